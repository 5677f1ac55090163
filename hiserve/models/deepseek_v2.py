"""DeepSeek-V2/V3-style decoder: multi-head latent attention (MLA), dense MLP, optional MoE.

Attention per layer (shapes per token; H heads, r = kv_lora_rank):
- q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x))) with a q LoRA; per head
  [q_nope (qk_nope_head_dim) | q_rope (qk_rope_head_dim)];
- kv_a_proj_with_mqa(x) = [latent (r) | k_rope (qk_rope_head_dim)]; the latent is
  RMS-normed (kv_a_layernorm); k_rope is one key shared by all heads;
- RoPE on q_rope and k_rope only ("decoupled"), DeepSeek's interleaved-pair layout;
- the KV cache stores only `[latent | k_rope]`; `MLAAttention` (layers/attention/mla.py)
  gets per-head keys and values from the latent through kv_b_proj.
MLP: dense SwiGLU on the first `first_k_dense_replace` layers (all, without experts),
then shared experts plus top-k routed experts (layers/moe.py).

Tensor parallelism (`--tp-size`): the query projections (q_proj / q_b_proj), kv_b_proj
(per-head up-projection) and o_proj split by heads, so each rank attends with H / tp heads;
the latent path (kv_a_proj_with_mqa, kv_a_layernorm, q_a_proj) is replicated, so every rank
caches the same `[latent | k_rope]` rows. MLPs and experts split along the intermediate
dimension; embedding and LM head by vocabulary (`layers/parallel_linear.py`).

`load_weights` takes HF names; routed experts come either per expert
(`mlp.experts.{e}.gate_proj.weight`, as checkpoints store them) or stacked
(`mlp.experts.gate_up_proj`, as transformers 5 holds them in memory).
"""

from __future__ import annotations

import math
import re
from typing import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from hiserve.distributed import get_tp_group, tp_all_reduce
from hiserve.layers import triton_ops
from hiserve.layers.activations import SiluAndMul
from hiserve.layers.attention.mla import MLAAttention
from hiserve.layers.decoder_layer import PreNormDecoderLayer
from hiserve.layers.forward_batch import ForwardBatch
from hiserve.layers.logits import LogitsProcessor
from hiserve.layers.moe import RoutedExperts, select_experts
from hiserve.layers.norms import RMSNorm
from hiserve.layers.parallel_linear import ColumnParallelLinear, RowParallelLinear, ShardPart, VocabParallelEmbedding
from hiserve.layers.rotary import compute_inv_freq
from hiserve.models.model_config import ModelConfig


# ----------------------------------------------------------------------- rope
def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's attention temperature term: 0.1 * mscale * ln(scale) + 1 (1 when not stretched)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_factor(s: dict, max_position: int) -> float:
    factor = s.get("factor")
    return float(factor) if factor is not None else max_position / float(s["original_max_position_embeddings"])


