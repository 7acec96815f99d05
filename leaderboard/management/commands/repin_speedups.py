"""Re-divide drafter runs by the baseline the rule picks now (services/baselines.py).

Stored speedups are pinned to the baseline cell they divided by: re-measuring a shared
baseline changes nothing by itself. This command is the explicit act that moves chosen runs
to the current baseline (for instance after a baseline run is found to be wrong), and says
which figures changed."""
from django.core.management.base import BaseCommand, CommandError

from leaderboard.models import Result, Run
from leaderboard.services import runs


class Command(BaseCommand):
    help = __doc__.splitlines()[0]

    def add_arguments(self, parser):
        parser.add_argument("run_ids", nargs="+", type=int, help="drafter run ids")

    def handle(self, run_ids, **options):
        for run_id in run_ids:
            run = Run.objects.select_related("protocol").filter(pk=run_id).first()
            if run is None or run.is_baseline:
                raise CommandError(f"run {run_id}: no such drafter run")
            for result in Result.objects.filter(run=run, k__gt=0).select_related("run"):
                before = (result.baseline_result_id, result.speedup)
                if not runs.divide_by_baseline(result):
                    self.stdout.write(f"run {run_id} {result.task} b={result.batch_size} "
                                      f"k={result.k}: no baseline cell under the rule")
                    continue
                if (result.baseline_result_id, result.speedup) != before:
                    self.stdout.write(
                        f"run {run_id} {result.task} b={result.batch_size} k={result.k}: "
                        f"{before[1]} (baseline cell {before[0]}) -> {result.speedup} "
                        f"(baseline cell {result.baseline_result_id})")
            if run.state == Run.SUCCEEDED:
                runs.record_analysis(run)
