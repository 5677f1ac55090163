"""Stop strings are matched on the decoded text, including ones whose characters span several tokens."""

from __future__ import annotations

import pytest

from hiserve.engine.sampling_params import SamplingParams
from hiserve.engine.schedule_batch import Req


@pytest.fixture(scope="module")
def tokenizer():
    from hiserve.models.loader import get_tokenizer, resolve_model_path

    return get_tokenizer(resolve_model_path(None))


@pytest.mark.parametrize("stop", ["🙂🙂🙂", "東京都", "é!", "end"])
def test_stop_string_found_when_its_last_token_arrives(tokenizer, stop: str):
    text = f"Well, {stop} and more"
    ids = tokenizer.encode(text, add_special_tokens=False)
    req = Req("r", [1, 2, 3], SamplingParams(max_new_tokens=100, stop=stop), False, 100, set())
    for i, tok in enumerate(ids):
        req.output_ids.append(tok)
        req.check_finished(tokenizer, context_len=10_000)
        decoded = tokenizer.decode(ids[:i + 1])
        if req.finished:
            break
        assert stop not in decoded, f"{stop!r} was in the text after token {i} but not matched"
    assert req.finished_reason == {"type": "stop", "matched": stop}
    assert stop in tokenizer.decode(req.output_ids)
    # The multibyte cases are the point: the stop string spans more tokens than characters + 2.
    if stop == "🙂🙂🙂":
        start = next(k for k in range(len(ids)) if stop in tokenizer.decode(ids[k:]))
        assert len(req.output_ids) - start > len(stop) + 2
