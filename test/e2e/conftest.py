"""One server per test module: a module sets `SERVER_ARGS = [...]` to add launch flags."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from server import kill, popen_launch_server  # noqa: E402


@pytest.fixture(scope="module")
def base_url(request: pytest.FixtureRequest):
    proc, url = popen_launch_server(getattr(request.module, "SERVER_ARGS", []))
    yield url
    kill(proc)
