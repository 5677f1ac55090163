"""Constrained decoding with xgrammar (SGLang's default grammar backend): JSON schema,
regex and EBNF constraints become a per-step allowed-token bitmask.

API side: `validate_constraint` checks a constraint without a tokenizer (a bad schema is
a 400 before any work starts). Scheduler side: `GrammarBackend` compiles constraints
(cached by source) against the model's tokenizer, keeps one `GrammarMatcher` per request
(`Req.grammar`, created at its first step), and builds the bitmask only for constrained
requests. `start_fill` computes the masks in a worker thread while the forward pass runs
(xgrammar's fill and torch's CPU/GPU kernels both release the GIL), `bitmask_for` joins
it just before sampling, and `accept` advances the matchers with the sampled tokens.

JSON is generated compactly (`any_whitespace=False`): free whitespace lets a small model
loop on newlines until max_tokens.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Optional

if TYPE_CHECKING:  # the API process imports this module to validate constraints: no torch there
    import torch

logger = logging.getLogger(__name__)

KINDS = ("json_schema", "regex", "ebnf")
MAX_CONSTRAINT_CHARS = 64 * 1024  # bounds compile time and memory per request


def validate_constraint(kind: str, source: str) -> None:
    """Check that `source` is a valid constraint of `kind` (json_schema, regex or ebnf).

    Raises:
        ValueError: the message says what is wrong (too long, not JSON, unsupported schema,
            bad regex or grammar).
    """
    if len(source) > MAX_CONSTRAINT_CHARS:
        raise ValueError(f"{kind} is {len(source)} characters; at most {MAX_CONSTRAINT_CHARS} are accepted.")
    import xgrammar as xgr  # imports torch (xgrammar 0.2.9): only once a constraint arrives

    try:
        if kind == "json_schema":
            schema = json.loads(source)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
            xgr.Grammar.from_json_schema(source, any_whitespace=False)
        elif kind == "regex":
            xgr.Grammar.from_regex(source)
        elif kind == "ebnf":
            xgr.Grammar.from_ebnf(source)
        else:
            raise ValueError(f"unknown constraint kind {kind!r}")
    except (RuntimeError, ValueError, TypeError) as e:
        raise ValueError(f"Invalid {kind}: {str(e).strip().splitlines()[-1]}") from e


class GrammarBackend:
    """Compiles constraints and builds bitmasks for the scheduler's constrained requests.

    Args:
        tokenizer: the HF tokenizer the server loads (`hiserve.models.loader.get_tokenizer`).
        vocab_size: V, the width of the model's logits (may exceed the tokenizer's).
        stop_token_ids: the model's EOS ids, which end a complete grammar.
    """

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr

        self._xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                      stop_token_ids=sorted(stop_token_ids) or None)
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=True)
        self.vocab_size = vocab_size
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        self._pending: Optional[Future] = None
        self._pending_rows: dict[int, int] = {}

    def _compile(self, kind: str, source: str) -> Any:
        if kind == "json_schema":
            return self.compiler.compile_json_schema(source, any_whitespace=False)
        if kind == "regex":
            return self.compiler.compile_regex(source)
        return self.compiler.compile_grammar(source)

    def ensure_matchers(self, reqs: list[Any]) -> list[Any]:
        """Create missing matchers; returns the constrained, unfinished requests. A constraint
        that fails to compile aborts its request with a 400 (the API checks it first)."""
        out = []
        for req in reqs:
            key = req.sampling_params.grammar_key
            if key is None or req.finished:
                continue
            if req.grammar is None:
                try:
                    req.grammar = self._xgr.GrammarMatcher(self._compile(*key))
                except (RuntimeError, ValueError) as e:
                    req.abort(f"Invalid {key[0]}: {e}", status_code=400)
                    continue
                for tok in req.output_ids:  # retracted and re-admitted: replay its output
                    req.grammar.accept_token(tok)
            out.append(req)
        return out

    def _fill(self, reqs: list[Any]) -> torch.Tensor:
        mask = self._xgr.allocate_token_bitmask(len(reqs), self.vocab_size)
        for i, req in enumerate(reqs):
            req.grammar.fill_next_token_bitmask(mask, i)
        return mask

    def start_fill(self, reqs: list[Any]) -> None:
        """Start building the masks of `reqs`' constrained requests in the worker thread."""
        constrained = self.ensure_matchers(reqs)
        if not constrained:
            return
        self._pending_rows = {id(r): i for i, r in enumerate(constrained)}
        self._pending = self._executor.submit(self._fill, constrained)

    def bitmask_for(self, reqs: list[Any]) -> Optional[torch.Tensor]:
        """[len(reqs), ceil(V/32)] int32 bitmask for sampling `reqs` (all-ones rows for the
        unconstrained), or None when none is constrained. Uses the mask `start_fill` built
        when it covers the request, else fills it now."""
        pending, rows = self._pending, self._pending_rows
        self._pending, self._pending_rows = None, {}
        ready = pending.result() if pending is not None else None
        constrained = self.ensure_matchers(reqs)
        if not constrained:
            return None
        out = self._xgr.allocate_token_bitmask(len(reqs), self.vocab_size)  # all ones
        for i, req in enumerate(reqs):
            if req.grammar is None or req.finished:
                continue
            if ready is not None and id(req) in rows:
                out[i] = ready[rows[id(req)]]
            else:
                req.grammar.fill_next_token_bitmask(out, i)
        return out

    @staticmethod
    def accept(reqs: list[Any], next_ids: list[int]) -> None:
        """Advance each constrained request's matcher by its sampled token."""
        for req, tok in zip(reqs, next_ids):
            if req.grammar is not None and not req.grammar.is_terminated():
                if not req.grammar.accept_token(tok):
                    logger.warning("grammar rejected sampled token %d of request %s", tok, req.rid)
