"""Running untrusted work (reading a submitted pickle, for one) in a child process with hard
limits: address space, CPU seconds, bytes per written file (``resource.setrlimit``, set in
the child before it runs anything) and wall-clock time (the parent kills the child's
process group). The child gets a minimal environment and no core dumps. A limit hit is
reported in words (``SandboxError``), never as a traceback of the child."""
from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from worker.processes import stop_process_group

ROOT = Path(__file__).resolve().parent.parent
GiB = 1 << 30
# What a child out of address space prints (Python, the C++ runtime, the dynamic loader).
MEMORY_SIGNS = ("MemoryError", "Cannot allocate memory", "bad_alloc",
                "failed to map segment", "out of memory")


@dataclass(frozen=True)
class Limits:
    """Hard limits of one sandboxed child. ``address_space`` covers Python, torch and the
    data (a memory-mapped file counts at its size)."""
    address_space: int = 4 * GiB
    cpu_seconds: int = 300
    wall_seconds: float = 600.0
    file_bytes: int = 8 * GiB

    def describe(self) -> str:
        return (f"{self.address_space / GiB:g} GiB of address space, {self.cpu_seconds} CPU "
                f"seconds, {self.wall_seconds:g} s wall clock, {self.file_bytes / GiB:g} GiB "
                "per written file")


class SandboxError(RuntimeError):
    """The sandboxed work failed: ``reason`` is one sentence for the submitter."""

    def __init__(self, reason: str, output: str = ""):
        self.reason = reason
        self.output = output
        super().__init__(reason)


def _apply_limits(limits: Limits):
    def preexec():
        for which, soft, hard in (
                (resource.RLIMIT_AS, limits.address_space, limits.address_space),
                # SIGXCPU at the soft limit (reported as such), SIGKILL at the hard one.
                (resource.RLIMIT_CPU, limits.cpu_seconds, limits.cpu_seconds + 5),
                (resource.RLIMIT_FSIZE, limits.file_bytes, limits.file_bytes),
                (resource.RLIMIT_CORE, 0, 0)):
            resource.setrlimit(which, (soft, hard))
    return preexec


def run_module(module: str, args: list[str], limits: Limits) -> dict:
    """Run ``python -m module *args`` under ``limits``; the module hands one JSON object
    back with ``write_result`` and exits 0, or says why it failed with ``fail``. Returns
    that object; raises SandboxError when a limit ends the child or it fails."""
    with tempfile.TemporaryDirectory(prefix="specboard-sandbox-") as tmp:
        result_path = Path(tmp) / "result.json"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT),
               "HOME": tmp, "TMPDIR": tmp, "OMP_NUM_THREADS": "1",
               "SPECBOARD_SANDBOX_RESULT": str(result_path)}
        proc = subprocess.Popen([sys.executable, "-m", module, *args], cwd=tmp, env=env,
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_apply_limits(limits))
        try:
            output, _ = proc.communicate(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            stop_process_group(proc, term_timeout=None)
            output, _ = proc.communicate()
            raise SandboxError(f"took longer than the {limits.wall_seconds:g} s allowed",
                               _text(output)) from None
        text = _text(output)
        code = proc.returncode
        if code in (-signal.SIGXCPU, -signal.SIGKILL):
            raise SandboxError(f"used more than the {limits.cpu_seconds} CPU seconds allowed",
                               text)
        if code == -signal.SIGXFSZ:
            raise SandboxError(f"wrote a file larger than the {limits.file_bytes / GiB:g} GiB "
                               "allowed", text)
        result = _read_result(result_path)
        if code != 0:
            if any(sign in text or sign in result.get("error", "") for sign in MEMORY_SIGNS):
                raise SandboxError(f"needed more than the {limits.address_space / GiB:g} GiB "
                                   "of memory allowed", text)
            if result.get("error"):
                raise SandboxError(result["error"], text)
            last = [ln for ln in text.strip().splitlines() if ln.strip()][-1:] or [
                f"exit status {code}"]
            raise SandboxError(last[0][:500], text)
        if not result:
            raise SandboxError("finished without a result", text)
        return result


def _read_result(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def _text(output: bytes | None) -> str:
    return (output or b"")[-20000:].decode("utf-8", "replace")


def write_result(obj: dict) -> None:
    """In the child: hand ``obj`` to the parent (see run_module)."""
    Path(os.environ["SPECBOARD_SANDBOX_RESULT"]).write_text(json.dumps(obj))


def fail(reason: str) -> int:
    """In the child: say why the work failed (one sentence); returns the exit status."""
    write_result({"error": reason})
    return 2
