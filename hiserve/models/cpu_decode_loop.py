"""DECODE passes of a Llama-family model on the CPU as one flat loop over its layers.

Why: a CPU decode step of a small model is short, and the Python around its kernels was a
large part of it: per layer about eleven `nn.Module` calls, each layer's CUDA/CPU route and
dtype checks, and each kernel wrapper's input checks. For SmolLM2-135M on a 2-core AMX Xeon,
in process with the two forms interleaved (`benchmark/cpu/ab_decode_loop.py`,
`benchmark/results/cpu_decode_loop_ab.json`), the module path's batch-1 scheduler step took
8.77 ms and this loop's 6.90; at batch 16, 24.4 against 21.8 ms.

It runs the same kernels with the same arguments as the modules (`LlamaModel.forward` through
`PreNormDecoderLayer`, `LlamaAttention`, `CpuPagedAttnBackend.forward`), so its hidden states
are bit-identical to theirs (test/unit/test_cpu_decode_loop.py). The linear layers are called
through their own `forward`, which keeps their dispatch by row count (int4 / block / AMX /
dense). The layers' weights and `forward` methods are taken once, at attach: attach after the
last change to the modules (the model runner attaches after the linears are prepacked and the GGUF GEMM
dispatch); looking them up on every pass measured 0.85x of the modules' batch-1 step where this
measures 0.79x (`cpu_decode_loop_ab.json` of tree 1572ecd, committed at 754a371). The kernels' tensors are
built here with the shapes and dtypes the kernels take, so the Python wrappers' checks are
skipped; the C++ bindings check the shapes and dtypes they index by (`csrc/cpu/bindings.h`), so
a mistaken shape raises instead of reading out of bounds (the tensors must be CPU tensors: the
model runner attaches the loop on the CPU only).

A pass takes the loop when `CpuDecodeLoop.forward` finds: a DECODE batch, no autograd, and the
cpu_paged backend (alone or as a hybrid's decode side) running each layer's attention as one
kernel call over the whole batch with the fused K/V store (`decode_kernel_args`); any other
pass returns None and runs the modules. It is attached (`attach_cpu_decode_loop`) only for a
CPU model at TP 1 whose CPU kernels load and whose layers are Llama's. `HISERVE_CPU_DECODE_LOOP=0`
keeps every pass on the modules (an A/B).
"""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from hiserve.distributed import get_tp_group
from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.layers.activations import SiluAndMul
from hiserve.layers.attention.cpu_backend import CpuPagedAttnBackend
from hiserve.layers.attention.hybrid_backend import HybridAttnBackend
from hiserve.layers.forward_batch import ForwardBatch
from hiserve.layers.linear import PackedLinear
from hiserve.layers.norms import RMSNorm
from hiserve.layers.rotary import RotaryEmbedding
from hiserve.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaMLP, LlamaModel

logger = logging.getLogger(__name__)
_DTYPES = (torch.float32, torch.bfloat16)


class _Layer(NamedTuple):
    """One decoder layer as the loop calls it (PreNormDecoderLayer's parts)."""

    input_layernorm: torch.Tensor  # [H] weight
    post_attention_layernorm: torch.Tensor  # [H] weight
    qkv_proj: Callable[[torch.Tensor], torch.Tensor]  # the linear layers' own forward methods
    o_proj: Callable[[torch.Tensor], torch.Tensor]
    gate_up_proj: Callable[[torch.Tensor], torch.Tensor]
    down_proj: Callable[[torch.Tensor], torch.Tensor]
    layer_id: int
    # silu(gate) * up in the gate/up GEMM's epilogue where the layer offers it (None: unfused);
    # the loop must take it where LlamaMLP does, or its bf16 rounding differs from the modules'.
    silu_mul: Callable[[torch.Tensor], torch.Tensor | None]


def _no_silu_mul(x: torch.Tensor) -> None:
    """A gate/up layer without a fused epilogue: the loop runs the GEMM, then the activation."""
    return None


