"""When does it pay? The protocol's analysis (bounds, best drafter per task and batch
size, crossover, Pareto, oracle combination) and the recommendation for a task mix."""
from __future__ import annotations

from typing import Optional

from ninja import Query, Router, Schema
from pydantic import Field

from .. import pays
from ..selectors import protocols
from .catalog import PROTOCOL_SLUG, PROTOCOL_VERSION, ProtocolSummaryOut, protocol_or_404
from .common import INT_MAX, PROTOCOL_REF, Out
from .errors import ApiError, error_responses, not_found, problem

router = Router()


class DrafterRefOut(Out):
    slug: str = Field(description="drafter slug")
    name: str = Field(description="drafter name")
    method: str = Field(description="drafter method")
    url: str = Field(description="the drafter's page")


class AnalysisRunOut(Out):
    drafter: DrafterRefOut = Field(description="the drafter")
    run_id: int = Field(description="its newest succeeded run, which the figures come from "
                                    "(with include_running, for a drafter without one, its "
                                    "run still measuring)")
    measuring: bool = Field(False, description="the run is still measuring: figures over "
                                               "the cells it has so far")
    has_records: bool = Field(description="whether the run has raw per-request records "
                                          "(needed for breakdown, bounds and costs)")
    baseline_run_id: Optional[int] = Field(description="the baseline run its speedups "
                                                       "divide by and its cost model is "
                                                       "fitted on")


class MatrixCellOut(Out):
    batch_size: int = Field(description="batch size")
    drafter: Optional[DrafterRefOut] = Field(description="the best drafter; null: the "
                                                         "baseline (no drafter beats it)")
    k: Optional[int] = Field(description="its speculation budget")
    speedup: float = Field(description="its measured speedup (1.0 for the baseline)")
    measuring: bool = Field(False, description="the best drafter's run is still measuring")
    best_drafter_speedup: Optional[float] = Field(description="the best drafter's measured "
                                                              "speedup, even below 1")


class MatrixRowOut(Out):
    task: str = Field(description="task")
    cells: list[Optional[MatrixCellOut]] = Field(description="one per batch size, in the "
                                                             "protocol's order")


class BatchBoundsOut(Out):
    batch_size: int = Field(description="batch size")
    measured_speedup: Optional[float] = Field(description="summed throughput over the "
                                                          "baseline's, all tasks")
    predicted_speedup: Optional[float] = Field(description="from tokens per step and the "
                                                           "measured costs, all tasks")
    oracle_speedup: Optional[float] = Field(description="every step proposes exactly the "
                                                        "tokens emitted, up to k, at no "
                                                        "draft cost")
    shares: Optional[dict[str, float]] = Field(description="share of the wall time per "
                                                           "phase (prefill, verification, "
                                                           "drafting_other; reference "
                                                           "traces: drafting, verification, "
                                                           "sampling, other)")


class CrossoverOut(Out):
    measured: Optional[int] = Field(description="smallest measured batch size whose "
                                                "speedup is below 1; null: never")
    interpolated: Optional[float] = Field(description="where the speedup crosses 1, "
                                                      "linear in log2 b between measured "
                                                      "batch sizes")


class CurveOut(Out):
    drafter: DrafterRefOut = Field(description="the drafter")
    k: int = Field(description="speculation budget")
    by_batch: list[BatchBoundsOut] = Field(description="speedups per batch size")
    crossover: CrossoverOut = Field(description="crossover batch size")
    mean_speedup: Optional[float] = Field(description="mean measured speedup over batch "
                                                      "sizes")


class ParetoOut(Out):
    drafter: DrafterRefOut = Field(description="the drafter")
    k: int = Field(description="speculation budget")
    cost: Optional[float] = Field(description="measured draft cost per step over the "
                                              "target's forward time t_fwd(b)")
    al: Optional[float] = Field(description="acceptance length from summed counts")
    frontier: bool = Field(description="not dominated (lower cost and higher AL)")


class CombineDrafterOut(Out):
    drafter: DrafterRefOut = Field(description="the drafter")
    tokens_per_step: Optional[float] = Field(description="its decode tokens per step on "
                                                         "the same requests")


