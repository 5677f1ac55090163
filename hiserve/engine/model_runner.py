"""Loads the model, sizes the KV pools, and runs one forward pass plus sampling."""

from __future__ import annotations

import dataclasses
import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from hiserve.distributed import get_tp_group, tp_broadcast_, tp_min_ints
from hiserve.engine.logprobs import global_rows, input_logprob_rows, logprob_rows, output_logprob_tensors
from hiserve.engine.sample_result import SampleOutput, SampleResult, SamplingPlan
from hiserve.engine.sampler import Sampler, SamplingBatchInfo
from hiserve.engine.schedule_batch import Req, ScheduleBatch
from hiserve.layers.attention.base import AttentionBackend
from hiserve.layers.forward_batch import ForwardBatch
from hiserve.layers.quantization import setup_int4_dispatch
from hiserve.mem_cache.hierarchy import KVSpec, build_kv_hierarchy, cell_size_bytes, reserved_device_bytes
from hiserve.models.cpu_decode_loop import attach_cpu_decode_loop
from hiserve.models.loader import load_model
from hiserve.models.model_config import ModelConfig
from hiserve.server_args import ServerArgs

if TYPE_CHECKING:
    from hiserve.engine.cuda_graph_runner import CudaGraphRunner
    from hiserve.engine.extend_graph_runner import ExtendGraphRunner

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


