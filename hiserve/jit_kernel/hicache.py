"""Public device <-> host KV transfer functions, dispatched by device and IO backend.

Every function checks shapes, dtypes, devices and index placement (ValueError naming the
offending value) and then runs one implementation:

| device pool on | io_backend | host layout         | write-back (all layers)             | load-back (one layer)      |
|----------------|------------|---------------------|-------------------------------------|----------------------------|
| CPU            | any        | any                 | `reference.py`                      | `reference.py`             |
| CUDA           | `direct`   | any                 | `reference.py` (torch copies)       | `reference.py`             |
| CUDA           | `kernel`   | `page_first`        | staged: relayout + copy engine      | per-layer SM kernel        |
| CUDA           | `kernel`   | `layer_first`       | all-layer SM kernel                 | per-layer SM kernel        |
| CUDA           | `kernel`   | `page_first_direct` | all-layer SM kernel (see below)     | per-layer SM kernel        |

`kernel` on CUDA falls back to `reference.py` with ONE logged warning when the JIT kernels
cannot be built here (`utils.can_use_jit_kernels`) or an item (one token of one layer of K,
V or the MLA row) is not a multiple of 16 bytes. `page_first_direct` write-back uses the
all-layer SM kernel because a copy-engine path would need each page's device slot on the
CPU, i.e. a `.cpu()` of the device indices, which blocks the scheduler.

Index placement: host indices come from the host allocator as CPU tensors and stay there.
The staged write-back computes host addresses on the CPU when it enqueues the copies, and a
`.cpu()` of a device tensor would block the scheduler thread until every transfer queued
before it has drained. The SM kernels read host indices on the device: the dispatcher moves
them with a non-blocking copy (`utils.host_indices_to_device`, reused across the layers of
one load-back). Device indices live on the device pool's device.

Units: `page_size` and slot counts are tokens; `*_bytes` are bytes. Everything is enqueued on
the current CUDA stream of the device pool's device; nothing here waits for the device.

Importing this module compiles nothing; the first kernel call compiles `csrc/kvcacheio`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Sequence

import torch

from hiserve.jit_kernel import reference, utils
from hiserve.jit_kernel.reference import LAYOUTS, WRITE_BACK_STAGING_PAGE_CHUNK  # noqa: F401 (re-export)

IO_BACKENDS = ("kernel", "direct")
LAYOUT_CODES = {"layer_first": 0, "page_first": 1, "page_first_direct": 2}

# Staged copies: "auto" submits every chunk as one cudaMemcpyBatchAsync where the runtime,
# driver and stream allow it, else one cudaMemcpyAsync per copy. Chosen by measurement
# (benchmark/hicache/bench_hicache_write_back.py, H200, CUDA 13.0): see COPY_MODE_NOTE.
COPY_MODES = {"auto": 0, "per_page": 1, "batch": 2}
COPY_MODE_NOTE = (
    "auto = one cudaMemcpyBatchAsync per chunk whenever usable. H200, one copy per page (shuffled host pages, "
    "benchmark/results/h200_hicache_write_back_v1_unmerged.json): per-page cudaMemcpyAsync 0.30-0.40 x the D2H "
    "limit at 64-70 KiB pages vs 0.41-0.87 batched, 0.78-0.85 vs 0.82-0.95 at ~1 MiB, 0.91-0.93 vs 0.92-0.96 at "
    "~4 MiB; never faster beyond noise, and ~2-3x the host time per copy"
)
# SM kernels: blocks per launch, so a transfer beside the forward pass takes few SMs.
DEFAULT_BLOCK_QUOTA = 8  # H200: 2 blocks reach ~0.5 of the H2D limit, 8 ~0.9, more adds nothing


# ----------------------------------------------------------------------------- checks


def _check_host_indices(host_indices: torch.Tensor) -> None:
    if isinstance(host_indices, torch.Tensor) and host_indices.device.type != "cpu":
        raise ValueError(
            f"host_indices must stay on the CPU, got a tensor on {host_indices.device}: host slots come "
            "from the host allocator on the CPU, and moving them back with .cpu() would block the "
            "scheduler until earlier transfers finish"
        )


# ----------------------------------------------------------------------------- staged write-back


@dataclasses.dataclass
class StagedWriteBackStats:
    """What one staged write-back enqueued: chunks and pages per chunk, copies (after merging
    consecutive host pages), and how many chunks went out as one cudaMemcpyBatchAsync (the
    rest as one cudaMemcpyAsync per copy)."""

    chunks: int = 0
    pages_per_chunk: int = 0
    copies: int = 0
    batched_chunks: int = 0


# Pages per relayout launch (the page order travels in the kernel's parameters).
MAX_PAGES_PER_CHUNK = 256
_EMPTY_ORDER = torch.empty(0, dtype=torch.int64)


def _staged(kinds, host_bufs, stagings, device_indices, host_indices, page_size, copy_mode, merge_runs,
            sort_pages=True, pipeline=True):
    if copy_mode not in COPY_MODES:
        raise ValueError(f"unknown copy_mode {copy_mode!r}; expected one of {tuple(COPY_MODES)}")
    table = utils.layer_pointer_table(kinds)
    first = kinds[0][0]
    device, layer_num, item = first.device, len(kinds[0]), tuple(first.shape[1:])
    item_bytes = utils.item_bytes_of(first)
    utils.check_item_bytes(item_bytes)
    _check_host_indices(host_indices)
    tokens = utils.check_indices(device_indices, host_indices, device, torch.device("cpu"), page_size)
    slots = [utils.check_host_buffer(h, f"host buffer {i}", "page_first", layer_num, page_size, item, first.dtype)
             for i, h in enumerate(host_bufs)]
    if len(set(slots)) != 1:
        raise ValueError(f"host buffers differ in slots: {slots}")
    page_bytes = page_size * layer_num * item_bytes
    capacity = None
    for i, st in enumerate(stagings):
        if st.device != device or st.dtype != first.dtype or not st.is_contiguous() or st.numel() == 0:
            raise ValueError(f"staging buffer {i} is {tuple(st.shape)} {st.dtype} on {st.device}; it must be a "
                             f"contiguous {first.dtype} tensor on {device}")
        if (st.numel() * st.element_size()) % page_bytes:
            raise ValueError(f"staging buffer {i} holds {st.numel() * st.element_size()} bytes, not a whole number "
                             f"of {page_bytes}-byte pages [P={page_size}, L={layer_num}, item={item}]")
        pages = st.numel() * st.element_size() // page_bytes
        capacity = pages if capacity is None else min(capacity, pages)
    num_pages = tokens // page_size
    # Pipelined (operations longer than the staging buffer): two halves of it, the relayout of
    # one overlapping the copies of the other. Shorter ones go as one chunk on one stream.
    pipeline = pipeline and capacity >= 2 and num_pages > capacity
    per_chunk = min(capacity // 2 if pipeline else capacity, MAX_PAGES_PER_CHUNK)
    stats = StagedWriteBackStats(pages_per_chunk=per_chunk)
    if num_pages == 0:
        return stats
    module = utils.load_kvcacheio_module()
    # Check the host pages (aligned runs inside the buffer) and order them by host page, so
    # consecutive host pages are staged consecutively and leave as one copy (C++, O(n log n)).
    order = utils.order_buffer(num_pages)
    plan = module.plan_host_pages(host_indices, page_size, slots[0], order)
    if plan < 0:
        bad = -1 - plan
        run = host_indices[bad * page_size:(bad + 1) * page_size].tolist()
        raise ValueError(f"host_indices must be page-aligned runs of {page_size} consecutive slots inside the "
                         f"{slots[0]} host slots; page {bad} is {run}")
    if plan == 0 or not sort_pages:
        order = _EMPTY_ORDER
    stream = torch.cuda.current_stream(device)
    relayout = stream
    if pipeline:
        relayout = utils.side_stream(device)
        device_indices.record_stream(relayout)  # read there: keep it from the allocator until then
        for st in stagings:
            st.record_stream(relayout)
    mode = COPY_MODES[copy_mode]
    s0, s1 = stagings[0], stagings[-1]
    h0, h1 = host_bufs[0], host_bufs[-1]
    half_bytes = per_chunk * page_bytes
    for index, begin in enumerate(range(0, num_pages, per_chunk)):
        count = min(per_chunk, num_pages - begin)
        result = module.staged_write_back_chunk(
            table, s0, s1, (index & 1) * half_bytes if pipeline else 0, h0, h1, device_indices, host_indices, order,
            begin, count, page_size, layer_num, item_bytes, len(kinds), slots[0], stream.cuda_stream,
            relayout.cuda_stream, index, mode, merge_runs)
        stats.chunks += 1
        stats.copies += result >> 2
        stats.batched_chunks += int((result & 3) == 1)
    return stats


def _default_staging(device, num_pages, page_size, layer_num, item, dtype):
    utils.warn_once("staging_temp", "staged write-back called without a staging buffer; allocating a temporary one "
                    "per call (give the host pool's staging buffers instead)")
    capacity = min(num_pages, WRITE_BACK_STAGING_PAGE_CHUNK)
    return torch.empty((max(capacity, 1), page_size, layer_num, *item), dtype=dtype, device=device)


def transfer_hicache_all_layer_staged_lf_pf(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    host_k: torch.Tensor,
    host_v: torch.Tensor,
    staging_k: torch.Tensor | None,
    staging_v: torch.Tensor | None,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    copy_mode: str = "auto",
    merge_runs: bool = True,
    sort_pages: bool = True,
    pipeline: bool = True,
) -> StagedWriteBackStats:
    """MHA staged write-back of every layer: device `layer_first` -> host `page_first`.

    The operation's pages are put in host-page order, then moved in chunks. Per chunk the
    relayout kernel gathers the chunk's tokens of every layer into the staging buffers,
    ordered `[page][token][layer][H][Dh]`, and the copy engine moves each staged page to its
    host page (consecutive host pages merged into one copy), as one `cudaMemcpyBatchAsync`
    per chunk or one `cudaMemcpyAsync` per copy. An operation of more pages than the staging
    capacity is pipelined (unless `pipeline=False`): chunks of half the capacity alternate
    between its two halves, the relayout running on a second stream so it overlaps the
    previous chunk's copies; otherwise chunks of the whole capacity on the current stream. The copies are on the current stream, which is ordered after
    every relayout, so work queued after this call on the current stream sees the host pages
    written. The host never waits for the device. Byte-identical to
    `reference.write_back_all_layer_ref(..., "page_first", ...)`.

    Args:
        k_layers, v_layers: the device pool's L layers, each `[device_slots, H, Dh]` (CUDA, contiguous).
        host_k, host_v: page_first host buffers `[S, L, H, Dh]` (pinned or registered), e.g.
            the host pool's `kv_buffer[0]` / `kv_buffer[1]`.
        staging_k, staging_v: device buffers of `capacity * P * L * H * Dh` elements each (the host
            pool's `[capacity, P, L, H, Dh]` staging buffers, capacity in pages); None: a temporary
            of min(pages, 64) pages per call.
        device_indices: int32/int64 `[n]` device slots on the device (any slots; read per token).
        host_indices: int32/int64 `[n]` host slots on the CPU, page-aligned runs of P slots inside
            the host buffers (checked on the CPU).
        page_size: P, tokens per page; n must be a multiple of it.
        copy_mode: "auto" (batched where usable, else per copy), "batch" (batched or error),
            "per_page" (one cudaMemcpyAsync per copy).
        merge_runs: merge consecutive host pages into one copy.
        sort_pages: stage pages in host-page order (more merging); False keeps the given order.
        pipeline: allow overlapping relayout and copies (two staging halves, a second stream).
    Returns:
        StagedWriteBackStats of what was enqueued.
    Raises:
        ValueError: shapes, dtypes, devices, index placement, or host pages that are not
            page-aligned runs inside the host buffers (nothing is enqueued then).
        RuntimeError: the kernels cannot be built, or a CUDA call failed.
    """
    first = k_layers[0]
    if staging_k is None or staging_v is None:
        pages = device_indices.numel() // max(page_size, 1)
        staging_k = _default_staging(first.device, pages, page_size, len(k_layers), first.shape[1:], first.dtype)
        staging_v = torch.empty_like(staging_k)
    return _staged([k_layers, v_layers], [host_k, host_v], [staging_k, staging_v], device_indices, host_indices,
                   page_size, copy_mode, merge_runs, sort_pages, pipeline)


def transfer_hicache_all_layer_mla_staged_lf_pf(
    kv_layers: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    staging: torch.Tensor | None,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    copy_mode: str = "auto",
    merge_runs: bool = True,
    sort_pages: bool = True,
    pipeline: bool = True,
) -> StagedWriteBackStats:
    """MLA staged write-back of every layer: device `[device_slots, 1, Dm]` layers -> host
    page_first `[S, L, 1, Dm]`; staging holds `capacity * P * L * Dm` elements
    (`[capacity, P, L, 1, Dm]`). Everything else as `transfer_hicache_all_layer_staged_lf_pf`.
    """
    first = kv_layers[0]
    if staging is None:
        pages = device_indices.numel() // max(page_size, 1)
        staging = _default_staging(first.device, pages, page_size, len(kv_layers), first.shape[1:], first.dtype)
    return _staged([kv_layers], [host_kv], [staging], device_indices, host_indices, page_size, copy_mode, merge_runs,
                   sort_pages, pipeline)


# ----------------------------------------------------------------------------- SM-kernel transfers


def _device_host_indices(host_indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host_indices if host_indices.device == device else utils.host_indices_to_device(host_indices, device)


def transfer_hicache_one_layer(
    host_k: torch.Tensor,
    host_v: torch.Tensor | None,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor | None,
    layout: str,
    layer_id: int,
    *,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
    block_quota: int = DEFAULT_BLOCK_QUOTA,
) -> None:
    """Load-back of one layer: host buffer(s) in `layout` -> device layer(s), token by token,
    by an SM kernel of at most `block_quota` blocks reading mapped host memory.

    Args:
        host_k, host_v: one kind's host buffer each (per-kind shape of `layout`, see
            `reference.py`), pinned; host_v None for MLA (one kind).
        k_layer, v_layer: layer `layer_id` of the device pool, `[device_slots, *item]`; v_layer
            None for MLA.
        layout: host layout.
        layer_id: the host layer to read.
        host_indices: int32/int64 `[n]` host slots, on the CPU (copied to the device without
            blocking, once for consecutive layers) or already on the device.
        device_indices: int32/int64 `[n]` device slots on the device.
        page_size: P (host page geometry; n need not be page-aligned on the device side).
        block_quota: blocks of the kernel (>= 1).
    Raises:
        ValueError: shapes, dtypes, devices, index placement, layer_id or block_quota that do not fit.
    """
    reference.check_layout(layout)
    hosts = [host_k] if host_v is None else [host_k, host_v]
    layers = [k_layer] if v_layer is None else [k_layer, v_layer]
    if len(hosts) != len(layers):
        raise ValueError("give host_v and v_layer together (MHA) or neither (MLA)")
    first = layers[0]
    if first.device.type != "cuda":
        raise ValueError(f"device layer must be on CUDA, got {first.device}")
    for i, t in enumerate(layers):
        if t.device != first.device or t.dtype != first.dtype or t.shape[1:] != first.shape[1:] or not t.is_contiguous():
            raise ValueError(f"device layer {i} is {tuple(t.shape)} {t.dtype} on {t.device}; expected contiguous "
                             f"[slots, *{tuple(first.shape[1:])}] {first.dtype} on {first.device}")
    if block_quota < 1:
        raise ValueError(f"block_quota must be >= 1, got {block_quota}")
    item, item_bytes = tuple(first.shape[1:]), utils.item_bytes_of(first)
    utils.check_item_bytes(item_bytes)
    layer_num = hosts[0].shape[0] if layout == "layer_first" else hosts[0].shape[1] if hosts[0].dim() > 1 else 0
    if not 0 <= layer_id < layer_num:
        raise ValueError(f"layer_id={layer_id} out of range for {layer_num} host layers")
    slots = [utils.check_host_buffer(h, f"host buffer {i}", layout, layer_num, page_size, item, first.dtype)
             for i, h in enumerate(hosts)]
    utils.check_indices(device_indices, host_indices, first.device, None, page_size)
    utils.check_host_bounds(host_indices, slots[0])
    if device_indices.numel() == 0:
        return
    host_on_device = _device_host_indices(host_indices, first.device)
    utils.load_kvcacheio_module().transfer_one_layer_h2d(
        hosts[0], hosts[-1], layers[0], layers[-1], host_on_device, device_indices, LAYOUT_CODES[layout], layer_id,
        layer_num, slots[0], page_size, item_bytes, len(layers), block_quota,
        torch.cuda.current_stream(first.device).cuda_stream)


def transfer_hicache_all_layer(
    kinds: Sequence[Sequence[torch.Tensor]],
    hosts: Sequence[torch.Tensor],
    layout: str,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    block_quota: int = DEFAULT_BLOCK_QUOTA,
) -> None:
    """All-layer write-back by an SM kernel storing into mapped host memory (layer_first and
    page_first_direct write-back; the per-token baseline of the staged path).

    Args:
        kinds: per kind (K, V; or the one MLA kind) the device pool's L layers `[device_slots, *item]`.
        hosts: per kind the host buffer in `layout` (pinned).
        layout: host layout (any of LAYOUTS).
        device_indices: int32/int64 `[n]` on the device.
        host_indices: int32/int64 `[n]`, on the CPU (moved without blocking) or on the device.
        page_size: P. block_quota: blocks of the kernel.
    Raises:
        ValueError: as `transfer_hicache_one_layer`.
    """
    reference.check_layout(layout)
    if len(kinds) != len(hosts) or len(kinds) not in (1, 2):
        raise ValueError(f"give 1 or 2 kinds with one host buffer each, got {len(kinds)} kinds, {len(hosts)} buffers")
    if block_quota < 1:
        raise ValueError(f"block_quota must be >= 1, got {block_quota}")
    table = utils.layer_pointer_table(kinds)
    first = kinds[0][0]
    layer_num, item, item_bytes = len(kinds[0]), tuple(first.shape[1:]), utils.item_bytes_of(first)
    utils.check_item_bytes(item_bytes)
    slots = [utils.check_host_buffer(h, f"host buffer {i}", layout, layer_num, page_size, item, first.dtype)
             for i, h in enumerate(hosts)]
    utils.check_indices(device_indices, host_indices, first.device, None, page_size)
    utils.check_host_bounds(host_indices, slots[0])
    if device_indices.numel() == 0:
        return
    host_on_device = _device_host_indices(host_indices, first.device)
    utils.load_kvcacheio_module().transfer_all_layer_d2h(
        table, hosts[0], hosts[-1], device_indices, host_on_device, LAYOUT_CODES[layout], layer_num, slots[0],
        page_size, item_bytes, len(kinds), block_quota, torch.cuda.current_stream(first.device).cuda_stream)


# ----------------------------------------------------------------------------- dispatch


def _route(device: torch.device, io_backend: str, item_bytes: int) -> bool:
    """True: run the CUDA kernels; False: the reference (CPU, `direct`, or kernels unavailable)."""
    if io_backend not in IO_BACKENDS:
        raise ValueError(f"unknown io_backend {io_backend!r}; expected one of {IO_BACKENDS}")
    if device.type != "cuda" or io_backend == "direct":
        return False
    if not utils.can_use_jit_kernels():
        return False
    if item_bytes % utils.VECTOR_BYTES:
        utils.warn_once(f"item_{item_bytes}", "KV items of %d bytes are not a multiple of 16; io_backend 'kernel' "
                        "uses the torch reference copies for them", item_bytes)
        return False
    return True


def _kind_views(host_kv: torch.Tensor, num_kinds: int) -> list[torch.Tensor]:
    if num_kinds == 1:
        return [host_kv]
    if host_kv.dim() == 0 or host_kv.shape[0] != 2:
        raise ValueError(f"MHA host_kv must have a leading K/V axis of 2, got shape {tuple(host_kv.shape)}")
    return [host_kv[0], host_kv[1]]


def _write_back(kinds, host_kv, layout, device_indices, host_indices, page_size, io_backend, stagings):
    _check_host_indices(host_indices)
    first = kinds[0][0]
    if not _route(first.device, io_backend, math.prod(first.shape[1:]) * first.element_size()):
        if len(kinds) == 2:
            reference.write_back_all_layer_ref(kinds[0], kinds[1], host_kv, layout, device_indices=device_indices,
                                               host_indices=host_indices, page_size=page_size)
        else:
            reference.write_back_all_layer_mla_ref(kinds[0], host_kv, layout, device_indices=device_indices,
                                                   host_indices=host_indices, page_size=page_size)
        return
    reference.check_layout(layout)
    hosts = _kind_views(host_kv, len(kinds))
    if layout == "page_first":
        if any(s is None for s in stagings):
            pages = device_indices.numel() // max(page_size, 1)
            stagings = [_default_staging(first.device, pages, page_size, len(kinds[0]), first.shape[1:], first.dtype)
                        for _ in kinds]
        _staged(kinds, hosts, stagings, device_indices, host_indices, page_size, "auto", True)
    else:
        transfer_hicache_all_layer(kinds, hosts, layout, device_indices=device_indices, host_indices=host_indices,
                                   page_size=page_size)


def write_back_all_layer(
    k_layers: Sequence[torch.Tensor],
    v_layers: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    layout: str,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
    staging_k: torch.Tensor | None = None,
    staging_v: torch.Tensor | None = None,
) -> None:
    """MHA write-back (device -> host) of every layer of the given slots.

    Args:
        k_layers, v_layers: the device pool's L tensors `[device_slots, H, Dh]`.
        host_kv: host buffer `[2, *per-kind shape of layout]` (see `reference.py`).
        layout: host layout.
        device_indices: int32/int64 `[n]` on the device pool's device.
        host_indices: int32/int64 `[n]` on the CPU, page-aligned runs of whole pages.
        page_size: tokens per page.
        io_backend: `kernel` or `direct`.
        staging_k, staging_v: the host pool's staging buffers (CUDA + page_first), used by the
            staged kernel path; None there allocates temporaries.
    Raises:
        ValueError: bad shapes, dtypes, devices, index placement or io_backend.
    """
    _write_back([k_layers, v_layers], host_kv, layout, device_indices, host_indices, page_size, io_backend,
                [staging_k, staging_v])


def write_back_all_layer_mla(
    kv_layers: Sequence[torch.Tensor],
    host_kv: torch.Tensor,
    layout: str,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
    staging: torch.Tensor | None = None,
) -> None:
    """MLA write-back (device -> host) of every layer; kv_layers are `[device_slots, 1, Dm]`.

    Arguments, errors: as in `write_back_all_layer`, with one host buffer and one staging buffer.
    """
    _write_back([kv_layers], host_kv, layout, device_indices, host_indices, page_size, io_backend, [staging])


def load_back_one_layer(
    host_kv: torch.Tensor,
    k_layer: torch.Tensor,
    v_layer: torch.Tensor,
    layout: str,
    layer_id: int,
    *,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
) -> None:
    """MHA load-back (host -> device) of layer `layer_id` into `k_layer`, `v_layer` `[device_slots, H, Dh]`.

    Arguments, errors: as in `write_back_all_layer`; ValueError too if layer_id is out of range.
    """
    _check_host_indices(host_indices)
    if not _route(k_layer.device, io_backend, math.prod(k_layer.shape[1:]) * k_layer.element_size()):
        reference.load_back_one_layer_ref(host_kv, k_layer, v_layer, layout, layer_id, host_indices=host_indices,
                                          device_indices=device_indices, page_size=page_size)
        return
    reference.check_layout(layout)
    host_k, host_v = _kind_views(host_kv, 2)
    transfer_hicache_one_layer(host_k, host_v, k_layer, v_layer, layout, layer_id, host_indices=host_indices,
                               device_indices=device_indices, page_size=page_size)


def load_back_one_layer_mla(
    host_kv: torch.Tensor,
    kv_layer: torch.Tensor,
    layout: str,
    layer_id: int,
    *,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
) -> None:
    """MLA load-back (host -> device) of layer `layer_id` into `kv_layer` `[device_slots, 1, Dm]`."""
    _check_host_indices(host_indices)
    if not _route(kv_layer.device, io_backend, math.prod(kv_layer.shape[1:]) * kv_layer.element_size()):
        reference.load_back_one_layer_mla_ref(host_kv, kv_layer, layout, layer_id, host_indices=host_indices,
                                              device_indices=device_indices, page_size=page_size)
        return
    reference.check_layout(layout)
    transfer_hicache_one_layer(host_kv, None, kv_layer, None, layout, layer_id, host_indices=host_indices,
                               device_indices=device_indices, page_size=page_size)
