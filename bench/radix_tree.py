"""Radix-tree prefix-cache micro-benchmark: per-call latency of match, insert and evict.

Synthetic trace: ``groups`` system prompts, each shared by ``requests`` requests that add a
private question. Requests are interleaved across groups (seeded shuffle). Each request does
what the scheduler does around the tree:

    match_prefix(prompt) -> lock the matched node
    evict(...) if the pool lacks room for the uncached prompt tail plus the answer
    insert(prompt + answer, slots) -> free the caller's duplicate slots -> unlock

Scenario ``fits``: the pool holds every unique token, so nothing is evicted.
Scenario ``quarter``: the pool holds a quarter of the unique tokens, so inserts evict.

Token lists are built fresh per request (as the tokenizer would hand them over), so key
comparisons cannot take Python's same-object shortcut.

    python bench/radix_tree.py                # full run, writes bench/results/radix_tree.json
    python bench/radix_tree.py --quick        # tiny smoke run
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.common import align_columns, write_report  # noqa: E402
from radixserve.cache.radix_tree import RadixCache  # noqa: E402
from radixserve.cache.tree_check import check_tree  # noqa: E402

OPS = ("match", "insert", "evict")
Tokens = list[int] | np.ndarray


def build_trace(args: argparse.Namespace) -> list[tuple[np.ndarray, np.ndarray]]:
    """(prompt, answer) int64 token arrays, interleaved across groups."""
    rng = np.random.default_rng(args.seed)
    systems = rng.integers(0, args.vocab, size=(args.groups, args.system_len))
    order = np.repeat(np.arange(args.groups), args.requests)
    rng.shuffle(order)
    trace = []
    for g in order:
        question = rng.integers(0, args.vocab, size=args.question_len)
        answer = rng.integers(0, args.vocab, size=args.answer_len)
        trace.append((np.concatenate([systems[g], question]), answer))
    return trace


def as_key_type(
    trace: list[tuple[np.ndarray, np.ndarray]], key_type: str
) -> list[tuple[Tokens, Tokens]]:
    """The trace as fresh Python lists (what a tokenizer hands over) or as int64 arrays."""
    if key_type == "numpy":
        return trace
    return [(prompt.tolist(), answer.tolist()) for prompt, answer in trace]


def run_scenario(
    trace: list[tuple[Tokens, Tokens]],
    page_size: int,
    pool_size: int,
    desc: str,
    progress: bool,
) -> dict:
    """Replay ``trace`` against a fresh tree; return latency percentiles per op."""
    free = pool_size  # free-slot counter of a pretend allocator
    next_slot = 0

    def free_slots(slots: np.ndarray) -> None:
        nonlocal free
        free += len(slots)

    tree = RadixCache(page_size, free_slots)
    times: dict[str, list[int]] = {op: [] for op in OPS}
    cached_tokens = prompt_tokens = 0
    clock = time.perf_counter_ns
    for prompt, answer in tqdm(trace, desc=desc, disable=not progress, leave=False):
        t0 = clock()
        match = tree.match_prefix(prompt)
        times["match"].append(clock() - t0)
        tree.inc_lock_ref(match.node)
        cached_len = len(match.slots)
        cached_tokens += cached_len
        prompt_tokens += len(prompt)

        full = prompt + answer if isinstance(prompt, list) else np.concatenate([prompt, answer])
        # [0, cached_len) comes from the tree; [cached_len, len(full)) needs fresh slots.
        need = len(full) - cached_len
        if need > free:
            t0 = clock()
            tree.evict(need - free)
            times["evict"].append(clock() - t0)
            if need > free:
                raise RuntimeError(f"pool of {pool_size} slots cannot fit a request of {need}")
        free -= need
        fresh = np.arange(next_slot, next_slot + need, dtype=np.int64)
        next_slot += need
        slots = np.concatenate([match.slots, fresh])

        t0 = clock()
        in_tree = tree.insert(full, slots)
        times["insert"].append(clock() - t0)
        # [cached_len, in_tree) duplicates what the tree already held; [aligned, len) was not
        # inserted. Both go back to the allocator.
        aligned = len(full) // page_size * page_size
        free += max(in_tree - cached_len, 0) + (len(full) - aligned)
        tree.dec_lock_ref(match.node)

    check_tree(tree)
    if tree.protected_size() != 0:
        raise RuntimeError("locks left after the trace")
    if free + tree.total_size() != pool_size:
        raise RuntimeError(f"slot leak: free={free} tree={tree.total_size()} pool={pool_size}")
    result = {"hit_rate": cached_tokens / max(prompt_tokens, 1), "ops": {}}
    for op, samples in times.items():
        if not samples:
            result["ops"][op] = {"calls": 0}
            continue
        us = np.asarray(samples, dtype=np.float64) / 1e3
        result["ops"][op] = {
            "calls": len(us),
            "median_us": float(np.median(us)),
            "p90_us": float(np.percentile(us, 90)),
            "p99_us": float(np.percentile(us, 99)),
            "mean_us": float(us.mean()),
        }
    return result


def format_table(rows: list[dict]) -> str:
    header = (
        "keys",
        "scenario",
        "page",
        "op",
        "calls",
        "median_us",
        "p90_us",
        "p99_us",
        "mean_us",
        "hit_rate",
    )
    lines = [header]
    for row in rows:
        for op in OPS:
            stats = row["ops"][op]
            if not stats["calls"]:
                lines.append(
                    (row["keys"], row["scenario"], str(row["page_size"]), op, "0")
                    + ("-",) * 4
                    + ("",)
                )
                continue
            lines.append(
                (
                    row["keys"],
                    row["scenario"],
                    str(row["page_size"]),
                    op,
                    str(stats["calls"]),
                    f"{stats['median_us']:.2f}",
                    f"{stats['p90_us']:.2f}",
                    f"{stats['p99_us']:.2f}",
                    f"{stats['mean_us']:.2f}",
                    f"{row['hit_rate']:.3f}",
                )
            )
    return align_columns(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", type=int, default=64, help="distinct system prompts")
    p.add_argument("--requests", type=int, default=32, help="requests per system prompt")
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--question-len", type=int, default=64)
    p.add_argument("--answer-len", type=int, default=64)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--page-sizes", type=int, nargs="+", default=[1, 16])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--key-types",
        nargs="+",
        choices=["list", "numpy"],
        default=["list", "numpy"],
        help="hand token ids to the tree as Python lists and/or int64 arrays",
    )
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "radix_tree.json")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.requests = 4, 4
        args.system_len, args.question_len, args.answer_len = 64, 16, 16
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    trace = build_trace(args)
    unique = args.groups * args.system_len + len(trace) * (args.question_len + args.answer_len)
    request_len = args.system_len + args.question_len + args.answer_len
    pools = {"fits": unique, "quarter": max(unique // 4, 2 * request_len)}
    rows = []
    for key_type in args.key_types:
        keyed = as_key_type(trace, key_type)
        for page_size in args.page_sizes:
            for scenario, pool in pools.items():
                # Unaligned tails are not cached but still take slots until the request ends.
                pool += page_size * 2
                desc = f"{key_type} {scenario} page={page_size}"
                result = run_scenario(keyed, page_size, pool, desc, not args.no_progress)
                rows.append(
                    {
                        "keys": key_type,
                        "scenario": scenario,
                        "page_size": page_size,
                        "pool_size": pool,
                        **result,
                    }
                )
    print(format_table(rows))
    report = {
        "benchmark": "radix_tree",
        "config": {k: v for k, v in vars(args).items() if k != "out"},
        "unique_tokens": unique,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": rows,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
