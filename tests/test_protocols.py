import pytest
from django.db import IntegrityError, transaction

from leaderboard.models import Protocol, ProtocolImmutableError, Result, Run, Target
from worker.protocol import ProtocolSpec, TaskSpec


def make_spec(**changes):
    base = dict(slug="p", version=1, target="t", target_sha256="0" * 64, engine="vllm",
                hardware="cpu", tasks=(TaskSpec("chat", "mt-bench", "a" * 64, 4),),
                batch_sizes=(1, 4), ks=(2,))
    base.update(changes)
    return ProtocolSpec(**base)


@pytest.fixture
def target(db):
    return Target.objects.create(slug="t", name="T", weights_sha256="0" * 64, vocab_size=10,
                                 hidden_size=8, num_layers=2)


def test_protocol_hash_is_stable_and_changes_with_any_field():
    assert make_spec().sha256() == make_spec().sha256()
    assert make_spec().sha256() == ProtocolSpec.from_dict(make_spec().to_dict()).sha256()
    others = [make_spec(batch_sizes=(1, 2)), make_spec(max_new_tokens=64), make_spec(ks=(2, 4)),
              make_spec(temperatures=(0.0, 1.0)), make_spec(hardware="h100"),
              make_spec(tasks=(TaskSpec("chat", "mt-bench", "b" * 64, 4),))]
    assert len({s.sha256() for s in others} | {make_spec().sha256()}) == len(others) + 1


def test_invalid_protocol_is_refused_with_reasons():
    with pytest.raises(ValueError, match="batch sizes must be positive"):
        make_spec(batch_sizes=(0,))


def test_protocol_without_results_can_be_edited(target):
    p = Protocol.objects.create(target=target, spec=make_spec().to_dict())
    first = p.sha256
    p.spec = make_spec(max_new_tokens=32).to_dict()
    p.save()
    assert p.sha256 != first


def test_a_protocol_builds_its_typed_spec_once_per_row_object(target):
    created = Protocol.objects.create(target=target, spec=make_spec())
    p = Protocol.objects.get(pk=created.pk)
    assert p.spec is p.spec and p.spec == make_spec()
    # stored as before: the same JSON in the column "spec", the same hash
    assert Protocol._meta.get_field("spec_json").column == "spec"
    assert p.spec_json == make_spec().to_dict() and p.sha256 == make_spec().sha256()
    # a new spec (assigned, or read again from the database) is built again, once
    p.spec = make_spec(max_new_tokens=32)
    assert p.spec.max_new_tokens == 32 and p.spec is p.spec
    p.refresh_from_db()
    assert p.spec.max_new_tokens == 128 and p.spec is p.spec


def add_result(protocol):
    run = Run.objects.create(protocol=protocol, hardware="cpu", state=Run.SUCCEEDED)
    return Result.objects.create(run=run, task="chat", batch_size=1, temperature=0.0, k=0,
                                 requests=1, generated_tokens=10, wall_seconds=1.0,
                                 output_throughput=10.0)


def test_protocol_with_results_is_immutable_and_a_new_version_is_made(target):
    p = Protocol.objects.create(target=target, spec=make_spec().to_dict())
    add_result(p)
    p.spec = make_spec(max_new_tokens=32).to_dict()
    with pytest.raises(ProtocolImmutableError, match="create version 2"):
        p.save()
    p.refresh_from_db()
    assert p.spec.max_new_tokens == 128
    v2 = p.new_version(max_new_tokens=32)
    assert (v2.slug, v2.version, v2.spec.max_new_tokens) == ("p", 2, 32)
    assert v2.sha256 != p.sha256


def test_result_cell_is_unique_in_the_database(target):
    p = Protocol.objects.create(target=target, spec=make_spec().to_dict())
    first = add_result(p)
    with pytest.raises(IntegrityError), transaction.atomic():
        Result.objects.create(run=first.run, task="chat", batch_size=1, temperature=0.0, k=0,
                              requests=1, generated_tokens=10, wall_seconds=1.0)
    assert Result.objects.filter(run=first.run).count() == 1


