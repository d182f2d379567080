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
  tiers       (b) ``--convs`` conversations x ``--turns`` turns in rotation (turn 1 of every
              conversation, then turn 2 of every one, ...), sent ``--window`` at a time; each starts
              with its own ``--doc-len``-token document and adds a ``--question-len``-token question
              and the ``--output-len``-token answer per turn.  The pool is ``--tier-pool-fraction``
              of the working set (every conversation's final context).  Per config: LRU alone,
              a host tier (``--host-fraction`` of the working set), a disk tier alone: hit rate
              and TTFT p50 of turns 2 and later, and the longest tier copy in one step against the
              median decode step (a promotion must not stall the others by more than a step).
              ``int8-kv``: no tier, the pool in int8 (``--kv-cache-dtype int8``) in the memory of
              LRU alone's pool, so it holds 1.94x (bfloat16) / 3.88x (float32) the tokens.
  restart     (c) a server on an empty disk folder answers a ``--restart-system-len``-token system
              prompt and a question (cold), stops; a server started on the same folder answers
              the same system prompt with another question (warm): first-request TTFT of each.
  preemption  (e) ``--swap-requests`` low-priority requests (``--swap-prompt-len`` prompt
              tokens, ``--swap-output-len`` outputs) decode in a pool of ``--swap-pool`` tokens
              that holds little else; ``--swap-waves`` waves of ``--swap-wave-size`` high-priority
              requests (``--swap-high-len`` tokens) arrive ``--swap-gap`` s apart and retract some
              of them (priority policy with preemption).  recompute vs swap: when the low ones are
              done, the waves' TTFT p50, retractions, prefill tokens computed, tokens swapped.
  groups      (d) ``--groups`` system prompts (``--group-system-len`` tokens) with ``--per-group``
              questions each, all submitted at once, interleaved across groups, into a pool of
              ``--group-pool`` tokens that holds about three system prompts.  Per
              ``--schedule-policy`` (fcfs, lpm, dfs-weight): prefill tokens computed against the
              unique ones, hit rate, wall time.

Hit rates and token counts are the scheduler's; they do not depend on timing in hot-prefix
(requests run one at a time).

    python bench/cache_pressure.py                 # bfloat16 (about 15 minutes)
    python bench/cache_pressure.py --quick         # tiny smoke run
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import sys
import tempfile
import threading
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
from bench.kv_quant import same_memory_tokens  # noqa: E402
from bench.workloads import TokenStream  # noqa: E402

EVICTION_POLICIES = ("lru", "lfu", "slru")
SCHEDULE_POLICIES = ("fcfs", "lpm", "dfs-weight")
TARGET_SLRU_HIT_RATE = 0.9
TARGET_LRU_HIT_RATE = 0.5
TIER_CONFIGS = ("lru", "host", "disk", "int8-kv")  # int8-kv: LRU alone, an int8 pool of the same memory
TARGET_TIER_HIT_RATE = 0.8  # (b) with the host or the disk tier
TARGET_LRU_ALONE_HIT_RATE = 0.3  # (b) where LRU alone is at most this
TARGET_TIER_TTFT_RATIO = 1 / 3  # (b) tier TTFT p50 over LRU-alone TTFT p50
TARGET_INT8_KV_HIT_RATIO = 1.5  # (b) int8-kv hit rate over LRU alone's (same memory)
TARGET_RESTART_TTFT_RATIO = 1 / 4  # (c) warm over cold first-request TTFT
SCENARIOS = ("hot-prefix", "tiers", "restart", "groups", "preemption")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help="comma list of " + ", ".join(SCENARIOS))
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
    p.add_argument("--convs", type=int, default=256)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--doc-len", type=int, default=256)
    p.add_argument("--window", type=int, default=32, help="tiers: requests in flight at once")
    p.add_argument("--tier-pool-fraction", type=float, default=0.25)
    p.add_argument("--host-fraction", type=float, default=1.0)
    p.add_argument("--tier-configs", default=",".join(TIER_CONFIGS), help="tiers: comma list of " + ", ".join(TIER_CONFIGS))
    p.add_argument("--restart-system-len", type=int, default=2048)
    p.add_argument("--swap-requests", type=int, default=6, help="preemption: low-priority requests")
    p.add_argument("--swap-prompt-len", type=int, default=1024)
    p.add_argument("--swap-output-len", type=int, default=256)
    p.add_argument("--swap-high-len", type=int, default=512, help="preemption: high-priority prompt tokens")
    p.add_argument("--swap-waves", type=int, default=4)
    p.add_argument("--swap-wave-size", type=int, default=4)
    p.add_argument("--swap-gap", type=float, default=1.5, help="seconds before each high-priority wave")
    p.add_argument("--swap-pool", type=int, default=8192)
    p.add_argument("--disk-dir", type=Path, default=None, help="scratch folder for disk tiers (default: a temp folder)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cache_pressure.json")
    args = p.parse_args(argv)
    if args.quick:
        args.system_len, args.question_len, args.oneoff_len, args.rounds, args.burst = 96, 8, 96, 4, 3
        args.hot_pool = 320
        args.groups, args.per_group, args.group_system_len, args.group_pool, args.output_len = 4, 3, 64, 256, 2
        args.convs, args.turns, args.doc_len, args.window = 12, 3, 64, 2
        args.restart_system_len = 256
        args.swap_requests, args.swap_prompt_len, args.swap_output_len, args.swap_pool = 4, 48, 48, 256
        args.swap_high_len, args.swap_waves, args.swap_wave_size, args.swap_gap = 32, 2, 2, 0.3
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


