"""The API process (the one `python -m hiserve.launch_server` starts) never imports torch or gguf.

The real launcher runs in a subprocess: it spawns the real scheduler process (which resolves
the flags and reads the GGUF tokenizer), builds the tokenizer from the spec it sends back,
serves HTTP and sends its warm-up /generate. The only change is a wrapped warm-up, which
then sends a streamed chat completion (chat template, incremental detokenization), prints
which torch / gguf modules this process holds, and fails on purpose so that the launcher
shuts down (exit status 1, "Warm-up failed").
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).parent))

from server import find_free_port  # noqa: E402

_MARK = "API_PROCESS_MODULES "

_PROBE = r"""
import json, sys
import httpx
from hiserve import launch_server as ls

real_warm_up = ls._warm_up

async def warm_up_then_probe(server_args):
    await real_warm_up(server_args)
    body = {"messages": [{"role": "user", "content": "Say hi in French"}], "max_tokens": 4,
            "temperature": 0, "stream": True, "logprobs": True, "top_logprobs": 2}
    async with httpx.AsyncClient(timeout=600) as client:
        r = await client.post(ls._local_url(server_args) + "/v1/chat/completions", json=body)
    assert r.status_code == 200 and "data: [DONE]" in r.text, r.text
    held = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "gguf"))
    print(%(mark)r + json.dumps({"held": held, "frozen": getattr(server_args, "_frozen", False),
                                 "dtype": server_args.dtype}), flush=True)
    raise RuntimeError("probe done")

ls._warm_up = warm_up_then_probe
sys.exit(ls.main(sys.argv[1:]))
""" % {"mark": _MARK}


def _launch(args: list[str], code: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code, *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=timeout)


def test_api_process_imports_neither_torch_nor_gguf():
    out = _launch(["--dtype", "float32", "--port", str(find_free_port()), "--log-level", "warning"], _PROBE)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith(_MARK)]
    assert lines, f"no probe line (exit {out.returncode}); stderr tail:\n{out.stderr[-4000:]}"
    probe = json.loads(lines[0][len(_MARK):])
    assert probe["held"] == [], f"the API process imported {probe['held'][:10]}"
    assert probe["frozen"] and probe["dtype"] == "float32"  # the scheduler process resolved them
    assert out.returncode == 1 and "probe done" in out.stderr  # left through the warm-up failure


def test_bad_flags_are_a_usage_error_from_the_scheduler_side_resolve():
    """resolve() runs in the scheduler process; its refusal still exits 2 with argparse's message."""
    code = "import sys; from hiserve.launch_server import main; sys.exit(main(sys.argv[1:]))"
    out = _launch(["--page-size", "0", "--port", str(find_free_port())], code, timeout=300)
    assert out.returncode == 2, out.stderr[-4000:]
    assert "error: --page-size must be >= 1, got 0" in out.stderr