def tp_local_config(config: ModelConfig, tp_size: int) -> ModelConfig:
    """The config as one TP rank's attention and KV pool see it: H / tp query heads and its
    KV heads (split, or one replicated head per rank when fewer KV heads than ranks); MLA
    keeps its latent whole. Vocabulary, hidden size and layers are unchanged."""
    if tp_size == 1:
        return config
    kv = config.num_key_value_heads
    return dataclasses.replace(config, num_attention_heads=config.num_attention_heads // tp_size,
                               num_key_value_heads=kv // tp_size if kv >= tp_size else 1)


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
        extend_graph_runner: the `ExtendGraphRunner` replaying short one-request EXTEND
            passes, or None (--cuda-graph-max-extend-tokens 0, or a prefill backend that
            cannot capture them).
    """

    def __init__(self, server_args: ServerArgs, model: tuple[nn.Module, ModelConfig] | None = None):
        self.server_args = server_args
        self.tp = get_tp_group()
        # TP rank r runs on CUDA device r (the launcher's layout); the CPU has one device.
        self.device = torch.device(server_args.device)
        if self.device.type == "cuda" and self.tp.size > 1:
            self.device = torch.device("cuda", self.tp.rank)
        self.dtype = _DTYPES[server_args.dtype]
        self.page_size = server_args.page_size
        torch.manual_seed(server_args.random_seed)
        if self.device.type == "cpu":  # the cores this process may use, not the machine's
            from hiserve.hardware import cpu_compute_threads

            torch.set_num_threads(cpu_compute_threads()[0])

        if model is None:
            model = load_model(server_args.model_path, self.dtype, self.device, load_format=server_args.load_format,
                               quantization=server_args.quantization or "none")
        self.model, self.full_model_config = model
        # Attention backends and the KV pool read this rank's heads from it.
        self.model_config = tp_local_config(self.full_model_config, self.tp.size)
        self.model.eval()
        if getattr(self.model, "pack_for_cpu", None) is not None and self.model.pack_for_cpu():
            logger.info("Linear weights prepacked for the CPU GEMM (%s; which GEMM is logged once)", server_args.dtype)
        if self.device.type == "cpu":  # GGUF int4 layers: int4 or dense GEMM by rows, timed here
            setup_int4_dispatch(self.model)
        model_max = self.model_config.max_position_embeddings
        if server_args.context_length is not None and server_args.context_length > model_max:
            raise ValueError(f"--context-length {server_args.context_length} exceeds the model's "
                             f"max_position_embeddings {model_max}")
        self.context_len = server_args.context_length or model_max
        self.vocab_size = self.model_config.vocab_size
        self.init_memory_pool()
        self.attn_backend = create_pass_attention_backend(server_args, self)
        if self.device.type == "cpu":  # DECODE passes as one loop over the layers (Llama family)
            attach_cpu_decode_loop(self.model)
        self.sampler = Sampler()
        self._grammar = None  # GrammarBackend, built at the first constrained request
        self.cuda_graph_runner = self._create_cuda_graph_runner()
        self.extend_graph_runner = self._create_extend_graph_runner()

    # ------------------------------------------------------------------ memory
    @property
    def is_mla(self) -> bool:
        return bool(getattr(self.model_config, "kv_lora_rank", None))

    def _kv_spec(self, num_tokens: int) -> KVSpec:
        args, cfg = self.server_args, self.model_config
        return KVSpec(
            num_tokens=num_tokens, page_size=self.page_size, dtype=self.dtype, device=self.device,
            layer_num=cfg.num_hidden_layers, num_kv_heads=getattr(cfg, "num_key_value_heads", 0),
            head_dim=getattr(cfg, "head_dim", 0),
            kv_lora_rank=getattr(cfg, "kv_lora_rank", None) or None,
            qk_rope_head_dim=getattr(cfg, "qk_rope_head_dim", 0) or 0,
            max_running_requests=self.max_running_requests, max_context_len=self.context_len + 8,
            disable_radix_cache=args.disable_radix_cache,
            enable_hierarchical_cache=args.enable_hierarchical_cache,
            hicache_ratio=args.hicache_ratio, hicache_size=args.hicache_size,
            hicache_mem_layout=args.hicache_mem_layout, hicache_io_backend=args.hicache_io_backend,
            hicache_write_policy=args.hicache_write_policy,
            hicache_storage_backend=args.hicache_storage_backend,
            hicache_storage_prefetch_policy=args.hicache_storage_prefetch_policy,
            hicache_storage_extra_config=args.hicache_storage_backend_extra_config,
            model_identity=self._model_identity())

    def _model_identity(self) -> str:
        """What makes this model's KV bytes (storage keys are namespaced by it, with the KV
        dtype and shapes): the model path (a GGUF file's own path), the weight format, and
        the seed of generated weights."""
        args = self.server_args
        ident = f"{args.model_path}|quantization={args.quantization}|load_format={args.load_format}"
        return ident + (f"|seed={args.random_seed}" if args.load_format == "dummy" else "")

    def _profile_max_total_tokens(self, spec: KVSpec) -> int:
        args = self.server_args
        if args.max_total_tokens is not None:
            return args.max_total_tokens
        if self.device.type != "cuda":
            return _CPU_DEFAULT_MAX_TOTAL_TOKENS
        free, total = torch.cuda.mem_get_info(self.device)
        budget = free - total * (1 - args.mem_fraction_static) - reserved_device_bytes(spec)
        if budget <= 0:
            raise ValueError(f"--mem-fraction-static {args.mem_fraction_static} leaves no room for "
                             f"the KV pool ({free} bytes free of {total})")
        return int(budget // cell_size_bytes(spec))

    def init_memory_pool(self) -> None:
        """Size the device pool and build the KV hierarchy (`mem_cache/hierarchy.py`): request
        rows, device pool, allocator, and with --enable-hierarchical-cache the host tier."""
        self.max_running_requests = self.server_args.max_running_requests or _DEFAULT_MAX_RUNNING_REQUESTS
        size = self._profile_max_total_tokens(self._kv_spec(0))
        # Every TP rank must hold the same slots (rank 0's scheduling decisions name slots
        # and pages that every rank's pools must have): the smallest budget wins.
        size = tp_min_ints([size])[0]
        self.kv_hierarchy = build_kv_hierarchy(self._kv_spec(size))
        self.max_total_num_tokens = self.kv_hierarchy.allocator.size
        # The attention backends and CUDA graphs read these; benchmarks and kernel tests that
        # build batches by hand also use the allocator (the scheduler goes through KVManager).
        self.req_to_token_pool = self.kv_hierarchy.req_to_token_pool
        self.token_to_kv_pool = self.kv_hierarchy.device_pool
        self.token_to_kv_pool_allocator = self.kv_hierarchy.allocator

    def _cell_size_bytes(self) -> int:
        """Device KV bytes of one token across all layers."""
        return cell_size_bytes(self.kv_hierarchy.spec)

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

    def _create_extend_graph_runner(self) -> "ExtendGraphRunner | None":
        max_tokens = self.server_args.cuda_graph_max_extend_tokens or 0
        if self.device.type != "cuda" or max_tokens == 0:
            return None
        if not self.attn_backend.supports_extend_cuda_graph:
            logger.info("Extend passes run eagerly: the prefill backend cannot capture them")
            return None
        from hiserve.engine.extend_graph_runner import ExtendGraphRunner

        decode = self.cuda_graph_runner
        return ExtendGraphRunner(self.model, self.attn_backend, self.req_to_token_pool, self.token_to_kv_pool,
                                 max_tokens, graph_pool=None if decode is None else decode.graph_pool)

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

    def prepare_input_logprobs(self, batch: ScheduleBatch) -> None:
        """For an EXTEND batch whose requests owe prompt logprobs: their rows
        (`batch.input_logprob_rows`) and the flat index the forward gathers (built on the
        calling thread: the overlap scheduler calls this before handing the batch over)."""
        if not batch.forward_mode.is_extend() or batch.input_logprob_index is not None:
            return
        batch.input_logprob_rows = input_logprob_rows(batch)
        if batch.input_logprob_rows is not None:
            batch.input_logprob_index = global_rows(batch, batch.input_logprob_rows, self.device)

    def forward(self, batch: ScheduleBatch) -> torch.Tensor:
        """Run the model on `batch`; returns next-token logits [B, vocab] float32 (after a graph
        replay, a view valid until the next replay: sample before running another pass).

        For EXTEND passes where a request owes prompt logprobs, `batch.input_logits` receives
        the logits of those positions. Grammar masks of constrained requests are built in a
        worker thread while the pass runs (started here unless `batch.grammar_started`). A
        batch that reads a load-back waits for it per layer, or as a whole before a graph
        replay (`run_forward`).
        """
        fb = self.make_forward_batch(batch)
        self.prepare_input_logprobs(batch)
        if batch.input_logprob_index is not None:
            fb.input_logprob_rows = batch.input_logprob_index
        if not batch.grammar_started:
            grammar = self.grammar_backend(batch.reqs)
            if grammar is not None:
                grammar.start_fill(batch.reqs)
            batch.grammar_started = True
        logits = self.run_forward(fb, batch.load_ticket)
        batch.input_logits = fb.input_logits
        return logits

    def grammar_backend(self, reqs: list[Req]):
        """The xgrammar backend, created the first time a request in `reqs` is constrained."""
        if self._grammar is None and any(r.sampling_params.grammar_key for r in reqs):
            from hiserve.engine.grammar import GrammarBackend
            from hiserve.models.loader import get_tokenizer

            self._grammar = GrammarBackend(get_tokenizer(self.server_args.tokenizer_path), self.vocab_size,
                                           list(self.model_config.eos_token_ids))
        return self._grammar

    def run_forward(self, forward_batch: ForwardBatch, load_ticket: object | None = None) -> torch.Tensor:
        """Logits [B, vocab] float32 of one pass: DECODE batches the CUDA-graph runner can take
        and one-request extends the extend-graph runner can take are replayed (the result is
        then valid until the next replay), the rest run eagerly.

        `load_ticket`: the load-back this pass reads (None: none). An eager pass waits for it
        per layer (the device pool's layer accessors wait on it for this pass only); a graph
        cannot wait per layer, so a replay first makes the stream wait for the whole load."""
        with torch.inference_mode():
            runner = self.cuda_graph_runner
            if runner is None or not runner.can_run(forward_batch):
                runner = self.extend_graph_runner
                if runner is not None and not runner.can_run(forward_batch):
                    runner = None
            if runner is not None:
                if load_ticket is not None:
                    load_ticket.wait_all()
                return runner.replay(forward_batch)
            self.token_to_kv_pool.register_layer_transfer_counter(load_ticket)  # None: no waits
            try:
                self.attn_backend.init_forward_metadata(forward_batch)
                return self.model.forward(forward_batch)
            finally:
                self.token_to_kv_pool.register_layer_transfer_counter(None)

    def plan_sampling(self, reqs: list[Req], eos_ids: set[int], rows: list[int] | None = None) -> SamplingPlan:
        """Read what sampling `reqs` needs from the requests (host side; device tensors are
        made on the calling thread's stream). `rows`: the logits rows of `reqs` when they are
        not all rows (a prefill's chunked request takes no token). Does not start grammar
        masks (the forward or the overlap scheduler does)."""
        params = [r.sampling_params for r in reqs]
        histories = [(r.origin_input_ids, r.output_ids) for r in reqs]
        device = self.device
        info = SamplingBatchInfo.from_reqs(params, histories, self.vocab_size, device, eos_token_ids=eos_ids)
        lp_rows = logprob_rows(reqs)
        with torch.inference_mode():
            select = torch.tensor(rows, dtype=torch.int64, device=device) if rows is not None else None
            index = torch.tensor(lp_rows, dtype=torch.int64, device=device) if lp_rows else None
        top_k = max((reqs[i].top_logprobs_num for i in lp_rows), default=0)
        grammar = self.grammar_backend(reqs) if any(r.sampling_params.grammar_key for r in reqs) else None
        return SamplingPlan(info, select, lp_rows, index, top_k, grammar)

    def sample_on_device(self, logits: torch.Tensor, reqs: list[Req], plan: SamplingPlan) -> SampleOutput:
        """Sample one token per request from `logits` [B, V] (rows `plan.select`); device
        tensors out, nothing read back to the host unless a grammar mask must be joined.
        Request state is not changed (result processing records tokens and logprobs)."""
        info = plan.info
        if plan.grammar is not None:
            mask = plan.grammar.bitmask_for(reqs)
            info.vocab_mask = mask.to(logits.device) if mask is not None else None
        with torch.inference_mode():
            if plan.select is not None:
                logits = logits.index_select(0, plan.select)
            next_ids, logprobs = self.sampler.sample_and_logprobs(logits, info, plan.logprob_index)
            # TP: every rank samples from the same gathered logits with the same seeds; rank 0's
            # tokens are broadcast anyway so the ranks' schedulers can never diverge (a kernel's
            # nondeterminism, a random draw). Device group: no host round trip.
            next_ids = tp_broadcast_(next_ids, src=0)
            out = SampleOutput(next_ids)
            if plan.logprob_index is not None:
                out.token_logprobs, out.top_values, out.top_ids = output_logprob_tensors(
                    next_ids, logprobs, plan.logprob_index, plan.top_k)
        return out

    def sample(self, logits: torch.Tensor, reqs: list[Req], eos_ids: set[int],
               rows: list[int] | None = None) -> SampleResult:
        """Plan, sample and read back in one go (the synchronous scheduler). Returns the host
        result; the caller records tokens, logprobs and grammar steps on the requests."""
        plan = self.plan_sampling(reqs, eos_ids, rows)
        out = self.sample_on_device(logits, reqs, plan).to_host(non_blocking=False)
        return SampleResult(out, plan.logprob_rows)
