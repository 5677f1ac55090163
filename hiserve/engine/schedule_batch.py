"""A request's scheduler-side state (`Req`) and the batch the scheduler runs (`ScheduleBatch`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch

from hiserve.engine.sampling_params import SamplingParams
from hiserve.layers.forward_batch import ForwardMode
from hiserve.mem_cache.kv_manager import ReqKV


class Req:
    """One sequence being generated.

    Its KV bookkeeping (`kv`: row, cached prefix, lock) belongs to the KV manager
    (hiserve/mem_cache/kv_manager.py); the scheduler only reads it.
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
        self.kv = ReqKV()
        self.extend_input_len = 0
        self.finished_reason: Optional[dict[str, Any]] = None
        self.sent_offset = 0  # output ids already sent to the API process
        self.finished_sent = False  # its final reply (with finished_reason) has been sent

        self.stop_token_ids = set(sampling_params.stop_token_ids or ())
        if not sampling_params.ignore_eos:
            self.stop_token_ids |= eos_token_ids
        self.stop_strs = sampling_params.stop_strs
        # Every token decodes to at least one byte, so a stop string of B UTF-8 bytes that ends in
        # the newest token lies within the last B tokens (in characters it could span more
        # tokens: a 4-byte emoji is often several byte-level tokens).
        self._stop_tail_tokens = max((len(s.encode("utf-8")) for s in self.stop_strs), default=0) + 1

        # Logprobs (set by `hiserve.engine.logprobs.init_req_logprobs`; see that module).
        self.return_logprob = False
        self.top_logprobs_num = 0
        self.input_logprob_next = 0  # first prompt position whose logprob is still owed; 0 = none owed
        self.input_token_logprobs: list[tuple[Optional[float], int]] = []
        self.input_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_logprobs_sent = False
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        # An xgrammar GrammarMatcher when the request is constrained (created at its first step).
        self.grammar: Any = None

        # Overlap scheduling (hiserve.engine.scheduler_overlap); all stay 0 / None without it.
        self.num_pending_tokens = 0  # sampled by a launched forward, not yet read back (0 or 1)
        self.future_slot = -1  # where that token waits in the worker's future-token buffer
        self.num_inflight = 0  # launched batches holding this request whose results are unprocessed
        self.release_pending: Optional[bool] = None  # KV release deferred until num_inflight is 0:
        # True = cache it (finished), False = free it uncached (an aborted chunked prompt)

    # ------------------------------------------------------------------ lengths
    @property
    def seqlen(self) -> int:
        """Tokens of the sequence so far (prompt + output)."""
        return len(self.origin_input_ids) + len(self.output_ids)

    def prefix_match_len(self) -> int:
        """How many leading tokens of `fill_ids` may come from the prefix cache.

        The last token is always recomputed (its logits pick the next token). A request that
        still owes prompt logprobs from position s matches at most s - 1 tokens, so the
        prefill computes the logits at positions s - 1 .. len - 2 that give them.
        """
        limit = len(self.fill_ids) - 1
        if self.input_logprob_next > 0:
            limit = min(limit, self.input_logprob_next - 1)
        return max(0, limit)

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
        if self.grammar is not None and self.grammar.is_terminated():
            # The grammar accepted its stop token (or, with ignore_eos, nothing more fits).
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
    # The load-back this batch reads (a LoadTicket), waited for per layer during its forward only.
    load_ticket: Any = None
    # Prompt logprobs (EXTEND only, see hiserve.engine.logprobs): per request, the local rows
    # of its extended tokens whose logits are wanted, and the logits the pass returned for them.
    input_logprob_rows: Optional[list[range]] = None
    input_logits: Optional[torch.Tensor] = None  # [sum of rows, V] float32
    input_logprob_index: Optional[torch.Tensor] = None  # [sum of rows] int64 flat rows (device)
    grammar_started: bool = False  # the grammar masks of its requests are being built
    # Overlap scheduling: input_ids holds -(slot + 1) for tokens still in the worker's
    # future-token buffer; `result` is the launched forward's ForwardResult.
    has_future_ids: bool = False
    result: Any = None

    @property
    def sampled_reqs(self) -> list[Req]:
        """The requests that take a token from this pass (all but a chunked prompt)."""
        if self.chunked_req is None:
            return self.reqs
        return [r for r in self.reqs if r is not self.chunked_req]

    def sampled_rows(self) -> Optional[list[int]]:
        """Logits rows of `sampled_reqs`, or None when that is every row."""
        if self.chunked_req is None:
            return None
        return [i for i, r in enumerate(self.reqs) if r is not self.chunked_req]

    @property
    def batch_size(self) -> int:
        return len(self.reqs)
