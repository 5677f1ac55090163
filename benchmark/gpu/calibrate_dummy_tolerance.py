"""How strongly bf16 rounding and the context move the greedy tokens of a dummy model (CPU).

The GPU serving test compares an attention backend with torch_native by first-token
agreement and the fraction of output before the first difference. This script measures,
on a Llama-3-8B-like dummy model narrowed to run on a CPU (`--layers` 32, hidden 512, the
128256-token vocabulary, the same weight scales), over `--prompts` random prompts:
- `f32_vs_bf16`: float32 vs bfloat16 (rounding everywhere: a pessimistic stand-in for
  two bf16 backends);
- `bf16_vs_bf16_chunked`: bf16 whole prefill vs bf16 chunked prefill of 64 tokens (only the
  reduction order differs: what a second correct backend changes);
- `context_changed`: bf16, the same last 32 prompt tokens after a different earlier context
  (what a backend reading the wrong KV amounts to).
A good tolerance passes the first two and fails the third.

    python benchmark/gpu/calibrate_dummy_tolerance.py   # ~2-4 minutes on 2 CPU cores
Writes <out-dir>/gpu_serving_tolerance_calibration.json.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import base_record, make_server_args, write_record  # noqa: E402

from hiserve.engine.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput  # noqa: E402
from hiserve.engine.sampling_params import SamplingParams  # noqa: E402
from hiserve.engine.scheduler import Scheduler  # noqa: E402
from hiserve.testing.dummy_model import SPECIAL_TOKENS, hf_config, write_dummy_model  # noqa: E402


def greedy(model_path: str, dtype: str, prompts: list[list[int]], output_tokens: int, chunk: int) -> list[list[int]]:
    args, _ = make_server_args(model_path=model_path, load_format="dummy", dtype=dtype, device="cpu",
                               chunked_prefill_size=chunk, random_seed=1)
    sched = Scheduler(args, None)
    outs = []
    for i, ids in enumerate(prompts):
        sp = SamplingParams(max_new_tokens=output_tokens, temperature=0, ignore_eos=True)
        sched.add_request(TokenizedGenerateReqInput(rid=str(i), input_ids=ids, sampling_params=sp))
        while sched.waiting_queue or sched.running or sched.chunked_req:
            sched.step()
        outs.append([t for m in sched.outbox if isinstance(m, BatchTokenIDOut)
                     for rid, new in zip(m.rids, m.new_output_ids) if rid == str(i) for t in new])
        sched.outbox.clear()
    return outs


def agreement(a: list[list[int]], b: list[list[int]]) -> dict[str, float]:
    first = [float(x[0] == y[0]) for x, y in zip(a, b)]
    prefix = []
    for x, y in zip(a, b):
        n = 0
        while n < len(x) and x[n] == y[n]:
            n += 1
        prefix.append(n / len(x))
    return {"first_token_agreement": float(np.mean(first)), "mean_prefix_fraction": float(np.mean(prefix))}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=8)
    p.add_argument("--out-dir", default="benchmark/results")
    args = p.parse_args(argv)
    import torch

    record = base_record(torch.device("cpu"), args)
    with tempfile.TemporaryDirectory(prefix="hiserve_calib_") as folder:
        path = write_dummy_model(folder, "llama3-8b")
        cfg = hf_config("llama3-8b")
        cfg.update(hidden_size=512, num_attention_heads=8, num_key_value_heads=2, head_dim=64,
                   intermediate_size=1792, num_hidden_layers=args.layers)
        Path(path, "config.json").write_text(json.dumps(cfg))
        rng = np.random.default_rng(0)
        lo, hi = len(SPECIAL_TOKENS), cfg["vocab_size"]
        prompts = [rng.integers(lo, hi, args.prompt_len).tolist() for _ in range(args.prompts)]
        changed = [rng.integers(lo, hi, args.prompt_len - 32).tolist() + q[-32:] for q in prompts]
        bf16 = greedy(path, "bfloat16", prompts, args.output_tokens, -1)
        result = {
            "model": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                          "num_key_value_heads", "head_dim", "intermediate_size", "vocab_size")},
            "f32_vs_bf16": agreement(greedy(path, "float32", prompts, args.output_tokens, -1), bf16),
            "bf16_vs_bf16_chunked": agreement(bf16, greedy(path, "bfloat16", prompts, args.output_tokens, 64)),
            "context_changed": agreement(bf16, greedy(path, "bfloat16", changed, args.output_tokens, -1)),
            "distinct_tokens_per_output": float(np.mean([len(set(o)) for o in bf16])),
        }
    record.update(result)
    for k in ("f32_vs_bf16", "bf16_vs_bf16_chunked", "context_changed"):
        print(f"{k:22s} first-token agreement {result[k]['first_token_agreement']:.3f}  "
              f"mean prefix fraction {result[k]['mean_prefix_fraction']:.3f}")
    write_record(record, args.out_dir, "gpu_serving_tolerance_calibration")
    return 0


if __name__ == "__main__":
    sys.exit(main())
