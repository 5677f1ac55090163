"""CUDA graphs of short one-request EXTEND passes: a follow-up turn on a cached prefix.

A device hit's own compute is small (64 new tokens of an 8B model: a few ms on an H200),
but run eagerly it launches ~10 kernels per layer from Python, each a few tens of µs of
host time, so the host, not the GPU, sets its latency. Replaying a graph launches them in
one call. (SGLang reaches the same end with piecewise graphs of the non-attention parts;
an FA3 pass over paged KV can be captured whole because all its varlen metadata are
device tensors.)

- Shapes: a graph has `N = bucket + 1` token rows for buckets 8, 16, 32, ... up to
  `--cuda-graph-max-extend-tokens`. An extend of t <= bucket tokens of ONE request runs in
  the smallest graph with t < N: rows 0..t-1 are the request's, rows t..N-1 a padding
  request on the padding row of `req_to_token` (context = its N - t rows, all in the
  padding page; its K/V go to slot 0). One padding row always exists, so no request of
  the pass ever has zero new tokens.
- Logits: the static `last_token_index` [2] = (t - 1, N - 1) picks the two requests'
  last rows; the request's row is returned.
- What runs eagerly: more than one request, more than the largest bucket, prompt logprobs
  (their rows vary), and every pass when extend graphs are off.
- Load-back: a graph cannot wait per layer, so a replay that reads a load-back first makes
  the compute stream wait for the whole load (`LoadTicket.wait_all`); the load still
  overlaps the host work of preparing the pass.
- Graphs share the DECODE graphs' memory pool (passes never overlap on the device).

`capture=False` keeps the static buffers and the padding but runs the model eagerly on
them instead of replaying: the same computation a graph would replay, checkable on the CPU.
The logits a replay returns are a view of a static output: valid until the next replay.
"""

from __future__ import annotations

import bisect
from typing import Any

import torch

from hiserve.engine.graph_capture import capture_forward, capture_graphs
from hiserve.layers.forward_batch import ForwardBatch, ForwardMode


