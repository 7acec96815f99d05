"""What is measured and how: the target models and the versioned protocols."""
from __future__ import annotations

from datetime import datetime
from typing import Any, Optional

from ninja import Path, Router
from pydantic import Field

from ..selectors import protocols
from .common import INT_MAX, SLUG, Out
from .errors import error_responses, not_found

router = Router()

PROTOCOL_SLUG = Path(..., pattern=SLUG, max_length=50, description="protocol slug")
PROTOCOL_VERSION = Path(..., ge=1, le=INT_MAX, description="protocol version")


def protocol_or_404(slug: str, version: int):
    protocol = protocols.get_protocol(f"{slug}@{version}")
    if protocol is None:
        raise not_found("version", f"no protocol {slug} v{version}: see /api/protocols")
    return protocol


class TargetRef(Out):
    slug: str = Field(description="the target's slug")
    name: str = Field(description="the target's name")


class TargetOut(Out):
    slug: str = Field(description="stable identifier")
    name: str = Field(description="display name")
    family: str = Field(description="model family, e.g. llama")
    hub_id: str = Field(description="model hub id, if any")
    revision: str = Field(description="model hub revision, if any")
    weights_sha256: str = Field(description="sha256 of the weights")
    vocab_size: int = Field(description="vocabulary size")
    hidden_size: int = Field(description="hidden size")
    num_layers: int = Field(description="number of layers")
    has_chat_template: bool = Field(description="whether the tokenizer has a chat template")
    created_at: datetime = Field(description="when it was added")


class ProtocolSummaryOut(Out):
    id: int = Field(description="database id")
    slug: str = Field(description="protocol slug; with version, identifies the protocol")
    version: int = Field(description="protocol version; a changed spec is a new version")
    label: str = Field(description='"slug vN"')
    ref: str = Field(description='"slug@version", as the protocol filters take it')
    title: str = Field(description="title")
    engine: str = Field(description="engine of record, e.g. vllm")
    hardware: str = Field(description="hardware class (the Celery queue), e.g. cpu, h100")
    sha256: str = Field(description="sha256 of canonical_json; every result carries it")
    created_at: datetime = Field(description="when it was created")
    target: TargetRef = Field(description="the target model it measures")
    tasks: list[str] = Field(description="task names")
    batch_sizes: list[int] = Field(description="batch sizes (requests in flight at once)")
    temperatures: list[float] = Field(description="sampling temperatures")
    ks: list[int] = Field(description="speculation budgets k")
    url: str = Field(description="the protocol's page")


class ProtocolOut(ProtocolSummaryOut):
    runs_count: int = Field(description="runs under this protocol")
    succeeded_runs: int = Field(description="succeeded runs under this protocol")
    spec: dict[str, Any] = Field(description="the full measurement spec")
    canonical_json: str = Field(description="the spec's canonical JSON (sha256 is its hash)")


class PromptSetUse(Out):
    task: str = Field(description="task name")
    prompt_set: str = Field(description="prompt set slug")
    categories: list[str] = Field(description="categories used (empty: all)")
    prompts: int = Field(description="prompts per task")
    spec_sha256: str = Field(description="sha256 of the prompt file the spec names")
    imported: bool = Field(description="whether the prompt set is imported here")
    name: Optional[str] = Field(description="prompt set name")
    format: Optional[str] = Field(description="spec-bench, mt-bench or humaneval")
    source_name: Optional[str] = Field(description="file the prompts were imported from")
    source_sha256: Optional[str] = Field(description="sha256 of that file")
    sha256_matches: bool = Field(description="whether the imported file is the one named")
    set_count: int = Field(description="prompts in the set")
    available: int = Field(description="prompts in the categories used")
    category_counts: dict[str, int] = Field(description="prompts per category")
    selection: str = Field(description="first (first N in file order) or stratified (in "
                                       "turn from each named category)")
    prompt_ids: dict[str, list[str]] = Field(description="the prompt ids measured, per "
                                                         "category")
    prompt_ids_error: str = Field(description="why the prompts cannot be chosen (empty: ok)")


class EngineFamilyMember(Out):
    slug: str = Field(description="protocol slug")
    version: int = Field(description="protocol version")
    label: str = Field(description='"slug vN"')
    ref: str = Field(description='"slug@version"')
    title: str = Field(description="title")
    engine: str = Field(description="engine, e.g. vllm")
    engine_version: Optional[str] = Field(description="the engine version it pins; null: the "
                                                      "deployment's default engine")
    recorded_engine_versions: list[str] = Field(description="engine versions its succeeded "
                                                            "runs recorded")
    engine_version_label: str = Field(description='the pinned version, or "default: " and '
                                                  "the recorded ones")
    queue: str = Field(description="the Celery queue its runs go to")
    drafters_measured: int = Field(description="drafters (not withdrawn or rejected) with a "
                                               "succeeded run under it")
    current: bool = Field(description="whether it is the protocol asked for")
    url: str = Field(description="its page")


class ProtocolDetailOut(Out):
    protocol: ProtocolSummaryOut = Field(description="the protocol")
    spec: dict[str, Any] = Field(description="the full measurement spec")
    canonical_json: str = Field(description="the spec's canonical JSON")
    sha256: str = Field(description="sha256 of canonical_json")
    tasks: list[PromptSetUse] = Field(description="each task's prompt set")
    multi_turn: Optional[str] = Field(description="multi-turn policy of the spec")
    multi_turn_policy: str = Field(description="what that policy means")
    metrics: list[tuple[str, str]] = Field(description="(metric, definition) pairs")
    runs: int = Field(description="runs under this protocol")
    succeeded_runs: int = Field(description="succeeded runs")
    cells_per_drafter_run: int = Field(description="cells in a drafter run's grid")
    cells_per_baseline_run: int = Field(description="cells in the baseline run's grid")
    baseline_mode: str = Field(description="paired (each drafter run measures its own "
                                           "baseline) or shared")
    baseline_rule: str = Field(description="which baseline cells a speedup divides by")
    pinned_rule: str = Field(description="what happens to stored speedups when a shared "
                                         "baseline is re-measured")
    repetitions: int = Field(description="passes over the prompts per cell")
    max_drift: float = Field(description="a paired run whose baseline passes drift more is "
                                         "flagged")
    interval_method: str = Field(description="how the 95% intervals are computed")
    aggregate_interval_method: str = Field(description="intervals over several cells")
    engine_version: Optional[str] = Field(description="the engine version it pins; null: the "
                                                      "deployment's default engine")
    queue: str = Field(description="the Celery queue its runs go to")
    engine_family: list[EngineFamilyMember] = Field(
        description="the protocol versions that differ from it only by engine version "
                    "(same family hash), itself included")


@router.get("/targets", response=list[TargetOut], tags=["reads"], summary="Target models")
def list_targets(request):
    return protocols.target_list()


@router.get("/protocols", response=list[ProtocolOut], tags=["reads"],
            summary="Protocols, with their canonical spec JSON and sha256")
def list_protocols(request):
    return protocols.protocol_list_with_specs()


@router.get("/protocols/{slug}/{version}",
            response={200: ProtocolDetailOut, **error_responses(404)}, tags=["reads"],
            summary="One protocol: spec, prompt sets, metric definitions")
def get_protocol(request, slug: str = PROTOCOL_SLUG, version: int = PROTOCOL_VERSION):
    return protocols.protocol_detail(protocol_or_404(slug, version))
