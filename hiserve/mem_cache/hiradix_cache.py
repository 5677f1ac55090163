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
  one request finishing (or being retracted) with that node on its path, counted in
  `cache_finished_req` only: the per-chunk and after-prefill inserts of a request re-walk
  its own nodes and are not reuse, so they count nothing. A node therefore reaches 2 when a
  second request that used it finishes.
* `write_back`: nothing is written until device eviction picks a node that is not
  backed up; it is written then and turned host-only.

Lock discipline (`lock_ref`, counted along the path to the root, as in RadixCache):

* a write started by write_through(_selective) locks its node until the write's ack
  (`check_hicache_events`), so its device slots cannot be evicted and reused mid-copy;
  a request finishing or aborting meanwhile only drops its own lock.
* a write started by device eviction (write_back) takes no lock: the node's device slots
  are freed at once and, on CUDA, the compute stream is made to wait for the write
  (`order_compute_after_writes`) before anything can reuse them.
* a load-back locks the loaded chain until the load's ack; while a load-back allocates
  (and maybe evicts) it also locks the device ancestor and pins the host-only chain
  (`host_ref`) against host eviction.

Host-only nodes are never locked: locks are taken on device nodes and walk upwards only.
"""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING

import torch

from hiserve.mem_cache.cache_controller import HiCacheController
from hiserve.mem_cache.radix_cache import CacheableReq, RadixCache, TreeNode

if TYPE_CHECKING:
    from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
    from hiserve.mem_cache.memory_pool_host import HostKVCache

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
    """

    def __init__(self) -> None:
        super().__init__()
        self.hit_count = 0
        self.host_ref = 0


