"""Llama-family decoder (Llama 2/3, SmolLM2, Mistral, Qwen2-style qkv bias).

q/k/v share one Linear (`qkv_proj`) and gate/up share one (`gate_up_proj`), so each is
one GEMM; `load_weights` stacks the separate checkpoint tensors into them. With a
`GGUFInt4Config` (`--quantization gguf`) a projection whose GGUF shards are all Q4_0/Q4_1
is a `GGUFInt4Linear` (int4 weight-only GEMM, packed once at load) instead of an nn.Linear.

Under tensor parallelism (`--tp-size` > 1, `layers/parallel_linear.py`) qkv and gate/up are
column-parallel (each rank its heads: H / tp query heads, KV heads split or replicated when
fewer than ranks), o_proj and down_proj row-parallel with an all-reduce, the embedding and
the LM head vocabulary-parallel; checkpoint tensors are sliced as they load. The int4 GGUF
path is TP=1 only (ServerArgs refuses it with more ranks).
"""

from __future__ import annotations

from typing import Iterable

import torch
from torch import nn

from hiserve.distributed import get_tp_group
from hiserve.layers.activations import SiluAndMul
from hiserve.layers.attention.base import RadixAttention
from hiserve.layers.decoder_layer import PreNormDecoderLayer
from hiserve.layers.forward_batch import ForwardBatch
from hiserve.layers.linear import PackedLinear, can_pack_for_cpu, pack_linear_layers, prepack_linear
from hiserve.layers.logits import LogitsProcessor
from hiserve.layers.norms import RMSNorm
from hiserve.layers.parallel_linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShardPart,
    VocabParallelEmbedding,
    head_parts,
    load_tp_weight,
)
from hiserve.layers.quantization import (GGUFBlockLinear, GGUFInt4Config, GGUFInt4Linear, GGUFQuantizedTensor,
                                         make_linear)
from hiserve.layers.rotary import RotaryEmbedding
from hiserve.models.model_config import ModelConfig


def _names(prefix: str, parts: tuple[str, ...]) -> list[str]:
    return [f"{prefix}.{p}.weight" for p in parts]


def _tp_size(quant_config: GGUFInt4Config | None) -> int:
    """The TP size; raises ValueError for int4 GGUF layers with more than one rank."""
    size = get_tp_group().size
    if size > 1 and quant_config is not None:
        raise ValueError("the GGUF int4 path is TP=1 only: use --quantization none with --tp-size > 1")
    return size


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, quant_config: GGUFInt4Config | None = None,
                 prefix: str = ""):
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {config.hidden_act!r}; only silu")
        inter, hidden = config.intermediate_size, config.hidden_size
        tp = _tp_size(quant_config)
        if tp > 1:
            self.gate_up_proj = ColumnParallelLinear(hidden, [ShardPart(inter, tp)] * 2, False, dtype)
            self.down_proj = RowParallelLinear(inter, hidden, False, dtype)
        else:  # gate and up stacked: one GEMM for both (dense or int4).
            self.gate_up_proj = make_linear(hidden, 2 * inter, False, dtype, quant_config,
                                            _names(prefix, ("gate_proj", "up_proj")))
            self.down_proj = make_linear(inter, hidden, False, dtype, quant_config, _names(prefix, ("down_proj",)))
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # the activation in the GEMM's epilogue where the layer offers it (AMX dense GEMMs)
        fused = getattr(self.gate_up_proj, "silu_mul", None)
        h = fused(x) if fused is not None else None
        return self.down_proj(h if h is not None else self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype,
                 quant_config: GGUFInt4Config | None = None, prefix: str = ""):
        super().__init__()
        tp = _tp_size(quant_config)
        self.head_dim = d = config.head_dim
        self.num_heads = get_tp_group().shard(config.num_attention_heads, "attention heads")[1]  # this rank's
        kv_part = head_parts(config.num_key_value_heads, d, tp)
        self.num_kv_heads = kv_part.full // kv_part.shards // d
        self.q_size = self.num_heads * d
        self.kv_size = self.num_kv_heads * d
        if tp > 1:
            q_part = head_parts(config.num_attention_heads, d, tp)
            self.qkv_proj = ColumnParallelLinear(config.hidden_size, [q_part, kv_part, kv_part],
                                                 config.attention_bias, dtype)
            self.o_proj = RowParallelLinear(q_part.full, config.hidden_size, False, dtype)
        else:  # q, k and v stacked: one GEMM for all three (dense or int4).
            self.qkv_proj = make_linear(config.hidden_size, self.q_size + 2 * self.kv_size, config.attention_bias,
                                        dtype, quant_config, _names(prefix, ("q_proj", "k_proj", "v_proj")))
            self.o_proj = make_linear(self.q_size, config.hidden_size, False, dtype, quant_config,
                                      _names(prefix, ("o_proj",)))
        self.attn = RadixAttention(
            self.num_heads, self.head_dim, self.head_dim**-0.5, self.num_kv_heads, layer_id
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        rotary: RotaryEmbedding,
        forward_batch: ForwardBatch,
    ) -> torch.Tensor:
        t = hidden_states.shape[0]
        qkv = self.qkv_proj(hidden_states)
        qk_size = self.q_size + self.kv_size
        # q and k are adjacent in qkv: rotate both heads sets in one call.
        qk = rotary.apply(qkv[:, :qk_size].view(t, self.num_heads + self.num_kv_heads, self.head_dim), cos_sin)
        q = qk[:, : self.num_heads].reshape(t, self.q_size)
        k = qk[:, self.num_heads :].reshape(t, self.kv_size)
        v = qkv[:, qk_size:]
        return self.o_proj(self.attn(q, k, v, forward_batch))


