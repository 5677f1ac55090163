"""The CPU decode loop (`hiserve/models/cpu_decode_loop.py`) against the modules it stands in
for, on the real default model: every DECODE pass of a scheduler run is computed both ways and
must give bit-identical hidden states (same kernels, same arguments), across the GGUF bf16
default and float32, page sizes 1 and 16, ragged batches that grow and shrink; passes it must
not take (EXTEND, another attention backend) run the modules; HISERVE_CPU_DECODE_LOOP=0 keeps
it off."""

from __future__ import annotations

import pytest
import torch

from hiserve.engine.io_struct import TokenizedGenerateReqInput
from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.scheduler import Scheduler
from hiserve.jit_kernel import cpu as cpu_kernels
from hiserve.models.cpu_decode_loop import CpuDecodeLoop
from hiserve.server_args import ServerArgs

pytestmark = pytest.mark.skipif(not cpu_kernels.can_use_cpu_kernels(), reason="CPU kernels cannot be built here")


def make(**kw) -> Scheduler:
    """A scheduler of `make serve` defaults on the CPU (plus `kw`), cache integrity checked."""
    return Scheduler(ServerArgs(device="cpu", max_total_tokens=4096, enable_cache_integrity_check=True,
                                **kw).resolve(), None)


class Compare:
    """Wraps a LlamaModel's forward: a pass the loop takes is run through the modules (loop
    detached) and then the loop, and the two hidden states must be equal bit for bit. The loop
    runs second, so the K/V later passes read are the ones it stored."""

    def __init__(self, inner):
        self.inner, self.loop, self.forward = inner, inner.decode_loop, inner.forward
        self.loop_passes = self.module_passes = 0
        inner.forward = self

    def __call__(self, input_ids, positions, fb):
        self.inner.decode_loop = None
        try:
            want = self.forward(input_ids, positions, fb)
        finally:
            self.inner.decode_loop = self.loop
        got = self.loop.forward(input_ids, positions, fb)
        if got is None:
            self.module_passes += 1
            assert not fb.forward_mode.is_decode() or self.loop.kernel_args(fb) is None
            return want
        self.loop_passes += 1
        assert fb.forward_mode.is_decode()
        assert got.dtype == want.dtype and torch.equal(got, want), "decode loop differs from the modules"
        return got


def submit(sched: Scheduler, tag: str, prompts: list[list[int]], max_new: list[int]) -> None:
    """Greedy requests `{tag}{i}` with ignore_eos, so each makes exactly max_new[i] tokens."""
    for i, (ids, n) in enumerate(zip(prompts, max_new)):
        sched.add_request(TokenizedGenerateReqInput(
            rid=f"{tag}{i}", input_ids=ids,
            sampling_params=SamplingParams(max_new_tokens=n, temperature=0, ignore_eos=True)))


def step(sched: Scheduler, limit: int = 2000) -> dict[str, list[int]]:
    """Up to `limit` iterations (until idle); the streamed ids of each request."""
    for _ in range(limit):
        if not sched.has_work():
            break
        sched.step()  # the overlap scheduler's iteration too
    outs: dict[str, list[int]] = {}
    for msg in sched.outbox:
        for rid, ids in zip(getattr(msg, "rids", []), getattr(msg, "new_output_ids", [])):
            outs.setdefault(rid, []).extend(ids)
    sched.outbox.clear()
    return outs


PROMPTS = [[1000 + (7 * i + j) % 5000 for j in range(n)] for i, n in enumerate((5, 37, 130, 64, 300))]


@pytest.mark.parametrize("flags", [{}, {"dtype": "float32"}, {"page_size": 16}, {"quantization": "none"}],
                         ids=["gguf-bf16-default", "float32", "page16", "dense-bf16"])
def test_loop_equals_modules_on_every_decode_pass(flags):
    sched = make(**flags)
    inner = sched.model_runner.model.model
    assert isinstance(inner.decode_loop, CpuDecodeLoop)
    cmp = Compare(inner)
    # Two requests decode a few steps, three more join them (the batch grows), requests finish
    # at different steps (it shrinks).
    submit(sched, "a", PROMPTS[:2], [9, 3])
    outs = step(sched, 4)
    submit(sched, "b", PROMPTS[2:], [12, 5, 8])
    for rid, ids in step(sched).items():
        outs.setdefault(rid, []).extend(ids)
    assert cmp.loop_passes >= 12 and cmp.module_passes >= 2  # decode passes looped, prefills not
    assert {rid: len(ids) for rid, ids in outs.items()} == {"a0": 9, "a1": 3, "b0": 12, "b1": 5, "b2": 8}
    sched.kv.check_integrity()
    assert sched.flush_cache()
    sched.kv.check_integrity()


