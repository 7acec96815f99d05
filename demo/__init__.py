"""The Gradio live demo, a package beside the site: `python manage.py demo`, from .venv-demo
(gradio needs pillow < 13, vllm >= 13, so the two cannot share an environment).

- ``app``: the Gradio layout and callbacks (the only module that imports gradio);
- ``backend``: what to offer (targets, drafters, prompts from the site's database), engines
  loaded lazily, the checks behind the person's messages, streaming a generation;
- ``trace``: the highlights, step log and counters, from the reference engine's traces.

It reads the site (leaderboard.models, leaderboard.services) and the library (worker); the
site imports it only in the `demo` command, and worker/ never does. The site's page that
embeds the app is leaderboard.views.demo_page.
"""
