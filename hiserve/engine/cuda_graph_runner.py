"""CUDA graphs of the model's DECODE forward, one per batch size, replayed instead of eager runs.

A decode step launches hundreds of small kernels; replaying a captured graph launches them
in one call. Each graph reads its inputs from static buffers (`input_ids`, `positions`,
`out_cache_loc`, `req_pool_indices`, `seq_lens`, sized for the largest batch) and writes
logits to a static output, so a replay copies the batch in, lets the attention backend
refill its own static metadata, and replays.

- Batch sizes captured: 1, 2, 4, 8, then every 8 up to 128, then every 16, up to `max_bs`
  (max_bs itself always included). A batch runs in the smallest graph that holds it; the
  extra rows are dummy requests on the padding row of `req_to_token` (all slot 0, the
  padding page), with seq_len `attn_backend.get_cuda_graph_seq_len_fill_value()`, and
  they write their K/V into slot 0.
- All graphs share one memory pool and are captured largest first, so the smaller ones
  reuse the largest one's memory (`graph_capture.py`, shared with the extend graphs).
- Sampling stays outside the graph (it reads per-request settings on the host).
- Host -> device load-back never concerns a decode replay: only the EXTEND batch that reads
  a load-back waits for it (per layer when eager, as a whole before an extend-graph replay:
  extend_graph_runner.py), and decode batches carry no load, so a decode replay waits for
  nothing and the compute stream's order covers earlier loads.

The logits a replay returns are a view of the graph's output buffer: valid until the next replay.
"""

from __future__ import annotations

import bisect
import logging
from typing import TYPE_CHECKING, Any

import torch

from hiserve.engine.graph_capture import capture_forward, capture_graphs
from hiserve.layers.forward_batch import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from hiserve.engine.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """Batch sizes to capture, ascending: 1, 2, 4, 8, 16, 24, ..., 128, 144, 160, ... <= max_bs,
    and max_bs itself.

    Raises:
        ValueError: max_bs < 1.
    """
    if max_bs < 1:
        raise ValueError(f"max_bs must be >= 1, got {max_bs}")
    grid = [1, 2, 4, 8, *range(16, 129, 8), *range(144, max_bs + 1, 16)]
    sizes = [bs for bs in grid if bs <= max_bs]
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


