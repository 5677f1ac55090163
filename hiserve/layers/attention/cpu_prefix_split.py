"""EXTEND attention over a cached prefix on the CPU's SDPA route, as two attentions merged by
log-sum-exp ("cascade" attention), with the prefix part shared by requests that share it.

A chunk of n new tokens over a cached prefix of p tokens attends to p + n keys under a causal
mask. Split at L <= p: every query sees all of the first L keys (no mask), and the rest
(p - L + n keys, causal) is small. Each part returns its output and the log-sum-exp of its
scores; the merged output is their softmax-weighted mean (the merge of attention states of
FlashInfer's cascade inference, Ye et al. 2024; vLLM's cascade attention does the same on GPUs).

Why: requests of one batch whose contexts start with the same pool slots (a shared system
prompt that the radix cache matched for all of them) run their prefix part as one unmasked call
over one gathered copy of the shared keys, with all their queries as rows and a KV head's G query
heads folded into them (one pass over K/V per KV head for all: GQA). Only such groups are split,
and only where the shared prefix is long, also against each member's own part: for a request
alone, or a short prefix, the unmasked prefix call plus the own call and the merge are no
faster than one masked call (see MIN_SHARED_TOKENS). Measured per layer on a
2-core Xeon with AMX, SmolLM2-135M heads, bf16 (benchmark/cpu/bench_prefix_split.py,
benchmark/results/cpu_prefix_split.json): 7 requests of 56 new tokens over a shared 1008-token
prefix 10.5 -> 6.0 ms, 4 of 128 over 2048 16.8 -> 10.3 ms.

The members' own parts run as one batched call (batch = member, queries and own keys padded
to the longest, padding masked out) where the padding at most doubles their work
(MAX_OWN_PADDING, MAX_OWN_PADDED_PAIRS): a call of a few dozen queries costs mostly its fixed
overhead. Scenario (c)'s groups, a layer's whole grouped attention
(benchmark/results/cpu_prefix_split_own_batched.json): 7 x 56 new tokens over 1008 shared
9.5 -> 8.3 ms, 8 x 50 8.1 -> 6.8 ms (0.84-0.87x; 0.87-0.90x in a first run). Otherwise one call
each.

The two parts run `aten._scaled_dot_product_flash_attention_for_cpu`, the kernel
`F.scaled_dot_product_attention` dispatches to on the CPU, called directly because it also
returns the log-sum-exp. `available()` is False where this torch lacks it; the caller then keeps
one masked SDPA call a request, as it does for a request that shares its prefix with no other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

# A group is split only where its shared prefix is long, absolutely and against each member's own
# part (its cached tokens past the shared ones plus its new tokens): per layer, split / one masked
# call each, benchmark/results/cpu_prefix_split.json (2-core Xeon with AMX): 0.53-0.72 at 1008
# and 2048 shared tokens (8-20x the own part), 0.90-1.02 at 512 (break-even), 1.02-1.40 at 256,
# 1.05-1.17 at 4x or less of the own part.
MIN_SHARED_TOKENS = 512
MIN_SHARED_TO_OWN = 8
# The own parts are batched into one call where padding them to the longest member's queries and
# keys costs at most MAX_OWN_PADDING x their unpadded work (query-key pairs) and at most
# MAX_OWN_PADDED_PAIRS pairs more: batching saves the calls' fixed overhead, which padding large
# parts outweighs (benchmark/results/cpu_prefix_split_own_batched.json, a layer's grouped
# attention batched / one call each: 0.93-0.97 at padding 1.4-1.9 with ~6000 pairs added, 0.99
# with ~19000 (128/96/64 queries), 1.13 with 30000 (200/100)).
MAX_OWN_PADDING = 2.0
MAX_OWN_PADDED_PAIRS = 16384
_FLASH_CPU = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def available() -> bool:
    """Whether this torch has the CPU flash-attention op that returns the log-sum-exp."""
    return _FLASH_CPU is not None


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: the key is seen) as the flash op takes it: 0 / -inf in `dtype`."""
    return torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, float("-inf"))


