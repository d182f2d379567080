"""The offline Engine: real scheduler and detokenizer processes over ZeroMQ, default model."""

from __future__ import annotations

import asyncio

import psutil
import pytest
from helpers.assertions import expected_cached_len

from radixserve import Engine

SYSTEM = (
    "You are a helpful assistant for a travel agency. Answer briefly and politely. "
    "Always mention the city name in your answer. "
) * 3


@pytest.fixture(scope="module")
def engine(default_model_path):
    with Engine(max_total_tokens=8192, random_seed=1, dtype="float32") as eng:
        yield eng


@pytest.fixture(autouse=True)
def memory_invariant(request):
    yield
    if "engine" in request.fixturenames:
        eng = request.getfixturevalue("engine")
        report = eng.check_memory()
        assert report["ok"], report
        assert report["locked_tokens"] == 0 and report["request_pages"] == 0


def test_greedy_matches_hf_and_second_request_hits_cache(engine, default_model_path) -> None:
    from helpers.oracle import hf_greedy

    prompts = [SYSTEM + "Question: where is the Eiffel tower?", SYSTEM + "Question: what is Rome famous for?"]
    assert engine.flush_cache()  # the first prompt finds nothing in the tree
    before = engine.get_stats()
    outs = []
    for p in prompts:
        outs.append(engine.generate(p, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}))
    ids = [engine.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for prompt_ids, out in zip(ids, outs, strict=True):
        assert out["output_ids"] == hf_greedy(default_model_path, prompt_ids, 12)
        assert out["text"] == engine.tokenizer.decode(out["output_ids"], skip_special_tokens=True)
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(prompt_ids) and meta["completion_tokens"] == 12
        assert meta["finish_reason"]["type"] == "length"
    # The tree holds the first request's KV: its prompt and all but its last output token
    # (never fed back); the second request is served the prefix both prompts share.
    first_kv = ids[0] + outs[0]["output_ids"][:-1]
    shared = expected_cached_len(ids[1], [first_kv], engine.info.page_size)
    assert shared > len(ids[0]) // 2  # the long system prompt
    assert [o["meta_info"]["cached_tokens"] for o in outs] == [0, shared]
    stats = engine.get_stats()
    assert stats["cached_tokens"] - before["cached_tokens"] == shared
    assert stats["prompt_tokens"] - before["prompt_tokens"] == len(ids[0]) + len(ids[1])
    assert stats["cache_hit_rate"] == stats["cached_tokens"] / stats["prompt_tokens"]


def test_batch_input_ids_and_order(engine) -> None:
    prompts = ["One, two, three,", "The sky is", "Paris is the capital of"]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (3, 5, 7)]
    outs = engine.generate(prompts, params)
    # Results come back in request order: each carries its own prompt and max_new_tokens.
    assert [o["meta_info"]["prompt_tokens"] for o in outs] == [
        len(engine.tokenizer.encode(p, add_special_tokens=False)) for p in prompts
    ]
    assert [o["meta_info"]["completion_tokens"] for o in outs] == [3, 5, 7]
    assert [len(o["output_ids"]) for o in outs] == [3, 5, 7]
    single = engine.generate(prompts[2], params[2])
    assert outs[2]["output_ids"] == single["output_ids"]
    by_ids = engine.generate(input_ids=[engine.tokenizer.encode(p) for p in prompts], sampling_params=params[2])
    assert [o["meta_info"]["completion_tokens"] for o in by_ids] == [7, 7, 7]
    assert by_ids[2]["output_ids"] == single["output_ids"]


def test_stream_joins_to_the_full_text(engine) -> None:
    params = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}
    full = engine.generate("Write a haiku about autumn.", params)
    pieces = list(engine.generate("Write a haiku about autumn.", params, stream=True))
    assert len(pieces) >= 2
    assert "".join(p["text"] for p in pieces) == full["text"]
    assert [t for p in pieces for t in p["output_ids"]] == full["output_ids"]
    assert pieces[-1]["meta_info"]["finish_reason"] is not None
    assert all(p["meta_info"]["finish_reason"] is None for p in pieces[:-1])


def test_async_generate_and_async_stream(engine) -> None:
    params = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}

    async def main():
        a, b = await asyncio.gather(
            engine.async_generate("Hello, my name is", params),
            engine.async_generate("The weather today", params),
        )
        stream = await engine.async_generate("Hello, my name is", params, stream=True)
        text = "".join([p["text"] async for p in stream])
        return a, b, text

    a, b, text = asyncio.run(main())
    assert a["meta_info"]["completion_tokens"] == b["meta_info"]["completion_tokens"] == 6
    assert b["output_ids"] == engine.generate("The weather today", params)["output_ids"]
    assert text == a["text"]


