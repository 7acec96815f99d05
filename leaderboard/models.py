"""SpecBoard's data model: targets, immutable versioned protocols, prompt sets, drafters,
runs (one measurement) and results (one cell of a run's grid)."""
from __future__ import annotations

import hashlib

from django.conf import settings
from django.core.exceptions import ValidationError
from django.db import models
from django.utils import timezone

from worker import methods
from worker.prompts import select_task_prompts
from worker.protocol import ProtocolSpec, canonical_json, engine_queue


class Target(models.Model):
    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=200)
    family = models.CharField(max_length=50, default="llama")
    path = models.CharField(max_length=500, blank=True, help_text="local checkpoint folder")
    hub_id = models.CharField(max_length=200, blank=True)
    revision = models.CharField(max_length=100, blank=True)
    weights_sha256 = models.CharField(max_length=64)
    vocab_size = models.PositiveIntegerField()
    hidden_size = models.PositiveIntegerField()
    num_layers = models.PositiveIntegerField()
    has_chat_template = models.BooleanField(default=False)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return self.name


class PromptSet(models.Model):
    FORMATS = [("spec-bench", "Spec-Bench"), ("mt-bench", "MT-Bench"), ("humaneval", "HumanEval")]
    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=200)
    format = models.CharField(max_length=20, choices=FORMATS)
    source_name = models.CharField(max_length=300, help_text="file the prompts came from")
    source_sha256 = models.CharField(max_length=64, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)

    def __str__(self):
        return self.slug


class Prompt(models.Model):
    prompt_set = models.ForeignKey(PromptSet, on_delete=models.CASCADE, related_name="prompts")
    external_id = models.CharField(max_length=100)
    position = models.PositiveIntegerField(help_text="order in the source file")
    category = models.CharField(max_length=50, db_index=True)
    turns = models.JSONField()
    reference = models.JSONField(null=True, blank=True)
    extra = models.JSONField(default=dict, blank=True)

    class Meta:
        ordering = ["prompt_set", "position"]
        constraints = [
            models.UniqueConstraint(fields=["prompt_set", "external_id"], name="unique_prompt_id"),
        ]

    def __str__(self):
        return f"{self.prompt_set.slug}#{self.external_id}"


class ProtocolImmutableError(Exception):
    """A protocol that has results is never edited: make a new version instead."""


