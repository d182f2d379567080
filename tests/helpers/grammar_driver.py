"""Drive an in-process Scheduler for grammar tests: errors (ErrorOut) are collected with the
outputs, and while only grammars are compiling the loop waits for one instead of spinning."""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import orjson
import torch

from helpers.sched_driver import finish_dict, meta_dict
from radixserve.ipc.messages import ErrorOut, GenerateReq, decode
from radixserve.scheduler.process import handle_frame

_rid = itertools.count()


class _Outbox:
    def __init__(self) -> None:
        self.sent: list[bytes] = []

    def send(self, data: bytes) -> None:
        self.sent.append(data)


def add(sched: Any, prompt: list[int], seed: int = 0, **params: Any) -> tuple[str, ErrorOut | None]:
    """Send a request as the front end does (a frame); its ErrorOut, if it was refused."""
    rid = f"g{next(_rid)}"
    params.setdefault("temperature", 0.0)
    frame = orjson.dumps({"type": GenerateReq.TYPE, "rid": rid, "input_ids": prompt, "sampling_params": params,
                          "seed": seed}, option=orjson.OPT_NON_STR_KEYS | orjson.OPT_SERIALIZE_NUMPY)
    out = _Outbox()
    handle_frame(sched, frame, out)
    replies = [decode(data) for data in out.sent]
    assert all(isinstance(r, ErrorOut) for r in replies) and len(replies) <= 1, replies
    return rid, replies[0] if replies else None


def submit(sched: Any, prompt: list[int], seed: int = 0, **params: Any) -> str:
    rid, err = add(sched, prompt, seed, **params)
    assert err is None, err.message
    return rid


def drive(sched: Any, on_step: Any = None, max_steps: int = 20_000) -> dict[str, dict[str, Any]]:
    """Step until idle: per request ``output_ids``, ``finished``, ``meta`` (or ``error``, an
    ErrorOut).  The KV invariant is checked after every step, and "no lock left" at the end.
    While only grammars are compiling, waits for one to finish instead of spinning."""
    results: dict[str, dict[str, Any]] = {}
    for step in range(max_steps):
        if not sched.has_work:
            break
        if sched.nothing_to_run:
            futures = [r.grammar_future for r in sched.waiting]
            concurrent.futures.wait(futures, return_when=concurrent.futures.FIRST_COMPLETED)
        out = sched.step()
        sched.check_memory()
        for err in sched.take_errors():
            assert err.rid not in results, f"{err.rid} answered twice"
            results[err.rid] = {"error": err}
        if out is not None:
            for i, rid in enumerate(out.rids):
                r = results.setdefault(rid, {"output_ids": [], "finished": None, "meta": None})
                assert "error" not in r and r["finished"] is None, f"{rid} answered after its end"
                r["output_ids"].extend(out.new_ids[i])
                r["finished"], r["meta"] = finish_dict(out.finished[i]), meta_dict(out.meta[i])
        if on_step is not None:
            on_step(step, sched)
    else:
        raise RuntimeError("scheduler did not become idle")
    report = sched.check_memory()
    assert report["locked_tokens"] == 0 and report["request_pages"] == 0, report
    return results


def text_of(tok: Any, result: dict[str, Any]) -> str:
    return tok.decode(result["output_ids"], skip_special_tokens=True)


def assert_valid_json(tok: Any, result: dict[str, Any], schema: dict) -> Any:
    """The output stopped at its end, parses as JSON and validates against ``schema``: the value."""
    assert result["finished"]["type"] == "stop", (result, text_of(tok, result))
    value = json.loads(text_of(tok, result))
    jsonschema.validate(value, schema)
    return value



def check_schema_outputs(sched: Any, tok: Any, prompt: list[int], avoid: dict[int, float], case: Any, seed: int,
                         temperature: float) -> None:
    """A greedy and a sampled run (``seed``, ``temperature``) of a ``schema_cases`` case with
    ``avoid`` as logit_bias: both stop, parse and validate."""
    params = {"json_schema": case.text, "max_new_tokens": case.max_tokens, "logit_bias": avoid}
    rids = [submit(sched, prompt, **params), submit(sched, prompt, seed=seed, temperature=temperature, **params)]
    results = drive(sched)
    for rid in rids:
        assert_valid_json(tok, results[rid], case.schema)


def check_regex_outputs(sched: Any, tok: Any, prompt: list[int], avoid: dict[int, float], case: Any, seed: int,
                        temperature: float) -> None:
    """A greedy and a sampled run of a ``regex_cases`` case: both stop and fully match."""
    params = {"regex": case.pattern, "max_new_tokens": case.max_tokens, "logit_bias": avoid}
    rids = [submit(sched, prompt, **params), submit(sched, prompt, seed=seed, temperature=temperature, **params)]
    results = drive(sched)
    for rid in rids:
        r = results[rid]
        assert r["finished"]["type"] == "stop", (case.pattern, r)
        assert re.fullmatch(case.pattern, text_of(tok, r)), (case.pattern, text_of(tok, r))


@contextlib.contextmanager
def one_torch_thread() -> Iterator[None]:
    """Run torch on one thread: on a shared 2-core machine two OpenMP threads spin-wait for
    each other whenever another process holds a core (a 10x slowdown measured with the
    default model); one thread keeps the run time steady.  Restored afterwards."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)
