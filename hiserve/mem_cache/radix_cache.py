"""Prefix index over the device KV pool: a radix tree of token ids → KV slots.

Each edge (node) holds a run of token ids (`key`) and the device slots of their KV
(`value`, int64, same length). With `page_size > 1` every key and value length is a
multiple of page_size and nodes split only at page boundaries, so a node always
owns whole pages.

Ownership of a request's slots (row `req_to_token[req.req_pool_idx]`):

    positions  [0 ............ cached_len) [cached_len ....... aligned_len) [aligned_len .. n)
    owner       the tree (locked via        the request; on cache_*_req      the request (the
                req.last_node)              it is inserted: the part the     unaligned tail; never
                                            tree already had is freed as a   in the tree)
                                            duplicate, the rest moves to
                                            the tree

`cached_len` is `len(req.prefix_indices)` rounded down to a page: after a chunk,
`prefix_indices` also carries the request's own unaligned tail.

A node with `lock_ref > 0` is in use by some request and is never evicted; `lock_ref`
is counted along the whole path (inc/dec walk to the root). `evictable_size()` and
`protected_size()` count tokens in unlocked / locked nodes.
"""

from __future__ import annotations

import heapq
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch

if TYPE_CHECKING:
    from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator


ChildKey = int | tuple[int, ...]