class Protocol(models.Model):
    slug = models.SlugField()
    version = models.PositiveIntegerField(default=1)
    title = models.CharField(max_length=200, blank=True)
    target = models.ForeignKey(Target, on_delete=models.PROTECT, related_name="protocols")
    engine = models.CharField(max_length=50, default="vllm")
    hardware = models.CharField(max_length=50, help_text="hardware class = Celery queue")
    # The stored canonical spec (the column keeps its name "spec"); code reads the typed
    # `spec` below, built from it once.
    spec_json = models.JSONField(db_column="spec", verbose_name="spec",
                                 help_text="the canonical measurement spec")
    sha256 = models.CharField(max_length=64, editable=False, db_index=True)
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["slug", "version"], name="unique_protocol_version"),
        ]

    def __str__(self):
        return f"{self.slug} v{self.version}"

    @property
    def spec(self) -> ProtocolSpec:
        """The typed spec, built from the stored JSON once per instance (again only when
        `spec_json` is replaced: assigned, refreshed from the database)."""
        built = self.__dict__.get("_spec_built")
        if built is None or built[0] is not self.spec_json:
            built = self.__dict__["_spec_built"] = (self.spec_json,
                                                    ProtocolSpec.from_dict(self.spec_json))
        return built[1]

    @spec.setter
    def spec(self, value: ProtocolSpec | dict):
        """Set the spec from a ProtocolSpec or its dict (Protocol(spec=...) works too)."""
        self.spec_json = value.to_dict() if isinstance(value, ProtocolSpec) else dict(value)

    @property
    def canonical_json(self):
        return canonical_json(self.spec_json)

    def has_results(self):
        return self.pk is not None and Result.objects.filter(run__protocol_id=self.pk).exists()

    def prompts_of_task(self, task, prompts=None) -> list:
        """The prompts a task of this protocol measures (worker.prompts.select_task_prompts
        over the task's prompt set in file order: the run service and the protocol page
        both call this). ValueError when the prompt set cannot give them."""
        if prompts is None:
            prompts = Prompt.objects.filter(prompt_set__slug=task.prompt_set)
        return select_task_prompts(list(prompts.order_by("position")), task.categories,
                                   task.prompts, task.selection)

    def task_prompts(self) -> dict:
        """{task: {"selection", "categories": {category: [prompt ids]}, "error"}} for every
        task, categories in the order the task names them (an empty list when a named
        category gives none); "error" says why a task's prompts cannot be chosen."""
        out = {}
        for task in self.spec.tasks:
            entry = {"selection": task.selection, "prompts": task.prompts,
                     "categories": {c: [] for c in task.categories}, "error": ""}
            try:
                for p in self.prompts_of_task(task):
                    entry["categories"].setdefault(p.category, []).append(p.external_id)
            except ValueError as e:
                entry["error"] = str(e)
            out[task.task] = entry
        return out

    def check_prompts(self, spec: ProtocolSpec):
        """Refuse a protocol whose imported prompt sets cannot fill its tasks (each task
        needs its number of prompts, at least the largest batch size, from its categories).
        Prompt sets not imported yet are checked when a run is built."""
        problems = []
        for task in spec.tasks:
            prompts = Prompt.objects.filter(prompt_set__slug=task.prompt_set)
            if not prompts.exists():
                continue
            try:
                self.prompts_of_task(task, prompts)
            except ValueError as e:
                problems.append(f"task {task.task!r}: {e} (the largest batch size is "
                                f"{max(spec.batch_sizes)})")
        if problems:
            raise ValueError("invalid protocol: " + "; ".join(problems))

    def clean(self):
        try:
            self.check_prompts(self.spec)
        except (ValueError, TypeError, KeyError) as e:
            raise ValidationError({"spec_json": str(e)}) from None

    def save(self, *args, **kwargs):
        spec = self.spec  # validates
        self.check_prompts(spec)
        self.spec_json = spec.to_dict()   # canonical; the typed spec stays the one built
        self.__dict__["_spec_built"] = (self.spec_json, spec)
        self.slug, self.version = spec.slug, spec.version
        self.engine, self.hardware = spec.engine, spec.hardware
        new_hash = spec.sha256()
        if self.pk is not None and new_hash != self.sha256 and self.has_results():
            raise ProtocolImmutableError(
                f"protocol {self.slug} v{self.version} has results and cannot be edited; "
                f"create version {self.next_version()} instead (Protocol.new_version)")
        self.sha256 = new_hash
        super().save(*args, **kwargs)

    def next_version(self):
        latest = Protocol.objects.filter(slug=self.slug).aggregate(v=models.Max("version"))["v"]
        return (latest or 0) + 1

    def new_version(self, **changes):
        """A copy of this protocol with `changes` applied to its spec, saved as the next version."""
        spec = dict(self.spec_json, **changes)
        spec["version"] = self.next_version()
        return Protocol.objects.create(title=self.title, target=self.target, spec=spec)


