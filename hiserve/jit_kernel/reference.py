"""Torch versions of every device <-> host KV transfer.

They are the CPU path of the engine and the oracle that the CUDA kernels are tested
against (`torch.equal`: every transfer is an exact copy, no dtype change).

Vocabulary (shared with `hiserve.mem_cache.memory_pool_host`):

* A *kind* is one stored tensor family: MHA has two (K and V), MLA one (the latent row).
* Device side, always `layer_first`: a list of `L` tensors `[device_slots, *item]`, one per
  layer, with `item = (H, Dh)` for MHA and `(1, Dm)` for MLA.
* Host side, one buffer per kind, S host slots, P tokens per page:

  | layout              | per-kind host shape      |
  |---------------------|--------------------------|
  | `layer_first`       | `[L, S, *item]`          |
  | `page_first`        | `[S, L, *item]`          |
  | `page_first_direct` | `[S/P, L, P, *item]`     |

  A host pool keeps one such buffer per kind (`HostKVCache.kv_buffers`).
* A transfer takes a sequence of kinds, each a `KVKind(device_layers, host)`, and moves
  every kind the same way.
* `device_indices` are slots of the device pool, on the device layers' device;
  `host_indices` are slots of the host pool, on the host buffer's device (the CPU).
  Both are 1-D int32 or int64 of equal length, a whole number of pages; the i-th device
  slot goes to (or comes from) the i-th host slot.

Write-back (device -> host) moves all layers at once; load-back (host -> device) moves
one layer, so attention on that layer can start while later layers are still arriving.

The plain functions copy token by token (advanced indexing), so they are exact for any
index values. The staged function follows the page structure the way the CUDA staged
kernel does (only the first slot of each page is read), so it requires page-aligned runs
of whole pages on both sides; comparing the two is the point of the oracle.
"""

from __future__ import annotations

from typing import NamedTuple, Sequence

import torch

LAYOUTS = ("layer_first", "page_first", "page_first_direct")

# Pages per chunk of the staged write-back (the staging buffer holds at most this many).
WRITE_BACK_STAGING_PAGE_CHUNK = 64

_INDEX_DTYPES = (torch.int32, torch.int64)


# ----------------------------------------------------------------------------- shapes


def host_kind_shape(
    layout: str, host_slots: int, layer_num: int, page_size: int, item_shape: Sequence[int]
) -> tuple[int, ...]:
    """Shape of one kind's host buffer (K, V or the MLA row) for `layout`.

    Raises:
        ValueError: unknown layout, or `host_slots` not a whole number of pages.
    """
    check_layout(layout)
    if host_slots % page_size:
        raise ValueError(f"host_slots={host_slots} is not a multiple of page_size={page_size}")
    item = tuple(item_shape)
    if layout == "layer_first":
        return (layer_num, host_slots, *item)
    if layout == "page_first":
        return (host_slots, layer_num, *item)
    return (host_slots // page_size, layer_num, page_size, *item)


def host_kind_slots(layout: str, host: torch.Tensor, page_size: int) -> int:
    """Number of host slots S held by one kind's host buffer of `layout`."""
    if layout == "layer_first":
        return host.shape[1]
    if layout == "page_first":
        return host.shape[0]
    return host.shape[0] * page_size


# ----------------------------------------------------------------------------- checks


def check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"unknown host layout {layout!r}; expected one of {LAYOUTS}")


def check_index_tensor(indices: torch.Tensor, name: str, device: torch.device) -> None:
    """1-D int32/int64 tensor on `device`, else ValueError naming the offending value."""
    if not isinstance(indices, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(indices).__name__}")
    if indices.dtype not in _INDEX_DTYPES:
        raise ValueError(f"{name} must be int32 or int64, got {indices.dtype}")
    if indices.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(indices.shape)}")
    if indices.device != device:
        raise ValueError(f"{name} must be on {device}, got {indices.device}")


