"""SpecBoard's measurement library: protocol, metrics, prompt sets, checkpoint inspection,
engines and the Celery tasks (worker/tasks.py, the only module here that knows Django)."""
