"""Constrained decoding (xgrammar) with the tiny random chat model (the default model's
49152-token vocabulary and tokenizer): in-process scheduler and the offline Engine.

A random model picks among the tokens a grammar allows almost at random, so it exercises
every corner of a grammar; the cases are finite languages (see helpers/grammar_cases.py), so
every output must finish with "stop" and be a sentence of its grammar.
"""

from __future__ import annotations

import json
import random
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
    add,
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

from radixserve.scheduler.request import ReqState

EOS = 2  # <|im_end|>, the tiny chat model's EOS
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "role": {"enum": ["admin", "user", "guest"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"type": "string", "pattern": "^[a-z]{1,4}$"}, "maxItems": 2},
    },
    "required": ["name", "role", "age", "tags"],
}
PERSON_TEXT = json.dumps(PERSON)
ANSWER_TAG = json.dumps({
    "type": "structural_tag",
    "format": {"type": "tag", "begin": "<answer>", "end": "</answer>",
               "content": {"type": "json_schema", "json_schema": {"type": "integer", "minimum": 0, "maximum": 99}}},
})
DIGITS = "[0-9]{40}"  # one token per digit in this vocabulary: exactly 40 tokens


# ---- fixtures ------------------------------------------------------------------------------


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Any:
    with one_torch_thread():
        yield




@pytest.fixture(scope="module")
def tok(tiny_chat_model: str) -> Any:
    from radixserve.tokenizer import load_tokenizer

    return load_tokenizer(tiny_chat_model)


@pytest.fixture(scope="module")
def shared_sched(tiny_chat_model: str, tok: Any) -> Any:
    """One scheduler for the property tests (its cache fills across examples; each example
    runs to idle, so the invariant holds between them)."""
    return make_scheduler(tiny_chat_model, tok, max_total_tokens=8192)


@pytest.fixture(scope="module")
def avoid(tiny_chat_model: str) -> dict[int, float]:
    """logit_bias keeping the random model off two xgrammar 0.2.9 defects that the server
    masks itself (tested directly below); the HF reference applies the same bias."""
    return xgrammar_defect_bias(tiny_chat_model, 49152, (EOS,))


@pytest.fixture(scope="module")
def exact_sched(tiny_chat_model: str, tok: Any) -> Any:
    """Jump-forward off: every output token is one the model chose (for the HF reference)."""
    return make_scheduler(tiny_chat_model, tok, max_total_tokens=8192, disable_jump_forward=True)


@pytest.fixture(scope="module")
def prompt(tok: Any) -> list[int]:
    return tok.encode("Answer with the requested format:")


# ---- every output is a sentence of its grammar ---------------------------------------------


@prop(8)
@given(case=schema_cases(max_tokens=250), seed=st.integers(0, 2**31))
def test_json_schema_outputs_parse_and_validate(shared_sched, tok, prompt, avoid, case, seed) -> None:
    check_schema_outputs(shared_sched, tok, prompt, avoid, case, seed, temperature=1.0)


@pytest.mark.slow
@prop(60)
@given(case=schema_cases(max_tokens=500, max_leaves=10), seed=st.integers(0, 2**31), jump_forward=st.booleans())
def test_many_json_schema_outputs_parse_and_validate(shared_sched, exact_sched, tok, prompt, avoid, case, seed,
                                                     jump_forward) -> None:
    check_schema_outputs(shared_sched if jump_forward else exact_sched, tok, prompt, avoid, case, seed, temperature=1.0)


@prop(12)
@given(case=regex_cases(), seed=st.integers(0, 2**31))
def test_regex_outputs_fullmatch(shared_sched, tok, prompt, avoid, case, seed) -> None:
    check_regex_outputs(shared_sched, tok, prompt, avoid, case, seed, temperature=1.0)


@pytest.mark.slow
@prop(80)
@given(case=regex_cases(max_chars=120), seed=st.integers(0, 2**31))
def test_many_regex_outputs_fullmatch(shared_sched, tok, prompt, avoid, case, seed) -> None:
    check_regex_outputs(shared_sched, tok, prompt, avoid, case, seed, temperature=1.0)


