"""Portable CPU tuning: feature tiers, the usable-core count (affinity, cgroup v2 quota),
the dtype picked from the features, the kernels' compile flags, and the thread split between
the API and scheduler processes."""

from __future__ import annotations

import pytest

from hiserve import hardware, launch_server
from hiserve.hardware import CpuInfo, Platform
from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.server_args import ServerArgs

AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}


@pytest.mark.parametrize("features, isa, bf16", [
    (AVX512 | {"avx512_bf16", "amx_bf16", "amx_tile", "avx512_vnni"}, "amx", True),  # Sapphire Rapids
    (AVX512 | {"avx512_bf16", "avx512_vnni"}, "avx512_bf16", True),  # Zen 4/5
    (AVX512 | {"avx512_vnni"}, "avx512", False),  # Cascade Lake
    ({"avx2", "fma", "f16c"}, "avx2", False),
    (set(), "baseline", False),
])
def test_isa_tier_and_native_bf16(features, isa, bf16):
    cpu = CpuInfo("x", frozenset(features))
    assert cpu.isa == isa and cpu.has_native_bf16 == bf16
    assert isa in cpu.describe()
    assert "-march=native" not in cpu_kernels.ISA_FLAGS[isa]


def test_detect_cpu_reads_this_machine():
    cpu = hardware.detect_cpu()
    assert cpu.features <= set(hardware.CPU_FEATURES)
    assert cpu.isa in cpu_kernels.ISA_FLAGS


@pytest.mark.parametrize("content, expected", [("150000 100000\n", 1.5), ("max 100000\n", None), ("200000 100000", 2.0)])
def test_cgroup_quota(tmp_path, content, expected):
    (tmp_path / "cpu.max").write_text(content)
    assert hardware._cgroup_cpu_limit(str(tmp_path)) == expected


def test_cgroup_absent(tmp_path):
    assert hardware._cgroup_cpu_limit(str(tmp_path / "none")) is None


@pytest.mark.parametrize("affinity, quota, expected", [(8, None, 8), (8, 1.5, 2), (8, 0.5, 1), (2, 4.0, 2)])
def test_usable_cpu_count(monkeypatch, affinity, quota, expected):
    monkeypatch.setattr(hardware.os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(hardware, "_cgroup_cpu_limit", lambda: quota)
    assert hardware.usable_cpu_count() == expected


def test_scheduler_threads_follow_omp_num_threads_else_usable_cores(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert launch_server.scheduler_threads() == (3, "OMP_NUM_THREADS")
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(hardware, "usable_cpu_count", lambda: 5)  # read through cpu_compute_threads
    assert launch_server.scheduler_threads()[0] == 5


@pytest.mark.parametrize("features, dtype", [(AVX512 | {"avx512_bf16"}, "bfloat16"), (AVX512, "float32"),
                                             ({"avx2", "fma"}, "float32")])
def test_cpu_dtype_auto_follows_features(features, dtype, caplog):
    caplog.set_level("INFO")
    args = ServerArgs(device="cpu").resolve(platform=Platform("cpu", cpu=CpuInfo("x", frozenset(features))))
    assert args.dtype == dtype
    assert args.attention_backend == "cpu_paged"
    assert any("--dtype auto" in r.getMessage() for r in caplog.records)


def test_cpu_paged_needs_the_cpu():
    with pytest.raises(ValueError, match="CPU only"):
        ServerArgs(device="cuda", attention_backend="cpu_paged").resolve(platform=Platform("cuda", (9, 0)))


def test_unbuildable_kernels_warn_once_and_fall_back(monkeypatch, caplog):
    from hiserve.jit_kernel import utils

    monkeypatch.setenv("HISERVE_CPU_KERNELS", "0")
    cpu_kernels.cpu_kernels_unavailable_reason.cache_clear()
    monkeypatch.setattr(utils, "_warned", set())
    try:
        caplog.set_level("WARNING")
        assert not cpu_kernels.can_use_cpu_kernels() and not cpu_kernels.can_use_cpu_kernels()
        warnings = [r for r in caplog.records if "CPU kernels unavailable" in r.getMessage()]
        assert len(warnings) == 1 and "HISERVE_CPU_KERNELS=0" in warnings[0].getMessage()
    finally:
        monkeypatch.delenv("HISERVE_CPU_KERNELS")
        cpu_kernels.cpu_kernels_unavailable_reason.cache_clear()
