"""Constrained decoding with the real default model (SmolLM2-135M-Instruct, float32, CPU).

Quick by default: the HF-reference check, jump-forward and a few generated schemas.  The
wider property runs, EBNF, regexes and the Engine end to end are marked slow.
"""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
from helpers.grammar_cases import (
    arith_grammar,
    check_arith,
    hf_constrained_greedy,
    prop,
    regex_cases,
    schema_cases,
    xgrammar_defect_bias,
)
from helpers.grammar_driver import (
    assert_valid_json,
    check_regex_outputs,
    check_schema_outputs,
    drive,
    one_torch_thread,
    submit,
    text_of,
)
from helpers.sched_driver import make_scheduler
from hypothesis import given
from hypothesis import strategies as st

EOS = (2,)  # <|im_end|>
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Rome", "Tokyo", "Lima"]},
        "languages": {"type": "array", "items": {"type": "string", "pattern": "^[A-Za-z]{2,10}$"}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "languages"],
}
DATE = "(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    with one_torch_thread():
        yield


@pytest.fixture(scope="module")
def tok(default_model_path: str) -> Any:
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(default_model_path)


@pytest.fixture(scope="module")
def scheds(default_model_path: str, tok: Any) -> dict[bool, Any]:
    """{jump_forward: scheduler}; the stats are compared as differences."""
    return {
        jf: make_scheduler(default_model_path, tok, max_total_tokens=16384, disable_jump_forward=not jf)
        for jf in (False, True)
    }


@pytest.fixture(scope="module")
def avoid(default_model_path: str) -> dict[int, float]:
    return xgrammar_defect_bias(default_model_path, 49152, EOS)


def chat(tok: Any, text: str) -> list[int]:
    ids = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def test_greedy_matches_hf_and_jump_forward_saves_steps(scheds, tok, default_model_path) -> None:
    """Jump-forward off: token for token HF's float32 greedy choice under the same mask.
    On: the same requests still give valid text, in fewer forward steps."""
    requests = [
        (chat(tok, "Describe a person as JSON: name, age, city, languages."), "json_schema", json.dumps(PERSON), 90),
        (chat(tok, "When did the Berlin wall fall? Answer with a date."), "regex", DATE, 16),
    ]
    steps = {}
    for jf, sched in scheds.items():
        before = sched.get_stats()
        rids = [submit(sched, p, max_new_tokens=m, **{kind: text}) for p, kind, text, m in requests]
        results = drive(sched)
        after = sched.get_stats()
        steps[jf] = after["forward_steps"] - before["forward_steps"]
        jumped = after["jump_forward_tokens"] - before["jump_forward_tokens"]
        assert (jumped > 0) == jf, jumped
        assert_valid_json(tok, results[rids[0]], PERSON)
        assert results[rids[1]]["finished"]["type"] == "stop"
        assert re.fullmatch(DATE, text_of(tok, results[rids[1]]))
        if not jf:
            for rid, (p, kind, text, m) in zip(rids, requests, strict=True):
                want = hf_constrained_greedy(default_model_path, p, kind, text, m, EOS)
                assert results[rid]["output_ids"] == want, (text_of(tok, results[rid]), tok.decode(want))
    assert steps[True] < steps[False], steps


def check_schema_case(sched: Any, tok: Any, avoid: dict[int, float], case: Any, seed: int) -> None:
    prompt = chat(tok, "Reply with a JSON value that follows this JSON schema: " + case.text)
    check_schema_outputs(sched, tok, prompt, avoid, case, seed, temperature=0.8)


@prop(3)
@given(case=schema_cases(max_tokens=120, max_leaves=4), seed=st.integers(0, 2**31))
def test_generated_schemas_validate(scheds, tok, avoid, case, seed) -> None:
    check_schema_case(scheds[True], tok, avoid, case, seed)


@pytest.mark.slow
@prop(20)
@given(case=schema_cases(max_tokens=250), seed=st.integers(0, 2**31), jf=st.booleans())
def test_many_generated_schemas_validate(scheds, tok, avoid, case, seed, jf) -> None:
    check_schema_case(scheds[jf], tok, avoid, case, seed)


@pytest.mark.slow
@prop(15)
@given(case=regex_cases(max_chars=30), seed=st.integers(0, 2**31))
def test_generated_regexes_fullmatch(scheds, tok, avoid, case, seed) -> None:
    prompt = chat(tok, "Write a short string.")
    check_regex_outputs(scheds[True], tok, prompt, avoid, case, seed, temperature=0.8)


@pytest.mark.slow
@pytest.mark.parametrize("shape", [(1, 1), (2, 1)])
def test_arithmetic_ebnf_matches_hf_and_evaluates(scheds, tok, default_model_path, shape) -> None:
    case = arith_grammar(*shape)
    prompt = chat(tok, "Write an arithmetic expression whose value is 42.")
    sched = scheds[False]
    rids = [submit(sched, prompt, ebnf=case.grammar, max_new_tokens=case.max_tokens)]
    rids += [submit(sched, prompt, seed=s, ebnf=case.grammar, max_new_tokens=case.max_tokens, temperature=1.0) for s in (1, 2)]
    results = drive(sched)
    for rid in rids:
        assert results[rid]["finished"]["type"] == "stop"
        check_arith(text_of(tok, results[rid]), case)
    want = hf_constrained_greedy(default_model_path, prompt, "ebnf", case.grammar, case.max_tokens, EOS)
    assert results[rids[0]]["output_ids"] == want


@pytest.mark.slow
def test_engine_with_the_default_model(default_model_path, avoid) -> None:
    from radixserve import Engine

    with Engine(max_total_tokens=8192, random_seed=5, dtype="float32") as engine:
        prompt = "Describe a person as JSON: name, age, city, languages."
        params = {"json_schema": json.dumps(PERSON), "max_new_tokens": 90, "temperature": 0}
        out = engine.generate(prompt, params)
        assert out["meta_info"]["finish_reason"]["type"] == "stop"
        jsonschema.validate(json.loads(out["text"]), PERSON)
        pieces = list(engine.generate(prompt, params, stream=True))
        assert "".join(p["text"] for p in pieces) == out["text"]
        outs = engine.generate(
            [prompt, "When did the Berlin wall fall?", "Count to five.", prompt],
            [
                {**params, "temperature": 0.8, "logit_bias": avoid},
                {"regex": DATE, "max_new_tokens": 16},
                {"max_new_tokens": 12, "temperature": 0},
                params,
            ],
            progress=False,
        )
        jsonschema.validate(json.loads(outs[0]["text"]), PERSON)
        assert re.fullmatch(DATE, outs[1]["text"])
        assert outs[3]["output_ids"] == out["output_ids"] and outs[3]["meta_info"]["cached_tokens"] > 0
        report = engine.check_memory()
        assert report["ok"] and report["locked_tokens"] == 0, report