def check_arith_runs(sched: Any, tok: Any, prompt: list[int], shape: tuple[int, int], seed: int) -> None:
    case = arith_grammar(*shape)
    rids = [
        submit(sched, prompt, ebnf=case.grammar, max_new_tokens=case.max_tokens),
        submit(sched, prompt, seed=seed, ebnf=case.grammar, max_new_tokens=case.max_tokens, temperature=1.0),
    ]
    results = drive(sched)
    for rid in rids:
        r = results[rid]
        assert r["finished"]["type"] == "stop", (shape, r)
        check_arith(text_of(tok, r), case)


@prop(3)
@given(shape=st.sampled_from([(0, 1), (0, 2), (1, 1)]), seed=st.integers(0, 2**31))
def test_arithmetic_ebnf_outputs_parse_and_evaluate(shared_sched, tok, prompt, shape, seed) -> None:
    check_arith_runs(shared_sched, tok, prompt, shape, seed)


@pytest.mark.slow
@prop(12)
@given(shape=st.sampled_from([(1, 2), (2, 1)]), seed=st.integers(0, 2**31))
def test_deeper_arithmetic_ebnf_outputs_parse_and_evaluate(shared_sched, tok, prompt, shape, seed) -> None:
    check_arith_runs(shared_sched, tok, prompt, shape, seed)


def test_length_bounded_json_strings_have_no_control_characters(tiny_chat_model, tok, prompt) -> None:
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=2048)
    form_feed = tok.convert_tokens_to_ids("Č")  # byte-level BPE token of "\x0c"
    schema = {"type": "string", "maxLength": 3}
    rid = submit(sched, prompt, json_schema=json.dumps(schema), max_new_tokens=30, logit_bias={form_feed: 100.0})
    text = text_of(tok, drive(sched)[rid])
    jsonschema.validate(json.loads(text), schema)  # strict: no raw control character


def test_json_strings_are_valid_utf8(tiny_chat_model, tok, prompt) -> None:
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=2048)
    # Push the path '"', byte ED, byte BD, byte BD, '"' (the string holds one "character").
    quote, byte_ed, byte_bd = (tok.convert_tokens_to_ids(t) for t in ('"', "í", "½"))
    schema = {"type": "string", "minLength": 1, "maxLength": 1}
    rid = submit(sched, prompt, json_schema=json.dumps(schema), max_new_tokens=10,
                 logit_bias={quote: 100.0, byte_ed: 90.0, byte_bd: 80.0})
    text = text_of(tok, drive(sched)[rid])
    jsonschema.validate(json.loads(text), schema)  # one character, not "\ufffd" * 3


# ---- the reference: HF transformers' greedy tokens under the same mask ---------------------

REFERENCE_CASES = [
    ("json_schema", PERSON_TEXT, 80),
    ("json_schema", json.dumps({"type": "array", "items": {"enum": ["yes", "no", 3]}, "minItems": 1, "maxItems": 4}), 40),
    ("regex", r"(\+1 )?\([0-9]{3}\) [0-9]{3}-[0-9]{4}", 30),
    ("regex", "(cat|dog|bird)s? (ran|sat){1,3}", 30),
    ("ebnf", arith_grammar(1, 1).grammar, 80),
    ("structural_tag", ANSWER_TAG, 30),
]


@pytest.mark.parametrize("page_size", [1, 16])
def test_greedy_matches_hf_with_the_same_mask(tiny_chat_model, tok, page_size) -> None:
    """Jump-forward off: every token is the argmax of HF's float32 logits after xgrammar's
    mask, in one mixed batch of prompts of different lengths."""
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=4096, page_size=page_size, disable_jump_forward=True)
    rng = random.Random(page_size)
    prompts = [tok.encode("Write it: " + " ".join(rng.choice(["a", "big", "list", "of", "words"]) for _ in range(n)))
               for n in (1, 9, 30, 4, 17, 6)]
    rids = [submit(sched, p, max_new_tokens=m, **{kind: text}) for p, (kind, text, m) in zip(prompts, REFERENCE_CASES, strict=True)]
    results = drive(sched)
    for rid, p, (kind, text, m) in zip(rids, prompts, REFERENCE_CASES, strict=True):
        want = hf_constrained_greedy(tiny_chat_model, p, kind, text, m, (EOS,))
        assert results[rid]["output_ids"] == want, (kind, text_of(tok, results[rid]), tok.decode(want))
        assert results[rid]["finished"]["type"] == "stop"
    tagged = re.fullmatch("<answer>([0-9]+)</answer>", text_of(tok, results[rids[-1]]))
    assert tagged and 0 <= int(tagged.group(1)) <= 99
    assert sched.get_stats()["jump_forward_tokens"] == 0


