"""The scheduler against HF greedy output: batching, chunking, cache hits, retraction."""

from __future__ import annotations

import pytest
from helpers.assertions import expected_cached_len
from helpers.oracle import hf_greedy
from helpers.sched_driver import make_scheduler, random_prompts, run_until_idle, submit

ARCHS = ["llama", "mistral-mha", "qwen2", "qwen3-hd128"]


def check_against_hf(folder: str, sched, reqs: list[list[int]], max_new: int = 12) -> dict:
    rids = [submit(sched, p, max_new_tokens=max_new, ignore_eos=True) for p in reqs]
    results = run_until_idle(sched)
    for rid, p in zip(rids, reqs, strict=True):
        assert results[rid]["output_ids"] == hf_greedy(folder, p, max_new), rid
        assert results[rid]["finished"]["type"] == "length"
    return {rid: results[rid] for rid in rids}


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("page_size", [1, 16])
def test_mixed_batches_match_hf(tiny_model_dir, arch: str, page_size: int) -> None:
    folder = tiny_model_dir(arch)
    # A small prefill budget admits the prompts over several steps, so later prefills share
    # forwards with earlier requests' decodes (mixed batches).
    sched = make_scheduler(folder, page_size=page_size, max_prefill_tokens=40, max_total_tokens=2048)
    check_against_hf(folder, sched, random_prompts(5, 3, 30, seed=page_size))
    stats = sched.get_stats()
    assert stats["mixed_steps"] > 0
    assert stats["requests_finished"] == 5