def test_protocol_cells_cover_the_grid():
    spec = make_spec(batch_sizes=(1, 4), ks=(2, 4), temperatures=(0.0, 1.0))
    assert len(spec.cells(with_drafter=True)) == 1 * 2 * 2 * 2
    assert {c.k for c in spec.cells(with_drafter=False)} == {0}


# ----------------------------------------------------------------------- protocol v2

V1_DICT = {
    "slug": "demo-cpu", "version": 1, "target": "smollm2", "target_sha256": "0" * 64,
    "engine": "vllm", "hardware": "cpu",
    "tasks": [{"task": "chat", "prompt_set": "mt-bench", "prompt_set_sha256": "a" * 64,
               "prompts": 16, "categories": ["writing", "roleplay"]}],
    "temperatures": [0.0], "max_new_tokens": 128, "seed": 0, "batch_sizes": [1, 4, 8],
    "ks": [2, 4], "warmup_requests": 2, "repetitions": 1, "chat_template": True,
    "multi_turn": "first_turn", "engine_args": {},
}


def test_a_v1_protocol_keeps_its_hash_and_reads_as_shared_first():
    import hashlib

    from worker.protocol import canonical_json

    spec = ProtocolSpec.from_dict(V1_DICT)
    assert spec.baseline == "shared" and spec.tasks[0].selection == "first"
    assert spec.to_dict() == V1_DICT
    assert spec.sha256() == hashlib.sha256(canonical_json(V1_DICT).encode()).hexdigest()
    assert ProtocolSpec.from_dict(spec.to_dict()).sha256() == spec.sha256()


def test_paired_and_stratified_change_the_hash_and_round_trip():
    shared = make_spec(baseline="shared")
    paired = make_spec(baseline="paired")
    assert make_spec().baseline == "paired"
    assert paired.sha256() != shared.sha256()
    assert make_spec(max_drift=0.1).sha256() != paired.sha256()
    assert "baseline" not in shared.to_dict() and "max_drift" not in shared.to_dict()
    assert paired.to_dict()["baseline"] == "paired" and paired.to_dict()["max_drift"] == 0.05
    strat = make_spec(tasks=(TaskSpec("chat", "mt-bench", "a" * 64, 4, ("a", "b"),
                                      "stratified"),))
    first = make_spec(tasks=(TaskSpec("chat", "mt-bench", "a" * 64, 4, ("a", "b")),))
    assert strat.sha256() != first.sha256()
    for spec in (shared, paired, strat, first):
        again = ProtocolSpec.from_dict(spec.to_dict())
        assert again == spec and again.sha256() == spec.sha256()


def test_new_values_are_validated():
    with pytest.raises(ValueError, match="baseline must be one of paired, shared"):
        make_spec(baseline="nearby")
    with pytest.raises(ValueError, match="max_drift"):
        make_spec(max_drift=0)
    with pytest.raises(ValueError, match="selection must be one of first, stratified"):
        TaskSpec("chat", "mt-bench", "a" * 64, 4, (), "random")


def test_a_task_that_cannot_fill_the_largest_batch_is_refused():
    with pytest.raises(ValueError, match="'chat' has 4 prompts, fewer than the largest "
                                         "batch size 8"):
        make_spec(batch_sizes=(1, 8))
    with pytest.raises(ValueError, match="fewer than the largest batch size"):
        ProtocolSpec.from_dict({**V1_DICT, "tasks": [{**V1_DICT["tasks"][0], "prompts": 4}]})


def test_run_cells_of_a_paired_drafter_include_its_baseline_cells():
    paired = make_spec(ks=(2, 4))
    shared = make_spec(ks=(2, 4), baseline="shared")
    assert paired.run_cells("baseline") == paired.cells(with_drafter=False)
    assert shared.run_cells("ngram") == shared.cells(with_drafter=True)
    cells = paired.run_cells("ngram")
    assert sorted(cells) == sorted(paired.cells(with_drafter=False)
                                   + paired.cells(with_drafter=True))
    assert [(c.batch_size, c.k) for c in cells] == [(1, 0), (1, 2), (1, 4),
                                                    (4, 0), (4, 2), (4, 4)]


class P:
    def __init__(self, external_id, category):
        self.external_id, self.category = external_id, category