@dataclass
class _Member:
    """One request of a group: its q rows [n], and the keys past the shared part."""

    rows: torch.Tensor  # [n] int64 rows of q (and of the output)
    own_slots: torch.Tensor  # [T] int64 pool slots of context positions L .. p + n - 1
    mask: torch.Tensor  # [n, T] bool: query j sees own key t iff t <= p - L + j
    _float_mask: dict = field(default_factory=dict)  # (dtype, G) -> [G * n, T] additive mask

    def additive_mask(self, dtype: torch.dtype, group: int) -> torch.Tensor:
        """The mask as the flash op takes it (q's dtype, 0 / -inf), repeated for G folded heads."""
        m = self._float_mask.get((dtype, group))
        if m is None:
            m = self._float_mask.setdefault((dtype, group), _additive(self.mask, dtype).repeat(group, 1))
        return m


@dataclass
class PrefixGroup:
    """Requests of one EXTEND batch whose contexts start with the same `shared_slots` [L]."""

    shared_slots: torch.Tensor  # [L] int64
    members: list[_Member]
    rows: torch.Tensor = field(init=False)  # [N] int64: the members' q rows, member after member
    contiguous: bool = field(init=False)  # rows are consecutive (the output is then one slice)
    batched: _OwnBatch | None = field(init=False)  # the members' own parts as one padded call, or None

    def __post_init__(self):
        self.rows = torch.cat([m.rows for m in self.members])
        first = int(self.rows[0])
        self.contiguous = bool(torch.equal(self.rows, torch.arange(first, first + self.rows.numel())))
        self.batched = _OwnBatch.plan(self.members)


@dataclass
class _OwnBatch:
    """The members' own parts padded to one batched flash call: member i's n_i queries and T_i own
    keys in batch row i, padded to n_max queries and T_max keys (padded keys masked out; a padded
    query row sees its row's first key only, so that no row is all -inf, and is dropped)."""

    q_rows: torch.Tensor  # [B * n_max] int64 rows of q, member after member (padding repeats a row)
    slots: torch.Tensor  # [B * T_max] int64 pool slots (padding repeats the member's first own slot)
    valid: torch.Tensor | None  # [N] int64 positions of the real query rows in B * n_max order (None: all)
    visible: torch.Tensor  # [B, n_max, T_max] bool
    n_max: int
    t_max: int
    # (dtype, G) -> [B, 1, G * n_max, T_max] additive mask
    _float_mask: dict[tuple[torch.dtype, int], torch.Tensor] = field(default_factory=dict)

    @staticmethod
    def plan(members: list[_Member]) -> _OwnBatch | None:
        """The padded batch, or None where padding would cost over MAX_OWN_PADDING x the work or
        over MAX_OWN_PADDED_PAIRS query-key pairs more."""
        ns = [m.rows.numel() for m in members]
        ts = [m.own_slots.numel() for m in members]
        n_max, t_max = max(ns), max(ts)
        padded, work = len(members) * n_max * t_max, sum(n * t for n, t in zip(ns, ts))
        if padded > MAX_OWN_PADDING * work or padded - work > MAX_OWN_PADDED_PAIRS:
            return None
        b = len(members)
        q_rows = torch.empty(b, n_max, dtype=torch.int64)
        slots = torch.empty(b, t_max, dtype=torch.int64)
        visible = torch.zeros(b, n_max, t_max, dtype=torch.bool)
        for i, (m, n, t) in enumerate(zip(members, ns, ts)):
            q_rows[i, :n], q_rows[i, n:] = m.rows, m.rows[0]
            slots[i, :t], slots[i, t:] = m.own_slots, m.own_slots[0]
            visible[i, :n, :t] = m.mask
            visible[i, n:, 0] = True
        valid = None if min(ns) == n_max else torch.cat([torch.arange(i * n_max, i * n_max + n)
                                                         for i, n in enumerate(ns)])
        return _OwnBatch(q_rows.flatten(), slots.flatten(), valid, visible, n_max, t_max)

    def additive_mask(self, dtype: torch.dtype, group: int) -> torch.Tensor:
        """[B, 1, G * n_max, T_max] in `dtype` (0 / -inf), rows in the folded (head, query) order."""
        m = self._float_mask.get((dtype, group))
        if m is None:
            b = self.visible.shape[0]
            m = _additive(self.visible, dtype).unsqueeze(1).expand(b, group, self.n_max, self.t_max)
            m = self._float_mask.setdefault((dtype, group), m.reshape(b, 1, group * self.n_max, self.t_max))
        return m


