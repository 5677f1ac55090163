"""Public device <-> host KV transfer functions, dispatched by device and IO backend.

One path for every model: `write_back_all_layer` and `load_back_one_layer` take a sequence of
*kinds*, each a `KVKind(device_layers, host)` (MHA: K and V; MLA: the one latent row), and move
them all. The CUDA kernels move one or two kinds per launch, so MHA's K and V still go in one
launch (the paired kernels: one launch where a call per kind would take two) and MLA's alone.

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
from hiserve.jit_kernel.reference import LAYOUTS, WRITE_BACK_STAGING_PAGE_CHUNK, KVKind  # noqa: F401 (re-export)

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

# The kernels move one or two kinds per launch (MHA's K and V together); more kinds would go
# in several launches (no model here has more).
KERNEL_MAX_KINDS = 2


def _check_kind_count(kinds: Sequence, hosts: Sequence) -> None:
    if len(kinds) != len(hosts) or not 1 <= len(kinds) <= KERNEL_MAX_KINDS:
        raise ValueError(f"give 1 to {KERNEL_MAX_KINDS} kinds with one host buffer each, got {len(kinds)} kinds, "
                         f"{len(hosts)} host buffers")


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


def _stagings_or_default(kinds, stagings, device_indices, page_size) -> list[torch.Tensor]:
    """The given staging buffers, or (any missing) a temporary per kind."""
    if stagings is not None and len(stagings) == len(kinds) and all(s is not None for s in stagings):
        return list(stagings)
    first = kinds[0][0]
    pages = device_indices.numel() // max(page_size, 1)
    return [_default_staging(first.device, pages, page_size, len(kinds[0]), first.shape[1:], first.dtype)
            for _ in kinds]


def transfer_hicache_all_layer_staged_lf_pf(
    kinds: Sequence[Sequence[torch.Tensor]],
    hosts: Sequence[torch.Tensor],
    stagings: Sequence[torch.Tensor | None] | None,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    copy_mode: str = "auto",
    merge_runs: bool = True,
    sort_pages: bool = True,
    pipeline: bool = True,
) -> StagedWriteBackStats:
    """Staged write-back of every layer of 1 or 2 kinds in one pass: device `layer_first` ->
    host `page_first` (MHA: K and V together; MLA: the one latent kind).

    The operation's pages are put in host-page order, then moved in chunks. Per chunk the
    relayout kernel gathers the chunk's tokens of every layer of every kind into that kind's
    staging buffer, ordered `[page][token][layer][*item]`, and the copy engine moves each
    staged page to its host page (consecutive host pages merged into one copy), as one
    `cudaMemcpyBatchAsync` per chunk or one `cudaMemcpyAsync` per copy. An operation of more
    pages than the staging capacity is pipelined (unless `pipeline=False`): chunks of half
    the capacity alternate between its two halves, the relayout running on a second stream
    so it overlaps the previous chunk's copies; otherwise chunks of the whole capacity on the
    current stream. The copies are on the current stream, which is ordered after every
    relayout, so work queued after this call on the current stream sees the host pages
    written. The host never waits for the device. Byte-identical to
    `reference.write_back_all_layer_ref(..., "page_first", ...)`.

    Args:
        kinds: per kind the device pool's L layers, each `[device_slots, *item]` (CUDA,
            contiguous, one item shape for all kinds); 1 or 2 kinds (the kernel's limit).
        hosts: per kind the page_first host buffer `[S, L, *item]` (pinned or registered),
            e.g. the host pool's `kv_buffers`.
        stagings: per kind a device buffer of `capacity * P * L * prod(item)` elements (the
            host pool's `[capacity, P, L, *item]` staging buffers, capacity in pages); None
            (or any None): a temporary of min(pages, 64) pages per kind and call.
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
        StagedWriteBackStats of what was enqueued (`copies` counts every kind's copies).
    Raises:
        ValueError: shapes, dtypes, devices, index placement, a kind count other than 1 or 2,
            or host pages that are not page-aligned runs inside the host buffers (nothing is
            enqueued then).
        RuntimeError: the kernels cannot be built, or a CUDA call failed.
    """
    _check_kind_count(kinds, hosts)
    stagings = _stagings_or_default(kinds, stagings, device_indices, page_size)
    return _staged(kinds, hosts, stagings, device_indices, host_indices, page_size, copy_mode, merge_runs,
                   sort_pages, pipeline)


# ----------------------------------------------------------------------------- SM-kernel transfers


def _device_host_indices(host_indices: torch.Tensor, device: torch.device) -> torch.Tensor:
    return host_indices if host_indices.device == device else utils.host_indices_to_device(host_indices, device)


def transfer_hicache_one_layer(
    hosts: Sequence[torch.Tensor],
    layers: Sequence[torch.Tensor],
    layout: str,
    layer_id: int,
    *,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
    block_quota: int = DEFAULT_BLOCK_QUOTA,
) -> None:
    """Load-back of one layer of 1 or 2 kinds in one launch: host buffers in `layout` ->
    device layers, token by token, by an SM kernel of at most `block_quota` blocks reading
    mapped host memory.

    Args:
        hosts: per kind the host buffer (per-kind shape of `layout`, see `reference.py`), pinned.
        layers: per kind layer `layer_id` of the device pool, `[device_slots, *item]`.
        layout: host layout.
        layer_id: the host layer to read.
        host_indices: int32/int64 `[n]` host slots, on the CPU (copied to the device without
            blocking, once for consecutive layers) or already on the device.
        device_indices: int32/int64 `[n]` device slots on the device.
        page_size: P (host page geometry; n need not be page-aligned on the device side).
        block_quota: blocks of the kernel (>= 1).
    Raises:
        ValueError: shapes, dtypes, devices, index placement, layer_id, kind count or
            block_quota that do not fit.
    """
    reference.check_layout(layout)
    _check_kind_count(layers, hosts)
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
    _check_kind_count(kinds, hosts)
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


def _item_bytes(kinds: Sequence[KVKind], layer_id: int = 0) -> int:
    layer = kinds[0][0][layer_id] if kinds and len(kinds[0][0]) > layer_id >= 0 else None
    if layer is None:
        raise ValueError(f"no device layer {layer_id} in the given kinds")
    return math.prod(layer.shape[1:]) * layer.element_size()


def write_back_all_layer(
    kinds: Sequence[KVKind],
    layout: str,
    *,
    device_indices: torch.Tensor,
    host_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
    stagings: Sequence[torch.Tensor | None] | None = None,
) -> None:
    """Write-back (device -> host) of every layer of every kind for the given slots.

    Args:
        kinds: per kind a `KVKind(device_layers, host)` (MHA: K then V; MLA: the latent row):
            the device pool's L tensors `[device_slots, *item]` and the host pool's buffer of
            that kind (per-kind shape of `layout`, see `reference.py`).
        layout: host layout.
        device_indices: int32/int64 `[n]` on the device pool's device.
        host_indices: int32/int64 `[n]` on the CPU, page-aligned runs of whole pages.
        page_size: tokens per page.
        io_backend: `kernel` or `direct`.
        stagings: per kind the host pool's staging buffer (CUDA + page_first), used by the
            staged kernel path; None (or any None) there allocates temporaries.
    Raises:
        ValueError: bad shapes, dtypes, devices, index placement or io_backend.
    """
    _check_host_indices(host_indices)
    item_bytes = _item_bytes(kinds)
    if not _route(kinds[0][0][0].device, io_backend, item_bytes):
        reference.write_back_all_layer_ref(kinds, layout, device_indices=device_indices, host_indices=host_indices,
                                           page_size=page_size)
        return
    reference.check_layout(layout)
    stagings = [None] * len(kinds) if stagings is None else list(stagings)
    # One launch (or staged pass) per group of at most KERNEL_MAX_KINDS kinds: MHA's K and V
    # together through the paired kernels, as before the kinds API; MLA's one kind alone.
    for begin in range(0, len(kinds), KERNEL_MAX_KINDS):
        group = kinds[begin:begin + KERNEL_MAX_KINDS]
        layers, hosts = [k[0] for k in group], [k[1] for k in group]
        if layout == "page_first":
            group_stagings = stagings[begin:begin + len(group)]
            transfer_hicache_all_layer_staged_lf_pf(layers, hosts, group_stagings, device_indices=device_indices,
                                                    host_indices=host_indices, page_size=page_size)
        else:
            transfer_hicache_all_layer(layers, hosts, layout, device_indices=device_indices,
                                       host_indices=host_indices, page_size=page_size)


def load_back_one_layer(
    kinds: Sequence[KVKind],
    layout: str,
    layer_id: int,
    *,
    host_indices: torch.Tensor,
    device_indices: torch.Tensor,
    page_size: int,
    io_backend: str,
) -> None:
    """Load-back (host -> device) of layer `layer_id` of every kind into `device_layers[layer_id]`.

    Arguments, errors: as in `write_back_all_layer`; ValueError too if layer_id is out of range.
    """
    _check_host_indices(host_indices)
    if not 0 <= layer_id < (len(kinds[0][0]) if kinds else 0):
        raise ValueError(f"layer_id={layer_id} out of range for {len(kinds[0][0]) if kinds else 0} layers")
    if not _route(kinds[0][0][layer_id].device, io_backend, _item_bytes(kinds, layer_id)):
        reference.load_back_one_layer_ref(kinds, layout, layer_id, host_indices=host_indices,
                                          device_indices=device_indices, page_size=page_size)
        return
    reference.check_layout(layout)
    for begin in range(0, len(kinds), KERNEL_MAX_KINDS):
        group = kinds[begin:begin + KERNEL_MAX_KINDS]
        transfer_hicache_one_layer([k[1] for k in group], [k[0][layer_id] for k in group], layout, layer_id,
                                   host_indices=host_indices, device_indices=device_indices, page_size=page_size)