@prop(4)
@given(case=schema_cases(max_tokens=120))
def test_greedy_matches_hf_for_generated_schemas(exact_sched, tiny_chat_model, tok, prompt, avoid, case) -> None:
    rid = submit(exact_sched, prompt, json_schema=case.text, max_new_tokens=case.max_tokens, logit_bias=avoid)
    result = drive(exact_sched)[rid]
    assert result["output_ids"] == hf_constrained_greedy(
        tiny_chat_model, prompt, "json_schema", case.text, case.max_tokens, (EOS,), avoid
    )
    assert_valid_json(tok, result, case.schema)


def test_jump_forward_appends_forced_text_in_fewer_steps(tiny_chat_model, tok, prompt) -> None:
    schema = {
        "type": "object",
        "properties": {
            "customer_identifier": {"enum": ["alpha-customer", "beta-customer"]},
            "is_subscription_active": {"type": "boolean"},
            "preferred_contact_channel": {"enum": ["electronic-mail", "telephone"]},
        },
        "required": ["customer_identifier", "is_subscription_active", "preferred_contact_channel"],
    }
    runs = {}
    for jump_forward in (False, True):
        sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=4096, disable_jump_forward=not jump_forward)
        rids = [submit(sched, p, json_schema=json.dumps(schema), max_new_tokens=100) for p in (prompt, prompt[:3])]
        results = drive(sched)
        for rid in rids:
            assert_valid_json(tok, results[rid], schema)
        runs[jump_forward] = sched.get_stats()
    assert runs[False]["jump_forward_tokens"] == 0
    assert runs[True]["jump_forward_tokens"] > 0
    assert runs[True]["forward_steps"] < runs[False]["forward_steps"]


def test_stop_token_inside_jump_forward_text_ends_the_output(tiny_chat_model, tok, prompt) -> None:
    """A stop token id among the forced tokens ends the output right after it, as a sampled
    one would (it used to be skipped unless it was the last forced token)."""
    schema = json.dumps({
        "type": "object",
        "properties": {"customer_identifier_code": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["customer_identifier_code"],
    })
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=4096)
    first = submit(sched, prompt, json_schema=schema, max_new_tokens=30)
    baseline = drive(sched)[first]["output_ids"]
    forced_before = sched.get_stats()["jump_forward_tokens"]
    assert forced_before >= 4  # the key is appended by jump-forward, several tokens at once
    stop = tok.convert_tokens_to_ids("_")  # inside the forced key, never the last of its run
    assert stop in baseline
    rid = submit(sched, prompt, json_schema=schema, max_new_tokens=30, stop_token_ids=[stop])
    r = drive(sched)[rid]
    assert r["output_ids"] == baseline[: baseline.index(stop) + 1]
    assert r["finished"] == {"type": "stop", "matched": stop}
    assert sched.get_stats()["jump_forward_tokens"] > forced_before


# ---- scheduling: retraction, chunked prefill, abort, cache hits -----------------------------