class CombineOut(Out):
    task: str = Field(description="task")
    batch_size: int = Field(description="batch size")
    k: int = Field(description="speculation budget")
    requests: int = Field(description="requests every combined drafter has, with the "
                                      "baseline's output")
    tokens: int = Field(description="decode tokens of those requests")
    steps: int = Field(description="steps of the oracle combination")
    al_combine: float = Field(description="tokens / steps of the combination")
    speedup_bound: Optional[float] = Field(description="its speedup by the cost model, "
                                                       "without draft cost")
    drafters: list[CombineDrafterOut] = Field(description="each drafter on the same "
                                                          "requests")


class MapCurvePointOut(Out):
    draft_cost: float = Field(description="draft cost per step / t_fwd(b)")
    tokens_per_step: float = Field(description="tokens per step needed to break even")


class MapCurveOut(Out):
    batch_size: int = Field(description="batch size")
    k: int = Field(description="speculation budget")
    points: list[MapCurvePointOut] = Field(description="the break-even line (ends where it "
                                                       "reaches k + 1 tokens per step)")


class MapPointOut(Out):
    drafter: DrafterRefOut = Field(description="the drafter")
    task: str = Field(description="task")
    batch_size: int = Field(description="batch size")
    k: int = Field(description="speculation budget")
    draft_cost: float = Field(description="its fitted draft cost per step / t_fwd(b)")
    tokens_per_step: Optional[float] = Field(description="measured decode tokens per step")
    acceptance_length: Optional[float] = Field(description="measured AL")
    break_even_tokens_per_step: float = Field(description="what it needs to pay (its own "
                                                           "share of drafting steps)")
    break_even_acceptance_length: Optional[float] = Field(description="the AL it needs")
    map_speedup: float = Field(description="tokens per step / break-even (decode only)")
    drafting_share: float = Field(description="share of its decode steps that drafted")
    drafts_every_step: bool = Field(description="every step drafted k tokens")
    speedup: Optional[float] = Field(description="measured speedup of the cell")
    speedup_low: Optional[float] = Field(description="its 95% interval, low")
    speedup_high: Optional[float] = Field(description="its 95% interval, high")


class MapTaskOut(Out):
    task: str = Field(description="task")
    curves: list[MapCurveOut] = Field(description="break-even per batch size and k")
    cost_model: dict = Field(description="the cost model the curves come from")
    points: list[MapPointOut] = Field(description="the measured cells on the map")


class BreakEvenMapOut(Out):
    baseline_run_id: Optional[int] = Field(description="the baseline run the curves' cost "
                                                       "model is fitted on")
    tasks: list[MapTaskOut] = Field(description="one map per task")


class OperatingPointOut(Out):
    batch_size: int = Field(description="batch size")
    per_user_speed: Optional[float] = Field(description="1 / mean TPOT (tokens / s)")
    output_throughput: Optional[float] = Field(description="output tokens / s of the cell")
    output_throughput_low: Optional[float] = Field(description="its 95% interval, low")
    output_throughput_high: Optional[float] = Field(description="its 95% interval, high")
    speedup: Optional[float] = Field(description="measured speedup (null: baseline)")


class OperatingLineOut(Out):
    drafter: Optional[DrafterRefOut] = Field(description="the drafter; null: a baseline")
    k: int = Field(description="speculation budget (0: baseline)")
    task: str = Field(description="task")
    run_id: Optional[int] = Field(description="the baseline run (baseline lines)")
    points: list[OperatingPointOut] = Field(description="by batch size")


class OperatingOut(Out):
    drafters: list[OperatingLineOut] = Field(description="per drafter, k and task")
    baselines: list[OperatingLineOut] = Field(description="per baseline run and task")


class ProtocolAnalysisOut(Out):
    protocol: ProtocolSummaryOut = Field(description="the protocol")
    temperature: float = Field(description="the temperature of every figure here")
    tasks: list[str] = Field(description="tasks")
    batch_sizes: list[int] = Field(description="batch sizes")
    ks: list[int] = Field(description="speculation budgets")
    drafters: list[AnalysisRunOut] = Field(description="the runs analysed")
    matrix: list[MatrixRowOut] = Field(description="best drafter per task and batch size")
    curves: list[CurveOut] = Field(description="per (drafter, k): speedups by batch size "
                                               "and crossover")
    pareto: list[ParetoOut] = Field(description="acceptance against draft cost")
    combine: list[CombineOut] = Field(description="oracle combination across drafters "
                                                  "(temperature 0)")
    map: BreakEvenMapOut = Field(description="the break-even map per task, with the "
                                             "measured cells on it")
    operating: OperatingOut = Field(description="throughput against per-user speed")
    definitions: list[tuple[str, str]] = Field(description="(name, definition) of each "
                                                           "figure")
    has_records: bool = Field(description="whether any run has raw records")


