"""n > 1 (identical prompts arriving together) computes the prompt once, whatever its length:
the copies wait one step and read it from the tree (page-aligned)."""

from __future__ import annotations

import random

import pytest
from helpers.oracle import hf_greedy
from helpers.sched_driver import make_scheduler, run_until_idle, submit
from helpers.server import (
    memory_checked_after_each_test,
    openai_client,
    server_info,
    tiny_chat_server,
)


def prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(6, 256) for _ in range(n)]


@pytest.mark.parametrize(("page_size", "length"), [(1, 10), (16, 40), (16, 33)])
def test_identical_prompts_compute_once(tiny_model_dir, page_size: int, length: int) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, page_size=page_size, max_total_tokens=2048)
    p = prompt(length, seed=length)
    rids = [submit(sched, p, max_new_tokens=4, ignore_eos=True) for _ in range(4)]
    results = run_until_idle(sched)
    ref = hf_greedy(folder, p, 4)
    assert all(results[r]["output_ids"] == ref for r in rids)
    # The first computes the prompt; each copy reads all but its last (partial) page from
    # the tree and computes the rest, at least the one token it samples from.
    shared = (length - 1) // page_size * page_size
    stats = sched.get_stats()
    assert stats["prefill_tokens_computed"] == length + 3 * (length - shared)
    assert stats["cached_tokens"] == 3 * shared
    assert sorted(results[r]["meta"]["cached_tokens"] for r in rids) == [0, shared, shared, shared]


def test_no_deferral_when_no_whole_page_is_shared(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, page_size=16, max_total_tokens=2048)
    p = prompt(10, seed=3)  # shorter than a page: nothing to gain from the tree
    for _ in range(4):
        submit(sched, p, max_new_tokens=2, ignore_eos=True)
    sched.step()
    assert not sched.waiting  # all four admitted in the first step
    run_until_idle(sched)
    assert sched.get_stats()["prefill_tokens_computed"] == 40


def test_prompts_differing_in_last_token_share_the_rest(tiny_model_dir) -> None:
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=2048)
    base = prompt(9, seed=4)
    reqs = [base + [t] for t in (100, 101, 102)]
    rids = [submit(sched, p, max_new_tokens=3, ignore_eos=True) for p in reqs]
    results = run_until_idle(sched)
    for rid, p in zip(rids, reqs, strict=True):
        assert results[rid]["output_ids"] == hf_greedy(folder, p, 3)
    assert sched.get_stats()["prefill_tokens_computed"] == 10 + 2 * 1


def test_prompt_logprobs_copies_still_compute_their_prompt(tiny_model_dir) -> None:
    from radixserve.ipc.messages import GenerateReq
    from radixserve.sampling import SamplingParams

    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, max_total_tokens=2048)
    p = prompt(10, seed=5)
    # Two copies want logprobs from position 0 (nothing may come from the tree for them);
    # the plain copy waits and reads the prompt from the tree.
    for i, start in enumerate((0, 0, -1)):
        err = sched.add_request(GenerateReq(rid=f"lp{i}", input_ids=p,
                                            sampling_params=SamplingParams(max_new_tokens=2),
                                            seed=0, return_logprob=True, logprob_start_len=start))
        assert err is None
    results = run_until_idle(sched)
    assert results["lp2"]["meta"]["cached_tokens"] == 9
    assert results["lp0"]["meta"]["cached_tokens"] == results["lp1"]["meta"]["cached_tokens"] == 0
    assert sched.get_stats()["prefill_tokens_computed"] == 10 + 10 + 1


# ---------------------------------------------------------------- over HTTP


server = tiny_chat_server("--max-total-tokens", "8000", "--context-length", "512")
memory_invariant = memory_checked_after_each_test("server")


def test_chat_n3_computes_the_prompt_once(server) -> None:
    client = openai_client(server)
    # A short prompt (under the 32-token in-batch sharing threshold for partial overlaps).
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name three rivers."}]
    before = server_info(server)["stats"]
    out = client.chat.completions.create(
        model="tiny", messages=msgs,
        n=3, max_tokens=4, temperature=0,
    )
    after = server_info(server)["stats"]
    length = out.usage.prompt_tokens
    assert len(out.choices) == 3 and 4 < length < 32
    assert after["prefill_tokens_computed"] - before["prefill_tokens_computed"] == length + 2
    assert after["cached_tokens"] - before["cached_tokens"] == 2 * (length - 1)
    # The usage reports choice 0, the one that computed the prompt.
    assert out.usage.prompt_tokens_details.cached_tokens == 0
    again = client.chat.completions.create(
        model="tiny", messages=msgs,
        n=3, max_tokens=4, temperature=0,
    )
    assert again.usage.prompt_tokens_details.cached_tokens == length - 1
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