def test_constrained_requests_survive_retraction(tiny_chat_model, tok) -> None:
    """A pool too small for all of them: requests are retracted mid-grammar, recomputed and
    continue; greedy outputs equal those of a pool with room to spare.  The outputs use
    nearly all of max_new_tokens, so admission's reservation falls short and decoding
    runs out of pages."""
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(16)] for _ in range(8)]
    array = {"type": "array", "items": {"type": "integer", "minimum": 100, "maximum": 999}, "minItems": 8, "maxItems": 8}
    cases = [({"regex": DIGITS}, 41)] * 6 + [({"json_schema": json.dumps(array)}, 41)] * 2
    outputs = {}
    for pool in (4096, 160):
        sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=pool, page_size=4)
        rids = [submit(sched, p, max_new_tokens=m, **c) for p, (c, m) in zip(prompts, cases, strict=True)]
        results = drive(sched)
        outputs[pool] = [results[r]["output_ids"] for r in rids]
        for rid, (c, _) in zip(rids, cases, strict=True):
            r = results[rid]
            if "regex" in c:
                assert r["finished"]["type"] == "stop" and re.fullmatch(DIGITS, text_of(tok, r)), r
            else:
                assert_valid_json(tok, r, array)
        retractions = sched.get_stats()["retractions"]
        assert (retractions > 0) == (pool == 160), retractions
    assert outputs[160] == outputs[4096]


def test_chunked_prefill_of_a_constrained_request(tiny_chat_model, tok) -> None:
    rng = random.Random(1)
    long_prompt = [rng.randrange(100, 40000) for _ in range(150)]
    outputs = []
    for chunk in (None, 16):
        sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=4096, chunked_prefill_size=chunk,
                               disable_jump_forward=True)
        rid = submit(sched, long_prompt, json_schema=PERSON_TEXT, max_new_tokens=80)
        short = submit(sched, long_prompt[:20], regex=DIGITS, max_new_tokens=80)
        steps = []
        results = drive(sched, on_step=lambda i, s, seen=steps: seen.append(s.chunked is not None))
        assert_valid_json(tok, results[rid], PERSON)
        assert re.fullmatch(DIGITS, text_of(tok, results[short]))
        assert any(steps) == (chunk is not None)
        outputs.append(results[rid]["output_ids"])
    assert outputs[0] == outputs[1]
    assert outputs[1] == hf_constrained_greedy(tiny_chat_model, long_prompt, "json_schema", PERSON_TEXT, 80, (EOS,))


def test_abort_in_the_middle_of_a_grammar(tiny_chat_model, tok, prompt) -> None:
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=4096, page_size=4)
    victim = submit(sched, prompt, regex=DIGITS, max_new_tokens=80)
    other = submit(sched, prompt + [11, 12], json_schema=PERSON_TEXT, max_new_tokens=80)

    def abort_midway(step: int, s: Any) -> None:
        req = s.reqs.get(victim)
        if req is not None and not req.finished and req.output_len >= 5:
            assert req.grammar is not None and 0 < req.grammar.num_accepted < 40
            s.abort(victim)

    results = drive(sched, on_step=abort_midway)
    assert results[victim]["finished"]["type"] == "abort"
    assert 5 <= len(results[victim]["output_ids"]) < 40
    assert_valid_json(tok, results[other], PERSON)
    assert sched.get_stats()["requests_aborted"] == 1


def test_abort_while_the_grammar_compiles(tiny_chat_model, tok, prompt) -> None:
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=4096)
    rid = submit(sched, prompt, regex="[a-f]{3}[0-9]{2}x" * 5, max_new_tokens=60)
    free_run = submit(sched, prompt, max_new_tokens=3)
    sched.abort(rid)  # still waiting (possibly compiling): dropped, never admitted
    results = drive(sched)
    assert results[rid]["finished"]["type"] == "abort" and results[rid]["output_ids"] == []
    assert results[free_run]["finished"]["type"] == "length"


def test_radix_cache_hit_in_the_middle_of_a_grammar(tiny_chat_model, tok, prompt) -> None:
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=4096, page_size=1)
    first = submit(sched, prompt, json_schema=PERSON_TEXT, max_new_tokens=80)
    r1 = drive(sched)[first]
    assert r1["meta"]["cached_tokens"] == 0
    # The same request again: the prompt comes from the tree, the output is the same.
    again = submit(sched, prompt, json_schema=PERSON_TEXT, max_new_tokens=80)
    r2 = drive(sched)[again]
    assert r2["output_ids"] == r1["output_ids"] and r2["meta"]["cached_tokens"] > 0
    # A prompt that ends inside the first output (an unfinished JSON object): the tree holds
    # the first request's output, and the same grammar constrains the new continuation.
    cut = len(r1["output_ids"]) // 2
    resumed = submit(sched, prompt + r1["output_ids"][:cut], json_schema=PERSON_TEXT, max_new_tokens=80)
    r3 = drive(sched)[resumed]
    assert r3["meta"]["cached_tokens"] >= len(prompt) + cut - 1
    assert_valid_json(tok, r3, PERSON)


