from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from leaderboard.tokens import create_token


class Command(BaseCommand):
    help = ("Create a REST API token for USERNAME and print it (it is shown only this once; "
            "only its sha256 is stored). Revoke tokens on the account settings page.")

    def add_arguments(self, parser):
        parser.add_argument("username")
        parser.add_argument("--name", default="", help="a label for the token")

    def handle(self, username, name="", **options):
        User = get_user_model()
        user = User.objects.filter(username=username).first()
        if user is None:
            raise CommandError(f"no user {username!r}: create one on the sign-up page or with "
                               "`manage.py createsuperuser`")
        if not user.is_active:
            raise CommandError(f"user {username!r} is inactive")
        _, raw = create_token(user, name or "command line")
        self.stdout.write(raw)
