"""Loads the model, sizes the KV pools, and runs one forward pass plus sampling."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from hiserve.engine.sampler import Sampler, SamplingBatchInfo
from hiserve.engine.schedule_batch import Req, ScheduleBatch
from hiserve.layers.attention.base import AttentionBackend
from hiserve.layers.forward_batch import ForwardBatch
from hiserve.mem_cache.allocator import ReqToTokenPool, TokenToKVPoolAllocator
from hiserve.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool
from hiserve.models.loader import load_model
from hiserve.models.model_config import ModelConfig
from hiserve.server_args import ServerArgs

if TYPE_CHECKING:
    from hiserve.engine.cuda_graph_runner import CudaGraphRunner

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_CPU_DEFAULT_MAX_TOTAL_TOKENS = 32768
_DEFAULT_MAX_RUNNING_REQUESTS = 256


def create_attention_backend(name: str, runner: "ModelRunner") -> AttentionBackend:
    """Instantiate one backend by its flag value (cpu_paged, torch_native, triton or fa3).

    Raises:
        ValueError: unknown name, or the backend cannot run this model here (its message says why).
    """
    if name == "cpu_paged":
        from hiserve.layers.attention.cpu_backend import CpuPagedAttnBackend

        return CpuPagedAttnBackend(runner)
    if name == "torch_native":
        from hiserve.layers.attention.torch_native import TorchNativeAttnBackend

        return TorchNativeAttnBackend(runner)
    if name == "triton":
        from hiserve.layers.attention.triton_backend import TritonAttnBackend

        return TritonAttnBackend(runner)
    if name == "fa3":
        from hiserve.layers.attention.flashattention_backend import FlashAttentionBackend

        return FlashAttentionBackend(runner)
    raise ValueError(f"unknown attention backend {name!r}")


def create_pass_attention_backend(server_args: ServerArgs, runner: "ModelRunner") -> AttentionBackend:
    """The backend of every pass: one backend, or a hybrid when --prefill-attention-backend
    and --decode-attention-backend differ (each defaults to --attention-backend)."""
    prefill = server_args.prefill_attention_backend or server_args.attention_backend
    decode = server_args.decode_attention_backend or server_args.attention_backend
    if prefill == decode:
        return create_attention_backend(prefill, runner)
    from hiserve.layers.attention.hybrid_backend import HybridAttnBackend

    logger.info("Attention: %s for prefill (EXTEND), %s for decode", prefill, decode)
    return HybridAttnBackend(create_attention_backend(prefill, runner), create_attention_backend(decode, runner))


class ModelRunner:
    """Owns the weights, the device pools, the attention backend and the CUDA graphs of one rank.

    Args:
        server_args: resolved arguments.
        model: an already built `(model, config)` on the device (tests); default: load
            `server_args.model_path`.

    Attributes:
        attn_backend: the backend of every pass (a `HybridAttnBackend` when prefill and
            decode backends differ).
        cuda_graph_runner: the `CudaGraphRunner` replaying DECODE batches, or None (CPU,
            --disable-cuda-graph, or a decode backend without CUDA-graph support).
    """

    def __init__(self, server_args: ServerArgs, model: tuple[nn.Module, ModelConfig] | None = None):
        self.server_args = server_args
        self.device = torch.device(server_args.device)
        self.dtype = _DTYPES[server_args.dtype]
        self.page_size = server_args.page_size
        torch.manual_seed(server_args.random_seed)
        if self.device.type == "cpu":  # the cores this process may use, not the machine's
            from hiserve.hardware import cpu_compute_threads

            torch.set_num_threads(cpu_compute_threads()[0])

        if model is None:
            model = load_model(server_args.model_path, self.dtype, self.device, load_format=server_args.load_format)
        self.model, self.model_config = model
        self.model.eval()
        if getattr(self.model, "pack_for_cpu", None) is not None and self.model.pack_for_cpu():
            logger.info("Linear weights prepacked for oneDNN (CPU, %s)", server_args.dtype)
        model_max = self.model_config.max_position_embeddings
        if server_args.context_length is not None and server_args.context_length > model_max:
            raise ValueError(f"--context-length {server_args.context_length} exceeds the model's "
                             f"max_position_embeddings {model_max}")
        self.context_len = server_args.context_length or model_max
        self.vocab_size = self.model_config.vocab_size
        self.host_pool = None  # the hierarchical cache's host pool (L2), when enabled
        self.init_memory_pool(reserved_bytes=self._hicache_staging_bytes())
        if server_args.enable_hierarchical_cache:
            self.init_host_pool()
        self.attn_backend = create_pass_attention_backend(server_args, self)
        self.sampler = Sampler()
        self.cuda_graph_runner = self._create_cuda_graph_runner()

    # ------------------------------------------------------------------ memory
    @property
    def is_mla(self) -> bool:
        return bool(getattr(self.model_config, "kv_lora_rank", None))

    def _cell_size_bytes(self) -> int:
        """Device KV bytes of one token across all layers (the pool classes own the formula)."""
        cfg = self.model_config
        if self.is_mla:
            return MLATokenToKVPool.cell_size_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                                    cfg.num_hidden_layers, self.dtype)
        return MHATokenToKVPool.cell_size_bytes(cfg.num_key_value_heads, cfg.head_dim,
                                                cfg.num_hidden_layers, self.dtype)

    def _profile_max_total_tokens(self, reserved_bytes: int) -> int:
        args = self.server_args
        if args.max_total_tokens is not None:
            return args.max_total_tokens
        if self.device.type != "cuda":
            return _CPU_DEFAULT_MAX_TOTAL_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - total * (1 - args.mem_fraction_static) - reserved_bytes
        if budget <= 0:
            raise ValueError(f"--mem-fraction-static {args.mem_fraction_static} leaves no room for "
                             f"the KV pool ({free} bytes free of {total})")
        return int(budget // self._cell_size_bytes())

    def init_memory_pool(self, reserved_bytes: int = 0) -> None:
        """Create `req_to_token_pool`, the device KV pool and its allocator.

        Args:
            reserved_bytes: device bytes to keep out of the KV pool (e.g. hicache staging buffers).
        """
        cfg = self.model_config
        size = self._profile_max_total_tokens(reserved_bytes)
        size = size // self.page_size * self.page_size
        if size < 2 * self.page_size:
            raise ValueError(f"--max-total-tokens {size} is too small for --page-size {self.page_size}")
        self.max_total_num_tokens = size
        self.max_running_requests = self.server_args.max_running_requests or _DEFAULT_MAX_RUNNING_REQUESTS
        # The padding row is the request row of the dummy requests padding a CUDA-graph batch.
        self.req_to_token_pool = ReqToTokenPool(self.max_running_requests, self.context_len + 8, self.device,
                                                padding_row=True)
        if self.is_mla:
            self.token_to_kv_pool = MLATokenToKVPool(size, self.page_size, self.dtype, cfg.kv_lora_rank,
                                                     cfg.qk_rope_head_dim, cfg.num_hidden_layers, self.device)
        else:
            self.token_to_kv_pool = MHATokenToKVPool(size, self.page_size, self.dtype,
                                                     cfg.num_key_value_heads, cfg.head_dim,
                                                     cfg.num_hidden_layers, self.device)
        self.token_to_kv_pool_allocator = TokenToKVPoolAllocator(size, self.page_size, self.device,
                                                                 self.token_to_kv_pool)
        logger.info("KV pool: %d tokens, %.1f MB; %d request rows", size,
                    size * self._cell_size_bytes() / 1e6, self.max_running_requests)

    def _hicache_staging_bytes(self) -> int:
        """Device bytes of the host pool's write-back staging buffers (0 when hicache is off),
        bounded before the pools exist (64 pages), so the device pool is sized without them."""
        args, cfg = self.server_args, self.model_config
        if not args.enable_hierarchical_cache:
            return 0
        from hiserve.mem_cache.memory_pool_host import write_back_staging_bytes

        itemsize = torch.empty((), dtype=self.dtype).element_size()
        if self.is_mla:
            item_bytes, num_buffers = (cfg.kv_lora_rank + cfg.qk_rope_head_dim) * itemsize, 1
        else:
            item_bytes, num_buffers = cfg.num_key_value_heads * cfg.head_dim * itemsize, 2
        return write_back_staging_bytes(args.hicache_mem_layout, self.device, None, self.page_size,
                                        cfg.num_hidden_layers, item_bytes, num_buffers)

    def init_host_pool(self) -> None:
        """Create the host pool (L2) backing the device pool (--enable-hierarchical-cache)."""
        from hiserve.mem_cache.memory_pool_host import MHATokenToKVPoolHost, MLATokenToKVPoolHost

        args = self.server_args
        host_cls = MLATokenToKVPoolHost if self.is_mla else MHATokenToKVPoolHost
        self.host_pool = host_cls(self.token_to_kv_pool, args.hicache_ratio, args.hicache_size,
                                  self.page_size, args.hicache_mem_layout)

    # ------------------------------------------------------------------ CUDA graphs
    def _create_cuda_graph_runner(self) -> "CudaGraphRunner | None":
        args = self.server_args
        if self.device.type != "cuda" or args.disable_cuda_graph:
            return None
        if not self.attn_backend.supports_cuda_graph:
            logger.info("CUDA graphs off: decode backend %s cannot be captured",
                        args.decode_attention_backend or args.attention_backend)
            return None
        from hiserve.engine.cuda_graph_runner import CudaGraphRunner

        return CudaGraphRunner(self)

    # ------------------------------------------------------------------ run
    def make_forward_batch(self, batch: ScheduleBatch) -> ForwardBatch:
        """The model-side view of a scheduled batch (pools and backend attached)."""
        return ForwardBatch(
            forward_mode=batch.forward_mode, batch_size=batch.batch_size, input_ids=batch.input_ids,
            positions=batch.positions, out_cache_loc=batch.out_cache_loc,
            req_pool_indices=batch.req_pool_indices, seq_lens=batch.seq_lens,
            seq_lens_cpu=batch.seq_lens_cpu, extend_seq_lens_cpu=batch.extend_seq_lens_cpu,
            extend_prefix_lens_cpu=batch.extend_prefix_lens_cpu,
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend)

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """Run the model on `batch`; returns next-token logits [B, vocab] float32 (after a graph
        replay, a view valid until the next replay: sample before running another pass)."""
        return self.run_forward(self.make_forward_batch(batch))

    def run_forward(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Logits [B, vocab] float32 of one pass: DECODE batches the CUDA-graph runner can take
        are replayed (the result is then valid until the next replay), the rest run eagerly."""
        with torch.inference_mode():
            runner = self.cuda_graph_runner
            if runner is not None and runner.can_run(forward_batch):
                return runner.replay(forward_batch)
            self.attn_backend.init_forward_metadata(forward_batch)
            return self.model.forward(forward_batch)

    def sample(self, logits: torch.Tensor, reqs: list[Req], eos_ids: set[int]) -> list[int]:
        """Pick one token per request; returns them as Python ints."""
        params = [r.sampling_params for r in reqs]
        histories = [(r.origin_input_ids, r.output_ids) for r in reqs]
        info = SamplingBatchInfo.from_reqs(params, histories, self.vocab_size, logits.device,
                                           eos_token_ids=eos_ids)
        with torch.inference_mode():
            return self.sampler.sample(logits, info).tolist()