_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree.

    Attributes:
        children: child nodes keyed by the first page of their key (a token id at
            page_size 1, a tuple of page_size token ids otherwise).
        parent: None only for the root.
        key: token ids of this edge.
        value: int64 device slots `[len(key)]`, or None when the KV is not on the device
            (only a host-tier subclass creates such nodes).
        host_value: int64 host slots, reserved for the host tier (always None here).
        lock_ref: requests (and later transfers) pinning this node on the device.
        last_access_time: `time.monotonic()` of the last match/insert through it (LRU key).
        id: monotonic creation number, unique per process.
    """

    def __init__(self) -> None:
        self.children: dict[ChildKey, TreeNode] = {}
        self.parent: TreeNode | None = None
        self.key: list[int] = []
        self.value: torch.Tensor | None = None
        self.host_value: torch.Tensor | None = None
        self.lock_ref = 0
        self.last_access_time = time.monotonic()
        self.id = next(_node_ids)

    @property
    def evicted(self) -> bool:
        return self.value is None

    @property
    def backuped(self) -> bool:
        return self.host_value is not None

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    """What `match_prefix` found.

    Attributes:
        device_indices: int64 `[matched tokens]` device slots of the matched prefix.
        last_device_node: deepest matched node whose KV is on the device.
        last_host_node: deepest matched node with a host copy (equals
            last_device_node while no host tier exists).
        host_hit_length: matched tokens past last_device_node that are only on host.
    """

    device_indices: torch.Tensor
    last_device_node: TreeNode
    last_host_node: TreeNode
    host_hit_length: int = 0


class CacheableReq(Protocol):
    """The request fields the cache reads and writes (the scheduler's `Req` has more)."""

    origin_input_ids: list[int]
    output_ids: list[int]
    fill_ids: list[int]
    req_pool_idx: int
    prefix_indices: torch.Tensor
    last_node: Any


def _match_len(a: list[int], b: list[int]) -> int:
    """Length of the common prefix of two token lists (compared 64 tokens at a time)."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i : i + 64] == b[i : i + 64]:
        i += 64
    if i >= n:
        return n
    while i < n and a[i] == b[i]:
        i += 1
    return i


class RadixCache:
    """Radix tree of cached prefixes whose KV lives in the device pool.

    Args:
        req_to_token_pool: request rows (read by cache_*_req, written by cache_unfinished_req).
        token_to_kv_pool_allocator: where duplicate, tail and evicted slots are freed.
        page_size: tokens per page; matches and inserts are page-aligned.
        disable: behave as a plain chunk cache (no sharing; see each method).
    """

    def __init__(
        self,
        req_to_token_pool: "ReqToTokenPool",
        token_to_kv_pool_allocator: "TokenToKVPoolAllocator",
        page_size: int,
        disable: bool = False,
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool_allocator = token_to_kv_pool_allocator
        self.page_size = page_size
        self.disable = disable
        self.device = token_to_kv_pool_allocator.device
        self.reset()

    # ---- helpers ------------------------------------------------------------------

    def _empty_indices(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _child_key(self, key: list[int]) -> ChildKey:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _page_match_len(self, a: list[int], b: list[int]) -> int:
        n = _match_len(a, b)
        return n - n % self.page_size

    def _new_node(self) -> TreeNode:
        """Every node of the tree is made here, so a subclass's tree holds its own node type."""
        return TreeNode()

    def _split_node(self, node: TreeNode, split_len: int) -> TreeNode:
        """Cut `node` after `split_len` tokens; returns the new upper node.

        The original object keeps the lower part, so a request whose `last_node` is
        `node` still ends at the same place; both halves keep `node`'s lock_ref.
        """
        upper = self._new_node()
        upper.parent = node.parent
        upper.key = node.key[:split_len]
        upper.value = None if node.value is None else node.value[:split_len]
        upper.host_value = None if node.host_value is None else node.host_value[:split_len]
        upper.lock_ref = node.lock_ref
        upper.last_access_time = node.last_access_time
        assert node.parent is not None
        node.parent.children[self._child_key(upper.key)] = upper

        node.key = node.key[split_len:]
        node.value = None if node.value is None else node.value[split_len:]
        node.host_value = None if node.host_value is None else node.host_value[split_len:]
        node.parent = upper
        upper.children = {self._child_key(node.key): node}
        return upper

    # ---- sizes and locks ----------------------------------------------------------

    def reset(self) -> None:
        """Drop the whole tree and zero the counters.

        Does not free any slot: callers reset together with `allocator.clear()`
        (flush), or evict everything first.
        """
        self.root_node = self._new_node()
        self.root_node.value = self._empty_indices()
        self.root_node.lock_ref = 1
        self._evictable_size = 0
        self._protected_size = 0

    def evictable_size(self) -> int:
        """Tokens in unlocked nodes (free-able by `evict`)."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Tokens in nodes locked by running requests."""
        return self._protected_size

    def total_size(self) -> int:
        """Tokens whose KV the tree holds on the device."""
        total, stack = 0, [self.root_node]
        while stack:
            node = stack.pop()
            if node.value is not None:
                total += len(node.value)
            stack.extend(node.children.values())
        return total

    def inc_lock_ref(self, node: TreeNode) -> int:
        """Pin `node` and its ancestors; returns the change in evictable_size() (tokens, <= 0)."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent
        return delta

    def dec_lock_ref(self, node: TreeNode) -> int:
        """Unpin `node` and its ancestors; returns the change in evictable_size() (tokens, >= 0)."""
        if self.disable:
            return 0
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 1:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            assert node.lock_ref >= 0, f"lock_ref went negative on {node}"
            assert node.parent is not None
            node = node.parent
        return delta

    # ---- match and insert ---------------------------------------------------------

    def match_prefix(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `key` (token ids), through host-only nodes too.

        Splits the last node when the match ends inside it, and refreshes
        last_access_time along the path. `device_indices` is int64 `[matched]` on the
        allocator's device and covers the device part; last_host_node is the deepest
        matched node and host_hit_length the tokens past last_device_node that only the
        host holds (both trivial without a host tier, which alone makes host-only nodes).
        """
        key = key[: len(key) - len(key) % self.page_size]
        if self.disable or not key:
            return MatchResult(self._empty_indices(), self.root_node, self.root_node)

        now = time.monotonic()
        node, last_device, values, host_len = self.root_node, self.root_node, [], 0
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._page_match_len(child.key, key)
            ends_inside = n < len(child.key)
            if ends_inside:
                child = self._split_node(child, n)
            if child.evicted:
                host_len += len(child.host_value)
            else:
                assert host_len == 0, "a device node below a host-only node"
                values.append(child.value)
                last_device = child
            node, key = child, key[n:]
            if ends_inside:
                break
        indices = torch.cat(values) if values else self._empty_indices()
        return MatchResult(indices, last_device, node, host_len)

    def insert(self, key: list[int], value: torch.Tensor) -> int:
        """Add `key` (token ids) with device slots `value` (integer `[len(key)]`).

        Returns the length of the *device* prefix that was already in the tree: the
        caller still owns `value[:returned]` and must free it as duplicates; the tree now
        owns the rest. Host-only nodes on the path (only a host tier has them) take the
        caller's slots and so are backed up again (device + host copy). Raises ValueError
        on a length mismatch or an unaligned length.
        """
        if self.disable:
            return 0
        if len(key) != len(value):
            raise ValueError(f"key has {len(key)} tokens but value has {len(value)} slots")
        if len(key) % self.page_size != 0:
            raise ValueError(f"key length {len(key)} is not a multiple of page_size {self.page_size}")

        now = time.monotonic()
        node, prefix_len, revived, path = self.root_node, 0, False, []
        while key:
            child = node.children.get(self._child_key(key))
            if child is None:
                break
            child.last_access_time = now
            n = self._page_match_len(child.key, key)
            if n < len(child.key):
                child = self._split_node(child, n)
            if child.evicted:
                child.value = value[:n].to(self.device, torch.int64, copy=True)
                self._evictable_size += n
                revived = True
            else:
                assert not revived, "a device node below a host-only node"
                prefix_len += n
            path.append(child)
            node, key, value = child, key[n:], value[n:]

        if key:
            leaf = self._new_node()
            leaf.parent = node
            leaf.key = list(key)
            leaf.value = value.to(self.device, torch.int64, copy=True)
            leaf.last_access_time = now
            node.children[self._child_key(key)] = leaf
            self._evictable_size += len(key)
            path.append(leaf)
        self._after_insert(path)
        return prefix_len

    def _after_insert(self, path: list[TreeNode]) -> None:
        """Called with every node on an inserted key's path, root side first (new leaf
        last), once the tree holds the key: where a host tier counts hits and starts
        backups."""

    # ---- request hooks ------------------------------------------------------------

    def cache_finished_req(self, req: CacheableReq) -> None:
        """Hand a finished request's KV to the tree and release everything it held.

        Tokens with KV are `(origin_input_ids + output_ids)[:-1]` (the last output
        token was never run); the caller guarantees exactly those positions of the
        request's row hold its slots. Frees duplicates, the unaligned tail and the row,
        and unlocks `req.last_node`.
        """
        token_ids = (req.origin_input_ids + req.output_ids)[:-1]
        kv_indices = self.req_to_token_pool.req_to_token[req.req_pool_idx, : len(token_ids)].to(torch.int64)
        allocator = self.token_to_kv_pool_allocator

        if self.disable:
            allocator.free(kv_indices)
            self.req_to_token_pool.free(req.req_pool_idx)
            return

        aligned_len = len(token_ids) - len(token_ids) % self.page_size
        cached_len = len(req.prefix_indices) - len(req.prefix_indices) % self.page_size
        new_prefix_len = self.insert(token_ids[:aligned_len], kv_indices[:aligned_len])
        allocator.free(kv_indices[cached_len:new_prefix_len])
        allocator.free(kv_indices[aligned_len:])
        self.req_to_token_pool.free(req.req_pool_idx)
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: CacheableReq) -> None:
        """Insert a running request's computed prefix (`req.fill_ids`) after a prefill chunk.

        Afterwards the request's row points at the tree's slots for the aligned part,
        `req.prefix_indices` (int64) covers all of `fill_ids` (tree slots, then the
        request's own unaligned tail) and `req.last_node` is the new, locked, last node.
        """
        token_ids = req.fill_ids
        row = req.req_pool_idx
        req_to_token = self.req_to_token_pool.req_to_token
        kv_indices = req_to_token[row, : len(token_ids)].to(torch.int64)

        if self.disable:
            req.prefix_indices = kv_indices
            return

        aligned_len = len(token_ids) - len(token_ids) % self.page_size
        cached_len = len(req.prefix_indices) - len(req.prefix_indices) % self.page_size
        new_prefix_len = self.insert(token_ids[:aligned_len], kv_indices[:aligned_len])
        self.token_to_kv_pool_allocator.free(kv_indices[cached_len:new_prefix_len])

        match = self.match_prefix(token_ids[:aligned_len])
        new_indices = match.device_indices
        assert len(new_indices) == aligned_len, "the prefix just inserted must match in full"
        req_to_token[row, cached_len:aligned_len] = new_indices[cached_len:].to(req_to_token.dtype)

        self.inc_lock_ref(match.last_device_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = torch.cat([new_indices, kv_indices[aligned_len:]])
        req.last_node = match.last_device_node

    # ---- eviction -----------------------------------------------------------------

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` device slots from unlocked leaves, least recently used first.

        Parents that become unlocked leaves join the candidates. Returns the tokens
        actually freed (less than asked when not enough is evictable; 0 is always safe).
        """
        if self.disable or num_tokens <= 0:
            return 0
        heap = [(n.last_access_time, n.id, n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        allocator = self.token_to_kv_pool_allocator
        num_evicted = 0
        allocator.free_group_begin()
        try:
            while num_evicted < num_tokens and heap:
                _, _, node = heapq.heappop(heap)
                assert node.value is not None
                allocator.free(node.value)
                num_evicted += len(node.value)
                parent = self._delete_leaf(node)
                if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                    heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        finally:
            allocator.free_group_end()
        return num_evicted

    def _evictable_leaves(self) -> list[TreeNode]:
        leaves, stack = [], [self.root_node]
        while stack:
            node = stack.pop()
            if node.children:
                stack.extend(node.children.values())
            elif node is not self.root_node and node.lock_ref == 0:
                leaves.append(node)
        return leaves

    def _delete_leaf(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key)]
        self._evictable_size -= len(node.key)
        return parent

    # ---- debugging ----------------------------------------------------------------

    def pretty_print(self) -> None:
        """Print the tree, one node per line, with its length, lock_ref and first tokens."""
        print(self.format_tree(), flush=True)

    def format_tree(self) -> str:
        lines = [
            f"root  total={self.total_size()} evictable={self._evictable_size} "
            f"protected={self._protected_size}"
        ]
        stack = [(child, 1) for child in reversed(list(self.root_node.children.values()))]
        while stack:
            node, depth = stack.pop()
            head = node.key[:8]
            more = "..." if len(node.key) > 8 else ""
            lines.append(f"{'  ' * depth}[{len(node.key)}] lock_ref={node.lock_ref} key={head}{more}")
            stack.extend((child, depth + 1) for child in reversed(list(node.children.values())))
        return "\n".join(lines)
