"""When the scheduler process dies, requests fail fast with 503 instead of hanging."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest
from server import find_free_port, kill, popen_launch_server


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


def _ctrl_c(proc) -> tuple[int, str]:
    """SIGINT to the server's whole process group, as a terminal's Ctrl-C sends it; (exit
    status, log)."""
    os.killpg(os.getpgid(proc.pid), signal.SIGINT)
    try:
        code = proc.wait(30)
    finally:
        kill(proc)
    return code, Path(proc.log_path).read_text(errors="replace")


def _wait_for_log(proc, text: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in Path(proc.log_path).read_text(errors="replace"):
        assert proc.poll() is None and time.monotonic() < deadline, f"no {text!r} in the log"
        time.sleep(0.1)


def test_ctrl_c_while_serving_exits_without_traceback():
    proc, _ = popen_launch_server(["--skip-server-warmup"])
    code, log = _ctrl_c(proc)
    # uvicorn shuts down, then re-raises the SIGINT it caught: exit status 130, as a shell reports
    assert code == 128 + signal.SIGINT, log[-3000:]
    assert "Traceback" not in log, log[-3000:]


def test_ctrl_c_during_start_up_exits_without_traceback():
    log = tempfile.NamedTemporaryFile(prefix="hiserve_ctrl_c_", suffix=".log", delete=False)
    proc = subprocess.Popen([sys.executable, "-m", "hiserve.launch_server", "--dtype", "float32",
                             "--port", str(find_free_port()), "--skip-server-warmup"],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    proc.log_path = log.name
    # Logged once the scheduler process has resolved the flags and is loading the model.
    _wait_for_log(proc, "server_args:")
    code, text = _ctrl_c(proc)
    assert code == 128 + signal.SIGINT, text[-3000:]
    assert "Traceback" not in text, text[-3000:]
    assert "Interrupted" in text
