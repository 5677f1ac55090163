"""HiCacheController: moves KV pages between the device pool (L1) and the host pool (L2).

Two queues, one per direction, each operation carrying an id and the radix-tree node ids
it serves:

* **write (write-back / backup, device → host)**: `write(device_indices, node_id)` takes
  host slots from the host pool and starts the copy at once. All layers move in one
  operation (`backup_from_device_all_layer`).
* **load (load-back, host → device)**: `load(host_indices, node_id)` takes device slots and
  queues the copy; `start_loading()` (called once the prefill batch is known, before its
  forward) merges every queued load into one operation and runs it *layer by layer*.

Completion is reported through two ack queues (`poll_write_acks()`, `poll_load_acks()`),
drained in order by the cache (`HiRadixCache.check_hicache_events`), which then releases
the locks it took for the transfer.

On CUDA each direction has its own stream:

* a write records an event on the current (compute) stream and makes the write stream
  wait on it, so the copy is ordered after the forward that produced the KV;
* a load does the same with the load stream, then records one event per layer; a
  `LayerLoadingCounter` registered on the device pool makes the compute stream wait on
  layer i's event when attention first asks for layer i's buffer, so layer 0's attention
  runs while later layers are still arriving.

On the CPU there is no second engine to overlap with: the same calls run the copies
synchronously, every operation is complete when it returns, and its ack still goes
through the queue (so the cache's lock discipline is the same on both devices).

Host indices are CPU tensors from the host allocator and never leave the CPU; device
indices stay on the device.
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from hiserve.mem_cache.allocator import TokenToKVPoolAllocator
    from hiserve.mem_cache.memory_pool_host import HostKVCache

logger = logging.getLogger(__name__)


@dataclass
class CacheOperation:
    """One queued transfer: `host_indices[i]` (CPU) pairs with `device_indices[i]` (device)."""

    op_id: int
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    node_ids: list[int] = field(default_factory=list)

    @staticmethod
    def merge(ops: list["CacheOperation"]) -> "CacheOperation":
        """One operation covering `ops` in order (the first op's id)."""
        if len(ops) == 1:
            return ops[0]
        return CacheOperation(
            ops[0].op_id,
            torch.cat([op.host_indices for op in ops]),
            torch.cat([op.device_indices for op in ops]),
            [nid for op in ops for nid in op.node_ids],
        )


@dataclass
class CacheAck:
    """A started transfer; `done()` once its copies have finished (always, on the CPU)."""

    op_id: int
    node_ids: list[int]
    num_tokens: int
    finish_event: "torch.cuda.Event | None" = None

    def done(self) -> bool:
        return self.finish_event is None or self.finish_event.query()

    def synchronize(self) -> None:
        if self.finish_event is not None:
            self.finish_event.synchronize()


class LayerLoadingCounter:
    """Per-layer events of the latest load-back; the device pool's layer accessors call
    `wait_until(layer_id)` (registered with `register_layer_transfer_counter`).

    Loads run one after another on a single load stream, so waiting on the latest load's
    layer i also covers every earlier load's layer i. `wait_until` is a GPU-side wait
    (the compute stream waits; the host does not block) and a no-op when no load is in
    flight, on the CPU, or while a CUDA graph is being captured.
    """

    def __init__(self, num_layers: int, device: torch.device) -> None:
        self.num_layers = num_layers
        self.is_cuda = device.type == "cuda"
        self._events: list["torch.cuda.Event"] | None = None
        self.num_loads = 0  # loads started so far (producer count)

    def start_producer(self) -> list["torch.cuda.Event"] | None:
        """Fresh per-layer events for a load that is about to be issued (None on the CPU)."""
        self.num_loads += 1
        if not self.is_cuda:
            return None
        self._events = [torch.cuda.Event() for _ in range(self.num_layers)]
        return self._events

    def wait_until(self, layer_id: int) -> None:
        events = self._events
        if events is None or torch.cuda.is_current_stream_capturing():
            return
        torch.cuda.current_stream().wait_event(events[layer_id])

    def clear(self) -> None:
        """No load in flight any more: stop waiting."""
        self._events = None


class HiCacheController:
    """Write (D2H) and load (H2D) queues between a device pool and its host pool.

    Args:
        token_to_kv_pool_allocator: device slot allocator; `get_kvcache()` is the device pool.
        mem_pool_host: the host pool (`MHATokenToKVPoolHost` / `MLATokenToKVPoolHost`).
        page_size: tokens per page (both pools use it).
        io_backend: `kernel` or `direct`, passed to the host pool's transfer functions.
        device: where the device pool lives (default: the pool's own device).
    Raises:
        ValueError: the allocator has no device pool, or the page sizes differ.
    """

    def __init__(
        self,
        token_to_kv_pool_allocator: "TokenToKVPoolAllocator",
        mem_pool_host: "HostKVCache",
        page_size: int,
        io_backend: str,
        device: str | torch.device | None = None,
    ) -> None:
        self.allocator = token_to_kv_pool_allocator
        self.mem_pool_device = token_to_kv_pool_allocator.get_kvcache()
        if self.mem_pool_device is None:
            raise ValueError("HiCacheController needs an allocator that knows its device KV pool")
        if mem_pool_host.page_size != page_size:
            raise ValueError(f"host pool page_size {mem_pool_host.page_size} != page_size {page_size}")
        self.mem_pool_host = mem_pool_host
        self.page_size = page_size
        self.io_backend = io_backend
        self.device = torch.device(device) if device is not None else self.mem_pool_device.device
        self.is_cuda = self.device.type == "cuda"
        self.write_stream = torch.cuda.Stream(self.device) if self.is_cuda else None
        self.load_stream = torch.cuda.Stream(self.device) if self.is_cuda else None

        self.layer_num = self.mem_pool_device.layer_num
        self.layer_counter = LayerLoadingCounter(self.layer_num, self.device)
        self.mem_pool_device.register_layer_transfer_counter(self.layer_counter)

        self._op_ids = itertools.count()
        self.write_queue: list[CacheOperation] = []
        self.load_queue: list[CacheOperation] = []
        self.ack_write_queue: deque[CacheAck] = deque()
        self.ack_load_queue: deque[CacheAck] = deque()
        self._last_write_event: "torch.cuda.Event | None" = None

    # ------------------------------------------------------------------ write (D2H)

    def write(self, device_indices: torch.Tensor, node_id: int) -> torch.Tensor | None:
        """Back up `device_indices` (whole pages, on the device) to newly taken host slots.

        The copy starts now (ordered after work already queued on the compute stream).
        Returns the host slots (int64 CPU `[n]`), or None when the host pool has too few
        free slots (nothing is taken; the caller may evict host nodes and retry).
        """
        host_indices = self.mem_pool_host.alloc(len(device_indices))
        if host_indices is None:
            return None
        self.write_queue.append(CacheOperation(next(self._op_ids), host_indices, device_indices, [node_id]))
        self.start_writing()
        return host_indices

    def start_writing(self) -> None:
        """Issue every queued write as one all-layer copy and queue its ack."""
        if not self.write_queue:
            return
        op = CacheOperation.merge(self.write_queue)
        self.write_queue = []
        n = len(op.device_indices)
        if not self.is_cuda:
            self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, op.host_indices, op.device_indices, self.io_backend)
            self.ack_write_queue.append(CacheAck(op.op_id, op.node_ids, n))
            return
        start, finish = torch.cuda.Event(), torch.cuda.Event()
        start.record()  # on the compute stream: after the forward that wrote these slots
        with torch.cuda.stream(self.write_stream):
            self.write_stream.wait_event(start)
            self.mem_pool_host.backup_from_device_all_layer(
                self.mem_pool_device, op.host_indices, op.device_indices, self.io_backend)
            finish.record(self.write_stream)
        op.device_indices.record_stream(self.write_stream)
        self._last_write_event = finish
        self.ack_write_queue.append(CacheAck(op.op_id, op.node_ids, n, finish))

    def order_compute_after_writes(self) -> None:
        """Make later compute-stream work (and loads, which start from it) wait for every
        write issued so far: call before handing the written device slots out again.
        Nothing to do on the CPU, where writes are already complete."""
        if self.is_cuda and self._last_write_event is not None:
            torch.cuda.current_stream().wait_event(self._last_write_event)

    # ------------------------------------------------------------------ load (H2D)

    def load(self, host_indices: torch.Tensor, node_id: int) -> torch.Tensor | None:
        """Queue a load-back of `host_indices` (CPU) into newly taken device slots.

        Returns the device slots (int64 on the device), or None when the device allocator
        has too few free pages (nothing is taken; the caller may evict and retry). The copy
        starts at the next `start_loading()`.
        """
        device_indices = self.allocator.alloc(len(host_indices))
        if device_indices is None:
            return None
        self.load_queue.append(CacheOperation(next(self._op_ids), host_indices, device_indices, [node_id]))
        return device_indices

    def start_loading(self) -> int:
        """Issue every queued load as one layer-by-layer copy.

        Returns the load's producer number (`layer_counter.num_loads`), or -1 when nothing
        was queued. On CUDA, forwards issued afterwards wait per layer until it has arrived.
        """
        if not self.load_queue:
            return -1
        op = CacheOperation.merge(self.load_queue)
        self.load_queue = []
        n = len(op.host_indices)
        layer_events = self.layer_counter.start_producer()
        if not self.is_cuda:
            for layer_id in range(self.layer_num):
                self.mem_pool_host.load_to_device_per_layer(
                    self.mem_pool_device, op.host_indices, op.device_indices, layer_id, self.io_backend)
            self.ack_load_queue.append(CacheAck(op.op_id, op.node_ids, n))
            return self.layer_counter.num_loads
        start, finish = torch.cuda.Event(), torch.cuda.Event()
        start.record()  # after earlier compute (and, through it, earlier writes of these slots)
        with torch.cuda.stream(self.load_stream):
            self.load_stream.wait_event(start)
            for layer_id in range(self.layer_num):
                self.mem_pool_host.load_to_device_per_layer(
                    self.mem_pool_device, op.host_indices, op.device_indices, layer_id, self.io_backend)
                layer_events[layer_id].record(self.load_stream)
            finish.record(self.load_stream)
        op.device_indices.record_stream(self.load_stream)
        self.ack_load_queue.append(CacheAck(op.op_id, op.node_ids, n, finish))
        return self.layer_counter.num_loads

    # ------------------------------------------------------------------ acks

    @staticmethod
    def _drain(queue: deque[CacheAck]) -> list[CacheAck]:
        done = []
        while queue and queue[0].done():
            ack = queue.popleft()
            ack.synchronize()  # already complete; makes the host's view of it final
            done.append(ack)
        return done

    def poll_write_acks(self) -> list[CacheAck]:
        """Finished writes, oldest first (stops at the first unfinished one)."""
        return self._drain(self.ack_write_queue)

    def poll_load_acks(self) -> list[CacheAck]:
        """Finished loads, oldest first; once none is in flight, layer waits stop."""
        done = self._drain(self.ack_load_queue)
        if not self.ack_load_queue and not self.load_queue:
            self.layer_counter.clear()
        return done

    def has_pending(self) -> bool:
        return bool(self.write_queue or self.load_queue or self.ack_write_queue or self.ack_load_queue)

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
        self.write_queue = []
        self.load_queue = []
        self.ack_write_queue.clear()
        self.ack_load_queue.clear()
        self._last_write_event = None
        self.layer_counter.clear()