def check_page_runs(indices: torch.Tensor, page_size: int, name: str) -> None:
    """Check that `indices` are whole pages: length a multiple of page_size, and (CPU only)
    every page is `start, start+1, ..., start+P-1` with `start % P == 0`.

    The value check is skipped for indices on an accelerator: reading them would
    synchronise the host with the device, which the transfer path must never do.
    """
    n = indices.numel()
    if n % page_size:
        raise ValueError(f"{name} has {n} slots, not a multiple of page_size={page_size}")
    if page_size == 1 or n == 0 or indices.device.type != "cpu":
        return
    pages = indices.view(-1, page_size).to(torch.int64)
    starts = pages[:, :1]
    offsets = torch.arange(page_size, dtype=torch.int64)
    if bool((starts % page_size != 0).any()) or not torch.equal(pages - starts, offsets.expand_as(pages)):
        bad = int(((starts % page_size != 0).squeeze(1) | (pages - starts != offsets).any(dim=1)).nonzero()[0])
        raise ValueError(
            f"{name} must be page-aligned runs of {page_size} consecutive slots; page {bad} is "
            f"{pages[bad].tolist()}"
        )


def _check_pair(device_indices: torch.Tensor, host_indices: torch.Tensor, page_size: int) -> None:
    if device_indices.numel() != host_indices.numel():
        raise ValueError(
            f"device_indices ({device_indices.numel()}) and host_indices ({host_indices.numel()}) "
            "must have the same length"
        )
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")


class KVKind(NamedTuple):
    """One kind of a transfer: the device pool's L per-layer tensors of that kind, each
    `[device_slots, *item]`, and the host buffer of the same kind (per-kind shape of the layout).

    Plain `(device_layers, host)` tuples are accepted wherever a KVKind is."""

    device_layers: Sequence[torch.Tensor]
    host: torch.Tensor


def _check_kind(
    layout: str,
    device_layers: Sequence[torch.Tensor],
    host: torch.Tensor,
    page_size: int,
    name: str,
    layer_id: int | None = None,
) -> None:
    """The device layers and the host buffer of one kind agree on layers, item shape, dtype.

    With `layer_id` (a load-back) only that layer is inspected: checking all L layers on each
    of the L per-layer calls would cost O(L^2) Python work per load-back."""
    if len(device_layers) == 0:
        raise ValueError(f"{name}: no device layers given")
    if layer_id is not None and not 0 <= layer_id < len(device_layers):
        raise ValueError(f"layer_id={layer_id} out of range for {len(device_layers)} layers")
    first = device_layers[0 if layer_id is None else layer_id]
    item = tuple(first.shape[1:])
    for index, layer in enumerate(device_layers if layer_id is None else ()):
        if tuple(layer.shape[1:]) != item or layer.dtype != first.dtype or layer.device != first.device:
            raise ValueError(
                f"{name}: device layer {index} is {tuple(layer.shape)} {layer.dtype} on {layer.device}, "
                f"layer 0 is {tuple(first.shape)} {first.dtype} on {first.device}"
            )
    if host.dtype != first.dtype:
        raise ValueError(f"{name}: host dtype {host.dtype} != device dtype {first.dtype} (copies are exact)")
    slots = host_kind_slots(layout, host, page_size)
    expected = host_kind_shape(layout, slots, len(device_layers), page_size, item)
    if tuple(host.shape) != expected:
        raise ValueError(
            f"{name}: host buffer shape {tuple(host.shape)} does not match layout {layout!r} "
            f"with L={len(device_layers)}, P={page_size}, item={item}; expected {expected}"
        )


def _check_kinds(layout, kinds, page_size, layer_id=None) -> torch.device:
    """Every kind checked; returns the device of the device layers (one for all kinds)."""
    if len(kinds) == 0:
        raise ValueError("no kinds given")
    pick = 0 if layer_id is None else layer_id
    for index, (layers, host) in enumerate(kinds):
        _check_kind(layout, layers, host, page_size, f"kind {index}", layer_id)
        if layers[pick].device != kinds[0][0][pick].device:
            raise ValueError(f"kind {index}: device layers on {layers[pick].device}, kind 0 on "
                             f"{kinds[0][0][pick].device}")
    return kinds[0][0][pick].device


