"""Seeded random weights for `--load-format dummy`, generated where the model lives.

Every parameter is filled in place on its own device (no CPU round trip: the 8B-parameter
Llama-3 shape takes well under a second on a GPU), each from a generator seeded with
(seed, parameter name), so a parameter's values do not depend on which others exist.

Scales keep activations finite and O(1) through any depth, make the output depend on the
context and not only on the current token, and keep bf16 rounding from deciding the greedy
token (a random deep network is easily chaotic: tiny differences grow layer by layer):
- a matrix `[..., fan_in]` is normal with std `gain / sqrt(fan_in)`, so a projection scales
  its input's magnitude by about `gain` (RMSNorm in front of every block resets it);
- query/key projections (Llama's fused qkv, MLA's q and kv_b up-projection) use gain 1.5:
  attention scores of std ~2, so attention favours some earlier tokens over others and
  what the KV cache holds changes the output;
- the projections that write into the residual stream (o_proj, down_proj, routed experts'
  down_proj) use gain 0.25: each block nudges the stream instead of replacing it, which
  bounds how much a rounding difference can grow through 32 layers;
- embeddings are standard normal; norm weights are ones; biases and routing correction
  biases are zeros.
Under tensor parallelism a sharded parameter (`tp_full_shape`, `tp_shard`, set by
`layers/parallel_linear.py`) is generated at its TP=1 shape with the same seed and sliced, so
every rank holds exactly its slice of TP=1's weights and TP=2 outputs can be compared with TP=1's.
Calibrated on the CPU with `benchmark/gpu/calibrate_dummy_tolerance.py` (a 32-layer model with
the Llama-3-8B vocabulary; results in benchmark/results/gpu_serving_tolerance_calibration.json):
a changed early context keeps the first greedy token of 1 prompt in 8, while float32 vs bf16
or a different bf16 reduction order keep it for 7 to 8 in 8. (With query/key gain 2 and
output gain 1 the same model was chaotic: float32 vs bf16 kept it for only 1 in 5.)
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn

# Role (leaf module name, or the parameter's own name for stacked experts) -> gain.
_GAINS = {
    "qkv_proj": 1.5,  # Llama: q, k and v together
    "q_proj": 1.5,  # MLA without q LoRA
    "q_b_proj": 1.5,  # MLA with q LoRA
    "kv_b_proj": 1.5,  # MLA: per-head k_nope and v from the latent
    "o_proj": 0.25,
    "down_proj": 0.25,  # dense MLP, shared experts and routed experts
}


def _role(name: str) -> str:
    parts = name.split(".")
    return parts[-2] if parts[-1] in ("weight", "bias") and len(parts) > 1 else parts[-1]


def dummy_std(name: str, shape: tuple[int, ...]) -> float | None:
    """Standard deviation of parameter `name` (our module names) of `shape`, or None for a
    vector that is constant (norm weights: ones; biases: zeros)."""
    if len(shape) < 2:
        return None
    role = _role(name)
    if role == "embed_tokens":
        return 1.0
    return _GAINS.get(role, 1.0) / math.sqrt(shape[-1])


def _param_seed(seed: int, name: str) -> int:
    return (int(seed) * 1_000_003 + zlib.crc32(name.encode())) % (2**63)


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int) -> None:
    """Fill every parameter of `model` in place (see the module docstring for the scales).

    Vectors whose name contains "norm" become ones, other vectors zeros.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        data = param.data
        full_shape = getattr(param, "tp_full_shape", None)
        std = dummy_std(name, tuple(full_shape or data.shape))
        if std is None:
            data.fill_(1.0 if "norm" in _role(name) else 0.0)
            continue
        gen = generators.get(data.device)
        if gen is None:
            gen = generators[data.device] = torch.Generator(device=data.device)
        gen.manual_seed(_param_seed(seed, name))
        if full_shape is None:
            data.normal_(0.0, std, generator=gen)
        else:  # TP: one TP=1-shaped tensor at a time, then this rank's slice of it
            full = torch.empty(full_shape, dtype=data.dtype, device=data.device).normal_(0.0, std, generator=gen)
            data.copy_(param.tp_shard(full))
