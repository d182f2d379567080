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
    with Engine(max_total_tokens=8192, random_seed=1) as eng:
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
    shared = expected_cached_len(ids[1], [first_kv], engine.info["page_size"])
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
    out = engine.generate("The capital of France is", {"max_new_tokens": 4, "temperature": 0}, return_logprob=True, top_logprobs_num=3)
    lps = out["meta_info"]["output_token_logprobs"]
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(lps) == len(out["output_ids"]) == len(tops)
    for tok, lp, top in zip(out["output_ids"], lps, tops, strict=True):
        assert lp <= 0 and len(top) == 3
        assert top[0][0] == tok and abs(top[0][1] - lp) < 1e-5  # greedy: the best alternative


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"prompt": ""}, "empty"),
        ({"prompt": "hi", "sampling_params": {"max_new_tokens": 0}}, "max_new_tokens"),
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
    eng = Engine(max_total_tokens=1024)
    pids = [p.pid for p in eng.procs.procs.values()]
    assert len(pids) == 2 and all(psutil.pid_exists(p) for p in pids)
    assert eng.generate("Hi", {"max_new_tokens": 1})["meta_info"]["completion_tokens"] == 1
    eng.shutdown()
    for pid in pids:
        assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    with pytest.raises(ValueError, match="unknown setting"):
        Engine(max_total_token=5)