class LlamaDecoderLayer(PreNormDecoderLayer):
    def __init__(self, config: ModelConfig, layer_id: int, dtype: torch.dtype,
                 quant_config: GGUFInt4Config | None = None):
        super().__init__()
        prefix = f"model.layers.{layer_id}"
        self.self_attn = LlamaAttention(config, layer_id, dtype, quant_config, f"{prefix}.self_attn")
        self.mlp = LlamaMLP(config, dtype, quant_config, f"{prefix}.mlp")
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, dtype: torch.dtype, quant_config: GGUFInt4Config | None = None):
        super().__init__()
        # A gather over dequantized rows: exact, and cheaper than any quantized lookup.
        if _tp_size(quant_config) > 1:
            self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        else:
            self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, dtype, quant_config)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype)
        self.rotary_emb = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope_theta, config.rope_scaling
        )
        # hiserve.models.cpu_decode_loop.CpuDecodeLoop, attached on the CPU where it can run
        self.decode_loop = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """input_ids, positions [T] int64 -> final hidden states [T, H] (model dtype); a DECODE
        pass the attached CPU decode loop can take runs there, bit-identical."""
        if self.decode_loop is not None:
            hidden_states = self.decode_loop.forward(input_ids, positions, forward_batch)
            if hidden_states is not None:
                return hidden_states
        hidden_states = self.embed_tokens(input_ids)
        cos_sin = self.rotary_emb.get_cos_sin(positions)
        residual = None
        for layer in self.layers:
            hidden_states, residual = layer(hidden_states, residual, cos_sin, self.rotary_emb, forward_batch)
        hidden_states, _ = self.norm(hidden_states, residual)
        return hidden_states


# checkpoint name fragment -> (fused parameter fragment, shard id)
_STACKED = {
    ".q_proj.": (".qkv_proj.", "q"),
    ".k_proj.": (".qkv_proj.", "k"),
    ".v_proj.": (".qkv_proj.", "v"),
    ".gate_proj.": (".gate_up_proj.", 0),
    ".up_proj.": (".gate_up_proj.", 1),
}


