"""Four simulated CPU devices for every test; must run before JAX is imported."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import multiprocessing  # noqa: E402
import threading  # noqa: E402

import pytest  # noqa: E402


def sebulba_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("sebulba-")]


@pytest.fixture
def no_leftovers():
    """Fails the test if it leaves inferencer threads or env processes behind."""
    yield
    assert sebulba_threads() == []
    assert multiprocessing.active_children() == []
