from django.contrib import admin
from django.contrib.auth import views as auth_views
from django.urls import path

from . import views
from .demo_views import demo_page
from .api import api

urlpatterns = [
    path("", views.home, name="home"),
    path("queue/", views.queue, name="queue"),
    path("queue/progress.json", views.queue_progress, name="queue_progress"),
    path("runs/<int:run_id>/", views.run_detail, name="run"),
    path("runs/<int:run_id>/cancel/", views.run_cancel, name="run_cancel"),
    path("runs/<int:run_id>/artifact/", views.run_artifact, name="run_artifact"),
    path("submit/", views.submit, name="submit"),
    path("drafters/<slug:slug>/", views.drafter_detail, name="drafter"),
    path("drafters/<slug:slug>/edit/", views.drafter_edit, name="drafter_edit"),
    path("drafters/<slug:slug>/withdraw/", views.drafter_withdraw, name="drafter_withdraw"),
    path("compare/", views.compare, name="compare"),
    path("protocols/", views.protocol_list, name="protocols"),
    path("protocols/<slug:slug>/v<int:version>/", views.protocol_detail, name="protocol"),
    path("protocols/<slug:slug>/v<int:version>/pays/", views.protocol_pays, name="protocol_pays"),
    path("accounts/signup/", views.signup, name="signup"),
    path("accounts/login/", auth_views.LoginView.as_view(), name="login"),
    path("accounts/logout/", auth_views.LogoutView.as_view(), name="logout"),
    path("accounts/settings/", views.account_settings, name="account_settings"),
    path("demo/", demo_page, name="demo"),
    path("admin/", admin.site.urls),
    path("api/", api.urls),
]
