"""Start and stop a real hiserve server for end-to-end tests.

`popen_launch_server(extra_args)` runs `python -m hiserve.launch_server --dtype float32
--port <free port> ...` in its own process group, waits until `/health` answers 200
(after the warm-up request), and returns the process and its base URL; `kill` stops the
server and its scheduler process together.

Environment:
    HISERVE_E2E_LAUNCH_TIMEOUT  seconds to wait for /health (default 600)
    HISERVE_E2E_LAUNCHER        command that replaces `python -m hiserve.launch_server`
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import httpx

REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH = float(os.environ.get("HISERVE_E2E_LAUNCH_TIMEOUT", "600"))


def find_free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launcher() -> list[str]:
    custom = os.environ.get("HISERVE_E2E_LAUNCHER")
    return shlex.split(custom) if custom else [sys.executable, "-m", "hiserve.launch_server"]


def _log_tail(proc: subprocess.Popen, n_chars: int = 4000) -> str:
    log = getattr(proc, "log_path", None)
    if log is None:
        return ""
    return Path(log).read_text(errors="replace")[-n_chars:]


def popen_launch_server(extra_args: list[str] = (), timeout: float = DEFAULT_TIMEOUT_FOR_SERVER_LAUNCH,
                        env: Optional[dict[str, str]] = None, wait: bool = True) -> tuple[subprocess.Popen, str]:
    """Launch a server on a free port and wait for /health 200 (`wait=False`: return at once);
    returns (process, base_url).

    The server's output goes to a temporary log file (`proc.log_path`), whose tail is in
    the exception if the server exits or does not come up in time.
    """
    port = find_free_port()
    base_url = f"http://127.0.0.1:{port}"
    cmd = [*_launcher(), "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port),
           *map(str, extra_args)]
    log = tempfile.NamedTemporaryFile(prefix="hiserve_e2e_", suffix=".log", delete=False)
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, **(env or {})}, start_new_session=True)
    log.close()
    proc.log_path = log.name
    if not wait:
        return proc, base_url
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=5.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with code {proc.returncode} during start-up; "
                                   f"log tail:\n{_log_tail(proc)}")
            try:
                if client.get(base_url + "/health").status_code == 200:
                    return proc, base_url
            except httpx.HTTPError:
                pass
            time.sleep(1.0)
    kill(proc)
    raise TimeoutError(f"server not healthy within {timeout:.0f} s: {' '.join(cmd)}; "
                       f"log tail:\n{_log_tail(proc)}")


def kill(proc: subprocess.Popen, grace: float = 15.0) -> None:
    """SIGTERM the server's process group (server + scheduler), SIGKILL whatever remains."""
    try:
        pgid = os.getpgid(proc.pid)
    except ProcessLookupError:
        return
    os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        pass
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def stream_events(client: httpx.Client, path: str, body: dict, **kwargs) -> list:
    """POST a streaming request; the parsed `data:` events in order, "[DONE]" kept as a string."""
    events = []
    with client.stream("POST", path, json=body, **kwargs) as r:
        assert r.status_code == 200, r.read()
        assert r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if not line:
                continue
            assert line.startswith("data: "), line
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
    return events