class TaskWeightOut(Out):
    task: str = Field(description="task")
    weight: float = Field(description="normalised weight")


class TaskOptionOut(Out):
    task: str = Field(description="task")
    throughput: Optional[float] = Field(description="measured output tokens / s")
    speedup: Optional[float] = Field(description="over the baseline's cell")


class OptionOut(Out):
    drafter: Optional[DrafterRefOut] = Field(description="the drafter; null: the baseline")
    k: int = Field(description="speculation budget (0 for the baseline)")
    throughput: float = Field(description="expected throughput of the mix: 1 / sum(w_t / "
                                          "throughput_t)")
    speedup: Optional[float] = Field(description="over the baseline's mix throughput")
    speedup_min: Optional[float] = Field(description="smallest per-task speedup")
    speedup_max: Optional[float] = Field(description="largest per-task speedup")
    per_task: list[TaskOptionOut] = Field(description="per task of the mix")


class RecommendOut(Out):
    protocol: ProtocolSummaryOut = Field(description="the protocol")
    temperature: float = Field(description="temperature of the cells used")
    requested_batch_size: int = Field(description="the batch size asked for")
    batch_size: Optional[int] = Field(description="the nearest measured batch size used")
    mix: list[TaskWeightOut] = Field(description="the task mix, normalised")
    best: Optional[OptionOut] = Field(description="the option with the highest throughput")
    options: list[OptionOut] = Field(description="every option, best first")


class RecommendQuery(Schema):
    protocol: str = Field(pattern=PROTOCOL_REF, max_length=80,
                          description='protocol slug, or "slug@version"')
    batch_size: int = Field(ge=1, le=INT_MAX, description="requests in flight at once (the "
                                                          "nearest measured one is used)")
    mix: str = Field("", max_length=2000, description='task weights, e.g. '
                     '"chat:0.5,code:0.5" (normalised; empty: every task equally)')
    temperature: Optional[float] = Field(None, ge=0, le=1000, allow_inf_nan=False,
                                         description="one of the protocol's temperatures "
                                                     "(default: its first)")


def _temperature(protocol, temperature):
    temps = list(protocol.spec.temperatures)
    if temperature is not None and float(temperature) not in temps:
        raise ApiError(422, problem("(query)", "temperature", "the protocol measures "
                                    "temperatures " + ", ".join(f"{t:g}" for t in temps)))
    return temperature


@router.get("/protocols/{slug}/{version}/analysis",
            response={200: ProtocolAnalysisOut, **error_responses(404, 422)}, tags=["reads"],
            url_name="protocol_analysis",
            summary="When does it pay? Bounds, best drafter per task and batch size, "
                    "crossover, Pareto, oracle combination")
def protocol_analysis(request, slug: str = PROTOCOL_SLUG, version: int = PROTOCOL_VERSION,
                      temperature: Optional[float] = Query(
                          None, ge=0, le=1000, allow_inf_nan=False,
                          description="one of the protocol's temperatures (default: its "
                                      "first)"),
                      include_running: bool = Query(
                          False, description="also a drafter whose only run is still "
                                             "measuring, over the cells it has (marked "
                                             "measuring), as the page shows; default: "
                                             "succeeded runs only")):
    """The figures of the protocol's "When does it pay?" page (definitions in
    `definitions` and in worker/analysis/__init__.py)."""
    protocol = protocol_or_404(slug, version)
    return pays.protocol_pays(protocol, _temperature(protocol, temperature),
                              include_running=include_running)


@router.get("/recommend", response={200: RecommendOut, **error_responses(404, 422)},
            tags=["reads"], summary="The drafter and k with the highest measured throughput "
                                    "for a task mix and batch size")
def recommend(request, q: Query[RecommendQuery]):
    """Per (drafter, k), the mix's throughput is the weighted harmonic mean of its cells'
    measured throughput (time per token adds up); the baseline is an option too."""
    protocol = protocols.get_protocol(q.protocol)
    if protocol is None:
        raise not_found("protocol", f"no protocol {q.protocol!r}: see /api/protocols")
    tasks = list(protocol.spec.task_names)
    try:
        mix = pays.parse_mix(q.mix, tasks)
    except ValueError as e:
        raise ApiError(422, problem("(query)", "mix", str(e))) from None
    return pays.recommendation(protocol, mix, q.batch_size,
                                    _temperature(protocol, q.temperature))
