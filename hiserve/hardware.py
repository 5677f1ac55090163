"""What the machine offers the engine (its `Platform`), detected once: the device, its compute
capability, whether FlashAttention-3 can run (for MLA too), the CPU's vector features, and
the cores this process may use.

`ServerArgs.resolve()` takes its defaults and checks from a `Platform`; tests build one by
hand to check the rules of a machine they are not on. (Not named `platform.py`: with
`hiserve/` on sys.path that would shadow the standard library's module.)
"""

from __future__ import annotations

import functools
import logging
import math
import os
from dataclasses import dataclass, field

logger = logging.getLogger(__name__)

# x86 feature flags that change a kernel or dtype choice, by their /proc/cpuinfo names.
CPU_FEATURES = ("amx_bf16", "amx_tile", "avx512_bf16", "avx512_vnni", "avx512f", "avx512bw", "avx512vl",
                "avx512dq", "avx2", "fma", "f16c")


@dataclass(frozen=True)
class CpuInfo:
    """The CPU's vector features, read once.

    Attributes:
        model_name: /proc/cpuinfo's "model name" ("" when unknown).
        features: the subset of `CPU_FEATURES` present.
    """

    model_name: str = ""
    features: frozenset[str] = field(default_factory=frozenset)

    @property
    def isa(self) -> str:
        """The instruction-set tier the CPU kernels are compiled for: "amx" (AVX512-BF16 and AMX
        bf16 tiles), "avx512_bf16" (AVX-512 with native bf16 dot products), "avx512", "avx2" or
        "baseline". Each tier's instructions include the ones below it."""
        f = self.features
        if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= f:
            if "avx512_bf16" not in f:
                return "avx512"
            return "amx" if {"amx_tile", "amx_bf16"} <= f else "avx512_bf16"
        if {"avx2", "fma"} <= f:
            return "avx2"
        return "baseline"

    @property
    def has_native_bf16(self) -> bool:
        """bf16 dot products in hardware (AVX512-BF16 or AMX): bf16 matmuls beat float32."""
        return "avx512_bf16" in self.features or "amx_bf16" in self.features

    def describe(self) -> str:
        """One line for logs: model, tier and the features that matter."""
        flags = ",".join(x for x in ("amx_bf16", "avx512_bf16", "avx512_vnni", "avx512f", "avx2") if x in self.features)
        return f"{self.model_name or 'unknown CPU'} (kernel ISA {self.isa}; {flags or 'no AVX2'})"


@functools.lru_cache(maxsize=None)
def detect_cpu() -> CpuInfo:
    """Read the CPU's features from /proc/cpuinfo (Linux); elsewhere ask torch for its
    vector capability ("AVX512" / "AVX2" / "DEFAULT"), which names no bf16 features."""
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        text = ""
    flags: set[str] = set()
    model = ""
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "flags" and not flags:
            flags = set(value.split())
        elif key == "model name" and not model:
            model = value.strip()
    if not flags:
        import torch

        cap = torch.backends.cpu.get_cpu_capability()
        if cap.startswith("AVX512"):
            flags = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}
        elif cap == "AVX2":
            flags = {"avx2", "fma", "f16c"}
    return CpuInfo(model, frozenset(flags & set(CPU_FEATURES)))


def _cgroup_cpu_limit(root: str = "/sys/fs/cgroup") -> float | None:
    """CPUs granted by cgroup v2 quotas ("quota period" in cpu.max) on this process's cgroup
    and its ancestors (the tightest wins), or None when none is set or cgroup v2 is absent."""
    try:
        with open("/proc/self/cgroup") as f:
            rel = next((ln.strip()[3:] for ln in f if ln.startswith("0::")), "/")
    except OSError:
        rel = "/"
    limit = None
    parts = [p for p in rel.split("/") if p]
    for depth in range(len(parts), -1, -1):
        try:
            with open(os.path.join(root, *parts[:depth], "cpu.max")) as f:
                quota, period = f.read().split()[:2]
        except (OSError, ValueError):
            continue
        if quota != "max":
            cpus = int(quota) / int(period)
            limit = cpus if limit is None else min(limit, cpus)
    return limit


def usable_cpu_count() -> int:
    """Cores this process may compute on: its CPU affinity, capped by a cgroup v2 cpu.max
    quota (rounded up: a quota of 1.5 CPUs still runs two threads usefully), at least 1."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        n = os.cpu_count() or 1
    limit = _cgroup_cpu_limit()
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


@dataclass(frozen=True)
class Platform:
    """Attributes:
        device_type: "cuda" when a CUDA device is visible, else "cpu".
        compute_capability: (major, minor) of CUDA device 0; None on the CPU.
        fa3_importable: `flash_attn_interface` imports.
        fa3_mla: the FA3 build runs absorbed MLA for the model's head dims (False when not
            probed: only an MLA model on Hopper is, and only when fa3 may be chosen).
        triton_importable: `triton` imports (the `triton` backend's kernels).
        cpu: the CPU's vector features (`detect_cpu()`; empty when built by hand).
    """

    device_type: str
    compute_capability: tuple[int, int] | None = None
    fa3_importable: bool = False
    fa3_mla: bool = False
    triton_importable: bool = True
    cpu: CpuInfo = field(default_factory=CpuInfo)

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
            return f"CPU only: {self.cpu.describe()}"
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
        return Platform("cpu", cpu=detect_cpu())
    from hiserve.layers.attention.fa3_probe import fa3_importable, fa3_supports_mla

    capability = tuple(torch.cuda.get_device_capability())
    importable = fa3_importable()
    mla = False
    if mla_head_dims is not None and capability[0] == 9 and importable:
        mla = fa3_supports_mla(*mla_head_dims)
    import importlib.util

    triton = importlib.util.find_spec("triton") is not None
    return Platform("cuda", (int(capability[0]), int(capability[1])), importable, mla, triton, detect_cpu())


def cpu_compute_threads() -> tuple[int, str]:
    """Threads for the engine's CPU compute and why: OMP_NUM_THREADS when the user set it (a
    positive integer), else `usable_cpu_count()`."""
    env = os.environ.get("OMP_NUM_THREADS", "")
    if env.isdigit() and int(env) > 0:
        return int(env), "OMP_NUM_THREADS"
    return usable_cpu_count(), "CPU affinity and cgroup quota"