@pytest.mark.parametrize("arch", ["llama", "qwen3-hd128"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_chunked_prefill_matches_hf(tiny_model_dir, arch: str, page_size: int) -> None:
    folder = tiny_model_dir(arch)
    sched = make_scheduler(folder, page_size=page_size, chunked_prefill_size=16, max_total_tokens=2048)
    reqs = random_prompts(3, 40, 70, seed=3)
    check_against_hf(folder, sched, reqs)
    # Each prompt needed several chunks; computed tokens still equal the prompt tokens.
    assert all(expected_cached_len(p, reqs[:i], page_size) == 0 for i, p in enumerate(reqs))
    stats = sched.get_stats()
    assert stats["prefill_tokens_computed"] == sum(len(p) for p in reqs)
    assert stats["forward_steps"] >= sum(len(p) for p in reqs) // 16


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_second_request_hits_cache(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, page_size=page_size, max_total_tokens=2048)
    shared = random_prompts(1, 48, 48, seed=7)[0]
    first = check_against_hf(folder, sched, [shared + [10, 11, 12]])
    assert list(first.values())[0]["meta"]["cached_tokens"] == 0
    second = check_against_hf(folder, sched, [shared + [20, 21]])
    cached = list(second.values())[0]["meta"]["cached_tokens"]
    assert cached == len(shared) // page_size * page_size
    # The same prompt again: everything but the last token comes from the tree.
    again = check_against_hf(folder, sched, [shared + [20, 21]])
    assert list(again.values())[0]["meta"]["cached_tokens"] == (len(shared) + 1) // page_size * page_size


@pytest.mark.parametrize("page_size", [1, 4])
def test_retraction_under_memory_pressure_matches_hf(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("qwen2")
    # Admission reserves only part of each request's future tokens (new_token_ratio), so
    # requests of ~20 prompt + 60 output tokens outgrow a 256-token pool and get retracted.
    sched = make_scheduler(folder, page_size=page_size, max_total_tokens=256)
    check_against_hf(folder, sched, random_prompts(8, 16, 24, seed=11), max_new=60)
    assert sched.get_stats()["retractions"] > 0


def test_burst_with_shared_prefix_computes_it_once(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=4096, chunked_prefill_size=64)
    system = random_prompts(1, 100, 100, seed=5)[0]
    tails = random_prompts(8, 8, 12, seed=6)
    reqs = [system + t for t in tails]
    check_against_hf(folder, sched, reqs, max_new=4)
    # The first request computes the system prompt; the seven others wait one step and read
    # it from the tree.  Their tails start differently, so nothing else is shared.
    assert len({t[0] for t in tails}) == len(tails)
    stats = sched.get_stats()
    unique = len(system) + sum(len(t) for t in tails)
    assert stats["prefill_tokens_computed"] == unique
    assert stats["cached_tokens"] == 7 * len(system)


@pytest.mark.parametrize("page_size", [1, 4])
def test_identical_prompts_in_one_batch(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, page_size=page_size, max_total_tokens=1024)
    p = random_prompts(1, 10, 10, seed=9)[0]  # shorter than the in-batch sharing threshold
    results = check_against_hf(folder, sched, [p, p, p])
    assert len({tuple(r["output_ids"]) for r in results.values()}) == 1
    # The copies wait one step, then read from the tree all the first one computed but the
    # last token, in whole pages.
    hit = expected_cached_len(p, [p], page_size)
    assert hit == (9 if page_size == 1 else 8)
    assert [r["meta"]["cached_tokens"] for r in results.values()] == [0, hit, hit]


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("disable", [False, True])
def test_policies_and_cache_off_give_same_tokens(tiny_model_dir, policy: str, disable: bool) -> None:
    folder = tiny_model_dir("mistral-mha")
    sched = make_scheduler(
        folder, schedule_policy=policy, disable_radix_cache=disable, max_total_tokens=1024,
        max_prefill_tokens=48,
    )
    base = random_prompts(1, 30, 30, seed=1)[0]
    reqs = [base + t for t in random_prompts(4, 2, 6, seed=2)] + random_prompts(2, 5, 20, seed=3)
    results = check_against_hf(folder, sched, reqs, max_new=6)
    if disable:
        assert all(r["meta"]["cached_tokens"] == 0 for r in results.values())
        assert sched.tree.total_size() == 0


def test_stop_conditions(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=1024, context_length=60)
    p = random_prompts(1, 12, 12, seed=4)[0]
    ref = hf_greedy(folder, p, 40)
    stop_tok = ref[5]
    r_stop = submit(sched, p, max_new_tokens=40, stop_token_ids=[stop_tok], ignore_eos=True)
    r_len = submit(sched, p, max_new_tokens=3, ignore_eos=True)
    long_p = random_prompts(1, 55, 55, seed=8)[0]
    r_ctx = submit(sched, long_p, max_new_tokens=100, ignore_eos=True)
    r_eos = submit(sched, p, max_new_tokens=40, stop_token_ids=[], ignore_eos=False)
    res = run_until_idle(sched)
    assert res[r_stop]["output_ids"] == ref[: ref.index(stop_tok) + 1]
    assert res[r_stop]["finished"] == {"type": "stop", "matched": stop_tok}
    assert res[r_len]["output_ids"] == ref[:3] and res[r_len]["finished"]["type"] == "length"
    assert len(long_p) + len(res[r_ctx]["output_ids"]) == 60
    assert res[r_ctx]["finished"]["type"] == "length"
    eos_ref = hf_greedy(folder, p, 40, eos_ids={2, 5})
    assert res[r_eos]["output_ids"] == eos_ref


def test_abort_frees_pages_and_keeps_partial_kv_out(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=1024)
    p = random_prompts(1, 20, 20, seed=12)[0]
    rid = submit(sched, p, max_new_tokens=50, ignore_eos=True)
    for _ in range(6):
        sched.step()
    req = sched.reqs[rid]
    generated = list(req.output_ids)
    assert len(generated) >= 4
    sched.abort(rid)
    out = sched.step()
    assert out.rids == [rid] and out.finished[0].type == "abort"
    report = sched.check_memory()
    assert report["request_pages"] == 0 and report["locked_tokens"] == 0
    # The prompt was cached after its prefill; the aborted request's decoded tokens were not.
    matched = len(sched.tree.match_prefix(p + generated).slots)
    assert matched == len(p) // sched.page_size * sched.page_size


@pytest.mark.parametrize("page_size", [1, 16])
def test_prefill_only_caches_the_prompt_and_samples_nothing(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, page_size=page_size, chunked_prefill_size=16, max_total_tokens=2048)
    p, q = random_prompts(2, 50, 50, seed=31)
    # max_new_tokens 0 (chunked: 50 tokens in chunks of 16), beside a request that decodes.
    other = submit(sched, q[:10], max_new_tokens=8, ignore_eos=True)
    rid = submit(sched, p, max_new_tokens=0)
    res = run_until_idle(sched)
    assert res[rid]["output_ids"] == [] and res[rid]["finished"] == {"type": "length", "matched": None, "length": 0}
    assert res[rid]["meta"]["completion_tokens"] == 0 and res[rid]["meta"]["prompt_tokens"] == len(p)
    assert res[other]["output_ids"] == hf_greedy(folder, q[:10], 8)
    assert res[other]["finished"] == {"type": "length", "matched": None, "length": 8}
    stats = sched.get_stats()
    assert stats["generation_tokens"] == 8 and stats["prefill_tokens_computed"] == len(p) + 10
    # The tree took the whole prompt (in whole pages): a longer prompt is served all of it.
    longer = p + [9, 10, 11]
    again = submit(sched, longer, max_new_tokens=3, ignore_eos=True)
    r = run_until_idle(sched)[again]
    assert r["meta"]["cached_tokens"] == len(p) // page_size * page_size
    assert r["output_ids"] == hf_greedy(folder, longer, 3)
    # The same prompt again: a cache hit up to its last token, which is computed (not sampled).
    hit = submit(sched, p, max_new_tokens=0)
    r = run_until_idle(sched)[hit]
    assert r["meta"]["cached_tokens"] == (len(p) - 1) // page_size * page_size and r["output_ids"] == []
    assert sched.get_stats()["generation_tokens"] == 8 + 3


def test_bad_requests_are_answered_and_others_continue(tiny_model_dir) -> None:
    import orjson

    from radixserve.ipc import messages as m
    from radixserve.scheduler.process import handle_frame

    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=512, context_length=64)
    good = submit(sched, [7, 8, 9], max_new_tokens=4, ignore_eos=True)
    bad = {  # name: (input ids, sampling params, what the message must name)
        "empty": ([], {}, "empty"),
        "too long": (list(range(10, 80)), {}, "context length is 64"),
        "bad id": ([1, 999], {}, "token id 999 is outside the vocabulary"),
        "negative id": ([1, -1], {}, "token id -1 is outside the vocabulary"),
        "max_new_tokens": ([1, 2], {"max_new_tokens": -1}, "max_new_tokens"),
        "temperature": ([1, 2], {"temperature": -1}, "temperature"),
        "top_p": ([1, 2], {"top_p": 1.5}, "top_p"),
        "top_k": ([1, 2], {"top_k": 0}, "top_k"),
        "unknown": ([1, 2], {"bogus": 1}, "bogus"),
        "stop id": ([1, 2], {"stop_token_ids": [4096]}, "stop_token_ids"),
    }
    # Each one arrives as a frame (the sampling values as they were sent), as from the front end.
    answers: list[bytes] = []

    class Outbox:
        def send(self, data: bytes) -> None:
            answers.append(data)

    for name, (ids, params, fragment) in bad.items():
        frame = orjson.dumps({"type": "generate", "rid": f"bad-{name}", "input_ids": ids,
                              "sampling_params": params, "seed": 0})
        handle_frame(sched, frame, Outbox())
        err = m.decode(answers.pop())
        assert isinstance(err, m.ErrorOut) and err.status == 400 and err.rid == f"bad-{name}", name
        assert fragment in err.message, (name, err.message)
    res = run_until_idle(sched)
    assert len(res[good]["output_ids"]) == 4
    assert not any(r.startswith("bad-") for r in res)


def test_eviction_is_lru_and_counted(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=128)
    for p in random_prompts(6, 30, 30, seed=13):
        submit(sched, p, max_new_tokens=2, ignore_eos=True)
        run_until_idle(sched)
    stats = sched.get_stats()
    assert stats["evicted_tokens"] > 0
    assert sched.tree.total_size() <= 128


# Page size 1 against the tiny models in every test above; the default model at 1 with -m slow.
# The default run takes 30 tokens a request in a smaller pool (still retracted, still mixed);
# the 60-token runs are in the slow lane.
@pytest.mark.parametrize(("page_size", "max_new", "max_total"), [
    pytest.param(1, 60, 192, marks=pytest.mark.slow, id="1-60tokens"),
    pytest.param(16, 60, 192, marks=pytest.mark.slow, id="16-60tokens"),
    pytest.param(16, 30, 128, id="16-30tokens"),
])
def test_default_model_matches_hf_through_every_path(default_model_path, page_size: int, max_new: int,
                                                     max_total: int) -> None:
    """Default model, float32: chunked prefill, mixed batches, a cache hit and retraction."""
    from radixserve.tokenizer import load_tokenizer

    tok = load_tokenizer(default_model_path)
    texts = [
        "The history of the printing press begins in the fifteenth century, when",
        "Here is a short list of fruits: apples, pears, plums,",
        "The history of the printing press begins in the fifteenth century, and its effect on",
        "In mathematics, a prime number is a natural number greater than one that",
    ]
    reqs = [tok.encode(t, add_special_tokens=False) for t in texts]
    sched = make_scheduler(
        default_model_path, tokenizer=tok, page_size=page_size, chunked_prefill_size=16,
        max_prefill_tokens=24, max_total_tokens=max_total,
    )
    results = check_against_hf(default_model_path, sched, reqs, max_new=max_new)
    stats = sched.get_stats()
    assert stats["retractions"] > 0 and stats["mixed_steps"] > 0
    # The third text is admitted once the first one's prompt is in the tree: it is served
    # their common prefix ("The history ... fifteenth century,", 12 tokens) in whole pages.
    hit = expected_cached_len(reqs[2], [reqs[0]], page_size)
    assert hit == (12 if page_size == 1 else 0)
    assert [r["meta"]["cached_tokens"] for r in results.values()] == [0, 0, hit, 0]
    assert stats["cached_tokens"] == hit
