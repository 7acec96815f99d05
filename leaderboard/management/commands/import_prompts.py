from django.core.management.base import BaseCommand, CommandError

from leaderboard.services.setup import ServiceError, import_prompt_set
from worker.prompts import FORMATS, PromptFileError


class Command(BaseCommand):
    help = "Import a prompt file (Spec-Bench, MT-Bench or HumanEval JSON lines) as a prompt set."

    def add_arguments(self, parser):
        parser.add_argument("file")
        parser.add_argument("--format", required=True, choices=FORMATS)
        parser.add_argument("--slug", help="name of the prompt set (default: from the file name)")
        parser.add_argument("--name", help="display name")

    def handle(self, file, format, slug=None, name=None, **options):
        try:
            prompt_set, created = import_prompt_set(file, format, slug=slug, name=name)
        except (PromptFileError, ServiceError) as e:
            raise CommandError(f"{e}\nNothing was imported.") from None
        counts = {}
        for cat in prompt_set.prompts.values_list("category", flat=True):
            counts[cat] = counts.get(cat, 0) + 1
        verb = "imported" if created else "already present (same file)"
        self.stdout.write(self.style.SUCCESS(
            f"{prompt_set.slug}: {verb}, {sum(counts.values())} prompts, sha256 "
            f"{prompt_set.source_sha256}"))
        for cat, n in sorted(counts.items()):
            self.stdout.write(f"  {cat}: {n}")
