"""`make run`: start the site, a CPU Celery worker, an intake worker (the submissions'
checks, queue ``intake``) and the Gradio demo once it is installed, on the embedded
default; print the URLs, and stop everything on Ctrl-C."""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from leaderboard.celery import INTAKE_QUEUE
from leaderboard.queues import worker_queues
from worker.processes import stop_process_group

ROOT = Path(__file__).resolve().parent.parent


def wait_for(url, seconds=60):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status < 500:
                    return True
        except OSError:
            time.sleep(0.5)
    return False


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--demo-port", type=int, default=7860)
    parser.add_argument("--queues", default=",".join(worker_queues("cpu")),
                        help="queues of the local worker (default: this environment's engine "
                             "version's and the plain hardware class, leaderboard/queues.py)")
    args = parser.parse_args(argv)
    python = sys.executable
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    commands = {
        "web": [python, "manage.py", "runserver", "--noreload", f"{args.host}:{args.port}"],
        "worker": [python, "-m", "celery", "-A", "leaderboard", "worker", "-Q", args.queues,
                   "-c", "1", "--loglevel", "INFO", "-n", f"cpu@{os.uname().nodename}"],
        # Its own worker: a submission is checked at once, not behind an hour's measurement.
        "intake": [python, "-m", "celery", "-A", "leaderboard", "worker", "-Q", INTAKE_QUEUE,
                   "-c", "1", "--loglevel", "INFO", "-n", f"intake@{os.uname().nodename}"],
    }
    demo_python = ROOT / ".venv-demo" / "bin" / "python"
    if demo_python.exists():
        commands["demo"] = [str(demo_python), "manage.py", "demo", "--host", args.host,
                            "--port", str(args.demo_port)]
    children = {}
    for name, cmd in commands.items():
        # Each child leads its own process group, so Ctrl-C here ends its whole tree.
        children[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, start_new_session=True)

    def stop(*_):
        stop_process_group(*children.values(), term_timeout=20, kill_timeout=10)
        sys.exit(0)

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    site = f"http://{args.host}:{args.port}/"
    if wait_for(site):
        print(f"\nSpecBoard is up:\n  site   {site}\n  admin  {site}admin/\n"
              f"  API    {site}api/docs\n  workers: queue {args.queues!r} (measurements), "
              f"queue {INTAKE_QUEUE!r} (submissions' checks)", flush=True)
        if "demo" in children:
            print(f"  demo   http://{args.host}:{args.demo_port}/ (also at {site}demo/)", flush=True)
        print("Ctrl-C stops everything.\n", flush=True)
    else:
        print(f"the site did not answer at {site} within a minute; see the output above",
              flush=True)
    while True:
        for name, proc in children.items():
            if proc.poll() is not None:
                print(f"[run] {name} exited with code {proc.returncode}; stopping the rest",
                      flush=True)
                stop()
        time.sleep(1)


if __name__ == "__main__":
    main()
