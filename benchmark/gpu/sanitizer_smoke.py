"""A short in-process serving run for compute-sanitizer: every GPU path of the hierarchical
cache, in a few seconds of real work.

    compute-sanitizer --tool memcheck --error-exitcode 3 \\
        python benchmark/gpu/sanitizer_smoke.py [--attention-backend fa3|triton] [--shape tiny-llama]
    python benchmark/gpu/sanitizer_smoke.py --device cpu     # the same run on the CPU (harness check)

The real Scheduler and ModelRunner (no HTTP): a dummy model (`tiny-llama` by default: 2
layers, 2 heads of 64, bf16), hierarchical cache `page_first` + `kernel` IO (staged
write-back, per-layer load-back kernel), a 512-token device pool, chunked prefill of 128
tokens, decode CUDA graphs up to batch 4. Four conversations of three turns run turn by
turn (the four requests of a turn together, so decode batches replay captured graphs);
their contexts outgrow the device pool, so later turns load prefixes back from the host.

Exit code 0 only if: every request produced its tokens, ids are in the vocabulary, at
least one write-back and one load-back happened, the final synchronize reports no CUDA
error, and /flush_cache's equivalent leaves device and host pools free. Prints a JSON
summary (and writes it to --out if given).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT))
sys.path.insert(0, str(REPO_ROOT / "benchmark" / "gpu"))
sys.path.insert(0, str(REPO_ROOT / "test" / "gpu"))

from common import graph_runner_of, make_server_args  # noqa: E402
from serving_harness import Workload  # noqa: E402

from hiserve.engine.io_struct import BatchTokenIDOut, TokenizedGenerateReqInput  # noqa: E402
from hiserve.engine.sampling_params import SamplingParams  # noqa: E402
from hiserve.engine.scheduler import Scheduler  # noqa: E402
from hiserve.testing.dummy_model import hf_config, write_dummy_model  # noqa: E402

WORKLOAD = dict(num_conversations=4, num_turns=3, first_question_tokens=96, question_tokens=32,
                reply_tokens=16, output_tokens=6)
POOL_TOKENS = 512


def run_until_idle(sched: Scheduler, max_steps: int = 10_000) -> None:
    steps = 0
    while sched.waiting_queue or sched.running or sched.chunked_req:
        sched.step()
        steps += 1
        if steps > max_steps:
            raise RuntimeError("scheduler did not finish the requests")


def collect_outputs(sched: Scheduler) -> dict[str, list[int]]:
    outs: dict[str, list[int]] = {}
    for msg in sched.outbox:
        if isinstance(msg, BatchTokenIDOut):
            for rid, ids in zip(msg.rids, msg.new_output_ids):
                outs.setdefault(rid, []).extend(ids)
    sched.outbox.clear()
    return outs


def smoke(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="hiserve_sanitizer_") as folder:
        path = write_dummy_model(folder, args.shape)
        vocab = hf_config(args.shape)["vocab_size"]
        fields = dict(model_path=path, load_format="dummy", device=args.device,
                      dtype="bfloat16" if args.device == "cuda" else "float32",
                      attention_backend=args.attention_backend, page_size=16, max_total_tokens=POOL_TOKENS,
                      chunked_prefill_size=128, max_running_requests=8, enable_hierarchical_cache=True,
                      hicache_ratio=8, hicache_mem_layout="page_first", hicache_io_backend="kernel",
                      random_seed=1)
        if args.device == "cuda":
            fields.update(cuda_graph_max_bs=4)
        server_args, missing = make_server_args(**fields)
        sched = Scheduler(server_args, None)
        w = Workload(**WORKLOAD, vocab_size=vocab)
        sp = SamplingParams(max_new_tokens=w.output_tokens, temperature=0, ignore_eos=True)
        outputs: dict[str, list[int]] = {}
        for turn in range(w.num_turns):
            for conv in range(w.num_conversations):
                sched.add_request(TokenizedGenerateReqInput(rid=f"c{conv}t{turn}", input_ids=w.prompt(conv, turn),
                                                            sampling_params=sp))
            run_until_idle(sched)
            outputs.update(collect_outputs(sched))
        controller = sched.kv.h.controller
        controller.synchronize()
        sched.check_cache_events()
        if args.device == "cuda":
            torch.cuda.synchronize()  # raises on an asynchronous CUDA error
        cache = sched.kv.prefix_cache
        summary = {
            "shape": args.shape, "device": args.device, "attention_backend": server_args.attention_backend,
            "server_args_missing": missing, "cuda_graph_runner_found": graph_runner_of(sched.model_runner) is not None,
            "requests": len(outputs), "expected_requests": w.num_requests,
            "backed_up_tokens": cache.backed_up_tokens_total, "loaded_back_tokens": cache.loaded_back_tokens_total,
        }
        problems = []
        if len(outputs) != w.num_requests or any(len(v) != w.output_tokens for v in outputs.values()):
            problems.append("not every request produced its tokens")
        if any(not 0 <= t < vocab for v in outputs.values() for t in v):
            problems.append("output id outside the vocabulary")
        if cache.backed_up_tokens_total == 0 or cache.loaded_back_tokens_total == 0:
            problems.append("no write-back or no load-back happened")
        if not sched.flush_cache():
            problems.append("flush refused: requests left")
        sched.kv.check_integrity()
        if sched.kv.allocator.available_size() != sched.max_total_num_tokens:
            problems.append("device pool not free after flush")
        host = cache.mem_pool_host
        if host.available_size() != host.size:
            problems.append("host pool not free after flush")
        if args.device == "cuda":
            torch.cuda.synchronize()
        summary["problems"] = problems
        return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="tiny-llama")
    p.add_argument("--attention-backend", default=None, help="default: fa3 on CUDA, torch_native on the CPU")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--out", default=None, help="also write the JSON summary here")
    args = p.parse_args(argv)
    if args.attention_backend is None:
        args.attention_backend = "fa3" if args.device == "cuda" else "torch_native"
    if args.device == "cuda" and not torch.cuda.is_available():
        print("cannot run: --device cuda without a CUDA device")
        return 1
    try:
        summary = smoke(args)
    except Exception as e:  # any failure is a non-zero exit with its traceback
        traceback.print_exc()
        summary = {"problems": [f"{type(e).__name__}: {e}"]}
    text = json.dumps(summary, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    return 1 if summary["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