def test_other_backend_and_env_switch_keep_the_modules(monkeypatch):
    sched = make(attention_backend="torch_native")
    inner = sched.model_runner.model.model
    cmp = Compare(inner)  # attached, but no pass may take it: torch_native runs the attention
    submit(sched, "a", PROMPTS[:2], [4, 4])
    step(sched)
    assert cmp.loop_passes == 0 and cmp.module_passes >= 4  # a prefill, 3 decodes
    sched.kv.check_integrity()

    monkeypatch.setenv("HISERVE_CPU_DECODE_LOOP", "0")
    sched = make(dtype="float32")
    assert sched.model_runner.model.model.decode_loop is None
    submit(sched, "a", PROMPTS[:1], [3])
    assert len(step(sched)["a0"]) == 3
    sched.kv.check_integrity()


@pytest.mark.parametrize("flags", [{}, {"enable_overlap_schedule": True},
                                   {"prefill_attention_backend": "torch_native", "decode_attention_backend": "cpu_paged"}],
                         ids=["default", "overlap", "hybrid"])
def test_served_tokens_equal_with_the_loop_off(monkeypatch, flags):
    """Through the model's own dispatch (LlamaModel.forward): the same greedy tokens with the
    loop on as with HISERVE_CPU_DECODE_LOOP=0, and the loop took the decode passes."""
    taken = []
    forward = CpuDecodeLoop.forward

    def counted(self, *a):
        out = forward(self, *a)
        taken.append(out is not None)
        return out

    monkeypatch.setattr(CpuDecodeLoop, "forward", counted)
    outs = {}
    for env in ("1", "0"):
        monkeypatch.setenv("HISERVE_CPU_DECODE_LOOP", env)
        sched = make(dtype="float32", **flags)
        submit(sched, "a", PROMPTS[:3], [10, 4, 7])
        outs[env] = step(sched)
        sched.kv.check_integrity()
    assert outs["1"] == outs["0"] and sum(len(v) for v in outs["0"].values()) == 21
    assert sum(taken) >= 9 and not all(taken)  # decode passes looped, prefills not (loop off: no calls)


def test_bindings_refuse_shapes_they_would_index_past():
    """The loop calls the C++ bindings without the Python wrappers' checks: the bindings
    themselves must refuse a shape that would read or write out of bounds."""
    m = cpu_kernels.load_cpu_module()
    x, w = torch.randn(4, 64), torch.ones(64)
    with pytest.raises(Exception, match="weight must be"):
        m.rmsnorm(x, x, torch.ones(32), torch.empty(4, 64), x, False, 1e-6, 1)
    with pytest.raises(Exception, match="residual"):
        m.rmsnorm(x, torch.randn(2, 64), w, torch.empty(4, 64), torch.empty(4, 64), True, 1e-6, 1)
    cos = torch.ones(2, 1, 32)
    with pytest.raises(Exception, match="cos/sin"):
        m.rotary(torch.randn(4, 3, 64), cos, cos, torch.empty(4, 3, 64), 64, True, 1)
    with pytest.raises(Exception, match="out"):
        m.silu_and_mul(torch.randn(4, 128), torch.empty(2, 64), 1)
    k = torch.zeros(8, 1, 64)
    one, starts = torch.zeros(1, dtype=torch.int64), torch.tensor([0, 1])
    r2t = torch.zeros(1, 8, dtype=torch.int32)
    with pytest.raises(Exception, match="out"):
        m.paged_attention(torch.randn(1, 64), k, k, torch.empty(1, 32), r2t, one, one + 1, starts, one, one, one,
                          False, 1, 1, 1.0, 1)
    with pytest.raises(Exception, match="int64"):
        m.paged_attention(torch.randn(1, 64), k, k, torch.empty(1, 64), r2t, one.int(), one + 1, starts, one, one,
                          one, False, 1, 1, 1.0, 1)
