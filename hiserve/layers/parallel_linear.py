"""Tensor-parallel linears and the vocabulary-parallel embedding / LM head (Megatron-LM's split,
as SGLang and vLLM name it).

- `ColumnParallelLinear`: output rows split over the ranks; a fused layer (q|k|v, gate|up)
  splits each part separately, so rank r holds [q_r | k_r | v_r]. A part may have fewer
  slices than ranks (`ShardPart.shards`): GQA with fewer KV heads than ranks replicates each
  KV head on `size / kv_heads` ranks. No communication.
- `RowParallelLinear`: input columns split; each rank's partial product is summed by an
  all-reduce (the bias is added once, after it).
- `VocabParallelEmbedding` / the LM head: vocabulary rows split in equal padded blocks of
  ceil(V / size); a lookup outside a rank's block gives zeros there and the all-reduce adds
  the owner's row; the head's [T, V / size] logits are all-gathered and trimmed to V.

Every sharded parameter carries `tp_full_shape` (its TP=1 shape) and `tp_shard(full)` (this
rank's slice of a TP=1 tensor), so dummy weights are the slices of TP=1's (same seed, same
values) and a checkpoint tensor is sliced at load time (`weight_loader`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from hiserve.distributed import get_tp_group, tp_all_gather_last_dim, tp_all_reduce


@dataclass(frozen=True)
class ShardPart:
    """One part of a fused column-parallel layer: `full` rows at TP=1, cut into `shards`
    equal slices (`shards` divides the TP size or equals it; fewer slices than ranks means
    replication)."""

    full: int
    shards: int

    def local(self, rank: int, size: int) -> tuple[int, int]:
        """(start row in the part, rows) of `rank`'s slice."""
        if size % self.shards or self.full % self.shards:
            raise ValueError(f"a part of {self.full} rows in {self.shards} slices does not fit "
                             f"--tp-size {size}")
        rows = self.full // self.shards
        return (rank * self.shards // size) * rows, rows


def head_parts(num_heads: int, head_dim: int, size: int) -> ShardPart:
    """The part of `num_heads` heads: split over the ranks, or replicated in groups when
    there are fewer heads than ranks (GQA/MQA KV heads).

    Raises:
        ValueError: neither count divides the other.
    """
    if num_heads % size and size % num_heads:
        raise ValueError(f"{num_heads} heads cannot be split over --tp-size {size}")
    return ShardPart(num_heads * head_dim, min(num_heads, size))


def _mark(param: nn.Parameter, full_shape: tuple[int, ...], shard: Callable[[torch.Tensor], torch.Tensor]) -> None:
    param.tp_full_shape = full_shape
    param.tp_shard = shard


class ColumnParallelLinear(nn.Module):
    """y_local = x @ W_local^T (+ b_local).

    Args:
        parts: the fused parts in row order (`ShardPart`s; a plain layer has one).
    Forward: x [T, in_features] -> [T, sum of local part rows], x's dtype.
    """

    def __init__(self, in_features: int, parts: list[ShardPart], bias: bool, dtype: torch.dtype):
        super().__init__()
        g = get_tp_group()
        self.parts = parts
        self.slices = [p.local(g.rank, g.size) for p in parts]  # (start in part, rows)
        self.local_offsets = [sum(r for _, r in self.slices[:i]) for i in range(len(parts))]
        out_local, out_full = sum(r for _, r in self.slices), sum(p.full for p in parts)
        self.in_features, self.out_features = in_features, out_local
        self.weight = nn.Parameter(torch.empty(out_local, in_features, dtype=dtype), requires_grad=False)
        _mark(self.weight, (out_full, in_features), self._shard_rows)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_local, dtype=dtype), requires_grad=False)
            _mark(self.bias, (out_full,), self._shard_rows)

    def _shard_rows(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's rows of a TP=1 tensor [sum(full), ...]."""
        out, base = [], 0
        for part, (start, rows) in zip(self.parts, self.slices):
            out.append(full.narrow(0, base + start, rows))
            base += part.full
        return torch.cat(out)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, part: int = 0) -> int:
        """Copy this rank's rows of checkpoint part `part` (its TP=1 rows) into `param`;
        returns the rows written. Raises ValueError on a shape mismatch."""
        start, rows = self.slices[part]
        if tensor.shape[0] != self.parts[part].full or tensor.shape[1:] != param.shape[1:]:
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not fit part {part} "
                             f"({self.parts[part].full} rows) of {tuple(param.shape)}")
        param.data.narrow(0, self.local_offsets[part], rows).copy_(tensor.narrow(0, start, rows))
        return rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local @ W_local^T) + b, W_local the rank's input columns.

    Args:
        reduce: False leaves the partial sum (a caller that adds several partials reduces once).
    Forward: x [T, in_features / size] -> [T, out_features], x's dtype.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype,
                 reduce: bool = True):
        super().__init__()
        g = get_tp_group()
        self.col_start, cols = g.shard(in_features, "input columns of a row-parallel linear")
        self.reduce = reduce
        self.in_features, self.out_features = cols, out_features
        self.weight = nn.Parameter(torch.empty(out_features, cols, dtype=dtype), requires_grad=False)
        _mark(self.weight, (out_features, in_features), lambda full: full.narrow(1, self.col_start, cols))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, part: int = 0) -> int:
        """Copy this rank's columns of a TP=1 weight (the whole bias); returns rows written."""
        src = tensor.narrow(1, self.col_start, self.in_features) if tensor.dim() == 2 else tensor
        if tuple(src.shape) != tuple(param.shape):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} does not fit {tuple(param.shape)}")
        param.data.copy_(src)
        return param.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        if self.reduce:
            y = tp_all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding (and, through `weight`, the LM head) over this rank's block of
    ceil(V / size) vocabulary rows (rows past V are zero padding).

    Forward: ids [T] int64 -> [T, hidden], summed over the ranks.
    """

    def __init__(self, vocab_size: int, hidden_size: int, dtype: torch.dtype):
        super().__init__()
        g = get_tp_group()
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // g.size)
        self.start = g.rank * self.per_rank
        self.rows = max(0, min(self.per_rank, vocab_size - self.start))  # real rows
        self.weight = nn.Parameter(torch.zeros(self.per_rank, hidden_size, dtype=dtype), requires_grad=False)
        _mark(self.weight, (vocab_size, hidden_size), self._shard_rows)

    def _shard_rows(self, full: torch.Tensor) -> torch.Tensor:
        out = full.new_zeros((self.per_rank, *full.shape[1:]))
        out[: self.rows] = full.narrow(0, self.start, self.rows)
        return out

    def weight_loader(self, param: nn.Parameter, tensor: torch.Tensor, part: int = 0) -> int:
        """Copy this rank's block of a TP=1 [V, hidden] tensor; returns rows written (all)."""
        if tuple(tensor.shape) != tuple(param.tp_full_shape):
            raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != {param.tp_full_shape}")
        param.data.copy_(self._shard_rows(tensor.to(param.dtype)))
        return param.shape[0]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return tp_all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


def gather_vocab_logits(local_logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[T, ceil(V / size)] per rank -> [T, V] on every rank (all-gather, padding trimmed)."""
    if get_tp_group().size == 1:
        return local_logits
    return tp_all_gather_last_dim(local_logits)[..., :vocab_size]


def load_tp_weight(module: Optional[nn.Module], param: nn.Parameter, tensor: torch.Tensor,
                   part: int = 0) -> int:
    """Load `tensor` (TP=1 shape) into `param` of `module` through its `weight_loader` when it
    has one (a parallel layer), else copy it whole; returns the rows written."""
    loader = getattr(module, "weight_loader", None)
    if loader is not None:
        return loader(param, tensor, part)
    if tuple(param.shape) != tuple(tensor.shape):
        raise ValueError(f"checkpoint shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
    param.data.copy_(tensor)
    return param.shape[0]
