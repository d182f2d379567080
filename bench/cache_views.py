"""What the cache views cost: the tree summary (``GET /cache/tree``) at 100k cached tokens, and
the step time of a loaded server with and without a client polling the views.

  summary   a radix tree of ``--convs`` conversations (``--systems`` shared system prompts of
            ``--system-len`` tokens, then ``--conv-len`` tokens each, in ``--turns`` nodes),
            about 100k tokens: the median time of one summary per sort and limit (this is the
            scheduler's share of a ``/cache/tree`` call; the decoding is the front end's).
  load      the default model served over HTTP; ``--streams`` concurrent streams (the
            shared-prefix workload: ``--groups`` system prompts of ``--system-len`` tokens, a
            question each, ``--output-len`` tokens out), alone and while a client fetches
            ``/cache/tree`` (limit 400, what the page asks) and ``/cache/misses`` every
            ``--poll-interval`` s, alternated twice: the scheduler's mean step time (from its
            own counters) and the wall time of each run.  Then, with ``--screenshot``, headless
            Chromium saves the ``/cache`` page of that server.

    python bench/cache_views.py                 # about 3 minutes
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

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

TARGET_SUMMARY_MS = 1.0
TARGET_STEP_CHANGE = 0.02


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--systems", type=int, default=8)
    p.add_argument("--system-len", type=int, default=512)
    p.add_argument("--convs", type=int, default=400)
    p.add_argument("--conv-len", type=int, default=240)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--output-len", type=int, default=96)
    p.add_argument("--poll-interval", type=float, default=0.5)
    p.add_argument("--groups", type=int, default=4, help="load: system prompts")
    p.add_argument("--screenshot", type=Path, default=None, help="save the /cache page (PNG) after the load runs")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cache_views.json")
    args = p.parse_args(argv)
    if args.quick:
        args.convs, args.streams, args.output_len, args.system_len, args.poll_interval = 40, 8, 16, 64, 0.05
    return args


def summary_cost(args: argparse.Namespace) -> list[dict[str, Any]]:
    from radixserve.cache.radix_tree import RadixCache
    from radixserve.cache.tree_view import summary_rows

    rng = random.Random(0)
    tree = RadixCache(1, lambda s: None)
    systems = [[rng.randrange(50_000) for _ in range(args.system_len)] for _ in range(args.systems)]
    slot = 0
    for c in range(args.convs):
        conv = systems[c % args.systems] + [rng.randrange(50_000) for _ in range(args.conv_len)]
        for t in range(1, args.turns + 1):  # each turn extends the last: one node per turn
            end = args.system_len + args.conv_len * t // args.turns
            cached = tree.insert(conv[:end], np.arange(slot, slot + end))
            slot += end - cached
        tree.match_prefix(systems[c % args.systems] + [1])
    rows = []
    for sort in ("weight", "tokens"):
        for limit in (50, 400):
            times = []
            for _ in range(30):
                t0 = time.perf_counter()
                view = summary_rows(tree, sort, None, limit)
                times.append(time.perf_counter() - t0)
            rows.append({"sort": sort, "limit": limit, "tokens": tree.total_size(), "nodes": view["nodes"],
                         "median_ms": 1000 * statistics.median(times)})
    return rows


def load_run(base_url: str, prompts: list[list[int]], output_len: int, poll: float | None) -> dict[str, Any]:
    import httpx

    def stats() -> dict[str, Any]:
        return httpx.get(base_url + "/server_info", timeout=60).json()["stats"]

    stop = threading.Event()
    polls = []

    def poller() -> None:
        with httpx.Client(base_url=base_url, timeout=60) as client:
            while not stop.wait(poll):
                t0 = time.perf_counter()
                client.get("/cache/tree", params={"sort": "tokens", "limit": 400}).raise_for_status()
                client.get("/cache/misses").raise_for_status()
                polls.append(time.perf_counter() - t0)

    async def one(client: httpx.AsyncClient, ids: list[int]) -> None:
        body = {"input_ids": ids, "stream": True,
                "sampling_params": {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}}
        async with client.stream("POST", "/generate", json=body) as r:
            async for _ in r.aiter_lines():
                pass

    async def all_streams() -> None:
        async with httpx.AsyncClient(base_url=base_url, timeout=600) as client:
            await asyncio.gather(*(one(client, p) for p in prompts))

    before = stats()
    thread = threading.Thread(target=poller, daemon=True) if poll else None
    if thread:
        thread.start()
    t0 = time.perf_counter()
    asyncio.run(all_streams())
    wall = time.perf_counter() - t0
    stop.set()
    if thread:
        thread.join()
    after = stats()
    steps = after["forward_steps"] - before["forward_steps"]
    return {"poller": poll is not None, "wall_s": wall, "steps": steps,
            "step_ms": 1000 * (after["step_seconds"] - before["step_seconds"]) / max(1, steps),
            "forward_ms": 1000 * (after["forward_seconds"] - before["forward_seconds"]) / max(1, steps),
            "polls": len(polls), "poll_ms_p50": 1000 * statistics.median(polls) if polls else None}


def load(args: argparse.Namespace) -> list[dict[str, Any]]:
    sys.path.insert(0, str(REPO / "tests"))
    from helpers.server import ServerProcess

    from bench.workloads import TokenStream
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    stream = TokenStream(load_tokenizer(default_model_path()), 0)
    systems = [stream.take(args.system_len) for _ in range(args.groups)]
    prompts = [systems[i % args.groups] + stream.take(16) for i in range(args.streams)]
    srv = ServerProcess("--dtype", args.dtype, "--max-total-tokens", "65536").wait_ready()
    try:
        load_run(srv.base_url, prompts[:4], 4, None)  # warm-up
        rows = []
        for poll in (None, args.poll_interval, None, args.poll_interval):  # alternated: drift hits both
            print(f"  load run, poller {'on' if poll else 'off'} ...", flush=True)
            rows.append(load_run(srv.base_url, prompts, args.output_len, poll))
        if args.screenshot is not None:
            screenshot(srv.base_url + "/cache", args.screenshot)
    finally:
        srv.stop()
    return rows


def screenshot(url: str, out: Path) -> None:
    import shutil
    import subprocess
    import tempfile

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        print("  no Chromium here: no screenshot", flush=True)
        return
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", "--virtual-time-budget=8000", "--window-size=1400,960",
                        f"--screenshot={out}", url], capture_output=True, timeout=120, check=True)
    print(f"  wrote {out}", flush=True)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    print("summary cost ...", flush=True)
    cost = summary_cost(args)
    print("load ...", flush=True)
    runs = load(args)
    table = [("sort", "limit", "cached tokens", "nodes", "summary ms (median)")]
    table += [(r["sort"], str(r["limit"]), str(r["tokens"]), str(r["nodes"]), f"{r['median_ms']:.2f}") for r in cost]
    lines = ["tree summary (the scheduler's share of GET /cache/tree)", align_columns(table, left={0})]
    table = [("poller", "wall s", "steps", "mean step ms", "mean forward ms", "polls", "poll ms p50")]
    table += [("on" if r["poller"] else "off", f"{r['wall_s']:.1f}", str(r["steps"]), f"{r['step_ms']:.2f}",
               f"{r['forward_ms']:.2f}", str(r["polls"]), f"{r['poll_ms_p50']:.1f}" if r["poll_ms_p50"] else "-")
              for r in runs]
    lines += [f"{args.streams} concurrent streams, with and without a client polling the views", align_columns(table)]
    off = statistics.mean(r["step_ms"] for r in runs if not r["poller"])
    on = statistics.mean(r["step_ms"] for r in runs if r["poller"])
    worst = max(r["median_ms"] for r in cost if r["limit"] == 50)
    checks = [target(args.dtype, "summary (limit 50, the default), ms <=", worst, TARGET_SUMMARY_MS, False),
              target(args.dtype, "step time change with the poller <=", on / off - 1, TARGET_STEP_CHANGE, False)]
    print("\n".join(lines + target_lines(checks)))
    report = {"benchmark": "cache_views", "params": args_params(args), "machine": machine_info(),
              "summary": cost, "load": runs, "targets": checks}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
