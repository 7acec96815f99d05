"""The order a run measures its cells in (worker.measure.measurement_groups_for): the first
comparison first, then the rest in grid order; pairing and resume semantics unchanged. On
the demo protocol that `make run` creates (its spec from leaderboard/services/setup.py)."""
from types import SimpleNamespace

import pytest

from leaderboard.services.setup import (DEMO_VERSION, demo_protocol_spec, demo_protocol_spec_v1,
                                       demo_protocol_spec_v2)
from worker.measure import (DrafterSpec, MeasureJob, first_comparison, measurement_groups,
                            measurement_groups_for, measurement_order)


def demo_spec(version=DEMO_VERSION):
    """The current demo protocol (make run's) by default, or an older version."""
    target = SimpleNamespace(slug="smollm2-135m-instruct", weights_sha256="0" * 64)
    sets = {"mt-bench": SimpleNamespace(source_sha256="1" * 64),
            "humaneval": SimpleNamespace(source_sha256="2" * 64)}
    make = {1: demo_protocol_spec_v1, 2: demo_protocol_spec_v2,
            DEMO_VERSION: demo_protocol_spec}[version]
    return make(target, sets)


def group_key(group):
    keys = {(c.task, c.temperature, c.batch_size) for c in group}
    assert len(keys) == 1, group   # a group shares task, temperature and batch size
    return keys.pop()


def test_the_demo_run_measures_chat_at_its_largest_batch_size_first_then_grid_order():
    spec = demo_spec()
    assert spec.baseline == "paired" and spec.repetitions >= 2
    groups = measurement_groups_for(spec, "ngram")
    first = groups[0]
    assert group_key(first) == first_comparison(spec) == ("chat", 0.0, max(spec.batch_sizes))
    # a complete comparison: the baseline cell first, then every k, all in one group
    assert [c.k for c in first] == [0, *spec.ks]
    # the rest follow in grid order: task, temperature, batch size
    tasks = [t.task for t in spec.tasks]
    rest = [group_key(g) for g in groups[1:]]
    assert rest == sorted(rest, key=lambda g: (tasks.index(g[0]), g[1], g[2]))
    assert first_comparison(spec) not in rest
    # every cell of the run exactly once, every group baseline first
    order = measurement_order(MeasureJob(spec, "", DrafterSpec("ngram"), {}))
    assert sorted(order) == sorted(spec.run_cells("ngram")) and len(set(order)) == len(order)
    assert all(g[0].k == 0 for g in groups)


def test_the_first_group_has_the_shortest_passes_of_its_task():
    """A pass sends a task's prompts b at a time: about ceil(prompts / b) request latencies,
    so the largest batch size has the fewest rounds of requests."""
    spec = demo_spec()
    rounds = {group_key(g): -(-spec.cell_prompts(g[0].task, g[0].batch_size)
                              // g[0].batch_size)
              for g in measurement_groups_for(spec, "ngram")}
    chat = {key: n for key, n in rounds.items() if key[0] == "chat"}
    assert rounds[first_comparison(spec)] == min(chat.values()) < max(chat.values())


def test_a_resumed_run_measures_a_group_with_a_missing_cell_again_whole():
    spec = demo_spec()
    everything = frozenset(c.key for c in spec.run_cells("ngram"))
    groups = measurement_groups_for(spec, "ngram")
    assert measurement_groups_for(spec, "ngram", everything) == []
    # the first group done: the rest, in the same order
    done_first = frozenset(c.key for c in groups[0])
    assert measurement_groups_for(spec, "ngram", done_first) == groups[1:]
    # one drafter cell missing in a later group: that group again, whole (its baseline cell
    # too, so the cell divides by baseline passes measured beside it)
    later = groups[3]
    missing = later[-1]
    job = MeasureJob(spec, "", DrafterSpec("ngram"), {}, everything - {missing.key})
    assert measurement_groups(job) == [later]
    assert measurement_order(job) == later and later[0].k == 0


@pytest.mark.parametrize("method", ["baseline", "ngram"])
def test_unpaired_runs_go_k_by_k_with_the_first_comparisons_cell_first(method):
    spec = demo_spec(version=1)
    assert spec.baseline == "shared"
    cells = [c for [c] in measurement_groups_for(spec, method)]
    assert sorted(cells) == sorted(spec.run_cells(method))
    ks = [c.k for c in cells]
    assert ks == sorted(ks)          # one engine at a time: every cell of a k together
    for k in sorted(set(ks)):
        of_k = [c for c in cells if c.k == k]
        assert (of_k[0].task, of_k[0].temperature, of_k[0].batch_size) == \
            first_comparison(spec)
        grid = [c for c in spec.cells(with_drafter=method != "baseline") if c.k == k]
        assert of_k[1:] == [c for c in grid if c != of_k[0]]