class CudaGraphRunner:
    """Captures and replays the DECODE forward of `model_runner.model`.

    Args:
        model_runner: a ModelRunner on CUDA: `model`, `attn_backend` (with
            `supports_cuda_graph`), `req_to_token_pool` (with a `padding_row`),
            `token_to_kv_pool`, `max_running_requests`, `device`, and
            `server_args.cuda_graph_max_bs`.
    Raises:
        ValueError: the device is not CUDA, the backend cannot be captured, the request
            table has no padding row, or `cuda_graph_max_bs` is unset.
        RuntimeError: a capture failed (the message names the batch size).
    """

    def __init__(self, model_runner: "ModelRunner") -> None:
        self.model = model_runner.model
        self.attn_backend = model_runner.attn_backend
        self.req_to_token_pool = model_runner.req_to_token_pool
        self.token_to_kv_pool = model_runner.token_to_kv_pool
        self.device = torch.device(model_runner.device)
        if self.device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        if not getattr(self.attn_backend, "supports_cuda_graph", False):
            raise ValueError(f"{type(self.attn_backend).__name__} cannot run under CUDA graphs")
        self.padding_row = self.req_to_token_pool.padding_row
        if self.padding_row is None:
            raise ValueError("CUDA graphs need a ReqToTokenPool created with padding_row=True")

        max_bs = model_runner.server_args.cuda_graph_max_bs
        if max_bs is None:
            raise ValueError("--cuda-graph-max-bs is unset (ServerArgs.resolve() sets it on CUDA)")
        # Graphs larger than the most requests that can run together would never replay.
        self.max_bs = min(max_bs, model_runner.max_running_requests)
        if self.max_bs < max_bs:
            logger.info("CUDA graphs up to batch %d, not --cuda-graph-max-bs %d: at most %d requests "
                        "run together (--max-running-requests)", self.max_bs, max_bs, self.max_bs)
        self.capture_bs = capture_batch_sizes(self.max_bs)
        self.fill_seq_len = self.attn_backend.get_cuda_graph_seq_len_fill_value()

        with torch.inference_mode():
            n, dev = self.max_bs, self.device
            self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
            self.positions = torch.full((n,), self.fill_seq_len - 1, dtype=torch.int64, device=dev)
            self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
            self.req_pool_indices = torch.full((n,), self.padding_row, dtype=torch.int64, device=dev)
            self.seq_lens = torch.full((n,), self.fill_seq_len, dtype=torch.int64, device=dev)
            self.attn_backend.init_cuda_graph_state(self.max_bs)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graph_pool: Any = None
        self.capture()

    # ------------------------------------------------------------------ capture
    def _forward_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        """A DECODE batch of `bs` requests whose tensors are views of the static buffers."""
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            positions=self.positions[:bs], out_cache_loc=self.out_cache_loc[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            seq_lens_cpu=seq_lens_cpu, extend_seq_lens_cpu=[1] * bs,
            extend_prefix_lens_cpu=[s - 1 for s in seq_lens_cpu],
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend)

    def capture(self) -> None:
        """Capture one graph per size in `capture_bs`, largest first, into one shared memory pool."""
        self.graph_pool = torch.cuda.graph_pool_handle()
        capture_graphs(self.device, self.capture_bs, self._capture_one,
                       lambda bs: f"CUDA graph capture failed at batch size {bs} "
                                  "(run with --disable-cuda-graph to serve without graphs)",
                       "DECODE CUDA graphs, batch sizes")

    def _capture_one(self, bs: int, stream: torch.cuda.Stream) -> None:
        fb = self._forward_batch(bs, [self.fill_seq_len] * bs)
        self.attn_backend.init_forward_metadata_capture_cuda_graph(
            bs, self.req_pool_indices[:bs], self.seq_lens[:bs])
        self.graphs[bs], self.outputs[bs] = capture_forward(self.model, fb, stream, self.graph_pool, self.device)

    # ------------------------------------------------------------------ replay
    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """A DECODE batch of at most `max_bs` requests."""
        return forward_batch.forward_mode.is_decode() and forward_batch.batch_size <= self.max_bs

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Run `forward_batch` (DECODE, `can_run`) through the smallest graph that holds it.

        Returns:
            float32 logits `[B, vocab]`, a view of the graph's output (valid until the next replay).
        """
        raw_bs = forward_batch.batch_size
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, raw_bs)]
        self.input_ids[:raw_bs].copy_(forward_batch.input_ids)
        self.positions[:raw_bs].copy_(forward_batch.positions)
        self.out_cache_loc[:raw_bs].copy_(forward_batch.out_cache_loc)
        self.req_pool_indices[:raw_bs].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:raw_bs].copy_(forward_batch.seq_lens)
        seq_lens_cpu = list(forward_batch.seq_lens_cpu)
        if bs > raw_bs:  # a larger batch may have left real requests in these rows
            self.input_ids[raw_bs:bs].zero_()
            self.positions[raw_bs:bs].fill_(self.fill_seq_len - 1)
            self.out_cache_loc[raw_bs:bs].zero_()
            self.req_pool_indices[raw_bs:bs].fill_(self.padding_row)
            self.seq_lens[raw_bs:bs].fill_(self.fill_seq_len)
            seq_lens_cpu += [self.fill_seq_len] * (bs - raw_bs)
        self.attn_backend.init_forward_metadata_replay_cuda_graph(
            bs, self.req_pool_indices[:bs], self.seq_lens[:bs], seq_lens_cpu)
        self.graphs[bs].replay()
        return self.outputs[bs][:raw_bs]