class Drafter(models.Model):
    METHODS = methods.DRAFTER_CHOICES  # (method, label), from the registry in worker/methods
    REVIEW_STATES = [("pending", "pending"), ("approved", "approved"),
                     ("rejected", "rejected"), ("withdrawn", "withdrawn")]

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                              on_delete=models.SET_NULL, related_name="drafters")
    slug = models.SlugField(unique=True)
    name = models.CharField(max_length=200)
    method = models.CharField(max_length=20, choices=METHODS)
    target = models.ForeignKey(Target, on_delete=models.PROTECT, related_name="drafters")
    params = models.JSONField(default=dict, blank=True, help_text="method parameters")
    description = models.TextField(blank=True)
    link = models.URLField(blank=True)
    licence = models.CharField(max_length=100, blank=True)
    content_sha256 = models.CharField(
        max_length=64, blank=True, db_index=True,
        help_text="hash of the tensors and config (worker.checkpoint content_sha256), or of "
                  "the method and params for a drafter without files")
    # The published format and what intake did to it: format, converted_from, notes,
    # verifier (worker/checkpoint/formats.py Intake.as_dict).
    intake = models.JSONField(default=dict, blank=True)
    claimed_acceptance_length = models.FloatField(null=True, blank=True)
    claimed_speedup = models.FloatField(null=True, blank=True)
    claimed_source = models.URLField(blank=True)
    review_state = models.CharField(max_length=20, choices=REVIEW_STATES, default="approved")
    trained_by_recipe = models.CharField(max_length=50, blank=True)
    # A baseline drafter trained here (leaderboard/services/training.py): on which data, seed, time.
    training_data = models.ForeignKey("TrainingDataset", null=True, blank=True,
                                      on_delete=models.SET_NULL, related_name="drafters")
    training_data_sha256 = models.CharField(max_length=64, blank=True)
    training_seed = models.IntegerField(null=True, blank=True)
    training_seconds = models.FloatField(null=True, blank=True)
    training_details = models.JSONField(default=dict, blank=True,
                                        help_text="steps, settings, first and final loss")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["name"]

    def __str__(self):
        return self.name


class Submission(models.Model):
    """One attempt to submit a drafter (an upload or a model-hub reference). The web request
    only stages the files and records it as *checking*; an intake worker (the task
    ``check_submission``, queue ``intake``: leaderboard/services/intake.py) checks and
    converts it out of the web process and ends it *accepted* (its drafter stored, its run
    queued), *refused* (its problems, by file and field; nothing else is kept) or *failed*
    (the site could not check it: the hub was unreachable, or a fault). Checking and refused
    attempts count toward the owner's daily limit (SPECBOARD_SUBMISSIONS_PER_DAY); an
    accepted one counts as its drafter."""
    CHECKING, ACCEPTED, REFUSED, FAILED = "checking", "accepted", "refused", "failed"
    STATES = [(s, s) for s in (CHECKING, ACCEPTED, REFUSED, FAILED)]
    FINISHED = (ACCEPTED, REFUSED, FAILED)

    owner = models.ForeignKey(settings.AUTH_USER_MODEL, null=True, blank=True,
                              on_delete=models.CASCADE, related_name="submissions")
    protocol = models.ForeignKey("Protocol", null=True, on_delete=models.SET_NULL,
                                 related_name="+")
    method = models.CharField(max_length=20)
    name = models.CharField(max_length=200)
    params = models.JSONField(default=dict, blank=True, help_text="checked method parameters")
    details = models.JSONField(default=dict, blank=True,
                               help_text="description, link, licence and claims, as submitted")
    hub_reference = models.CharField(max_length=300, blank=True,
                                     help_text="owner/name@revision, for a hub submission")
    # [name in the checkpoint, storage name, size] of each uploaded file, until checked.
    staged = models.JSONField(default=list, blank=True)
    state = models.CharField(max_length=10, choices=STATES, default=CHECKING, db_index=True)
    problems = models.JSONField(default=list, blank=True)
    drafter = models.ForeignKey(Drafter, null=True, blank=True, on_delete=models.SET_NULL,
                                related_name="submissions")
    attempts = models.PositiveIntegerField(default=0, help_text="checks started (a worker "
                                           "that died mid-check is replaced)")
    created_at = models.DateTimeField(auto_now_add=True, db_index=True)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        ordering = ["-created_at"]

    def __str__(self):
        return f"{self.name} ({self.method}), {self.state} {self.created_at:%Y-%m-%d %H:%M}"


