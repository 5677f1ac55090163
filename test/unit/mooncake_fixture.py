"""A real `mooncake_master` on loopback ports for tests (and a way to kill and restart it).

`MooncakeMaster()` picks free ports for the master's RPC, its HTTP metadata server
(`--enable_http_metadata_server=true`) and its admin/metrics HTTP server; `start()` runs the
binary shipped in the `mooncake-transfer-engine-non-cuda` wheel and waits until
`/health` on the admin port says `service_ready` and the metadata server answers;
`kill()` SIGKILLs it (an abrupt death, as in a crash); `restart()` starts it again on the
same ports; `stop()` ends it. `extra_config()` is the `--hicache-storage-backend-extra-config`
dict (SGLang's keys) pointing a client at it.

`mooncake_unavailable()` says why the tests must skip (no wheel, or its library cannot load,
e.g. no libibverbs.so.1: `make setup` installs Debian's libibverbs1 when run as root).
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    """A TCP port free on 127.0.0.1 right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def master_binary() -> Path | None:
    """Path of the `mooncake_master` executable inside the installed `mooncake` package."""
    spec = importlib.util.find_spec("mooncake")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / "mooncake_master"
        if path.is_file():
            return path
    return None


def mooncake_unavailable() -> str | None:
    """None when the Mooncake client and master can run here, else the reason to skip."""
    if master_binary() is None:
        return "mooncake-transfer-engine-non-cuda is not installed (pip install '.[test]')"
    try:
        import mooncake.store  # noqa: F401
    except (ImportError, OSError) as exc:
        return (f"the Mooncake client cannot load ({exc}); install Debian's libibverbs1 "
                "(make setup does, as root)")
    return None


class MooncakeMaster:
    """One `mooncake_master` process on 127.0.0.1.

    Args:
        lease_ttl_ms: the master's `--default_kv_lease_ttl` (ms an object read or checked
            stays unremovable; Mooncake's default is 10000).
        rpc_port: the RPC port (default: a free one), for a master a client already expects.
    Attributes:
        rpc_port, http_port, metrics_port: its ports; `address` "127.0.0.1:<rpc_port>";
        `metadata_server` "http://127.0.0.1:<http_port>/metadata".
    """

    def __init__(self, lease_ttl_ms: int | None = None, rpc_port: int | None = None) -> None:
        binary = master_binary()
        if binary is None:
            raise RuntimeError("mooncake_master not found: install mooncake-transfer-engine-non-cuda")
        if not os.access(binary, os.X_OK):
            binary.chmod(binary.stat().st_mode | 0o111)
        self.binary = binary
        self.rpc_port = rpc_port or free_port()
        self.http_port = free_port()
        self.metrics_port = free_port()
        self.lease_ttl_ms = lease_ttl_ms
        self.proc: subprocess.Popen | None = None
        self.log_path = tempfile.NamedTemporaryFile(prefix="mooncake_master_", suffix=".log", delete=False).name

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def extra_config(self, **overrides) -> dict:
        """Client config for this master: TCP, loopback, a small lent segment (32 MiB)."""
        return {"master_server_address": self.address, "metadata_server": self.metadata_server,
                "protocol": "tcp", "local_hostname": "127.0.0.1", "device_name": "",
                "global_segment_size": 32 * 1024**2, "local_buffer_size": 16 * 1024**2, **overrides}

    def command(self) -> list[str]:
        cmd = [str(self.binary), f"--rpc_port={self.rpc_port}", "--rpc_address=127.0.0.1",
               "--rpc_thread_num=2", "--enable_http_metadata_server=true",
               f"--http_metadata_server_port={self.http_port}", "--http_metadata_server_host=127.0.0.1",
               f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1",
               "--enable_metric_reporting=false"]
        if self.lease_ttl_ms is not None:
            cmd.append(f"--default_kv_lease_ttl={self.lease_ttl_ms}")
        return cmd

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/health", timeout=1) as r:
                if not json.loads(r.read()).get("service_ready"):
                    return False
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=1) as r:
                return r.status == 200
        except (OSError, ValueError):
            return False

    def log_tail(self, n_chars: int = 3000) -> str:
        return Path(self.log_path).read_text(errors="replace")[-n_chars:]

    def start(self, timeout: float = 30.0) -> "MooncakeMaster":
        """Run the master and wait until it serves. Raises RuntimeError (with its log tail) if
        it exits or is not ready within `timeout` seconds."""
        assert self.proc is None or self.proc.poll() is not None, "master already running"
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(self.command(), stdout=log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}:\n{self.log_tail()}")
            if self._ready():
                return self
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"mooncake_master not ready in {timeout:.0f} s:\n{self.log_tail()}")

    def kill(self) -> None:
        """SIGKILL the master (an abrupt death) and wait for it to go."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def restart(self, timeout: float = 30.0) -> "MooncakeMaster":
        """Kill it if alive, then start it again on the same ports (an empty master)."""
        self.kill()
        return self.start(timeout)

    def stop(self, grace: float = 5.0) -> None:
        """SIGTERM, then SIGKILL after `grace` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(grace)
        except subprocess.TimeoutExpired:
            self.kill()
