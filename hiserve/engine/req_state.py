"""Per-sequence output state on the API side: detokenized text, stop-string hold-back, metrics.

The tokenizer manager's receive task feeds each scheduler update into `ReqState.update`;
route handlers read `text` (cumulative, never showing a stop string or its beginning),
`output_ids`, `finish_reason` and `meta_info()`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Optional

from hiserve.engine.detokenizer import IncrementalDetokenizer, first_stop, visible_len
from hiserve.engine.io_struct import TokenizedGenerateReqInput
from hiserve.engine.logprobs_format import LogprobState


class ReqState:
    """What the API process knows about one sequence while the scheduler generates it."""

    __slots__ = ("rid", "parent_rid", "index", "stream", "stop_strs", "no_stop_trim", "event", "dirty",
                 "log_metrics", "detok", "shown", "final_text", "finish_reason", "prompt_tokens",
                 "completion_tokens", "cached_device", "cached_host", "cached_storage", "created", "first_token_at",
                 "last_token_at", "finished_at", "logprobs")

    def __init__(self, req: TokenizedGenerateReqInput, parent_rid: str, index: int, tokenizer: Any,
                 event: asyncio.Event, log_metrics: bool):
        sp = req.sampling_params
        self.rid = req.rid
        self.parent_rid = parent_rid
        self.index = index
        self.stream = req.stream
        self.stop_strs = sp.stop_strs
        self.no_stop_trim = sp.no_stop_trim
        self.event = event  # shared by the sequences of one HTTP request
        self.dirty = False  # changed since the handler last looked
        self.log_metrics = log_metrics
        self.detok = IncrementalDetokenizer(tokenizer, sp.skip_special_tokens)
        self.shown = 0  # chars of detok.text that may be shown (stop-string hold-back)
        self.final_text: Optional[str] = None
        self.finish_reason: Optional[dict[str, Any]] = None
        self.prompt_tokens = len(req.input_ids)
        self.completion_tokens = 0
        self.cached_device = 0
        self.cached_host = 0
        self.cached_storage: Optional[int] = None  # None: the server has no storage tier
        self.created = time.monotonic()
        self.first_token_at: Optional[float] = None
        self.last_token_at: Optional[float] = None
        self.finished_at: Optional[float] = None
        self.logprobs = (LogprobState(tokenizer, req.top_logprobs_num, req.return_text_in_logprobs)
                         if req.return_logprob else None)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def output_ids(self) -> list[int]:
        return self.detok.ids

    @property
    def text(self) -> str:
        """The output so far (cumulative), never showing a stop string or its beginning."""
        if self.final_text is not None:
            return self.final_text
        return self.detok.text[:self.shown]

    @property
    def cached_tokens(self) -> int:
        return self.cached_device + self.cached_host + (self.cached_storage or 0)

    def cached_tokens_details(self) -> dict[str, int]:
        """Cached prompt tokens by tier; "storage" only on a server with a storage tier (as SGLang)."""
        details = {"device": self.cached_device, "host": self.cached_host}
        if self.cached_storage is not None:
            details["storage"] = self.cached_storage
        return details

    def meta_info(self) -> dict[str, Any]:
        meta = {
            "id": self.rid,
            "finish_reason": self.finish_reason,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
            "cached_tokens_details": self.cached_tokens_details(),
            "weight_version": "default",
        }
        if self.finished_at is not None:
            meta["e2e_latency"] = self.finished_at - self.created
        if self.logprobs is not None:
            meta.update(self.logprobs.meta_info())
        return meta

    def update(self, new_ids: list[int], finish_reason: Optional[dict[str, Any]], now: float) -> None:
        self.detok.step(new_ids)
        if new_ids:
            if self.first_token_at is None:
                self.first_token_at = now
            self.last_token_at = now
        text = self.detok.text
        if finish_reason is None:
            self.shown = visible_len(text, self.stop_strs, self.shown) if self.stop_strs else len(text)
            return
        self.detok.flush()
        text = self.detok.text
        matched = finish_reason.get("matched")
        if finish_reason["type"] == "stop" and isinstance(matched, str) and not self.no_stop_trim:
            cut = first_stop(text, self.stop_strs or [matched], self.shown)
            if cut != -1:
                text = text[:cut]
        self.final_text = text
        self.finish_reason = finish_reason
        self.finished_at = now
