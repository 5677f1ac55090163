"""Logprobs on the API side: accumulate what the scheduler sends, render SGLang's and OpenAI's shapes.

- `/generate` `meta_info`: `input_token_logprobs` / `output_token_logprobs` are lists of
  `[logprob, token_id, text_or_null]` (text only with `return_text_in_logprobs`), and with
  `top_logprobs_num > 0` `input_top_logprobs` / `output_top_logprobs` hold one such list
  per position, best first (the first prompt position's logprob is null and its top list
  is null).
- `/v1/completions`: `{"tokens", "token_logprobs", "top_logprobs", "text_offset"}`; each top
  entry is a `{token_text: logprob}` dict of the `logprobs` best tokens plus the chosen
  one (as vLLM does), null for the first prompt token under `echo`.
- `/v1/chat/completions`: `{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
  "refusal": null}`.

What the numbers mean is defined in hiserve.engine.logprobs.
"""

from __future__ import annotations

from typing import Any, Optional

from hiserve.engine.errors import BadRequestError
from hiserve.engine.io_struct import LogprobChunk

Entry = tuple[Optional[float], int]


class LogprobState:
    """All logprobs of one sequence received so far."""

    def __init__(self, tokenizer: Any, top_logprobs_num: int, return_text: bool = False):
        self.tokenizer = tokenizer
        self.top_logprobs_num = top_logprobs_num
        self.return_text = return_text
        self.input_token_logprobs: list[Entry] = []
        self.input_top_logprobs: list[list[Entry]] = []
        self.output_token_logprobs: list[Entry] = []
        self.output_top_logprobs: list[list[Entry]] = []

    def add(self, chunk: Optional[LogprobChunk]) -> None:
        if chunk is None:
            return
        if chunk.input_token_logprobs is not None:
            self.input_token_logprobs = list(chunk.input_token_logprobs)
            self.input_top_logprobs = list(chunk.input_top_logprobs or [])
        self.output_token_logprobs.extend(chunk.output_token_logprobs)
        self.output_top_logprobs.extend(chunk.output_top_logprobs)

    def meta_info(self) -> dict[str, Any]:
        """SGLang's meta_info logprob fields."""
        tokenizer = self.tokenizer
        def triples(entries: list[Entry]) -> list[list[Any]]:
            return [[lp, tid, token_text(tokenizer, tid) if self.return_text else None] for lp, tid in entries]

        meta = {"input_token_logprobs": triples(self.input_token_logprobs),
                "output_token_logprobs": triples(self.output_token_logprobs)}
        if self.top_logprobs_num > 0:
            meta["input_top_logprobs"] = [
                triples(top) if lp is not None else None
                for (lp, _), top in zip(self.input_token_logprobs, self.input_top_logprobs)]
            meta["output_top_logprobs"] = [triples(top) for top in self.output_top_logprobs]
        return meta

    def echo_entries(self) -> tuple[list[Entry], list[Optional[list[Entry]]]]:
        """Prompt then output entries and top lists (None for the first prompt token)."""
        tops = [t if lp is not None else None for (lp, _), t in zip(self.input_token_logprobs,
                                                                    self._tops(self.input_top_logprobs,
                                                                               len(self.input_token_logprobs)))]
        return (self.input_token_logprobs + self.output_token_logprobs,
                tops + self._tops(self.output_top_logprobs, len(self.output_token_logprobs)))

    def output_entries(self, start: int = 0) -> tuple[list[Entry], list[list[Entry]]]:
        n = len(self.output_token_logprobs)
        return (self.output_token_logprobs[start:], self._tops(self.output_top_logprobs, n)[start:])

    @staticmethod
    def _tops(tops: list[list[Entry]], n: int) -> list[list[Entry]]:
        return tops if len(tops) == n else [[] for _ in range(n)]


def token_text(tokenizer: Any, token_id: int) -> str:
    """The text of one token as the client sees it (decoded alone; a partial UTF-8 byte
    sequence decodes to U+FFFD)."""
    return tokenizer.decode([token_id])


