"""`mooncake` storage backend: pages as objects in a Mooncake Store shared by every replica.

Mooncake Store (https://github.com/kvcache-ai/Mooncake, PyPI `mooncake-transfer-engine`, on
CPU `mooncake-transfer-engine-non-cuda`) is a distributed KV object store: a master
(`mooncake_master`, shipped in the wheel; with `--enable_http_metadata_server=true` it also
serves the transfer engine's metadata) keeps the object index, and every client contributes
memory (`global_segment_size`) that objects are placed in. Object name `f"{key}.{kind}"`,
one per page and KV kind (base.object_keys), holding the page's bytes exactly as the host
pool holds them.

Zero copy: the host pool's one allocation (`host_pool.buffer`, uint8) is registered with
the client once (`register_buffer`); a page then goes out with `batch_put_from(keys, ptrs,
sizes)` and comes back with `batch_get_into(keys, ptrs, sizes)` straight from / into
`host_pool.page_byte_range(kind, page)` — the transfer engine reads and writes the pool's
memory, no staging copy.

Return conventions of `mooncake.store.MooncakeDistributedStore` 0.3.13 (read from the
bindings and checked against a live master): `setup(...)` 0 on success and **blocks until
the master answers** (no time-out: ~1 minute was observed with no master, then it succeeded
when one appeared); `batch_is_exist` 1 / 0 / negative per key; `batch_put_from` 0 per key on
success (also for a key already there), negative error code otherwise; `batch_get_into`
bytes read per key or a negative code (-704 not found, -600 buffer smaller than the
object); `remove_by_regex(regex, force)` the count removed — without `force` an object
under a read lease (granted by a get *or an exists*, `--default_kv_lease_ttl`, 10 s) is
kept; `health_check()` 0 healthy, 1 not set up / closed, 2 master unreachable (answered
from the client's own ping state, in microseconds).

Master death: the client notices at once (its ping thread sees the connection drop:
`health_check()` = 2), then reconnects **by itself** when a master answers again at the
same address (same client object, no new `setup`; its memory segment is remounted and its
registered buffers stay valid). The new master starts empty: stored pages are gone, new
writes are hits again. A client that dies takes the objects in its lent segment with it: for
the master's `--client_ttl` (10 s) they still exist and gets of them answer -800 after ~1 s,
then they are gone (-704). While the master is down every store call blocks ~4.5 s in RPC
retries and answers -900 (RPC_FAIL), so this backend checks `health_check()` before each
call and counts "unavailable" without calling. `close()` with a dead master blocks ~10 s
(segment unmount retries): it runs on a daemon thread, waited for at most `CLOSE_WAIT_S`.

A master that is not reachable at start does not stop the server: `setup` is attempted only
after a TCP probe of the master (and of an HTTP metadata server) succeeds, the failure is
counted ("unavailable"), every call misses, and the probe is retried at most every
`connect_retry_interval` seconds from the calling (storage worker) thread.

Configuration, as SGLang's `MooncakeStoreConfig` (`mem_cache/storage/mooncake_store/
mooncake_store.py`) reads it: the extra config when it names `master_server_address`, else
the JSON file at $SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, else the environment (MOONCAKE_MASTER,
MOONCAKE_TE_META_DATA_SERVER, MOONCAKE_PROTOCOL, MOONCAKE_DEVICE, MOONCAKE_LOCAL_HOSTNAME,
MOONCAKE_GLOBAL_SEGMENT_SIZE).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

from hiserve.mem_cache.storage.base import HiCacheStorage

if TYPE_CHECKING:
    from hiserve.mem_cache.memory_pool_host import HostKVCache

logger = logging.getLogger(__name__)

ENV_CONFIG_PATH = "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH"
DEFAULT_GLOBAL_SEGMENT_SIZE = 4 * 1024**3  # SGLang's default ("4gb"): memory this client lends
DEFAULT_LOCAL_BUFFER_SIZE = 16 * 1024**2  # zero-copy calls do not use it; SGLang's 16 MiB
DEFAULT_RETRY_INTERVAL_S = 5.0
PROBE_TIMEOUT_S = 1.0
CLOSE_WAIT_S = 5.0  # a close takes ~1.5-2 s with a live master (it stops its ping thread)

OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705
# Mooncake ErrorCode (mooncake-store/include/types.h) -> failure reason.
_REASONS = {-200: "no_space", -600: "size_mismatch", -707: "lease_expired", -800: "transfer_error",
            -900: "unavailable", -901: "timeout"}

_SIZE_RE = re.compile(r"^\s*([0-9.]+)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)


def parse_size(value: Any) -> int:
    """Bytes from an int or a size string ("4gb", "512MB", "1.5g", "1073741824").

    Raises:
        ValueError: anything else (the message names the value).
    """
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int):
        return value
    m = _SIZE_RE.match(str(value))
    if not m:
        raise ValueError(f"invalid size {value!r}; use bytes or e.g. '4gb', '512mb'")
    return int(float(m.group(1)) * 1024 ** " kmgt".index((m.group(2) or " ").lower()))


_NAMES = {-200: "NO_AVAILABLE_HANDLE: store full", -600: "INVALID_PARAMS: object size differs from the page",
          -707: "LEASE_EXPIRED during the transfer", -800: "TRANSFER_FAIL", -900: "RPC_FAIL: master unreachable",
          -901: "RPC_TIMEOUT: master did not answer"}


def error_reason(code: int) -> str:
    """Failure reason of a negative Mooncake error code ("io_error" when not a known one)."""
    return _REASONS.get(code, "io_error")


def describe(code: int) -> str:
    """"error code -900 (RPC_FAIL: master unreachable)" for a log or state()."""
    name = _NAMES.get(code)
    return f"error code {code}" + (f" ({name})" if name else "")


@dataclass
class MooncakeStoreConfig:
    """Client settings (SGLang's key names).

    Attributes:
        master_server_address: "host:port" of `mooncake_master`'s RPC port.
        metadata_server: transfer-engine metadata: "http://host:port/metadata" (the master's
            HTTP metadata server) or "P2PHANDSHAKE" (none needed).
        protocol: "tcp" (any machine) or "rdma".
        device_name: RDMA device(s), "" for TCP.
        local_hostname: address other clients reach this one at.
        global_segment_size: bytes of memory this client lends to the store.
        local_buffer_size: bytes of the client's own staging buffer (unused by zero-copy calls).
        connect_retry_interval: seconds between connection attempts while the master is
            unreachable (hiserve's own key).
    """

    master_server_address: str
    metadata_server: str = "P2PHANDSHAKE"
    protocol: str = "tcp"
    device_name: str = ""
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = DEFAULT_GLOBAL_SEGMENT_SIZE
    local_buffer_size: int = DEFAULT_LOCAL_BUFFER_SIZE
    connect_retry_interval: float = DEFAULT_RETRY_INTERVAL_S

    @staticmethod
    def from_dict(d: dict, source: str) -> "MooncakeStoreConfig":
        """From a dict with SGLang's keys; `source` names it in errors.

        Raises:
            ValueError: no `master_server_address`, a bad size or a negative retry interval.
        """
        if not d.get("master_server_address"):
            raise ValueError(f"mooncake storage: {source} has no master_server_address")
        def size(key: str, default: int) -> int:
            try:
                return parse_size(d.get(key, default))
            except ValueError as exc:
                raise ValueError(f"{key}: {exc}") from exc

        try:
            cfg = MooncakeStoreConfig(
                master_server_address=str(d["master_server_address"]),
                metadata_server=str(d.get("metadata_server") or "P2PHANDSHAKE"),
                protocol=str(d.get("protocol") or "tcp").lower(),
                device_name=str(d.get("device_name") or ""),
                local_hostname=str(d.get("local_hostname") or "127.0.0.1"),
                global_segment_size=size("global_segment_size", DEFAULT_GLOBAL_SEGMENT_SIZE),
                local_buffer_size=size("local_buffer_size", DEFAULT_LOCAL_BUFFER_SIZE),
                connect_retry_interval=float(d.get("connect_retry_interval", DEFAULT_RETRY_INTERVAL_S)))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"mooncake storage: {source}: {exc}") from exc
        if cfg.connect_retry_interval < 0:
            raise ValueError(f"mooncake storage: {source}: connect_retry_interval must be >= 0")
        return cfg

    @staticmethod
    def resolve(extra_config: dict) -> "MooncakeStoreConfig":
        """SGLang's order: the extra config if it names the master, else the JSON file at
        $SGLANG_HICACHE_MOONCAKE_CONFIG_PATH, else MOONCAKE_* environment variables.

        Raises:
            ValueError: none of the three names a master, or the file is unreadable / not JSON.
        """
        if extra_config.get("master_server_address"):
            return MooncakeStoreConfig.from_dict(extra_config, "--hicache-storage-backend-extra-config")
        path = os.environ.get(ENV_CONFIG_PATH)
        if path:
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f)
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"mooncake storage: cannot read ${ENV_CONFIG_PATH} {path!r}: {exc}") from exc
            return MooncakeStoreConfig.from_dict({**extra_config, **data}, f"${ENV_CONFIG_PATH} {path!r}")
        env = {"master_server_address": os.environ.get("MOONCAKE_MASTER"),
               "metadata_server": os.environ.get("MOONCAKE_TE_META_DATA_SERVER"),
               "protocol": os.environ.get("MOONCAKE_PROTOCOL"),
               "device_name": os.environ.get("MOONCAKE_DEVICE"),
               "local_hostname": os.environ.get("MOONCAKE_LOCAL_HOSTNAME"),
               "global_segment_size": os.environ.get("MOONCAKE_GLOBAL_SEGMENT_SIZE")}
        env = {k: v for k, v in env.items() if v}
        if "master_server_address" not in env:
            raise ValueError("mooncake storage needs a master: set master_server_address in "
                             "--hicache-storage-backend-extra-config, a config file in "
                             f"${ENV_CONFIG_PATH}, or $MOONCAKE_MASTER")
        return MooncakeStoreConfig.from_dict({**extra_config, **env}, "the MOONCAKE_* environment")


def _host_port(address: str, default_port: int) -> tuple[str, int]:
    """("host", port) of "host:port", "[v6]:port" or a URL."""
    if "://" in address:
        u = urlparse(address)
        return u.hostname or "127.0.0.1", u.port or default_port
    host, _, port = address.rpartition(":")
    return (host.strip("[]") or "127.0.0.1", int(port)) if port.isdigit() else (address, default_port)


def probe(address: str, default_port: int, timeout: float = PROBE_TIMEOUT_S) -> str | None:
    """None when a TCP connection to `address` opens within `timeout` s, else the error text."""
    try:
        host, port = _host_port(address, default_port)
        with socket.create_connection((host, port), timeout=timeout):
            return None
    except (OSError, ValueError) as exc:
        return f"{address}: {exc}"


class MooncakeStore(HiCacheStorage):
    """Pages in a Mooncake Store (SGLang `--hicache-storage-backend mooncake`).

    Args:
        host_pool: a page-first host pool; its `buffer` (uint8, CPU) is registered once.
        namespace: `keys.storage_namespace(...)`; every object name starts with it.
        extra_config: SGLang's keys (`MooncakeStoreConfig`); other keys are ignored.
    Raises:
        ImportError: the `mooncake` package is not installed (message says which wheel).
        ValueError: no master configured, a bad size, or a `layer_first` host pool.
        A master that cannot be reached never raises: the backend starts unavailable
        (counted, `state()["connected"]` False) and connects when the master appears.
    """

    name = "mooncake"

    def __init__(self, host_pool: "HostKVCache", namespace: str, extra_config: dict) -> None:
        super().__init__(host_pool, namespace)
        self.config = MooncakeStoreConfig.resolve(extra_config)
        try:
            from mooncake.store import MooncakeDistributedStore
        except ImportError as exc:
            raise ImportError("--hicache-storage-backend mooncake needs the Mooncake wheel: pip install "
                              "mooncake-transfer-engine-non-cuda (CPU) or mooncake-transfer-engine (CUDA); "
                              f"it also needs the system library libibverbs1 ({exc})") from exc
        self._store_cls = MooncakeDistributedStore
        self._store: Any = None  # a set-up client with the host pool registered, or None
        self._connect_lock = threading.Lock()
        self._next_attempt = 0.0
        self._closed = False
        self._last_error = ""
        self._healthy = False  # last health seen, to log each loss and recovery once
        if not self._connect():
            self._fail("unavailable", self._last_error)

    # ------------------------------------------------------------------ connection

    def _connect(self) -> bool:
        """Set up a client and register the host pool, if the master answers a TCP probe.
        Rate-limited to one attempt per `connect_retry_interval`; True when connected."""
        with self._connect_lock:
            if self._store is not None:
                return True
            now = time.monotonic()
            if self._closed or now < self._next_attempt:
                return False
            self._next_attempt = now + self.config.connect_retry_interval
            cfg = self.config
            # setup() blocks until the master answers, so never call it on an unreachable one.
            err = probe(cfg.master_server_address, 50051)
            if err is None and cfg.metadata_server.startswith("http"):
                err = probe(cfg.metadata_server, 80)
            if err is not None:
                return self._connect_failed("master or metadata server unreachable: " + err)
            store = self._store_cls()
            buf = self.host_pool.buffer
            try:
                rc = store.setup(cfg.local_hostname, cfg.metadata_server, cfg.global_segment_size,
                                 cfg.local_buffer_size, cfg.protocol, cfg.device_name, cfg.master_server_address)
                if rc != 0:
                    return self._connect_failed(f"setup returned {rc}")
                rc = store.register_buffer(buf.data_ptr(), buf.numel())
                if rc != 0:
                    store.close()
                    return self._connect_failed(f"register_buffer of the host pool returned {rc}")
            except (RuntimeError, TypeError, ValueError) as exc:  # a binding that raises: still a miss
                return self._connect_failed(f"setup: {exc}")
            self._store, self._healthy = store, True
            logger.info("mooncake storage: connected to master %s (metadata %s, %s), host pool of %d bytes "
                        "registered", cfg.master_server_address, cfg.metadata_server, cfg.protocol, buf.numel())
            return True

    def _connect_failed(self, detail: str) -> bool:
        self._last_error = detail
        return False

    def _client(self) -> Any:
        """The client when the master is reachable now, else None (counted "unavailable")."""
        if self._closed:
            return None
        if self._store is None and not self._connect():
            self._fail("unavailable", self._last_error)
            return None
        store = self._store  # read once: close() may clear it from another thread
        if store is None:
            return None
        health = store.health_check()
        if health != 0:
            # The client reconnects by itself; calling now would block ~4.5 s to fail.
            self._last_error = f"health_check() = {health} (master unreachable)"
            if self._healthy:
                logger.warning("mooncake storage: master %s unreachable; storage calls miss until it "
                               "is back", self.config.master_server_address)
            self._healthy = False
            self._fail("unavailable", self._last_error)
            return None
        if not self._healthy:
            logger.info("mooncake storage: master %s reachable again", self.config.master_server_address)
            self._healthy = True
        return store

    def _check_codes(self, codes: list[int], op: str) -> None:
        """Count the first real failure among per-object codes (not-found is a miss)."""
        bad = [c for c in codes if c < 0 and c != OBJECT_NOT_FOUND]
        if bad:
            self._last_error = f"{op}: {describe(bad[0])}"
            self._fail(error_reason(bad[0]), self._last_error)

    # ------------------------------------------------------------------ helpers

    def _objects(self, keys: list[str], host_pages: list[int] | None) -> tuple[list[str], list[int], list[int]]:
        """Object names, and (with host pages) their addresses and sizes in the pool, page-major."""
        names = [name for key in keys for name in self.object_keys(key)]
        if host_pages is None:
            return names, [], []
        base = self.host_pool.buffer.data_ptr()
        ptrs, sizes = [], []
        for page in host_pages:
            for kind in self.kinds:
                offset, nbytes = self.host_pool.page_byte_range(kind, page)
                ptrs.append(base + offset)
                sizes.append(nbytes)
        return names, ptrs, sizes

    def _leading(self, ok: list[bool]) -> int:
        """Leading pages whose every kind is ok (`ok` is per object, page-major)."""
        n = len(self.kinds)
        for page in range(len(ok) // n):
            if not all(ok[page * n:(page + 1) * n]):
                return page
        return len(ok) // n

    # ------------------------------------------------------------------ contract

    def batch_exists(self, keys: list[str]) -> int:
        """Leading pages of `keys` present with every kind (0..len(keys)); 0 when unavailable.
        (Mooncake grants a read lease on what it finds: those objects are not evicted for
        the lease TTL, which covers the get that usually follows.)"""
        if not keys:
            return 0
        store = self._client()
        if store is None:
            return 0
        names, _, _ = self._objects(keys, None)
        codes = store.batch_is_exist(names)
        self._check_codes(codes, "batch_is_exist")
        return self._leading([c == 1 for c in codes])

    def _transfer_call(self, op: str, keys: list[str], host_pages: list[int]):
        """(client, object names, pointers, sizes) for a page transfer, or None when there is
        nothing to do or no master now (counted by `_client`).

        Raises:
            ValueError: `len(keys) != len(host_pages)` or a host page out of range.
        """
        if len(keys) != len(host_pages):
            raise ValueError(f"{op}: {len(keys)} keys for {len(host_pages)} host pages")
        if not keys:
            return None
        names, ptrs, sizes = self._objects(keys, host_pages)
        store = self._client()
        return None if store is None else (store, names, ptrs, sizes)

    def batch_get_into(self, keys: list[str], host_pages: list[int]) -> int:
        """Read pages straight into host pages `host_pages` (every kind). Returns the leading
        pages read whole (each object exactly its page's bytes); later pages may hold garbage.

        Raises:
            ValueError: `len(keys) != len(host_pages)` or a host page out of range.
        """
        call = self._transfer_call("batch_get_into", keys, host_pages)
        if call is None:
            return 0
        store, names, ptrs, sizes = call
        start = time.perf_counter()
        got = store.batch_get_into(names, ptrs, sizes)
        self._check_codes(got, "batch_get_into")
        ok = [g == s for g, s in zip(got, sizes)]
        if any(0 <= g != s for g, s in zip(got, sizes)):
            self._fail("size_mismatch", "batch_get_into: an object's size differs from its page's")
        pages = self._leading(ok)
        self._count(pages_read=pages, bytes_read=sum(sizes[:pages * len(self.kinds)]),
                    read_seconds=time.perf_counter() - start)
        return pages

    def batch_set_from(self, keys: list[str], host_pages: list[int]) -> int:
        """Write host pages `host_pages` under `keys` (every kind), skipping objects the store
        already has. Returns the leading pages stored (written now or already present): the
        caller marks exactly those as in storage, so a page after a failed one does not count.

        Raises:
            ValueError: `len(keys) != len(host_pages)` or a host page out of range.
        """
        call = self._transfer_call("batch_set_from", keys, host_pages)
        if call is None:
            return 0
        store, names, ptrs, sizes = call
        start = time.perf_counter()
        present = store.batch_is_exist(names)
        self._check_codes(present, "batch_is_exist")
        if any(c < 0 for c in present):
            # Typically the master just died: a put now would block in RPC retries to fail.
            return 0
        todo = [i for i, c in enumerate(present) if c != 1]
        stored = [c == 1 for c in present]
        if todo:
            codes = store.batch_put_from([names[i] for i in todo], [ptrs[i] for i in todo],
                                         [sizes[i] for i in todo])
            self._check_codes(codes, "batch_put_from")
            for i, code in zip(todo, codes):
                stored[i] = code in (0, OBJECT_ALREADY_EXISTS)
            written_bytes = sum(sizes[i] for i, code in zip(todo, codes) if code == 0)
        else:
            written_bytes = 0
        n = len(self.kinds)
        whole = [all(stored[p * n:(p + 1) * n]) for p in range(len(keys))]
        skipped = sum(all(present[p * n + k] == 1 for k in range(n)) for p in range(len(keys)))
        self._count(pages_written=sum(whole) - skipped, pages_skipped=skipped, bytes_written=written_bytes,
                    write_seconds=time.perf_counter() - start)
        return self._leading(stored)

    def clear(self) -> None:
        """Remove this namespace's objects (`remove_by_regex("^<namespace>/")`; Mooncake's
        `remove_all` would also drop other models' and configurations' pages). Objects under a
        read lease (read or checked within the master's `--default_kv_lease_ttl`, 10 s by
        default) are kept, as Mooncake keeps them: forcing would free memory a replica may be
        reading from."""
        store = self._client()
        if store is None:
            return
        removed = store.remove_by_regex("^" + re.escape(self.namespace) + "/", False)
        if removed < 0:
            self._last_error = f"remove_by_regex: {describe(removed)}"
            self._fail(error_reason(removed), self._last_error)
        else:
            logger.info("mooncake storage: cleared %d objects of %s", removed, self.namespace)

    def close(self) -> None:
        """Unregister the host pool and close the client (idempotent). Call after the storage
        worker has stopped calling and before the host pool is freed. Waits at most
        `CLOSE_WAIT_S` (a close with a dead master retries its unmount for ~10 s; it then
        finishes on a daemon thread)."""
        with self._connect_lock:
            store, self._store, self._closed = self._store, None, True
        if store is None:
            return
        buf = self.host_pool.buffer

        def _close() -> None:
            if buf is not None:
                store.unregister_buffer(buf.data_ptr())
            store.close()

        t = threading.Thread(target=_close, name="mooncake-close", daemon=True)
        t.start()
        t.join(CLOSE_WAIT_S)
        if t.is_alive():
            logger.warning("mooncake storage: close did not finish in %.0f s (master unreachable?); "
                           "leaving it to a background thread", CLOSE_WAIT_S)

    def state(self) -> dict:
        """Backend, namespace, master and metadata addresses, protocol, whether the master is
        reachable now, the last error, and failures by reason."""
        store = self._store
        connected = store is not None and not self._closed and store.health_check() == 0
        return {**super().state(), "master_server_address": self.config.master_server_address,
                "metadata_server": self.config.metadata_server, "protocol": self.config.protocol,
                "connected": connected, "closed": self._closed, "last_error": self._last_error,
                "failures": dict(self.stats().failures)}
