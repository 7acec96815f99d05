from django.contrib import admin

from .models import (ApiToken, Drafter, DrafterFile, Prompt, PromptSet, Protocol,
                     ProtocolCalibration, Result, Run, Submission, Target, TrainingDataset)


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


@admin.register(Protocol)
class ProtocolAdmin(admin.ModelAdmin):
    list_display = ("slug", "version", "target", "engine", "hardware", "sha256", "created_at")
    list_filter = ("engine", "hardware", "target")
    search_fields = ("slug", "title", "sha256")
    readonly_fields = ("sha256",)


@admin.register(ProtocolCalibration)
class ProtocolCalibrationAdmin(admin.ModelAdmin):
    # Written by `manage.py calibrate_protocol`, which also re-divides the cells: read-only here.
    list_display = ("protocol", "between_run_variance", "cells", "degrees_of_freedom",
                    "created_at")
    list_filter = ("protocol",)

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
    list_display = ("id", "drafter", "protocol", "hardware", "state", "cells_done",
                    "cells_total", "worker_host", "queued_at", "finished_at")
    list_filter = ("state", "hardware", "protocol")
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
