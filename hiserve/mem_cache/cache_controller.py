"""HiCacheController: moves KV pages between the device pool (L1) and the host pool (L2).

* **write (write-back / backup, device → host)**: `write(device_indices, node_id)` takes
  host slots from the host pool and starts the copy at once; all layers move in one
  operation (`backup_from_device_all_layer`).
* **load (load-back, host → device)**: `load(host_indices, device_indices, node_id)` queues
  a copy into device slots the caller allocated; `start_loading()` (once the prefill batch
  is known, before its forward) merges the queued loads into one operation that runs layer
  by layer and returns its `LoadTicket`.

Completion comes back through two ack queues (`poll_write_acks()`, `poll_load_acks()`),
drained in order by the cache every scheduler iteration.

On CUDA each direction has its own stream:

* a write records an event on the compute stream and makes the write stream wait on it,
  so the copy is ordered after the forward that produced the KV. Nothing on the compute
  stream ever waits for a write: device slots whose write is in flight are simply not
  handed out again until its ack (the cache keeps them on a pending list);
* a load does the same on the load stream (after any write of the same host pages still in
  flight), then records one event per layer in its `LoadTicket`. Only the batch that reads
  the loaded slots carries the ticket: during its forward the device pool's layer accessors
  make the compute stream wait for layer i's event, so layer 0's attention runs while later
  layers are still arriving, and no other forward or CUDA-graph replay waits at all.

On the CPU there is no second engine to overlap with: the same calls run the copies
synchronously, every operation is complete when it returns, and its ack still goes
through the queue (so the cache's bookkeeping is the same on both devices).

Host indices are CPU tensors from the host allocator and never leave the CPU. Device
indices arrive as CPU tensors too (the allocator's) and are copied to the device through
pinned memory without blocking the host.
"""

from __future__ import annotations

import itertools
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hiserve.distributed import get_tp_group, tp_min_ints

if TYPE_CHECKING:
    from hiserve.mem_cache.memory_pool import KVCache
    from hiserve.mem_cache.memory_pool_host import HostKVCache


@dataclass
class CacheAck:
    """A started transfer; `done()` once its copies have finished (always, on the CPU).

    Attributes:
        op_id: operation number (per controller).
        node_ids: radix-tree nodes the transfer serves.
        num_tokens: tokens moved.
        finish_event: CUDA event recorded after the copies (None on the CPU).
    """

    op_id: int
    node_ids: list[int]
    num_tokens: int
    finish_event: "torch.cuda.Event | None" = None

    def done(self) -> bool:
        return self.finish_event is None or self.finish_event.query()

    def synchronize(self) -> None:
        """Block the host until the transfer has finished."""
        if self.finish_event is not None:
            self.finish_event.synchronize()


def agreed_done(acks: list[CacheAck]) -> list[bool]:
    """`done()` of each ack, agreed across TP ranks: an ack counts as done only when it is
    done on every rank (element-wise all-reduce MIN on the CPU group, as SGLang's HiCache
    agrees on finished transfers), so every rank's tree takes the same acks in the same
    iteration. Every rank holds the same acks (same schedule), so the lists have the same
    length. On the CPU (no events: every ack is done at once) no collective is needed."""
    flags = [a.done() for a in acks]
    if get_tp_group().size == 1 or all(a.finish_event is None for a in acks):
        return flags
    return [bool(f) for f in tp_min_ints([int(f) for f in flags])]


class LoadTicket:
    """Per-layer arrival of one load-back, for the forward of the batch that reads it.

    Installed on the device pool for that forward only (`register_layer_transfer_counter`);
    `wait_until(i)` makes the compute stream (not the host) wait for layer i. A no-op on
    the CPU, where the load is complete before the ticket exists.
    """

    def __init__(self, layer_events: "list[torch.cuda.Event] | None", ack: CacheAck) -> None:
        self.layer_events = layer_events
        self.ack = ack

    def wait_until(self, layer_id: int) -> None:
        if self.layer_events is None or torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.current_stream().wait_event(self.layer_events[layer_id])

    def wait_all(self) -> None:
        """Make the compute stream wait for every layer (a CUDA-graph replay cannot wait per
        layer). The layers are copied in order on one stream, so the last event covers all."""
        if self.layer_events:
            torch.cuda.current_stream().wait_event(self.layer_events[-1])


@dataclass
class _LoadOp:
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    node_ids: list[int]
    after: list[CacheAck] = field(default_factory=list)  # writes of these host pages in flight


