"""Estimate a protocol's between-run variance of the log-speedup and apply it to its cells.

From the drafters measured in two or more succeeded runs under the protocol (n-gram, a
shipped head: `bench/rerun.py` measures them again), by the method of moments
(worker.calibration), stored as a new ProtocolCalibration; then every drafter cell of the
protocol is divided again so that its stored speedup interval carries it. Prints the
estimate, the runs it came from, the held-out check (each task's cell pairs judged with the
estimate the other tasks give: out of sample) and every interval that changed."""
import math

from django.core.management.base import BaseCommand, CommandError

from leaderboard.management.commands.measure import resolve_protocol
from leaderboard.services import calibration
from worker.calibration import Z


def _fmt(interval):
    s, lo, hi = interval
    if s is None:
        return "-"
    if lo is None or hi is None:
        return f"{s:.3f}"
    return f"{s:.3f} [{lo:.3f}, {hi:.3f}] ±{max(hi - s, s - lo) / s * 100:.1f}%"


class Command(BaseCommand):
    help = __doc__.splitlines()[0]

    def add_arguments(self, parser):
        parser.add_argument("protocol", help="protocol slug, optionally slug@version")
        parser.add_argument("--drafter", action="append", dest="drafters",
                            help="use only this drafter's runs (repeatable; default: every "
                                 "drafter with two or more succeeded runs)")
        parser.add_argument("--dry-run", action="store_true",
                            help="print the estimate; store and change nothing")

    def handle(self, protocol, drafters=None, dry_run=False, **options):
        protocol = resolve_protocol(protocol)
        outcome = calibration.calibrate(protocol, drafters, dry_run)
        est, by_drafter = outcome.estimate, outcome.by_drafter
        if not est.degrees_of_freedom:
            raise CommandError(
                f"{protocol}: no drafter cell was measured in two succeeded runs (with "
                "records and intervals); measure a reference drafter again first "
                "(bench/rerun.py DRAFTER --count 2)")
        for slug, rs in sorted(by_drafter.items()):
            self.stdout.write(f"{slug}: runs {', '.join(str(r.pk) for r in rs)}")
        sd = math.sqrt(est.variance)
        self.stdout.write(
            f"{protocol}: between-run variance of the log-speedup {est.variance:.3g} "
            f"(sd {sd * 100:.2f}%, adds ±{(math.exp(Z * sd) - 1) * 100:.1f}% at 95%; "
            f"raw estimate {est.raw_variance:.3g}) from {est.cells} cells, "
            f"{est.degrees_of_freedom} degrees of freedom, runs "
            f"{', '.join(map(str, est.run_ids))}")
        within, judged = outcome.held_out_within()
        if judged:
            self.stdout.write(
                f"held out by task (each task's cells against the estimate of the other "
                f"tasks' alone): |z| <= 1.96 in {within} of {judged} cell pairs")
        else:
            self.stdout.write("held out by task: no check (one task only)")
        if dry_run:
            self.stdout.write("dry run: nothing stored")
            return
        for c in outcome.changes:
            r = c.result
            self.stdout.write(f"run {r.run_id} {r.task} b={r.batch_size} t={r.temperature:g} "
                              f"k={r.k}: {_fmt(c.before)} -> {_fmt(c.after)}")
        self.stdout.write(self.style.SUCCESS(
            f"stored calibration {outcome.row.pk}; {len(outcome.changes)} cell intervals "
            f"changed"))