def extend_graph_buckets(max_tokens: int) -> list[int]:
    """The most new tokens each graph takes, ascending: 8, 16, 32, ... < max_tokens, and max_tokens.

    Raises:
        ValueError: max_tokens < 1.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    buckets, b = [], 8
    while b < max_tokens:
        buckets.append(b)
        b *= 2
    return buckets + [max_tokens]


class ExtendGraphRunner:
    """Captures and replays one-request EXTEND passes of `model`.

    Args:
        model: the model (`forward(ForwardBatch) -> [B, vocab]` float32 logits).
        attn_backend: its attention backend, with `supports_extend_cuda_graph`.
        req_to_token_pool: with a `padding_row`.
        token_to_kv_pool: the device KV pool.
        max_tokens: the most new tokens a replayed pass may have (`--cuda-graph-max-extend-tokens`).
        graph_pool: a CUDA graph memory pool to share (the DECODE graphs'), or None.
        capture: False runs the static-buffer pass eagerly instead of capturing (CPU tests).
    Raises:
        ValueError: capture on a non-CUDA device, a backend that cannot be captured, no
            padding row, or max_tokens < 1.
        RuntimeError: a capture failed (the message names the graph's size).
    """

    def __init__(self, model: Any, attn_backend: Any, req_to_token_pool: Any, token_to_kv_pool: Any,
                 max_tokens: int, graph_pool: Any = None, capture: bool = True) -> None:
        self.model, self.attn_backend = model, attn_backend
        self.req_to_token_pool, self.token_to_kv_pool = req_to_token_pool, token_to_kv_pool
        self.device = token_to_kv_pool.device
        if capture and torch.device(self.device).type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, got {self.device}")
        if not getattr(attn_backend, "supports_extend_cuda_graph", False):
            raise ValueError(f"{type(attn_backend).__name__} cannot capture EXTEND passes")
        self.padding_row = req_to_token_pool.padding_row
        if self.padding_row is None:
            raise ValueError("extend graphs need a ReqToTokenPool created with padding_row=True")
        self.buckets = extend_graph_buckets(max_tokens)
        self.max_tokens = max_tokens
        self.use_graphs = capture
        n, dev = max_tokens + 1, self.device
        with torch.inference_mode():
            self.input_ids = torch.zeros(n, dtype=torch.int64, device=dev)
            self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
            self.out_cache_loc = torch.zeros(n, dtype=torch.int64, device=dev)
            self.req_pool_indices = torch.full((2,), self.padding_row, dtype=torch.int64, device=dev)
            self.seq_lens = torch.ones(2, dtype=torch.int64, device=dev)
            self.last_token_index = torch.zeros(2, dtype=torch.int64, device=dev)
            attn_backend.init_extend_graph_state()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.graph_pool = graph_pool
        if capture:
            self.capture()

    def _forward_batch(self, rows: int) -> ForwardBatch:
        """The static EXTEND pass of `rows` token rows: the request (1 token at capture) + padding."""
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=2, input_ids=self.input_ids[:rows],
            positions=self.positions[:rows], out_cache_loc=self.out_cache_loc[:rows],
            req_pool_indices=self.req_pool_indices, seq_lens=self.seq_lens, seq_lens_cpu=[1, rows - 1],
            extend_seq_lens_cpu=[1, rows - 1], extend_prefix_lens_cpu=[0, 0],
            req_to_token_pool=self.req_to_token_pool, token_to_kv_pool=self.token_to_kv_pool,
            attn_backend=self.attn_backend, last_token_index=self.last_token_index)

    # ------------------------------------------------------------------ capture
    def capture(self) -> None:
        """One graph per bucket, largest first (the smaller ones reuse its memory)."""
        if self.graph_pool is None:
            self.graph_pool = torch.cuda.graph_pool_handle()
        capture_graphs(torch.device(self.device), [b + 1 for b in self.buckets], self._capture_one,
                       lambda rows: f"CUDA graph capture of a {rows - 1}-token extend failed (run with "
                                    "--cuda-graph-max-extend-tokens 0 to run extends eagerly)",
                       "extend CUDA graphs of one request, token rows (new tokens + 1)")

    def _capture_one(self, rows: int, stream: torch.cuda.Stream) -> None:
        self._fill_capture_inputs(rows)
        self.graphs[rows], self.outputs[rows] = capture_forward(self.model, self._forward_batch(rows), stream,
                                                                self.graph_pool, torch.device(self.device))

    def _fill_capture_inputs(self, rows: int) -> None:
        """Both requests on the padding row, writing slot 0: the request 1 token, padding the rest."""
        self.input_ids.zero_()
        self.positions.zero_()
        self.out_cache_loc.zero_()
        self.req_pool_indices.fill_(self.padding_row)
        self.seq_lens.copy_(torch.tensor([1, rows - 1]))
        self.last_token_index.copy_(torch.tensor([0, rows - 1]))
        self.attn_backend.init_forward_metadata_capture_extend_graph(rows)

    # ------------------------------------------------------------------ replay
    def can_run(self, forward_batch: ForwardBatch) -> bool:
        """An EXTEND pass of one request with at most `max_tokens` new tokens and no prompt logprobs."""
        return (forward_batch.forward_mode.is_extend() and forward_batch.batch_size == 1
                and forward_batch.num_tokens <= self.max_tokens and forward_batch.input_logprob_rows is None)

    def replay(self, forward_batch: ForwardBatch) -> torch.Tensor:
        """Run `forward_batch` (`can_run`) in the smallest graph that holds it.

        Returns:
            float32 logits `[1, vocab]`, a view of a static output (valid until the next replay).
        Raises:
            IndexError: more new tokens than the largest bucket (`can_run` says False).
        """
        t = forward_batch.num_tokens
        rows = self.buckets[bisect.bisect_left(self.buckets, t)] + 1
        # Device-to-device copies and scalar fills only: nothing waits for the device.
        self.input_ids[:t].copy_(forward_batch.input_ids)
        self.positions[:t].copy_(forward_batch.positions)
        self.out_cache_loc[:t].copy_(forward_batch.out_cache_loc)
        self.input_ids[t:rows].zero_()
        self.positions[t:rows].zero_()
        self.out_cache_loc[t:rows].zero_()  # slot 0: the padding page
        self.req_pool_indices[:1].copy_(forward_batch.req_pool_indices)
        self.seq_lens[:1].copy_(forward_batch.seq_lens)
        self.seq_lens[1].fill_(rows - t)
        self.last_token_index[0].fill_(t - 1)
        self.last_token_index[1].fill_(rows - 1)
        self.attn_backend.init_forward_metadata_replay_extend_graph(
            rows, self.req_pool_indices[:1], self.seq_lens[:1], forward_batch.seq_lens_cpu[0], t)
        if self.use_graphs:
            self.graphs[rows].replay()
            return self.outputs[rows][:1]
        return self.model.forward(self._forward_batch(rows))[:1]