class HiCacheController:
    """Write (D2H) and load (H2D) between a device pool and its host pool.

    Args:
        mem_pool_device: the device KV pool (L1).
        mem_pool_host: the host pool (L2) backing it.
        io_backend: `kernel` or `direct`, passed to the host pool's transfer functions.
    Raises:
        ValueError: the two pools' page sizes differ.
    """

    def __init__(self, mem_pool_device: "KVCache", mem_pool_host: "HostKVCache", io_backend: str) -> None:
        if mem_pool_host.page_size != mem_pool_device.page_size:
            raise ValueError(f"host pool page_size {mem_pool_host.page_size} != device pool "
                             f"page_size {mem_pool_device.page_size}")
        self.mem_pool_device = mem_pool_device
        self.mem_pool_host = mem_pool_host
        self.page_size = mem_pool_device.page_size
        self.io_backend = io_backend
        self.device = mem_pool_device.device
        self.is_cuda = self.device.type == "cuda"
        self.write_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.load_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.layer_num = mem_pool_device.layer_num
        self._op_ids = itertools.count()
        self.load_queue: list[_LoadOp] = []
        self.ack_write_queue: deque[CacheAck] = deque()
        self.ack_load_queue: deque[CacheAck] = deque()

    def _on_device(self, indices: torch.Tensor) -> torch.Tensor:
        """`indices` (CPU) on the device pool's device, copied without blocking the host."""
        if not self.is_cuda:
            return indices
        return indices.pin_memory().to(self.device, non_blocking=True)

    # ------------------------------------------------------------------ write (D2H)

    def write(self, device_indices: torch.Tensor, node_id: int) -> tuple[torch.Tensor, CacheAck] | None:
        """Back up `device_indices` (int64 CPU, whole pages) to newly taken host slots.

        The copy starts now, ordered after the work already queued on the compute stream.
        Returns (host slots int64 CPU `[n]`, the write's ack), or None when the host pool
        has too few free slots (nothing is taken; the caller may evict host nodes and retry).
        """
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        op_id, n = next(self._op_ids), len(device_indices)
        if not self.is_cuda:
            self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, host_indices, device_indices, self.io_backend)
            ack = CacheAck(op_id, [node_id], n)
        else:
            dev_indices = self._on_device(device_indices)
            start, finish = torch.cuda.Event(), torch.cuda.Event()
            start.record()  # on the compute stream: after the forward that wrote these slots
            with torch.cuda.stream(self.write_stream):
                self.write_stream.wait_event(start)
                self.mem_pool_host.backup_from_device_all_layer(
                    self.mem_pool_device, host_indices, dev_indices, self.io_backend)
                finish.record(self.write_stream)
            dev_indices.record_stream(self.write_stream)
            ack = CacheAck(op_id, [node_id], n, finish)
        self.ack_write_queue.append(ack)
        return host_indices, ack

    # ------------------------------------------------------------------ load (H2D)

    def load(self, host_indices: torch.Tensor, device_indices: torch.Tensor, node_id: int,
             after: list[CacheAck] | None = None) -> None:
        """Queue a load-back of `host_indices` into `device_indices` (both int64 CPU `[n]`,
        whole pages); `after`: writes still in flight that filled these host pages. The copy
        starts at the next `start_loading()`."""
        self.load_queue.append(_LoadOp(host_indices, device_indices, [node_id], list(after or ())))

    def start_loading(self, after: "torch.cuda.Event | None" = None) -> LoadTicket | None:
        """Issue every queued load as one layer-by-layer copy; None when nothing was queued.

        after: a CUDA event the copies must also wait for (overlap scheduling: the forward
        still running on the worker's stream, which the compute-stream event below does not
        cover). Returns the ticket the consuming batch's forward must carry (see `LoadTicket`).
        """
        if not self.load_queue:
            return None
        ops, self.load_queue = self.load_queue, []
        host_indices = torch.cat([op.host_indices for op in ops])
        device_indices = torch.cat([op.device_indices for op in ops])
        node_ids = [nid for op in ops for nid in op.node_ids]
        ack = CacheAck(next(self._op_ids), node_ids, len(host_indices))
        if not self.is_cuda:
            for layer_id in range(self.layer_num):
                self.mem_pool_host.load_to_device_per_layer(
                    self.mem_pool_device, host_indices, device_indices, layer_id, self.io_backend)
            self.ack_load_queue.append(ack)
            return LoadTicket(None, ack)
        dev_indices = self._on_device(device_indices)
        layer_events = [torch.cuda.Event() for _ in range(self.layer_num)]
        start = torch.cuda.Event()
        ack.finish_event = torch.cuda.Event()
        start.record()  # after earlier compute that last used these device slots
        with torch.cuda.stream(self.load_stream):
            self.load_stream.wait_event(start)
            if after is not None:
                self.load_stream.wait_event(after)
            for w in (w for op in ops for w in op.after if w.finish_event is not None):
                self.load_stream.wait_event(w.finish_event)
            for layer_id in range(self.layer_num):
                self.mem_pool_host.load_to_device_per_layer(
                    self.mem_pool_device, host_indices, dev_indices, layer_id, self.io_backend)
                layer_events[layer_id].record(self.load_stream)
            ack.finish_event.record(self.load_stream)
        dev_indices.record_stream(self.load_stream)
        self.ack_load_queue.append(ack)
        return LoadTicket(layer_events, ack)

    # ------------------------------------------------------------------ acks

    @staticmethod
    def _drain(queue: deque[CacheAck]) -> list[CacheAck]:
        flags = agreed_done(list(queue))
        n = flags.index(False) if False in flags else len(flags)  # the finished head, in order
        return [queue.popleft() for _ in range(n)]

    def poll_write_acks(self) -> list[CacheAck]:
        """Finished writes, oldest first (stops at the first unfinished one)."""
        return self._drain(self.ack_write_queue)

    def poll_load_acks(self) -> list[CacheAck]:
        """Finished loads, oldest first."""
        return self._drain(self.ack_load_queue)

    def has_pending(self) -> bool:
        return bool(self.load_queue or self.ack_write_queue or self.ack_load_queue)

    # ------------------------------------------------------------------ reset

    def synchronize(self) -> None:
        """Block until every started transfer has finished (queued loads are not started)."""
        if self.is_cuda:
            self.write_stream.synchronize()
            self.load_stream.synchronize()

    def reset(self) -> None:
        """Wait for started transfers, then drop every queue and ack (slot ownership is the
        caller's: it clears both pools' allocators)."""
        self.synchronize()
        self.load_queue = []
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
