from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from leaderboard.models import Run, Submission
from leaderboard.selectors.protocols import get_protocol
from leaderboard.services import intake, submissions
from worker import methods


class Command(BaseCommand):
    help = ("Submit a drafter from the model hub by reference (owner/name or "
            "owner/name@revision): the revision is pinned to its commit, the files are "
            "judged and the safetensors headers read before anything is downloaded, only "
            "the accepted files are fetched, checked as an upload is, stored and queued. "
            "It is a submission like the form's (listed on the submitter's submissions "
            "page), checked here unless --in-worker hands it to the intake worker. "
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
        parser.add_argument("--in-worker", action="store_true",
                            help="send it to the intake worker (queue intake) and return at "
                                 "once, printing the submission's id, instead of checking it "
                                 "in this command")

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
            submission = intake.receive(
                owner=user, protocol=found, method=method, hub_reference=reference,
                name=name or repo.rsplit("/", 1)[-1], description=description,
                licence=licence, link=link, send=options.get("in_worker", False))
        except submissions.SubmissionRefused as e:
            raise CommandError("refused:\n" + "\n".join(f"  - {p}" for p in e.problems)) from None
        if options.get("in_worker"):
            self.stdout.write(f"submission {submission.pk}: sent to the intake worker "
                              "(queue intake); its page and GET /api/submissions/"
                              f"{submission.pk} follow it")
            return
        submission = intake.check(submission.pk, send=True)
        if submission.state != Submission.ACCEPTED:
            raise CommandError(f"submission {submission.pk} {submission.state}:\n" + "\n".join(
                f"  - {p['file']}: {p['field']}: {p['message']}" for p in submission.problems))
        drafter = submission.drafter
        run = Run.objects.filter(drafter=drafter, protocol=found).order_by("pk").first()
        hub = drafter.intake["hub"]
        self.stdout.write(f"{drafter.slug}: {hub['repo_id']} at commit {hub['commit']} "
                          f"(revision {hub['revision']}); run {run.pk} queued on {run.hardware} "
                          f"(submission {submission.pk})")
        for note in drafter.intake.get("notes", []):
            self.stdout.write(f"  note: {note}")
