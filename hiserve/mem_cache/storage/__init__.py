"""The storage tier (L3): backends behind one contract (`base.HiCacheStorage`).

`create_storage(backend, host_pool, namespace, extra_config)` builds one by name, as
`--hicache-storage-backend` spells it; `parse_extra_config` reads
`--hicache-storage-backend-extra-config` (inline JSON or `@path/to/file.json`, as SGLang) and
`check_extra_config` checks it when the flags are resolved.
"""

from __future__ import annotations

import json
import logging
from typing import TYPE_CHECKING

from hiserve.mem_cache.storage.base import HiCacheStorage, StorageStats

if TYPE_CHECKING:
    from hiserve.mem_cache.memory_pool_host import HostKVCache

STORAGE_BACKENDS = ("file", "mooncake")

logger = logging.getLogger(__name__)

__all__ = ["STORAGE_BACKENDS", "HiCacheStorage", "StorageStats", "create_storage", "parse_extra_config",
           "unknown_extra_config_keys", "check_extra_config"]

# Keys each backend reads (SGLang's names where SGLang has them), and the integration's own
# (`storage_controller.StorageConfig`).
COMMON_EXTRA_KEYS = frozenset({"prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token"})
BACKEND_EXTRA_KEYS = {
    "file": frozenset({"file_storage_path", "storage_size_cap_gb", "file_fsync", "file_io_threads"}),
    "mooncake": frozenset({"master_server_address", "metadata_server", "protocol", "device_name",
                           "local_hostname", "global_segment_size", "local_buffer_size", "connect_retry_interval"}),
}


def unknown_extra_config_keys(backend: str, extra_config: dict) -> list[str]:
    """Keys of `extra_config` that neither `backend` nor the storage integration reads (sorted);
    a misspelt key would otherwise fall back to its default silently."""
    known = COMMON_EXTRA_KEYS | BACKEND_EXTRA_KEYS.get(backend, frozenset())
    return sorted(k for k in extra_config if k not in known)


def create_storage(backend: str, host_pool: "HostKVCache", namespace: str,
                   extra_config: dict) -> HiCacheStorage:
    """A storage backend by name.

    Args:
        backend: one of `STORAGE_BACKENDS`.
        host_pool: the page-first host pool it reads into and writes from.
        namespace: `keys.storage_namespace(...)`.
        extra_config: the parsed extra config (SGLang key names; each backend reads its own).
    Raises:
        ValueError: an unknown backend name, or what the backend's constructor raises for
            a bad configuration (e.g. a `layer_first` host pool).
        ImportError: the backend's library is not installed (mooncake).
    """
    if backend == "file":
        from hiserve.mem_cache.storage.file_backend import FileStorage

        return FileStorage(host_pool, namespace, extra_config)
    if backend == "mooncake":
        from hiserve.mem_cache.storage.mooncake_backend import MooncakeStore

        return MooncakeStore(host_pool, namespace, extra_config)
    raise ValueError(f"unknown hicache storage backend {backend!r}; choose one of {', '.join(STORAGE_BACKENDS)}")


def parse_extra_config(text: str | None) -> dict:
    """`--hicache-storage-backend-extra-config`: a JSON object inline, or `@path` to a JSON file.

    Returns {} for None or blank text.
    Raises:
        ValueError: unreadable file, invalid JSON, or JSON that is not an object (the message
            names the flag and, for a file, the path).
    """
    flag = "--hicache-storage-backend-extra-config"
    if text is None or not text.strip():
        return {}
    text = text.strip()
    source = "inline JSON"
    if text.startswith("@"):
        path = text[1:]
        source = f"file {path!r}"
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"{flag}: cannot read {source}: {exc.strerror or exc}") from exc
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{flag}: invalid JSON in {source}: {exc}") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{flag}: {source} must be a JSON object, got {type(config).__name__}")
    return config


def check_extra_config(backend: str, extra_config: dict) -> None:
    """Check `backend`'s own extra-config values that need no connection (the `file` size cap
    and read threads; a mooncake master is reached only at start-up) and log a warning naming
    any key nothing reads.

    Raises:
        ValueError: a bad value; the message names the flag and the key.
    """
    from hiserve.mem_cache.storage.io_threads import io_threads_from

    flag = "--hicache-storage-backend-extra-config"
    if backend == "file":
        cap = extra_config.get("storage_size_cap_gb", 0) or 0
        if isinstance(cap, bool) or not isinstance(cap, (int, float)) or cap < 0:
            raise ValueError(f"{flag}: storage_size_cap_gb must be a number >= 0 (GB), got {cap!r}")
        try:
            io_threads_from(extra_config)
        except ValueError as exc:
            raise ValueError(f"{flag}: {exc}") from exc
    unknown = unknown_extra_config_keys(backend, extra_config)
    if unknown:
        known = sorted(COMMON_EXTRA_KEYS | BACKEND_EXTRA_KEYS.get(backend, frozenset()))
        logger.warning("%s: ignoring key(s) the %s backend does not read: %s (known: %s)",
                       flag, backend, ", ".join(unknown), ", ".join(known))