class TrainingDataset(models.Model):
    """Conversations written by a target, shared by every training recipe; versioned and
    hashed like a prompt set. ``path`` is the JSON-lines file's name in the storage."""

    slug = models.SlugField()
    version = models.PositiveIntegerField(default=1)
    target = models.ForeignKey(Target, on_delete=models.PROTECT, related_name="training_datasets")
    sha256 = models.CharField(max_length=64, db_index=True)
    n = models.PositiveIntegerField(help_text="conversations")
    tokens = models.PositiveIntegerField(default=0)
    source = models.CharField(max_length=300, help_text="generated, or the prompts file's name")
    params = models.JSONField(default=dict, blank=True, help_text="generation settings, stats")
    path = models.CharField(max_length=500, help_text="file name in the storage")
    created_at = models.DateTimeField(auto_now_add=True)

    class Meta:
        ordering = ["slug", "-version"]
        constraints = [
            models.UniqueConstraint(fields=["slug", "version"], name="unique_training_dataset_version"),
        ]

    def __str__(self):
        return f"{self.slug} v{self.version}"


class DrafterFile(models.Model):
    drafter = models.ForeignKey(Drafter, on_delete=models.CASCADE, related_name="files")
    name = models.CharField(max_length=300, help_text="path inside the checkpoint folder")
    file = models.FileField(upload_to="drafters/%Y/%m/")
    size = models.BigIntegerField()
    sha256 = models.CharField(max_length=64)

    class Meta:
        constraints = [
            models.UniqueConstraint(fields=["drafter", "name"], name="unique_drafter_file"),
        ]


class Run(models.Model):
    QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED = (
        "queued", "running", "succeeded", "failed", "cancelled")
    STATES = [(s, s) for s in (QUEUED, RUNNING, SUCCEEDED, FAILED, CANCELLED)]
    FINISHED = (SUCCEEDED, FAILED, CANCELLED)

    drafter = models.ForeignKey(Drafter, null=True, blank=True, on_delete=models.CASCADE,
                                related_name="runs", help_text="empty for the baseline")
    protocol = models.ForeignKey(Protocol, on_delete=models.PROTECT, related_name="runs")
    hardware = models.CharField(max_length=50, db_index=True)
    # The Celery queue it is sent to: its protocol's (hardware class, engine, engine version),
    # ProtocolSpec.queue; the hardware class itself when the protocol pins no engine version.
    queue = models.CharField(max_length=100, db_index=True, default="")
    state = models.CharField(max_length=20, choices=STATES, default=QUEUED, db_index=True)
    cells_done = models.PositiveIntegerField(default=0)
    cells_total = models.PositiveIntegerField(default=0)
    eta_seconds = models.FloatField(null=True, blank=True)
    attempts = models.PositiveIntegerField(default=0)
    cancel_requested = models.BooleanField(default=False)
    worker_host = models.CharField(max_length=200, blank=True)
    engine_version = models.CharField(max_length=50, blank=True)
    versions = models.JSONField(default=dict, blank=True, help_text="vllm, torch, transformers")
    hardware_description = models.CharField(max_length=300, blank=True)
    engine_args = models.JSONField(default=dict, blank=True)
    error = models.TextField(blank=True)
    log_tail = models.TextField(blank=True)
    artifact = models.FileField(upload_to="runs/", blank=True)
    queued_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    # Paired protocols: (max - min) / mean of the run's baseline passes, the largest over its
    # baseline cells (worker.intervals.drift); flagged above the protocol's max_drift.
    drift = models.FloatField(null=True, blank=True)
    drift_flagged = models.BooleanField(default=False)

    class Meta:
        ordering = ["-queued_at"]
        indexes = [models.Index(fields=["hardware", "state", "queued_at"])]

    def __str__(self):
        who = self.drafter.name if self.drafter_id else "baseline"
        return f"run {self.pk}: {who} under {self.protocol}"

    def save(self, *args, **kwargs):
        """A run made without a queue gets its protocol's for its hardware class
        (engine_queue: the class itself unless the protocol pins an engine version)."""
        if not self.queue and self.protocol_id:
            self.queue = engine_queue(self.hardware, self.protocol.engine,
                                      self.protocol.spec.engine_version)
        super().save(*args, **kwargs)

    @property
    def is_baseline(self):
        return self.drafter_id is None

    @property
    def progress(self):
        return self.cells_done / self.cells_total if self.cells_total else 0.0


