from django.core.management.base import BaseCommand, CommandError

from leaderboard.models import Run
from leaderboard.services.runs import record_analysis


class Command(BaseCommand):
    help = ("Compute and store the \"When does it pay?\" figures of succeeded drafter runs "
            "(a worker does this when a run finishes; use this for runs measured before).")

    def add_arguments(self, parser):
        parser.add_argument("run_ids", nargs="*", type=int,
                            help="runs to analyse (default: every succeeded drafter run)")

    def handle(self, run_ids, **options):
        runs = Run.objects.filter(state=Run.SUCCEEDED, drafter__isnull=False)
        if run_ids:
            runs = runs.filter(pk__in=run_ids)
            missing = set(run_ids) - set(runs.values_list("pk", flat=True))
            if missing:
                raise CommandError(f"no succeeded drafter run with id {sorted(missing)}; "
                                   "only those can be analysed")
        runs = list(runs.select_related("drafter").order_by("pk"))
        for i, run in enumerate(runs, 1):
            cells = record_analysis(run)
            note = (f"{cells} cells" if cells else
                    "skipped: no succeeded baseline or no cells")
            self.stdout.write(f"[{i}/{len(runs)}] run {run.pk} ({run.drafter.slug}): {note}")
        self.stdout.write(self.style.SUCCESS(f"{len(runs)} runs analysed"))