def scratch(args: argparse.Namespace, name: str) -> Path:
    """An empty disk-tier folder."""
    base = args.disk_dir or Path(tempfile.gettempdir()) / "radixserve-bench-disk"
    path = base / name
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    return path


def tiers(args: argparse.Namespace, tokenizer: Any, config: str) -> dict[str, Any]:
    stream = TokenStream(tokenizer, args.seed + 11)
    # Each conversation's document opens with its own header (so no two share a prefix) and
    # goes on with a window of a common text; questions come from a shared set.
    text = stream.take(4 * args.doc_len)
    docs = []
    for c in range(args.convs):
        head = tokenizer.encode(f"Case file {c}:", add_special_tokens=False)
        at = (c * 97) % (len(text) - args.doc_len)
        docs.append((head + text[at : at + args.doc_len])[: args.doc_len])
    pool = [stream.take(args.question_len) for _ in range(64)]
    questions = [[pool[(7 * c + t) % len(pool)] for t in range(args.turns)] for c in range(args.convs)]
    per_conv = args.doc_len + args.turns * (args.question_len + args.output_len)
    working_set = args.convs * per_conv
    pool = int(args.tier_pool_fraction * working_set)
    settings: dict[str, Any] = {}
    if config == "host":
        settings["host_cache_size"] = int(args.host_fraction * working_set)
    elif config == "disk":
        settings.update(disk_cache_dir=str(scratch(args, "tiers")), disk_cache_size=2 * working_set)
    elif config == "int8-kv":
        pool = same_memory_tokens(pool, args.dtype, "int8")
        settings["kv_cache_dtype"] = "int8"
    sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    history = [list(d) for d in docs]
    metas: list[dict[str, Any]] = []
    with engine(args, pool, **settings) as eng:
        eng.generate(input_ids=stream.take(16), sampling_params={"max_new_tokens": 1})  # warm-up
        assert eng.flush_cache()
        t0 = time.perf_counter()
        for turn in range(args.turns):
            for start in range(0, args.convs, args.window):
                convs = range(start, min(args.convs, start + args.window))
                prompts = [history[c] + questions[c][turn] for c in convs]
                outs = eng.generate(input_ids=prompts, sampling_params=sampling, progress=False)
                for c, prompt, out in zip(convs, prompts, outs, strict=True):
                    history[c] = prompt + out["output_ids"]
                    if turn:
                        metas.append(out["meta_info"])
            print(f"    turn {turn + 1}/{args.turns} done", flush=True)
        wall = time.perf_counter() - t0
        stats = eng.get_stats()
    prompt_tokens = sum(m["prompt_tokens"] for m in metas)
    # Without a tier the server gives no split: every cached token is then a device hit.
    details = [m.get("cached_tokens_details") or {"device": m["cached_tokens"]} for m in metas]
    by_tier = {t: sum(d.get(t, 0) for d in details) for t in ("device", "host", "disk")}
    decode_step_ms = 1000 * stats["forward_seconds"] / max(1, stats["forward_steps"])
    return {
        "scenario": "tiers", "policy": config, "wall_s": wall, "pool_tokens": pool, "working_set": working_set,
        "kv_cache_dtype": settings.get("kv_cache_dtype", "auto"),
        "prompt_tokens": prompt_tokens, "cached_tokens": sum(m["cached_tokens"] for m in metas),
        "hit_rate": sum(m["cached_tokens"] for m in metas) / prompt_tokens,
        "ttft_p50_ms": 1000 * statistics.median(m["ttft"] for m in metas),
        "cached_by_tier": by_tier, "prefill_computed": stats["prefill_tokens_computed"],
        "tier_copy_ms_max": stats.get("tier_copy_ms_max", 0.0), "mean_step_ms": decode_step_ms,
        "disk_loaded_tokens": stats.get("disk_loaded_tokens", 0), "promoted_tokens": stats.get("promoted_tokens", 0),
    }


