"""lm-evaluation-harness, unmodified, against a running hiserve vs lm-eval's own `hf` model.

Runs two local tasks (benchmark/lm_eval/tasks: `hiserve_mc`, multiple choice scored by
loglikelihood through `/v1/completions` with `echo` + `logprobs`; `hiserve_gen`, greedy
generate-until) twice: with lm-eval's `local-completions` model against a hiserve server
it launches (float32), and with lm-eval's `hf` model on the same GGUF in float32. Writes
benchmark/results/lm_eval_hiserve_vs_hf.json and prints a table.

Pass criteria (stated tolerance): every task metric equal within one item (|delta| <= 1/N:
a greedy near-tie may flip one answer between two float32 implementations), and the
per-request loglikelihoods within 1e-2 nats of each other.

Usage: PYTHONPATH=$PWD .venv/bin/python benchmark/lm_eval/run_lm_eval.py [--model-path GGUF]
Needs `pip install "lm-eval[api]==0.4.13"` (the `eval` extra). No dataset hub is contacted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TASKS = ["hiserve_mc", "hiserve_gen"]
LL_TOL = 1e-2

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def evaluate(model: str, model_args: dict) -> dict:
    import lm_eval
    from lm_eval.tasks import TaskManager

    tm = TaskManager(include_path=str(REPO / "benchmark/lm_eval/tasks"))
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=TASKS, task_manager=tm,
                                   batch_size=1, log_samples=True, random_seed=0, numpy_random_seed=0,
                                   torch_random_seed=0, fewshot_random_seed=0)


def scores(result: dict) -> dict[str, dict[str, float]]:
    out = {}
    for task, metrics in result["results"].items():
        out[task] = {k.split(",")[0]: v for k, v in metrics.items()
                     if isinstance(v, (int, float)) and "stderr" not in k and k != "alias"}
    return out


def loglikelihoods(result: dict) -> list[float]:
    lls = []
    for sample in result["samples"]["hiserve_mc"]:
        lls.extend(float(r[0]) for r in (x[0] if isinstance(x[0], (list, tuple)) else x
                                         for x in sample["resps"]))
    return lls


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", default=None, help="GGUF file; default: the installed SmolLM2")
    args = parser.parse_args()
    os.chdir(REPO)
    sys.path.insert(0, str(REPO / "test/e2e"))
    from server import kill, popen_launch_server

    from hiserve.models.loader import get_tokenizer, resolve_model_path

    model_path = resolve_model_path(args.model_path)
    folder, gguf_name = os.path.split(model_path)
    tok_dir = tempfile.mkdtemp(prefix="hiserve_lmeval_tok_")
    get_tokenizer(model_path).save_pretrained(tok_dir)  # lm-eval's tokenizer for local-completions

    # A small KV pool: the prompts are short, and the machine may be shared.
    proc, url = popen_launch_server(["--model-path", model_path, "--max-total-tokens", "4096"])
    try:
        t0 = time.time()
        served = evaluate("local-completions", {
            "model": model_path, "base_url": f"{url}/v1/completions", "tokenizer_backend": "huggingface",
            "tokenizer": tok_dir, "tokenized_requests": True, "num_concurrent": 8, "max_retries": 3,
            "timeout": 3000})  # seconds per request: a busy CPU machine is slow
        t_served = time.time() - t0
    finally:
        kill(proc)
    t0 = time.time()
    reference = evaluate("hf", {"pretrained": folder, "gguf_file": gguf_name, "tokenizer": tok_dir,
                                "dtype": "float32", "device": "cpu"})
    t_hf = time.time() - t0

    s_served, s_ref = scores(served), scores(reference)
    ll_s, ll_r = loglikelihoods(served), loglikelihoods(reference)
    max_ll_diff = float(max(abs(a - b) for a, b in zip(ll_s, ll_r))) if ll_s else float("nan")
    rows, ok = [], bool(len(ll_s) == len(ll_r) and max_ll_diff <= LL_TOL)
    for task in TASKS:
        n = len(served["samples"][task])
        for metric, value in s_served[task].items():
            ref = s_ref[task].get(metric)
            value, ref = float(value), (None if ref is None else float(ref))  # numpy scalars -> JSON
            good = bool(ref is not None and abs(value - ref) <= 1.0 / n + 1e-9)
            ok = ok and good
            rows.append({"task": task, "metric": metric, "hiserve": value, "hf": ref, "n": n, "within_tol": good})
    print(f"{'task':<12} {'metric':<12} {'hiserve':>8} {'hf':>8} {'n':>4}  ok")
    for r in rows:
        print(f"{r['task']:<12} {r['metric']:<12} {r['hiserve']:>8.4f} {r['hf']:>8.4f} {r['n']:>4}  {r['within_tol']}")
    print(f"loglikelihoods: {len(ll_s)} requests, max |hiserve - hf| = {max_ll_diff:.2e} nats (tol {LL_TOL})")
    out = {"model_path": model_path, "tasks": TASKS, "rows": rows, "loglikelihood_requests": len(ll_s),
           "max_abs_loglikelihood_diff": max_ll_diff, "loglikelihood_tol": LL_TOL,
           "seconds": {"hiserve_local_completions": t_served, "hf": t_hf}, "pass": ok,
           "lm_eval_version": __import__("importlib.metadata").metadata.version("lm-eval")}
    dest = REPO / "benchmark/results/lm_eval_hiserve_vs_hf.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {dest.relative_to(REPO)}; pass = {ok}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
