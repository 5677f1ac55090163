"""Prefix index over the device KV pool: a radix tree of token ids → KV slots.

Each edge (node) holds a run of token ids (`key`) and the device slots of their KV
(`value`, int64, same length). With `page_size > 1` every key and value length is a
multiple of page_size and nodes split only at page boundaries, so a node always
owns whole pages.

Slots are int64 CPU tensors (the allocator's). The tree implements the prefix-cache
contract (prefix_cache.py): it never frees a slot itself, and knows nothing of requests;
the KV manager (kv_manager.py) decides which of a request's slots go into it.

A node with `lock_ref > 0` is in use by some request and is never evicted; `lock_ref`
is counted along the whole path (inc/dec walk to the root). `evictable_size()` and
`protected_size()` count tokens in unlocked / locked nodes.
"""

from __future__ import annotations

import heapq
import itertools
import time

import torch

from hiserve.mem_cache.prefix_cache import (
    InsertResult,
    MatchResult,
    PrefixCache,
    PrefixHandle,
    empty_slots,
)


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
        lock_ref: requests and transfers pinning this node on the device (counted along
            the path: every lock of a descendant counts here too).
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


class RadixCache(PrefixCache):
    """Radix tree of cached prefixes whose KV lives in the device pool (the prefix-cache
    contract of prefix_cache.py).

    Slots are int64 CPU tensors throughout (the allocator's); the tree never frees a slot
    itself: `insert` says which of the caller's slots are duplicates and `evict` returns
    the slots it dropped, and the caller (the KV manager) frees them.

    Args:
        page_size: tokens per page; matches and inserts are page-aligned.
    """

    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self.reset()

    # ---- helpers ------------------------------------------------------------------

    def _child_key(self, key: list[int]) -> ChildKey:
        return key[0] if self.page_size == 1 else tuple(key[: self.page_size])

    def _page_match_len(self, a: list[int], b: list[int]) -> int:
        n = _match_len(a, b)
        return n - n % self.page_size

    def _new_node(self) -> TreeNode:
        """Every node of the tree is made here, so a subclass's tree holds its own node type."""
        return TreeNode()

    @staticmethod
    def _handle(node: TreeNode, cached_len: int) -> PrefixHandle:
        return PrefixHandle(cached_len, node)

    def _split_node(self, node: TreeNode, split_len: int) -> TreeNode:
        """Cut `node` after `split_len` tokens; returns the new upper node.

        The original object keeps the lower part, so a handle on `node` still ends at the
        same place; both halves keep `node`'s lock_ref.
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
        """Drop the whole tree and zero the counters (slots are not freed: the caller
        clears the allocator, or evicts everything first)."""
        self.root_node = self._new_node()
        self.root_node.value = empty_slots()
        self.root_node.lock_ref = 1
        self._evictable_size = 0
        self._protected_size = 0

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        """Tokens whose KV the tree holds on the device."""
        return sum(len(n.value) for n in self._nodes() if n.value is not None)

    def _nodes(self) -> list[TreeNode]:
        """Every node but the root."""
        out, stack = [], list(self.root_node.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def lock(self, handle: PrefixHandle) -> None:
        self._inc_lock_ref(handle._node)

    def unlock(self, handle: PrefixHandle) -> None:
        self._dec_lock_ref(handle._node)

    def _inc_lock_ref(self, node: TreeNode) -> int:
        """Pin `node` and its ancestors; returns the change in evictable_size() (tokens, <= 0)."""
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 0 and node.value is not None:
                self._evictable_size -= len(node.key)
                self._protected_size += len(node.key)
                delta -= len(node.key)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent
        return delta

    def _dec_lock_ref(self, node: TreeNode) -> int:
        """Unpin `node` and its ancestors; returns the change in evictable_size() (tokens, >= 0)."""
        delta = 0
        while node is not self.root_node:
            if node.lock_ref == 1 and node.value is not None:
                self._evictable_size += len(node.key)
                self._protected_size -= len(node.key)
                delta += len(node.key)
            node.lock_ref -= 1
            assert node.lock_ref >= 0, f"lock_ref went negative on {node}"
            assert node.parent is not None
            node = node.parent
        return delta

    # ---- match and insert ---------------------------------------------------------

    def match(self, key: list[int]) -> MatchResult:
        """Longest cached page-aligned prefix of `key` (token ids), through host-only nodes too.

        Splits the last node when the match ends inside it, and refreshes last_access_time
        along the path. The device part ends at `handle`; host-only nodes past it (only a
        host tier makes them) are `host_hit_length` tokens ending at `host_handle`.
        """
        key = key[: len(key) - len(key) % self.page_size]
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
        indices = torch.cat(values) if values else empty_slots()
        handle = self._handle(last_device, len(indices))
        host_handle = self._handle(node, len(indices) + host_len) if host_len else handle
        return MatchResult(indices, handle, host_len, host_handle)

    def insert(self, key: list[int], slots: torch.Tensor, hit: bool = False) -> InsertResult:
        """Add `key` (token ids) with device `slots` (int64 CPU `[len(key)]`); `hit` is
        for subclasses that count reuse.

        `cached_len` of the result is the *device* prefix that was already in the tree: the
        caller still owns `slots[:cached_len]` (duplicates to free); the tree owns the rest.
        Host-only nodes on the path take the caller's slots and so are on the device again.
        Raises ValueError on a length mismatch or an unaligned length.
        """
        if len(key) != len(slots):
            raise ValueError(f"key has {len(key)} tokens but slots has {len(slots)}")
        if len(key) % self.page_size != 0:
            raise ValueError(f"key length {len(key)} is not a multiple of page_size {self.page_size}")
        total = len(key)
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
                child.value = slots[:n].to("cpu", torch.int64, copy=True)
                self._revive(child)
                revived = True
            else:
                assert not revived, "a device node below a host-only node"
                prefix_len += n
            path.append(child)
            node, key, slots = child, key[n:], slots[n:]

        if key:
            leaf = self._new_node()
            leaf.parent = node
            leaf.key = list(key)
            leaf.value = slots.to("cpu", torch.int64, copy=True)
            leaf.last_access_time = now
            node.children[self._child_key(key)] = leaf
            self._evictable_size += len(key)
            path.append(leaf)
            node = leaf
        self._after_insert(path)
        return InsertResult(prefix_len, self._handle(node, total))

    def _revive(self, node: TreeNode) -> None:
        """A host-only node just got device slots back: count them (a locked node's
        tokens are protected, an unlocked one's evictable)."""
        if node.lock_ref > 0:
            self._protected_size += len(node.value)
        else:
            self._evictable_size += len(node.value)

    def _after_insert(self, path: list[TreeNode]) -> None:
        """Called with every node on an inserted key's path, root side first (new leaf
        last), once the tree holds the key: where a host tier starts backups."""

    # ---- eviction -----------------------------------------------------------------

    def evict(self, num_tokens: int) -> torch.Tensor:
        """Drop unlocked leaves, least recently used first, until `num_tokens` tokens are
        dropped or none is left; parents that become unlocked leaves join the candidates.
        Returns their slots (int64 CPU), for the caller to free."""
        if num_tokens <= 0:
            return empty_slots()
        heap = [(n.last_access_time, n.id, n) for n in self._nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_evicted = 0
        while num_evicted < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            assert node.value is not None
            freed.append(node.value)
            num_evicted += len(node.value)
            parent = self._delete_leaf(node)
            if parent is not self.root_node and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access_time, parent.id, parent))
        return torch.cat(freed) if freed else empty_slots()

    def _delete_leaf(self, node: TreeNode) -> TreeNode:
        parent = node.parent
        assert parent is not None
        del parent.children[self._child_key(node.key)]
        self._evictable_size -= len(node.key)
        return parent

    # ---- integrity ----------------------------------------------------------------

    def check_integrity(self) -> torch.Tensor:
        """Verify the tree: key/slot lengths agree and are page-aligned, children are keyed
        by their first page, every lock count covers its children's, device nodes are
        closed upwards, and the size counters equal a recount. Returns the device slots
        the tree owns (int64 CPU). Raises AssertionError naming the broken invariant."""
        evictable = protected = 0
        owned = []
        for node in self._nodes():
            assert len(node.key) > 0 and len(node.key) % self.page_size == 0, f"unaligned {node}"
            assert node.parent.children.get(self._child_key(node.key)) is node, f"mis-keyed {node}"
            child_locks = sum(c.lock_ref for c in node.children.values())
            assert node.lock_ref >= child_locks, f"{node} has fewer locks than its children"
            if node.value is None:
                assert node.host_value is not None, f"{node} holds KV in no tier"
                continue
            assert len(node.value) == len(node.key), f"{node}: {len(node.value)} slots"
            assert node.parent is self.root_node or node.parent.value is not None, \
                f"device {node} below a host-only parent"
            owned.append(node.value)
            if node.lock_ref > 0:
                protected += len(node.key)
            else:
                evictable += len(node.key)
        assert evictable == self._evictable_size, \
            f"evictable_size {self._evictable_size} != recount {evictable}"
        assert protected == self._protected_size, \
            f"protected_size {self._protected_size} != recount {protected}"
        slots = torch.cat(owned) if owned else empty_slots()
        assert len(torch.unique(slots)) == len(slots), "a device slot held by two nodes"
        return slots

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
