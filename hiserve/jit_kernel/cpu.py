"""Build, cache and call the JIT CPU kernels under `jit_kernel/csrc/cpu/`.

The C++ sources are compiled with apache-tvm-ffi (`tvm_ffi.cpp.load_inline`, g++ + ninja,
OpenMP) the first time a kernel is needed, once per machine ISA tier: the compile flags are
chosen from the CPU's features (`hiserve.hardware.detect_cpu().isa`), never `-march=native`,
so a shared build cache (`TVM_FFI_CACHE_DIR`) never hands one CPU's build to another that
lacks its instructions. The module name holds a hash of the sources and the tier.

`can_use_cpu_kernels()` answers whether they can run here and logs ONE warning with the
reason the first time it says no (no tvm-ffi, no compiler or ninja, a failed build); the
callers then use their torch forms. HISERVE_CPU_KERNELS=0 turns the kernels off.

The wrappers take torch CPU tensors, check what the C++ side assumes (raising ValueError),
allocate the outputs and run on `torch.get_num_threads()` OpenMP threads (the same libgomp
torch loads, so both share one thread pool).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path

import torch

from hiserve.hardware import detect_cpu
from hiserve.jit_kernel.utils import _ensure_ninja_on_path, _import_tvm_ffi, warn_once

logger = logging.getLogger(__name__)

CPU_CSRC_DIR = Path(__file__).resolve().parent / "csrc" / "cpu"
CPU_FUNCTIONS = {
    "paged_attention": "paged (DECODE/EXTEND) causal attention over the KV pool through req_to_token",
    "rmsnorm": "RMSNorm with an optional fused residual add",
    "rotary": "rotary embedding, NeoX or interleaved, partial rotary_dim",
    "silu_and_mul": "silu(gate) * up",
    "argmax_rows": "greedy sampling: each float32 row's argmax (first on ties, first NaN as torch)",
    "gguf_gemm": "GEMM of a few rows by GGUF Q4/Q8_0 blocks, dequantized in registers",
    "gguf_amx_ready": "1 where this build has the AMX GEMM and the process may use AMX tiles",
    "gguf_amx_pack": "GGUF Q4_0/Q4_1/Q8_0 blocks -> the AMX GEMM's 16 x 32 weight records",
    "gguf_amx_gemm": "GEMM of bf16 rows by AMX weight records (AMX tiles, one dequantization per call)",
    "amx_bf16_gemm": "dense bf16 GEMM on AMX tiles for many rows, weights in 32-feature tile strips",
    "amx_bf16_gemm_silu": "the MLP's gate/up GEMM on AMX tiles with silu(gate) * up in its epilogue",
    "amx_flash_attention": "prefill attention on AMX tiles (causal or not, GQA, optional log-sum-exp)",
}
# Explicit -m flags per tier (see CpuInfo.isa). prefer-vector-width=512: gcc otherwise keeps
# 256-bit vectors on AVX-512 targets, halving the width of the kernels' inner loops.
ISA_FLAGS = {
    "amx": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
            "-mavx512bf16", "-mamx-tile", "-mamx-bf16", "-mprefer-vector-width=512"],
    "avx512_bf16": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
                    "-mavx512bf16", "-mprefer-vector-width=512"],
    "avx512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq",
               "-mprefer-vector-width=512"],
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "baseline": [],
}
_DTYPES = (torch.float32, torch.bfloat16)
_build_lock = threading.Lock()


def cpu_csrc_digest() -> str:
    """Hash of the CPU sources (part of the module name, so an edit gives a new build)."""
    digest = hashlib.sha256()
    for path in sorted(CPU_CSRC_DIR.glob("*")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:12]


@functools.lru_cache(maxsize=None)
def cpu_kernels_unavailable_reason() -> str | None:
    """Why the CPU kernels cannot be built or loaded here, or None when they are loaded."""
    if os.environ.get("HISERVE_CPU_KERNELS", "1") == "0":
        return "HISERVE_CPU_KERNELS=0"
    try:
        _import_tvm_ffi()
    except Exception as exc:
        return f"apache-tvm-ffi is not importable ({type(exc).__name__}: {exc}); pip install apache-tvm-ffi"
    if shutil.which(os.environ.get("CXX", "c++")) is None and shutil.which("g++") is None:
        return "no C++ compiler (c++/g++) on PATH"
    if not _ensure_ninja_on_path():
        return "ninja was not found on PATH (pip install ninja)"
    try:
        load_cpu_module()
    except Exception as exc:  # a compiler error: its text is in the exception
        return f"the build failed ({type(exc).__name__}: {str(exc)[-2000:]})"
    return None


def can_use_cpu_kernels() -> bool:
    """True when the CPU kernels are built and loaded; else warns once (with the reason)."""
    reason = cpu_kernels_unavailable_reason()
    if reason is not None:
        warn_once("cpu_kernels", "hiserve CPU kernels unavailable (%s); using the torch forms", reason)
        return False
    return True


def runnable_isas() -> tuple[str, ...]:
    """The ISA tiers this CPU can run, lowest first (ISA_FLAGS lists them highest first, and
    each tier's instructions include the ones below it): tests build every one of them."""
    tiers = tuple(reversed(ISA_FLAGS))
    return tiers[: tiers.index(detect_cpu().isa) + 1]


@functools.lru_cache(maxsize=None)
def load_cpu_module(isa: str | None = None):
    """Compile (first call) and load the CPU module for `isa` (default: this CPU's tier; a
    lower one, from `runnable_isas()`, for tests of the other code paths).

    Raises:
        RuntimeError / ImportError: tvm-ffi missing or the compiler failed.
    """
    if isa is None and detect_cpu().isa == "amx":
        try:
            return _build_cpu_module("amx")
        except Exception as exc:  # e.g. a compiler without -mamx-tile (gcc < 11): AMX is only the GEMM
            warn_once("cpu_kernels_amx", "the AMX build of the CPU kernels failed (%s); using the avx512_bf16 "
                      "build (no AMX GEMM)", str(exc)[-500:])
            return _build_cpu_module("avx512_bf16")
    return _build_cpu_module(isa or detect_cpu().isa)


def _build_cpu_module(isa: str):
    """Compile (first call) and load the module of one ISA tier (cached on disk by tvm-ffi)."""
    tvm_ffi = _import_tvm_ffi()
    cpu = detect_cpu()
    digest = cpu_csrc_digest()
    name = f"hiserve_cpu_{digest}_{isa}"
    source = f'// csrc/cpu digest {digest}\n#include "bindings.h"\n'
    with _build_lock:
        module = tvm_ffi.cpp.load_inline(
            name=name,
            cpp_sources=source,
            functions=CPU_FUNCTIONS,
            extra_cflags=["-O3", "-fopenmp", *ISA_FLAGS[isa]],
            extra_ldflags=["-fopenmp"],
            extra_include_paths=[str(CPU_CSRC_DIR)],
        )
    logger.info("loaded JIT CPU module %s for %s", name, cpu.describe())
    return module


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ValueError(message)


def _check_float(*tensors: torch.Tensor) -> None:
    dtype = tensors[0].dtype
    _check(dtype in _DTYPES, f"CPU kernels run float32 or bfloat16, got {dtype}")
    for t in tensors:
        _check(t.device.type == "cpu", "CPU kernels need CPU tensors")
        _check(t.dtype == dtype, f"dtype mismatch: {t.dtype} vs {dtype}")


def paged_attention(
    q: torch.Tensor,
    k_buf: torch.Tensor,
    v_buf: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    q_starts: torch.Tensor,
    num_q_heads: int,
    scale: float,
    k_new: torch.Tensor | None = None,
    v_new: torch.Tensor | None = None,
    out_cache_loc: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's new tokens over its whole context in the pool,
    optionally storing the new tokens' K/V into the pool first (in the same C++ call).

    Args:
        q: [T, Hq * D] (rows may be strided, e.g. a view of a fused QKV output).
        k_buf, v_buf: pool layers [slots, Hkv, D] / [slots, Hkv, Dv], q's dtype.
        req_to_token: [R, max_context] int32; row r lists request r's pool slots in order.
        req_pool_indices, seq_lens: [B] int64; seq_lens counts the context incl. new tokens.
        q_starts: [B + 1] int64 cumulative new-token counts (q rows of request b:
            q_starts[b]:q_starts[b+1]); DECODE is q_starts = arange(B + 1).
        num_q_heads: Hq (a multiple of Hkv); scale: the softmax scale.
        k_new, v_new, out_cache_loc: all three or none. k_new [T', Hkv * D], v_new
            [T', Hkv * Dv] in the pool's dtype (no conversion here: the caller casts or keeps
            its own store; rows may be strided, each contiguous), out_cache_loc [T'] int64:
            row t is written to k_buf[out_cache_loc[t]] / v_buf[...] before attention reads
            the pool, as `MHATokenToKVPool.set_kv_buffer` would. The new tokens' slots must be
            the last context slots of their requests in req_to_token.
    Returns:
        [T, Hq * Dv] in q's dtype.
    Raises:
        ValueError: dtypes, devices or shapes the kernel does not take (an out-of-range
            out_cache_loc raises from the kernel, before any row is written).
    """
    dt, i64 = q.dtype, torch.int64
    # One boolean pass on the hot path (decode calls this once per layer and step); the
    # detailed checks run only when it fails, to raise with the reason.
    if not (dt in _DTYPES and q.is_cpu and k_buf.is_cpu and v_buf.is_cpu and k_buf.dtype == dt
            and v_buf.dtype == dt and k_buf.dim() == 3 and v_buf.dim() == 3 and k_buf.is_contiguous()
            and v_buf.is_contiguous() and q.dim() == 2 and q.stride(1) == 1
            and req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1
            and req_pool_indices.dtype == i64 and seq_lens.dtype == i64 and q_starts.dtype == i64
            and req_pool_indices.is_cpu and seq_lens.is_cpu and q_starts.is_cpu
            and req_pool_indices.is_contiguous() and seq_lens.is_contiguous() and q_starts.is_contiguous()
            and q_starts.numel() == seq_lens.numel() + 1 == req_pool_indices.numel() + 1
            and q.shape[1] == num_q_heads * k_buf.shape[2]):
        _validate_paged_attention(q, k_buf, v_buf, req_to_token, req_pool_indices, seq_lens, q_starts, num_q_heads)
    k_new, v_new, out_cache_loc, store = _kv_store_args(k_buf, v_buf, k_new, v_new, out_cache_loc, q_starts)
    out = q.new_empty((q.shape[0], num_q_heads * v_buf.shape[2]))
    load_cpu_module().paged_attention(q, k_buf, v_buf, out, req_to_token, req_pool_indices, seq_lens, q_starts,
                                      k_new, v_new, out_cache_loc, store, num_q_heads, k_buf.shape[1],
                                      float(scale), torch.get_num_threads())
    return out


def _kv_store_args(k_buf: torch.Tensor, v_buf: torch.Tensor, k_new: torch.Tensor | None, v_new: torch.Tensor | None,
                   out_cache_loc: torch.Tensor | None, filler: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """(k_new, v_new, out_cache_loc, store) for the kernel: the checked store, or `filler`
    three times and False without one. Raises ValueError on a store the kernel does not take."""
    store = out_cache_loc is not None
    if store:
        # One boolean pass again; _validate_kv_store raises with the reason when it fails.
        if not (k_new is not None and v_new is not None and k_new.dtype == k_buf.dtype and v_new.dtype == k_buf.dtype
                and k_new.is_cpu and v_new.is_cpu and out_cache_loc.is_cpu and out_cache_loc.dtype == torch.int64
                and out_cache_loc.dim() == 1 and out_cache_loc.is_contiguous()
                and k_new.dim() == 2 and v_new.dim() == 2 and k_new.stride(1) == 1 and v_new.stride(1) == 1
                and k_new.shape[0] == v_new.shape[0] == out_cache_loc.shape[0]
                and k_new.shape[1] == k_buf.shape[1] * k_buf.shape[2]
                and v_new.shape[1] == v_buf.shape[1] * v_buf.shape[2]):
            _validate_kv_store(k_buf, v_buf, k_new, v_new, out_cache_loc)
    elif k_new is not None or v_new is not None:
        _validate_kv_store(k_buf, v_buf, k_new, v_new, out_cache_loc)
    else:  # unread by the kernel without the store; any tensor fills the slots
        k_new = v_new = out_cache_loc = filler
    return k_new, v_new, out_cache_loc, store


def _validate_kv_store(k_buf: torch.Tensor, v_buf: torch.Tensor, k_new: torch.Tensor | None,
                       v_new: torch.Tensor | None, out_cache_loc: torch.Tensor | None) -> None:
    """Raise ValueError unless k_new/v_new/out_cache_loc are a store `paged_attention` takes."""
    _check(k_new is not None and v_new is not None and out_cache_loc is not None,
           "k_new, v_new and out_cache_loc go together")
    _check(k_new.dtype == k_buf.dtype and v_new.dtype == k_buf.dtype and k_new.is_cpu and v_new.is_cpu,
           f"k_new/v_new must be CPU tensors of the pool dtype {k_buf.dtype}")
    _check(k_new.dim() == 2 and v_new.dim() == 2 and k_new.stride(1) == 1 and v_new.stride(1) == 1,
           "k_new/v_new must be [T, width] with contiguous rows")
    _check(out_cache_loc.dtype == torch.int64 and out_cache_loc.is_cpu and out_cache_loc.dim() == 1
           and out_cache_loc.is_contiguous(), "out_cache_loc must be a contiguous int64 CPU [T]")
    n = out_cache_loc.shape[0]
    _check(k_new.shape == (n, k_buf.shape[1] * k_buf.shape[2])
           and v_new.shape == (n, v_buf.shape[1] * v_buf.shape[2]),
           "k_new/v_new must be [T, Hkv * D] / [T, Hkv * Dv] with T = len(out_cache_loc)")


def _validate_paged_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor,
                              req_to_token: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                              q_starts: torch.Tensor, num_q_heads: int) -> None:
    """Raise ValueError with the first reason `paged_attention` cannot take these inputs."""
    _check_float(q, k_buf, v_buf)
    _check(k_buf.dim() == 3 and v_buf.dim() == 3 and k_buf.is_contiguous() and v_buf.is_contiguous(),
           "k_buf/v_buf must be contiguous [slots, heads, dim]")
    _check(q.dim() == 2 and q.stride(1) == 1, "q must be [T, Hq * D] with contiguous rows")
    _check(req_to_token.dtype == torch.int32 and req_to_token.stride(1) == 1, "req_to_token must be int32")
    for t in (req_pool_indices, seq_lens, q_starts):
        _check(t.dtype == torch.int64 and t.is_contiguous() and t.device.type == "cpu", "index tensors: int64 CPU")
    _check(q_starts.numel() == seq_lens.numel() + 1 == req_pool_indices.numel() + 1, "q_starts must be [B + 1]")
    _check(q.shape[1] == num_q_heads * k_buf.shape[2], "q width must be num_q_heads * head_dim")


def rmsnorm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> RMSNorm(x) [T, H]; with residual [T, H]: (RMSNorm(x + residual), x + residual).
    Rounds as `hiserve.layers.norms.rmsnorm_reference` does (on AVX512-BF16 CPUs a denormal
    bf16 result, |v| < 2^-126, flushes to zero). Raises ValueError on bad input."""
    dt = x.dtype
    if not (dt in _DTYPES and x.is_cpu and weight.is_cpu and weight.dtype == dt and x.dim() == 2
            and x.stride(1) == 1 and weight.shape == (x.shape[1],)
            and (residual is None or residual.is_cpu and residual.dtype == dt and residual.shape == x.shape)):
        _check_float(x, weight)
        _check(x.dim() == 2 and x.stride(1) == 1 and weight.shape == (x.shape[1],), "x must be [T, H], weight [H]")
        if residual is not None:
            _check_float(x, residual)
            _check(residual.shape == x.shape, "residual must have x's shape")
    w = weight.contiguous()
    out = torch.empty_like(x, memory_format=torch.contiguous_format)  # cheaper than torch.empty(shape)
    if residual is None:
        load_cpu_module().rmsnorm(x, x, w, out, out, False, float(eps), torch.get_num_threads())
        return out
    new_residual = torch.empty_like(x, memory_format=torch.contiguous_format)
    load_cpu_module().rmsnorm(x, residual.contiguous(), w, out, new_residual, True, float(eps),
                              torch.get_num_threads())
    return out, new_residual


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int, is_neox: bool = True) -> torch.Tensor:
    """x [T, heads, head_dim] (heads contiguous), cos/sin [T, 1, rotary_dim // 2] float32 ->
    rotated copy [T, heads, head_dim]. Raises ValueError on bad input."""
    if not (x.dtype in _DTYPES and x.is_cpu and x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2]
            and cos.dtype == torch.float32 and sin.dtype == torch.float32
            and cos.shape[0] == x.shape[0] and cos.shape[-1] == rotary_dim // 2):
        _check_float(x)
        _check(x.dim() == 3 and x.stride(2) == 1 and x.stride(1) == x.shape[2], "x must be [T, heads, head_dim]")
        _check(cos.dtype == torch.float32 and sin.dtype == torch.float32, "cos/sin must be float32")
        _check(cos.shape[0] == x.shape[0] and cos.shape[-1] == rotary_dim // 2,
               "cos/sin must be [T, 1, rotary_dim // 2]")
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    load_cpu_module().rotary(x, cos, sin, out, int(rotary_dim), bool(is_neox), torch.get_num_threads())
    return out


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> silu(gate) * up [T, I]. Raises ValueError on bad input."""
    if not (x.dtype in _DTYPES and x.is_cpu and x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0):
        _check_float(x)
        _check(x.dim() == 2 and x.stride(1) == 1 and x.shape[1] % 2 == 0, "x must be [T, 2I]")
    out = torch.empty((x.shape[0], x.shape[1] // 2), dtype=x.dtype)
    load_cpu_module().silu_and_mul(x, out, torch.get_num_threads())
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [B, V] float32 CPU, rows contiguous, V >= 1 -> [B] int64, torch.argmax(dim=-1)'s
    result (the first index on ties; the first NaN where a row has one), vectorized and
    parallel over rows. Raises ValueError on bad input."""
    if not (logits.dtype == torch.float32 and logits.is_cpu and logits.dim() == 2 and logits.stride(1) == 1
            and logits.shape[1] >= 1):
        _check(logits.dtype == torch.float32 and logits.is_cpu, "logits must be float32 on the CPU")
        _check(logits.dim() == 2 and logits.shape[1] >= 1, f"logits must be [B, V >= 1], got {tuple(logits.shape)}")
        _check(logits.stride(1) == 1, "logits rows must be contiguous (stride 1 along V)")
    out = torch.empty(logits.shape[0], dtype=torch.int64)
    load_cpu_module().argmax_rows(logits, out, torch.get_num_threads())
    return out


def use_cpu_kernels(*tensors: torch.Tensor) -> bool:
    """Whether a layer should call these kernels for `tensors`: all CPU, one dtype among
    float32/bfloat16, no autograd (the kernels have no backward), and the module loads."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPES:
        return False
    grad = torch.is_grad_enabled()
    for t in tensors:  # a plain loop: called per layer and step, a generator costs more here
        if not t.is_cpu or t.dtype != dtype or grad and t.requires_grad:
            return False
    return can_use_cpu_kernels()


# GGUF type name -> (the kernel's block_type id, bytes a 32-weight block: ggml-common.h's sizes,
# which gguf_gemm.h's block_bytes repeats and hiserve.layers.quantization.gguf reads from here)
GGUF_BLOCK_TYPES = {"Q4_0": (0, 18), "Q4_1": (1, 20), "Q8_0": (2, 34)}


def gguf_gemm(x: torch.Tensor, blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """y = x @ W^T with W in its GGUF blocks, dequantized in registers (csrc/cpu/gguf_gemm.h).

    Args:
        x: [M, K] float32 or bfloat16 (rows may be strided, each contiguous); K % 32 == 0.
        blocks: uint8 [N, K/32 * block bytes], contiguous: row n holds output feature n's
            blocks exactly as the GGUF file stores them.
        qtype: "Q4_0", "Q4_1" or "Q8_0".
    Returns:
        [M, N] in x's dtype; each weight is gguf's own dequantized value (exact in float32),
        the sum over K runs in float32.
    Raises:
        ValueError: another type, or shapes/dtypes the kernel does not take.
    """
    kind, nbytes = GGUF_BLOCK_TYPES.get(qtype, (None, 0))
    if not (kind is not None and x.dtype in _DTYPES and x.is_cpu and x.dim() == 2 and x.stride(1) == 1
            and blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.is_contiguous() and blocks.is_cpu
            and x.shape[1] % 32 == 0 and blocks.shape[1] == x.shape[1] // 32 * nbytes):
        _check(kind is not None, f"gguf_gemm takes {sorted(GGUF_BLOCK_TYPES)}, got {qtype}")
        _check_float(x)
        _check(x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows")
        _check(blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.is_contiguous() and blocks.is_cpu,
               "blocks must be a contiguous uint8 CPU tensor [N, bytes]")
        _check(x.shape[1] % 32 == 0 and blocks.shape[1] == x.shape[1] // 32 * nbytes,
               f"blocks rows must hold K/32 {qtype} blocks ({nbytes} bytes each) for K = {x.shape[1]}")
    out = x.new_empty((x.shape[0], blocks.shape[0]))
    load_cpu_module().gguf_gemm(x, blocks, out, kind, torch.get_num_threads())
    return out


@functools.lru_cache(maxsize=None)
def amx_gemm_available() -> bool:
    """True where the AMX GEMM can run: the CPU's kernel tier is "amx", the kernels build, and
    Linux granted this process AMX tile state (asked once, by the kernel module)."""
    return detect_cpu().isa == "amx" and can_use_cpu_kernels() and bool(load_cpu_module().gguf_amx_ready())


def gguf_amx_pack(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    """GGUF Q4_0/Q4_1/Q8_0 rows -> the AMX GEMM's weight records (csrc/cpu/gguf_amx.h).

    Args:
        blocks: uint8 [N, K/32 * block bytes], contiguous, as the GGUF file stores the rows; N % 16 == 0.
        qtype: "Q4_0", "Q4_1" or "Q8_0".
    Returns:
        uint8 [N/16, K/32, 320] (Q4: 5 bits a weight, as Q4_1) or [N/16, K/32, 544] (Q8_0).
    Raises:
        ValueError: another type or shape; RuntimeError: no AMX build here, or a Q4_0 scale
            whose -8x overflows fp16 (|d| >= 8192; no quantizer writes one).
    """
    kind, nbytes = GGUF_BLOCK_TYPES.get(qtype, (None, 0))
    _check(kind is not None, f"gguf_amx_pack takes Q4_0, Q4_1 or Q8_0, got {qtype}")
    _check(blocks.dtype == torch.uint8 and blocks.dim() == 2 and blocks.is_contiguous() and blocks.is_cpu,
           "blocks must be a contiguous uint8 CPU tensor [N, bytes]")
    _check(blocks.shape[0] % 16 == 0 and blocks.shape[1] % nbytes == 0,
           f"blocks must be [N, K/32 * {nbytes}] with N a multiple of 16, got {tuple(blocks.shape)}")
    record = 544 if qtype == "Q8_0" else 320
    out = torch.empty((blocks.shape[0] // 16, blocks.shape[1] // nbytes, record), dtype=torch.uint8)
    load_cpu_module().gguf_amx_pack(blocks, out, kind)
    return out


def gguf_amx_gemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """y = x @ W^T on AMX tiles, W in `gguf_amx_pack`'s records: each weight is gguf's
    dequantized value rounded to bf16 (as the dense bf16 copy holds it), sums in float32.

    Args:
        x: [M, K] bfloat16 (rows may be strided, each contiguous); any M (passes of 64 rows).
        packed: uint8 [N/16, K/32, 320 or 544] from `gguf_amx_pack`.
    Returns:
        [M, N] bfloat16.
    Raises:
        ValueError: x not bf16 or shapes that disagree (checked here); RuntimeError: no AMX
            here, or a check of the C++ side (memory safety) failed.
    """
    if not (x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1
            and packed.dim() == 3 and x.shape[1] == packed.shape[1] * 32):
        _check(x.dtype == torch.bfloat16 and x.is_cpu, f"gguf_amx_gemm takes bfloat16 CPU rows, got {x.dtype}")
        _check(x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows")
        _check(packed.dim() == 3 and x.shape[1] == packed.shape[1] * 32,
               f"x has K = {x.shape[1]}, the packed weight {packed.shape[1] * 32 if packed.dim() == 3 else '?'}")
    out = x.new_empty((x.shape[0], packed.shape[0] * 16))
    load_cpu_module().gguf_amx_gemm(x, packed, out, torch.get_num_threads())
    return out
