"""The site's page for the live demo: it links to the Gradio app (`manage.py demo`, a
separate process in its own environment) and embeds it in an iframe."""
from django.conf import settings
from django.shortcuts import render


def demo_page(request):
    return render(request, "leaderboard/demo.html", {"demo_url": settings.SPECBOARD_DEMO_URL})