def _out_dtype(linear: nn.Module) -> torch.dtype | None:
    """The dtype a linear layer returns for model-dtype input: GGUF layers keep the input's
    (their `dtype` is the model's), dense ones return their weight's (prepacked or not)."""
    if isinstance(linear, PackedLinear):
        return linear.packed_weight.dtype
    dtype = getattr(linear, "dtype", None)
    if isinstance(dtype, torch.dtype):
        return dtype
    weight = getattr(linear, "weight", None)
    return weight.dtype if isinstance(weight, torch.Tensor) else None


def _unsupported(model: nn.Module) -> str | None:
    """Why the loop cannot run `model`, or None. Exact types: a subclass may change a forward
    (e.g. a q/k norm) that the loop would not repeat."""
    if os.environ.get("HISERVE_CPU_DECODE_LOOP", "1") == "0":
        return "HISERVE_CPU_DECODE_LOOP=0"
    if get_tp_group().size > 1:
        return "tensor parallelism"
    if not (type(model) is LlamaModel and len(model.layers) > 0 and type(model.rotary_emb) is RotaryEmbedding
            and type(model.norm) is RMSNorm and type(model.embed_tokens) is nn.Embedding):
        return "not a Llama decoder stack"
    dtype = model.embed_tokens.weight.dtype
    if dtype not in _DTYPES or model.embed_tokens.weight.device.type != "cpu":
        return f"a {dtype} model off the CPU kernels' dtypes or device"
    a0 = model.layers[0].self_attn
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if not (type(layer) is LlamaDecoderLayer and type(attn) is LlamaAttention and type(mlp) is LlamaMLP
                and all(type(n) is RMSNorm and n.weight.dtype == dtype and n.eps == model.norm.eps for n in norms)
                and type(mlp.act_fn) is SiluAndMul and attn.attn.scaling == a0.attn.scaling
                and (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (a0.num_heads, a0.num_kv_heads, a0.head_dim)
                and all(_out_dtype(lin) == dtype for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj,
                                                              mlp.down_proj))):
            return "a layer the loop does not know"
    if not cpu_kernels.can_use_cpu_kernels():
        return "CPU kernels unavailable"
    return None