def _common_len(a: torch.Tensor, b: torch.Tensor) -> int:
    """Length of the common leading run of two int64 slot vectors."""
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def _fits(shared_len: int, items: list[tuple[int, int, int, torch.Tensor]]) -> bool:
    """Whether a group of `items` on `shared_len` leading slots is worth splitting."""
    worst_own = max(p - shared_len + e - s for s, e, p, _ in items)
    return shared_len >= MIN_SHARED_TOKENS and shared_len >= MIN_SHARED_TO_OWN * worst_own


def plan_groups(chunks: list[tuple[int, int, int, torch.Tensor]]
                ) -> tuple[list[PrefixGroup], list[tuple[int, int, int, torch.Tensor]]]:
    """Group EXTEND chunks over a cached prefix by shared leading slots.

    chunks: (q_start, q_end, prefix_len, slots [prefix_len + n] int64) per request, n =
    q_end - q_start >= 1, prefix_len >= 1. Chunks are bucketed by their first slot (any shared
    run starts there, so planning stays linear in the batch); within a bucket a chunk joins the
    group it shares most leading slots with if the group, its shared part cut to that common
    run, still passes `_fits` (MIN_SHARED_TOKENS, MIN_SHARED_TO_OWN x every member's own
    part), else it opens a group of its own (shared = its whole prefix): one weakly sharing
    request cannot cancel a good group. New tokens have slots of their own, so a shared part
    never reaches into a request's new tokens.
    Returns (the groups of two or more requests that pass `_fits`, the other chunks in batch
    order). Raises nothing on well-formed chunks (IndexError on an empty slots tensor).
    """
    buckets: dict[int, list[list]] = {}  # first slot -> [[shared_slots, [chunk, ...]], ...]
    for chunk in chunks:
        prefix, slots = chunk[2], chunk[3]
        entries = buckets.setdefault(int(slots[0]), [])
        best, best_common = None, 0
        for entry in entries:
            common = _common_len(entry[0], slots[:prefix])
            if common > best_common and _fits(common, entry[1] + [chunk]):
                best, best_common = entry, common
        if best is None:
            entries.append([slots[:prefix], [chunk]])
        else:
            best[0] = best[0][:best_common]
            best[1].append(chunk)
    groups, alone = [], []
    for shared, items in (entry for entries in buckets.values() for entry in entries):
        L = shared.numel()
        if len(items) < 2 or not _fits(L, items):
            alone += items
            continue
        members = []
        for q_start, q_end, prefix, slots in items:
            n, own = q_end - q_start, prefix - L + q_end - q_start
            mask = torch.arange(own).view(1, -1) <= torch.arange(prefix - L, prefix - L + n).view(-1, 1)
            members.append(_Member(torch.arange(q_start, q_end), slots[L:].contiguous(), mask))
        groups.append(PrefixGroup(shared.contiguous(), members))
    return groups, sorted(alone, key=lambda c: c[0])


