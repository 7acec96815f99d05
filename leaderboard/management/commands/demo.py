import logging
import os

from django.conf import settings
from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = ("Serve the Gradio live demo: speculative decoding step by step on the reference "
            "engine, for the leaderboard's targets and drafters. Runs from .venv-demo "
            "(`make install` creates it; gradio cannot live beside vllm).")

    def add_arguments(self, parser):
        parser.add_argument("--host", default="127.0.0.1")
        parser.add_argument("--port", type=int, default=7860)

    def handle(self, *args, host="127.0.0.1", port=7860, **options):
        os.environ["GRADIO_ANALYTICS_ENABLED"] = "False"  # before gradio is imported
        try:
            import gradio  # noqa: F401
        except ImportError as e:
            raise CommandError(
                "gradio is not installed in this environment; the demo runs from .venv-demo: "
                "`make install`, then `.venv-demo/bin/python manage.py demo`") from e
        # The demo is its own package beside the site (demo/); only this command imports it.
        from demo.app import build_app, launch
        from demo.backend import set_threads

        set_threads(settings.DEMO_TORCH_THREADS)
        for noisy in ("httpx", "urllib3"):  # gradio's own start-up probes, one line each
            logging.getLogger(noisy).setLevel(logging.WARNING)
        app = build_app()
        self.stdout.write(f"[demo] serving on http://{host}:{port}/", ending="\n")
        self.stdout.flush()
        launch(app, host, port)
