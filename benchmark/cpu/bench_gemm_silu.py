"""The MLP's gate/up GEMM with silu(gate) * up in its epilogue (`cpu_amx.amx_bf16_gemm_silu`,
csrc/cpu/amx_bf16_gemm_silu.h) against the plain AMX GEMM followed by SiluAndMul, on an AMX CPU,
same process, interleaved.

Part 1, the kernel: SmolLM2-135M's gate/up shape (2 x 1536 x 576) at 16 to 2048 rows; each
sample calls 30 layers' weights in turn (a model's count, weights read cold as in a forward pass);
the two alternate sample by sample (`bench_cpu_attention.interleaved_medians`); medians of
--reps. The fused output is checked against the unfused one first (to bf16 rounding).

Part 2 (--steps): `make serve` defaults driven in process (`bench_scheduler_steps.Driver`), the
fused path switched on and off between requests (ABBA) by patching `GGUFInt4Linear.silu_mul`:
a fresh 1061-token chat prompt's prefill step, and 7 questions of ~56 tokens over its cached
system prompt (scenario (c)'s second step), medians of --reps each.

    python benchmark/cpu/bench_gemm_silu.py [--steps] [--out benchmark/results/cpu_amx_gemm_silu.json]

Prints a table; the JSON holds the command, CPU (lscpu: model, flags), threads, date and every median.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cpu_attention import interleaved_medians  # noqa: E402
from bench_linear import lscpu  # noqa: E402
from bench_scheduler_steps import WORDS, Driver  # noqa: E402

from hiserve.jit_kernel import cpu as cpu_kernels  # noqa: E402
from hiserve.jit_kernel.cpu_amx import amx_bf16_gemm, amx_bf16_gemm_silu, amx_bf16_pack  # noqa: E402
from hiserve.layers.quantization.gguf import GGUFInt4Linear  # noqa: E402

INTER, HIDDEN, LAYERS = 1536, 576, 30
ROWS = (16, 64, 200, 448, 1061, 2048)


@torch.inference_mode()
def kernel_table(reps: int) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    packed = [amx_bf16_pack((torch.randn(2 * INTER, HIDDEN, generator=gen) / 24).bfloat16()) for _ in range(LAYERS)]
    rows = []
    for m in ROWS:
        x = torch.randn(m, HIDDEN, generator=gen).bfloat16()
        fused = amx_bf16_gemm_silu(x, packed[0])
        unfused = cpu_kernels.silu_and_mul(amx_bf16_gemm(x, packed[0]))
        torch.testing.assert_close(fused.float(), unfused.float(), rtol=2 ** -6, atol=2e-3)
        ms = interleaved_medians({"unfused": lambda: [cpu_kernels.silu_and_mul(amx_bf16_gemm(x, p)) for p in packed],
                                  "fused": lambda: [amx_bf16_gemm_silu(x, p) for p in packed]},
                                 reps, time.perf_counter)
        un, fu = ms["unfused"], ms["fused"]
        rows.append({"rows": m, "unfused_ms_per_layer": un / LAYERS, "fused_ms_per_layer": fu / LAYERS,
                     "fused_over_unfused": fu / un})
    return rows


def steps(reps: int) -> dict:
    """Prefill steps of `make serve` defaults with the fused path on and off (ABBA)."""
    d = Driver(time.perf_counter)
    tok, rng, on = d.sched.tokenizer, random.Random(0), GGUFInt4Linear.silu_mul

    def words(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def chat(system: str) -> list[int]:
        ids = tok.apply_chat_template([{"role": "system", "content": system}, {"role": "user", "content": words(45)}],
                                      add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if hasattr(ids, "keys") else ids)

    def prefill_ms(prompts: list[list[int]]) -> float:
        for ids in prompts:
            d.submit(ids, 1)
        ms = None
        while d.busy():
            ext, t, _ = d.step()
            ms = t if ext and ms is None else ms
        return ms

    out = {"fused": {"prompt_1061_ms": [], "questions_7x56_ms": []},
           "unfused": {"prompt_1061_ms": [], "questions_7x56_ms": []}}
    for i in range(2 * reps + 2):
        label = "fused" if i % 4 in (0, 3) else "unfused"
        GGUFInt4Linear.silu_mul = on if label == "fused" else (lambda self, x: None)
        system = words(1000)
        full, seven = prefill_ms([chat(system)]), prefill_ms([chat(system) for _ in range(7)])
        if i >= 2:  # the first pair warms up
            out[label]["prompt_1061_ms"].append(full)
            out[label]["questions_7x56_ms"].append(seven)
    GGUFInt4Linear.silu_mul = on
    return {k: {m: statistics.median(v) for m, v in d2.items()} | {"samples": d2} for k, d2 in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument("--steps", action="store_true", help="also prefill steps with the fused path on and off")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if not cpu_kernels.amx_gemm_available():
        sys.exit(f"no AMX kernels here (kernel ISA {cpu_kernels.detect_cpu().isa}): nothing to compare")
    rows = kernel_table(args.reps)
    print(f"{'rows':>5} {'GEMM + silu ms':>15} {'fused ms':>9} {'fused/unfused':>14}   (a layer, 2x{INTER}x{HIDDEN})")
    for r in rows:
        print(f"{r['rows']:>5} {r['unfused_ms_per_layer']:>15.3f} {r['fused_ms_per_layer']:>9.3f} "
              f"{r['fused_over_unfused']:>14.2f}")
    step = steps(args.reps) if args.steps else None
    if step:
        for label, d in step.items():
            print(f"{label}: 1061-token prompt {d['prompt_1061_ms']:.1f} ms, 7 x 56 questions over it "
                  f"{d['questions_7x56_ms']:.1f} ms")
    if args.out:
        Path(args.out).write_text(json.dumps({
            "benchmark": "cpu_amx_gemm_silu", "command": " ".join(["python"] + sys.argv),
            "date": datetime.now(timezone.utc).isoformat(), "cpu": lscpu(),
            "isa": cpu_kernels.detect_cpu().isa, "threads": torch.get_num_threads(), "torch": torch.__version__,
            "shape": {"inter": INTER, "hidden": HIDDEN}, "layers_per_sample": LAYERS, "reps": args.reps,
            "kernel": rows, "steps": step}, indent=1))


if __name__ == "__main__":
    main()
