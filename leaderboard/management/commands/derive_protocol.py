"""Derive a protocol version pinned to another engine version (same target, prompts,
sampling, batch sizes and k) and, with --queue, queue on it the baseline and every approved
drafter its family has measured (leaderboard/services/engine_versions.py). Prints the new
protocol, its queue, the runs queued and how to start a worker for that queue."""
from django.core.management.base import BaseCommand, CommandError

from leaderboard.management.commands.measure import resolve_protocol
from leaderboard.services import engine_versions


class Command(BaseCommand):
    help = __doc__.splitlines()[0]

    def add_arguments(self, parser):
        parser.add_argument("protocol", help="the source protocol: slug@version (slug alone: "
                                             "its newest version)")
        parser.add_argument("--engine-version", required=True,
                            help="the engine version to pin, e.g. 0.31.0")
        parser.add_argument("--queue", action="store_true",
                            help="queue the baseline and the family's approved drafters on it")
        parser.add_argument("--title", help="the new version's title (default: the source's)")

    def handle(self, protocol, engine_version, queue=False, title=None, **options):
        source = resolve_protocol(protocol)
        try:
            derived, new_runs = engine_versions.derive_and_queue(source, engine_version,
                                                                 queue=queue, title=title)
        except engine_versions.DeriveRefused as e:
            raise CommandError(str(e)) from None
        spec = derived.spec
        self.stdout.write(self.style.SUCCESS(
            f"created {derived} from {source}: {spec.engine} {spec.engine_version}, queue "
            f"{spec.queue!r}, sha256 {derived.sha256[:12]}"))
        if queue:
            self.stdout.write(f"queued {len(new_runs)} run{'s' if len(new_runs) != 1 else ''}"
                              + (":" if new_runs else " (nothing measured in its family yet)"))
            for run in new_runs:
                who = run.drafter.slug if run.drafter_id else "baseline"
                self.stdout.write(f"  run {run.pk}: {who} ({run.cells_total} cells)")
        else:
            self.stdout.write(f"nothing queued; queue its drafters with --queue, or: "
                              f"manage.py measure DRAFTER --protocol {derived.slug}@"
                              f"{derived.version}")
        self.stdout.write(engine_versions.worker_hint(derived))
