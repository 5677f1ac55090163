"""The cross-flag rules of tensor parallelism (`--tp-size`, `--dist-init-addr`, `--dist-timeout`),
applied by `ServerArgs.resolve()`."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from hiserve.server_args import ServerArgs

logger = logging.getLogger("hiserve.server_args")


def resolve_tp(args: "ServerArgs") -> None:
    """Check and complete the TP flags of `args` (not yet frozen).

    - `--quantization gguf` keeps projections as CPU int4 blocks that have no tensor-parallel
      split here, so TP > 1 refuses it; with `--quantization` unset, TP > 1 picks `none`
      (the weights are dequantized to `--dtype`, then sliced), logged.

    Raises:
        ValueError: a value out of range, or a combination TP cannot run.
    """
    if args.tp_size < 1:
        raise ValueError(f"--tp-size must be >= 1, got {args.tp_size}")
    if args.dist_timeout <= 0:
        raise ValueError(f"--dist-timeout must be > 0 seconds, got {args.dist_timeout}")
    if args.dist_init_addr is not None:
        host, _, port = args.dist_init_addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--dist-init-addr must be host:port, got {args.dist_init_addr!r}")
    if args.tp_size == 1:
        return
    if args.quantization == "gguf":
        raise ValueError(f"--quantization gguf (int4 CPU GEMM) cannot be split over --tp-size {args.tp_size}; "
                         f"use --quantization none (the GGUF is dequantized to --dtype, then sharded)")
    if args.quantization is None:
        args.quantization = "none"
        logger.info("--quantization not given -> none (--tp-size %d: the int4 GGUF path is TP=1 only)",
                    args.tp_size)
    if args.device == "cuda":
        import torch

        if torch.cuda.device_count() < args.tp_size:
            raise ValueError(f"--tp-size {args.tp_size} needs {args.tp_size} CUDA devices, "
                             f"{torch.cuda.device_count()} visible")
