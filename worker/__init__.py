"""SpecBoard's measurement library: protocol, metrics, prompt sets, checkpoint inspection,
engines, runner, analysis and training recipes. It knows nothing of Django: the site's Celery
task (leaderboard/tasks.py) and run service call it."""