# ---- min_new_tokens --------------------------------------------------------------------------


@prop(10)
@given(k=st.integers(0, 12), mode=st.sampled_from(["eos", "stop_token_ids", "grammar"]))
def test_min_new_tokens_holds_back_the_end(shared_sched, tok, prompt, k, mode) -> None:
    """The end token is pushed to be the argmax at every step; it comes exactly at k."""
    stop = EOS if mode != "stop_token_ids" else tok.convert_tokens_to_ids("!")
    params: dict[str, Any] = {"min_new_tokens": k, "max_new_tokens": 40, "logit_bias": {stop: 100.0}}
    if mode == "stop_token_ids":
        params["stop_token_ids"] = [stop]
    if mode == "grammar":
        params["regex"] = "[a-z]{0,400}"  # never complete within 13 tokens
    rid = submit(shared_sched, prompt, **params)
    r = drive(shared_sched)[rid]
    assert len(r["output_ids"]) == k + 1, (k, r)
    assert r["output_ids"][-1] == stop and stop not in r["output_ids"][:-1]
    assert r["finished"]["type"] == "stop"
    if mode == "grammar":
        assert re.fullmatch("[a-z]{0,400}", text_of(tok, r))


def test_min_new_tokens_beyond_what_the_grammar_allows(shared_sched, tok, prompt) -> None:
    """The grammar wins: a complete sentence with nothing more allowed ends the request."""
    rid = submit(shared_sched, prompt, regex="ab", min_new_tokens=10, max_new_tokens=20)
    r = drive(shared_sched)[rid]
    assert text_of(tok, r) == "ab" and r["finished"]["type"] == "stop"


def test_ignore_eos_does_not_go_past_the_end_of_a_grammar(shared_sched, tok, prompt) -> None:
    """With ignore_eos the grammar's stop token (EOS) does not stop the request by itself, but
    the grammar allows nothing after it: the request ends there (this used to crash the step
    loop, asking the terminated matcher for a mask), and its neighbours are unaffected."""
    ended = submit(shared_sched, prompt, regex="[a-z]{0,50}", ignore_eos=True, max_new_tokens=10,
                   logit_bias={EOS: 100.0})
    other = submit(shared_sched, prompt, regex=DIGITS, max_new_tokens=41)
    free_run = submit(shared_sched, prompt, ignore_eos=True, max_new_tokens=5, logit_bias={EOS: 100.0})
    results = drive(shared_sched)
    assert results[ended]["output_ids"] == [EOS]
    assert results[ended]["finished"] == {"type": "stop", "matched": EOS}
    assert re.fullmatch(DIGITS, text_of(tok, results[other]))
    assert results[free_run]["output_ids"] == [EOS] * 5  # no grammar: ignore_eos goes on
    assert results[free_run]["finished"]["type"] == "length"


# ---- bad input ------------------------------------------------------------------------------

BAD_GRAMMARS = [
    ({"json_schema": "{not json"}, ["json_schema", "not valid JSON"]),
    ({"json_schema": "[1, 2]"}, ["json_schema", "JSON object"]),
    ({"json_schema": '{"type": "integer", "minimum": 5, "maximum": 1}'}, ["json_schema", "minimum greater than maximum"]),
    ({"json_schema": '{"type": "frobnicate"}'}, ["json_schema", "frobnicate"]),
    ({"regex": "("}, ["regex", "parenthesis"]),
    ({"regex": "[a-"}, ["regex", "["]),
    ({"ebnf": 'root ::= "a" |'}, ["ebnf", "line 1"]),
    ({"ebnf": "root ::= undefined_rule"}, ["ebnf", "undefined_rule"]),
    ({"ebnf": 'start ::= "a"'}, ["ebnf", "root"]),
    ({"structural_tag": "{nope"}, ["structural_tag", "not valid JSON"]),
]


