"""Greedy agreement with transformers float32: GGUF-native int4 vs dequantized bf16 vs float32.

The calibration behind test/e2e/test_generation_gguf.py's thresholds: the same chat prompts
(test/e2e/test_generation.py's CHAT_PROMPTS), 32 greedy tokens each, run in-process through
each variant of the default model (bench_linear.VARIANTS) and through transformers in float32
on the same GGUF. Reports, per variant, first-token agreement and the common-prefix length
with the reference per prompt; writes benchmark/results/cpu_bench_linear_agreement.json.

    python benchmark/cpu/bench_linear_agreement.py [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_linear import VARIANTS, DecodeHarness, load_variants, lscpu  # noqa: E402

from hiserve.layers.forward_batch import ForwardMode  # noqa: E402
from hiserve.models import loader  # noqa: E402

REPO = Path(__file__).resolve().parents[2]


def chat_prompts() -> list[str]:
    sys.path.insert(0, str(REPO / "test" / "e2e"))
    from test_generation import CHAT_PROMPTS

    return CHAT_PROMPTS


def reference(path: str, prompts: list[str], new_tokens: int) -> list[tuple[list[int], list[int]]]:
    """transformers float32 greedy ids (no sampling) for each chat prompt."""
    import transformers

    folder, name = os.path.split(path)
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, torch_dtype=torch.float32)
    out = []
    for p in prompts:
        ids = tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if hasattr(ids, "keys") else ids)
        with torch.no_grad():
            gen = model.generate(torch.tensor([ids]), max_new_tokens=new_tokens, do_sample=False,
                                 min_new_tokens=new_tokens)
        out.append((ids, gen[0, len(ids):].tolist()))
    return out


def greedy(model, config, dtype, ids: list[int], new_tokens: int) -> list[int]:
    with torch.inference_mode():
        h = DecodeHarness(model, config, dtype, [ids], len(ids) + new_tokens + 8)
        out = [int(h.first_logits.argmax(-1))]
        while len(out) < new_tokens:
            out.append(int(h.step(ForwardMode.DECODE, [[out[-1]]]).argmax(-1)))
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model-path", default=None)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--out", default=str(REPO / "benchmark" / "results" / "cpu_bench_linear_agreement.json"))
    args = ap.parse_args()
    path = loader.resolve_model_path(args.model_path)
    refs = reference(path, chat_prompts(), args.new_tokens)
    models = load_variants(path)
    rows = {}
    for name, (model, config, dtype) in models.items():
        prefixes = [common_prefix(greedy(model, config, dtype, ids, args.new_tokens), ref) for ids, ref in refs]
        rows[name] = {"prefix": prefixes, "first_token_agree": sum(p > 0 for p in prefixes),
                      "mean_prefix": sum(prefixes) / len(prefixes)}
        print(f"{name:>16}: first token {rows[name]['first_token_agree']}/{len(prefixes)}, "
              f"common prefix {prefixes} (mean {rows[name]['mean_prefix']:.1f} of {args.new_tokens})", flush=True)
    result = {"benchmark": "cpu_bench_linear_agreement", "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
              "command": " ".join([os.path.basename(sys.executable), *sys.argv]), "model": path,
              "torch": torch.__version__, "cpu": lscpu(), "new_tokens": args.new_tokens, "variants": rows,
              "variant_defs": {n: [str(d), q] for n, (d, q) in VARIANTS.items()}}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
