"""Sampling parameters of one request, with SGLang's names, defaults and checks."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional, Union

_GREEDY_TEMPERATURE = 1e-6
MAX_LOGIT_BIAS_ENTRIES = 1024  # OpenAI documents no cap; this bounds the per-step scatter
MAX_STOP_STRINGS = 32  # SGLang's limit (latest)
# SGLang accepts (0, 2]; a penalty near 0 divides positive logits by ~0 (1e-300 is 0.0 in float32),
# whose inf/NaN probabilities killed the scheduler ("probability tensor contains either inf, nan or
# element < 0"), found by the schemathesis run; test/unit/test_http_limits.py reproduces it.
MIN_REPETITION_PENALTY = 0.01


@dataclass
class SamplingParams:
    """Native `/generate` sampling parameters (the OpenAI routes map onto these).

    `temperature` below 1e-6 means greedy. `max_new_tokens=None` means "until the
    context limit" and is clamped by the scheduler.
    """

    max_new_tokens: Optional[int] = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: Optional[Union[str, list[str]]] = None
    stop_token_ids: Optional[list[int]] = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    n: int = 1
    sampling_seed: Optional[int] = None
    stream_interval: Optional[int] = None
    # token id -> additive bias in [-100, 100], applied to the logits before sampling.
    logit_bias: Optional[dict[int, float]] = None
    # Constrained decoding (xgrammar); at most one of the three is set.
    json_schema: Optional[str] = None
    regex: Optional[str] = None
    ebnf: Optional[str] = None
    stop_strs: list[str] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop_strs = []
        elif isinstance(self.stop, str):
            self.stop_strs = [self.stop] if self.stop else []
        else:
            self.stop_strs = [s for s in self.stop if s]

    # What `verify` accepts, as JSON Schema keywords: the request schemas (/openapi.json) show
    # these, so the published schema and the server's checks come from one place.
    SCHEMA_BOUNDS = {
        "max_new_tokens": {"minimum": 0},
        "min_new_tokens": {"minimum": 0, "description": "At most max_new_tokens."},
        "temperature": {"minimum": 0},
        "top_p": {"exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"minimum": -1, "not": {"const": 0}},
        "min_p": {"minimum": 0, "maximum": 1},
        "frequency_penalty": {"minimum": -2, "maximum": 2},
        "presence_penalty": {"minimum": -2, "maximum": 2},
        "repetition_penalty": {"minimum": MIN_REPETITION_PENALTY, "maximum": 2},
        "n": {"minimum": 1},
        "stream_interval": {"minimum": 1},
    }

    @property
    def grammar_key(self) -> Optional[tuple[str, str]]:
        """(kind, source) of the request's grammar constraint, or None when unconstrained."""
        for kind in ("json_schema", "regex", "ebnf"):
            value = getattr(self, kind)
            if value is not None:
                return kind, value
        return None

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_TEMPERATURE or self.top_k == 1

    def verify(self, vocab_size: int | None = None) -> None:
        """Check ranges the way SGLang does.

        Raises:
            ValueError: naming the offending parameter and its value.
        """
        if self.max_new_tokens is not None:
            if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
                raise ValueError(f"max_new_tokens must be an integer, got {self.max_new_tokens!r}.")
            if self.max_new_tokens < 0:
                raise ValueError(f"max_new_tokens must be at least 0, got {self.max_new_tokens}.")
        if not 0 <= self.min_new_tokens <= (self.max_new_tokens if self.max_new_tokens is not None
                                            else self.min_new_tokens):
            raise ValueError(f"min_new_tokens must be in [0, max_new_tokens], got {self.min_new_tokens}.")
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}.")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1 or self.top_k == 0:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}.")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 2:
            raise ValueError(f"repetition_penalty must be in [{MIN_REPETITION_PENALTY}, 2], "
                             f"got {self.repetition_penalty}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.stream_interval is not None and self.stream_interval < 1:
            raise ValueError(f"stream_interval must be at least 1, got {self.stream_interval}.")
        if len(self.stop_strs) > MAX_STOP_STRINGS:
            raise ValueError(f"stop accepts at most {MAX_STOP_STRINGS} strings, got {len(self.stop_strs)}.")
        if self.stop_token_ids is not None and vocab_size is not None:
            bad = [t for t in self.stop_token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"stop_token_ids must be token ids in [0, {vocab_size}), got {bad}.")
        if self.logit_bias:
            self._verify_logit_bias(vocab_size)
        if sum(v is not None for v in (self.json_schema, self.regex, self.ebnf)) > 1:
            raise ValueError("json_schema, regex and ebnf are exclusive: set at most one of them.")

    def _verify_logit_bias(self, vocab_size: int | None) -> None:
        if len(self.logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"logit_bias accepts at most {MAX_LOGIT_BIAS_ENTRIES} entries, "
                             f"got {len(self.logit_bias)}.")
        for token, bias in self.logit_bias.items():
            if vocab_size is not None and not 0 <= token < vocab_size:
                raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}), got {token}.")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias} for token {token}.")
