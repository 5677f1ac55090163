"""The issue's three CPU serving scenarios, run with benchmark/bench_serving.py against one server.

  a: 8 single-stream chats, ~200 prompt tokens, 64 output tokens
  b: concurrency 1, 4, 16 x 32 requests, ~300 prompt tokens, 128 output tokens, ignore_eos
  c: 32 requests sharing a ~1000-token system prompt + ~50-token questions, concurrency 8
     (32 output tokens, ignore_eos: the scenario is about time to first token)

`quick=True` shrinks request counts and output lengths for a smoke test; the prompt lengths stay.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import bench_serving  # noqa: E402  (benchmark/bench_serving.py, the shared client)


@dataclass(frozen=True)
class Level:
    """One bench_serving run: a scenario at one concurrency."""

    scenario: str        # "a", "b" or "c"
    concurrency: int
    args: tuple[str, ...]


def levels(quick: bool) -> list[Level]:
    out_a, out_b, out_c = (8, 8, 4) if quick else (64, 128, 32)
    a_n = 2 if quick else 8
    common_b = ("--scenario", "random", "--random-input-len", "300", "--random-output-len", str(out_b),
                "--ignore-eos")
    result = [Level("a", 1, ("--scenario", "random", "--num-prompts", str(a_n), "--random-input-len", "200",
                             "--random-output-len", str(out_a), "--concurrency", "1",
                             "--warmup", "1" if quick else "2"))]
    for conc in (1, 4, 16):
        n = conc if quick else 32
        result.append(Level("b", conc, (*common_b, "--num-prompts", str(n), "--concurrency", str(conc))))
    c_n = 8 if quick else 32
    result.append(Level("c", 8, ("--scenario", "shared-prefix", "--num-prompts", str(c_n),
                                 "--shared-prefix-len", "1000", "--question-len", "50",
                                 "--random-output-len", str(out_c), "--ignore-eos", "--concurrency", "8")))
    return result


def run_level(level: Level, base_url: str, tokenizer: str, seed: int, log_path: Path) -> dict[str, Any]:
    """Run one level; returns bench_serving's metrics dict (TTFT/TPOT in ms, throughput in tok/s).

    The client's own per-level tables go to `log_path`. Raises RuntimeError if a request failed.
    """
    argv = ["--base-url", base_url, "--backend", "openai-chat", "--tokenizer", tokenizer,
            "--temperature", "0", "--seed", str(seed), *level.args]
    args = bench_serving.parse_args(argv)
    if "--warmup" not in level.args:
        args.warmup = 1
    with open(log_path, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        print(f"=== scenario {level.scenario} concurrency {level.concurrency}: {' '.join(argv)}")
        record = asyncio.run(bench_serving.amain(args))
    metrics = record["results"][0]
    if metrics["failed"]:
        raise RuntimeError(f"scenario {level.scenario} c={level.concurrency}: {metrics['failed']} failed "
                           f"requests, e.g. {metrics['errors'][:1]}")
    metrics["client_command"] = "python benchmark/bench_serving.py " + " ".join(argv)
    return metrics
