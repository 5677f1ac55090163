"""--quantization: its default per device, dtype and checkpoint, and the combinations it refuses.

resolve() only looks at the path (a `.gguf` file or not), so a tiny placeholder file stands
in for a GGUF here; no weights are read.
"""

from __future__ import annotations

import json
import logging

import pytest

from hiserve.hardware import CpuInfo, Platform
from hiserve.server_args import ServerArgs

CPU = Platform("cpu")
CUDA = Platform("cuda", (8, 0), fa3_importable=False)


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("gguf") / "model.gguf"
    path.write_bytes(b"GGUF")
    return str(path)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("hf")
    (folder / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    return str(folder)


@pytest.mark.parametrize("dtype, device, load_format, expected", [
    ("bfloat16", "cpu", "auto", "gguf"),   # the default serving path
    ("float32", "cpu", "auto", "none"),    # the reference dtype stays dequantized
    ("bfloat16", "cpu", "dummy", "none"),  # random weights have no GGUF blocks
    ("bfloat16", "cuda", "auto", "none"),  # the int4 kernel is the CPU one
])
def test_default_for_a_gguf_file(gguf_file, caplog, dtype, device, load_format, expected):
    platform = CUDA if device == "cuda" else CPU
    with caplog.at_level(logging.INFO, logger="hiserve.server_args"):
        args = ServerArgs(model_path=gguf_file, dtype=dtype, device=device, load_format=load_format,
                          attention_backend="torch_native").resolve(platform)
    assert args.quantization == expected
    assert f"--quantization not given -> {expected}" in caplog.text


@pytest.mark.parametrize("features, dtype", [
    ({"avx2", "fma", "f16c"}, "float32"),                                      # AVX2 only
    ({"avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512dq"}, "float32"),  # AVX-512, no bf16
    ({"avx2", "fma", "avx512f", "avx512_bf16"}, "bfloat16"),
])
def test_auto_dtype_keeps_the_gguf_default(gguf_file, features, dtype):
    """--dtype auto picks float32 on a CPU without native bf16 dot products; that is the CPU's
    choice, not a request for the float32 reference, so the GGUF is still served natively
    (its int4 kernel runs in bf16 on cast activations: 10x faster than its float32 code)."""
    platform = Platform("cpu", cpu=CpuInfo("x", frozenset(features)))
    args = ServerArgs(model_path=gguf_file, device="cpu", attention_backend="torch_native").resolve(platform)
    assert (args.dtype, args.quantization) == (dtype, "gguf")


def test_default_for_an_hf_folder_is_none(hf_folder):
    assert ServerArgs(model_path=hf_folder, dtype="bfloat16", device="cpu").resolve(CPU).quantization == "none"


def test_explicit_gguf_with_float32_is_kept(gguf_file):
    args = ServerArgs(model_path=gguf_file, dtype="float32", device="cpu", quantization="gguf").resolve(CPU)
    assert args.quantization == "gguf"


@pytest.mark.parametrize("kwargs, message", [
    ({"device": "cuda", "attention_backend": "torch_native"}, "--device is cuda"),
    ({"load_format": "dummy"}, "--load-format dummy"),
    ({"dtype": "float16"}, "not --dtype float16"),
])
def test_gguf_refusals_name_the_flag(gguf_file, kwargs, message):
    platform = CUDA if kwargs.get("device") == "cuda" else CPU
    args = ServerArgs(model_path=gguf_file, quantization="gguf", **{"dtype": "bfloat16", "device": "cpu", **kwargs})
    with pytest.raises(ValueError, match=message):
        args.resolve(platform)


def test_gguf_needs_a_gguf_file(hf_folder):
    with pytest.raises(ValueError, match="needs a GGUF file"):
        ServerArgs(model_path=hf_folder, quantization="gguf", dtype="bfloat16", device="cpu").resolve(CPU)
