"""ServerArgs.resolve(): attention backend and CUDA-graph rules per platform, checked on CPU with
hand-made `Platform`s (plus one CUDA-marked test on the real machine).

The models are config.json-only HF folders: resolve() reads a config, never weights.
"""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch

from hiserve.hardware import Platform, detect_platform
from hiserve.server_args import ServerArgs

CPU = Platform("cpu")
HOPPER_FA3 = Platform("cuda", (9, 0), fa3_importable=True, fa3_mla=False)
HOPPER_FA3_MLA = Platform("cuda", (9, 0), fa3_importable=True, fa3_mla=True)
HOPPER_NO_FA3 = Platform("cuda", (9, 0), fa3_importable=False)
AMPERE = Platform("cuda", (8, 0), fa3_importable=True)
AMPERE_NO_TRITON = Platform("cuda", (8, 0), fa3_importable=False, triton_importable=False)

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000}
DEEPSEEK_MLA = {"architectures": ["DeepseekV2ForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
                "num_attention_heads": 4, "intermediate_size": 512, "vocab_size": 1000, "kv_lora_rank": 512,
                "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128}
DEEPSEEK_MOE = {**DEEPSEEK_MLA, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64}


def model_dir(tmp_path_factory, config: dict) -> str:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    return model_dir(tmp_path_factory, LLAMA)


@pytest.fixture(scope="module")
def mla(tmp_path_factory) -> str:
    return model_dir(tmp_path_factory, DEEPSEEK_MLA)


@pytest.fixture(scope="module")
def moe(tmp_path_factory) -> str:
    return model_dir(tmp_path_factory, DEEPSEEK_MOE)


def resolve(platform: Platform, model_path: str, **kwargs) -> ServerArgs:
    return ServerArgs(model_path=model_path, **kwargs).resolve(platform=platform)


# ------------------------------------------------------------------ no downgrade
NO_DOWNGRADE = dict(attention_backend="fa3", enable_hierarchical_cache=True, hicache_io_backend="kernel")


def assert_no_downgrade(args: ServerArgs) -> None:
    assert args.device == "cuda"
    assert (args.attention_backend, args.prefill_attention_backend, args.decode_attention_backend) == ("fa3",) * 3
    assert args.enable_hierarchical_cache
    assert args.hicache_io_backend == "kernel"
    assert args.hicache_mem_layout == "page_first"
    assert args.disable_cuda_graph is False
    assert args.cuda_graph_max_bs == 160


def test_fa3_decode_with_kernel_io_is_not_downgraded(llama, caplog):
    with caplog.at_level(logging.INFO, logger="hiserve.server_args"):
        args = resolve(HOPPER_FA3, llama, **NO_DOWNGRADE)
    assert_no_downgrade(args)
    changed = [r.getMessage() for r in caplog.records
               if "hicache" in r.getMessage() or "attention" in r.getMessage() or "CUDA graphs" in r.getMessage()]
    assert changed == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_fa3_decode_with_kernel_io_on_this_machine(llama):
    platform = detect_platform()
    if not platform.can_use_fa3:
        pytest.skip(f"FlashAttention-3 cannot run here: {platform.describe()}")
    assert_no_downgrade(ServerArgs(model_path=llama, **NO_DOWNGRADE).resolve())


# ------------------------------------------------------------------ defaults per platform
@pytest.mark.parametrize("platform, model, dtype, expected", [
    (CPU, "llama", "auto", "cpu_paged"),
    (HOPPER_FA3, "llama", "auto", "fa3"),
    (HOPPER_FA3, "llama", "float16", "fa3"),
    (HOPPER_FA3, "llama", "float32", "triton"),  # FA3 has no float32 kernels
    (HOPPER_NO_FA3, "llama", "auto", "triton"),
    (AMPERE, "llama", "auto", "triton"),
    (HOPPER_FA3, "mla", "auto", "triton"),  # this FA3 build lacks the MLA kernel
    (HOPPER_FA3_MLA, "mla", "auto", "fa3"),
])
def test_default_attention_backend(request, caplog, platform, model, dtype, expected):
    with caplog.at_level(logging.INFO, logger="hiserve.server_args"):
        args = resolve(platform, request.getfixturevalue(model), dtype=dtype)
    assert args.device == platform.device_type
    assert (args.attention_backend, args.prefill_attention_backend, args.decode_attention_backend) == (expected,) * 3
    assert any(f"--attention-backend not given -> {expected}" in r.getMessage() for r in caplog.records)
    if platform.device_type == "cpu":
        assert args.disable_cuda_graph is True and args.cuda_graph_max_bs is None
    else:
        assert args.disable_cuda_graph is False and args.cuda_graph_max_bs == 160


def test_default_on_cuda_says_why_not_fa3(llama, caplog):
    with caplog.at_level(logging.INFO, logger="hiserve.server_args"):
        resolve(AMPERE, llama)
    assert any("compute capability 8.0" in r.getMessage() for r in caplog.records)


# ------------------------------------------------------------------ what cannot run
@pytest.mark.parametrize("flag", ["attention_backend", "prefill_attention_backend", "decode_attention_backend"])
@pytest.mark.parametrize("backend", ["triton", "fa3"])
def test_gpu_backend_on_cpu_raises(llama, flag, backend):
    with pytest.raises(ValueError, match="--" + flag.replace("_", "-") + f" {backend} needs CUDA"):
        resolve(CPU, llama, **{flag: backend})


@pytest.mark.parametrize("platform, model, kwargs, reason", [
    (AMPERE, "llama", {}, "Hopper"),
    (HOPPER_NO_FA3, "llama", {}, "Hopper"),
    (HOPPER_FA3, "llama", {"dtype": "float32"}, "float32"),
    (HOPPER_FA3, "mla", {}, "fails its MLA trial"),
])
@pytest.mark.parametrize("flag", ["--attention-backend", "--decode-attention-backend"])
def test_explicit_fa3_that_cannot_run_raises(request, platform, model, kwargs, reason, flag):
    field = flag[2:].replace("-", "_")
    with pytest.raises(ValueError, match=f"{flag} fa3 cannot run: .*{reason}.*use {flag} triton"):
        resolve(platform, request.getfixturevalue(model), **{field: "fa3"}, **kwargs)


def test_triton_that_cannot_import_raises(llama):
    with pytest.raises(ValueError, match="--attention-backend triton: triton does not import"):
        resolve(AMPERE_NO_TRITON, llama, attention_backend="triton")
    # No default can run: say so and name the flag that still works, never pick one silently.
    with pytest.raises(ValueError, match="pass --attention-backend torch_native"):
        resolve(AMPERE_NO_TRITON, llama)


def test_device_cuda_without_cuda_raises(llama):
    with pytest.raises(ValueError, match="--device cuda"):
        resolve(CPU, llama, device="cuda")


# ------------------------------------------------------------------ prefill / decode backends
def test_prefill_and_decode_default_to_attention_backend(llama):
    args = resolve(HOPPER_FA3, llama, attention_backend="triton")
    assert (args.prefill_attention_backend, args.decode_attention_backend) == ("triton", "triton")


def test_decode_backend_alone_keeps_default_prefill(llama):
    args = resolve(HOPPER_FA3, llama, decode_attention_backend="triton")
    assert (args.attention_backend, args.prefill_attention_backend, args.decode_attention_backend) == (
        "fa3", "fa3", "triton")
    assert args.disable_cuda_graph is False


def test_prefill_backend_alone(llama):
    args = resolve(HOPPER_FA3, llama, attention_backend="triton", prefill_attention_backend="fa3")
    assert (args.prefill_attention_backend, args.decode_attention_backend) == ("fa3", "triton")


# ------------------------------------------------------------------ CUDA graphs
@pytest.mark.parametrize("kwargs", [{"attention_backend": "torch_native"},
                                    {"attention_backend": "fa3", "decode_attention_backend": "torch_native"}])
def test_torch_native_decode_on_cuda_turns_graphs_off_with_a_reason(llama, caplog, kwargs):
    with caplog.at_level(logging.INFO, logger="hiserve.server_args"):
        args = resolve(HOPPER_FA3, llama, **kwargs)
    assert args.decode_attention_backend == "torch_native"
    assert args.disable_cuda_graph is True
    assert any("CUDA graphs off" in r.getMessage() and "torch_native" in r.getMessage() for r in caplog.records)


def test_torch_native_prefill_keeps_graphs(llama):
    args = resolve(HOPPER_FA3, llama, prefill_attention_backend="torch_native")
    assert args.decode_attention_backend == "fa3" and args.disable_cuda_graph is False


def test_moe_model_keeps_graphs(moe, caplog):
    """The MoE layer runs densely (no host sync) while a graph is captured, so graphs stay on."""
    with caplog.at_level(logging.INFO, logger="hiserve.server_args"):
        args = resolve(HOPPER_FA3, moe, attention_backend="triton")
    assert args.disable_cuda_graph is False
    assert not any("CUDA graphs off" in r.getMessage() for r in caplog.records)


def test_graph_flags_are_kept(llama):
    args = resolve(HOPPER_FA3, llama, cuda_graph_max_bs=48, disable_cuda_graph=True)
    assert args.cuda_graph_max_bs == 48 and args.disable_cuda_graph is True
    assert resolve(HOPPER_FA3, llama, cuda_graph_max_bs=7).cuda_graph_max_bs == 7


def test_cuda_graph_max_bs_must_be_positive(llama):
    with pytest.raises(ValueError, match="--cuda-graph-max-bs"):
        resolve(HOPPER_FA3, llama, cuda_graph_max_bs=0)


def test_extend_graph_defaults_and_rules(llama, caplog):
    assert resolve(HOPPER_FA3, llama).cuda_graph_max_extend_tokens == 256
    assert resolve(HOPPER_FA3, llama, cuda_graph_max_extend_tokens=64).cuda_graph_max_extend_tokens == 64
    assert resolve(HOPPER_FA3, llama, cuda_graph_max_extend_tokens=0).cuda_graph_max_extend_tokens == 0
    assert resolve(HOPPER_FA3, llama, disable_cuda_graph=True).cuda_graph_max_extend_tokens == 0
    assert resolve(CPU, llama).cuda_graph_max_extend_tokens == 0
    # fa3 decode with a triton prefill: extends cannot be captured, said in the log
    with caplog.at_level("INFO", logger="hiserve.server_args"):
        args = resolve(HOPPER_FA3, llama, prefill_attention_backend="triton")
    assert args.cuda_graph_max_extend_tokens == 0 and "Extend passes run eagerly" in caplog.text
    with pytest.raises(ValueError, match="--cuda-graph-max-extend-tokens 64 needs --prefill-attention-backend fa3"):
        resolve(HOPPER_FA3, llama, prefill_attention_backend="triton", cuda_graph_max_extend_tokens=64)
    with pytest.raises(ValueError, match="--cuda-graph-max-extend-tokens must be >= 0"):
        resolve(HOPPER_FA3, llama, cuda_graph_max_extend_tokens=-1)
    # a torch_native decode turns every graph off, extend graphs included
    args = resolve(HOPPER_FA3, llama, prefill_attention_backend="fa3", decode_attention_backend="torch_native")
    assert args.disable_cuda_graph is True and args.cuda_graph_max_extend_tokens == 0


def test_moe_model_extends_run_eagerly_unless_asked(moe, caplog):
    """Under a graph the routed experts run densely: E/k times the work for 257 rows."""
    with caplog.at_level(logging.INFO, logger="hiserve.server_args"):
        assert resolve(HOPPER_FA3_MLA, moe, attention_backend="fa3").cuda_graph_max_extend_tokens == 0
    assert "mixture-of-experts" in caplog.text
    args = resolve(HOPPER_FA3_MLA, moe, attention_backend="fa3", cuda_graph_max_extend_tokens=64)
    assert args.cuda_graph_max_extend_tokens == 64 and args.disable_cuda_graph is False


# ------------------------------------------------------------------ existing rules stay
def test_hicache_direct_io_layout_rule_stays(llama):
    args = resolve(HOPPER_FA3, llama, enable_hierarchical_cache=True, hicache_io_backend="direct")
    assert args.hicache_mem_layout == "page_first_direct"
    assert args.attention_backend == "fa3" and args.hicache_io_backend == "direct"


def test_cli_flags_parse():
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(["--prefill-attention-backend", "fa3", "--decode-attention-backend", "triton",
                            "--cuda-graph-max-bs", "32", "--disable-cuda-graph"])
    args = ServerArgs.from_cli_args(ns)
    assert (args.attention_backend, args.prefill_attention_backend, args.decode_attention_backend) == (
        None, "fa3", "triton")
    assert args.cuda_graph_max_bs == 32 and args.disable_cuda_graph is True
    assert ServerArgs.from_cli_args(parser.parse_args([])).disable_cuda_graph is False
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flashinfer"])


def test_cli_reports_a_bad_combination_as_a_usage_error(llama, capsys):
    from hiserve.server_args import prepare_server_args

    with pytest.raises(SystemExit) as exc:
        prepare_server_args(["--model-path", llama, "--page-size", "0"])
    assert exc.value.code == 2
    assert "--page-size must be >= 1" in capsys.readouterr().err


def test_resolved_args_are_frozen(llama):
    import dataclasses

    args = ServerArgs(model_path=llama, device="cpu").resolve()
    with pytest.raises(dataclasses.FrozenInstanceError, match="page_size"):
        args.page_size = 64
    assert args.resolve() is args  # resolving again changes nothing
    assert args.model_config() is args.model_config()  # the lazily read config is still cached
