from django import forms
from django.contrib import admin, messages
from django.contrib.admin import helpers
from django.template.response import TemplateResponse

from .models import (ApiToken, Drafter, DrafterFile, EngineWorker, Prompt, PromptSet, Protocol,
                     ProtocolCalibration, Result, Run, Submission, Target, TrainingDataset)
from .services import engine_versions


@admin.register(Target)
class TargetAdmin(admin.ModelAdmin):
    list_display = ("name", "slug", "family", "vocab_size", "hidden_size", "num_layers",
                    "has_chat_template", "created_at")
    list_filter = ("family", "has_chat_template")
    search_fields = ("name", "slug", "hub_id", "weights_sha256")


class PromptInline(admin.TabularInline):
    model = Prompt
    extra = 0
    fields = ("position", "external_id", "category", "turns")
    readonly_fields = fields
    show_change_link = True
    max_num = 0


@admin.register(PromptSet)
class PromptSetAdmin(admin.ModelAdmin):
    list_display = ("slug", "name", "format", "source_name", "source_sha256", "created_at")
    list_filter = ("format",)
    search_fields = ("slug", "name", "source_sha256")


@admin.register(Prompt)
class PromptAdmin(admin.ModelAdmin):
    list_display = ("external_id", "prompt_set", "category", "position")
    list_filter = ("prompt_set", "category")
    search_fields = ("external_id", "turns")


DERIVE_TEMPLATE = "admin/leaderboard/protocol/derive_engine_version.html"


class EngineVersionForm(forms.Form):
    """What the admin action "derive a version for another engine version" asks."""
    engine_version = forms.CharField(max_length=50, help_text="the engine version to pin, "
                                     "e.g. 0.31.0 (a worker of that version measures it)")
    queue = forms.BooleanField(required=False, initial=True, help_text="queue the baseline "
                               "and the family's approved drafters on it")


@admin.register(Protocol)
class ProtocolAdmin(admin.ModelAdmin):
    list_display = ("slug", "version", "target", "engine", "engine_version", "hardware",
                    "sha256", "created_at")
    list_filter = ("engine", "hardware", "target")
    search_fields = ("slug", "title", "sha256")
    readonly_fields = ("sha256",)
    actions = ["derive_engine_version"]

    @admin.display(description="engine version")
    def engine_version(self, obj):
        return obj.spec.engine_version or "default"

    @admin.action(description="Derive a version for another engine version and queue its "
                              "drafters", permissions=["add"])
    def derive_engine_version(self, request, queryset):
        """An intermediate form asks the engine version; each selected protocol then gets a
        new version pinned to it, with its family's drafters queued
        (services.engine_versions.derive_and_queue; a refusal is shown, nothing kept)."""
        form = EngineVersionForm(request.POST if "apply" in request.POST else None)
        if form.is_valid():
            for source in queryset.order_by("slug", "version"):
                try:
                    derived, new_runs = engine_versions.derive_and_queue(
                        source, form.cleaned_data["engine_version"],
                        queue=form.cleaned_data["queue"])
                except engine_versions.DeriveRefused as e:
                    self.message_user(request, str(e), messages.ERROR)
                    continue
                self.message_user(request, (
                    f"created {derived} from {source}, queue {derived.spec.queue!r}; "
                    f"{len(new_runs)} runs queued; {engine_versions.worker_hint(derived)}"),
                    messages.SUCCESS)
            return None
        return TemplateResponse(request, DERIVE_TEMPLATE, {
            **self.admin_site.each_context(request),
            "title": "Derive a version for another engine version", "opts": self.model._meta,
            "form": form, "protocols": queryset.order_by("slug", "version"),
            "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
            "action": "derive_engine_version"})


@admin.register(ProtocolCalibration)
class ProtocolCalibrationAdmin(admin.ModelAdmin):
    # Written by `manage.py calibrate_protocol`, which also re-divides the cells: read-only here.
    list_display = ("protocol", "between_run_variance", "cells", "degrees_of_freedom",
                    "held_out_within", "held_out_pairs", "created_at")
    list_filter = ("protocol",)

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


@admin.register(EngineWorker)
class EngineWorkerAdmin(admin.ModelAdmin):
    # Written by the workers themselves (services/workers.py): read-only here.
    list_display = ("hostname", "hardware", "engine", "engine_version", "queues",
                    "torch_version", "started_at", "last_seen_at")
    list_filter = ("hardware", "engine", "engine_version")

    def has_add_permission(self, request):
        return False

    def has_change_permission(self, request, obj=None):
        return False


class DrafterFileInline(admin.TabularInline):
    model = DrafterFile
    extra = 0
    readonly_fields = ("name", "file", "size", "sha256")


@admin.register(Drafter)
class DrafterAdmin(admin.ModelAdmin):
    list_display = ("name", "method", "target", "owner", "review_state", "trained_by_recipe",
                    "created_at")
    list_filter = ("method", "review_state", "target")
    search_fields = ("name", "slug", "content_sha256", "owner__username")
    inlines = [DrafterFileInline]


@admin.register(Run)
class RunAdmin(admin.ModelAdmin):
    list_display = ("id", "drafter", "protocol", "hardware", "queue", "state", "cells_done",
                    "cells_total", "worker_host", "queued_at", "finished_at")
    list_filter = ("state", "hardware", "queue", "protocol")
    search_fields = ("drafter__name", "worker_host", "error")
    readonly_fields = ("versions", "engine_args", "log_tail", "error")


@admin.register(Result)
class ResultAdmin(admin.ModelAdmin):
    list_display = ("run", "task", "batch_size", "temperature", "k", "acceptance_length",
                    "output_throughput", "speedup")
    list_filter = ("task", "batch_size", "temperature", "k", "run__protocol")
    search_fields = ("run__drafter__name", "task")


@admin.register(ApiToken)
class ApiTokenAdmin(admin.ModelAdmin):
    list_display = ("user", "name", "created_at", "last_used_at", "revoked_at")
    search_fields = ("user__username", "name")
    readonly_fields = ("token_sha256",)


@admin.register(TrainingDataset)
class TrainingDatasetAdmin(admin.ModelAdmin):
    list_display = ("slug", "version", "target", "n", "tokens", "source", "sha256", "created_at")
    search_fields = ("slug", "sha256")
    readonly_fields = ("sha256", "path", "params")


@admin.register(Submission)
class SubmissionAdmin(admin.ModelAdmin):
    """Every submission attempt and what intake made of it (checking and refused ones count
    toward the owner's daily limit)."""
    list_display = ("name", "method", "state", "owner", "protocol", "hub_reference",
                    "created_at", "finished_at")
    list_filter = ("state", "method")
    search_fields = ("name", "owner__username", "hub_reference")
    readonly_fields = ("owner", "protocol", "method", "name", "params", "details",
                       "hub_reference", "staged", "state", "problems", "drafter", "attempts",
                       "created_at", "finished_at")
