"""The CUDA-graph-capturable (dense) routed-experts path equals the per-expert (sparse) one.

CPU, float32: the dense form (every expert on every token, weighted by a `[T, E]` routing
matrix that is zero for unpicked experts) must give the per-expert loop's result up to
float32 rounding, for every routing method, including tokens whose experts are all the
same few and experts no token picks.
"""

from __future__ import annotations

import pytest
import torch

from hiserve.layers.moe import RoutedExperts, select_experts

E, H, INTER = 8, 32, 24


def make_experts(seed: int) -> RoutedExperts:
    torch.manual_seed(seed)
    experts = RoutedExperts(E, H, INTER, torch.float32)
    experts.gate_up_proj.data.normal_(0, H**-0.5)
    experts.down_proj.data.normal_(0, INTER**-0.5)
    return experts


@pytest.mark.parametrize("tokens", [1, 5, 64])
@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy", "noaux_tc"])
def test_dense_equals_sparse(tokens: int, method: str) -> None:
    experts = make_experts(tokens)
    x = torch.randn(tokens, H)
    logits = torch.randn(tokens, E)
    scoring = "sigmoid" if method == "noaux_tc" else "softmax"
    bias = torch.randn(E) * 0.1 if method == "noaux_tc" else None
    weights, ids = select_experts(logits, 3, method, scoring, n_group=4, topk_group=2,
                                  correction_bias=bias, norm_topk_prob=True, routed_scaling_factor=2.5)
    sparse = experts.forward_sparse(x, weights, ids)
    dense = experts.forward_dense(x, weights, ids)
    torch.testing.assert_close(dense, sparse, rtol=1e-5, atol=1e-6)
    # Not trivially equal: the result depends on the routing.
    other = experts.forward_dense(x, weights, (ids + 1) % E)
    assert not torch.allclose(other, sparse, rtol=1e-3, atol=1e-4)


def test_dense_with_unpicked_experts_and_shared_choices() -> None:
    experts = make_experts(7)
    x = torch.randn(6, H)
    ids = torch.tensor([[0, 1]] * 6)  # experts 2..7 unpicked
    weights = torch.rand(6, 2)
    torch.testing.assert_close(experts.forward_dense(x, weights, ids),
                               experts.forward_sparse(x, weights, ids), rtol=1e-5, atol=1e-6)


def test_forward_uses_sparse_outside_capture() -> None:
    experts = make_experts(3)
    x = torch.randn(4, H)
    weights, ids = select_experts(torch.randn(4, E), 2)
    assert torch.equal(experts(x, weights, ids), experts.forward_sparse(x, weights, ids))
