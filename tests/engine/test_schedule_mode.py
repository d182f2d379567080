"""--schedule-mode: mixed steps (decodes beside a prefill chunk) against prefill-first (a step
with prompt work runs it alone; the decodes wait), the same tokens either way."""

from __future__ import annotations

import pytest
from helpers.oracle import hf_greedy
from helpers.sched_driver import make_scheduler, random_prompts, run_until_idle, submit

from radixserve.config import ServerArgs


def running(sched, rid: str):
    return next((r for r in sched.running if r.rid == rid), None)


def decodes_during_a_prefill(folder: str, mode: str, page_size: int) -> tuple[list[int], dict, object]:
    """A decodes; B's 60-token prompt arrives and is computed in 16-token chunks.  Returns A's
    output length after each of B's prefill steps, the results, and the scheduler."""
    sched = make_scheduler(folder, schedule_mode=mode, chunked_prefill_size=16, page_size=page_size,
                           max_total_tokens=2048)
    first, second = random_prompts(2, 60, 60, seed=11)
    a = submit(sched, first[:12], max_new_tokens=24, ignore_eos=True)
    while running(sched, a) is None or running(sched, a).output_len < 3:
        sched.step()
    b = submit(sched, second, max_new_tokens=8, ignore_eos=True)
    lengths = []
    while running(sched, b) is None:  # B's prefill steps, to its first token
        sched.step()
        lengths.append(running(sched, a).output_len)
    results = run_until_idle(sched)
    assert results[a]["output_ids"] == hf_greedy(folder, first[:12], 24)
    assert results[b]["output_ids"] == hf_greedy(folder, second, 8)
    return lengths, results, sched


@pytest.mark.parametrize("page_size", [pytest.param(1, marks=pytest.mark.slow), 16])
def test_prefill_first_pauses_decodes_while_a_prompt_computes(tiny_model_dir, page_size: int) -> None:
    folder = tiny_model_dir("llama")
    mixed, _, sched_mixed = decodes_during_a_prefill(folder, "mixed", page_size)
    first, _, sched_first = decodes_during_a_prefill(folder, "prefill-first", page_size)
    assert len(mixed) == len(first) == 4  # 60 tokens in chunks of 16
    # mixed: A gains a token in every one of B's chunk steps; prefill-first: in none of them
    assert [b - a for a, b in zip(mixed, mixed[1:], strict=False)] == [1, 1, 1]
    assert len(set(first)) == 1
    assert sched_mixed.get_stats()["mixed_steps"] >= 4 and sched_first.get_stats()["mixed_steps"] == 0


def test_prefill_first_still_decodes_when_no_prompt_fits(tiny_model_dir) -> None:
    """A prompt that waits for memory does not stop the decodes that will free it."""
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, schedule_mode="prefill-first", max_total_tokens=160, chunked_prefill_size=-1)
    reqs = random_prompts(3, 40, 40, seed=5)
    rids = [submit(sched, p, max_new_tokens=30, ignore_eos=True) for p in reqs]
    seen: dict[str, int] = {}
    decoded_while_waiting = []

    def watch(step: int, sched) -> None:
        grew = any(r.output_len > seen.get(r.rid, r.output_len) for r in sched.running)
        decoded_while_waiting.append(grew and bool(sched.waiting))
        seen.update({r.rid: r.output_len for r in sched.running})

    results = run_until_idle(sched, on_step=watch)
    assert any(decoded_while_waiting)  # a prompt waited for pages while the others decoded
    for rid, p in zip(rids, reqs, strict=True):
        assert results[rid]["output_ids"] == hf_greedy(folder, p, 30)


def test_schedule_mode_names_the_field() -> None:
    with pytest.raises(ValueError, match="schedule_mode must be one of"):
        ServerArgs(schedule_mode="decode-first")
    assert ServerArgs().schedule_mode == "mixed"
