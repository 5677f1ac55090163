"""Shared set-up for Triton kernel tests: import it before any kernel module.

Without a GPU it sets TRITON_INTERPRET=1 (kernels then run on CPU tensors in Triton's
interpreter) and works around an interpreter bug; importing it skips the importing test
module when triton is not installed. Exports INTERPRET and DEVICE ("cpu" or "cuda").
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

INTERPRET = bool(triton.knobs.runtime.interpret)
DEVICE = "cpu" if INTERPRET else "cuda"


@triton.jit
def _runtime_bound_loop(Bound, Out):
    n = tl.load(Bound)
    acc = 0
    for i in range(0, n, 2):
        acc += i
    tl.store(Out, acc)


def _fix_interpreter_runtime_loop_bounds() -> None:
    """Triton 3.6's interpreter turns a kernel scalar used as a `range` bound into a Python
    int with `int(ndarray)` on a 1-element array, which NumPy >= 2.4 refuses
    (triton-lang/triton#9171). Patch that one conversion, only when a probe shows the bug."""
    out = torch.zeros(1, dtype=torch.int64)
    try:
        _runtime_bound_loop[(1,)](torch.tensor([5]), out)
        return
    except triton.runtime.errors.InterpreterError as e:
        if "0-dimensional" not in str(e):
            raise
    from triton.runtime import interpreter

    patch_tensor = interpreter._patch_lang_tensor

    def patched(tensor, scope):
        patch_tensor(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched
    _runtime_bound_loop[(1,)](torch.tensor([5]), out)
    assert out.item() == 0 + 2 + 4


if INTERPRET:
    _fix_interpreter_runtime_loop_bounds()
