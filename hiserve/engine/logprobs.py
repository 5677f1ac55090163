"""Token logprobs on the scheduler side: prompt logprobs from the prefill, output logprobs
from the sampling step, and the per-message chunks sent to the API process.

Definitions (positions are prompt indices, `ids` the prompt's token ids):
- prompt logprob of position j >= 1: log softmax(model logits at j - 1)[ids[j]], of the raw
  model distribution (no temperature or penalties: those shape sampling, and prompt
  tokens are not sampled). Position 0 has no context, so its logprob is None, as in
  SGLang and OpenAI's `echo`. A request asks for positions `logprob_start_len` .. L - 1
  (`logprob_start_len` = -1: none).
- output logprob: from `Sampler.sample_and_logprobs`, the very logits the token was drawn
  from (after penalties, logit_bias, grammar mask and temperature; see hiserve.engine.sampler),
  so no extra forward pass is run for output tokens.

Prefix cache: logits exist only for positions the prefill computes, so a request that
still owes prompt logprobs from position s matches the prefix cache only up to s - 1
(`Req.prefix_match_len`) and recomputes the rest; the tokens before s - 1 still hit. It
costs a recompute of the prompt tail only for requests that ask for prompt logprobs, and
keeps `cached_tokens` honest (it counts only what was really reused).

Values below LOGPROB_FLOOR (-inf for grammar-forbidden tokens) are reported as the floor,
so JSON never carries -inf.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from hiserve.engine.io_struct import LogprobChunk
from hiserve.engine.schedule_batch import Req, ScheduleBatch

LOGPROB_FLOOR = -9999.0


def init_req_logprobs(req: Req, return_logprob: bool, logprob_start_len: int, top_logprobs_num: int) -> None:
    """Set a new request's logprob options (`logprob_start_len` < 0: output logprobs only)."""
    req.return_logprob = bool(return_logprob)
    if not req.return_logprob:
        return
    req.top_logprobs_num = max(0, int(top_logprobs_num))
    n = len(req.origin_input_ids)
    if logprob_start_len is None or logprob_start_len < 0 or logprob_start_len >= n:
        return
    if logprob_start_len == 0:
        req.input_token_logprobs.append((None, req.origin_input_ids[0]))
        req.input_top_logprobs.append([])
    first = max(1, logprob_start_len)
    req.input_logprob_next = first if first < n else 0


def input_logprob_rows(batch: ScheduleBatch) -> Optional[list[range]]:
    """Per request of an EXTEND batch, the local rows of its extended tokens whose logits give
    owed prompt logprobs (the logits at position j give the logprob of position j + 1); None
    when no request owes any."""
    out, any_rows = [], False
    for req, p, n in zip(batch.reqs, batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu):
        nxt = req.input_logprob_next
        if nxt <= 0:
            out.append(range(0))
            continue
        lo = max(p, nxt - 1)
        hi = min(p + n, len(req.origin_input_ids) - 1)
        out.append(range(lo - p, max(lo, hi) - p))
        any_rows = any_rows or hi > lo
    return out if any_rows else None


def global_rows(batch: ScheduleBatch, rows: list[range], device: torch.device) -> torch.Tensor:
    """The T-axis indices of `rows` (request-local) in the batch's flattened tokens, [R] int64."""
    out, offset = [], 0
    for r, n in zip(rows, batch.extend_seq_lens_cpu):
        out.extend(offset + i for i in r)
        offset += n
    return torch.tensor(out, dtype=torch.int64, device=device)


def _top(logprobs: torch.Tensor, k: int) -> list[list[tuple[float, int]]]:
    """Best-first (logprob, id) pairs of each row of [R, V] logprobs."""
    if k <= 0:
        return [[] for _ in range(logprobs.shape[0])]
    vals, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    vals = vals.clamp(min=LOGPROB_FLOOR)
    return [list(zip(v, i)) for v, i in zip(vals.tolist(), ids.tolist())]


def record_input_logprobs(batch: ScheduleBatch) -> None:
    """Append the prompt logprobs this EXTEND pass computed to each request that owes them."""
    if batch.input_logprob_rows is None or batch.input_logits is None:
        return
    offset = 0
    with torch.inference_mode():
        for req, rows, p in zip(batch.reqs, batch.input_logprob_rows, batch.extend_prefix_lens_cpu):
            if not rows:
                continue
            logits = batch.input_logits[offset:offset + len(rows)]
            offset += len(rows)
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            first = p + rows.start + 1  # prompt position of the first logprob
            targets = req.origin_input_ids[first:first + len(rows)]
            tok = logprobs.gather(1, torch.tensor(targets, device=logprobs.device).view(-1, 1)).view(-1)
            req.input_token_logprobs.extend(zip(tok.clamp(min=LOGPROB_FLOOR).tolist(), targets))
            req.input_top_logprobs.extend(_top(logprobs, req.top_logprobs_num))
            nxt = first + len(rows)
            req.input_logprob_next = nxt if nxt < len(req.origin_input_ids) else 0


def logprob_rows(reqs: list[Req]) -> list[int]:
    """Indices of the requests that want output logprobs."""
    return [i for i, r in enumerate(reqs) if r.return_logprob]


def output_logprob_tensors(next_ids: torch.Tensor, logprobs: torch.Tensor, index: torch.Tensor,
                           k: int) -> tuple[torch.Tensor, Optional[torch.Tensor], Optional[torch.Tensor]]:
    """The logprob of each logprob row's sampled token and its top-k, on the device (no sync).

    Args:
        next_ids: [S] int64 sampled tokens.
        logprobs: [R, V] float32 from `Sampler.sample_and_logprobs` (rows `index`).
        index: [R] int64 rows of `next_ids` that `logprobs` covers.
        k: top logprobs wanted (the largest top_logprobs_num of those rows; 0: none).

    Returns:
        ([R] float32 token logprobs, [R, k] float32 top values or None, [R, k] int64 top ids
        or None), all floored at LOGPROB_FLOOR (JSON never carries -inf).
    """
    chosen = next_ids.index_select(0, index)
    tok = logprobs.gather(1, chosen.view(-1, 1)).view(-1).clamp(min=LOGPROB_FLOOR)
    if k <= 0:
        return tok, None, None
    vals, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
    return tok, vals.clamp(min=LOGPROB_FLOOR), ids


def logprob_chunk(req: Req, start: int, end: int) -> Optional[LogprobChunk]:
    """What to send with output tokens start..end-1: their logprobs, plus the prompt's once
    they are complete (or the request finished without them)."""
    if not req.return_logprob:
        return None
    chunk = LogprobChunk(output_token_logprobs=req.output_token_logprobs[start:end],
                         output_top_logprobs=req.output_top_logprobs[start:end] if req.top_logprobs_num else [])
    if not req.input_logprobs_sent and (req.input_logprob_next == 0 or req.finished):
        chunk.input_token_logprobs = req.input_token_logprobs
        chunk.input_top_logprobs = req.input_top_logprobs if req.top_logprobs_num else []
        req.input_logprobs_sent = True
    return chunk


def request_options(recv: Any) -> tuple[bool, int, int]:
    """(return_logprob, logprob_start_len, top_logprobs_num) of a TokenizedGenerateReqInput."""
    return (getattr(recv, "return_logprob", False), getattr(recv, "logprob_start_len", -1),
            getattr(recv, "top_logprobs_num", 0))