def _check_transfer(layout, kinds, device_indices, host_indices, page_size, layer_id=None) -> None:
    check_layout(layout)
    _check_pair(device_indices, host_indices, page_size)
    device = _check_kinds(layout, kinds, page_size, layer_id)
    check_index_tensor(device_indices, "device_indices", device)
    check_index_tensor(host_indices, "host_indices", kinds[0][1].device)
    check_page_runs(host_indices, page_size, "host_indices")


# ----------------------------------------------------------------------------- plain copies


def _write_back_kind(
    device_layers: Sequence[torch.Tensor],
    host: torch.Tensor,
    layout: str,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
) -> None:
    dev_idx = device_indices.to(torch.int64)
    host_idx = host_indices.to(torch.int64)
    if layout == "page_first_direct":
        host_page, host_off = host_idx // page_size, host_idx % page_size
    for layer_id, layer in enumerate(device_layers):
        rows = layer[dev_idx].to(host.device)  # [n, *item]
        if layout == "layer_first":
            host[layer_id, host_idx] = rows
        elif layout == "page_first":
            host[host_idx, layer_id] = rows
        else:
            host[host_page, layer_id, host_off] = rows


def _load_back_kind(
    host: torch.Tensor,
    device_layer: torch.Tensor,
    layout: str,
    layer_id: int,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
) -> None:
    host_idx = host_indices.to(torch.int64)
    if layout == "layer_first":
        rows = host[layer_id, host_idx]
    elif layout == "page_first":
        rows = host[host_idx, layer_id]
    else:
        rows = host[host_idx // page_size, layer_id, host_idx % page_size]
    device_layer[device_indices.to(torch.int64)] = rows.to(device_layer.device)


def write_back_all_layer_ref(
    kinds: Sequence[KVKind],
    layout: str,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Write-back of every layer of every kind: device `layer_first` -> host `layout`.

    Args:
        kinds: per kind (MHA: K then V; MLA: the latent row) a `KVKind(device_layers, host)`:
            L device tensors `[device_slots, *item]` and that kind's host buffer (per-kind
            shape of `layout`, e.g. a host pool's `kv_buffers[i]`).
        layout: `layer_first`, `page_first` or `page_first_direct`.
        device_indices: int32/int64 `[n]` on the device layers' device.
        host_indices: int32/int64 `[n]` on the host buffers' device, page-aligned runs of whole pages.
        page_size: tokens per page P.
    Raises:
        ValueError: shapes, dtypes, devices or indices that do not fit (message names the value).
    """
    _check_transfer(layout, kinds, device_indices, host_indices, page_size)
    for layers, host in kinds:
        _write_back_kind(layers, host, layout, device_indices, host_indices, page_size)


def load_back_one_layer_ref(
    kinds: Sequence[KVKind],
    layout: str,
    layer_id: int,
    *,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
) -> None:
    """Load-back of layer `layer_id` of every kind: host `layout` -> device `layer_first`
    (writes `device_layers[layer_id]` of each kind).

    Args:
        kinds, host_indices, device_indices, page_size: as in `write_back_all_layer_ref`.
        layer_id: which layer to move.
    Raises:
        ValueError: as in `write_back_all_layer_ref`, or layer_id out of range.
    """
    _check_transfer(layout, kinds, device_indices, host_indices, page_size, layer_id)
    for layers, host in kinds:
        _load_back_kind(host, layers[layer_id], layout, layer_id, host_indices, device_indices, page_size)


# ----------------------------------------------------------------------------- staged write-back


def _staging_buffers(kinds, stagings, num_pages, page_size, device) -> list[torch.Tensor]:
    """The given staging buffer of each kind (checked), or a temporary of min(pages, 64) pages."""
    stagings = [None] * len(kinds) if stagings is None else list(stagings)
    if len(stagings) != len(kinds):
        raise ValueError(f"{len(stagings)} staging buffers for {len(kinds)} kinds")
    layer_num, out = len(kinds[0][0]), []
    for index, ((layers, host), staging) in enumerate(zip(kinds, stagings)):
        item = tuple(layers[0].shape[1:])
        if staging is None:
            capacity = min(num_pages, WRITE_BACK_STAGING_PAGE_CHUNK)
            staging = torch.empty((capacity, page_size, layer_num, *item), dtype=host.dtype, device=device)
        elif (
            staging.dim() != 3 + len(item)
            or tuple(staging.shape[1:]) != (page_size, layer_num, *item)
            or staging.shape[0] == 0
            or staging.dtype != host.dtype
            or staging.device != device
        ):
            raise ValueError(
                f"kind {index}: staging buffer {tuple(staging.shape)} {staging.dtype} on {staging.device} must "
                f"be [capacity >= 1, {page_size}, {layer_num}, *{item}] {host.dtype} on {device}"
            )
        out.append(staging)
    return out


def transfer_all_layer_staged_lf_pf_ref(
    kinds: Sequence[KVKind],
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    stagings: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """Staged write-back, device `layer_first` -> host `page_first`, the way the CUDA path does it.

    Per chunk of at most `capacity` pages: gather each page's tokens of every layer into the
    kind's staging buffer in `[page][token][layer][element]` order, then copy each staged page
    as one contiguous run to its host page. The result equals `write_back_all_layer_ref(...,
    "page_first", ...)` byte for byte.

    Args:
        kinds: per kind a `KVKind(device_layers, host)`: L device tensors `[device_slots, *item]`
            and the kind's page_first host buffer `[S, L, *item]`.
        device_indices: int32/int64 `[n]` on the device, page-aligned runs of whole pages
            (only each page's first slot is read; values are checked only on the CPU).
        host_indices: int32/int64 `[n]` on the CPU, page-aligned runs of whole pages.
        page_size: P.
        stagings: per kind `[capacity, P, L, *item]` on the device, same dtype (the chunk size
            is the smallest capacity); None (or a None entry): a temporary of `min(pages, 64)` pages.
    Raises:
        ValueError: shapes, dtypes, devices or index placement that do not fit.
    """
    _check_pair(device_indices, host_indices, page_size)
    device = _check_kinds("page_first", kinds, page_size)
    check_index_tensor(device_indices, "device_indices", device)
    check_index_tensor(host_indices, "host_indices", torch.device("cpu"))
    check_page_runs(device_indices, page_size, "device_indices")
    check_page_runs(host_indices, page_size, "host_indices")
    num_pages = device_indices.numel() // page_size
    if num_pages == 0:
        return
    staging_buffers = _staging_buffers(kinds, stagings, num_pages, page_size, device)
    capacity = min(s.shape[0] for s in staging_buffers)

    # Only the first slot of each page is read, as the relayout kernel does.
    page_starts = device_indices[::page_size].to(torch.int64)
    token_offsets = torch.arange(page_size, dtype=torch.int64, device=device)
    # Host page starts as Python ints: the copy engine's addresses are computed on the CPU.
    host_starts = host_indices[::page_size].tolist()

    for begin in range(0, num_pages, capacity):
        count = min(capacity, num_pages - begin)
        slots = page_starts[begin : begin + count, None] + token_offsets  # [count, P]
        for (layers, host), staging in zip(kinds, staging_buffers):
            # Hop 1 (device -> device relayout): staging[page, token, layer, ...].
            for layer_id, layer in enumerate(layers):
                staging[:count, :, layer_id] = layer[slots]
            # Hop 2 (device -> host): one contiguous [P, L, *item] run per page.
            for page in range(count):
                start = host_starts[begin + page]
                host[start : start + page_size].copy_(staging[page])