def yarn_inv_freq(rotary_dim: int, base: float, s: dict, max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN: blend interpolated (÷factor) and original frequencies per dimension pair.

    Pairs that turn more than `beta_fast` times over the original context keep their
    frequency, pairs that turn fewer than `beta_slow` times are interpolated, and a linear
    ramp joins them. Returns (inv_freq [rotary_dim // 2], magnitude scale of cos/sin).
    """
    factor = _yarn_factor(s, max_position)
    orig_ctx = float(s["original_max_position_embeddings"])
    beta_fast = float(s.get("beta_fast") or 32)
    beta_slow = float(s.get("beta_slow") or 1)

    def dim_for_rotations(rotations: float) -> float:
        # the pair index i whose wavelength 2*pi*base^(2i/d) fits `rotations` times in orig_ctx
        return rotary_dim * math.log(orig_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = dim_for_rotations(beta_fast), dim_for_rotations(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: keep the original frequency, 0: interpolate
    base_freq = base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim)
    inv_freq = (1.0 / (factor * base_freq)) * (1 - keep) + (1.0 / base_freq) * keep

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        mscale, mscale_all_dim = s.get("mscale"), s.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attn_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attn_factor = _yarn_mscale(factor)
    return inv_freq, float(attn_factor)


class DeepseekRotaryEmbedding(nn.Module):
    """RoPE on the decoupled rope dims; `interleaved` rotates pairs (x[2i], x[2i+1]),
    otherwise halves (x[i], x[i + d/2]). Cache [max_position, d]: cos | sin, times the
    YaRN magnitude scale."""

    def __init__(self, rotary_dim: int, max_position: int, base: float, rope_scaling: dict | None,
                 interleaved: bool = True):
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        if rope_scaling and rope_scaling.get("rope_type") == "yarn":
            inv_freq, mag = yarn_inv_freq(rotary_dim, base, rope_scaling, max_position)
        else:
            inv_freq, mag = compute_inv_freq(rotary_dim, base, rope_scaling), 1.0
        freqs = torch.outer(torch.arange(max_position, dtype=torch.float32), inv_freq)
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], -1) * mag, persistent=False)

    def get_cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] -> (cos, sin), each [T, 1, rotary_dim // 2] float32."""
        cs = self.cos_sin_cache.index_select(0, positions).unsqueeze(1)
        return cs[..., : self.rotary_dim // 2], cs[..., self.rotary_dim // 2 :]

    def apply(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """x [T, heads, rotary_dim] -> rotated copy, same dtype and layout (one Triton kernel on CUDA)."""
        if triton_ops.use_triton(x):
            from hiserve.layers.triton_ops.rotary import rotary_embedding

            return rotary_embedding(x, cos_sin[0], cos_sin[1], self.rotary_dim, interleaved=self.interleaved)
        cos, sin = cos_sin
        xf = x.float()
        if self.interleaved:
            x1, x2 = xf[..., 0::2], xf[..., 1::2]
            return torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2).to(x.dtype)
        half = self.rotary_dim // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def softmax_scale(config: ModelConfig) -> float:
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim)^2 when it is set."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    s = config.rope_scaling
    if s and s.get("mscale_all_dim"):
        m = _yarn_mscale(_yarn_factor(s, config.max_position_embeddings), float(s["mscale_all_dim"]))
        scale *= m * m
    return scale


# ------------------------------------------------------------------------ mlp
def _column(in_features: int, parts: list[int], bias: bool, dtype: torch.dtype) -> nn.Module:
    """nn.Linear at TP=1, else a ColumnParallelLinear splitting each part over the ranks."""
    tp = get_tp_group().size
    if tp == 1:
        return nn.Linear(in_features, sum(parts), bias=bias, dtype=dtype)
    return ColumnParallelLinear(in_features, [ShardPart(p, tp) for p in parts], bias, dtype)


def _row(in_features: int, out_features: int, bias: bool, dtype: torch.dtype, reduce: bool = True) -> nn.Module:
    """nn.Linear at TP=1, else a RowParallelLinear (all-reduced unless `reduce` is False)."""
    if get_tp_group().size == 1:
        return nn.Linear(in_features, out_features, bias=bias, dtype=dtype)
    return RowParallelLinear(in_features, out_features, bias, dtype, reduce=reduce)


class DeepseekV2MLP(nn.Module):
    """SwiGLU MLP; under TP `reduce=False` leaves the partial sum to the caller (MoE)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str, dtype: torch.dtype,
                 reduce: bool = True):
        super().__init__()
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r}; only silu")
        self.gate_up_proj = _column(hidden_size, [intermediate_size] * 2, False, dtype)
        self.down_proj = _row(intermediate_size, hidden_size, False, dtype, reduce)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class MoEGate(nn.Module):
    """Router weight [E, H] (kept in float32, as DeepSeek does), V3's correction bias [E]."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e = config.n_routed_experts
        self.weight = nn.Parameter(torch.empty(e, config.hidden_size, dtype=torch.float32), requires_grad=False)
        self.e_score_correction_bias = None
        if config.topk_method == "noaux_tc":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight)


class DeepseekV2MoE(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        self.config = config
        self.gate = MoEGate(config)
        self.experts = RoutedExperts(config.n_routed_experts, config.hidden_size, config.moe_intermediate_size, dtype)
        self.shared_experts = None
        if config.n_shared_experts:
            self.shared_experts = DeepseekV2MLP(
                config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.hidden_act, dtype,
                reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        weights, ids = select_experts(
            self.gate(x), c.num_experts_per_tok, c.topk_method, c.scoring_func, c.n_group, c.topk_group,
            self.gate.e_score_correction_bias, c.norm_topk_prob, c.routed_scaling_factor,
        )
        out = self.experts(x, weights, ids)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return tp_all_reduce(out)  # one all-reduce for routed and shared partial sums (TP)


# ------------------------------------------------------------------ attention
class DeepseekV2Attention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        hidden, h = config.hidden_size, config.num_attention_heads
        self.num_heads = get_tp_group().shard(h, "attention heads")[1]  # this rank's heads
        self.qk_nope_head_dim = config.qk_nope_head_dim
        self.qk_rope_head_dim = config.qk_rope_head_dim
        self.qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        self.v_head_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.q_lora_rank = config.q_lora_rank
        bias = config.attention_bias
        if self.q_lora_rank:
            self.q_a_proj = nn.Linear(hidden, self.q_lora_rank, bias=bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, config.rms_norm_eps, dtype)
            self.q_b_proj = _column(self.q_lora_rank, [h * self.qk_head_dim], False, dtype)
        else:
            self.q_proj = _column(hidden, [h * self.qk_head_dim], False, dtype)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.kv_lora_rank + self.qk_rope_head_dim, bias=bias, dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, config.rms_norm_eps, dtype)
        self.kv_b_proj = _column(self.kv_lora_rank, [h * (self.qk_nope_head_dim + self.v_head_dim)], False, dtype)
        self.o_proj = _row(h * self.v_head_dim, hidden, bias, dtype)
        self.attn = MLAAttention(self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim,
                                 self.kv_lora_rank, softmax_scale(config), layer_id, self.kv_b_proj)

    def forward(self, x: torch.Tensor, cos_sin, rotary: DeepseekRotaryEmbedding,
                forward_batch: ForwardBatch) -> torch.Tensor:
        t = x.shape[0]
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        else:
            q = self.q_proj(x)
        q = q.view(t, self.num_heads, self.qk_head_dim)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        latent = self.kv_a_layernorm(latent)
        q_rope = rotary.apply(q_rope, cos_sin)
        k_rope = rotary.apply(k_rope.unsqueeze(1), cos_sin).squeeze(1)
        return self.o_proj(self.attn(q_nope, q_rope, latent, k_rope, forward_batch))


# ---------------------------------------------------------------------- model
class DeepseekV2DecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype):
        super().__init__()
        self.self_attn = DeepseekV2Attention(config, layer_id, dtype)
        if config.is_moe_layer(layer_id):
            self.mlp = DeepseekV2MoE(config, dtype)
        else:
            self.mlp = DeepseekV2MLP(config.hidden_size, config.intermediate_size, config.hidden_act, dtype)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class DeepseekV2Model(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype):
        super().__init__()
        if get_tp_group().size > 1:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(
            DeepseekV2DecoderLayer(config, i, dtype) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = DeepseekRotaryEmbedding(
            config.qk_rope_head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling,
            interleaved=config.rope_interleave,
        )

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch):
        hidden_states = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.get_cos_sin(positions)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos_sin, self.rotary_emb, forward_batch)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


_EXPERT_RE = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


class DeepseekV2ForCausalLM(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32):
        super().__init__()
        if not config.kv_lora_rank:
            raise ValueError("DeepseekV2ForCausalLM needs an MLA config (kv_lora_rank is not set)")
        self.config = config
        self.dtype = dtype
        self.model = DeepseekV2Model(config, dtype)
        if config.tie_word_embeddings:
            self.lm_head = None
        elif get_tp_group().size > 1:  # this rank's vocabulary block; logits all-gathered
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.logits_processor = LogitsProcessor(config.vocab_size)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [B, vocab] for the last new token of each request."""
        hidden_states = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        return self.logits_processor(hidden_states, self.lm_head_weight, forward_batch)

    def _destination(self, name: str, tensor: torch.Tensor,
                     params: dict[str, nn.Parameter]) -> tuple[str, torch.Tensor, torch.Tensor]:
        """HF tensor name -> (our parameter name, the slice of it the tensor fills, the part of
        `tensor` that goes there: this rank's slice under TP, else all of it)."""
        m = _EXPERT_RE.match(name)
        if m:  # one expert of the stacked routed experts
            prefix, expert, proj = m.group(1), int(m.group(2)), m.group(3)
            experts = self.get_submodule(prefix)
            s, n = experts.inter_start, experts.intermediate_size
            if proj == "down_proj":
                target = f"{prefix}.down_proj"
                return target, params[target].data[expert], tensor.narrow(1, s, n)
            target = f"{prefix}.gate_up_proj"
            rows = params[target].data[expert]
            return target, rows[:n] if proj == "gate_proj" else rows[n:], tensor.narrow(0, s, n)
        for frag, half in ((".gate_proj.", 0), (".up_proj.", 1)):  # dense / shared-expert MLP
            if frag in name:
                target = name.replace(frag, ".gate_up_proj.")
                if target not in params:
                    break
                rows = params[target].data
                size = rows.shape[0] // 2
                start = get_tp_group().shard(tensor.shape[0])[0] if get_tp_group().size > 1 else 0
                return target, rows.narrow(0, half * size, size), tensor.narrow(0, start, size)
        if name not in params:
            raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
        param = params[name]
        full = getattr(param, "tp_full_shape", None)
        if full is not None and tuple(tensor.shape) == tuple(full):
            tensor = param.tp_shard(tensor.to(param.dtype))
        return name, param.data, tensor

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load HF-named tensors; raises if a parameter stays unset or a name is unknown.

        Layers past `num_hidden_layers` (DeepSeek-V3's multi-token-prediction layer) are skipped.
        """
        params = dict(self.named_parameters())
        loaded: dict[str, int] = {}  # parameter name -> elements written
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            m = _LAYER_RE.match(name)
            if m and int(m.group(1)) >= self.config.num_hidden_layers:
                continue
            target, dest, tensor = self._destination(name, tensor, params)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded[target] = loaded.get(target, 0) + tensor.numel()
        missing = [n for n, p in params.items() if loaded.get(n, 0) != p.numel()]
        if missing:
            raise ValueError(f"parameters not (fully) loaded from the checkpoint: {missing[:8]}")
        for layer in self.model.layers:
            layer.self_attn.attn.bind_weights(layer.self_attn.kv_b_proj)


DeepseekV3ForCausalLM = DeepseekV2ForCausalLM