@pytest.mark.parametrize(("params", "words"), BAD_GRAMMARS, ids=lambda v: str(v)[:40] if isinstance(v, dict) else None)
def test_bad_grammar_is_answered_with_an_error(tiny_chat_model, tok, prompt, params, words) -> None:
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=2048, page_size=4)
    good = submit(sched, prompt, json_schema=PERSON_TEXT, max_new_tokens=80)
    free_run = submit(sched, prompt, max_new_tokens=6)
    bad = submit(sched, prompt, max_new_tokens=10, **params)  # accepted: compiled off the loop
    results = drive(sched)
    err = results[bad]["error"]
    assert err.status == 400 and all(w in err.message for w in words), err.message
    assert_valid_json(tok, results[good], PERSON)
    assert results[free_run]["finished"]["type"] == "length"
    assert bad not in sched.reqs


def test_repeated_bad_grammar_is_answered_from_the_cache(tiny_chat_model, tok, prompt) -> None:
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=2048)
    first = submit(sched, prompt, regex="(ab", max_new_tokens=5)
    e1 = drive(sched)[first]["error"]
    compiled = sched.get_stats()["grammars_compiled"]
    assert compiled == 1
    assert sched.constraints.compiler.submit(("regex", "(ab")).done()  # cached, as an error
    again = submit(sched, prompt, regex="(ab", max_new_tokens=5)
    sched.step()  # the cached error is there at once: answered in the first step
    errors = sched.take_errors()
    assert [(e.rid, e.message, e.status) for e in errors] == [(again, e1.message, 400)]
    assert sched.get_stats()["grammars_compiled"] == compiled
    assert not sched.has_work
    # A good grammar used by two requests is compiled once, too.
    rids = [submit(sched, prompt, regex="[xy]{4}", max_new_tokens=8) for _ in range(2)]
    results = drive(sched)
    assert all(re.fullmatch("[xy]{4}", text_of(tok, results[r])) for r in rids)
    assert sched.get_stats()["grammars_compiled"] == compiled + 1


def test_grammar_refused_at_once_when_it_cannot_apply(tiny_chat_model, tok, prompt) -> None:
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=2048)
    good = submit(sched, prompt, regex="[xy]{4}", max_new_tokens=8)
    rid, err = add(sched, prompt, regex="a+", ebnf='root ::= "a"')
    assert err is not None and err.status == 400
    assert "regex" in err.message and "ebnf" in err.message and "at most one" in err.message
    rid, err = add(sched, prompt, json_schema=PERSON_TEXT, min_new_tokens=5, max_new_tokens=4)
    assert err is not None and err.status == 400 and "min_new_tokens" in err.message
    off = make_scheduler(tiny_chat_model, tok, max_total_tokens=2048, grammar_backend="none")
    rid, err = add(off, prompt, json_schema=PERSON_TEXT)
    assert err is not None and err.status == 400
    assert "json_schema" in err.message and "grammar-backend none" in err.message
    assert not off.has_work and rid not in off.reqs
    free_run = submit(off, prompt, max_new_tokens=3)
    assert drive(off)[free_run]["finished"]["type"] == "length"
    assert re.fullmatch("[xy]{4}", text_of(tok, drive(sched)[good]))


def test_compiler_memory_is_bounded_by_its_cache(tok, monkeypatch) -> None:
    """Every distinct grammar text is compiled once and kept in an LRU; nothing else keeps
    grammars (xgrammar's own compiler cache has no size limit unless turned off)."""
    from radixserve.grammar import GrammarError, RequestGrammar
    from radixserve.grammar import compiler as compiler_module

    monkeypatch.setattr(compiler_module, "CACHE_ENTRIES", 3)
    compiler = compiler_module.GrammarCompiler(tok, 49152, [EOS])
    try:
        keys = [("regex", f"[a-c]{{{n}}}x") for n in range(1, 9)] + [("json_schema", PERSON_TEXT)]
        for key in keys:
            compiler.compile_now(key)
        with pytest.raises(GrammarError, match="regex"):
            compiler.compile_now(("regex", "(x"))
        assert len(compiler.compile_seconds) <= 3
        assert compiler._compiler.get_cache_size_bytes() == 0  # xgrammar keeps nothing itself
        # An evicted grammar compiles again and works.
        again = RequestGrammar(compiler.compile_now(keys[0]), [EOS])
        assert all(again.accept(t) for t in tok.encode("ax", add_special_tokens=False))
        assert again.completed
    finally:
        compiler.shutdown()


