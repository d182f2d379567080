"""The scheduler's step profile: ``start_profile`` / ``stop_profile`` control requests, through
the scheduler process's message handler and through the Engine.  No timing thresholds: only
that the categories account for the measured step time and land where the code ran."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from helpers.sched_driver import make_scheduler, run_until_idle

from radixserve import Engine
from radixserve.ipc import messages as m
from radixserve.model.decoder import ATTENTION_SCOPE
from radixserve.sampling import SamplingParams
from radixserve.scheduler.process import handle_frame
from radixserve.scheduler.profiling import CATEGORIES, FORWARD_SCOPE, SAMPLING_SCOPE, scope_seconds

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [5, 6, 7, 8, 40, 41], [90, 91, 92]]


class Outbox:
    """Stands in for the scheduler's PUSH socket: keeps what was sent, decoded."""

    def __init__(self) -> None:
        self.msgs: list[Any] = []

    def send(self, data: bytes) -> None:
        self.msgs.append(m.decode(data))


def control(sched: Any, command: str) -> dict[str, Any]:
    out = Outbox()
    handle_frame(sched, m.encode(m.ControlReq(cid=command, command=command)), out)
    (reply,) = out.msgs
    assert isinstance(reply, m.ControlOut) and reply.cid == command
    return reply.result


def assert_accounts_for_steps(result: dict[str, Any], steps: int, step_s: float, forward_s: float) -> None:
    """The profile covers exactly the steps the scheduler counted, and splits their time."""
    assert result["steps"] == steps
    assert result["step_s"] == pytest.approx(step_s)
    assert sum(result[f"{c}_s"] for c in CATEGORIES) == pytest.approx(step_s)
    assert all(result[f"{c}_s"] >= 0 for c in CATEGORIES), result
    assert result["attention_s"] > 0 and result["linear_s"] > 0 and result["sampling_s"] > 0
    # The scheduler's forward clock runs from the model call to the end of sampling.
    assert result["forward_s"] + result["sampling_s"] <= forward_s
    assert result["attention_s"] + result["linear_s"] <= result["forward_s"]


def _event(name: str, us: float, children: tuple = ()) -> SimpleNamespace:
    ev = SimpleNamespace(name=name, time_range=SimpleNamespace(elapsed_us=lambda: us),
                         cpu_children=list(children), cpu_parent=None)
    for child in children:
        child.cpu_parent = ev
    return ev


def test_scope_seconds_counts_each_op_once_in_its_category() -> None:
    addmm = _event("aten::addmm", 25)
    linear = _event("aten::linear", 30, (addmm,))
    inner_mm = _event("aten::matmul", 10)  # inside attention: attention's, not linear's
    attention = _event(ATTENTION_SCOPE, 40, (inner_mm,))
    forward = _event(FORWARD_SCOPE, 100, (linear, attention, _event("aten::mul", 5)))
    sampling = _event(SAMPLING_SCOPE, 8, (_event("aten::mm", 3),))
    stray = _event("aten::mm", 7)  # outside the forward: the scheduler's
    events = [forward, linear, addmm, attention, inner_mm, *forward.cpu_children[2:], sampling,
              *sampling.cpu_children, stray]
    assert scope_seconds(events) == pytest.approx(
        {"forward": 100e-6, "attention": 40e-6, "linear": 30e-6, "sampling": 8e-6})


def test_profile_control_requests_split_the_step_time(tiny_model_dir) -> None:
    sched = make_scheduler(tiny_model_dir("llama"), max_total_tokens=1024)
    assert "error" in control(sched, "stop_profile")  # nothing to stop
    before = sched.get_stats()
    assert control(sched, "start_profile") == {"started": True}
    assert "error" in control(sched, "start_profile")  # one window at a time; the first runs on
    out = Outbox()
    for i, prompt in enumerate(PROMPTS):
        req = m.GenerateReq(rid=f"p{i}", input_ids=prompt, seed=0,
                            sampling_params=SamplingParams(max_new_tokens=5, temperature=0, ignore_eos=True))
        handle_frame(sched, m.encode(req), out)
    run_until_idle(sched)
    result = control(sched, "stop_profile")
    after = sched.get_stats()
    assert out.msgs == []  # every request was accepted
    assert_accounts_for_steps(result, after["forward_steps"] - before["forward_steps"],
                              after["step_seconds"] - before["step_seconds"],
                              after["forward_seconds"] - before["forward_seconds"])
    assert result["decode_steps"] == after["decode_steps"] - before["decode_steps"] > 0
    assert result["profiled_ops"] > result["steps"]

    # An empty window: no steps, nothing attributed.
    control(sched, "start_profile")
    empty = control(sched, "stop_profile")
    assert empty["steps"] == 0 and all(empty[f"{c}_s"] == 0 for c in CATEGORIES)


def test_engine_profiles_the_scheduler_process(tiny_chat_model) -> None:
    from radixserve.threads import scheduler_threads

    with Engine(model=tiny_chat_model, max_total_tokens=1024) as engine:
        assert engine.info.torch_threads == scheduler_threads()[0]
        with pytest.raises(RuntimeError, match="no profile is running"):
            engine.stop_profile()
        before = engine.get_stats()
        engine.start_profile()
        engine.generate(input_ids=PROMPTS, progress=False,
                        sampling_params={"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
        result = engine.stop_profile()
        after = engine.get_stats()
        assert result["torch_threads"] == engine.info.torch_threads
        memory = engine.check_memory()
        assert memory["ok"] and memory["locked_tokens"] == 0, memory
    assert_accounts_for_steps(result, after["forward_steps"] - before["forward_steps"],
                              after["step_seconds"] - before["step_seconds"],
                              after["forward_seconds"] - before["forward_seconds"])


def test_scope_records_only_under_the_profiler() -> None:
    """Off the profiler a scope opens no range (a range costs tens of microseconds even when
    nothing records it); under it the range is recorded with its name."""
    import contextlib

    import torch

    from radixserve.profiler_scopes import scope

    assert isinstance(scope("radixserve.test"), contextlib.nullcontext)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with scope("radixserve.test"):
            torch.ones(4).sum()
    names = [ev.name for ev in prof.events()]
    assert names.count("radixserve.test") == 1 and "aten::sum" in names