MT_BENCH_SHAPED = [P(str(81 + i), cat) for i, cat in enumerate(
    c for c in ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem",
                "humanities") for _ in range(10))]


def test_stratified_selection_takes_every_named_category_in_turn():
    from worker.prompts import select_task_prompts

    cats = ("writing", "roleplay", "humanities", "stem")
    chosen = select_task_prompts(MT_BENCH_SHAPED, cats, 8, "stratified")
    assert [p.category for p in chosen] == list(cats) * 2
    assert [p.external_id for p in chosen][:4] == ["81", "91", "151", "141"]
    first = select_task_prompts(MT_BENCH_SHAPED, cats, 8, "first")
    assert {p.category for p in first} == {"writing"}
    # No categories named: order of first appearance; a category that runs out is skipped.
    small = [P("1", "a"), P("2", "b"), P("3", "b"), P("4", "b"), P("5", "c")]
    assert [p.external_id for p in select_task_prompts(small, (), 5, "stratified")] == \
        ["1", "2", "5", "3", "4"]
    with pytest.raises(ValueError, match="needs 6 prompts"):
        select_task_prompts(small, (), 6, "stratified")


# ----------------------------------------------------------------------- protocol v3

V3_CHANGES = dict(target_half_width=0.05, max_repetitions=8, cell_time_budget_s=150.0,
                  max_loaded_remeasures=3, prompts_by_batch_size={1: 4})


def test_v3_keys_are_left_out_when_unset_so_older_hashes_do_not_change():
    from worker.protocol import V3_KEYS

    v2 = make_spec(tasks=(TaskSpec("chat", "mt-bench", "a" * 64, 8, ("a", "b"),
                                   "stratified"),), batch_sizes=(1, 4, 8), repetitions=3)
    assert not set(V3_KEYS) & set(v2.to_dict())
    assert not set(V3_KEYS) & set(ProtocolSpec.from_dict(V1_DICT).to_dict())
    # A stored v2 dict reads back to the same hash, with the v3 defaults.
    again = ProtocolSpec.from_dict(v2.to_dict())
    assert again.sha256() == v2.sha256() and not again.adaptive
    assert again.loaded_remeasure_limit == 2 and again.cell_prompts("chat", 1) == 8


@pytest.mark.parametrize("key", sorted(V3_CHANGES))
def test_each_v3_key_changes_the_hash_and_round_trips(key):
    base = make_spec(tasks=(TaskSpec("chat", "mt-bench", "a" * 64, 8),), repetitions=2,
                     max_repetitions=8 if key == "target_half_width" else None)
    spec = make_spec(**{**base.__dict__, key: V3_CHANGES[key]})
    assert spec.sha256() != base.sha256()
    data = spec.to_dict()
    assert key in data
    again = ProtocolSpec.from_dict(data)
    assert again == spec and again.sha256() == spec.sha256()
    # what a protocol row stores is JSON: keys of prompts_by_batch_size are strings there
    import json

    assert ProtocolSpec.from_dict(json.loads(json.dumps(data))) == spec


def test_prompts_by_batch_size_gives_a_batch_size_the_first_n_prompts():
    spec = make_spec(tasks=(TaskSpec("chat", "mt-bench", "a" * 64, 16),), batch_sizes=(1, 4),
                     prompts_by_batch_size={1: 4})
    assert spec.cell_prompts("chat", 1) == 4 and spec.cell_prompts(spec.tasks[0], 4) == 16
    assert make_spec(prompts_by_batch_size={1: 40}).cell_prompts("chat", 1) == 4  # all it has
    with pytest.raises(ValueError, match="2 prompts at batch size 4"):
        make_spec(prompts_by_batch_size={4: 2})
    with pytest.raises(ValueError, match="names batch size 8"):
        make_spec(prompts_by_batch_size={8: 8})


