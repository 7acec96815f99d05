from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from leaderboard.selectors.protocols import get_protocol
from leaderboard.services import submissions
from worker import methods


class Command(BaseCommand):
    help = ("Submit a drafter from the model hub by reference (owner/name or "
            "owner/name@revision): the revision is pinned to its commit, the files are "
            "judged and the safetensors headers read before anything is downloaded, only "
            "the accepted files are fetched, checked as an upload is, stored and queued. "
            "The hub is HF_ENDPOINT (huggingface_hub's default otherwise); gated and private "
            "repositories need SPECBOARD_HF_TOKEN.")

    def add_arguments(self, parser):
        parser.add_argument("reference", help="owner/name or owner/name@revision (a branch, "
                                              "a tag or a commit hash; default main)")
        parser.add_argument("--protocol", required=True, help="SLUG@VERSION (or SLUG: newest)")
        parser.add_argument("--method", required=True, choices=methods.WEIGHTED_METHODS)
        parser.add_argument("--name", help="display name (default: the repository's name)")
        parser.add_argument("--owner", help="username of the submitter (default: none, a site "
                                            "entry; a named owner's daily limit applies)")
        parser.add_argument("--description", default="")
        parser.add_argument("--licence", default="")
        parser.add_argument("--link", default="", help="code, paper or model card")

    def handle(self, reference, protocol, method, name=None, owner=None, description="",
               licence="", link="", **options):
        found = get_protocol(protocol)
        if found is None:
            raise CommandError(f"no protocol {protocol!r}")
        user = None
        if owner:
            user = get_user_model().objects.filter(username=owner).first()
            if user is None:
                raise CommandError(f"no user {owner!r}")
        repo = reference.partition("@")[0]
        try:
            drafter, run = submissions.submit_from_hub(
                reference=reference, owner=user, protocol=found, method=method,
                name=name or repo.rsplit("/", 1)[-1], description=description,
                licence=licence, link=link)
        except submissions.SubmissionRefused as e:
            raise CommandError("refused:\n" + "\n".join(f"  - {p}" for p in e.problems)) from None
        hub = drafter.intake["hub"]
        self.stdout.write(f"{drafter.slug}: {hub['repo_id']} at commit {hub['commit']} "
                          f"(revision {hub['revision']}); run {run.pk} queued on {run.hardware}")
        for note in drafter.intake.get("notes", []):
            self.stdout.write(f"  note: {note}")