def restart(args: argparse.Namespace, tokenizer: Any, config: str) -> dict[str, Any]:
    """config "cold": an empty disk folder; "warm": the folder the cold server wrote."""
    stream = TokenStream(tokenizer, args.seed + 13)
    system = stream.take(args.restart_system_len)
    questions = stream.take(args.question_len), stream.take(args.question_len)
    question = questions[0] if config == "cold" else questions[1]
    folder = (args.disk_dir or Path(tempfile.gettempdir()) / "radixserve-bench-disk") / "restart"
    if config == "cold":
        folder = scratch(args, "restart")
    sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    t_start = time.perf_counter()
    with engine(args, 4 * args.restart_system_len, disk_cache_dir=str(folder)) as eng:
        started = time.perf_counter() - t_start
        eng.generate(input_ids=stream.take(16), sampling_params={"max_new_tokens": 1})  # warm-up (< 1 block)
        out = eng.generate(input_ids=system + question, sampling_params=sampling)
        stats = eng.get_stats()
    meta = out["meta_info"]
    return {"scenario": "restart", "policy": config, "ttft_ms": 1000 * meta["ttft"], "start_s": started,
            "cached_tokens": meta["cached_tokens"], "cached_by_tier": meta.get("cached_tokens_details"),
            "disk_blocks": stats.get("disk_blocks", 0)}