def test_stop_string_is_excluded(engine) -> None:
    params = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    full = engine.generate("Count: 1, 2, 3, 4, 5,", params)["text"]
    assert len(full) > 6
    stop = full[3:6]
    out = engine.generate("Count: 1, 2, 3, 4, 5,", {**params, "stop": [stop]})
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert stop not in out["text"]
    assert full.startswith(out["text"]) and len(out["text"]) <= 3 + len(stop)
    streamed = "".join(p["text"] for p in engine.generate("Count: 1, 2, 3, 4, 5,", {**params, "stop": stop}, stream=True))
    assert streamed == out["text"]


def test_seed_reproducible(engine) -> None:
    params = {"max_new_tokens": 12, "temperature": 1.0, "seed": 1234}
    a = engine.generate("Tell me a story about a dragon.", params)
    b = engine.generate("Tell me a story about a dragon.", params)
    c = engine.generate("Tell me a story about a dragon.", {**params, "seed": 99})
    assert a["output_ids"] == b["output_ids"]
    assert a["output_ids"] != c["output_ids"]


def test_logprobs(engine) -> None:
    prompt = "The capital of France is"
    prompt_ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    out = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0}, return_logprob=True, top_logprobs_num=3)
    meta = out["meta_info"]
    lps, tops = meta["output_token_logprobs"], meta["output_top_logprobs"]
    assert len(lps) == len(out["output_ids"]) == len(tops) == 4
    for tok, (lp, tid, text), top in zip(out["output_ids"], lps, tops, strict=True):
        assert tid == tok and text is None and lp <= 0 and len(top) == 3
        assert top[0][1] == tok and abs(top[0][0] - lp) < 1e-5  # greedy: the best alternative
    # The default logprob_start_len (-1): the last prompt position only.
    assert [e[1:] for e in meta["input_token_logprobs"]] == [[prompt_ids[-1], None]]
    assert meta["input_token_logprobs"][0][0] < 0 and len(meta["input_top_logprobs"][0]) == 3
    # Texts when asked: each token decoded on its own, in every list.
    texted = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0}, return_logprob=True,
                             top_logprobs_num=2, return_text_in_logprobs=True, logprob_start_len=0)["meta_info"]
    decode = engine.tokenizer.decode
    assert [e[2] for e in texted["output_token_logprobs"]] == [decode([t]) for t in out["output_ids"]]
    assert [e[1:] for e in texted["input_token_logprobs"]] == [[t, decode([t])] for t in prompt_ids]
    assert texted["input_token_logprobs"][0][0] is None and texted["input_top_logprobs"][0] is None
    assert all(e[2] == decode([e[1]]) for top in texted["input_top_logprobs"][1:] + texted["output_top_logprobs"]
               for e in top)
    assert [e[0] for e in texted["output_token_logprobs"]] == pytest.approx([e[0] for e in lps], abs=1e-5)
    # Without top_logprobs_num the top lists hold None per position.
    plain = engine.generate(prompt, {"max_new_tokens": 2, "temperature": 0}, return_logprob=True)["meta_info"]
    assert plain["output_top_logprobs"] == [None, None] and plain["input_top_logprobs"] == [None]


