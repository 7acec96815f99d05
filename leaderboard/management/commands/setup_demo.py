from django.core.management.base import BaseCommand

from leaderboard.services.setup import ensure_acceptance_protocol, queue_demo_runs, setup_demo


class Command(BaseCommand):
    help = ("Create the demo target (SmolLM2-135M from PyPI, converted once), the MT-Bench and "
            "HumanEval prompt sets, the demo protocol, the n-gram drafter and the trained "
            "drafters shipped in drafters/ (SPECBOARD_SHIPPED_DRAFTERS_DIR). Idempotent.")

    def add_arguments(self, parser):
        parser.add_argument("--prompts-per-task", type=int, default=None,
                            help="prompts per task in the demo protocol at batch sizes 4 "
                                 "and 8 (default SPECBOARD_DEMO_PROMPTS_PER_TASK, 24; at least "
                                 "the largest batch size); batch size 1 measures the first 8")
        parser.add_argument("--queue-runs", action="store_true",
                            help="queue the baseline and each demo drafter that has no run yet "
                                 "under the demo protocol, the n-gram drafter first, then the "
                                 "shipped ones (make run does this)")
        parser.add_argument("--acceptance-protocol", action="store_true",
                            help="also create demo-cpu-acceptance: the demo's tasks and prompts "
                                 "at batch size 8, the largest k, one pass (learning curves)")

    def handle(self, *args, prompts_per_task=None, queue_runs=False, acceptance_protocol=False,
               **options):
        say = lambda m: self.stdout.write(f"[setup_demo] {m}")  # noqa: E731
        rows = setup_demo(progress=say, prompts_per_task=prompts_per_task)
        # A refused shipped drafter stops nothing else (the site still starts): it is named,
        # with what to fix, on stderr.
        for folder, message in rows["shipped"].refused:
            self.stderr.write(self.style.ERROR(f"[setup_demo] shipped drafter {folder} refused: {message}"))
        if acceptance_protocol:
            say(f"protocol {ensure_acceptance_protocol(rows)}: for learning curves")
        if queue_runs:
            for run in queue_demo_runs(rows):
                who = run.drafter.name if run.drafter_id else "baseline"
                say(f"queued run {run.pk}: {who} ({run.cells_total} cells) on {run.hardware!r}")
        self.stdout.write(self.style.SUCCESS(
            f"[setup_demo] done: target {rows['target'].slug}, protocol {rows['protocol']}"))
