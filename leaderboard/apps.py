from django.apps import AppConfig


class LeaderboardConfig(AppConfig):
    name = "leaderboard"
    verbose_name = "SpecBoard"
    default_auto_field = "django.db.models.BigAutoField"
