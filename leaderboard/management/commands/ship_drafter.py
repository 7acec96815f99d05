from django.core.management.base import BaseCommand, CommandError

from leaderboard.models import Drafter
from leaderboard.services.errors import ServiceError
from leaderboard.services.shipping import ship_drafter
from leaderboard.services.training import find_dataset, trained_drafter


class Command(BaseCommand):
    help = ("Copy a trained drafter (its stored config.json + safetensors and its training "
            "record, training.json) into the shipped folder (drafters/, or "
            "SPECBOARD_SHIPPED_DRAFTERS_DIR), which setup_demo registers on every machine.")

    def add_arguments(self, parser):
        parser.add_argument("drafter", nargs="?", help="drafter slug (or give --recipe, --data, --seed)")
        parser.add_argument("--recipe", help="the recipe of the drafter to ship")
        parser.add_argument("--data", help="its training data: SLUG (newest version) or SLUG@VERSION")
        parser.add_argument("--seed", type=int, default=0, help="its training seed (default 0)")
        parser.add_argument("--to", help="the shipped folder (default: SPECBOARD_SHIPPED_DRAFTERS_DIR, drafters/)")
        parser.add_argument("--name", help="folder name (default: the drafter's slug)")
        parser.add_argument("--replace", action="store_true",
                            help="overwrite a folder of that name that holds other files")

    def handle(self, *args, drafter=None, recipe=None, data=None, seed=0, to=None, name=None,
               replace=False, **options):
        try:
            if drafter:
                row = Drafter.objects.select_related("target", "training_data").filter(slug=drafter).first()
                if row is None:
                    raise ServiceError(f"no drafter {drafter!r}")
            elif recipe and data:
                row = trained_drafter(recipe, find_dataset(data), seed)
                if row is None:
                    raise ServiceError(f"no {recipe} drafter trained on {data} with seed {seed}; "
                                       "train it with `manage.py train_drafter`")
            else:
                raise ServiceError("name a drafter slug, or --recipe and --data (and --seed)")
            folder, changed = ship_drafter(row, root=to, folder_name=name, replace=replace)
        except ServiceError as e:
            raise CommandError(str(e)) from None
        self.stdout.write(self.style.SUCCESS(
            f"{row.slug}: {'shipped to' if changed else 'already shipped, unchanged, in'} {folder}"))
