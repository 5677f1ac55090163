"""The cross-flag rules of CUDA graphs and overlap scheduling (`--cuda-graph-max-bs`,
`--cuda-graph-max-extend-tokens`, `--disable-cuda-graph`, `--enable/--disable-overlap-schedule`),
applied by `ServerArgs.resolve()` after the attention backends are chosen."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hiserve.server_args import ServerArgs

logger = logging.getLogger("hiserve.server_args")

CUDA_DEFAULT_CUDA_GRAPH_MAX_BS = 160
# Short single-request extends (a follow-up turn after a cached prefix) are launch-bound: a
# 64-token follow-up on a 2K prefix of an 8B model answered in 48 ms eager, 15 ms replayed
# (H200, over HTTP: benchmark/results/h200_hit_latency_ab_extend_graphs_{off,on}.json).
CUDA_DEFAULT_CUDA_GRAPH_MAX_EXTEND_TOKENS = 256


def resolve_overlap(args: "ServerArgs") -> None:
    """Overlap scheduling: on for CUDA unless disabled, off on the CPU unless forced.

    Raises:
        ValueError: both --enable-overlap-schedule and --disable-overlap-schedule.
    """
    if args.enable_overlap_schedule and args.disable_overlap_schedule:
        raise ValueError("--enable-overlap-schedule and --disable-overlap-schedule contradict each other")
    if args.device != "cuda" and not args.enable_overlap_schedule and not args.disable_overlap_schedule:
        args.disable_overlap_schedule = True
        logger.info("Overlap scheduling off: --device %s (--enable-overlap-schedule forces it on)", args.device)


def resolve_cuda_graph(args: "ServerArgs") -> None:
    """--cuda-graph-max-bs / --cuda-graph-max-extend-tokens defaults, and the cases where a
    pass cannot be captured (then graphs of that kind are off, logged).

    Raises:
        ValueError: a value out of range, or extend graphs asked of a prefill backend that
            cannot be captured.
    """
    if args.cuda_graph_max_bs is not None and args.cuda_graph_max_bs < 1:
        raise ValueError(f"--cuda-graph-max-bs must be >= 1, got {args.cuda_graph_max_bs}")
    asked = args.cuda_graph_max_extend_tokens
    if asked is not None and asked < 0:
        raise ValueError(f"--cuda-graph-max-extend-tokens must be >= 0 (0: no extend graphs), got {asked}")
    if args.device != "cuda":
        if not args.disable_cuda_graph:
            args.disable_cuda_graph = True
            logger.info("CUDA graphs off: --device %s", args.device)
        if asked:
            logger.info("--cuda-graph-max-extend-tokens %d ignored: --device %s has no CUDA graphs",
                        asked, args.device)
        args.cuda_graph_max_extend_tokens = 0
        return
    if args.cuda_graph_max_bs is None:
        args.cuda_graph_max_bs = CUDA_DEFAULT_CUDA_GRAPH_MAX_BS
    if not args.disable_cuda_graph and args.decode_attention_backend == "torch_native":
        args.disable_cuda_graph = True
        logger.info("CUDA graphs off: --decode-attention-backend torch_native cannot be captured "
                    "(its decode reads per-batch lengths on the host); use triton or fa3 for graphs")
    # Mixture-of-experts layers need no rule for decode graphs: while a graph is captured they
    # run densely, without reading the routing back to the host (hiserve/layers/moe.py).
    _resolve_extend_graphs(args, asked)


def _resolve_extend_graphs(args: "ServerArgs", asked: int | None) -> None:
    """Extend graphs need graphs on and a prefill backend with static varlen metadata (fa3);
    a mixture-of-experts model gets them only when asked for."""
    if args.disable_cuda_graph:
        if asked:
            logger.info("--cuda-graph-max-extend-tokens %d ignored: CUDA graphs are off", asked)
        args.cuda_graph_max_extend_tokens = 0
        return
    if args.prefill_attention_backend != "fa3":
        if asked:
            raise ValueError(f"--cuda-graph-max-extend-tokens {asked} needs --prefill-attention-backend fa3 "
                             f"(got {args.prefill_attention_backend}); use 0")
        args.cuda_graph_max_extend_tokens = 0
        logger.info("Extend passes run eagerly (no extend graphs): prefill backend %s has no capturable "
                    "varlen metadata (fa3 has)",
                    args.prefill_attention_backend)
        return
    if asked is not None:
        return
    if args.model_config().n_routed_experts:
        # Under a graph the routed experts run densely (every expert on every token, see
        # layers/moe.py): cheap for a decode batch, E/k times the expert work for 257 rows.
        args.cuda_graph_max_extend_tokens = 0
        logger.info("Extend passes run eagerly: a mixture-of-experts model would run every expert on "
                    "every token under a graph (--cuda-graph-max-extend-tokens N asks for it anyway)")
        return
    args.cuda_graph_max_extend_tokens = CUDA_DEFAULT_CUDA_GRAPH_MAX_EXTEND_TOKENS
