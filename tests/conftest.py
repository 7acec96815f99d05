"""Shared fixtures. Tests use the real services that the environment names
(DATABASE_URL, CELERY_BROKER_URL) and the real demo target, converted once into
SPECBOARD_DATA_DIR (default var/data) and reused across runs."""
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SHARED_DATA = Path(os.environ.get("SPECBOARD_SHARED_DATA", ROOT.parent / "shared" / "data"))
ARTIFACTS = Path(os.environ.get("SPECBOARD_TEST_ARTIFACTS", ROOT / "test-artifacts"))


def data_dir() -> Path:
    return Path(os.environ.get("SPECBOARD_DATA_DIR", ROOT / "var" / "data"))


@pytest.fixture(scope="session")
def demo_target_dir() -> Path:
    """The real demo target (SmolLM2-135M-Instruct) as a safetensors checkpoint."""
    from worker.demo_assets import demo_target

    return demo_target(data_dir(), progress=print)


@pytest.fixture(scope="session")
def shared_data() -> Path:
    if not SHARED_DATA.is_dir():
        pytest.fail(f"the shared prompt files are missing: expected {SHARED_DATA} "
                    "(set SPECBOARD_SHARED_DATA)")
    return SHARED_DATA


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    return ARTIFACTS
