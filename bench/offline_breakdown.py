"""``bench/offline.py --breakdown``: where the scheduler's step time goes, in passes of its own.

Each pass runs under ``Engine.start_profile`` / ``stop_profile`` (torch.profiler in the
scheduler process, ``radixserve/scheduler/profiling.py``), after the timed run, so the
profiler's overhead never reaches the wall times.  What it costs shows as ``profiled_step_ms``
against ``unprofiled_step_ms`` (a step of the same work without the profiler).

Two scenarios per radixserve engine:
  workload  the timed workload again, on a flushed cache
  decode    (radix only) the shared-prefix prompts (default 64 requests, 1k-token system
            prompts), first computed and cached by a prefill-only pass, then ``output_len``
            tokens each, once unprofiled and once profiled: every step is a decode step of
            all of them at once (when they reach the scheduler together)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from bench.common import align_columns, target
from radixserve.scheduler.profiling import CATEGORIES

TARGET_DECODE_ATTENTION_SHARE = 0.35
# ``generate(prompts, output_len)``: greedy output ids of one batch submitted at once.
Generate = Callable[[list[list[int]], int], list[list[int]]]


def summarize(raw: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's profile with ms per step and share of the step for each category."""
    steps = max(raw["steps"], 1)
    out = dict(raw)
    out["profiled_step_ms"] = 1000 * raw["step_s"] / steps
    for c in CATEGORIES:
        out[f"{c}_ms"] = 1000 * raw[f"{c}_s"] / steps
        out[f"{c}_share"] = raw[f"{c}_s"] / raw["step_s"] if raw["step_s"] else 0.0
    out["decode_rows_per_step"] = raw["decode_rows"] / raw["decode_steps"] if raw["decode_steps"] else 0.0
    return out


def profiled(engine: Any, run: Callable[[], Any]) -> dict[str, Any]:
    """The summarized profile of the steps ``run()`` makes the engine take."""
    engine.start_profile()
    try:
        run()
    finally:
        raw = engine.stop_profile()
    return summarize(raw)


def workload_breakdown(engine: Any, run: Callable[[], Any], unprofiled_step_ms: float) -> dict[str, Any]:
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused before the breakdown pass")
    result = profiled(engine, run)
    result["unprofiled_step_ms"] = unprofiled_step_ms
    return result


def decode_breakdown(engine: Any, generate: Generate, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """The decode scenario, once unprofiled (its step time) and once profiled.  Both passes
    find every prompt but its last token in the tree, so they compute the same."""
    if not engine.flush_cache():
        raise RuntimeError("flush_cache refused before the decode breakdown")
    generate(prompts, 0)  # prefill only: the prompts go to the tree
    before = engine.get_stats()
    generate(prompts, output_len)
    after = engine.get_stats()
    steps = after["forward_steps"] - before["forward_steps"]
    result = profiled(engine, lambda: generate(prompts, output_len))
    result.update(requests=len(prompts), prompt_len=max(len(p) for p in prompts), output_len=output_len,
                  unprofiled_step_ms=1000 * (after["step_seconds"] - before["step_seconds"]) / max(steps, 1))
    return result


def format_breakdown(rows: list[dict[str, Any]]) -> str:
    """One line per engine and scenario: steps, ms per step, and each category's ms (share)."""
    lines = [("config", "dtype", "scenario", "steps", "batch", "unprofiled ms", "step ms", *CATEGORIES)]
    for r in rows:
        for scenario, b in (r.get("breakdown") or {}).items():
            lines.append((
                r["config"], r["dtype"], scenario, str(b["steps"]), f"{b['decode_rows_per_step']:.0f}",
                f"{b['unprofiled_step_ms']:.1f}", f"{b['profiled_step_ms']:.1f}",
                *(f"{b[f'{c}_ms']:.1f} ({b[f'{c}_share']:.0%})" for c in CATEGORIES),
            ))
    title = ("breakdown per step, ms (share), of the profiled pass; unprofiled ms: a step of the same "
             "work without the profiler; batch: decode rows per decode step")
    return title + "\n" + align_columns(lines, left=(0, 1, 2))


def breakdown_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Attention's share of a decode step of the decode scenario, per dtype, for the default
    engine (``radix``; ``radix-torch`` is there for comparison)."""
    checks = []
    for r in rows:
        decode = (r.get("breakdown") or {}).get("decode")
        if decode is not None and r["config"] == "radix":
            name = f"radix decode step at {decode['requests']} requests: attention share <="
            checks.append(target(r["dtype"], name, decode["attention_share"],
                                 TARGET_DECODE_ATTENTION_SHARE, at_least=False))
    return checks
