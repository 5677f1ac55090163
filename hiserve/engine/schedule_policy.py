"""Admission of waiting requests into a prefill batch: queue order, token budgets, chunking."""

from __future__ import annotations

from enum import Enum, auto
from typing import Optional

from hiserve.engine.schedule_batch import Req
from hiserve.mem_cache.kv_manager import KVManager

# Past this queue length, lpm's per-request prefix match costs more than it saves.
_LPM_MAX_QUEUE = 128
# A running request's future decode tokens are reserved up to this many (SGLang clips the same way).
_DECODE_RESERVE_CLIP = 4096


def order_waiting_queue(policy: str, waiting: list[Req], kv: KVManager) -> None:
    """Sort `waiting` in place: fcfs keeps arrival order; lpm puts the longest cached prefix first."""
    if policy != "lpm" or len(waiting) > _LPM_MAX_QUEUE or not kv.shares_prefixes:
        return
    lengths = {id(req): kv.cached_len(req.origin_input_ids + req.output_ids) for req in waiting}
    waiting.sort(key=lambda r: -lengths[id(r)])


class AddResult(Enum):
    CONTINUE = auto()  # admitted; try the next one
    NO_TOKEN = auto()  # out of KV budget
    OTHER = auto()  # a per-batch budget (input tokens, chunk, request count) is spent


class PrefillAdder:
    """Admits requests into one prefill batch while its budgets last.

    Budgets, in tokens: `rem_total_tokens` = the KV manager's room (free + evictable +
    pending device slots) minus what the running requests will still decode (scaled by
    `new_token_ratio`, an estimate of the fraction of max_new_tokens a request really
    uses); `rem_input_tokens` = --max-prefill-tokens; `rem_chunk_tokens` =
    --chunked-prefill-size. A request is admitted through the KV manager only once the
    budget accepts it, so a refused request starts no load-back and evicts nothing.
    """

    def __init__(self, kv: KVManager, running: list[Req], new_token_ratio: float,
                 max_prefill_tokens: int, chunked_prefill_size: Optional[int], page_size: int,
                 max_new_reqs: int):
        self.kv = kv
        self.page_size = page_size
        self.new_token_ratio = new_token_ratio
        reserve = sum(min(r.max_new_tokens - len(r.output_ids), _DECODE_RESERVE_CLIP) for r in running)
        self.rem_total_tokens = kv.room() - int(reserve * new_token_ratio)
        self.rem_input_tokens = max_prefill_tokens
        self.rem_chunk_tokens = chunked_prefill_size if chunked_prefill_size and chunked_prefill_size > 0 else None
        self.max_new_reqs = max_new_reqs
        self.can_run: list[Req] = []
        self.new_chunked_req: Optional[Req] = None

    def _total_need(self, req: Req) -> int:
        """Slots the request still needs: its whole remaining prompt past the device prefix
        (a host part needs device slots too, loaded or recomputed) and its decode reserve,
        rounded up to pages plus one partly filled page."""
        extend_len = len(req.fill_ids) - req.kv.prefix_len
        decode = min(req.max_new_tokens - len(req.output_ids), _DECODE_RESERVE_CLIP)
        tokens = extend_len + int(decode * self.new_token_ratio)
        return (-(-tokens // self.page_size) + 1) * self.page_size

    def _take(self, req: Req, extend_len: int) -> None:
        req.extend_input_len = extend_len
        req.fill_ids = req.fill_ids[: req.kv.prefix_len + extend_len]
        self.rem_input_tokens -= extend_len
        if self.rem_chunk_tokens is not None:
            self.rem_chunk_tokens -= extend_len
        self.can_run.append(req)

    def add_chunked_req(self, req: Req) -> None:
        """Continue the prompt of the request chunked in the previous pass (it holds its locks)."""
        self.rem_total_tokens -= self._total_need(req)
        extend_len = len(req.fill_ids) - req.kv.prefix_len
        limit = self._chunk_limit()
        if limit is not None and extend_len > limit:
            extend_len = limit
            self.new_chunked_req = req
        self._take(req, extend_len)

    def _chunk_limit(self) -> Optional[int]:
        if self.rem_chunk_tokens is None:
            return None
        return self.rem_chunk_tokens // self.page_size * self.page_size

    def add_one_req(self, req: Req) -> AddResult:
        """Try to admit `req`, just matched by the KV manager (`kv.match`)."""
        if len(self.can_run) >= self.max_new_reqs:
            return AddResult.OTHER
        compute_len = len(req.fill_ids) - req.kv.prefix_len - self.kv.loadable_len(req)
        limit = self._chunk_limit()
        if self.rem_input_tokens <= 0 or (limit is not None and limit <= 0):
            return AddResult.OTHER
        if compute_len > self.rem_input_tokens and self.can_run:
            return AddResult.OTHER
        # Lock first: the request's own cached prefix must not count as room for it.
        self.rem_total_tokens -= self.kv.lock(req)
        need = self._total_need(req)
        if need > self.rem_total_tokens:
            self.rem_total_tokens += self.kv.unlock(req)
            return AddResult.NO_TOKEN
        self.rem_total_tokens -= need
        self.kv.admit(req)  # only now: take a row, start the load-back of its host part
        extend_len = len(req.fill_ids) - req.kv.prefix_len
        if limit is not None and extend_len > limit:
            self.new_chunked_req = req
            self._take(req, limit)
            return AddResult.OTHER
        self._take(req, extend_len)
        return AddResult.CONTINUE