def test_v3_values_are_validated():
    with pytest.raises(ValueError, match="needs max_repetitions or cell_time_budget_s"):
        make_spec(target_half_width=0.05)
    with pytest.raises(ValueError, match="target_half_width must be a fraction"):
        make_spec(target_half_width=1.5, max_repetitions=4)
    with pytest.raises(ValueError, match="max_repetitions must be at least repetitions"):
        make_spec(repetitions=3, max_repetitions=2)
    with pytest.raises(ValueError, match="cell_time_budget_s must be positive"):
        make_spec(cell_time_budget_s=0)
    with pytest.raises(ValueError, match="max_loaded_remeasures"):
        make_spec(max_loaded_remeasures=-1)


def test_engine_version_is_left_out_when_unset_and_pins_a_queue_when_set():
    plain = make_spec()
    assert "engine_version" not in plain.to_dict()
    assert plain.queue == "cpu"
    pinned = plain.with_engine_version("0.31.0", version=2)
    assert pinned.to_dict()["engine_version"] == "0.31.0"
    assert ProtocolSpec.from_dict(pinned.to_dict()) == pinned
    assert pinned.sha256() != plain.sha256()
    assert pinned.queue == "cpu.vllm-0.31.0"
    assert pinned.with_engine_version("0.30.0", version=3).queue == "cpu.vllm-0.30.0"


def test_the_family_hash_ignores_only_the_version_and_the_engine_version():
    plain = make_spec()
    assert plain.with_engine_version("0.31.0", version=7).family_sha256() == plain.family_sha256()
    for other in (make_spec(max_new_tokens=64), make_spec(ks=(2, 4)), make_spec(hardware="h100"),
                  make_spec(engine="sglang"), make_spec(slug="q")):
        assert other.family_sha256() != plain.family_sha256()


@pytest.mark.parametrize("bad", ["", "latest", "0.31", "0.31.0; rm", "0.31.0/x", "v0.31.0"])
def test_an_engine_version_must_be_a_release_number(bad):
    if bad == "0.31":   # two parts are a release too
        assert make_spec(engine_version=bad).queue == "cpu.vllm-0.31"
        return
    with pytest.raises(ValueError, match="engine_version"):
        make_spec(engine_version=bad)


# ----------------------------------------------------------------------- protocol v4

def test_engine_starts_is_left_out_when_unset_changes_the_hash_and_round_trips():
    plain = make_spec(repetitions=2)
    assert "engine_starts" not in plain.to_dict() and plain.starts == 1
    assert plain.per_start() is plain
    split = make_spec(repetitions=2, engine_starts=2)
    assert split.to_dict()["engine_starts"] == 2 and split.starts == 2
    assert split.sha256() != plain.sha256()
    assert ProtocolSpec.from_dict(split.to_dict()) == split
    # a version derived for another engine keeps its starts (the family hash includes them)
    assert split.with_engine_version("0.31.0", version=5).engine_starts == 2
    assert split.family_sha256() != plain.family_sha256()


def test_engine_starts_are_validated():
    with pytest.raises(ValueError, match="engine_starts must be a positive integer"):
        make_spec(engine_starts=0)
    with pytest.raises(ValueError, match="engine_starts must be a positive integer"):
        make_spec(engine_starts=True)
    with pytest.raises(ValueError, match=r"repetitions \(2\) must be at least engine_starts "
                                         r"\(3\)"):
        make_spec(repetitions=2, engine_starts=3)


@pytest.mark.parametrize("limits, starts, expected", [
    # (repetitions, max_repetitions, budget) split over the starts, rounded up
    ((2, 4, 150.0), 2, (1, 2, 75.0)),
    ((3, 4, 90.0), 2, (2, 2, 45.0)),
    ((3, 7, None), 3, (1, 3, None)),
    ((4, None, 100.0), 4, (1, None, 25.0)),
])
def test_per_start_splits_the_pass_limits_between_the_starts(limits, starts, expected):
    repetitions, most, budget = limits
    spec = make_spec(repetitions=repetitions, max_repetitions=most, cell_time_budget_s=budget,
                     target_half_width=0.05 if (most or budget) else None,
                     engine_starts=starts)
    one = spec.per_start()
    assert (one.repetitions, one.max_repetitions, one.cell_time_budget_s) == expected
    assert one.starts == 1 and one.target_half_width == spec.target_half_width
    # together the starts measure at least the protocol's minimum
    assert one.repetitions * starts >= spec.repetitions