class EngineWorker(models.Model):
    """A measurement worker that announced itself when it started (leaderboard/tasks.py,
    services/workers.py): its hardware class, engine and engine version, and the queues it
    consumes. Seen again while it runs; deleted when it stops. One whose last sign of life is
    older than settings.RUN_STALE_AFTER_S died without saying so, and counts as gone."""

    hostname = models.CharField(max_length=200, unique=True, help_text="celery node name")
    hardware = models.CharField(max_length=50)
    engine = models.CharField(max_length=50)
    engine_version = models.CharField(max_length=50, blank=True)
    queues = models.JSONField(default=list, help_text="the queues it consumes")
    python_version = models.CharField(max_length=50, blank=True)
    torch_version = models.CharField(max_length=50, blank=True)
    started_at = models.DateTimeField(default=timezone.now)
    last_seen_at = models.DateTimeField(default=timezone.now, db_index=True)

    class Meta:
        ordering = ["hardware", "engine", "engine_version", "hostname"]

    def __str__(self):
        return f"{self.hostname}: {self.engine} {self.engine_version or '?'} on {self.hardware}"


class Result(models.Model):
    """One cell of a run's grid. Unique on (run, task, batch size, temperature, k), so a
    redelivered task never doubles a row. k = 0 for the baseline."""

    run = models.ForeignKey(Run, on_delete=models.CASCADE, related_name="results")
    task = models.CharField(max_length=50)
    batch_size = models.PositiveIntegerField()
    temperature = models.FloatField()
    k = models.PositiveIntegerField()
    requests = models.PositiveIntegerField()
    generated_tokens = models.PositiveIntegerField()
    wall_seconds = models.FloatField()
    drafts = models.PositiveIntegerField(default=0)
    draft_tokens = models.PositiveIntegerField(default=0)
    accepted_tokens = models.PositiveIntegerField(default=0)
    accepted_at = models.JSONField(default=list, blank=True)
    acceptance_length = models.FloatField(null=True, blank=True)
    acceptance_rate = models.FloatField(null=True, blank=True)
    per_position_acceptance = models.JSONField(default=list, blank=True)
    conditional_acceptance = models.JSONField(default=list, blank=True)
    output_throughput = models.FloatField(null=True)
    ttft_mean = models.FloatField(null=True)
    ttft_p50 = models.FloatField(null=True)
    ttft_p90 = models.FloatField(null=True)
    ttft_p99 = models.FloatField(null=True)
    tpot_mean = models.FloatField(null=True)
    tpot_p50 = models.FloatField(null=True)
    tpot_p90 = models.FloatField(null=True)
    tpot_p99 = models.FloatField(null=True)
    speedup = models.FloatField(null=True, blank=True)
    speedup_low = models.FloatField(null=True, blank=True)
    speedup_high = models.FloatField(null=True, blank=True)
    # The speedup's two 95% intervals (services.runs.speedup_with_interval; docs/measurement.md
    # "Two intervals"). speedup_low/high, what the leaderboard ranks by: where a rerun on the
    # protocol's prompts would land (the passes' log standard error with the prompts held
    # fixed, speedup_passes_se, and the protocol's between-run variance,
    # speedup_between_run_variance); before the protocol is calibrated, the interval across
    # prompts. speedup_prompts_low/high: across prompts (prompts as clusters, then passes,
    # plus the between-run variance): how far the speedup may move on other prompts of the
    # task's kind.
    speedup_prompts_low = models.FloatField(null=True, blank=True)
    speedup_prompts_high = models.FloatField(null=True, blank=True)
    speedup_passes_se = models.FloatField(null=True, blank=True)
    speedup_between_run_variance = models.FloatField(null=True, blank=True)
    # The cell speedup divides by (leaderboard/services/baselines.py picks it, once: every
    # read follows this key, so a stored speedup is pinned to the cells it divided by).
    baseline_result = models.ForeignKey("self", null=True, blank=True, on_delete=models.SET_NULL,
                                        related_name="+", help_text="the cell speedup divides by")
    # Protocol v2 figures (worker.measure CellResult.figures); null on older rows.
    repetitions = models.PositiveIntegerField(null=True, blank=True)
    decode_tokens = models.PositiveIntegerField(null=True, blank=True)
    decode_steps = models.PositiveIntegerField(null=True, blank=True)
    engine_acceptance_length = models.FloatField(null=True, blank=True)
    output_throughput_low = models.FloatField(null=True, blank=True)
    output_throughput_high = models.FloatField(null=True, blank=True)
    acceptance_length_low = models.FloatField(null=True, blank=True)
    acceptance_length_high = models.FloatField(null=True, blank=True)
    pass_throughputs = models.JSONField(null=True, blank=True)
    host_load = models.FloatField(null=True, blank=True)
    loaded = models.BooleanField(null=True, blank=True)
    # Adaptive passes (protocol v3): why the cell stopped measuring ("target": its
    # half-width reached the protocol's target; "budget": its time budget was spent;
    # "max": the most passes the protocol allows; "fixed": a protocol without a target),
    # and how many passes were measured again because the engine's cores were loaded.
    passes_stop = models.CharField(max_length=16, null=True, blank=True)
    remeasured_passes = models.PositiveIntegerField(default=0)
    # Protocol v4: the engine starts the cell's kept passes came from. Under a protocol with
    # several (ProtocolSpec.engine_starts) a cell is stored after each start's round and
    # replaced after the next: fewer than the protocol's is a cell still being measured
    # (``is_complete``). Null on rows stored before (one start).
    engine_starts = models.PositiveSmallIntegerField(null=True, blank=True)
    checks = models.JSONField(null=True, blank=True)
    lossless_share = models.FloatField(null=True, blank=True)
    measured_at = models.DateTimeField(default=timezone.now)
    # "When does it pay?" (worker.analysis) from the run's raw records and its baseline's
    # cost model, written once the run and its baseline have succeeded
    # (services.runs.record_analysis)
    # so that pages and the export read them like any other figure.
    tokens_per_step = models.FloatField(null=True, blank=True)
    predicted_speedup = models.FloatField(null=True, blank=True)
    engine_efficiency = models.FloatField(null=True, blank=True)
    oracle_speedup = models.FloatField(null=True, blank=True)
    no_waste_speedup = models.FloatField(null=True, blank=True)
    prefill_share = models.FloatField(null=True, blank=True)
    verification_share = models.FloatField(null=True, blank=True)
    drafting_other_share = models.FloatField(null=True, blank=True)

    class Meta:
        ordering = ["run", "task", "batch_size", "temperature", "k"]
        constraints = [
            models.UniqueConstraint(fields=["run", "task", "batch_size", "temperature", "k"],
                                    name="unique_result_cell"),
        ]
        indexes = [models.Index(fields=["task", "batch_size"])]

    # A cell as pages, the API and the analysis read it (`as_cell_dict`).
    CELL_FIELDS = (
        "task", "batch_size", "temperature", "k", "requests", "generated_tokens",
        "wall_seconds", "drafts", "draft_tokens", "accepted_tokens", "accepted_at",
        "acceptance_length", "acceptance_rate", "per_position_acceptance",
        "conditional_acceptance", "output_throughput", "ttft_mean", "ttft_p50", "ttft_p90",
        "ttft_p99", "tpot_mean", "tpot_p50", "tpot_p90", "tpot_p99", "speedup",
        "lossless_share", "measured_at",
        # protocol v2 (null on older rows)
        "repetitions", "decode_tokens", "decode_steps", "tokens_per_step",
        "engine_acceptance_length", "output_throughput_low", "output_throughput_high",
        "acceptance_length_low", "acceptance_length_high", "speedup_low", "speedup_high",
        "pass_throughputs", "host_load", "loaded", "checks",
        # protocol v3 (null / 0 on older rows)
        "passes_stop", "remeasured_passes",
        # protocol v4 (null on older rows)
        "engine_starts",
        # the speedup's interval across prompts beside the ranking one, and what the ranking
        # one is built from (null on rows divided before them)
        "speedup_prompts_low", "speedup_prompts_high", "speedup_passes_se",
        "speedup_between_run_variance",
    )

    def as_cell_dict(self) -> dict:
        d = {f: getattr(self, f) for f in self.CELL_FIELDS}
        d["temperature"] = float(d["temperature"])
        d["accepted_at"] = list(d["accepted_at"] or [])
        d["run_id"] = self.run_id
        d["baseline_result_id"] = self.baseline_result_id
        d["checks_ok"], d["checks_failed"] = checks_summary(self.checks)
        return d


