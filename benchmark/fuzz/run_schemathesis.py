"""Fuzz every operation of /openapi.json with schemathesis against a local server.

    .venv/bin/python benchmark/fuzz/run_schemathesis.py [--max-examples 80] [--out benchmark/results]

Starts `python -m hiserve.launch_server` on 127.0.0.1 with the `tiny-llama` dummy model
(hiserve.testing.dummy_model: random weights at a tiny shape, a real tokenizer and chat
template) and a small context, so the generated requests finish in milliseconds on a CPU;
the API surface under test is the same for every model. Runs `st run` over all
operations with the checks below, then checks the server still answers /health and
/generate. Writes the schemathesis output to `<out>/schemathesis.txt` and a summary to
`<out>/schemathesis.json`; exits non-zero on any failure.

Checks: every built-in one except `positive_data_acceptance` (a schema-valid request must
not be refused), which runs separately as a report. The schema states every per-field bound
and the two "one of" rules (exactly one of text / input_ids; at most one of json_schema /
regex / ebnf), but the context-length rule (prompt tokens + max_tokens <= context length)
depends on the tokenizer, a grammar's validity on its compiler, and best_of == n or
min_new_tokens <= max_new_tokens compare two fields' values, which JSON Schema cannot say;
so those refusals (400, naming the parameter) are expected and listed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from hiserve.testing.dummy_model import write_dummy_model

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "test" / "e2e"))
from server import kill, popen_launch_server  # noqa: E402

KEY = "fuzz-key"
SERVER_ARGS = ["--api-key", KEY, "--load-format", "dummy", "--context-length", 32,
               "--max-running-requests", 8, "--max-total-tokens", 8192]
GATING = ("not_a_server_error,status_code_conformance,content_type_conformance,"
          "response_headers_conformance,response_schema_conformance,negative_data_rejection,"
          "missing_required_header,unsupported_method,allow_header_conformance,ignored_auth")


def _st(url: str, checks: str, max_examples: int, seed: int, extra: list[str]) -> tuple[int, str]:
    # Schemathesis's CLI entry point through this interpreter: an `st` script's shebang names the
    # venv it was installed from, which may have moved.
    entry = "import sys; from schemathesis.cli import schemathesis; sys.argv[0] = 'st'; sys.exit(schemathesis())"
    cmd = [sys.executable, "-c", entry, "run", f"{url}/openapi.json", "--checks", checks,
           "--max-examples", str(max_examples), "--seed", str(seed), "-H", f"Authorization: Bearer {KEY}",
           "--request-timeout", "120", "--workers", "1", "--continue-on-failure", *extra]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env={**os.environ, "NO_COLOR": "1"})
    return proc.returncode, proc.stdout + proc.stderr


def _cases(output: str) -> int:
    """Test cases schemathesis reports having generated (its summary line)."""
    found = re.findall(r"(\d+) generated", output)
    return sum(int(n) for n in found)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--max-examples", type=int, default=80)
    ap.add_argument("--seed", type=int, default=20261201)
    ap.add_argument("--max-time", type=int, default=0, help="time budget of each st run in s (0: none)")
    ap.add_argument("--out", default=str(REPO / "benchmark" / "results"))
    ap.add_argument("--skip-positive", action="store_true", help="skip the positive_data_acceptance report")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    model_dir = tempfile.mkdtemp(prefix="hiserve_fuzz_model_")
    model = write_dummy_model(model_dir, "tiny-llama")
    proc, url = popen_launch_server(["--model-path", model, *SERVER_ARGS])
    try:
        t0 = time.monotonic()
        budget = ["--max-time", str(args.max_time)] if args.max_time else []
        rc, text = _st(url, GATING, args.max_examples, args.seed, budget)
        summary = {"command": " ".join(sys.argv), "server_args": [str(a) for a in SERVER_ARGS],
                   "checks": GATING.split(","), "exit_code": rc, "seconds": round(time.monotonic() - t0, 1)}
        report = "=== gating checks ===\n" + text
        if not args.skip_positive:
            prc, ptext = _st(url, "positive_data_acceptance", args.max_examples // 2, args.seed, budget)
            summary["positive_data_acceptance_exit_code"] = prc
            report += "\n=== positive_data_acceptance (report only) ===\n" + ptext
        with httpx.Client(base_url=url, timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
            alive = c.get("/health").status_code == 200 and c.post(
                "/generate", json={"text": "Hi", "sampling_params": {"max_new_tokens": 2}}).status_code == 200
        summary["alive_after"] = alive
        summary["server_errors_in_log"] = Path(proc.log_path).read_text(errors="replace").count("Traceback")
    finally:
        kill(proc)
    (out / "schemathesis.txt").write_text(report)
    (out / "schemathesis.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(report[-3000:])
    print(json.dumps(summary, indent=2))
    return 0 if rc == 0 and summary["alive_after"] else 1


if __name__ == "__main__":
    sys.exit(main())
