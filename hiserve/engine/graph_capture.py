"""Capturing a model forward into CUDA graphs: what the DECODE graphs (`cuda_graph_runner.py`)
and the one-request EXTEND graphs (`extend_graph_runner.py`) share.

`capture_graphs` captures one graph per size, largest first into one memory pool (the
smaller graphs then reuse the largest one's memory), and logs what they took;
`capture_forward` is one capture: warm-up runs on the capture stream first, so kernels that
set themselves up lazily (cuBLAS workspaces, autotuned configs) do it outside the capture.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from hiserve.layers.forward_batch import ForwardBatch

logger = logging.getLogger(__name__)

WARMUP_RUNS = 2


def capture_forward(model: Any, forward_batch: ForwardBatch, stream: torch.cuda.Stream, pool: Any,
                    device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """Capture `model.forward(forward_batch)` on `stream` into memory pool `pool`.

    Returns:
        (the graph, its output tensor: the logits a replay writes).
    Raises:
        RuntimeError: what CUDA raised during the warm-up or the capture.
    """
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(WARMUP_RUNS):
            model.forward(forward_batch)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        out = model.forward(forward_batch)
    return graph, out


def capture_graphs(device: torch.device, sizes: list[int], capture_one: Callable[[int, torch.cuda.Stream], None],
                   failure: Callable[[int], str], what: str) -> None:
    """Call `capture_one(size, stream)` for each of `sizes`, largest first, in inference mode,
    then log `what`, the sizes, the seconds and the device memory they took.

    Raises:
        RuntimeError: a capture failed; the message is `failure(size)` and CUDA's own.
    """
    torch.cuda.synchronize(device)
    free_before = torch.cuda.mem_get_info(device)[0]
    start = time.perf_counter()
    stream = torch.cuda.Stream(device)
    with torch.inference_mode():
        for size in sorted(sizes, reverse=True):
            try:
                capture_one(size, stream)
            except RuntimeError as e:
                raise RuntimeError(f"{failure(size)}: {e}") from e
    torch.cuda.synchronize(device)
    used = free_before - torch.cuda.mem_get_info(device)[0]
    logger.info("Captured %d %s (%s) in %.1f s, %.1f MB of device memory", len(sizes), what, sorted(sizes),
                time.perf_counter() - start, used / 1e6)
