"""Can FlashAttention-3 run here, and which of its kernels were built?

FA3 ships as the `flash_attn_interface` module (PyPI wheel `tokenspeed-fa3`, or a
build from the flash-attention repo's `hopper/` folder). It runs only on Hopper
(compute capability 9.x). A wheel may leave head-dim combinations out of its build;
its `flash_attn_config.CONFIG["build_flags"]` says which. MLA in the absorbed form
needs the pair (q/k head dim = qk_rope_head_dim, v head dim = kv_lora_rank) fed
through `qv`; a trial call, not the build flags, decides whether it runs.

Every probe is cached: the answers cannot change within a process.
"""

from __future__ import annotations

import functools
import logging
from types import ModuleType
from typing import Any

logger = logging.getLogger(__name__)

FA3_INSTALL_HINT = "pip install tokenspeed-fa3"
# The build flag that removes the (64, 512)-style pairs MLA needs; both spellings have been used.
_HDIMDIFF64_FLAGS = ("FLASH_ATTENTION_DISABLE_HDIMDIFF64", "FLASHATTENTION_DISABLE_HDIMDIFF64")


@functools.lru_cache(maxsize=1)
def _import_fa3() -> tuple[ModuleType | None, str | None]:
    """(module, None) when `flash_attn_interface` imports, else (None, why)."""
    try:
        import flash_attn_interface
    except Exception as e:  # noqa: BLE001 - ImportError, or OSError from a .so built for another torch/CUDA
        return None, f"{type(e).__name__}: {e}"
    return flash_attn_interface, None


def fa3_module() -> ModuleType:
    """The imported `flash_attn_interface` module.

    Raises:
        ImportError: it cannot be imported (the message says why and how to install it).
    """
    module, err = _import_fa3()
    if module is None:
        raise ImportError(f"flash_attn_interface cannot be imported ({err}); {FA3_INSTALL_HINT}")
    return module


def fa3_importable() -> bool:
    """Whether `flash_attn_interface` imports (loads its CUDA extension; needs no GPU)."""
    return _import_fa3()[0] is not None


@functools.lru_cache(maxsize=1)
def fa3_unavailable_reason() -> str | None:
    """Why FA3 cannot run on this machine, or None when it can (CUDA, compute capability 9.x,
    `flash_attn_interface` importable)."""
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return f"compute capability {major}.{minor}; FlashAttention-3 needs Hopper (9.x)"
    module, err = _import_fa3()
    if module is None:
        return f"flash_attn_interface cannot be imported ({err}); {FA3_INSTALL_HINT}"
    return None


def can_use_fa3() -> bool:
    """CUDA, compute capability 9.x, and `flash_attn_interface` importable."""
    return fa3_unavailable_reason() is None


def fa3_build_flags() -> dict[str, Any]:
    """The wheel's `flash_attn_config.CONFIG["build_flags"]` ({} when the wheel has none)."""
    try:
        from flash_attn_config import CONFIG
    except ImportError:
        return {}
    return dict(CONFIG.get("build_flags", {}))


@functools.lru_cache(maxsize=8)
def fa3_supports_mla(qk_rope_head_dim: int = 64, kv_lora_rank: int = 512) -> bool:
    """Whether this FA3 build runs absorbed MLA: q/k head dim `qk_rope_head_dim` with a `qv`
    and v head dim of `kv_lora_rank` (DeepSeek: 64 and 512).

    False without FA3; otherwise a one-token trial call decides (it initialises CUDA in the
    calling process) and checks the values, not only that the call returns: the
    `tokenspeed-fa3` wheel (3.0.0.post20260810) sets `FLASH_ATTENTION_DISABLE_HDIMDIFF64`,
    yet the 64/512 `qv` call runs on an H200 and returns wrong values (seen 2026-11-30),
    so this answers False there. The answer is cached.
    """
    if not can_use_fa3():
        return False
    flags = fa3_build_flags()
    disabled = [name for name in _HDIMDIFF64_FLAGS if flags.get(name)]
    if disabled:
        logger.info("FlashAttention-3 build has %s set; trying head dims %d/%d through qv anyway",
                    disabled[0], qk_rope_head_dim, kv_lora_rank)
    ok, why = _mla_trial_call(qk_rope_head_dim, kv_lora_rank)
    if not ok:
        logger.info("FlashAttention-3 MLA trial call (head dims %d/%d) failed: %s",
                    qk_rope_head_dim, kv_lora_rank, why)
    return ok


def _mla_trial_call(rope: int, rank: int) -> tuple[bool, str]:
    """A small paged MLA decode (2 requests of 3 and 5 tokens over pages of 2, 16 heads, random
    q / qv / cache) checked against `flash_attn_with_kvcache_reference` at bf16 tolerance: a
    kernel that runs but miscomputes the q.k or qv.v scores fails it."""
    import torch

    from hiserve.layers.attention.fa3_reference import flash_attn_with_kvcache_reference

    fa3 = fa3_module()
    dev, dt = torch.device("cuda"), torch.bfloat16
    gen = torch.Generator(device=dev).manual_seed(0)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen, device=dev).to(dt)

    heads, page = 16, 2
    args = dict(
        q=rand(2, 1, heads, rope), qv=rand(2, 1, heads, rank),
        k_cache=rand(8, page, 1, rope), v_cache=rand(8, page, 1, rank),
        cache_seqlens=torch.tensor([3, 5], dtype=torch.int32, device=dev),
        page_table=torch.tensor([[5, 2, 0], [1, 7, 3]], dtype=torch.int32, device=dev),
        softmax_scale=(rope + rank) ** -0.5, causal=True)
    try:
        out = fa3.flash_attn_with_kvcache(**args)
        if isinstance(out, tuple):
            out = out[0]
        torch.cuda.synchronize()
    except (RuntimeError, ValueError, AssertionError, TypeError) as e:
        return False, f"{type(e).__name__}: {e}"
    ref = flash_attn_with_kvcache_reference(**args)
    err = (out.float() - ref.float()).abs().max().item()
    scale = ref.float().abs().max().item()
    if out.shape != ref.shape or not err <= 2e-2 * scale + 1e-3:
        return False, f"wrong values (max abs error {err:.3g} against the torch reference, scale {scale:.3g})"
    return True, ""
