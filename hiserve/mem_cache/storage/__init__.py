"""The storage tier (L3): backends behind one contract (`base.HiCacheStorage`).

`create_storage(backend, host_pool, namespace, extra_config)` builds one by name, as
`--hicache-storage-backend` spells it; `parse_extra_config` reads
`--hicache-storage-backend-extra-config` (inline JSON or `@path/to/file.json`, as SGLang).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from hiserve.mem_cache.storage.base import HiCacheStorage, StorageStats

if TYPE_CHECKING:
    from hiserve.mem_cache.memory_pool_host import HostKVCache

STORAGE_BACKENDS = ("file", "mooncake")

__all__ = ["STORAGE_BACKENDS", "HiCacheStorage", "StorageStats", "create_storage", "parse_extra_config"]


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
