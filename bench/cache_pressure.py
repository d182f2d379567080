"""The cache under pressure: eviction policies against a scan of one-off prompts, and
scheduling policies on interleaved groups, with the KV pool sized below the working set.

Scenarios (each config on a fresh ``Engine``, default model, one run):

  hot-prefix  (a) agents share one system prompt (``--system-len`` tokens).  ``--warmup`` agent
              requests (system prompt + a ``--question-len``-token question) make it popular;
              then each of ``--rounds`` rounds sends a burst of ``--burst`` one-off prompts
              (``--oneoff-len`` tokens, no text in common) and one agent request, all
              sequentially.  The pool (``--hot-pool`` tokens) holds the system prompt and about
              two one-offs.  Per ``--radix-eviction-policy`` (lru, lfu, slru): the hit rate of
              the rounds' agent requests (cached / prompt tokens) and their TTFT p50.
  groups      (d) ``--groups`` system prompts (``--group-system-len`` tokens) with ``--per-group``
              questions each, all submitted at once, interleaved across groups, into a pool of
              ``--group-pool`` tokens that holds about three system prompts.  Per
              ``--schedule-policy`` (fcfs, lpm, dfs-weight): prefill tokens computed against the
              unique ones, hit rate, wall time.

Hit rates and token counts are the scheduler's; they do not depend on timing in hot-prefix
(requests run one at a time).  The host/disk tiers, warm restarts and swap preemption (the
issue's scenarios b, c, e) come with those features.

    python bench/cache_pressure.py                 # bfloat16 (about 3 minutes)
    python bench/cache_pressure.py --quick         # tiny smoke run
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    align_columns,
    args_params,
    machine_info,
    target,
    target_lines,
    write_report,
)
from bench.workloads import TokenStream  # noqa: E402

EVICTION_POLICIES = ("lru", "lfu", "slru")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
TARGET_SLRU_HIT_RATE = 0.9
TARGET_LRU_HIT_RATE = 0.5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--scenarios", default="hot-prefix,groups", help="comma list of hot-prefix, groups")
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--oneoff-len", type=int, default=1024)
    p.add_argument("--warmup", type=int, default=3, help="agent requests before the first burst")
    p.add_argument("--rounds", type=int, default=12, help="bursts, each followed by one agent request")
    p.add_argument("--burst", type=int, default=3, help="one-off prompts between two agent requests")
    p.add_argument("--hot-pool", type=int, default=3328, help="KV pool tokens in hot-prefix")
    p.add_argument("--groups", type=int, default=8)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--group-system-len", type=int, default=512)
    p.add_argument("--group-pool", type=int, default=2560, help="KV pool tokens in groups")
    p.add_argument("--output-len", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cache_pressure.json")
    args = p.parse_args(argv)
    if args.quick:
        args.system_len, args.question_len, args.oneoff_len, args.rounds, args.burst = 96, 8, 96, 4, 3
        args.hot_pool = 320
        args.groups, args.per_group, args.group_system_len, args.group_pool, args.output_len = 4, 3, 64, 256, 2
    return args


def engine(args: argparse.Namespace, pool: int, **settings: Any) -> Any:
    from radixserve import Engine

    return Engine(dtype=args.dtype, max_total_tokens=pool, random_seed=args.seed, log_level="warning", **settings)


def hot_prefix(args: argparse.Namespace, tokenizer: Any, policy: str) -> dict[str, Any]:
    stream = TokenStream(tokenizer, args.seed)
    system = stream.take(args.system_len)
    questions = [stream.take(args.question_len) for _ in range(args.warmup + args.rounds)]
    oneoffs = [[stream.take(args.oneoff_len) for _ in range(args.burst)] for _ in range(args.rounds)]
    sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    agents: list[dict[str, Any]] = []
    with engine(args, args.hot_pool, radix_eviction_policy=policy) as eng:
        eng.generate(input_ids=stream.take(16), sampling_params={"max_new_tokens": 1})  # warm-up
        assert eng.flush_cache()
        for q in questions[: args.warmup]:
            eng.generate(input_ids=system + q, sampling_params=sampling)
        t0 = time.perf_counter()
        for r in range(args.rounds):
            for prompt in oneoffs[r]:
                eng.generate(input_ids=prompt, sampling_params=sampling)
            out = eng.generate(input_ids=system + questions[args.warmup + r], sampling_params=sampling)
            agents.append(out["meta_info"])
        wall = time.perf_counter() - t0
        stats = eng.get_stats()
    prompt_tokens = sum(m["prompt_tokens"] for m in agents)
    return {
        "scenario": "hot-prefix", "policy": policy, "wall_s": wall,
        "agent_hit_rate": sum(m["cached_tokens"] for m in agents) / prompt_tokens if prompt_tokens else 0.0,
        "agent_ttft_p50_ms": 1000 * statistics.median(m["ttft"] for m in agents) if agents else None,
        "agent_cached_tokens": [m["cached_tokens"] for m in agents],
        "evicted_tokens": stats["evicted_tokens"], "overall_hit_rate": stats["cache_hit_rate"],
    }


def groups(args: argparse.Namespace, tokenizer: Any, policy: str) -> dict[str, Any]:
    stream = TokenStream(tokenizer, args.seed + 7)
    systems = [stream.take(args.group_system_len) for _ in range(args.groups)]
    prompts = [systems[g] + stream.take(args.question_len) for _ in range(args.per_group) for g in range(args.groups)]
    unique = args.groups * args.group_system_len + len(prompts) * args.question_len
    sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    with engine(args, args.group_pool, schedule_policy=policy) as eng:
        eng.generate(input_ids=stream.take(16), sampling_params={"max_new_tokens": 1})  # warm-up
        assert eng.flush_cache()
        before = eng.get_stats()
        t0 = time.perf_counter()
        outs = eng.generate(input_ids=prompts, sampling_params=sampling, progress=False)
        wall = time.perf_counter() - t0
        after = eng.get_stats()
    computed = after["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    prompt_tokens = after["prompt_tokens"] - before["prompt_tokens"]
    return {
        "scenario": "groups", "policy": policy, "wall_s": wall, "prefill_computed": computed,
        "unique_tokens": unique, "computed_over_unique": computed / unique,
        "hit_rate": (after["cached_tokens"] - before["cached_tokens"]) / prompt_tokens,
        "ttft_p50_ms": 1000 * statistics.median(o["meta_info"]["ttft"] for o in outs),
        "retractions": after["retractions"] - before["retractions"],
        "evicted_tokens": after["evicted_tokens"] - before["evicted_tokens"],
    }


def report_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    hot = [r for r in rows if r["scenario"] == "hot-prefix"]
    if hot:
        table = [("eviction policy", "agent hit rate", "agent TTFT p50 ms", "evicted tokens", "wall s")]
        table += [(r["policy"], f"{r['agent_hit_rate']:.1%}", f"{r['agent_ttft_p50_ms']:.0f}",
                   str(r["evicted_tokens"]), f"{r['wall_s']:.1f}") for r in hot]
        lines += ["hot-prefix (a): a shared system prompt between bursts of one-off prompts",
                  align_columns(table, left={0})]
    grp = [r for r in rows if r["scenario"] == "groups"]
    if grp:
        table = [("schedule policy", "prefill computed", "computed/unique", "hit rate", "TTFT p50 ms",
                  "retractions", "wall s")]
        table += [(r["policy"], str(r["prefill_computed"]), f"{r['computed_over_unique']:.2f}", f"{r['hit_rate']:.1%}",
                   f"{r['ttft_p50_ms']:.0f}", str(r["retractions"]), f"{r['wall_s']:.1f}") for r in grp]
        lines += ["groups (d): interleaved groups submitted at once into a small pool", align_columns(table, left={0})]
    return lines


def check_targets(rows: list[dict[str, Any]], dtype: str) -> list[dict[str, Any]]:
    by = {(r["scenario"], r["policy"]): r for r in rows}
    slru, lru = by.get(("hot-prefix", "slru")), by.get(("hot-prefix", "lru"))
    return [
        target(dtype, "hot-prefix slru agent hit rate >=", slru and slru["agent_hit_rate"], TARGET_SLRU_HIT_RATE, True),
        target(dtype, "hot-prefix lru agent hit rate <=", lru and lru["agent_hit_rate"], TARGET_LRU_HIT_RATE, False),
    ]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - {"hot-prefix", "groups"}
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)}")
    plan = ([(hot_prefix, p) for p in EVICTION_POLICIES] if "hot-prefix" in scenarios else []) + (
        [(groups, p) for p in SCHEDULE_POLICIES] if "groups" in scenarios else [])
    rows = []
    for i, (run, policy) in enumerate(plan, 1):
        print(f"[{i}/{len(plan)}] {run.__name__.replace('_', '-')} {policy} ...", flush=True)
        rows.append(run(args, tokenizer, policy))
    checks = check_targets(rows, args.dtype)
    print("\n".join(report_lines(rows) + target_lines(checks)))
    report = {"benchmark": "cache_pressure", "params": args_params(args), "machine": machine_info(),
              "results": rows, "targets": checks}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
