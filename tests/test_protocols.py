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
    others = [make_spec(batch_sizes=(1, 8)), make_spec(max_new_tokens=64), make_spec(ks=(2, 4)),
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
    assert p.spec["max_new_tokens"] == 128
    v2 = p.new_version(max_new_tokens=32)
    assert (v2.slug, v2.version, v2.spec["max_new_tokens"]) == ("p", 2, 32)
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
