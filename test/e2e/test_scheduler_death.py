"""When the scheduler process dies, requests fail fast with 503 instead of hanging."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import httpx
import pytest
from server import kill, popen_launch_server


def _scheduler_pid(server_pid: int) -> int:
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children")
    if not children.exists():
        pytest.skip("needs Linux /proc to find the scheduler process")
    for pid in map(int, children.read_text().split()):
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"spawn_main" in cmdline:  # not the resource tracker
            return pid
    raise AssertionError("no scheduler child process found")


@pytest.fixture(scope="module")
def server():
    proc, url = popen_launch_server(["--skip-server-warmup"])
    yield proc, url
    kill(proc)


def test_scheduler_death_fails_requests(server):
    proc, url = server
    body = {"text": "Tell me a story.", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}
    with httpx.Client(base_url=url, timeout=60) as client:
        lines = []
        with client.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            start = None
            for line in r.iter_lines():
                if not line:
                    continue
                lines.append(line)
                if start is None and line.startswith("data: {"):
                    os.kill(_scheduler_pid(proc.pid), signal.SIGKILL)
                    start = time.monotonic()
        # The open stream ends with an error event, then [DONE].
        assert time.monotonic() - start < 10
        assert lines[-1] == "data: [DONE]"
        assert '"error"' in lines[-2] and "scheduler" in lines[-2]

        assert client.get("/health").status_code == 503
        assert client.get("/health_generate").status_code == 503
        r = client.post("/generate", json={"text": "Hi"})
        assert r.status_code == 503 and "scheduler" in r.json()["error"]["message"]
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}]})
        assert r.status_code == 503
        assert client.get("/get_server_info").status_code == 503
        assert proc.poll() is None  # still answering, not hanging or gone
