"""Prompt logprobs (``logprob_start_len``) against HF transformers' log-softmax, in the scheduler
(chunked prefill, cached prefixes, page sizes 1 and 16, retraction) and over HTTP
(native ``/generate``, OpenAI ``/v1/completions`` with ``echo`` + ``logprobs``)."""

from __future__ import annotations

import functools
import math
import random
from typing import Any

import httpx
import openai
import pytest
import torch
from helpers import sched_driver
from helpers.oracle import hf_greedy, hf_model
from helpers.sched_driver import make_scheduler, run_until_idle
from helpers.server import memory_checked_after_each_test, openai_client, tiny_chat_server

from radixserve.ipc.messages import GenerateReq
from radixserve.sampling import SamplingParams

TOL = 1e-4


def prompts(n: int, lo: int, hi: int, seed: int = 0, vocab: int = 256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(6, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


@functools.lru_cache(maxsize=32)
def hf_prompt_logprobs(folder: str, prompt: tuple[int, ...]) -> torch.Tensor:
    """``[len(prompt), vocab]``: row p is log_softmax of HF's float32 logits at position p."""
    with torch.inference_mode():
        logits = hf_model(folder)(input_ids=torch.tensor([list(prompt)])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def check_prompt_logprobs(folder: str, prompt: list[int], start: int, top_n: int,
                          values: list[float | None], tops: list[Any]) -> None:
    """Position p's logprob is HF's log_softmax at p - 1 of token p; position 0 has none."""
    ref = hf_prompt_logprobs(folder, tuple(prompt))
    assert len(values) == len(tops) == len(prompt) - start
    for i, p in enumerate(range(start, len(prompt))):
        if p == 0:
            assert values[i] is None and tops[i] is None
            continue
        assert math.isclose(values[i], ref[p - 1, prompt[p]].item(), abs_tol=TOL), (p, values[i])
        assert len(tops[i]) == top_n
        ref_vals, _ = ref[p - 1].topk(top_n)
        for (tok, lp), rv in zip(tops[i], ref_vals.tolist(), strict=True):
            assert math.isclose(lp, rv, abs_tol=TOL)
            assert math.isclose(ref[p - 1, tok].item(), lp, abs_tol=TOL)  # the pair is consistent


def check_native_prompt_logprobs(folder: str, prompt: list[int], start: int, top_n: int,
                                 meta: dict[str, Any]) -> None:
    """:func:`check_prompt_logprobs` on a native result's SGLang triples ``[logprob, id, text]``,
    whose ids must be the prompt's from ``start`` on."""
    entries, tops = meta["input_token_logprobs"], meta["input_top_logprobs"]
    assert [e[1] for e in entries] == prompt[start:]
    pairs = [None if top is None else [[t, lp] for lp, t, _ in top] for top in tops]
    if top_n == 0:  # no top lists asked: None at every position
        assert tops == [None] * len(entries)
        pairs = [None if p == 0 else [] for p in range(start, len(prompt))]
    check_prompt_logprobs(folder, prompt, start, top_n, [e[0] for e in entries], pairs)


def submit(sched, prompt: list[int], start: int = -1, top_n: int = 0, **params: Any) -> str:
    """A request ignoring EOS that wants its prompt logprobs from position ``start`` (-1: none)."""
    fields = {"return_logprob": start >= 0 or top_n > 0, "top_logprobs_num": top_n, "logprob_start_len": start}
    return sched_driver.submit(sched, prompt, fields, **{"ignore_eos": True, **params})


# ---------------------------------------------------------------- in the scheduler


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_prompt_logprobs_match_hf_with_chunked_prefill(tiny_model_dir, arch: str, page_size: int) -> None:
    folder = tiny_model_dir(arch)
    # Chunks of 16 tokens and a small prefill budget: every prompt spans several forwards,
    # mixed with other requests' prefills and decodes.
    sched = make_scheduler(folder, page_size=page_size, chunked_prefill_size=16,
                           max_prefill_tokens=40, max_total_tokens=2048)
    reqs = prompts(5, 35, 70, seed=page_size)
    starts = [0, 1, 17, len(reqs[3]) - 1, -1]
    rids = [submit(sched, p, start=s, top_n=3, max_new_tokens=5) for p, s in zip(reqs, starts, strict=True)]
    results = run_until_idle(sched)
    for rid, p, s in zip(rids, reqs, starts, strict=True):
        r = results[rid]
        assert r["output_ids"] == hf_greedy(folder, p, 5)
        if s < 0:
            assert r["deliveries"] == 0
            continue
        assert r["deliveries"] == 1
        check_prompt_logprobs(folder, p, s, 3, r["input"], r["input_top"])


def test_prompt_logprobs_without_top_n_and_single_token_prompt(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=1024)
    p = prompts(1, 12, 12, seed=2)[0]
    plain = submit(sched, p, start=3, top_n=0, max_new_tokens=2)
    single = submit(sched, [7], start=0, top_n=2, max_new_tokens=2)
    results = run_until_idle(sched)
    assert results[plain]["input_top"] == [[] for _ in range(len(p) - 3)]
    check_prompt_logprobs(folder, p, 3, 0, results[plain]["input"], results[plain]["input_top"])
    assert results[single]["input"] == [None] and results[single]["input_top"] == [None]


@pytest.mark.parametrize("page_size", [1, 16])
def test_cached_prefix_is_capped_at_logprob_start(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, page_size=page_size, max_total_tokens=2048)
    shared = prompts(1, 48, 48, seed=7)[0]
    submit(sched, shared + [10, 11], max_new_tokens=2)
    run_until_idle(sched)  # the tree now holds `shared`
    tail = [20, 21, 22, 23, 24, 25, 26, 27, 28, 29]
    p = shared + tail
    # Logits owed from position start - 1: the match stops there (page aligned) even though
    # the tree holds all of `shared`.
    cases = {
        "after_shared": len(shared) + 3,  # the whole cached prefix is still read from the tree
        "inside_shared": 40,
        "from_zero": 0,
    }
    rids = {}
    for name, start in cases.items():
        rids[name] = submit(sched, p, start=start, top_n=2, max_new_tokens=3)
        results = run_until_idle(sched)
        r = results[rids[name]]
        cap = min(max(start - 1, 0), len(p) - 1)
        expected_cached = min(cap, len(shared)) // page_size * page_size
        assert r["meta"]["cached_tokens"] == expected_cached, name
        assert r["deliveries"] == 1
        check_prompt_logprobs(folder, p, start, 2, r["input"], r["input_top"])
        assert r["output_ids"] == hf_greedy(folder, p, 3)
    # A request without prompt logprobs still takes everything the tree has.
    full = submit(sched, p, max_new_tokens=3)
    assert run_until_idle(sched)[full]["meta"]["cached_tokens"] == (len(p) - 1) // page_size * page_size


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_sends_prompt_logprobs_once(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("qwen2")
    # ~20 prompt + 60 output tokens per request outgrow a 256-token pool: decodes are
    # retracted and recomputed (their prompt logprobs were already sent).
    sched = make_scheduler(folder, page_size=page_size, max_total_tokens=256)
    reqs = prompts(8, 16, 24, seed=11)
    rids = [submit(sched, p, start=i % 3, top_n=2, max_new_tokens=60) for i, p in enumerate(reqs)]
    results = run_until_idle(sched)
    assert sched.get_stats()["retractions"] > 0
    for rid, p, i in zip(rids, reqs, range(len(reqs)), strict=True):
        r = results[rid]
        assert r["output_ids"] == hf_greedy(folder, p, 60)
        assert r["deliveries"] == 1
        check_prompt_logprobs(folder, p, i % 3, 2, r["input"], r["input_top"])


@pytest.mark.parametrize("page_size", [1, 16])
def test_retraction_mid_prefill_keeps_collected_logprobs(tiny_model_dir, page_size: int) -> None:
    from radixserve.scheduler.decode import retract

    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, page_size=page_size, chunked_prefill_size=16, max_total_tokens=1024)
    long_prompt = prompts(1, 100, 100, seed=22)[0]
    rid = submit(sched, long_prompt, start=3, top_n=1, max_new_tokens=4)
    req = sched.reqs[rid]
    while req.kv.computed_len < 48:
        sched.step()
    assert sched.chunked is req and req.prompt_logprobs.pending
    collected = len(req.prompt_logprobs.logprobs)
    assert collected == req.kv.computed_len - 3 + 1  # logits at q give token q + 1: positions [3, computed_len]
    # What reserve_decode_slots does to a partly prefilled request when pages run out.
    retract(req, sched.kv)
    sched.chunked = None
    sched.waiting.appendleft(req)
    sched.check_memory()
    r = run_until_idle(sched)[rid]
    assert r["deliveries"] == 1
    check_prompt_logprobs(folder, long_prompt, 3, 1, r["input"], r["input_top"])
    assert r["output_ids"] == hf_greedy(folder, long_prompt, 4)
    # Re-admitted, it read its computed chunks back from the tree and kept their logprobs.
    assert sched.get_stats()["prefill_tokens_computed"] == len(long_prompt)


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_only_returns_prompt_logprobs(tiny_model_dir, page_size: int) -> None:
    """max_new_tokens 0 (SGLang's scoring call): prompt logprobs, nothing sampled, the prompt
    cached; asked from the prompt's length, an empty list."""
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, page_size=page_size, chunked_prefill_size=16, max_total_tokens=1024)
    p = prompts(1, 40, 40, seed=5)[0]
    rids = {start: submit(sched, p, start=start, top_n=2, max_new_tokens=0) for start in (0, 21, len(p) - 1, len(p))}
    results = run_until_idle(sched)
    for start, rid in rids.items():
        r = results[rid]
        assert r["output_ids"] == [] and r["finished"]["type"] == "length" and r["deliveries"] == 1
        if start == len(p):
            assert r["input"] == [] and r["input_top"] == []
        else:
            check_prompt_logprobs(folder, p, start, 2, r["input"], r["input_top"])
    assert sched.get_stats()["generation_tokens"] == 0
    assert len(sched.tree.match_prefix(p).slots) == len(p) // page_size * page_size


def test_bad_logprob_start_len_is_refused(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=512)
    for start in (4, 10, -2):
        err = sched.add_request(GenerateReq(rid=f"bad{start}", input_ids=[7, 8, 9], sampling_params=SamplingParams(),
                                            seed=0, return_logprob=True, logprob_start_len=start))
        assert err is not None and err.status == 400 and "logprob_start_len" in err.message
    assert not sched.has_work


def test_engine_prompt_logprobs(tiny_chat_model) -> None:
    import asyncio

    from radixserve import Engine

    ids = list(range(300, 318))
    with Engine(model=tiny_chat_model, max_total_tokens=2048, context_length=256, dtype="float32") as engine:
        params = {"max_new_tokens": 2, "temperature": 0}
        out = engine.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                              top_logprobs_num=2, logprob_start_len=1)
        meta = out["meta_info"]
        check_native_prompt_logprobs(tiny_chat_model, ids, 1, 2, meta)
        assert len(meta["output_token_logprobs"]) == 2
        # A stream's pieces carry their own part of the lists: the prompt's in one piece.
        pieces = list(engine.generate(input_ids=ids, sampling_params=params, return_logprob=True,
                                      logprob_start_len=0, stream=True))
        assert [len(p["meta_info"]["input_token_logprobs"]) > 0 for p in pieces].count(True) == 1
        streamed = [e for p in pieces for e in p["meta_info"]["input_token_logprobs"]]
        assert streamed[0] == [None, ids[0], None]
        assert [e[0] for e in streamed[1:]] == pytest.approx([e[0] for e in meta["input_token_logprobs"]], abs=TOL)
        batch = asyncio.run(engine.async_generate(input_ids=[ids, ids[:5]], sampling_params=params,
                                                  return_logprob=True, logprob_start_len=4))
        assert [len(r["meta_info"]["input_token_logprobs"]) for r in batch] == [len(ids) - 4, 1]
        with pytest.raises(ValueError, match="logprob_start_len"):
            engine.generate(input_ids=[ids, ids[:5]], sampling_params=params, return_logprob=True,
                            logprob_start_len=6)
        assert engine.check_memory()["locked_tokens"] == 0


# ---------------------------------------------------------------- over HTTP


server = tiny_chat_server("--max-total-tokens", "8000", "--context-length", "512", "--chunked-prefill-size", "16")


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai_client(server)


memory_invariant = memory_checked_after_each_test("server")


def test_native_generate_prompt_logprobs(server, tiny_chat_model) -> None:
    from radixserve.tokenizer import load_tokenizer

    text = "The quick brown fox jumps over the lazy dog, and then the dog sleeps."
    ids = load_tokenizer(tiny_chat_model).encode(text, add_special_tokens=False)
    body = {"text": text, "sampling_params": {"max_new_tokens": 3, "temperature": 0},
            "return_logprob": True, "top_logprobs_num": 2, "logprob_start_len": 2}
    out = httpx.post(server.base_url + "/generate", json=body, timeout=60).json()
    meta = out["meta_info"]
    check_native_prompt_logprobs(tiny_chat_model, ids, 2, 2, meta)
    assert len(meta["output_token_logprobs"]) == 3
    # Streaming gives the same values; without logprob_start_len there are none.
    stream = httpx.post(server.base_url + "/generate", json={**body, "stream": True}, timeout=60)
    events = [line[6:] for line in stream.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]
    import orjson

    last = orjson.loads(events[-1])["meta_info"]
    assert last["input_token_logprobs"] == meta["input_token_logprobs"]
    # The default start (-1) covers the last prompt position only; the prompt's length, none.
    last = httpx.post(server.base_url + "/generate", json={**body, "logprob_start_len": -1}, timeout=60).json()
    check_native_prompt_logprobs(tiny_chat_model, ids, len(ids) - 1, 2, last["meta_info"])
    empty = httpx.post(server.base_url + "/generate", json={**body, "logprob_start_len": len(ids)}, timeout=60)
    assert empty.json()["meta_info"]["input_token_logprobs"] == []
    plain = httpx.post(server.base_url + "/generate", json={**body, "return_logprob": False}, timeout=60).json()
    assert "input_token_logprobs" not in plain["meta_info"] and "output_token_logprobs" not in plain["meta_info"]
    bad = httpx.post(server.base_url + "/generate", json={**body, "logprob_start_len": len(ids) + 1}, timeout=60)
    assert bad.status_code == 400 and "logprob_start_len" in bad.json()["error"]["message"]


def test_completions_echo_logprobs(client, tiny_chat_model) -> None:
    from radixserve.tokenizer import load_tokenizer

    tok = load_tokenizer(tiny_chat_model)
    prompt = "In a hole in the ground there lived a hobbit. Not a nasty, dirty, wet hole"
    ids = tok.encode(prompt, add_special_tokens=False)
    # The same prompt once without logprobs first: its cached prefix must not hide logits.
    client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                    echo=True, logprobs=2)
    choice = out.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(prompt)
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == len(ids) + 4
    assert lp.tokens[: len(ids)] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = hf_prompt_logprobs(tiny_chat_model, tuple(ids))
    for p in range(1, len(ids)):
        assert math.isclose(lp.token_logprobs[p], ref[p - 1, ids[p]].item(), abs_tol=TOL)
        assert 1 <= len(lp.top_logprobs[p]) <= 2
    # text_offset runs on through the prompt into the completion.
    assert lp.text_offset[0] == 0
    assert all(b - a == len(s) for a, b, s in zip(lp.text_offset, lp.text_offset[1:], lp.tokens, strict=False))
    assert lp.text_offset[len(ids)] == len(prompt) == len("".join(lp.tokens[: len(ids)]))
    assert out.usage.prompt_tokens_details.cached_tokens == 0  # logprobs from position 0
    # The completion's part equals what logprobs without echo returns.
    plain = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    assert plain.choices[0].logprobs.token_logprobs == pytest.approx(lp.token_logprobs[len(ids):], abs=TOL)
    # Streaming: the same tokens, logprobs and offsets, chunk by chunk.
    chunks = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0,
                                            echo=True, logprobs=2, stream=True))
    streamed = {"tokens": [], "token_logprobs": [], "text_offset": []}
    for c in chunks:
        if c.choices and c.choices[0].logprobs:
            for key in streamed:
                streamed[key] += getattr(c.choices[0].logprobs, key)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert streamed["tokens"] == lp.tokens and streamed["text_offset"] == lp.text_offset
    assert streamed["token_logprobs"][0] is None
    assert streamed["token_logprobs"][1:] == pytest.approx(lp.token_logprobs[1:], abs=TOL)