def completion_logprobs(tokenizer: Any, entries: list[Entry], tops: list[Optional[list[Entry]]],
                        text_offset: int = 0) -> dict[str, Any]:
    """OpenAI `/v1/completions` choice logprobs for `entries` (and their top lists)."""
    tokens, token_logprobs, top_logprobs, offsets = [], [], [], []
    for (lp, tid), top in zip(entries, tops):
        text = token_text(tokenizer, tid)
        tokens.append(text)
        token_logprobs.append(lp)
        offsets.append(text_offset)
        text_offset += len(text)
        if top is None or lp is None:
            top_logprobs.append(None)
            continue
        best = {token_text(tokenizer, t): v for v, t in top}
        best.setdefault(text, lp)
        top_logprobs.append(best)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs,
            "text_offset": offsets}


def chat_logprobs(tokenizer: Any, entries: list[Entry], tops: list[list[Entry]], top_n: int) -> dict[str, Any]:
    """OpenAI `/v1/chat/completions` choice logprobs."""
    def item(lp: float, tid: int) -> dict[str, Any]:
        text = token_text(tokenizer, tid)
        return {"token": text, "logprob": lp, "bytes": list(text.encode("utf-8"))}

    content = []
    for (lp, tid), top in zip(entries, tops):
        content.append({**item(lp, tid), "top_logprobs": [item(v, t) for v, t in top[:top_n]]})
    return {"content": content, "refusal": None}


class LogprobTracker:
    """Per choice index, the output logprobs already streamed; yields the new ones."""

    def __init__(self) -> None:
        self.sent: dict[int, int] = {}

    def new_output(self, index: int, state: Optional[LogprobState]) -> tuple[list[Entry], list[list[Entry]]]:
        if state is None:
            return [], []
        start = self.sent.get(index, 0)
        entries, tops = state.output_entries(start)
        self.sent[index] = start + len(entries)
        return entries, tops


def apply_logprob_options(subreqs: list[tuple[str, Any]], options: list[tuple[bool, int, int]],
                          ns: list[int], return_text: bool = False) -> None:
    """Set each sequence's logprob options from its prompt's (return_logprob,
    logprob_start_len, top_logprobs_num); `subreqs` are prompt-major, `ns[i]` per prompt.

    Raises:
        BadRequestError: logprob_start_len is not below the prompt's length.
    """
    k = 0
    for (ret, start, top), n in zip(options, ns):
        for _ in range(n):
            req = subreqs[k][1]
            k += 1
            if ret and start >= len(req.input_ids):
                raise BadRequestError(f"logprob_start_len ({start}) must be below the prompt length "
                                      f"({len(req.input_ids)} tokens).", param="logprob_start_len")
            req.return_logprob, req.logprob_start_len, req.top_logprobs_num = ret, start, top
            req.return_text_in_logprobs = return_text


def completion_choice_logprobs(tokenizer: Any, state: Optional[LogprobState], echo: bool,
                               text_offset: int) -> Optional[dict[str, Any]]:
    """A whole completion choice's logprobs (prompt first under echo); None when not asked."""
    if state is None:
        return None
    if echo:
        return completion_logprobs(tokenizer, *state.echo_entries())
    return completion_logprobs(tokenizer, *state.output_entries(), text_offset)


def completion_stream_logprobs(tokenizer: Any, state: Optional[LogprobState], tracker: LogprobTracker,
                               index: int, with_prompt: bool) -> Optional[dict[str, Any]]:
    """The logprobs of a streamed completion chunk: the new output tokens (after the prompt's,
    in the first chunk under echo); None when there are none."""
    if state is None:
        return None
    entries, tops = tracker.new_output(index, state)
    if with_prompt:
        n_in = len(state.input_token_logprobs)
        prompt_entries, prompt_tops = state.echo_entries()
        entries, tops = prompt_entries[:n_in] + entries, prompt_tops[:n_in] + tops
    return completion_logprobs(tokenizer, entries, tops) if entries else None


def chat_stream_logprobs(tokenizer: Any, state: Optional[LogprobState], tracker: LogprobTracker,
                         index: int, top_n: int) -> Optional[dict[str, Any]]:
    """The logprobs of a streamed chat chunk (the new output tokens), or None."""
    if state is None:
        return None
    entries, tops = tracker.new_output(index, state)
    return chat_logprobs(tokenizer, entries, tops, top_n) if entries else None
