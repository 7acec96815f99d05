import sys

from django.core.management.base import BaseCommand, CommandError

from leaderboard.queues import start_worker_command
from leaderboard.services import runs
from leaderboard.models import Drafter, Protocol


def resolve_protocol(slug):
    qs = Protocol.objects.all()
    if slug:
        name, _, version = slug.partition("@")
        qs = qs.filter(slug=name)
        if version:
            qs = qs.filter(version=int(version))
    protocol = qs.order_by("-version").first()
    if protocol is None:
        known = ", ".join(sorted(set(Protocol.objects.values_list("slug", flat=True)))) or "none"
        raise CommandError(f"no protocol {slug or ''!r}; known protocols: {known}")
    return protocol


class Command(BaseCommand):
    help = ("Measure a drafter (slug, or 'baseline') under a protocol: queue it on the "
            "protocol's queue (its hardware class, and engine version when it pins one), or "
            "with --sync measure it here with a progress bar.")

    def add_arguments(self, parser):
        parser.add_argument("drafter", help="drafter slug, or 'baseline' for the target alone")
        parser.add_argument("--protocol", help="protocol slug, optionally slug@version "
                                               "(default: the newest protocol)")
        parser.add_argument("--sync", action="store_true",
                            help="measure in this process (no worker needed)")

    def handle(self, drafter, protocol=None, sync=False, **options):
        protocol = resolve_protocol(protocol)
        if drafter == "baseline":
            drafter_obj = None
        else:
            drafter_obj = Drafter.objects.filter(slug=drafter).first()
            if drafter_obj is None:
                known = ", ".join(Drafter.objects.values_list("slug", flat=True)) or "none"
                raise CommandError(f"no drafter {drafter!r}; known drafters: {known}, baseline")
        refusal = runs.engine_version_refusal(protocol) if sync else None
        if refusal is not None:
            raise CommandError(f"--sync cannot measure it here: {refusal}")
        try:
            if sync and runs.needs_shared_baseline(protocol, drafter_obj):
                self._sync(runs.queue_run(protocol, None, send=False))
            run = runs.queue_run(protocol, drafter_obj, send=not sync)
        except runs.RunError as e:
            raise CommandError(str(e)) from None
        if not sync:
            worker = start_worker_command(protocol.hardware, protocol.spec.engine_version,
                                          run.queue)
            self.stdout.write(self.style.SUCCESS(
                f"queued run {run.pk} on queue {run.queue!r} ({run.cells_total} cells); "
                f"a worker measures it: {worker}"))
            return
        state = self._sync(run)
        if state != "succeeded":
            raise CommandError(f"run {run.pk} {state}")

    def _sync(self, run):
        from tqdm import tqdm

        from leaderboard.services.runs import execute_run

        who = run.drafter.name if run.drafter_id else "baseline"
        bar = tqdm(total=run.cells_total, desc=f"run {run.pk} ({who})", unit="cell",
                   file=sys.stdout)

        def progress(r):
            bar.n = r.cells_done
            bar.set_postfix_str(f"ETA {r.eta_seconds:.0f}s" if r.eta_seconds else "")
            bar.refresh()

        state = execute_run(run.pk, progress=progress)
        bar.close()
        run.refresh_from_db()
        if run.state == "failed":
            self.stderr.write(f"run {run.pk} failed: {run.error}\n--- log tail ---\n{run.log_tail}")
        else:
            self.stdout.write(self.style.SUCCESS(f"run {run.pk}: {run.state}, "
                                                 f"{run.cells_done}/{run.cells_total} cells"))
        return state or run.state
