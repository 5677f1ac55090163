"""Python side of the AMX kernels: the dense bf16 GEMM (csrc/cpu/amx_bf16_gemm.h) and its weight
packing, the MLP's gate/up GEMM with silu in its epilogue (amx_bf16_gemm_silu.h) and the prefill
flash attention (amx_attention.h), each a checked call. `amx_gemm_available()` (in `cpu`) says
whether this process can run them."""

from __future__ import annotations

import torch

from hiserve.jit_kernel.cpu import _check, load_cpu_module


def amx_bf16_packable(weight: torch.Tensor) -> bool:
    """Whether `amx_bf16_pack` takes this weight: bf16 [N, K] on the CPU, N and K positive
    multiples of 32 (the kernel's 32-feature strips and 32-wide K steps)."""
    return (weight.dtype == torch.bfloat16 and weight.is_cpu and weight.dim() == 2
            and weight.shape[0] > 0 and weight.shape[1] > 0
            and weight.shape[0] % 32 == 0 and weight.shape[1] % 32 == 0)


def amx_bf16_pack(weight: torch.Tensor) -> torch.Tensor:
    """W [N, K] bf16 -> the kernel's tile layout, bf16 [N/32, K/32, 1024] (the same bytes as W).

    Element [s, kb, 512 h + 32 r + 2 f + p] = W[32 s + 16 h + f, 32 kb + 2 r + p]: per strip of
    32 features and K block of 32, two 16 x 32 B-tile images with K pairs interleaved, AMX's
    VNNI order for TDPBF16PS (Intel Optimization Reference Manual, ch. 20).
    Raises:
        ValueError: not bf16 [N, K] on the CPU with N and K multiples of 32.
    """
    _check(amx_bf16_packable(weight),
           f"amx_bf16_pack takes a bf16 CPU weight [N, K], N and K multiples of 32, got "
           f"{weight.dtype} {tuple(weight.shape)}")
    n, k = weight.shape
    w = weight.detach().reshape(n // 32, 2, 16, k // 32, 16, 2)  # (s, h, f, kb, r, p)
    return w.permute(0, 3, 1, 4, 2, 5).contiguous().reshape(n // 32, k // 32, 1024)


_NO_BIAS = torch.empty(0, dtype=torch.float32)


def amx_bf16_gemm(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """y = x @ W^T (+ bias) on AMX tiles, W from `amx_bf16_pack`; float32 sums, the bias added
    in float32, one rounding to bf16.

    Args:
        x: [M, K] bfloat16 on the CPU, rows contiguous (strided rows allowed); any M.
        packed: bf16 [N/32, K/32, 1024] on the CPU, contiguous, from `amx_bf16_pack`.
        bias: float32 [N] on the CPU, contiguous, or None.
    Returns:
        [M, N] bfloat16, contiguous.
    Raises:
        ValueError: x not bf16 [M, K], a packed weight or bias not as above, or a K that
            disagrees with the packed weight; RuntimeError: no AMX here, or a check of the
            C++ side (memory safety) failed.
    """
    packed_ok = (packed.dtype == torch.bfloat16 and packed.is_cpu and packed.dim() == 3 and packed.is_contiguous()
                 and packed.shape[2] == 1024)
    bias_ok = bias is None or (bias.dtype == torch.float32 and bias.is_cpu and bias.is_contiguous()
                               and packed_ok and bias.shape == (packed.shape[0] * 32,))
    if not (x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1 and packed_ok
            and x.shape[1] == packed.shape[1] * 32 and bias_ok):
        _check(x.dtype == torch.bfloat16 and x.is_cpu, f"amx_bf16_gemm takes bfloat16 CPU rows, got {x.dtype}")
        _check(x.dim() == 2 and x.stride(1) == 1, "x must be [M, K] with contiguous rows")
        _check(packed_ok, "packed must be a contiguous bf16 CPU tensor [N/32, K/32, 1024]")
        _check(x.shape[1] == packed.shape[1] * 32,
               f"x has K = {x.shape[1]}, the packed weight {packed.shape[1] * 32}")
        _check(bias_ok, "bias must be a contiguous float32 CPU tensor [N]")
    out = x.new_empty((x.shape[0], packed.shape[0] * 32))
    load_cpu_module().amx_bf16_gemm(x, packed, _NO_BIAS if bias is None else bias, out, torch.get_num_threads())
    return out


def amx_bf16_gemm_silu(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    """silu(x @ W_gate^T) * (x @ W_up^T) on AMX tiles for W = [W_gate; W_up] [2I, K] packed by
    `amx_bf16_pack` (the weight the plain `amx_bf16_gemm` takes): float32 sums, the activation
    on them, one rounding to bf16 (the unfused path rounds gate and up, then silu).

    Args:
        x: [M, K] bfloat16 on the CPU, rows contiguous (strided rows allowed); any M.
        packed: bf16 [2I/32, K/32, 1024] on the CPU, contiguous, I a multiple of 32.
    Returns:
        [M, I] bfloat16, contiguous.
    Raises:
        ValueError: x not bf16 [M, K], or a packed weight not as above or of another K;
            RuntimeError: no AMX here, or a check of the C++ side failed.
    """
    _check(x.dtype == torch.bfloat16 and x.is_cpu and x.dim() == 2 and x.stride(1) == 1,
           f"amx_bf16_gemm_silu takes bfloat16 CPU rows [M, K], got {x.dtype} {tuple(x.shape)}")
    _check(packed.dtype == torch.bfloat16 and packed.is_cpu and packed.dim() == 3 and packed.is_contiguous()
           and packed.shape[2] == 1024 and packed.shape[0] % 2 == 0,
           "packed must be a contiguous bf16 CPU tensor [2I/32, K/32, 1024]")
    _check(x.shape[1] == packed.shape[1] * 32, f"x has K = {x.shape[1]}, the packed weight {packed.shape[1] * 32}")
    out = x.new_empty((x.shape[0], packed.shape[0] * 16))
    load_cpu_module().amx_bf16_gemm_silu(x, packed, out, torch.get_num_threads())
    return out


_NO_SLOTS = torch.empty(0, dtype=torch.int64)
_NO_LSE = torch.empty(0, dtype=torch.float32)


def amx_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                        slots: torch.Tensor | None = None, cu_q: torch.Tensor | None = None,
                        cu_k: torch.Tensor | None = None, out: torch.Tensor | None = None,
                        with_lse: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention of one or more sequences' queries over their keys on AMX tiles
    (csrc/cpu/amx_attention.h): float32 scores and online softmax (FlashAttention), the
    probabilities rounded to bf16 for P v, one rounding of the output.

    Args:
        q: [Tq, Hq, D] bfloat16 on the CPU, last dim contiguous (other strides free); D a
            multiple of 32, at most 256.
        k, v: [R, Hkv, D] bfloat16, heads adjacent and each contiguous (a pool buffer, or new
            rows), Hq a multiple of Hkv; query head h reads KV head h // (Hq / Hkv).
        scale: the scores' factor (1/sqrt(D) for most models), > 0.
        causal: in each sequence, query i of n sees keys j <= i + S - n (bottom-right
            aligned, as FlashAttention); needs S >= n. False: every key of its sequence.
        slots: int64 [Tk] contiguous, the rows of k/v that are the keys, in order (pool slots:
            read in place); None: the keys are k/v's rows, Tk = R.
        cu_q, cu_k: int64 [B + 1] contiguous offsets (FlashAttention's varlen form): sequence
            b has q rows [cu_q[b], cu_q[b + 1]) and keys [cu_k[b], cu_k[b + 1]); None for
            both: one sequence of all Tq queries and all Tk keys.
        out: [Tq, Hq, D] bfloat16 to write (last dim contiguous, e.g. a view of the layer's
            output); None: a new contiguous tensor.
        with_lse: also return each query's natural-log log-sum-exp of its scaled scores,
            float32 [Hq, Tq] (for a cascade merge).
    Returns:
        (out, lse or None).
    Raises:
        ValueError: dtypes, devices or shapes as not above; RuntimeError: no AMX here, a slot
            or an offset out of range, or another check of the C++ side (memory safety).
    """
    _check(q.dtype == k.dtype == v.dtype == torch.bfloat16 and q.is_cpu and k.is_cpu and v.is_cpu,
           f"amx_flash_attention takes bfloat16 CPU tensors, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    _check(q.dim() == k.dim() == v.dim() == 3 and q.stride(2) == 1 and k.stride(2) == v.stride(2) == 1
           and k.stride(1) == k.shape[2] and v.stride(1) == v.shape[2],
           "q must be [Tq, Hq, D] and k/v [R, Hkv, D] with adjacent contiguous heads")
    n, hq, d = q.shape
    _check(d % 32 == 0 and 0 < d <= 256 and k.shape[2] == v.shape[2] == d and k.shape[:2] == v.shape[:2]
           and k.shape[1] > 0 and hq % k.shape[1] == 0,
           f"shapes disagree: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    _check(scale > 0, f"scale must be positive, got {scale}")
    _check(slots is None or (slots.dtype == torch.int64 and slots.dim() == 1 and slots.is_contiguous()
                             and slots.is_cpu), "slots must be a contiguous int64 CPU vector")
    _check((cu_q is None) == (cu_k is None), "give both cu_q and cu_k, or neither")
    _check(cu_q is None or (cu_q.is_cpu and cu_k.is_cpu), "cu_q and cu_k must be CPU tensors")
    if cu_q is None:
        s = k.shape[0] if slots is None else slots.numel()
        _check(not causal or s >= n, f"causal attention needs at least as many keys ({s}) as queries ({n})")
        _check(n == 0 or s > 0, "no keys")
        cu_q, cu_k = torch.tensor([0, n], dtype=torch.int64), torch.tensor([0, s], dtype=torch.int64)
    if out is None:
        out = q.new_empty((n, hq, d))
    _check(out.dtype == torch.bfloat16 and out.is_cpu and out.shape == (n, hq, d) and out.stride(2) == 1,
           f"out must be a bfloat16 CPU tensor [{n}, {hq}, {d}] with a contiguous last dim")
    lse = torch.empty((hq, n), dtype=torch.float32) if with_lse else None
    load_cpu_module().amx_flash_attention(q, k, v, _NO_SLOTS if slots is None else slots, cu_q, cu_k, out,
                                          _NO_LSE if lse is None else lse, causal, scale, torch.get_num_threads())
    return out, lse
