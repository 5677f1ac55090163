"""Mixture of experts in plain PyTorch: top-k routing and the routed experts.

Routing (`select_experts`) follows DeepSeek's gate variants:
- `greedy` (V2): softmax over the experts, the top k;
- `group_limited_greedy` (V2): experts in `n_group` groups, a group scored by its best
  expert, only the best `topk_group` groups eligible, then the top k;
- `noaux_tc` (V3): sigmoid scores; the choice (not the weights) adds a per-expert
  correction bias; a group scored by the sum of its two best biased scores.
The weights are the chosen experts' (unbiased) scores, optionally renormalized to
sum to one, times `routed_scaling_factor`.

`RoutedExperts` holds all experts' weights stacked, `gate_up_proj [E, 2*I, H]`
(gate rows then up rows) and `down_proj [E, H, I]`, and runs each hit expert on the
tokens routed to it. Finding the hit experts reads the routing back to the host, which a
CUDA graph cannot capture; while a capture is in progress (decode under CUDA graphs) the
experts instead run densely, every expert on every token with the routing weights as a
dense `[T, E]` matrix (zero for experts a token did not pick): fixed shapes, no host
sync, E/k times the expert FLOPs, which is cheap at decode batch sizes (and why extend
graphs, up to 257 rows, are off by default for these models: server_args_cuda.py).

Under tensor parallelism every expert is split along its intermediate dimension (each rank
I / tp gate, up and down columns of every expert: Megatron's MLP split per expert); the
result is a partial sum the caller all-reduces (once, with the shared experts').
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hiserve.distributed import get_tp_group


def select_experts(
    router_logits: torch.Tensor,
    top_k: int,
    topk_method: str = "greedy",
    scoring_func: str = "softmax",
    n_group: int | None = None,
    topk_group: int | None = None,
    correction_bias: torch.Tensor | None = None,
    norm_topk_prob: bool = False,
    routed_scaling_factor: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64)."""
    logits = router_logits.float()
    if scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"unsupported MoE scoring_func {scoring_func!r} (softmax, sigmoid)")
    t, e = scores.shape
    choice = scores if correction_bias is None else scores + correction_bias.float()

    if topk_method == "greedy":
        pass
    elif topk_method in ("group_limited_greedy", "noaux_tc"):
        if not n_group or not topk_group or e % n_group:
            raise ValueError(f"{topk_method} needs n_group dividing {e} experts and topk_group; "
                             f"got n_group={n_group}, topk_group={topk_group}")
        grouped = choice.view(t, n_group, e // n_group)
        if topk_method == "group_limited_greedy":
            group_scores = grouped.max(dim=-1).values
        else:
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
        keep_groups = group_scores.topk(topk_group, dim=-1).indices  # [T, topk_group]
        keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, keep_groups, True)
        keep = keep.unsqueeze(-1).expand(t, n_group, e // n_group).reshape(t, e)
        fill = 0.0 if topk_method == "group_limited_greedy" else float("-inf")
        choice = choice.masked_fill(~keep, fill)
    else:
        raise ValueError(f"unsupported MoE topk_method {topk_method!r}")

    ids = choice.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob and top_k > 1:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


class RoutedExperts(nn.Module):
    """E SwiGLU experts, weights stacked; `forward(x, weights, ids)` sums each token's experts
    (this rank's share of it under TP: `intermediate_size` is then the local I / tp)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype):
        super().__init__()
        self.num_experts = num_experts
        self.inter_start, inter = get_tp_group().shard(intermediate_size, "expert intermediate columns")
        self.full_intermediate_size = intermediate_size
        self.intermediate_size = inter
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts, 2 * inter, hidden_size, dtype=dtype), requires_grad=False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, inter, dtype=dtype), requires_grad=False
        )
        if inter != intermediate_size:
            self.gate_up_proj.tp_full_shape = (num_experts, 2 * intermediate_size, hidden_size)
            self.gate_up_proj.tp_shard = self.shard_gate_up
            self.down_proj.tp_full_shape = (num_experts, hidden_size, intermediate_size)
            self.down_proj.tp_shard = self.shard_down

    def shard_gate_up(self, full: torch.Tensor) -> torch.Tensor:
        """[..., 2I (gate | up), H] at TP=1 -> this rank's [..., 2I/tp (gate | up), H]."""
        s, n, i = self.inter_start, self.intermediate_size, self.full_intermediate_size
        dim = full.dim() - 2
        return torch.cat([full.narrow(dim, s, n), full.narrow(dim, i + s, n)], dim=dim)

    def shard_down(self, full: torch.Tensor) -> torch.Tensor:
        """[..., H, I] at TP=1 -> this rank's [..., H, I/tp]."""
        return full.narrow(-1, self.inter_start, self.intermediate_size)

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """x [T, H], weights [T, k] float32, ids [T, k] int64 -> [T, H] in x's dtype."""
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            return self.forward_dense(x, weights, ids)
        return self.forward_sparse(x, weights, ids)

    def forward_dense(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Every expert on every token, weighted by the dense routing matrix; no host sync
        (CUDA-graph capturable). Same arguments and result as `forward`."""
        inter = self.intermediate_size
        dense = torch.zeros(x.shape[0], self.num_experts, dtype=weights.dtype, device=x.device)
        dense.scatter_(1, ids, weights)  # [T, E]
        gate_up = torch.matmul(x.unsqueeze(0), self.gate_up_proj.transpose(1, 2))  # [E, T, 2I]
        h = F.silu(gate_up[..., :inter]) * gate_up[..., inter:]
        y = torch.matmul(h, self.down_proj.transpose(1, 2))  # [E, T, H]
        y = y * dense.t().unsqueeze(-1).to(x.dtype)
        return y.sum(dim=0)

    def forward_sparse(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """Each hit expert on its own tokens (reads the hit experts back to the host)."""
        out = torch.zeros_like(x)
        inter = self.intermediate_size
        for expert in ids.unique().tolist():
            tokens, slots = (ids == expert).nonzero(as_tuple=True)
            gate_up = F.linear(x[tokens], self.gate_up_proj[expert])
            h = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
            y = F.linear(h, self.down_proj[expert]) * weights[tokens, slots].unsqueeze(-1).to(x.dtype)
            out.index_add_(0, tokens, y)
        return out
