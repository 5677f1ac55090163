"""Fixtures shared by the CPU unit tests."""

from __future__ import annotations

import pytest

from hiserve.jit_kernel import cpu as cpu_kernels


@pytest.fixture
def amx():
    """Skip a test of an AMX kernel where it cannot run: no C++ toolchain for the JIT CPU
    kernels, or a CPU without AMX (their code is AMX instructions only; CI machines vary).
    Checked in the test, not at collection: building the module at collection costs every run."""
    if not cpu_kernels.can_use_cpu_kernels():
        pytest.skip("JIT CPU kernels do not build here")
    if not cpu_kernels.amx_gemm_available():
        pytest.skip(f"no AMX here (kernel ISA {cpu_kernels.detect_cpu().isa})")
