"""Scheduler-level timings of `make serve` defaults, in process (no HTTP), for A/Bs across commits.

Builds the scheduler as the server does (`ServerArgs(device="cpu").resolve()`: GGUF int4 with the
dense dispatch, bf16 (float32 on a CPU without native bf16), cpu_paged) and drives it directly:

- single: one request of 200 prompt tokens and 64 output tokens, 5 times; the median decode
  step (schedule + forward + sample + output) and the 200-token prefill step.
- shared-prefix: scenario (c) of benchmark/cpu/scenarios.py in a closed loop: 32 chat requests
  sharing a ~1000-token system prompt with ~50-token questions, 8 in flight, 32 output tokens,
  ignore_eos; a request arrives when one finishes. TTFT = arrival to the step that emits its
  first token (streaming), so HTTP and tokenizer time are left out.

`--batch 16`: also the median decode step with 16 requests running (scenario (b) at c=16).
`--dtype` / `--quantization`: as the server's flags, for an A/B of the defaults on one CPU.

Times are process CPU time by default (with OMP_NUM_THREADS=1 on a shared machine they leave
out the time other jobs hold the core); `--clock wall` for a quiet machine. To compare two
commits, run the script with PYTHONPATH pointing at each checkout in turn.

    OMP_NUM_THREADS=1 PYTHONPATH=$PWD python benchmark/cpu/bench_scheduler_steps.py [--out x.json]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

from hiserve.engine.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput
from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.scheduler import Scheduler
from hiserve.server_args import ServerArgs

WORDS = ("alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "seven", "blue", "market")


class Driver:
    """A scheduler without sockets, stepped by hand; `clock` times the steps."""

    def __init__(self, clock, **flags):
        self.sched = Scheduler(ServerArgs(device="cpu", **flags).resolve(), None)
        self.clock = clock
        self._rid = 0

    def submit(self, ids: list[int], max_new: int) -> str:
        self._rid += 1
        rid = f"r{self._rid}"
        self.sched.add_request(TokenizedGenerateReqInput(
            rid=rid, input_ids=ids, stream=True,
            sampling_params=SamplingParams(max_new_tokens=max_new, temperature=0, ignore_eos=True)))
        return rid

    def step(self) -> tuple[bool, float, list[tuple[str, bool]]]:
        """One iteration: (was it a prefill, ms, [(rid, finished)] of the outputs it emitted)."""
        s = self.sched
        start = self.clock()
        batch = s.get_next_batch_to_run()
        s.run_batch(batch)
        s.check_cache_events()
        ms = (self.clock() - start) * 1e3
        out = [(rid, fin is not None) for msg in s.outbox if isinstance(msg, BatchTokenIDOut)
               for rid, fin in zip(msg.rids, msg.finished_reasons)]
        s.outbox.clear()
        return batch.forward_mode.is_extend(), ms, out

    def busy(self) -> bool:
        s = self.sched
        return bool(s.waiting_queue or s.running or s.chunked_req)


def single_stream(d: Driver, repeats: int) -> dict:
    """Median decode step and 200-token prefill of one request, over `repeats` requests."""
    decode, prefill = [], []
    for i in range(repeats + 1):
        d.submit(list(range(1000, 1200)), 64)
        steps = []
        while d.busy():
            steps.append(d.step()[:2])
        d.sched.flush_cache()
        if i:  # the first request warms up
            decode.append(statistics.median(ms for ext, ms in steps if not ext))
            prefill.append(next(ms for ext, ms in steps if ext))
    return {"decode_step_ms": statistics.median(decode), "prefill_200_ms": statistics.median(prefill),
            "decode_samples_ms": decode, "prefill_samples_ms": prefill}


def batched_decode(d: Driver, batch: int = 16, prompt: int = 300, out: int = 64) -> dict:
    """Median decode step with `batch` requests running (scenario (b) at concurrency 16)."""
    for i in range(batch):
        d.submit([1000 + (i * 7 + j) % 20000 for j in range(prompt)], out)
    steps = []
    while d.busy():
        ext, ms, _ = d.step()
        if not ext and len(d.sched.running) == batch:
            steps.append(ms)
    d.sched.flush_cache()
    return {"batch": batch, "decode_step_ms": statistics.median(steps), "steps": len(steps)}


def run_closed_loop(d: Driver, prompts: list[list[int]], concurrency: int, out: int) -> tuple[list[float], list[float]]:
    """Serve `prompts` with `concurrency` in flight, the next arriving when one finishes (`out`
    output tokens each, ignore_eos). Returns (every request's TTFT, every prefill step's time),
    in ms of `d.clock`: TTFT runs from arrival to the step that emits its first token."""
    arrive, first, prefills = {}, {}, []
    for p in prompts[:concurrency]:
        arrive[d.submit(p, out)] = d.clock()
    nxt = concurrency
    while d.busy():
        ext, ms, emitted = d.step()
        if ext:
            prefills.append(ms)
        now = d.clock()
        for rid, finished in emitted:
            first.setdefault(rid, now)
            if finished and nxt < len(prompts):
                arrive[d.submit(prompts[nxt], out)] = d.clock()
                nxt += 1
    return [(first[r] - arrive[r]) * 1e3 for r in arrive], prefills


def shared_prefix(d: Driver, num: int = 32, concurrency: int = 8, seed: int = 0) -> dict:
    """Scenario (c), closed loop; mean/median TTFT and every prefill batch."""
    rng = random.Random(seed)
    words = lambda n: " ".join(rng.choice(WORDS) for _ in range(n))  # noqa: E731
    system = words(1000)
    tok = d.sched.tokenizer
    prompts = []
    for _ in range(num):
        ids = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": words(45)}],
                                      add_generation_prompt=True, tokenize=True)
        prompts.append(list(ids["input_ids"] if hasattr(ids, "keys") else ids))
    ttft, prefills = run_closed_loop(d, prompts, concurrency, 32)
    d.sched.flush_cache()
    return {"requests": num, "prompt_tokens": len(prompts[0]), "ttft_mean_ms": statistics.mean(ttft),
            "ttft_median_ms": statistics.median(ttft), "prefill_steps_ms": prefills}


def _cpu_model() -> str:
    """lscpu's model name (not imported from bench_linear: this script also runs against older
    checkouts, whose modules bench_linear may not match)."""
    import subprocess

    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return ""
    return next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--clock", choices=("cpu", "wall"), default="cpu")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("--dtype", default="auto", help="as the server's flag (an A/B of the defaults)")
    ap.add_argument("--quantization", default=None, help="as the server's flag (default: its default)")
    ap.add_argument("--batch", type=int, default=0, help="also the median decode step at this many requests")
    args = ap.parse_args()
    import torch

    d = Driver(time.process_time if args.clock == "cpu" else time.perf_counter, dtype=args.dtype,
               quantization=args.quantization)
    shared_prefix(d, num=8)  # warm-up: kernels built, allocator primed
    single = single_stream(d, args.repeats)
    print(f"single stream: decode step {single['decode_step_ms']:.2f} ms, prefill of 200 tokens "
          f"{single['prefill_200_ms']:.1f} ms")
    shared = shared_prefix(d)
    print(f"shared prefix (scenario c, in process): TTFT mean {shared['ttft_mean_ms']:.0f} ms, median "
          f"{shared['ttft_median_ms']:.0f} ms; prefill steps {[round(x) for x in shared['prefill_steps_ms']]} ms")
    batched = batched_decode(d, args.batch) if args.batch else None
    if batched:
        print(f"decode step at {args.batch} requests: {batched['decode_step_ms']:.2f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({"benchmark": "cpu_scheduler_steps", "clock": args.clock,
                                              "threads": torch.get_num_threads(), "cpu": _cpu_model(),
                                              "flags": {"dtype": d.sched.server_args.dtype,
                                                        "quantization": d.sched.server_args.quantization},
                                              "single": single, "shared_prefix": shared, "batched": batched},
                                             indent=1))


if __name__ == "__main__":
    main()