class HiRadixCache(RadixCache):
    """RadixCache whose evicted prefixes survive in a host pool and can be loaded back.

    Args:
        req_to_token_pool, token_to_kv_pool_allocator, page_size: as RadixCache (the
            allocator must know its device pool: `get_kvcache()`).
        mem_pool_host: the host pool backing the allocator's device pool.
        write_policy: `write_through`, `write_through_selective` or `write_back`.
        io_backend: `kernel` or `direct` (host pool transfer functions).
        load_back_threshold: host hits shorter than this many tokens are recomputed.
    Attributes:
        cache_controller: the HiCacheController moving the pages.
        backed_up_tokens_total, loaded_back_tokens_total: counters since start (metrics).
    """

    def __init__(
        self,
        req_to_token_pool: "ReqToTokenPool",
        token_to_kv_pool_allocator: "TokenToKVPoolAllocator",
        page_size: int,
        mem_pool_host: "HostKVCache",
        write_policy: str = "write_through",
        io_backend: str = "kernel",
        load_back_threshold: int = DEFAULT_LOAD_BACK_THRESHOLD,
    ) -> None:
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"unknown write policy {write_policy!r}; expected one of {WRITE_POLICIES}")
        self.mem_pool_host = mem_pool_host
        self.write_policy = write_policy
        self.load_back_threshold = load_back_threshold
        self.cache_controller = HiCacheController(
            token_to_kv_pool_allocator, mem_pool_host, page_size, io_backend)
        self.backed_up_tokens_total = 0
        self.loaded_back_tokens_total = 0
        self._counting_hits = False
        super().__init__(req_to_token_pool, token_to_kv_pool_allocator, page_size, disable=False)

    # ---- state ----------------------------------------------------------------------

    def reset(self) -> None:
        """Drop both tiers: wait for transfers, drop the tree, free every host slot.

        Device slots are not freed (as in RadixCache.reset: pair with `allocator.clear()`).
        """
        self.cache_controller.reset()
        self.mem_pool_host.clear()
        super().reset()
        self.ongoing_write_through: dict[int, TreeNode] = {}
        self.ongoing_load_back: dict[int, TreeNode] = {}

    def host_total_size(self) -> int:
        """Host slots of the pool."""
        return self.mem_pool_host.size

    def host_used_size(self) -> int:
        """Host slots in use (held by tree nodes)."""
        return self.mem_pool_host.size - self.mem_pool_host.available_size()

    def _new_node(self) -> TreeNode:
        return HiTreeNode()

    def _split_node(self, node: TreeNode, split_len: int) -> TreeNode:
        """As RadixCache's (which also splits host_value); both halves keep hit_count and
        host_ref too (a node in flight keeps its id: the lower half)."""
        upper = super()._split_node(node, split_len)
        upper.hit_count = node.hit_count
        upper.host_ref = node.host_ref
        return upper

    # ---- match and insert -----------------------------------------------------------

    # match_prefix and insert are RadixCache's: they already walk through host-only nodes
    # (match counts them as host hits, insert gives them the caller's device slots back).

    def _after_insert(self, path: list[TreeNode]) -> None:
        """Count hits (only during cache_finished_req's insert), then back up what the
        write policy wants (see the module docstring)."""
        if self._counting_hits:
            for n in path:
                n.hit_count += 1
        if self.write_policy == "write_through":
            self._backup_nodes([n for n in path if not n.backuped])
        elif self.write_policy == "write_through_selective":
            self._backup_nodes(
                [n for n in path if not n.backuped and n.hit_count >= SELECTIVE_WRITE_THRESHOLD])

    def cache_finished_req(self, req: CacheableReq) -> None:
        """As RadixCache's; this insert is the one that counts hits (one per request)."""
        self._counting_hits = True
        try:
            super().cache_finished_req(req)
        finally:
            self._counting_hits = False

    # ---- write (backup) -------------------------------------------------------------

    def _backup_nodes(self, nodes: list[TreeNode]) -> None:
        for node in nodes:
            if not self._write_backup(node, lock=True):
                break  # the host pool is full of pinned / device-resident copies

    def _write_backup(self, node: TreeNode, lock: bool) -> bool:
        """Start writing `node`'s device KV to the host; False if no host room even after
        host eviction. With `lock`, the node stays locked until the write's ack."""
        assert node.value is not None and node.host_value is None
        n = len(node.value)
        host_indices = self.cache_controller.write(node.value, node.id)
        if host_indices is None:
            self.evict_host(n)
            host_indices = self.cache_controller.write(node.value, node.id)
        if host_indices is None:
            return False
        node.host_value = host_indices
        self.backed_up_tokens_total += n
        if lock:
            self.inc_lock_ref(node)
            self.ongoing_write_through[node.id] = node
        return True

    # ---- acks -----------------------------------------------------------------------

    def check_hicache_events(self) -> None:
        """Process finished writes and loads: release the locks taken for them. Call every
        scheduler iteration (decode-only ones too), or write locks pile up."""
        self.writing_check()
        self.loading_check()

    def writing_check(self) -> None:
        for ack in self.cache_controller.poll_write_acks():
            for node_id in ack.node_ids:
                node = self.ongoing_write_through.pop(node_id, None)
                if node is not None:  # None: an unlocked write-back from eviction
                    self.dec_lock_ref(node)

    def loading_check(self) -> None:
        for ack in self.cache_controller.poll_load_acks():
            for node_id in ack.node_ids:
                node = self.ongoing_load_back.pop(node_id, None)
                if node is not None:
                    self.dec_lock_ref(node)

    # ---- load-back ------------------------------------------------------------------

    def init_load_back(
        self, last_host_node: TreeNode, host_hit_length: int, mem_quota: int | None = None
    ) -> tuple[torch.Tensor, TreeNode]:
        """Load the host-only chain ending at `last_host_node` back to the device.

        All or nothing: skipped (returns an empty tensor and the deepest device node) when
        the chain is shorter than `load_back_threshold`, longer than `mem_quota` tokens, or
        device slots cannot be found even after evicting. Otherwise returns the new device
        slots of the chain (in order) and `last_host_node`, which now holds device slots and
        stays locked until the load's ack. The copy itself starts at the next
        `ready_to_load_host_cache()`.
        """
        chain, node = [], last_host_node
        while node.evicted:
            chain.append(node)
            node = node.parent
        ancestor = node
        chain.reverse()
        n = sum(len(c.host_value) for c in chain)  # == host_hit_length of the match that found it
        if not chain or n < max(self.load_back_threshold, 1) or (mem_quota is not None and n > mem_quota):
            return self._empty_indices(), ancestor

        host_indices = torch.cat([c.host_value for c in chain])
        self.inc_lock_ref(ancestor)
        for c in chain:
            c.host_ref += 1
        try:
            device_indices = self.cache_controller.load(host_indices, last_host_node.id)
            if device_indices is None:
                self.evict(n)
                device_indices = self.cache_controller.load(host_indices, last_host_node.id)
        finally:
            for c in chain:
                c.host_ref -= 1
            self.dec_lock_ref(ancestor)
        if device_indices is None:
            return self._empty_indices(), ancestor

        offset = 0
        for c in chain:
            c.value = device_indices[offset : offset + len(c.host_value)]
            offset += len(c.host_value)
        self._evictable_size += n
        self.inc_lock_ref(last_host_node)
        self.ongoing_load_back[last_host_node.id] = last_host_node
        self.loaded_back_tokens_total += n
        return device_indices, last_host_node

    def ready_to_load_host_cache(self) -> int:
        """Start the queued load-backs (before the forward that reads them); see
        HiCacheController.start_loading."""
        return self.cache_controller.start_loading()

    # ---- eviction -------------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots, least recently used device leaves first.

        A device leaf here is an unlocked device node whose children are all host-only.
        Backed-up nodes become host-only (device slots freed, host copy kept). A node that
        is not backed up is written first under write_back (or when it has host-only
        children, which must keep a parent); otherwise, or if the host has no room, it is
        deleted with any host-only subtree. Nodes whose writes are not acknowledged yet are
        locked, so acks are processed only by `check_hicache_events`. Returns device tokens freed.
        """
        if num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._device_leaves()]
        heapq.heapify(heap)
        allocator = self.token_to_kv_pool_allocator
        num_evicted, wrote = 0, False
        allocator.free_group_begin()
        try:
            while num_evicted < num_tokens and heap:
                _, _, node = heapq.heappop(heap)
                if node.evicted or node.lock_ref > 0:
                    continue
                if not node.backuped and (self.write_policy == "write_back" or node.children):
                    wrote |= self._write_backup(node, lock=False)
                parent = node.parent
                n = len(node.value)
                allocator.free(node.value)
                self._evictable_size -= n
                num_evicted += n
                if node.backuped:
                    node.value = None
                else:
                    self._delete_subtree(node)
                if parent is not self.root_node and self._is_device_leaf(parent):
                    heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        finally:
            if wrote:
                self.cache_controller.order_compute_after_writes()
            allocator.free_group_end()
        return num_evicted

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
            self.mem_pool_host.free(c.host_value)
            stack.extend(c.children.values())

    def evict_host(self, num_tokens: int) -> int:
        """Free at least `num_tokens` host slots by deleting host-only leaves, LRU first.

        Only host-only nodes are candidates (a backed-up node's host copy stays while it is
        on the device); pinned ones (`host_ref`) are skipped. Returns host tokens freed.
        """
        if num_tokens <= 0:
            return 0
        heap, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            stack.extend(node.children.values())
            if node.evicted and not node.children and node.host_ref == 0:
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
                    and parent.host_ref == 0):
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return freed

    # ---- debugging ------------------------------------------------------------------

    def format_tree(self) -> str:
        lines = [f"root  device={self.total_size()} evictable={self._evictable_size} "
                 f"protected={self._protected_size} "
                 f"host_used={self.host_used_size()}/{self.host_total_size()}"]
        stack = [(c, 1) for c in reversed(list(self.root_node.children.values()))]
        while stack:
            node, depth = stack.pop()
            state = "host" if node.evicted else ("dev+host" if node.backuped else "dev")
            lines.append(f"{'  ' * depth}[{len(node.key)}] {state} lock_ref={node.lock_ref} "
                         f"hits={node.hit_count} key={node.key[:8]}{'...' if len(node.key) > 8 else ''}")
            stack.extend((c, depth + 1) for c in reversed(list(node.children.values())))
        return "\n".join(lines)