def preemption(args: argparse.Namespace, tokenizer: Any, mode: str) -> dict[str, Any]:
    """Long low-priority requests decode in a pool that holds them and little else; waves of
    high-priority requests arrive (``--schedule-policy priority --priority-preemption``) and
    retract some of them each time; the retracted ones come back when a wave is done."""
    stream = TokenStream(tokenizer, args.seed + 17)
    low = [stream.take(args.swap_prompt_len) for _ in range(args.swap_requests)]
    waves = [[stream.take(args.swap_high_len) for _ in range(args.swap_wave_size)] for _ in range(args.swap_waves)]
    low_sampling = {"max_new_tokens": args.swap_output_len, "temperature": 0, "ignore_eos": True}
    high_sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    done: dict[str, Any] = {}
    with engine(args, args.swap_pool, preemption_mode=mode, schedule_policy="priority",
                priority_preemption=True) as eng:
        eng.generate(input_ids=stream.take(16), sampling_params={"max_new_tokens": 1})  # warm-up
        assert eng.flush_cache()
        before = eng.get_stats()

        def run_low() -> None:
            done["low"] = eng.generate(input_ids=low, sampling_params=low_sampling, progress=False)
            done["low_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        worker = threading.Thread(target=run_low)
        worker.start()
        high_ttft = []
        for wave in waves:
            time.sleep(args.swap_gap)  # the low requests are decoding
            outs = eng.generate(input_ids=wave, sampling_params=high_sampling, priority=10, progress=False)
            high_ttft += [o["meta_info"]["ttft"] for o in outs]
        worker.join()
        wall = time.perf_counter() - t0
        after = eng.get_stats()
    return {
        "scenario": "preemption", "policy": mode, "wall_s": wall, "low_wall_s": done["low_s"],
        "high_ttft_p50_ms": 1000 * statistics.median(high_ttft),
        "retractions": after["retractions"] - before["retractions"],
        "prefill_computed": after["prefill_tokens_computed"] - before["prefill_tokens_computed"],
        "swapped_out_tokens": after.get("swapped_out_tokens", 0), "promoted_tokens": after.get("promoted_tokens", 0),
        "tier_copy_ms_total": after.get("tier_copy_ms_total", 0.0),
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
    tier_rows = [r for r in rows if r["scenario"] == "tiers"]
    if tier_rows:
        table = [("config", "pool tokens", "hit rate", "TTFT p50 ms", "by tier device/host/disk", "prefill computed",
                  "longest tier copy ms", "mean step ms", "wall s")]
        table += [(r["policy"], str(r["pool_tokens"]), f"{r['hit_rate']:.1%}", f"{r['ttft_p50_ms']:.0f}",
                   "/".join(str(r["cached_by_tier"][t]) for t in ("device", "host", "disk")),
                   str(r["prefill_computed"]), f"{r['tier_copy_ms_max']:.1f}", f"{r['mean_step_ms']:.1f}",
                   f"{r['wall_s']:.1f}") for r in tier_rows]
        r0 = tier_rows[0]
        lines += [f"tiers (b): conversations in rotation, turns 2+; pool {r0['pool_tokens']} tokens = "
                  f"{r0['pool_tokens'] / r0['working_set']:.0%} of the working set", align_columns(table, left={0})]
    rs = [r for r in rows if r["scenario"] == "restart"]
    if rs:
        table = [("server", "first-request TTFT ms", "cached tokens", "disk blocks")]
        table += [(r["policy"], f"{r['ttft_ms']:.0f}", str(r["cached_tokens"]), str(r["disk_blocks"])) for r in rs]
        lines += ["restart (c): first request after a start on an empty vs a warm disk tier",
                  align_columns(table, left={0})]
    pre = [r for r in rows if r["scenario"] == "preemption"]
    if pre:
        table = [("preemption", "low-priority done s", "high TTFT p50 ms", "retractions", "prefill computed",
                  "swapped out", "copy ms")]
        table += [(r["policy"], f"{r['low_wall_s']:.1f}", f"{r['high_ttft_p50_ms']:.0f}", str(r["retractions"]),
                   str(r["prefill_computed"]), str(r["swapped_out_tokens"]), f"{r['tier_copy_ms_total']:.0f}")
                  for r in pre]
        lines += ["preemption (e): high-priority waves retract long low-priority requests in a small pool",
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
    checks = [
        target(dtype, "hot-prefix slru agent hit rate >=", slru and slru["agent_hit_rate"], TARGET_SLRU_HIT_RATE, True),
        target(dtype, "hot-prefix lru agent hit rate <=", lru and lru["agent_hit_rate"], TARGET_LRU_HIT_RATE, False),
    ]
    alone = by.get(("tiers", "lru"))
    if alone:
        checks.append(target(dtype, "tiers lru-alone hit rate <=", alone["hit_rate"], TARGET_LRU_ALONE_HIT_RATE, False))
        for config in ("host", "disk"):
            r = by.get(("tiers", config))
            if r:
                checks.append(target(dtype, f"tiers {config} hit rate >=", r["hit_rate"], TARGET_TIER_HIT_RATE, True))
                checks.append(target(dtype, f"tiers {config} TTFT p50 / lru-alone <=",
                                     r["ttft_p50_ms"] / alone["ttft_p50_ms"], TARGET_TIER_TTFT_RATIO, False))
                checks.append(target(dtype, f"tiers {config} longest tier copy / mean step <=",
                                     r["tier_copy_ms_max"] / r["mean_step_ms"], 1.0, False))
        int8 = by.get(("tiers", "int8-kv"))
        if int8:
            checks.append(target(dtype, "tiers int8-kv hit rate / lru-alone (same memory) >=",
                                 int8["hit_rate"] / max(alone["hit_rate"], 1e-9), TARGET_INT8_KV_HIT_RATIO, True))
    cold, warm = by.get(("restart", "cold")), by.get(("restart", "warm"))
    if cold and warm:
        checks.append(target(dtype, "restart warm / cold first TTFT <=", warm["ttft_ms"] / cold["ttft_ms"],
                             TARGET_RESTART_TTFT_RATIO, False))
    return checks


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    scenarios = args.scenarios.split(",")
    unknown = set(scenarios) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenario(s) {sorted(unknown)}")
    tier_configs = [c for c in args.tier_configs.split(",") if c]
    if set(tier_configs) - set(TIER_CONFIGS):
        raise SystemExit(f"unknown tier config(s) {sorted(set(tier_configs) - set(TIER_CONFIGS))}")
    configs = {"hot-prefix": (hot_prefix, EVICTION_POLICIES), "tiers": (tiers, tier_configs),
               "restart": (restart, ("cold", "warm")), "groups": (groups, SCHEDULE_POLICIES),
               "preemption": (preemption, ("recompute", "swap"))}
    plan = [(configs[name][0], c) for name in SCENARIOS if name in scenarios for c in configs[name][1]]
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
