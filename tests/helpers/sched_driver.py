"""Drives an in-process :class:`Scheduler` step by step, checking the memory invariant."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import torch

from radixserve.config import ServerArgs
from radixserve.ipc.messages import FinishReason, GenerateReq, ReqMeta
from radixserve.model.loader import load_model
from radixserve.runtime.pieces import RequestMeta
from radixserve.sampling import SamplingParams
from radixserve.scheduler.scheduler import Scheduler

_rid = itertools.count()


def finish_dict(finished: FinishReason | None) -> dict[str, Any] | None:
    """A row's finish reason as the client reads it (``meta_info.finish_reason``)."""
    return None if finished is None else finished.to_dict()


def meta_dict(meta: ReqMeta) -> dict[str, Any]:
    """A row's request description as the client reads it (``meta_info``: the counts, and what
    the request asked for, ``pin``, ``cache_report``, ... when set)."""
    return RequestMeta.of_row("", meta, None).info()


def make_scheduler(folder: str, tokenizer: Any = None, **settings: Any) -> Scheduler:
    """A float32 scheduler on the CPU (or on ``device=...``)."""
    settings.setdefault("device", "cpu")
    args = ServerArgs.from_kwargs(model=folder, dtype="float32", **settings).resolve()
    loaded = load_model(folder, torch.float32, args.device)
    return Scheduler(args, loaded.model, loaded.config, tokenizer)


def submit(sched: Scheduler, prompt: list[int], req_fields: dict[str, Any] | None = None, **params: Any) -> str:
    """Add a request with sampling ``params`` (greedy unless they say otherwise) and any other
    :class:`GenerateReq` fields in ``req_fields``; returns its rid."""
    rid = f"r{next(_rid)}"
    params.setdefault("temperature", 0.0)
    err = sched.add_request(GenerateReq(rid=rid, input_ids=prompt, sampling_params=SamplingParams.from_dict(params),
                                        seed=0, **(req_fields or {})))
    if err is not None:
        raise ValueError(err.message)
    return rid


def run_until_idle(sched: Scheduler, max_steps: int = 10_000, on_step: Any = None) -> dict[str, dict[str, Any]]:
    """Step until no work is left; returns per request ``output_ids``, ``finished``, ``meta``,
    and its prompt logprobs: ``input``, ``input_top`` and ``deliveries`` (how many outputs
    carried them).

    The KV invariant (free + tree + requests == all pages) is checked after every step, and
    with "no lock left" once idle.
    """
    results: dict[str, dict[str, Any]] = {}
    waited = 0.0  # seconds slept while only a grammar compiled (or KV loaded) in the background
    budget, step = max_steps, -1
    while sched.has_work:
        if budget == 0:
            raise RuntimeError("scheduler did not become idle")
        step += 1
        if sched.nothing_to_run and waited < 120.0:
            # as the process loop does: wait a little, then step (which polls the compile); such
            # steps are not counted, so a slow compile on a busy machine does not use them up
            time.sleep(0.005)
            waited += 0.005
        else:
            budget -= 1
        out = sched.step()
        sched.check_memory()
        if out is not None:
            for i, rid in enumerate(out.rids):
                r = results.setdefault(rid, {"output_ids": [], "finished": None, "meta": None,
                                             "input": None, "input_top": None, "deliveries": 0})
                r["output_ids"].extend(out.new_ids[i])
                r["finished"], r["meta"] = finish_dict(out.finished[i]), meta_dict(out.meta[i])
                if out.input_logprobs[i] is not None:
                    r["deliveries"] += 1
                    r["input"], r["input_top"] = out.input_logprobs[i], out.input_top_logprobs[i]
        if on_step is not None:
            on_step(step, sched)
    report = sched.check_memory()
    assert report["locked_tokens"] == 0
    return results


def random_prompts(n: int, lo: int, hi: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of random ids in [6, 256), each of ``lo`` to ``hi`` tokens."""
    rng = random.Random(seed)
    return [[rng.randrange(6, 256) for _ in range(rng.randint(lo, hi))] for _ in range(n)]


def run_one(sched: Scheduler, prompt: list[int], n: int = 8) -> dict[str, Any]:
    """One greedy request of ``n`` tokens (eos ignored), run to the end."""
    rid = submit(sched, prompt, max_new_tokens=n, ignore_eos=True)
    return run_until_idle(sched)[rid]
