from django.core.management.base import BaseCommand, CommandError

from leaderboard.services.setup import ServiceError
from leaderboard.services.training import mix_training_data


class Command(BaseCommand):
    help = ("Mix training data: the conversations of several datasets of one target as one "
            "dataset (interleaved in proportion, duplicates and evaluation prompts dropped), "
            "versioned and hashed like the others, for train_drafter --data.")

    def add_arguments(self, parser):
        parser.add_argument("datasets", nargs="+", metavar="DATA",
                            help="the datasets to mix (SLUG or SLUG@VERSION), at least two")
        parser.add_argument("--slug", required=True, help="the mix's name")

    def handle(self, *args, datasets, slug, **o):
        try:
            row, created = mix_training_data(slug, datasets)
        except ServiceError as e:
            raise CommandError(f"{e}\nNo dataset was recorded.") from None
        stats = row.params["stats"]
        verb = "written" if created else "already present (nothing new written)"
        parts = ", ".join(f"{p['n']} of {p['slug']} v{p['version']}" for p in stats["parts"])
        self.stdout.write(self.style.SUCCESS(
            f"training data {row.slug} v{row.version}: {verb}; {row.n} conversations ({parts}; "
            f"{stats['duplicates']} duplicates and {stats['evaluation_prompts']} evaluation "
            f"prompts dropped), {row.tokens} tokens, sha256 {row.sha256}"))
