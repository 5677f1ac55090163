"""What the machine offers the engine (its `Platform`), detected once: the device, its compute
capability, and whether FlashAttention-3 can run (for MLA too).

`ServerArgs.resolve()` takes its defaults and checks from a `Platform`; tests build one by
hand to check the rules of a machine they are not on. (Not named `platform.py`: with
`hiserve/` on sys.path that would shadow the standard library's module.)
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Platform:
    """Attributes:
        device_type: "cuda" when a CUDA device is visible, else "cpu".
        compute_capability: (major, minor) of CUDA device 0; None on the CPU.
        fa3_importable: `flash_attn_interface` imports.
        fa3_mla: the FA3 build runs absorbed MLA for the model's head dims (False when not
            probed: only an MLA model on Hopper is, and only when fa3 may be chosen).
        triton_importable: `triton` imports (the `triton` backend's kernels).
    """

    device_type: str
    compute_capability: tuple[int, int] | None = None
    fa3_importable: bool = False
    fa3_mla: bool = False
    triton_importable: bool = True

    @property
    def is_hopper(self) -> bool:
        """Compute capability 9.x (H100, H200)."""
        return self.compute_capability is not None and self.compute_capability[0] == 9

    @property
    def can_use_fa3(self) -> bool:
        """CUDA, compute capability 9.x, and `flash_attn_interface` importable."""
        return self.device_type == "cuda" and self.is_hopper and self.fa3_importable

    def describe(self) -> str:
        """One line for logs and error messages."""
        if self.device_type != "cuda":
            return "CPU only"
        cc = "?" if self.compute_capability is None else "%d.%d" % self.compute_capability
        fa3 = "importable" if self.fa3_importable else "not importable"
        return f"CUDA compute capability {cc}, flash_attn_interface {fa3}"


def detect_platform(mla_head_dims: tuple[int, int] | None = None) -> Platform:
    """Probe this machine; returns its `Platform` (CPU-only when no CUDA device is visible).

    Args:
        mla_head_dims: (qk_rope_head_dim, kv_lora_rank) of an MLA model, to probe FA3's MLA
            kernel (a trial call on the GPU where the build flags allow it); None: not probed.
    """
    import torch

    if not torch.cuda.is_available():
        return Platform("cpu")
    from hiserve.layers.attention.fa3_probe import fa3_importable, fa3_supports_mla

    capability = tuple(torch.cuda.get_device_capability())
    importable = fa3_importable()
    mla = False
    if mla_head_dims is not None and capability[0] == 9 and importable:
        mla = fa3_supports_mla(*mla_head_dims)
    import importlib.util

    triton = importlib.util.find_spec("triton") is not None
    return Platform("cuda", (int(capability[0]), int(capability[1])), importable, mla, triton)
