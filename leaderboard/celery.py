"""The Celery app. Its configuration is the CELERY_* block of leaderboard/settings.py:
measurement tasks are long accelerator jobs, so late acks, prefetch 1, one queue per
hardware class (and per engine version a protocol pins: leaderboard/queues.py), and outcomes
written to the database rather than a result backend."""
import os

from celery import Celery
from celery.signals import worker_init

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "leaderboard.settings")

# The measurement task, named after where it lives (leaderboard/tasks.py). The site sends it
# by this name, so sending needs no import of the task. Until 2026-12-04 it was
# "worker.measure_run": docs/deployment.md says what becomes of messages queued under that.
MEASURE_RUN = "leaderboard.tasks.measure_run"
# The intake task (leaderboard/services/intake.py) and its queue: a submission's checks and
# conversion run on an intake worker, never in a web worker, and never wait behind a
# measurement.
CHECK_SUBMISSION = "leaderboard.tasks.check_submission"
INTAKE_QUEUE = "intake"

app = Celery("leaderboard")
app.config_from_object("django.conf:settings", namespace="CELERY")
# Imported when a worker starts (not at import: the task module needs Django set up).
app.autodiscover_tasks(["leaderboard"], related_name="tasks")


def ensure_broker_folders():
    """The filesystem broker needs its folders before the first message is sent."""
    options = app.conf.broker_transport_options or {}
    for key in ("data_folder_in", "data_folder_out", "processed_folder", "control_folder"):
        if options.get(key):
            os.makedirs(options[key], exist_ok=True)


# The site may send a message before any worker has started (a submission right after
# `make web`), so the folders are made on import, and again when a worker starts.
ensure_broker_folders()
worker_init.connect(lambda **_: ensure_broker_folders(), weak=False)
