"""A request's scheduler-side state (`Req`) and the batch the scheduler runs (`ScheduleBatch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hiserve.engine.sampling_params import SamplingParams
from hiserve.layers.forward_batch import ForwardMode


class Req:
    """One sequence being generated.

    KV ownership: `prefix_indices` are the device slots of tokens whose KV existed when
    this round started (matched in the radix cache, or computed by earlier chunks);
    slots of newer tokens are recorded only in `req_to_token[req_pool_idx]`.
    """

    def __init__(self, rid: str, input_ids: list[int], sampling_params: SamplingParams,
                 stream: bool, max_new_tokens: int, eos_token_ids: set[int]):
        self.rid = rid
        self.origin_input_ids = input_ids
        self.sampling_params = sampling_params
        self.stream = stream
        self.max_new_tokens = max_new_tokens
        self.output_ids: list[int] = []
        # Tokens whose KV exists after the current round (prefix + this round's extend).
        self.fill_ids: list[int] = []
        self.req_pool_idx: Optional[int] = None
        self.prefix_indices: torch.Tensor = torch.empty(0, dtype=torch.int64)
        self.last_node: Any = None
        self.extend_input_len = 0
        self.finished_reason: Optional[dict[str, Any]] = None
        self.cached_tokens_device = 0
        self.cached_tokens_host = 0
        self.host_hit_length = 0  # tokens of the current match that sit on the host tier
        self.admitted_once = False
        self.sent_offset = 0  # output ids already sent to the API process

        self.stop_token_ids = set(sampling_params.stop_token_ids or ())
        if not sampling_params.ignore_eos:
            self.stop_token_ids |= eos_token_ids
        self.stop_strs = sampling_params.stop_strs
        # Every token decodes to at least one byte, so a stop string of B UTF-8 bytes that ends in
        # the newest token lies within the last B tokens (in characters it could span more
        # tokens: a 4-byte emoji is often several byte-level tokens).
        self._stop_tail_tokens = max((len(s.encode("utf-8")) for s in self.stop_strs), default=0) + 1

    # ------------------------------------------------------------------ lengths
    @property
    def seqlen(self) -> int:
        """Tokens of the sequence so far (prompt + output)."""
        return len(self.origin_input_ids) + len(self.output_ids)

    def init_next_round_input(self) -> None:
        """Start (or restart, after retraction) the prefill of prompt + output so far."""
        self.fill_ids = self.origin_input_ids + self.output_ids

    @property
    def finished(self) -> bool:
        return self.finished_reason is not None

    # ------------------------------------------------------------------ finish
    def check_finished(self, tokenizer: Any, context_len: int) -> None:
        """Set `finished_reason` if the newest output token ends the request."""
        if self.finished_reason is not None:
            return
        n_out = len(self.output_ids)
        last = self.output_ids[-1]
        past_min = n_out >= self.sampling_params.min_new_tokens
        if past_min and last in self.stop_token_ids:
            self.finished_reason = {"type": "stop", "matched": last}
            return
        if past_min and self.stop_strs:
            # Decode only a tail long enough to hold any stop string: O(1) per step. A character cut
            # at the tail's start decodes to U+FFFD, which no match that ends later can need.
            tail_tokens = self.output_ids[-self._stop_tail_tokens:]
            tail = tokenizer.decode(tail_tokens, skip_special_tokens=False)
            for s in self.stop_strs:
                if s in tail:
                    self.finished_reason = {"type": "stop", "matched": s}
                    return
        if n_out >= self.max_new_tokens:
            self.finished_reason = {"type": "length", "length": self.max_new_tokens}
            return
        if self.seqlen >= context_len:
            self.finished_reason = {"type": "length", "length": n_out}

    def abort(self, message: str, status_code: Optional[int] = None) -> None:
        self.finished_reason = {"type": "abort", "message": message,
                                "status_code": status_code, "err_type": None}


@dataclass
class ScheduleBatch:
    """Requests that run together in one forward pass, with their device tensors."""

    reqs: list[Req]
    forward_mode: ForwardMode
    input_ids: torch.Tensor  # [T] int64
    positions: torch.Tensor  # [T] int64
    out_cache_loc: torch.Tensor  # [T] int64
    req_pool_indices: torch.Tensor  # [B] int64
    seq_lens: torch.Tensor  # [B] int64
    seq_lens_cpu: list[int]
    extend_seq_lens_cpu: list[int]
    extend_prefix_lens_cpu: list[int]
    chunked_req: Optional[Req] = None  # the request whose prompt is not finished after this pass

    @property
    def batch_size(self) -> int:
        return len(self.reqs)
