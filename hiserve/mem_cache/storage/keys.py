"""Storage keys: a chained hash per page, namespaced by configuration.

Page i's key is `sha256(key of page i-1 || token ids of page i)`, so one key names the whole
prefix up to the end of its page: two requests share a storage page exactly when they share
every token before its end. The chain starts from the namespace's own hash, so two models
or configurations (dtype, page size, host layout, KV kinds and shapes) never read each
other's pages. `hashlib` is used rather than `hash()`, whose seed changes per process: keys
must agree across restarts and replicas. (SGLang chains per-page SHA-256 the same way:
`get_hash_str` in `mem_cache/hicache_storage.py`.)
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

KEY_FORMAT_VERSION = 1  # bump when the object format or the hash input changes


def storage_namespace(model: str, dtype: str, page_size: int, layout: str,
                      kinds: Sequence[tuple[str, Sequence[int]]], layer_num: int,
                      extra: str = "") -> str:
    """A short, filesystem- and key-safe namespace for one KV configuration.

    Args:
        model: model identity (path or name, plus any GGUF file / revision).
        dtype: KV dtype name, e.g. "bfloat16".
        page_size: tokens per page.
        layout: host layout ("page_first" or "page_first_direct": the byte order differs).
        kinds: (kind name, item shape) per KV kind, e.g. [("k", (4, 64)), ("v", (4, 64))].
        layer_num: layers in the KV pool.
        extra: anything else that changes the KV bytes (e.g. tensor-parallel rank).
    Returns:
        "hiserve-v{N}-{16 hex digits}".
    """
    desc = repr((KEY_FORMAT_VERSION, model, dtype, page_size, layout,
                 [(n, tuple(s)) for n, s in kinds], layer_num, extra))
    return f"hiserve-v{KEY_FORMAT_VERSION}-{hashlib.sha256(desc.encode()).hexdigest()[:16]}"


def page_keys(token_ids: Sequence[int], page_size: int, namespace: str,
              start_page: int = 0, prior: str | None = None) -> list[str]:
    """Keys of the full pages of `token_ids` (a trailing partial page has none).

    Args:
        token_ids: the prefix, from its first token (or from page `start_page` with `prior`).
        page_size: tokens per page.
        namespace: `storage_namespace(...)`; seeds the chain.
        start_page: index of the first page in `token_ids` (with `prior`: the key of the
            page before it), to extend a chain without rehashing its start.
        prior: key of page `start_page - 1` (None: start a new chain at page 0).
    Returns:
        one 64-hex-digit key per full page, prefixed with the namespace.
    Raises:
        ValueError: `start_page > 0` without `prior`.
    """
    if start_page > 0 and prior is None:
        raise ValueError("page_keys: start_page > 0 needs the prior page's key")
    h = (prior.rsplit("/", 1)[-1] if prior else hashlib.sha256(namespace.encode()).hexdigest())
    keys = []
    for i in range(len(token_ids) // page_size):
        page = token_ids[i * page_size:(i + 1) * page_size]
        h = hashlib.sha256(bytes.fromhex(h) + struct.pack(f"<{page_size}q", *page)).hexdigest()
        keys.append(f"{namespace}/{h}")
    return keys
