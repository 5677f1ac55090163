"""--tp-size, --dist-init-addr, --dist-timeout: the rules `server_args_tp.resolve_tp` applies
(the GGUF int4 path is TP=1 only). resolve() reads no weights: a
placeholder `.gguf` file and a config-only folder stand in for models."""

from __future__ import annotations

import json
import logging

import pytest

from hiserve.hardware import Platform
from hiserve.server_args import ServerArgs, server_args_parser

CPU = Platform("cpu")


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


def test_gguf_default_becomes_none_at_tp2(gguf_file, caplog):
    with caplog.at_level(logging.INFO, logger="hiserve.server_args"):
        args = ServerArgs(model_path=gguf_file, dtype="bfloat16", device="cpu", tp_size=2).resolve(CPU)
    assert args.quantization == "none"
    assert "int4 GGUF path is TP=1 only" in caplog.text
    assert ServerArgs(model_path=gguf_file, dtype="bfloat16", device="cpu").resolve(CPU).quantization == "gguf"


def test_explicit_gguf_at_tp2_is_refused(gguf_file):
    with pytest.raises(ValueError, match="--quantization gguf .* cannot be split over --tp-size 2"):
        ServerArgs(model_path=gguf_file, dtype="bfloat16", device="cpu", tp_size=2, quantization="gguf").resolve(CPU)


@pytest.mark.parametrize("kwargs, match", [
    ({"tp_size": 0}, "--tp-size must be >= 1"),
    ({"dist_timeout": 0}, "--dist-timeout must be > 0"),
    ({"dist_init_addr": "localhost"}, "--dist-init-addr must be host:port"),
])
def test_bad_values(hf_folder, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ServerArgs(model_path=hf_folder, device="cpu", **kwargs).resolve(CPU)


def test_cli_flags():
    ns = server_args_parser().parse_args(["--tp-size", "2", "--dist-init-addr", "10.0.0.1:5000",
                                          "--dist-timeout", "30"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.tp_size, args.dist_init_addr, args.dist_timeout) == (2, "10.0.0.1:5000", 30)