def checks_summary(checks) -> tuple[bool | None, list[str]]:
    """(ok, failed reasons) of a cell's self-checks; (None, []) for a row measured before
    they were kept."""
    if not checks or "ok" not in checks:
        return None, []
    return bool(checks["ok"]), list(checks.get("failed") or [])


class ApiToken(models.Model):
    """A bearer token for the REST API; only its sha256 is stored."""

    user = models.ForeignKey(settings.AUTH_USER_MODEL, on_delete=models.CASCADE,
                             related_name="api_tokens")
    name = models.CharField(max_length=100, blank=True)
    token_sha256 = models.CharField(max_length=64, unique=True)
    created_at = models.DateTimeField(auto_now_add=True)
    last_used_at = models.DateTimeField(null=True, blank=True)
    revoked_at = models.DateTimeField(null=True, blank=True)

    @staticmethod
    def hash(token: str) -> str:
        return hashlib.sha256(token.encode()).hexdigest()


class ProtocolCalibration(models.Model):
    """A protocol's between-run variance of the paired log-speedup (worker.calibration),
    estimated from drafters measured in several runs under it (`manage.py
    calibrate_protocol`). The newest row applies: every drafter cell's stored speedup
    interval is its within-run interval widened by it (services.runs.speedup_with_interval).
    Kept beside the protocol, which is immutable once it has results; a new estimate is a
    new row, so the history stays."""

    protocol = models.ForeignKey(Protocol, on_delete=models.CASCADE,
                                 related_name="calibrations")
    between_run_variance = models.FloatField(
        help_text="variance of the log-speedup between runs, floored at 0 (what is applied)")
    raw_variance = models.FloatField(
        null=True, blank=True, help_text="the method-of-moments estimate before the floor")
    cells = models.PositiveIntegerField(
        default=0, help_text="cells measured in two or more runs of one drafter")
    degrees_of_freedom = models.PositiveIntegerField(
        default=0, help_text="sum over those cells of (runs - 1): the run pairs, with two runs")
    runs = models.ManyToManyField(Run, related_name="+", blank=True,
                                  help_text="the runs the estimate came from")
    drafters = models.JSONField(default=list, blank=True,
                                help_text="slugs of the drafters whose runs were used")
    # The out-of-sample check (worker.calibration.held_out_rows): the estimate is calibrated
    # on its own runs by construction; each task's pairs judged by the other tasks' is not.
    held_out_pairs = models.PositiveIntegerField(
        default=0, help_text="cell pairs judged held out by task (0: no check, one task only "
                             "or recorded before the check)")
    held_out_within = models.PositiveIntegerField(
        default=0, help_text="of those, the pairs with |z| <= 1.96")
    inherited_from = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.SET_NULL, related_name="+",
        help_text="a copy of this calibration of another version of the protocol's family "
                  "(derived for another engine version), until the protocol is calibrated "
                  "from its own reruns")
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        ordering = ["protocol", "-created_at", "-pk"]

    def __str__(self):
        return f"{self.protocol}: between-run variance {self.between_run_variance:.3g}"

    @classmethod
    def variance_for(cls, protocol_id) -> float | None:
        """The between-run variance that applies to the protocol's cells now (None when it
        was never calibrated: no rerun has measured it yet)."""
        value = (cls.objects.filter(protocol_id=protocol_id).order_by("-created_at", "-pk")
                 .values_list("between_run_variance", flat=True).first())
        return None if value is None else float(value)