# ---- compilation is off the step loop ----------------------------------------------------


def big_schema(n: int, seed: int = 0) -> dict:
    """Slow to compile (seconds): n required fields, each with its own string pattern."""
    rng = random.Random(seed)

    def word() -> str:
        return "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 10)))

    props = {f"f{i}": {"type": "string", "pattern": f"^{word()}[0-9]{{1,3}}{word()}$"} for i in range(n)}
    return {"type": "object", "properties": props, "required": list(props)}


def test_slow_compile_does_not_delay_other_requests(tiny_chat_model, tok, prompt) -> None:
    sched = make_scheduler(tiny_chat_model, tok, max_total_tokens=4096)
    slow = submit(sched, prompt, json_schema=json.dumps(big_schema(1200)), max_new_tokens=6)
    quick = submit(sched, prompt, max_new_tokens=4)
    seen: list[tuple[int, bool]] = []  # (quick's output length, slow still compiling) per step

    def watch(step: int, s: Any) -> None:
        q, w = s.reqs.get(quick), s.reqs.get(slow)
        compiling = w is not None and w.state == ReqState.WAITING and w.grammar is None
        seen.append((q.output_len if q is not None else 4, compiling))

    results = drive(sched, on_step=watch)
    assert any(n > 0 and compiling for n, compiling in seen), seen
    # The unconstrained request even finished before the grammar was ready.
    assert (4, True) in seen
    assert results[quick]["finished"]["type"] == "length"
    out = text_of(tok, results[slow])
    assert results[slow]["finished"]["type"] == "length" and out.startswith('{"f0": "')


# ---- through the offline Engine (real processes over ZeroMQ) ---------------------------------


@pytest.fixture(scope="module")
def engine(tiny_chat_model: str) -> Any:
    from radixserve import Engine

    with Engine(model=tiny_chat_model, max_total_tokens=8192, random_seed=3, dtype="float32") as eng:
        yield eng


@pytest.fixture
def checked_engine(engine: Any) -> Any:
    yield engine
    report = engine.check_memory()
    assert report["ok"], report
    assert report["locked_tokens"] == 0 and report["request_pages"] == 0, report


def test_engine_json_schema_plain_and_streamed(checked_engine, avoid) -> None:
    params = {"json_schema": PERSON_TEXT, "max_new_tokens": 80, "temperature": 0}
    out = checked_engine.generate("Describe a user as JSON:", params)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    jsonschema.validate(json.loads(out["text"]), PERSON)
    pieces = list(checked_engine.generate("Describe a user as JSON:", params, stream=True))
    assert len(pieces) >= 2
    assert "".join(p["text"] for p in pieces) == out["text"]
    assert [t for p in pieces for t in p["output_ids"]] == out["output_ids"]
    assert pieces[-1]["meta_info"]["finish_reason"]["type"] == "stop"
    sampled = checked_engine.generate("Describe a user as JSON:", {**params, "temperature": 1.0, "logit_bias": avoid})
    jsonschema.validate(json.loads(sampled["text"]), PERSON)


def test_engine_regex_and_ebnf(checked_engine) -> None:
    date = "(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    out = checked_engine.generate("A date:", {"regex": date, "max_new_tokens": 20, "temperature": 0})
    assert re.fullmatch(date, out["text"]) and out["meta_info"]["finish_reason"]["type"] == "stop"
    case = arith_grammar(1, 1)
    out = checked_engine.generate("Compute:", {"ebnf": case.grammar, "max_new_tokens": case.max_tokens, "temperature": 0.8})
    check_arith(out["text"], case)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"


