"""Shared pieces of the GPU benchmarks: server args for in-process runs, synthetic decode
batches over a filled KV pool, timing, the copy-bandwidth limit, and the JSON record.

Byte counts end in `_bytes`; times are milliseconds (`_ms`) unless named `_s`.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from hiserve.engine.model_runner import ModelRunner  # noqa: E402
from hiserve.engine.sampling_params import SamplingParams  # noqa: E402
from hiserve.engine.schedule_batch import Req, ScheduleBatch  # noqa: E402
from hiserve.layers.forward_batch import ForwardMode  # noqa: E402
from hiserve.server_args import ServerArgs  # noqa: E402


def make_server_args(**fields: Any) -> tuple[ServerArgs, list[str]]:
    """Resolved ServerArgs from `fields`; fields this checkout's ServerArgs lacks (e.g. CUDA-graph
    flags before they exist) are left out and named in the returned list, which the
    benchmarks record, so a result never silently claims a setting it did not have."""
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    missing = sorted(k for k in fields if k not in known)
    args = ServerArgs(**{k: v for k, v in fields.items() if k in known}).resolve()
    return args, missing


def graph_runner_of(runner: ModelRunner) -> Any:
    """The runner's CUDA-graph runner object, or None (CPU, disabled, or not implemented)."""
    for name in ("cuda_graph_runner", "graph_runner"):
        obj = getattr(runner, name, None)
        if obj is not None:
            return obj
    return None


def fill_kv_pool(runner: ModelRunner, seed: int = 0) -> None:
    """Random O(1) values in every device KV buffer (decode reads them; zeros would do for
    timing, but finite non-trivial values keep the attention math representative)."""
    gen = torch.Generator(device=runner.device).manual_seed(seed)
    for buf in runner.token_to_kv_pool.buffers():
        buf.normal_(0.0, 1.0, generator=gen)


@dataclasses.dataclass
class DecodeBatch:
    """A DECODE batch of `batch_size` requests with `context_len` tokens each (the new token is
    the last one, position context_len - 1), and the device slots its requests hold."""

    batch: ScheduleBatch
    slots: torch.Tensor  # [batch_size, context_len] int64 device slots
    rows: list[int]  # req_to_token rows


def make_decode_batch(runner: ModelRunner, batch_size: int, context_len: int, seed: int = 0) -> DecodeBatch:
    """Allocate rows and whole pages for `batch_size` requests of `context_len` tokens and
    build the decode batch that reads all of them. Replaying it rewrites the same new-token
    slot each time, so it can be timed any number of times.

    Raises:
        ValueError: context_len is not a multiple of the page size.
        RuntimeError: the pools are too small.
    """
    if context_len % runner.page_size:
        raise ValueError(f"context_len {context_len} must be a multiple of page_size {runner.page_size}")
    rows = runner.req_to_token_pool.alloc(batch_size)
    slots = runner.token_to_kv_pool_allocator.alloc(batch_size * context_len)
    if rows is None or slots is None:
        raise RuntimeError(f"pools too small for {batch_size} x {context_len} tokens")
    slots = slots.view(batch_size, context_len)
    dev = runner.device
    rows_t = torch.tensor(rows, dtype=torch.int64, device=dev)
    for row, row_slots in zip(rows, slots):
        runner.req_to_token_pool.write(row, 0, row_slots)
    runner.req_to_token_pool.flush()
    gen = torch.Generator().manual_seed(seed)
    vocab = runner.vocab_size
    prompts = torch.randint(10, vocab, (batch_size, context_len), generator=gen).tolist()
    sp = SamplingParams(max_new_tokens=1 << 20, temperature=0, ignore_eos=True)
    reqs = []
    for i, ids in enumerate(prompts):
        req = Req(f"bench{i}", ids[:-1], sp, False, 1 << 20, set())
        req.output_ids = [ids[-1]]
        req.kv.row = rows[i]
        reqs.append(req)
    seq_lens = [context_len] * batch_size
    batch = ScheduleBatch(
        reqs=reqs, forward_mode=ForwardMode.DECODE,
        input_ids=torch.tensor([p[-1] for p in prompts], dtype=torch.int64, device=dev),
        positions=torch.full((batch_size,), context_len - 1, dtype=torch.int64, device=dev),
        out_cache_loc=slots[:, -1].contiguous().to(dev), req_pool_indices=rows_t,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev), seq_lens_cpu=seq_lens,
        extend_seq_lens_cpu=[1] * batch_size, extend_prefix_lens_cpu=[context_len - 1] * batch_size)
    return DecodeBatch(batch, slots, rows)


def release_decode_batch(runner: ModelRunner, db: DecodeBatch) -> None:
    runner.token_to_kv_pool_allocator.free(db.slots.reshape(-1))
    runner.req_to_token_pool.free(db.rows)


def time_ms(fn: Callable[[], Any], device: torch.device, reps: int, warmup: int = 2) -> list[float]:
    """Per-call time of `fn` in ms, `reps` samples after `warmup` calls: CUDA events on the
    current stream (including the host's launch work between them), wall clock on the CPU."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in events]


def copy_bandwidth_bytes_per_s(device: torch.device, nbytes: int, reps: int = 10) -> dict[str, float]:
    """Device-to-device `copy_` of `nbytes`: HBM traffic (read + write = 2 x nbytes) per
    second, the limit a decode step (which almost only reads) is compared with.

    Returns {"copy_bytes", "copy_ms", "hbm_bytes_per_s"}.
    """
    n = max(1, nbytes // 2) * 2
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    src.random_(0, 255)
    ms = statistics.median(time_ms(lambda: dst.copy_(src), device, reps))
    del src, dst
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return {"copy_bytes": n, "copy_ms": ms, "hbm_bytes_per_s": 2 * n / (ms * 1e-3)}


def cpu_model() -> str:
    """The host CPU's model name (/proc/cpuinfo; platform.processor() elsewhere)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def machine_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
                            "cpu_count": os.cpu_count(), "cpu_model": cpu_model(), "device": str(device)}
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        info.update(gpu=props.name, gpu_memory_bytes=props.total_memory, sm_count=props.multi_processor_count,
                    torch_cuda=torch.version.cuda)
    return info


def base_record(device: torch.device, args: Any) -> dict[str, Any]:
    return {"command": " ".join([Path(sys.executable).name, *sys.argv]),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": machine_info(device), "settings": dict(vars(args))}


def write_record(record: dict[str, Any], out_dir: str, name: str) -> Path:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{name}.json"
    path.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {path}")
    return path