def _gather_heads(buf: torch.Tensor, slots: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """buf [pool, Hkv, D] rows at slots -> [1, Hkv, S, D] in `dtype`."""
    return buf.index_select(0, slots).to(dtype).transpose(0, 1).unsqueeze(0)


def _own_each(qv: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, members: list[_Member],
              scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The own parts, one flash call a member: qv [Hkv, G, N, D] -> (o [Hkv, G, N, D] in qv's
    dtype, lse [Hkv, G, N] float32)."""
    hkv, g, n_all, d = qv.shape
    dt = qv.dtype
    o_own = torch.empty(hkv, g, n_all, d, dtype=dt)
    lse_own = torch.empty(hkv, g, n_all, dtype=torch.float32)
    start = 0
    for m in members:
        n = m.rows.numel()
        qm = qv[:, :, start : start + n].reshape(1, hkv, g * n, d)
        o, lse = _FLASH_CPU(qm, _gather_heads(k_buf, m.own_slots, dt), _gather_heads(v_buf, m.own_slots, dt),
                            0.0, False, attn_mask=m.additive_mask(dt, g), scale=scale)
        o_own[:, :, start : start + n] = o.view(hkv, g, n, d)
        lse_own[:, :, start : start + n] = lse.view(hkv, g, n)
        start += n
    return o_own, lse_own


def _own_batched(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, ob: _OwnBatch, hkv: int, g: int,
                 d: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The own parts as one padded call (`_OwnBatch`): q [T, Hq * D] -> (o [Hkv, G, N, D] in q's
    dtype, lse [Hkv, G, N] float32), N the members' query rows in member order."""
    b, dt = ob.visible.shape[0], q.dtype
    qb = q.index_select(0, ob.q_rows).view(b, ob.n_max, hkv, g, d).permute(0, 2, 3, 1, 4)
    kb, vb = (buf.index_select(0, ob.slots).view(b, ob.t_max, hkv, d).transpose(1, 2).to(dt) for buf in (k_buf, v_buf))
    o, lse = _FLASH_CPU(qb.reshape(b, hkv, g * ob.n_max, d), kb, vb, 0.0, False,
                        attn_mask=ob.additive_mask(dt, g), scale=scale)
    # [B, Hkv, G, n_max, ...] -> [Hkv, G, B * n_max, ...], then the real rows in member order
    o = o.view(b, hkv, g, ob.n_max, d).permute(1, 2, 0, 3, 4).reshape(hkv, g, b * ob.n_max, d)
    lse = lse.view(b, hkv, g, ob.n_max).permute(1, 2, 0, 3).reshape(hkv, g, b * ob.n_max)
    if ob.valid is None:  # no padded query row
        return o, lse.float()
    return o.index_select(2, ob.valid), lse.index_select(2, ob.valid).float()


def attend_group(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, group: PrefixGroup,
                 num_heads: int, scale: float, out: torch.Tensor) -> None:
    """Write the group's attention into out[group.rows].

    q [T, Hq * D], out [T, Hq * D] (q's dtype); k_buf / v_buf [pool, Hkv, D] (any float dtype,
    cast to q's). Query head h reads KV head h // G (G = Hq / Hkv), as SDPA's enable_gqa. The
    shared keys are read once for all members; each member's own keys once; the two states merge
    by their log-sum-exps. Raises ValueError where K and V head dims differ or Hq % Hkv != 0
    (the flash op takes one head dim; the MHA pool holds one, so the backend never passes such),
    TypeError where this torch lacks the op (`available()`), RuntimeError from the op.
    """
    hkv, d = k_buf.shape[1], k_buf.shape[2]
    if v_buf.shape[2] != d or num_heads % hkv or q.shape[1] != num_heads * d:
        raise ValueError(f"attend_group takes K and V of one head dim and Hq % Hkv == 0: K {tuple(k_buf.shape)}, "
                         f"V {tuple(v_buf.shape)}, {num_heads} query heads, q {tuple(q.shape)}")
    g, n_all, dt = num_heads // hkv, group.rows.numel(), q.dtype
    # Fold: [N, Hkv, G, D] -> [1, Hkv, G * N, D]; row r of a KV head is query r % N of head g = r // N.
    qf = q.index_select(0, group.rows).view(n_all, hkv, g, d).permute(1, 2, 0, 3).reshape(1, hkv, g * n_all, d)
    o_shared, lse_shared = _FLASH_CPU(qf, _gather_heads(k_buf, group.shared_slots, dt),
                                      _gather_heads(v_buf, group.shared_slots, dt), 0.0, False, scale=scale)
    if group.batched is not None:
        o_own, lse_own = _own_batched(q, k_buf, v_buf, group.batched, hkv, g, d, scale)
    else:
        o_own, lse_own = _own_each(qf.view(hkv, g, n_all, d), k_buf, v_buf, group.members, scale)
    # The own part's weight e^lo / (e^ls + e^lo) = sigmoid(lo - ls), computed in float32 and
    # rounded to q's dtype (lerp takes one dtype); one lerp then forms the merged output: a
    # single pass over the outputs instead of six (bf16 error as the masked call's, measured).
    w_own = torch.sigmoid(lse_own - lse_shared.view(hkv, g, n_all)).unsqueeze(-1).to(dt)
    merged = torch.lerp(o_shared.view(hkv, g, n_all, d), o_own, w_own).permute(2, 0, 1, 3)  # [N, Hkv, G, D]
    if group.contiguous:
        out[group.rows[0] : group.rows[0] + n_all].view(n_all, hkv, g, d).copy_(merged)
    else:
        out[group.rows] = merged.reshape(n_all, num_heads * d).to(out.dtype)