def test_engine_batch_of_mixed_requests(checked_engine, avoid) -> None:
    case = arith_grammar(1, 1)
    params = [
        {"json_schema": PERSON_TEXT, "max_new_tokens": 80, "temperature": 0},
        {"max_new_tokens": 7, "temperature": 0, "ignore_eos": True},
        {"regex": DIGITS, "max_new_tokens": 60, "temperature": 1.0},
        {"ebnf": case.grammar, "max_new_tokens": case.max_tokens, "temperature": 0.7},
        {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True},
        {"json_schema": PERSON_TEXT, "max_new_tokens": 80, "temperature": 1.0, "logit_bias": avoid},
        {"regex": "(yes|no)", "max_new_tokens": 5, "temperature": 0},
        {"max_new_tokens": 9, "temperature": 0, "ignore_eos": True},
    ]
    prompts = [f"Request {i}: answer as asked." for i in range(8)]
    outs = checked_engine.generate(prompts, params, progress=False)
    for out, p in zip(outs, params, strict=True):
        reason = out["meta_info"]["finish_reason"]["type"]
        if "json_schema" in p:
            jsonschema.validate(json.loads(out["text"]), PERSON)
        elif "regex" in p:
            assert re.fullmatch(p["regex"], out["text"])
        elif "ebnf" in p:
            check_arith(out["text"], case)
        else:
            assert reason == "length" and out["meta_info"]["completion_tokens"] == p["max_new_tokens"]
            continue
        assert reason == "stop"
    # The unconstrained greedy one is the same alone as in the mixed batch.
    alone = checked_engine.generate(prompts[1], params[1])
    assert alone["output_ids"] == outs[1]["output_ids"]


def test_engine_bad_grammars_are_errors(checked_engine) -> None:
    from radixserve.engine import RequestError

    with pytest.raises(ValueError, match="regex") as info:
        checked_engine.generate("x", {"regex": "[a-", "max_new_tokens": 5})
    assert isinstance(info.value, RequestError) and info.value.status == 400
    with pytest.raises(ValueError, match="json_schema.*not valid JSON"):
        checked_engine.generate("x", {"json_schema": "{", "max_new_tokens": 5})
    with pytest.raises(ValueError, match="ebnf"):
        checked_engine.generate("x", {"ebnf": "root ::= nothing_here", "max_new_tokens": 5})
    with pytest.raises(ValueError, match="at most one"):
        checked_engine.generate("x", {"regex": "a", "json_schema": "{}", "max_new_tokens": 5})
    # In a batch, the bad one fails the call; the engine goes on serving.
    with pytest.raises(ValueError, match="regex"):
        checked_engine.generate(["a", "b"], [{"regex": "(", "max_new_tokens": 3}, {"max_new_tokens": 3}], progress=False)
    out = checked_engine.generate("x", {"regex": "[0-9]{3}", "max_new_tokens": 5, "temperature": 0})
    assert re.fullmatch("[0-9]{3}", out["text"])


def test_engine_bad_grammar_next_to_requests_in_flight(checked_engine) -> None:
    import asyncio

    async def main() -> list[Any]:
        return await asyncio.gather(
            checked_engine.async_generate("a", {"regex": "[0-9]{5}", "max_new_tokens": 8, "temperature": 0}),
            checked_engine.async_generate("b", {"json_schema": '{"type": "nope"}', "max_new_tokens": 8}),
            checked_engine.async_generate("c", {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}),
            return_exceptions=True,
        )

    good, bad, free_run = asyncio.run(main())
    assert isinstance(bad, ValueError) and "json_schema" in str(bad) and "nope" in str(bad)
    assert re.fullmatch("[0-9]{5}", good["text"]) and good["meta_info"]["finish_reason"]["type"] == "stop"
    assert free_run["meta_info"]["completion_tokens"] == 6


@pytest.mark.slow
def test_engine_without_a_grammar_backend(tiny_chat_model) -> None:
    from radixserve import Engine

    with Engine(model=tiny_chat_model, max_total_tokens=2048, grammar_backend="none", dtype="float32") as engine:
        with pytest.raises(ValueError, match="json_schema.*grammar-backend none"):
            engine.generate("x", {"json_schema": PERSON_TEXT, "max_new_tokens": 5})
        out = engine.generate("x", {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        assert out["meta_info"]["completion_tokens"] == 4
        report = engine.check_memory()
        assert report["ok"] and report["locked_tokens"] == 0, report
