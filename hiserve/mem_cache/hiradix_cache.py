"""HiRadixCache: the radix tree over two tiers, device pool (L1) and host pool (L2).

Each node may hold device slots (`value`) and host slots (`host_value`). States:

    device only      value, no host_value       (not backed up yet)
    backed up        value and host_value       (device + host copy)
    host only        host_value, value None     ("evicted": only the host copy is left)

A node with neither is deleted, never kept. Device-resident nodes are closed upwards
(a device node's parent is on the device); along any root-to-leaf path the device nodes
come first, then host-only ones. Device eviction only takes nodes whose children are all
host-only, and load-back always loads a whole host-only chain below a device node, which
keeps it so.

Write policies (`--hicache-write-policy`), i.e. when a node gets its host copy:

* `write_through`: on every insert (finished, unfinished and chunked-prefill inserts
  alike), every node on the inserted path that is not backed up is written, so a long
  chunked prompt ends up on the host chunk by chunk. (SGLang's threshold of 1 hit.)
* `write_through_selective`: a node is written once it has been hit >= 2 times. A *hit* is
  one request finishing (or being retracted) with that node on its path: an insert with
  `hit=True`, which the KV manager passes only then; the per-chunk and after-prefill inserts
  of a request re-walk its own nodes and are not reuse, so they count nothing. A node
  therefore reaches 2 when a second request that used it finishes.
* `write_back`: nothing is written until device eviction picks a node that is not
  backed up; it is written then and turned host-only.

Locks and transfers:

* a write (backup) takes no lock. If device eviction picks a node whose write is still in
  flight, the node turns host-only at once but its device slots wait on a pending list
  until the write's ack (`poll`), so nothing can overwrite them mid-copy and the compute
  stream never waits for a write.
* a load-back locks the loaded chain's last node until the load's ack, and the load waits
  (on its own stream) for any write of the same host pages still in flight. While the
  KV manager allocates device slots for a load-back, the host-only chain is pinned
  (`host_ref`) so host eviction cannot drop it.

Host-only nodes are never locked: locks are taken on device nodes and walk upwards only.

With a storage tier (L3) the mixin in hiradix_storage.py adds page keys per node, a
write-through to storage once a node's host write is acknowledged (host pages pinned while
the storage worker reads them), and prefetches from storage that insert host-only nodes.
"""

from __future__ import annotations

import contextlib
import heapq
import logging
from typing import Iterator

import torch

from hiserve.mem_cache.cache_controller import CacheAck, HiCacheController, agreed_done
from hiserve.mem_cache.hiradix_storage import HiRadixStorageMixin
from hiserve.mem_cache.prefix_cache import InsertResult, PrefixHandle, empty_slots
from hiserve.mem_cache.radix_cache import RadixCache, TreeNode
from hiserve.mem_cache.storage_controller import StorageConfig, StorageController

logger = logging.getLogger(__name__)

WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
# Hits (finished requests through a node) before write_through_selective backs it up.
SELECTIVE_WRITE_THRESHOLD = 2
# Host hits shorter than this are recomputed rather than loaded back (SGLang: 10 tokens);
# a host hit is always at least one page, so one page is the effective minimum.
DEFAULT_LOAD_BACK_THRESHOLD = 10


class HiTreeNode(TreeNode):
    """A TreeNode with the host tier's bookkeeping.

    Attributes (besides TreeNode's):
        hit_count: requests that finished with this node on their path.
        host_ref: pins on the host copy (a load-back in progress); host eviction skips it.
        storage_keys, storage_state, storage_ops: the storage tier's (hiradix_storage.py):
            page keys, None / "queued" / "stored", ids of storage ops pinning the host copy.
    """

    def __init__(self) -> None:
        super().__init__()
        self.hit_count = 0
        self.host_ref = 0
        self.storage_keys: list[str] | None = None
        self.storage_state: str | None = None
        self.storage_ops: list[int] = []


