"""One sampling step's inputs and outputs, split at the host/device boundary.

`SamplingPlan` is everything sampling needs from the requests (their parameters, the
logprob rows, the rows of the logits to sample), built on the scheduler's thread. Sampling
then works on device tensors only (`ModelRunner.sample_on_device` → `SampleOutput`), so the
overlap worker (`hiserve.engine.tp_worker_overlap`) can run it right after the forward
without reading any request state. `SampleOutput.to_host` copies the small results to the
host (pinned memory, non-blocking on CUDA); `SampleResult` is what result processing reads:
plain Python lists, indexed by the row of the request among the sampled ones.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hiserve.engine.sampler import SamplingBatchInfo


@dataclass
class SamplingPlan:
    """Host-side preparation of one sampling step (built before the forward is launched).

    Attributes:
        info: the batch's sampling tensors (on the logits' device).
        select: [S] int64 rows of the logits to sample (device), or None for all rows (a
            prefill pass whose chunked request takes no token has S < B).
        logprob_rows: indices (among the sampled rows) that want output logprobs.
        logprob_index: the same as a [R] int64 device tensor, or None when R = 0.
        top_k: the largest top_logprobs_num among those rows (0: none).
        grammar: the grammar backend when a sampled request is constrained, else None.
    """

    info: SamplingBatchInfo
    select: Optional[torch.Tensor]
    logprob_rows: list[int]
    logprob_index: Optional[torch.Tensor]
    top_k: int
    grammar: Any = None


@dataclass
class SampleOutput:
    """Sampled tokens and their logprobs as tensors (device, or host after `to_host`).

    Attributes:
        next_ids: [S] int64 sampled tokens.
        token_logprobs: [R] float32 logprob of each logprob row's token, or None.
        top_values, top_ids: [R, k] float32 / int64 best-first top logprobs, or None.
    """

    next_ids: torch.Tensor
    token_logprobs: Optional[torch.Tensor] = None
    top_values: Optional[torch.Tensor] = None
    top_ids: Optional[torch.Tensor] = None

    def to_host(self, non_blocking: bool) -> "SampleOutput":
        """Copies on the host. With `non_blocking` (CUDA) they land in pinned memory and are
        valid only after an event recorded after this call has completed."""

        def copy(t: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            if t is None or t.device.type == "cpu":
                return t
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=non_blocking)
            out.copy_(t, non_blocking=non_blocking)
            return out

        return SampleOutput(copy(self.next_ids), copy(self.token_logprobs), copy(self.top_values),
                            copy(self.top_ids))


class SampleResult:
    """A finished sampling step on the host, read by result processing.

    Args:
        out: a host `SampleOutput` (complete: its copies have finished).
        logprob_rows: the sampled rows the logprob tensors cover, in order.
    """

    def __init__(self, out: SampleOutput, logprob_rows: list[int]):
        self.next_ids: list[int] = out.next_ids.tolist()
        self._row_of = {row: j for j, row in enumerate(logprob_rows)}
        self._token_lp = out.token_logprobs.tolist() if out.token_logprobs is not None else []
        self._tops: Optional[list[list[tuple[float, int]]]] = None
        if out.top_values is not None:
            self._tops = [list(zip(v, i)) for v, i in zip(out.top_values.tolist(), out.top_ids.tolist())]

    def record_logprobs(self, req: Any, row: int) -> None:
        """Append row `row`'s token logprob (and top logprobs) to `req` if it asked for them."""
        j = self._row_of.get(row)
        if j is None:
            return
        req.output_token_logprobs.append((self._token_lp[j], self.next_ids[row]))
        if req.top_logprobs_num and self._tops is not None:
            req.output_top_logprobs.append(self._tops[j][:req.top_logprobs_num])