class CpuDecodeLoop:
    """The decoder stack of a LlamaModel for DECODE passes (see the module docstring)."""

    def __init__(self, model: LlamaModel) -> None:
        a0 = model.layers[0].self_attn
        self.model = model
        self.num_heads, self.num_kv_heads, self.head_dim = a0.num_heads, a0.num_kv_heads, a0.head_dim
        self.q_size, self.kv_size = a0.q_size, a0.kv_size
        self.qk_size = self.q_size + self.kv_size  # q and k columns of the fused QKV output
        self.scale = float(a0.attn.scaling)
        self.eps = float(model.norm.eps)
        self.rotary_dim = model.rotary_emb.rotary_dim
        self.dtype = model.embed_tokens.weight.dtype
        self.layers = [_Layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight,
                              layer.self_attn.qkv_proj.forward, layer.self_attn.o_proj.forward,
                              layer.mlp.gate_up_proj.forward, layer.mlp.down_proj.forward,
                              layer.self_attn.attn.layer_id, getattr(layer.mlp.gate_up_proj, "silu_mul", _no_silu_mul))
                       for layer in model.layers]

    def kernel_args(self, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(req_pool_indices [B], seq_lens [B], q_starts [B + 1], out_cache_loc [B]) for the
        paged attention kernel when this pass can take the loop (`CpuPagedAttnBackend.decode_kernel_args`),
        else None."""
        if not fb.forward_mode.is_decode() or torch.is_grad_enabled():
            return None
        backend = fb.attn_backend
        if isinstance(backend, HybridAttnBackend):
            backend = backend.decode_backend
        pool = fb.token_to_kv_pool
        if (type(backend) is not CpuPagedAttnBackend or pool.dtype != self.dtype
                or getattr(pool, "head_num", None) != self.num_kv_heads
                or getattr(pool, "head_dim", None) != self.head_dim):
            return None
        return backend.decode_kernel_args()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor | None:
        """input_ids, positions [B] int64 -> final hidden states [B, H] (the model's dtype), or
        None when this pass must run the modules (`kernel_args`).

        Raises:
            RuntimeError: a C++ binding's check failed (a shape the kernels do not take).
        """
        args = self.kernel_args(fb)
        if args is None:
            return None
        model = self.model
        hidden = F.embedding(input_ids, model.embed_tokens.weight)
        cos, sin = model.rotary_emb.get_cos_sin(positions)
        residual = None
        module, threads = cpu_kernels.load_cpu_module(), torch.get_num_threads()
        for layer in self.layers:
            hidden, residual = self._layer(layer, hidden, residual, cos, sin, args, fb, module, threads)
        return model.norm.forward(hidden, residual)[0]

    def _layer(self, layer: _Layer, hidden: torch.Tensor, residual: torch.Tensor | None, cos: torch.Tensor,
               sin: torch.Tensor, args: tuple[torch.Tensor, ...], fb: ForwardBatch, module: Any, threads: int
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer, as PreNormDecoderLayer.forward runs it: hidden/residual [T, H] in, the
        MLP output and the new residual out. `module`: the JIT CPU module (tvm-ffi)."""
        t, nh, nkv, d = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        contiguous = torch.contiguous_format
        x = torch.empty_like(hidden, memory_format=contiguous)
        if residual is None:
            module.rmsnorm(hidden, hidden, layer.input_layernorm, x, x, False, self.eps, threads)
            residual = hidden
        else:
            new_residual = torch.empty_like(hidden, memory_format=contiguous)
            module.rmsnorm(hidden, residual, layer.input_layernorm, x, new_residual, True, self.eps, threads)
            residual = new_residual
        qkv = layer.qkv_proj(x)  # [T, q | k | v]; q and k rotated in one call, as LlamaAttention does
        qk_size = self.qk_size
        qk = torch.empty((t, nh + nkv, d), dtype=qkv.dtype)
        module.rotary(qkv[:, :qk_size].view(t, nh + nkv, d), cos, sin, qk, self.rotary_dim, True, threads)
        pool = fb.token_to_kv_pool
        # get_*_buffer first: they wait for a layer's load-back, which must land before the
        # kernel writes the new rows over it (as CpuPagedAttnBackend.forward does).
        k_buf, v_buf = pool.get_key_buffer(layer.layer_id), pool.get_value_buffer(layer.layer_id)
        attn = torch.empty((t, nh * d), dtype=qkv.dtype)
        req_pool_indices, seq_lens, q_starts, out_cache_loc = args
        module.paged_attention(qk[:, :nh].reshape(t, self.q_size), k_buf, v_buf, attn,
                               fb.req_to_token_pool.req_to_token, req_pool_indices, seq_lens, q_starts,
                               qk[:, nh:].reshape(t, self.kv_size), qkv[:, qk_size:], out_cache_loc, True, nh, nkv,
                               self.scale, threads)
        hidden = layer.o_proj(attn)
        x = torch.empty_like(hidden, memory_format=contiguous)
        new_residual = torch.empty_like(hidden, memory_format=contiguous)
        module.rmsnorm(hidden, residual, layer.post_attention_layernorm, x, new_residual, True, self.eps, threads)
        act = layer.silu_mul(x)
        if act is None:
            gate_up = layer.gate_up_proj(x)
            act = torch.empty((t, gate_up.shape[1] // 2), dtype=gate_up.dtype)
            module.silu_and_mul(gate_up, act, threads)
        return layer.down_proj(act), new_residual


def attach_cpu_decode_loop(model: nn.Module) -> bool:
    """Give a causal LM's LlamaModel (`model.model`) a `CpuDecodeLoop` when it can run one;
    logs the outcome once. Returns whether it was attached."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel):
        logger.info("CPU decode loop: off (not a Llama-family model); DECODE runs the modules")
        return False
    why = _unsupported(inner)
    if why is not None:
        logger.info("CPU decode loop: off (%s); DECODE runs the modules", why)
        return False
    inner.decode_loop = CpuDecodeLoop(inner)
    logger.info("CPU decode loop: on (DECODE passes run the layers as one loop; "
                "HISERVE_CPU_DECODE_LOOP=0 turns it off)")
    return True