def test_prefill_only_with_and_without_cache_hit(engine) -> None:
    prompt = SYSTEM + "Question: what is the capital of Spain?"
    ids = engine.tokenizer.encode(prompt, add_special_tokens=False)
    page = engine.info.page_size
    assert engine.flush_cache()
    out = engine.generate(prompt, {"max_new_tokens": 0})
    assert out["text"] == "" and out["output_ids"] == []
    meta = out["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "matched": None, "length": 0}
    assert (meta["prompt_tokens"], meta["cached_tokens"], meta["completion_tokens"]) == (len(ids), 0, 0)
    # A longer prompt scored from the end of the cached one: served from the tree up to there.
    longer = prompt + " Answer:"
    ids2 = engine.tokenizer.encode(longer, add_special_tokens=False)
    assert ids2[: len(ids)] == ids
    scored = engine.generate(longer, {"max_new_tokens": 0}, return_logprob=True, logprob_start_len=len(ids))
    meta = scored["meta_info"]
    assert meta["cached_tokens"] == (len(ids) - 1) // page * page and meta["completion_tokens"] == 0
    assert [e[1] for e in meta["input_token_logprobs"]] == ids2[len(ids):]
    assert all(e[0] < 0 for e in meta["input_token_logprobs"]) and meta["output_token_logprobs"] == []
    # Generating from the prefix afterwards reads it from the tree.
    gen = engine.generate(prompt, {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
    assert gen["meta_info"]["cached_tokens"] == expected_cached_len(ids, [ids2], page)
    assert gen["meta_info"]["completion_tokens"] == 4


def test_pin_keeps_a_prefix_and_unpin_releases_it(engine) -> None:
    assert engine.flush_cache()
    page = engine.info.page_size
    msgs = [{"role": "system", "content": SYSTEM}]
    pin = engine.pin(messages=msgs, ttl=600)
    ids = engine.tokenizer.encode(engine.apply_chat_template(msgs, add_generation_prompt=False),
                                  add_special_tokens=False)
    assert pin["tokens"] == len(ids) // page * page and 0 < pin["expires_in"] <= 600
    assert [p | {"expires_in": None} for p in engine.pins()] == [pin | {"expires_in": None}]
    assert engine.check_memory()["pinned_tokens"] == pin["tokens"]
    # A chat request with that system prompt reads it from the tree.
    chat = engine.apply_chat_template(msgs + [{"role": "user", "content": "Where is Rome?"}])
    out = engine.generate(chat, {"max_new_tokens": 1}, return_cache_report=True)
    assert out["meta_info"]["cached_tokens"] >= pin["tokens"] - page
    report = out["meta_info"]["cache_report"]
    assert report["cached_tokens"] == out["meta_info"]["cached_tokens"] and report["request_next"]
    salted = engine.pin(messages=msgs, extra_key="tenant-x")  # its own copy in its namespace
    assert salted["cache_salt"] == "tenant-x" and salted["pin_id"] != pin["pin_id"]
    assert engine.unpin(messages=msgs, extra_key="tenant-x") == [salted["pin_id"]]
    assert engine.unpin(pin["pin_id"]) == [pin["pin_id"]]
    assert engine.pins() == [] and engine.unpin(pin["pin_id"]) == []
    with pytest.raises(ValueError, match="exactly one"):
        engine.pin()
    with pytest.raises(ValueError, match="ttl"):
        engine.pin(prompt="hello there", ttl=-1)


def test_apply_chat_template(engine) -> None:
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Capital of Spain?"}]
    render = engine.tokenizer.apply_chat_template
    assert engine.apply_chat_template(msgs) == render(msgs, add_generation_prompt=True, tokenize=False)
    assert engine.apply_chat_template(msgs, add_generation_prompt=False) == render(msgs, tokenize=False)
    cont = [*msgs, {"role": "assistant", "content": "It is"}]
    assert engine.apply_chat_template(cont, continue_final_message=True) == render(
        cont, continue_final_message=True, tokenize=False)
    with pytest.raises(ValueError, match="role"):
        engine.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="continue_final_message"):
        engine.apply_chat_template(msgs, continue_final_message=True)
    with pytest.raises(ValueError, match="chat_template_kwargs may not set"):
        engine.apply_chat_template(msgs, tokenize=True)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": -1}}, "max_new_tokens"),
        ({"prompt": "hi", "sampling_params": {"n": 2}}, "sampling_params.n"),
        ({"prompt": "hi", "sampling_params": {"temperature": -0.5}}, "temperature"),
        ({"prompt": "hi", "sampling_params": {"top_p": 0}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"top_p": 1.5}}, "top_p"),
        ({"prompt": "hi", "sampling_params": {"top_k": 0}}, "top_k"),
        ({"prompt": "hi", "sampling_params": {"top_k": -2}}, "top_k"),
        ({"prompt": "hi", "sampling_params": {"max_tokens": 3}}, "max_tokens"),
        ({"input_ids": [1, 2, 10**9]}, "vocabulary"),
        ({"input_ids": [-5]}, "vocabulary"),
        ({"input_ids": []}, "empty"),
        ({"prompt": "word " * 9000}, "context length"),
        ({"prompt": ["ok", ""]}, "request 1"),
        ({}, "prompt"),
    ],
)
def test_bad_input_raises_value_error_and_engine_keeps_serving(engine, kwargs, fragment) -> None:
    with pytest.raises(ValueError, match=fragment):
        engine.generate(**kwargs)
    out = engine.generate("Hello", {"max_new_tokens": 2, "temperature": 0, "ignore_eos": True})
    assert out["meta_info"]["completion_tokens"] == 2


def test_shutdown_leaves_no_process(default_model_path) -> None:
    eng = Engine(max_total_tokens=1024, dtype="float32")
    pids = [p.pid for p in eng.procs.procs.values()]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    assert eng.generate("Hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
    eng.shutdown()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(ValueError, match="unknown setting"):
        Engine(max_total_token=5, dtype="float32")
