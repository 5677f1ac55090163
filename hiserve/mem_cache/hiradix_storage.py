"""The storage tier (L3) side of HiRadixCache: write-through to storage and prefetch from it.

Mixed into `HiRadixCache` (hiradix_cache.py); every method runs on the scheduler thread.
Backend calls run on the storage worker (`storage_controller.py`), which hands finished ops
back through `_storage_poll()`, called from `HiRadixCache.poll()`.

Per node (`HiTreeNode`):

    storage_keys    one key per page of the node (`storage/keys.py`: chained sha256),
                    computed at insert from the parent's last key; split with the node
    storage_state   None · "queued" (a backup op has it) · "stored" (storage holds every page)
    storage_ops     ids of storage ops pinning the node's host pages: host eviction skips it,
                    and a deletion that cannot wait defers freeing its host slots until the
                    last pin goes (`_deferred_host`)

Write-through: when a node's host write is acknowledged, a `BackupOp` of its pages is queued
(pinned until the worker is done); the worker skips pages already stored. A node already
"queued" or "stored" is not queued again.

Prefetch (a request's prefix past what the tree holds, at queue entry):

    start_prefetch   match; keys of the remaining full pages; pin the matched path;
                     worker: batch_exists → hit pages
    (poll)           hits ≥ threshold: take host slots (≤ prefetch_host_fraction of the pool,
                     evicting unpinned host-only leaves), worker: batch_get_into in batches
    prefetch_ready   the policy: best_effort / wait_complete / timeout
    take_prefetch    cancel; insert the arrived leading pages as host-only nodes below the
                     matched path (pages inserted meanwhile by others: freed); the slots of
                     pages that did not arrive are freed once the worker has let go
    cancel_prefetch  (abort) the same without inserting

Host slots are owned exactly once: by a tree node, by a prefetch op (`_prefetch_ops`), by the
deferred-free list, or by the host pool's free list (`_storage_host_slots`, checked by
`check_integrity`). SGLang's counterparts: `HiRadixCache.prefetch_from_storage`,
`check_prefetch_progress`, `_insert_helper_host`, `write_backup_storage`.

Tensor parallelism: each rank has its own worker and store namespace (MHA: its own heads, the
rank in the namespace; MLA: one namespace, written by rank 0 only, read by all, as SGLang
does), and the ranks agree on everything the worker decides asynchronously, so every tree
stays equal (`tp_min_ints`, CPU group): the worker runs ops in submission order, so the ops
finished on *every* rank are a common prefix and only those are processed (the rest wait,
still the worker's); `hit_pages`, `stored_pages` and, at take time, `completed_pages` are the
minimum over the ranks, and the `timeout` policy's verdict is "ready" only when every rank's
clock says so.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from hiserve.distributed import get_tp_group, tp_min_ints
from hiserve.mem_cache.prefix_cache import empty_slots
from hiserve.mem_cache.storage.keys import page_keys
from hiserve.mem_cache.storage_controller import BackupOp, PrefetchOp, StorageConfig, StorageOpStats

if TYPE_CHECKING:
    from hiserve.mem_cache.radix_cache import TreeNode
    from hiserve.mem_cache.storage_controller import StorageController

logger = logging.getLogger(__name__)


class HiRadixStorageMixin:
    """L3 methods of HiRadixCache (module docstring). Needs the host cache's `root_node`,
    `page_size`, `mem_pool_host`, `match`, `evict_host`, `_child_key`, `_new_node`."""

    storage: "StorageController | None" = None

    def _init_storage(self, storage: "StorageController | None", namespace: str,
                      config: StorageConfig | None) -> None:
        self.storage = storage
        self.storage_namespace = namespace
        self.storage_config = config or StorageConfig()
        self.storage_stats = StorageOpStats()
        self._prefetch_ops: dict[int, PrefetchOp] = {}
        self._storage_done: list[BackupOp | PrefetchOp] = []  # finished here, not on every rank yet
        # MLA under TP: every rank holds the same latent, so only rank 0 writes it (one namespace).
        self._storage_writer = get_tp_group().is_first or not self._storage_is_mla()

    def _reset_storage(self) -> None:
        """Cancel the prefetches, let the worker finish every op and account for them; the
        slots go with the host pool's clear (the caller's next step)."""
        if self.storage is not None:
            for op in self._prefetch_ops.values():
                op.cancelled = True
            while self.storage.in_flight() + len(self._storage_done):  # equal on every rank
                self.storage.wait_idle()
                self._storage_poll([])
        self._storage_pins: dict[int, list["TreeNode"]] = {}  # op id -> pinned nodes
        self._prefetch_ops: dict[int, PrefetchOp] = {}
        self._deferred_host: list[tuple[set[int], torch.Tensor]] = []

    def _storage_is_mla(self) -> bool:
        return [k.name for k in self.mem_pool_host.kinds] == ["kv"]

    def _agreed_storage_ops(self) -> list[BackupOp | PrefetchOp]:
        """Finished ops to process now: at TP 1 all of them; under TP the leading ones every
        rank has finished (the worker keeps submission order); the others stay the worker's
        (`in_worker`) until the next poll."""
        self._storage_done += self.storage.poll()
        n = len(self._storage_done)
        if get_tp_group().size > 1:
            n = tp_min_ints([n])[0]
        ops, self._storage_done = self._storage_done[:n], self._storage_done[n:]
        for op in self._storage_done:
            op.in_worker = True
        return ops

    # ---- keys -----------------------------------------------------------------------

    def _assign_storage_keys(self, path: list["TreeNode"]) -> None:
        """Give every node of an inserted path (root side first) its page keys."""
        if self.storage is None:
            return
        for node in path:
            if node.storage_keys is None:
                parent = node.parent
                prior = parent.storage_keys[-1] if parent is not self.root_node else None
                start = self._depth_tokens(parent) // self.page_size
                node.storage_keys = page_keys(node.key, self.page_size, self.storage_namespace,
                                              start_page=start, prior=prior)

    def _depth_tokens(self, node: "TreeNode") -> int:
        n = 0
        while node is not self.root_node:
            n += len(node.key)
            node = node.parent
        return n

    def _split_storage(self, node: "TreeNode", upper: "TreeNode", split_len: int) -> None:
        """Share `node`'s storage bookkeeping with its new upper half (called from _split_node)."""
        if node.storage_keys is not None:
            cut = split_len // self.page_size
            upper.storage_keys, node.storage_keys = node.storage_keys[:cut], node.storage_keys[cut:]
        upper.storage_state = node.storage_state
        upper.storage_ops = list(node.storage_ops)
        for op_id in node.storage_ops:
            self._storage_pins[op_id].append(upper)

    # ---- pins and host frees ----------------------------------------------------------

    def _pin(self, op_id: int, nodes: list["TreeNode"]) -> None:
        self._storage_pins[op_id] = list(nodes)
        for n in nodes:
            n.storage_ops.append(op_id)

    def _unpin(self, op_id: int) -> None:
        for n in self._storage_pins.pop(op_id, []):
            n.storage_ops.remove(op_id)
        keep = []
        for ops, slots in self._deferred_host:
            ops.discard(op_id)
            if ops:
                keep.append((ops, slots))
            else:
                self.mem_pool_host.free(slots)
        self._deferred_host = keep

    def _free_host_of(self, node: "TreeNode") -> None:
        """Free a deleted node's host slots now, or when its storage pins go."""
        if node.storage_ops:
            self._deferred_host.append((set(node.storage_ops), node.host_value))
        else:
            self.mem_pool_host.free(node.host_value)

    def _storage_host_slots(self) -> torch.Tensor:
        """Host slots owned outside the tree: prefetch ops and deferred frees (int64 CPU)."""
        P = self.page_size
        held = [op.host_slots[max(op.taken_pages, 0) * P:] for op in self._prefetch_ops.values()
                if op.host_slots is not None]
        held += [s for _, s in self._deferred_host]
        return torch.cat(held) if held else empty_slots()

    def _prefetch_held_tokens(self) -> int:
        return len(self._storage_host_slots())

    # ---- write-through ------------------------------------------------------------------

    def _in_tree(self, node: "TreeNode") -> bool:
        parent = node.parent
        return parent is not None and parent.children.get(self._child_key(node.key)) is node

    def _queue_storage_backup(self, nodes: list["TreeNode"]) -> None:
        """One BackupOp for the nodes whose host copy just completed (module docstring)."""
        todo, seen = [], set()
        for n in nodes:
            if (n.id not in seen and n.storage_state is None and n.host_value is not None
                    and n.storage_keys is not None and self._in_tree(n)):
                seen.add(n.id)
                todo.append(n)
        if not todo:
            return
        P = self.page_size
        keys = [k for n in todo for k in n.storage_keys]
        pages = torch.cat([n.host_value[::P] // P for n in todo]).tolist()
        op = BackupOp(keys, pages, write=self._storage_writer)
        self._pin(op.op_id, todo)
        for n in todo:
            n.storage_state = "queued"
        self.storage.submit(op)

    def _backup_done(self, op: BackupOp) -> None:
        if get_tp_group().size > 1:  # stored on every rank (MLA: rank 0's count; the others claim all)
            op.stored_pages = tp_min_ints([op.stored_pages])[0]
        P = self.page_size
        stored = set(op.host_pages[:op.stored_pages])
        for n in self._storage_pins.get(op.op_id, []):
            pages = (n.host_value[::P] // P).tolist() if n.host_value is not None else []
            n.storage_state = "stored" if pages and all(p in stored for p in pages) else None
        self._unpin(op.op_id)
        st = self.storage_stats
        written = max(op.stored_pages - op.skipped_pages, 0)
        st.backuped_tokens_total += written * P
        st.backup_bytes_total += written * self._page_bytes_all_kinds()
        st.record("backup", written, op.seconds, written * self._page_bytes_all_kinds())
        if op.error is not None:
            self._storage_failure("worker_error", op.error)

    def _storage_failure(self, reason: str, detail: str) -> None:
        """Count a failure of the integration by reason; log the first of each (a miss)."""
        failures = self.storage_stats.failures
        if reason not in failures:
            logger.warning("storage tier: %s (%s); counted as a miss, further %r failures are counted "
                           "without logging", reason, detail, reason)
        failures[reason] += 1

    def _page_bytes_all_kinds(self) -> int:
        return sum(k.page_bytes for k in self.mem_pool_host.kinds)

    def _storage_poll(self, written_nodes: list["TreeNode"]) -> None:
        """Queue backups of nodes whose host write finished; process finished storage ops."""
        if self.storage is None:
            return
        if written_nodes:
            self._queue_storage_backup(written_nodes)
        for op in self._agreed_storage_ops():
            if isinstance(op, BackupOp):
                self._backup_done(op)
            elif op.phase == "exists":
                self._exists_done(op)
            else:
                self._fetch_done(op)

    # ---- prefetch -------------------------------------------------------------------------

    def start_prefetch(self, token_ids: list[int]) -> PrefetchOp | None:
        """Start prefetching the full pages of `token_ids` past what the tree holds (device
        or host), if at least `prefetch_threshold` tokens remain. Returns the op (pass it to
        `prefetch_ready` / `take_prefetch` / `cancel_prefetch`), or None."""
        if self.storage is None:
            return None
        P = self.page_size
        aligned = len(token_ids) - len(token_ids) % P
        m = self.match(token_ids[:aligned])
        held = m.device_len + m.host_hit_length
        cap = int(self.mem_pool_host.size * self.storage_config.prefetch_host_fraction)
        if aligned - held < max(self.storage_config.prefetch_threshold, P) or self._prefetch_held_tokens() >= cap:
            return None
        end = m.host_handle._node
        prior = end.storage_keys[-1] if end is not self.root_node else None
        keys = page_keys(token_ids[held:aligned], P, self.storage_namespace, start_page=held // P, prior=prior)
        op = PrefetchOp(keys, list(token_ids[:aligned]), held, P)
        path, node = [], end
        while node is not self.root_node:
            path.append(node)
            node = node.parent
        self._pin(op.op_id, path)  # the prefix the fetched pages extend stays on the host
        self._prefetch_ops[op.op_id] = op
        self.storage.submit(op)
        return op

    def _exists_done(self, op: PrefetchOp) -> None:
        if op.error is not None:
            self._storage_failure("worker_error", op.error)
        if op.cancelled:
            self._settle(op)
            return
        P, cfg = self.page_size, self.storage_config
        if get_tp_group().size > 1:  # pages every rank's store holds
            op.hit_pages = tp_min_ints([op.hit_pages])[0]
        room = int(self.mem_pool_host.size * cfg.prefetch_host_fraction) - self._prefetch_held_tokens()
        op.hit_pages = min(op.hit_pages, max(room, 0) // P)
        if op.hit_pages * P < max(cfg.prefetch_threshold, P):
            self._prefetch_miss(op)
            return
        need = op.hit_pages * P
        slots = self.mem_pool_host.alloc(need)
        if slots is None:
            self.evict_host(need - self.mem_pool_host.available_size())
            slots = self.mem_pool_host.alloc(need)
        if slots is None:
            self._storage_failure("host_full", f"no {need} host slots for a prefetch")
            self._prefetch_miss(op)
            return
        op.host_slots = slots
        op.host_pages = (slots[::P] // P).tolist()
        op.phase = "fetch"
        self.storage.submit(op)

    def _prefetch_miss(self, op: PrefetchOp) -> None:
        op.phase, op.hit_pages = "done", 0
        self._unpin(op.op_id)

    def _fetch_done(self, op: PrefetchOp) -> None:
        op.phase = "done"
        st = self.storage_stats
        st.record("prefetch", op.completed_pages, op.seconds, op.completed_pages * self._page_bytes_all_kinds())
        if op.error is not None:
            self._storage_failure("worker_error", op.error)
        if op.cancelled:
            self._settle(op)

    def _settle(self, op: PrefetchOp) -> None:
        """The worker has let go of `op`: free the host slots it still holds; forget it."""
        if op.host_slots is not None:
            self.mem_pool_host.free(op.host_slots[max(op.taken_pages, 0) * self.page_size:])
            op.host_slots = None
        self._unpin(op.op_id)
        self._prefetch_ops.pop(op.op_id, None)

    def prefetch_ready(self, op: PrefetchOp, now: float | None = None) -> bool:
        """Whether the policy lets the request of `op` be scheduled now (module docstring)."""
        policy = self.storage_config.prefetch_policy
        if op.phase == "done" or policy == "best_effort":
            return True
        if policy == "wait_complete":
            return False
        cfg = self.storage_config
        budget = cfg.prefetch_timeout_base + cfg.prefetch_timeout_per_ki_token * op.num_tokens / 1024
        ready = (time.monotonic() if now is None else now) - op.started >= budget
        return bool(tp_min_ints([int(ready)])[0]) if get_tp_group().size > 1 else ready

    def take_prefetch(self, op: PrefetchOp) -> int:
        """End `op` and insert the pages that have arrived as host-only nodes; returns the
        tokens inserted (0: a miss). Slots of pages that did not arrive are freed now or,
        while the worker still holds the op, when it hands it back."""
        op.cancelled = True
        n = op.completed_pages if op.phase != "exists" else 0
        if get_tp_group().size > 1:  # pages that arrived on every rank (the worker may still read)
            n = tp_min_ints([n])[0]
        inserted = self._insert_prefetched(op, n) if n else 0
        op.taken_pages = n
        self._unpin(op.op_id)
        if not op.in_worker:
            self._settle(op)
        st = self.storage_stats
        st.prefetched_tokens_total += inserted
        st.prefetch_bytes_total += inserted // self.page_size * self._page_bytes_all_kinds()
        return inserted

    def cancel_prefetch(self, op: PrefetchOp) -> None:
        """Abandon `op` (its request was aborted): nothing is inserted; its slots are freed
        once the worker has let go."""
        op.cancelled = True
        op.taken_pages = max(op.taken_pages, 0)
        self._unpin(op.op_id)
        if not op.in_worker:
            self._settle(op)

    def _insert_prefetched(self, op: PrefetchOp, num_pages: int) -> int:
        """Hang the first `num_pages` fetched pages below the tree's match of their prefix."""
        P = self.page_size
        total = op.start_len + num_pages * P
        slots = op.host_slots[:num_pages * P]
        m = self.match(op.token_ids[:total])
        held = m.device_len + m.host_hit_length
        if held < op.start_len:  # the prefix they extend has left the tree: useless
            self.mem_pool_host.free(slots)
            return 0
        dup = held - op.start_len
        self.mem_pool_host.free(slots[:dup])  # inserted meanwhile by another request
        if held >= total:
            return 0
        end = m.host_handle._node
        node = self._new_node()
        node.parent = end
        node.key = list(op.token_ids[held:total])
        node.host_value = slots[dup:].clone()
        node.storage_keys = op.keys[dup // P:num_pages]
        node.storage_state = "stored"
        end.children[self._child_key(node.key)] = node
        return total - held

    # ---- integrity and state --------------------------------------------------------------

    def _check_storage_integrity(self, nodes: list["TreeNode"]) -> None:
        """Pins agree with the ops in flight; every node has one key per page."""
        for op_id, pinned in self._storage_pins.items():
            for n in pinned:
                assert op_id in n.storage_ops, f"{n} lost its pin of storage op {op_id}"
        for n in nodes:
            for op_id in n.storage_ops:
                assert op_id in self._storage_pins, f"{n} is pinned by finished storage op {op_id}"
            if self.storage is not None:
                assert n.storage_keys is not None and len(n.storage_keys) * self.page_size == len(n.key), \
                    f"{n} has {n.storage_keys and len(n.storage_keys)} storage keys"
        for op in self._prefetch_ops.values():
            assert op.in_worker or op.phase == "done" and op.taken_pages < 0, \
                f"prefetch op {op.op_id} is neither running nor waiting to be taken"

    def storage_metrics(self) -> dict:
        """Counters for /metrics (cumulative; `recent`: the latest finished ops, see
        `StorageOpStats`), failures by reason from the backend and the integration."""
        st, bs = self.storage_stats, self.storage.backend.stats()
        cap = self.mem_pool_host.size * self.storage_config.prefetch_host_fraction
        return {"prefetched_tokens_total": st.prefetched_tokens_total,
                "backuped_tokens_total": st.backuped_tokens_total,
                "prefetch_bytes_total": st.prefetch_bytes_total, "backup_bytes_total": st.backup_bytes_total,
                "failures": dict(bs.failures + st.failures), "recent": list(st.recent),
                "prefetch_occupied_ratio": self._prefetch_held_tokens() / cap if cap else 0.0}

    def storage_state(self) -> dict | None:
        """The backend's state plus this cache's storage counters (None without storage)."""
        if self.storage is None:
            return None
        st, bs = self.storage_stats, self.storage.backend.stats()
        failures = dict(bs.failures + st.failures)
        return {**self.storage.backend.state(), "prefetch_policy": self.storage_config.prefetch_policy,
                "ops_in_flight": self.storage.in_flight(), "prefetch_ops": len(self._prefetch_ops),
                "prefetch_held_tokens": self._prefetch_held_tokens(),
                "prefetched_tokens_total": st.prefetched_tokens_total,
                "backuped_tokens_total": st.backuped_tokens_total,
                "pages_read": bs.pages_read, "pages_written": bs.pages_written,
                "pages_skipped": bs.pages_skipped, "failures": failures}
