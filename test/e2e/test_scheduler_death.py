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


def _ctrl_c(proc, within: float = 30.0) -> tuple[int, str]:
    """SIGINT to the server's whole process group, as a terminal's Ctrl-C sends it; (exit
    status, log). Every process of the group must be gone within `within` seconds."""
    pgid = os.getpgid(proc.pid)
    try:
        os.killpg(pgid, signal.SIGINT)
        code = proc.wait(within)
        deadline = time.monotonic() + 10
        while True:  # the scheduler (and anything it started) too, not only the API process
            try:
                os.killpg(pgid, 0)
            except ProcessLookupError:
                break
            assert time.monotonic() < deadline, "processes of the server's group outlived it"
            time.sleep(0.1)
    finally:
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
    return code, Path(proc.log_path).read_text(errors="replace")


def _launch_interruptible(**kwargs):
    """`popen_launch_server` whose server takes SIGINT even when this test run ignores it: a
    background job of a non-interactive shell (`make test &`, some CI runners) starts with
    SIGINT ignored, and an ignored signal stays ignored through fork and exec, where Python
    then leaves it ignored. A handled one is reset to the default at exec."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return popen_launch_server(["--skip-server-warmup"], **kwargs)
    finally:
        signal.signal(signal.SIGINT, old)


def _wait_for_log(proc, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in Path(proc.log_path).read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, f"no {text!r} in the log"
        time.sleep(0.1)


def test_ctrl_c_while_streaming_exits_soon_without_traceback():
    """A long stream is open: uvicorn gives it a few seconds (launch_server's graceful
    shutdown), then the server exits 130, as a shell reports an interrupted command."""
    proc, url = _launch_interruptible()
    body = {"text": "Tell me a story.", "stream": True,
            "sampling_params": {"max_new_tokens": 4000, "ignore_eos": True}}
    try:
        with httpx.Client(base_url=url, timeout=60) as client, client.stream("POST", "/generate", json=body) as r:
            assert next(line for line in r.iter_lines() if line.startswith("data: {"))
            start = time.monotonic()
            code, log = _ctrl_c(proc, within=30)
            elapsed = time.monotonic() - start
    finally:
        kill(proc)  # only if something above failed first
    assert elapsed < 20, f"exit took {elapsed:.1f} s"
    assert code == 128 + signal.SIGINT, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_ctrl_c_during_start_up_exits_without_traceback():
    proc, _ = _launch_interruptible(wait=False)
    try:
        # Logged once the scheduler process has resolved the flags and is loading the model.
        _wait_for_log(proc, "server_args:")
    finally:
        code, text = _ctrl_c(proc)
    assert "Scheduler ready" not in text, "the interrupt came after start-up; nothing was tested"
    assert code == 128 + signal.SIGINT, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert "Interrupted" in text