class HiRadixCache(HiRadixStorageMixin, RadixCache):
    """RadixCache whose evicted prefixes survive in a host pool and can be loaded back.

    Args:
        page_size: tokens per page (both pools use it).
        cache_controller: moves pages between the device pool and its host pool.
        write_policy: `write_through`, `write_through_selective` or `write_back`.
        load_back_threshold: host hits shorter than this many tokens are recomputed.
        storage: the storage tier's worker (None: no L3); its backend reads and writes this
            cache's host pool. storage_namespace: prefix of the page keys
            (`keys.storage_namespace`). storage_config: prefetch policy and limits.
    Attributes:
        mem_pool_host: the host pool (the controller's).
        backed_up_tokens_total, loaded_back_tokens_total: counters since start (metrics).
    """

    def __init__(
        self,
        page_size: int,
        cache_controller: HiCacheController,
        write_policy: str = "write_through",
        load_back_threshold: int = DEFAULT_LOAD_BACK_THRESHOLD,
        storage: StorageController | None = None,
        storage_namespace: str = "",
        storage_config: StorageConfig | None = None,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        self.cache_controller = cache_controller
        self.mem_pool_host = cache_controller.mem_pool_host
        self.write_policy = write_policy
        self.load_back_threshold = max(load_back_threshold, 1)
        self.backed_up_tokens_total = 0
        self.loaded_back_tokens_total = 0
        self._counting_hits = False
        self._init_storage(storage, storage_namespace, storage_config)
        super().__init__(page_size)

    # ---- state ----------------------------------------------------------------------

    def reset(self) -> None:
        """Drop both tiers: wait for transfers (storage ones too), drop the tree, free every
        host slot. Storage keeps its pages (it outlives this process and may be shared).

        Device slots are not freed (as in RadixCache.reset: pair with `allocator.clear()`).
        """
        self.cache_controller.reset()
        self._reset_storage()
        self.mem_pool_host.clear()
        super().reset()
        self._writing: dict[int, tuple[TreeNode, CacheAck]] = {}  # node id -> its write
        self._loading: dict[int, TreeNode] = {}  # node id -> loaded chain end (locked)
        self._pending: list[tuple[CacheAck, torch.Tensor]] = []  # evicted mid-write
        self._pending_tokens = 0

    def host_total_size(self) -> int:
        """Host slots of the pool."""
        return self.mem_pool_host.size

    def host_used_size(self) -> int:
        """Host slots in use (held by tree nodes)."""
        return self.mem_pool_host.size - self.mem_pool_host.available_size()

    def pending_slots(self) -> int:
        return self._pending_tokens

    def pending_indices(self) -> torch.Tensor:
        return torch.cat([s for _, s in self._pending]) if self._pending else empty_slots()

    def _new_node(self) -> TreeNode:
        return HiTreeNode()

    def _split_node(self, node: TreeNode, split_len: int) -> TreeNode:
        """As RadixCache's (which also splits host_value); both halves keep hit_count and
        host_ref. A node in flight keeps its id (the lower half), so the upper half joins
        its transfer's bookkeeping too."""
        upper = super()._split_node(node, split_len)
        upper.hit_count = node.hit_count
        upper.host_ref = node.host_ref
        if node.id in self._writing:
            self._writing[upper.id] = (upper, self._writing[node.id][1])
        self._split_storage(node, upper, split_len)
        return upper

    # ---- insert ---------------------------------------------------------------------

    def insert(self, key: list[int], slots: torch.Tensor, hit: bool = False) -> InsertResult:
        """As RadixCache's; `hit`: this insert ends a request's use of the prefix (a
        finished or retracted request), which counts one hit on every node of its path."""
        self._counting_hits = hit
        try:
            return super().insert(key, slots)
        finally:
            self._counting_hits = False

    def _after_insert(self, path: list[TreeNode]) -> None:
        """Count hits, then back up what the write policy wants (module docstring)."""
        self._assign_storage_keys(path)
        if self._counting_hits:
            for n in path:
                n.hit_count += 1
        if self.write_policy == "write_through":
            self._backup_nodes([n for n in path if not n.backuped])
        elif self.write_policy == "write_through_selective":
            self._backup_nodes(
                [n for n in path if not n.backuped and n.hit_count >= SELECTIVE_WRITE_THRESHOLD])

    # ---- write (backup) -------------------------------------------------------------

    def _backup_nodes(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            if not self._write_backup(node):
                break  # the host pool is full of pinned / device-resident copies

    def _write_backup(self, node: TreeNode) -> bool:
        """Start writing `node`'s device KV to the host; False if no host room even after
        host eviction."""
        assert node.value is not None and node.host_value is None
        n = len(node.value)
        started = self.cache_controller.write(node.value, node.id)
        if started is None:
            self.evict_host(n)
            started = self.cache_controller.write(node.value, node.id)
        if started is None:
            return False
        node.host_value, ack = started
        self._writing[node.id] = (node, ack)
        self.backed_up_tokens_total += n
        return True

    # ---- acks -----------------------------------------------------------------------

    def poll(self) -> torch.Tensor:
        """Process finished writes and loads (call every scheduler iteration): unlock
        loaded chains and return the device slots of nodes evicted mid-write whose write
        has now finished (int64 CPU), for the caller to free."""
        finished = {id(ack) for ack in self.cache_controller.poll_write_acks()}
        written = []
        if finished:  # a split node's upper half shares its lower half's write
            written = [v[0] for v in self._writing.values() if id(v[1]) in finished]
            self._writing = {k: v for k, v in self._writing.items() if id(v[1]) not in finished}
        self._storage_poll(written)  # write-through to L3 after the host write; storage acks
        for ack in self.cache_controller.poll_load_acks():
            for node_id in ack.node_ids:
                node = self._loading.pop(node_id, None)
                if node is not None:
                    self._dec_lock_ref(node)
        return self._release_pending(wait=False)

    def _release_pending(self, wait: bool) -> torch.Tensor:
        """Slots of evicted nodes whose write has finished; with `wait`, block for all."""
        free, keep = [], []
        done = [True] * len(self._pending) if wait else agreed_done([a for a, _ in self._pending])
        for (ack, slots), ok in zip(self._pending, done):
            if wait:
                ack.synchronize()
            (free if ok else keep).append((ack, slots))
        self._pending = keep
        self._pending_tokens = sum(len(s) for _, s in keep)
        return torch.cat([s for _, s in free]) if free else empty_slots()

    def wait_pending(self) -> torch.Tensor:
        """Block until every write of an evicted node has finished; returns their slots
        (the caller frees them). Used only when the allocator is short without them."""
        return self._release_pending(wait=True)

    # ---- load-back ------------------------------------------------------------------

    def _host_chain(self, host_handle: PrefixHandle) -> list[TreeNode]:
        chain, node = [], host_handle._node
        while node.evicted:
            chain.append(node)
            node = node.parent
        return chain[::-1]

    @contextlib.contextmanager
    def pinned(self, host_handle: PrefixHandle) -> Iterator[None]:
        """Keep the host-only chain ending at `host_handle` out of host eviction meanwhile."""
        chain = self._host_chain(host_handle)
        for c in chain:
            c.host_ref += 1
        try:
            yield
        finally:
            for c in chain:
                c.host_ref -= 1

    def load_back(self, host_handle: PrefixHandle, device_indices: torch.Tensor) -> None:
        """Give the host-only chain ending at `host_handle` the device slots
        `device_indices` (int64 CPU, one per chain token, allocated by the caller) and queue
        the copy; the chain's last node stays locked until the load's ack. The copy starts
        at the next `cache_controller.start_loading()`."""
        chain = self._host_chain(host_handle)
        host_indices = torch.cat([c.host_value for c in chain])
        assert len(host_indices) == len(device_indices), "load-back slots do not cover the chain"
        writes = [self._writing[c.id][1] for c in chain if c.id in self._writing]
        offset = 0
        for c in chain:
            c.value = device_indices[offset : offset + len(c.host_value)]
            offset += len(c.host_value)
            self._evictable_size += len(c.value)
        last = host_handle._node
        self._inc_lock_ref(last)
        self._loading[last.id] = last
        self.cache_controller.load(host_indices, device_indices, last.id, after=writes)
        self.loaded_back_tokens_total += len(device_indices)

    # ---- eviction -------------------------------------------------------------------

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop at least `num_tokens` device tokens, least recently used device leaves first.

        A device leaf here is an unlocked device node whose children are all host-only.
        Backed-up nodes become host-only (host copy kept). A node that is not backed up is
        written first under write_back (or when it has host-only children, which must keep
        a parent); otherwise, or if the host has no room, it is deleted with any host-only
        subtree. Returns the slots free now (int64 CPU); slots of nodes whose write is
        still in flight go to the pending list instead (`poll`, `wait_pending`).
        """
        if num_tokens <= 0:
            return empty_slots()
        heap = [(n.last_access_time, n.id, n) for n in self._device_leaves()]
        heapq.heapify(heap)
        free_now: list[torch.Tensor] = []
        writing: list[tuple[CacheAck, torch.Tensor]] = []  # evicted while their write may still run
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            if node.evicted or node.lock_ref > 0:
                continue
            if not node.backuped and (self.write_policy == "write_back" or node.children):
                self._write_backup(node)
            parent, slots = node.parent, node.value
            self._evictable_size -= len(slots)
            num_evicted += len(slots)
            write = self._writing.get(node.id)
            if write is not None:
                writing.append((write[1], slots))
            else:
                free_now.append(slots)
            if node.backuped:
                node.value = None
            else:
                self._delete_subtree(node)
            if parent is not self.root_node and self._is_device_leaf(parent):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        # One agreement across TP ranks for all of them (a collective, not one per node): every
        # rank must free, or pend until the write's ack, the same slots.
        for (ack, slots), done in zip(writing, agreed_done([ack for ack, _ in writing])):
            if done:
                free_now.append(slots)
            else:
                self._pending.append((ack, slots))
                self._pending_tokens += len(slots)
        return torch.cat(free_now) if free_now else empty_slots()

    def _is_device_leaf(self, node: TreeNode) -> bool:
        return (node.value is not None and node.lock_ref == 0
                and all(c.evicted for c in node.children.values()))

    def _device_leaves(self) -> list[TreeNode]:
        leaves, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            if node.evicted:
                continue
            stack.extend(node.children.values())
            if self._is_device_leaf(node):
                leaves.append(node)
        return leaves

    def _delete_subtree(self, node: TreeNode) -> None:
        """Unlink `node` (its device slots already freed) and free the host copies of its
        host-only descendants."""
        del node.parent.children[self._child_key(node.key)]
        stack = list(node.children.values())
        while stack:
            c = stack.pop()
            assert c.evicted and c.host_ref == 0, "deleting a device or pinned node"
            self._free_host_of(c)  # later, if a storage op still reads it
            stack.extend(c.children.values())

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots by deleting host-only leaves, LRU first.

        Only host-only nodes are candidates (a backed-up node's host copy stays while it is
        on the device); pinned ones (`host_ref`, or a storage op's `storage_ops`) are
        skipped. Returns host tokens freed.
        """
        if num_tokens <= 0:
            return 0
        heap, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.evicted and not node.children and node.host_ref == 0 and not node.storage_ops:
                heap.append((node.last_access_time, node.id, node))
        heapq.heapify(heap)
        freed = 0
        while freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            self.mem_pool_host.free(node.host_value)
            freed += len(node.host_value)
            parent = node.parent
            del parent.children[self._child_key(node.key)]
            if (parent is not self.root_node and parent.evicted and not parent.children
                    and parent.host_ref == 0 and not parent.storage_ops):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    # ---- integrity ----------------------------------------------------------------

    def check_integrity(self) -> torch.Tensor:
        """RadixCache's checks, plus the host tier: host slots held by nodes are distinct,
        page-aligned runs, and together with the slots storage ops hold and the host pool's
        free slots cover the pool exactly; no host pin (`host_ref`) outlives its load-back
        set-up; storage pins match the storage ops in flight."""
        owned = super().check_integrity()
        nodes = self._nodes()
        host = [n.host_value for n in nodes if n.host_value is not None]
        host.append(self._storage_host_slots())  # prefetch ops, frees deferred by storage pins
        self._check_storage_integrity(nodes)
        for n in nodes:
            assert n.host_ref == 0, f"{n} is still pinned on the host"
            if n.host_value is not None:
                assert len(n.host_value) == len(n.key), f"{n}: {len(n.host_value)} host slots"
        host_slots = torch.cat(host) if host else empty_slots()
        assert len(torch.unique(host_slots)) == len(host_slots), "a host slot held by two nodes"
        in_use = self.mem_pool_host.size - self.mem_pool_host.available_size()
        assert in_use == len(host_slots), \
            f"host pool has {in_use} slots in use but the tree and storage ops hold {len(host_slots)}"
        return owned

    # ---- debugging ------------------------------------------------------------------

    def format_tree(self) -> str:
        lines = [f"root  device={self.total_size()} evictable={self._evictable_size} "
                 f"protected={self._protected_size} pending={self._pending_tokens} "
                 f"host_used={self.host_used_size()}/{self.host_total_size()}"]
        stack = [(c, 1) for c in reversed(list(self.root_node.children.values()))]
        while stack:
            node, depth = stack.pop()
            state = "host" if node.evicted else ("dev+host" if node.backuped else "dev")
            lines.append(f"{'  ' * depth}[{len(node.key)}] {state} lock_ref={node.lock_ref} "
                         f"hits={node.hit_count} key={node.key[:8]}{'...' if len(node.key) > 8 else ''}")
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)
