"""Incremental detokenization: no half characters, stop strings held back and trimmed."""

from __future__ import annotations

import pytest

from radixserve.detokenizer import IncrementalDetokenizer
from radixserve.ipc import messages as m


@pytest.fixture(scope="module")
def tokenizer(default_model_path):
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


def feed(detok: IncrementalDetokenizer, rid: str, ids: list[int], stop: list[str],
         finish_at: int | None = None, finished: dict | None = None) -> list[str]:
    """Send ids one step at a time; the step ``finish_at`` carries ``finished``."""
    deltas = []
    last = len(ids) if finish_at is None else finish_at + 1
    for i in range(last):
        fin = finished if i == last - 1 else None
        init = m.DetokSettings(stop) if i == 0 else None
        fin = None if fin is None else m.FinishReason(**fin)
        out = detok.process(m.TokenOut(rids=[rid], new_ids=[[ids[i]]], finished=[fin],
                                       meta=[m.ReqMeta(len(ids), 0, i + 1, None)], init=[init]))
        deltas.append(out.text_deltas[0])
    return deltas


def test_multibyte_characters_are_never_split(tokenizer) -> None:
    text = "Café 東京 naïve 🙂🚀 Ωmega — done"
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) > len(text.split())  # some characters span several tokens
    detok = IncrementalDetokenizer(tokenizer)
    deltas = feed(detok, "a", ids, [], finished={"type": "length", "matched": None})
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids)
    assert detok.states == {}  # state dropped at the end


def test_stop_string_spanning_tokens_is_held_back_and_trimmed(tokenizer) -> None:
    text = "Hello world, the end is near and more follows"
    ids = tokenizer.encode(text, add_special_tokens=False)
    stop = "the end"
    # The scheduler finishes the request on the token that completes the stop string.
    upto = next(i for i in range(len(ids)) if stop in tokenizer.decode(ids[: i + 1]))
    detok = IncrementalDetokenizer(tokenizer)
    deltas = feed(detok, "b", ids, [stop], finish_at=upto, finished={"type": "stop", "matched": stop})
    joined = "".join(deltas)
    assert joined == "Hello world, "
    assert not any("the" in d for d in deltas)


def test_held_back_prefix_is_released_when_it_is_not_a_stop(tokenizer) -> None:
    text = "the endless road goes on"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    deltas = feed(detok, "c", ids, ["the end."], finished={"type": "length", "matched": None})
    assert "".join(deltas) == text


def test_stop_token_is_not_in_the_text(tokenizer) -> None:
    ids = tokenizer.encode("one two three", add_special_tokens=False)
    stop_tok = ids[-1]
    detok = IncrementalDetokenizer(tokenizer)
    deltas = feed(detok, "d", ids, [], finished={"type": "stop", "matched": stop_tok})
    assert "".join(deltas) == tokenizer.decode(ids[:-1])
