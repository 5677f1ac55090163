"""Storage-tier flags in ServerArgs: SGLang's spellings and defaults, the rules in resolve()
(a backend needs the hierarchical cache; layer_first becomes a page-first layout, logged),
clear errors naming the flag for bad extra config, and nothing changed without a backend."""

from __future__ import annotations

import dataclasses
import json
import logging

import pytest

from hiserve.hardware import Platform
from hiserve.server_args import ServerArgs, prepare_server_args

CPU = Platform("cpu")
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 512, "vocab_size": 1000}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> str:
    folder = tmp_path_factory.mktemp("model")
    (folder / "config.json").write_text(json.dumps(LLAMA))
    return str(folder)


def resolve(model_path: str, **kwargs) -> ServerArgs:
    return ServerArgs(model_path=model_path, device="cpu", **kwargs).resolve(platform=CPU)


def test_defaults_are_sglangs(llama):
    args = resolve(llama)
    assert args.hicache_storage_backend is None
    assert args.hicache_storage_prefetch_policy == "timeout"
    assert args.hicache_storage_backend_extra_config is None


def test_without_a_backend_nothing_changes(llama):
    base = resolve(llama, enable_hierarchical_cache=True, hicache_mem_layout="layer_first")
    with_policy = resolve(llama, enable_hierarchical_cache=True, hicache_mem_layout="layer_first",
                          hicache_storage_prefetch_policy="best_effort")
    assert base.hicache_mem_layout == with_policy.hicache_mem_layout == "layer_first"


def test_backend_needs_the_hierarchical_cache(llama):
    with pytest.raises(ValueError, match="--hicache-storage-backend file needs --enable-hierarchical-cache"):
        resolve(llama, hicache_storage_backend="file")


@pytest.mark.parametrize("io_backend,want", [("kernel", "page_first"), ("direct", "page_first_direct")])
def test_layer_first_becomes_page_first_logged(llama, caplog, io_backend, want):
    with caplog.at_level(logging.INFO, logger="hiserve.server_args"):
        args = resolve(llama, enable_hierarchical_cache=True, hicache_storage_backend="file",
                       hicache_mem_layout="layer_first", hicache_io_backend=io_backend)
    assert args.hicache_mem_layout == want
    assert any("layer_first with --hicache-storage-backend file" in r.getMessage() for r in caplog.records)


def test_extra_config_json_and_file(llama, tmp_path):
    cfg = {"file_storage_path": str(tmp_path), "prefetch_threshold": 64}
    args = resolve(llama, enable_hierarchical_cache=True, hicache_storage_backend="file",
                   hicache_storage_backend_extra_config=json.dumps(cfg))
    assert json.loads(args.hicache_storage_backend_extra_config) == cfg
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    resolve(llama, enable_hierarchical_cache=True, hicache_storage_backend="file",
            hicache_storage_backend_extra_config=f"@{path}")


@pytest.mark.parametrize("text,match", [
    ("{not json", "--hicache-storage-backend-extra-config: invalid JSON"),
    ("[1, 2]", "--hicache-storage-backend-extra-config: .*must be a JSON object"),
    ("@/nonexistent/cfg.json", "--hicache-storage-backend-extra-config: cannot read"),
    ('{"prefetch_threshold": "many"}', "--hicache-storage-backend-extra-config: prefetch_threshold"),
    ('{"prefetch_timeout_base": -1}', "--hicache-storage-backend-extra-config: prefetch_timeout_base"),
    # The file backend's own values, checked with the flags rather than after the model loads.
    ('{"file_io_threads": 0}', "--hicache-storage-backend-extra-config: file_io_threads"),
    ('{"storage_size_cap_gb": "big"}', "--hicache-storage-backend-extra-config: storage_size_cap_gb"),
])
def test_bad_extra_config_names_the_flag(llama, text, match):
    with pytest.raises(ValueError, match=match):
        resolve(llama, enable_hierarchical_cache=True, hicache_storage_backend="file",
                hicache_storage_backend_extra_config=text)


def test_cli_spelling_and_choices(llama, capsys):
    args = prepare_server_args(["--model-path", llama, "--device", "cpu", "--enable-hierarchical-cache",
                                "--hicache-storage-backend", "file", "--hicache-storage-prefetch-policy",
                                "wait_complete", "--hicache-storage-backend-extra-config", '{"prefetch_threshold": 32}'])
    assert (args.hicache_storage_backend, args.hicache_storage_prefetch_policy) == ("file", "wait_complete")
    for bad in (["--hicache-storage-backend", "s3"], ["--hicache-storage-prefetch-policy", "never"]):
        with pytest.raises(SystemExit):
            prepare_server_args(["--model-path", llama, *bad])
    with pytest.raises(SystemExit):  # a usage error on stderr, not a traceback
        prepare_server_args(["--model-path", llama, "--device", "cpu", "--hicache-storage-backend", "file"])
    assert "--enable-hierarchical-cache" in capsys.readouterr().err
    assert {f.name for f in dataclasses.fields(ServerArgs)} >= {
        "hicache_storage_backend", "hicache_storage_prefetch_policy", "hicache_storage_backend_extra_config"}


def test_extra_config_keys_in_help_are_read():
    """Every key --help names for --hicache-storage-backend-extra-config is one some code reads
    (the help once named a storage_op_timeout nothing implemented)."""
    import re
    from pathlib import Path

    import hiserve.mem_cache.storage as storage_pkg
    import hiserve.mem_cache.storage_controller as controller

    help_text = {f.name: f.metadata["help"] for f in dataclasses.fields(ServerArgs)}[
        "hicache_storage_backend_extra_config"]
    keys = set(re.findall(r"\b([a-z]+(?:_[a-z]+)+)\b", help_text))
    assert {"file_storage_path", "master_server_address", "prefetch_threshold"} <= keys
    sources = [Path(controller.__file__).read_text()]
    sources += [p.read_text() for p in Path(storage_pkg.__file__).parent.glob("*.py")]
    unread = sorted(k for k in keys if not any(f'"{k}"' in s or f"{k}:" in s for s in sources))
    assert not unread, f"--help names extra-config keys nothing reads: {unread}"



def test_unknown_extra_config_key_is_named_in_a_warning(llama, caplog):
    """A misspelt key (file_storage_dir for file_storage_path) would silently fall back to the
    default directory: the warning names it and the keys the backend reads."""
    with caplog.at_level(logging.WARNING, logger="hiserve.mem_cache.storage"):
        resolve(llama, enable_hierarchical_cache=True, hicache_storage_backend="file",
                hicache_storage_backend_extra_config='{"file_storage_dir": "/tmp/x", "prefetch_threshold": 32}')
    text = caplog.text
    assert "file_storage_dir" in text and "file_storage_path" in text and "prefetch_threshold, " not in text.split(
        "does not read:")[1].split("(known")[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hiserve.mem_cache.storage"):
        resolve(llama, enable_hierarchical_cache=True, hicache_storage_backend="file",
                hicache_storage_backend_extra_config='{"file_storage_path": "/tmp/x", "file_io_threads": 2}')
    assert "does not read" not in caplog.text
