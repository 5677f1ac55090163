"""The tokenizer in a form the API process can rebuild without torch or gguf.

Loading a tokenizer through `AutoTokenizer` imports torch, and for a GGUF checkpoint parses
the file with `gguf`; the API process needs neither, only encode / decode / chat template.
The scheduler process, which loads the model anyway, sends a `TokenizerSpec` (the fast
tokenizer's JSON plus its special tokens and chat template) in `SchedulerReady`; the API
process rebuilds the same tokenizer from it with `tokenizers` and transformers'
`TokenizersBackend` (neither imports torch), so apply_chat_template and decode behave as the
scheduler's tokenizer does.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

_SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token", "add_bos_token", "add_eos_token")


@dataclass
class TokenizerSpec:
    tokenizer_json: str  # tokenizers.Tokenizer.to_str(): model, normalizer, pre/post-processing, added tokens
    init_kwargs: dict[str, Any] = field(default_factory=dict)  # special tokens, chat_template


def tokenizer_spec(tokenizer: Any) -> TokenizerSpec:
    """The spec of a loaded Hugging Face fast tokenizer (one with `backend_tokenizer`)."""
    kwargs = {k: tokenizer.init_kwargs[k] for k in _SPECIAL if tokenizer.init_kwargs.get(k) is not None}
    if getattr(tokenizer, "chat_template", None):
        kwargs["chat_template"] = tokenizer.chat_template
    kwargs = {k: str(v) if hasattr(v, "content") else v for k, v in kwargs.items()}  # AddedToken -> str
    return TokenizerSpec(tokenizer.backend_tokenizer.to_str(), kwargs)


def build_tokenizer(spec: TokenizerSpec) -> Any:
    """A transformers fast tokenizer equal to the one `spec` was taken from; imports no torch."""
    import tokenizers
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend(tokenizer_object=tokenizers.Tokenizer.from_str(spec.tokenizer_json),
                             **spec.init_kwargs)