class LlamaForCausalLM(nn.Module):
    """Args: quant_config: keep Q4_0/Q4_1 GGUF projections as int4 (`--quantization gguf`)."""

    supports_gguf_int4 = True

    def __init__(self, config: ModelConfig, dtype: torch.dtype = torch.float32,
                 quant_config: GGUFInt4Config | None = None):
        super().__init__()
        self.config = config
        self.dtype = dtype
        self.model = LlamaModel(config, dtype, quant_config)
        if config.tie_word_embeddings:
            self.lm_head = None
        elif _tp_size(quant_config) > 1:  # this rank's vocabulary block; logits all-gathered
            self.lm_head = VocabParallelEmbedding(config.vocab_size, config.hidden_size, dtype)
        else:
            self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.logits_processor = LogitsProcessor(config.vocab_size)
        self.packed_lm_head: PackedLinear | None = None
        self.gguf_head: GGUFBlockLinear | None = None

    @property
    def lm_head_weight(self) -> torch.Tensor | PackedLinear | GGUFBlockLinear:
        return self.gguf_head if self.gguf_head is not None else self._dense_head_weight

    @property
    def _dense_head_weight(self) -> torch.Tensor | PackedLinear:
        if self.packed_lm_head is not None:
            return self.packed_lm_head
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def set_gguf_head(self, tensor: GGUFQuantizedTensor) -> None:
        """After loading: run the LM head's few-row calls on its GGUF blocks (`tensor`, the
        stored form of the head, or of the embedding when tied); raises ValueError on a type
        or shape the block kernel does not take."""
        self.gguf_head = GGUFBlockLinear(tensor, self._dense_head_weight)

    def pack_for_cpu(self) -> bool:
        """After loading: prepack every projection (and the LM head) for the AMX tile GEMM or
        oneDNN (`prepack_linear`) when `can_pack_for_cpu` says so; returns whether it did."""
        weight = self._dense_head_weight
        if not can_pack_for_cpu(weight.device, weight.dtype):
            return False
        pack_linear_layers(self.model)
        self.packed_lm_head = prepack_linear(weight, None)
        if self.lm_head is not None:
            self.lm_head = None  # the packed copy replaces it
        if self.gguf_head is not None:  # its many-row calls take the packed copy too
            self.gguf_head.set_dense_weight(self.packed_lm_head)
        return True

    @torch.inference_mode()
    def forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Returns float32 logits [B, vocab] for the last new token of each request."""
        hidden_states = self.model(forward_batch.input_ids, forward_batch.positions, forward_batch)
        return self.logits_processor(hidden_states, self.lm_head_weight, forward_batch)

    def _shard_range(self, shard, dim0: int) -> tuple[int, int]:
        cfg = self.config
        if shard in (0, 1):  # gate / up halves
            return shard * dim0 // 2, dim0 // 2
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        return {"q": (0, q), "k": (q, kv), "v": (q + kv, kv)}[shard]

    def _load_dense(self, name: str, target: str, param: nn.Parameter, tensor: torch.Tensor, shard) -> int:
        """Copy a dense checkpoint tensor (TP=1 shape) into `param`, or into its stacked
        part `shard`; a parallel layer takes its rank's slice. Returns the rows written."""
        if get_tp_group().size > 1:
            module = self.get_submodule(target.rsplit(".", 1)[0])
            part = {"q": 0, "k": 1, "v": 2}.get(shard, shard or 0)
            try:
                return load_tp_weight(module, param, tensor, part)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from None
        dest = param.data
        if shard is not None:
            start, size = self._shard_range(shard, dest.shape[0])
            dest = dest.narrow(0, start, size)
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(dest.shape)}")
        dest.copy_(tensor)
        return tensor.shape[0]

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor | GGUFQuantizedTensor]]) -> None:
        """Load HF-named tensors (dense, or GGUF 4-bit blocks for `GGUFInt4Linear` layers);
        raises if a parameter stays unset or a name is unknown."""
        params = dict(self.named_parameters())
        int4 = {f"{n}.weight": m for n, m in self.named_modules() if isinstance(m, GGUFInt4Linear)}
        loaded: dict[str, int] = {}  # parameter name -> rows written
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding is the head
            target, shard = name, None
            for frag, (fused, shard_id) in _STACKED.items():
                if frag in name:
                    target, shard = name.replace(frag, fused), shard_id
                    break
            if isinstance(tensor, GGUFQuantizedTensor):
                if target not in int4:
                    raise KeyError(f"checkpoint tensor {name!r} ({tensor.qtype}) has no int4 layer")
                layer = int4[target]
                start = 0 if shard is None else self._shard_range(shard, layer.out_features)[0]
                layer.load_rows(start, tensor)
                if layer.rows_loaded == layer.out_features:
                    layer.finalize()  # pack now: one layer's staging at a time, not the model's
                continue
            if target not in params:
                raise KeyError(f"checkpoint tensor {name!r} has no parameter in {type(self).__name__}")
            param = params[target]
            loaded[target] = loaded.get(target, 0) + self._load_dense(name, target, param, tensor, shard)
        missing = [n for n, p in params.items() if loaded.get(n, 0) != p.shape[0]]
        missing += [n for n, m in int4.items() if m.rows_loaded != m.out_features]
        if missing:
            raise ValueError(f"parameters not (fully) loaded from the checkpoint: {missing[:8]}")
