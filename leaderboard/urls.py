
from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path, register_converter

from . import views
from .api import api

class IdConverter:
    """A database id: at most 18 digits, so that an address with a larger number is a 404,
    not an integer the database cannot hold (a 500)."""

    regex = "[0-9]{1,18}"

    def to_python(self, value):
        return int(value)

    def to_url(self, value):
        return str(value)


register_converter(IdConverter, "id")

urlpatterns = [
    path("", views.home, name="home"),
    path("queue/", views.queue, name="queue"),
    path("queue/progress.json", views.queue_progress, name="queue_progress"),
    path("runs/<id:run_id>/", views.run_detail, name="run"),
    path("runs/<id:run_id>/cancel/", views.run_cancel, name="run_cancel"),
    path("runs/<id:run_id>/artifact/", views.run_artifact, name="run_artifact"),
    path("submit/", views.submit, name="submit"),
    path("submissions/", views.submission_list, name="submissions"),
    path("submissions/<id:pk>/", views.submission_detail, name="submission"),
    path("drafters/<slug:slug>/", views.drafter_detail, name="drafter"),
    path("drafters/<slug:slug>/edit/", views.drafter_edit, name="drafter_edit"),
    path("drafters/<slug:slug>/withdraw/", views.drafter_withdraw, name="drafter_withdraw"),
    path("compare/", views.compare, name="compare"),
    path("protocols/", views.protocol_list, name="protocols"),
    path("protocols/<slug:slug>/v<id:version>/", views.protocol_detail, name="protocol"),
    path("protocols/<slug:slug>/v<id:version>/pays/", views.protocol_pays, name="protocol_pays"),
    path("recipes/", views.recipes, name="recipes"),
    path("upgrades/", views.upgrades, name="upgrades"),
    path("upgrades/<slug:slug>/<str:span>/", views.upgrade, name="upgrade"),
    path("accounts/signup/", views.signup, name="signup"),
    # Failed log-ins are counted and locked out by django-axes (settings.py, AXES_*).
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("accounts/settings/", views.account_settings, name="account_settings"),
    path("demo/", views.demo_page, name="demo"),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
]

handler500 = "leaderboard.views.server_error"
