"""Incremental detokenization and stop-string hold-back for streamed text.

Decoding the whole output again for every new token costs O(length) per token. Instead
each step decodes a short window: the tokens since `prefix_offset` (already shown, kept
as context because some tokenizers render a token differently depending on its
neighbour, e.g. sentencepiece's leading space) and the unread ones after `read_offset`.

    ids:  [ ... shown ... | prefix_offset ... read_offset | new ids ]
                          '---- decoded twice ----'
    new text = decode(prefix..end) minus decode(prefix..read)

A token can end in the middle of a multi-byte UTF-8 character; the window then decodes
to a trailing U+FFFD and the new text is held back until the character completes.
"""

from __future__ import annotations

from typing import Any, Callable

_REPLACEMENT_CHAR = "\ufffd"


def _backend_decode(tokenizer: Any) -> Callable[..., str] | None:
    """The Rust `tokenizers.Tokenizer.decode` behind a transformers fast tokenizer whose `_decode`
    is the stock one (which, without clean-up, only calls it), else None. Per streamed token
    this skips transformers' Python around it (`to_py_obj`, argument handling): about half of
    the detokenizer's cost in a profile of the API process at concurrency 1."""
    try:
        import tokenizers
        from transformers import PreTrainedTokenizerFast
    except ImportError:
        return None
    backend = getattr(tokenizer, "_tokenizer", None)
    if (isinstance(tokenizer, PreTrainedTokenizerFast) and isinstance(backend, tokenizers.Tokenizer)
            and type(tokenizer)._decode is PreTrainedTokenizerFast._decode):
        return backend.decode
    return None


class IncrementalDetokenizer:
    """The text of a growing list of output ids, decoding only the newest tokens per step."""

    __slots__ = ("tokenizer", "skip_special_tokens", "ids", "text", "prefix_offset", "read_offset", "_fast")

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self._fast = _backend_decode(tokenizer)
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def _decode(self, ids: list[int]) -> str:
        # No clean-up of spaces: it rewrites text across token boundaries, so the
        # concatenation of steps would stop matching a decode of the whole output.
        if self._fast is not None:
            return self._fast(ids, skip_special_tokens=self.skip_special_tokens)
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def step(self, new_ids: list[int]) -> None:
        """Append `new_ids` and extend `text` by whatever now decodes completely."""
        if not new_ids:
            return
        self.ids.extend(new_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset:])
        if len(window_text) > len(prefix_text) and not window_text.endswith(_REPLACEMENT_CHAR):
            self.text += window_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)

    def flush(self) -> None:
        """At the end of the output, emit held-back text even if it is an incomplete character."""
        if self.read_offset == len(self.ids):
            return
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        window_text = self._decode(self.ids[self.prefix_offset:])
        self.text += window_text[len(prefix_text):]
        self.prefix_offset = self.read_offset = len(self.ids)


def first_stop(text: str, stop_strs: list[str], start: int = 0) -> int:
    """Index of the earliest occurrence of any stop string at or after `start`, or -1."""
    best = -1
    for s in stop_strs:
        i = text.find(s, start)
        if i != -1 and (best == -1 or i < best):
            best = i
    return best


def visible_len(text: str, stop_strs: list[str], start: int) -> int:
    """How much of a running output may be shown without revealing a stop string.

    The shown text ends before any stop string and before the longest suffix that could
    still grow into one. `start` is the previously shown length: no stop string begins
    before it (its beginning would have been held back), so only the tail is searched,
    which keeps a step O(new text + stop lengths).
    """
    hit = first_stop(text, stop_strs, start)
    if hit != -1:
        return hit
    end = len(text)
    for s in stop_strs:
        for k in range(min(len(s) - 1, end - start), 0, -1):
            if text.endswith(s[:k]):
                end = min(end, len(text) - k)
                break
    return end
