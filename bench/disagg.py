"""Prefill-decode disaggregation on one machine: a prefill and a decode worker behind smg
(``--pd-disaggregation``) against two colocated workers behind smg (``cache_aware``), one core
each (and ``pd-nixl``: the pair with its KV written through NIXL), the same workload through
smg's streamed ``/v1/chat/completions``: ``--chat-clients``
clients each looping over short chat messages (a new one every turn, exactly ``--chat-tokens``
out), and every ``--burst-interval`` s a burst of ``--burst-size`` long never-seen prompts
(disjoint windows of the corpus, bench/workloads.py: only the template's system prompt is ever
cached).  Timed over ``--duration`` s after ``--warmup`` s of chat alone.

Reported: chat TTFT and ITL p50/p99 (and the ITL p99 over the gaps overlapping a burst's
prefill: from its first request sent to its last first token), burst TTFT, output tokens/s, and
for ``pd`` the KV bytes and transfer ms (the prefill's gather + send, the wire, the decode's
write) per request, from the workers' ``stats.disaggregation``.  Transfer overhead: with the
chat stopped, ``--measure`` unique ``--measure-len``-token prompts one at a time through the PD
pair, against their prefill time (TTFT, one output token) on a colocated worker.

    python bench/disagg.py                                        # both configs, bfloat16
    python bench/disagg.py --configs pd --duration 60
    python bench/disagg.py --quick --out /tmp/disagg_quick.json   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.cluster import SERVED_MODEL, warm, worker_flags, worker_stats  # noqa: E402
from bench.common import (  # noqa: E402
    Launched,
    align_columns,
    args_params,
    free_port,
    machine_info,
    target,
    target_lines,
    write_report,
)
from bench.compare import Server  # noqa: E402
from bench.serving_report import distribution  # noqa: E402
from bench.workloads import TokenStream  # noqa: E402

TARGET_ITL_RATIO = 3.0  # colocated / pd chat ITL p99 under bursts
TARGET_TRANSFER_SHARE = 0.10  # transfer ms / prefill ms of a 1k-token prompt
CONFIGS = ("pd", "colocated", "pd-nixl")  # pd-nixl: the KV written through NIXL (UCX) instead of ZeroMQ
ONE_CORE = {"OMP_NUM_THREADS": "1"}
# No worker ejected for an answer; a stopped router waits for nothing in flight.
ROUTER_FLAGS = ("--disable-circuit-breaker", "--shutdown-grace-period-secs", "1", "--log-level", "warn")


# ---- the workload -------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    """Chat message texts, disjoint windows of one token stream (the same for every config)."""

    chat: list[list[str]]  # per client, one message per turn
    bursts: list[list[str]]  # per burst
    measure: list[str]  # the transfer-overhead prompts
    warm: str  # one long prompt per worker before the timed run


def build_workload(tokenizer: Any, args: argparse.Namespace) -> Workload:
    """Messages whose chat prompt (template included) is at most the wanted length, and close."""
    def prompt_len(content: str) -> int:
        text = tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        return len(tokenizer.encode(text, add_special_tokens=False))

    overhead, stream = prompt_len(""), TokenStream(tokenizer, args.seed)

    def text(length: int) -> str:  # a window decoded and re-encoded can grow: cut it to fit
        ids = stream.take(max(1, length - overhead))
        while len(ids) > 1 and (excess := prompt_len(tokenizer.decode(ids)) - length) > 0:
            ids = ids[:-excess]
        return tokenizer.decode(ids)

    bursts = int(args.duration // args.burst_interval)
    return Workload(chat=[[text(args.chat_len) for _ in range(args.chat_turns)] for _ in range(args.chat_clients)],
                    bursts=[[text(args.burst_len) for _ in range(args.burst_size)] for _ in range(bursts)],
                    measure=[text(args.measure_len) for _ in range(args.measure)], warm=text(args.burst_len))


# ---- one streamed chat request --------------------------------------------------------------
@dataclass
class Reply:
    start: float  # seconds after the traffic's start, as ``times``
    requested: int  # max_tokens
    times: list[float] = field(default_factory=list)  # arrival of each chunk with content
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def ttft(self) -> float:
        return self.times[0] - self.start


async def send_chat(client: Any, content: str, max_tokens: int, t0: float) -> Reply:
    """Stream one chat completion of exactly ``max_tokens`` tokens (``ignore_eos``)."""
    import httpx

    body = {"model": SERVED_MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": max_tokens,
            "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    reply = Reply(start=time.perf_counter() - t0, requested=max_tokens)
    try:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            if resp.status_code != 200:
                reply.error = f"HTTP {resp.status_code}: {(await resp.aread()).decode(errors='replace')[:300]}"
                return reply
            async for line in resp.aiter_lines():
                data = line[5:].strip() if line.startswith("data:") else ""
                if not data or data == "[DONE]":
                    continue
                obj = json.loads(data)
                if obj.get("error"):
                    reply.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return reply
                choices = obj.get("choices") or []
                if any((c.get("delta") or {}).get("content") for c in choices) or (
                        not reply.times and any(c.get("finish_reason") for c in choices)):
                    reply.times.append(time.perf_counter() - t0)
                if usage := obj.get("usage"):
                    reply.prompt_tokens, reply.output_tokens = usage["prompt_tokens"], usage["completion_tokens"]
    except (httpx.HTTPError, json.JSONDecodeError, KeyError) as e:
        reply.error = f"{type(e).__name__}: {e}"
    if reply.ok and not reply.times:
        reply.error = "the stream carried no token"
    return reply


def http_client(base: str) -> Any:
    import httpx

    return httpx.AsyncClient(base_url=base, timeout=httpx.Timeout(600.0, connect=30.0),
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


async def run_traffic(base: str, work: Workload, args: argparse.Namespace) -> tuple[list[Reply], list[list[Reply]]]:
    """The chat loops from t=0 until ``warmup + duration``; burst k at ``warmup + (k + 1/2) *
    burst_interval``.  Returns the chat replies and each burst's."""
    t0 = time.perf_counter()
    end = args.warmup + args.duration
    async with http_client(base) as client:
        async def chat_loop(client_id: int, messages: list[str]) -> list[Reply]:
            replies = []
            for content in messages:
                if time.perf_counter() - t0 >= end:
                    return replies
                replies.append(await send_chat(client, content, args.chat_tokens, t0))
            print(f"  warning: chat client {client_id} ran out of messages after {len(replies)} turns "
                  f"({time.perf_counter() - t0:.0f} s); raise --chat-turns", flush=True)
            return replies

        async def bursts() -> list[list[Reply]]:
            tasks = []
            for k, burst in enumerate(work.bursts):
                await asyncio.sleep(max(0.0, args.warmup + (k + 0.5) * args.burst_interval
                                        - (time.perf_counter() - t0)))
                tasks.append([asyncio.create_task(send_chat(client, p, args.burst_tokens, t0)) for p in burst])
            return [list(await asyncio.gather(*burst)) for burst in tasks]

        sent, *chats = await asyncio.gather(bursts(), *(chat_loop(i, m) for i, m in enumerate(work.chat)))
    return [r for replies in chats for r in replies], sent


async def sequential(base: str, prompts: list[str], max_tokens: int) -> list[Reply]:
    async with http_client(base) as client:
        return [await send_chat(client, p, max_tokens, time.perf_counter()) for p in prompts]


# ---- the processes --------------------------------------------------------------------------
class Smg(Launched):
    """smg on free loopback ports; ready once it lists ``n_workers`` healthy workers."""

    def __init__(self, routing: list[str], n_workers: int) -> None:
        port = free_port()
        self.n_workers = n_workers
        cmd = [sys.executable, "-m", "smg.launch_router", *routing, "--host", "127.0.0.1", "--port", str(port),
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()), *ROUTER_FLAGS]
        super().__init__("smg", cmd, port, 120.0)

    def is_ready(self) -> bool:
        with urllib.request.urlopen(self.base_url + "/workers", timeout=2) as r:
            listed = json.loads(r.read())["workers"]
        return len(listed) == self.n_workers and all(w.get("is_healthy", True) for w in listed)


def config_setup(name: str, args: argparse.Namespace) -> tuple[list[list[str]], Any]:
    """The workers' flags, and a function of their URLs giving smg's routing flags."""
    base = worker_flags(args, args.pool_tokens)
    if name == "colocated":
        return [base, base], lambda urls: ["--worker-urls", *urls, "--policy", "cache_aware"]
    bootstrap = free_port()
    backend = ["--disaggregation-transfer-backend", "nixl" if name == "pd-nixl" else "zmq"]
    flags = [[*base, *backend, "--disaggregation-mode", "prefill", "--disaggregation-bootstrap-port", str(bootstrap)],
             [*base, *backend, "--disaggregation-mode", "decode"]]
    return flags, lambda urls: ["--pd-disaggregation", "--prefill", urls[0], str(bootstrap),
                                "--decode", urls[1], "--policy", "round_robin"]


def run_config(name: str, work: Workload, args: argparse.Namespace) -> dict[str, Any]:
    """Start the config's workers and smg, run the traffic, then the transfer (``pd``) or
    prefill (``colocated``) measurement; stop everything."""
    flag_lists, routing = config_setup(name, args)
    print(f"[{name}] starting 2 workers (1 thread each) and smg ...", flush=True)
    workers: list[Server] = []
    try:
        for flags in flag_lists:
            workers.append(Server(None, flags, 600, env=ONE_CORE))
        urls = [w.base_url for w in workers]
        router = Smg(routing(urls), len(workers))
        try:  # a short completion, then a long prompt (a first long forward costs more)
            for base in (urls if name == "colocated" else [router.base_url]):
                warm(base)
                if not (reply := asyncio.run(sequential(base, [work.warm], 2))[0]).ok:
                    raise RuntimeError(f"[{name}] the warm-up request failed: {reply.error}")
            before = [worker_stats(u) for u in urls]
            print(f"[{name}] traffic: {args.warmup:g} s warm-up + {args.duration:g} s ...", flush=True)
            chats, bursts = asyncio.run(run_traffic(router.base_url, work, args))
            after = [worker_stats(u) for u in urls]
            row = {"config": name, **summarize_traffic(chats, bursts, args),
                   "requests_per_worker": [a["requests_finished"] - b["requests_finished"]
                                           for a, b in zip(after, before, strict=True)]}
            if name.startswith("pd"):
                row["kv"] = kv_moved(before, after)
            print(f"[{name}] {len(work.measure)} sequential {args.measure_len}-token prompts ...", flush=True)
            row["measure"] = measure(name, router.base_url, urls, work.measure)
        finally:
            router.stop()
    finally:
        for w in workers:
            w.stop()
    return row


# ---- what a run measured --------------------------------------------------------------------
def summarize_traffic(chats: list[Reply], bursts: list[list[Reply]], args: argparse.Namespace) -> dict[str, Any]:
    """Chat turns started in the timed window (after the warm-up) and every burst."""
    lo, hi = args.warmup, args.warmup + args.duration
    timed = [r for r in chats if lo <= r.start < hi]
    chat = [r for r in timed if r.ok]
    burst = [r for b in bursts for r in b if r.ok]
    failed = [r.error for r in timed + [r for b in bursts for r in b] if not r.ok]
    # A burst's prefill window: from its first request sent to its last first token.
    windows = [(min(r.start for r in b), max(r.times[0] for r in b if r.ok)) for b in bursts if any(r.ok for r in b)]
    gaps = [(a, b) for r in chat for a, b in pairwise(r.times)]
    under = [b - a for a, b in gaps if any(a < end and b > start for start, end in windows)]
    done = chat + burst
    tokens = sum(r.output_tokens for r in done)
    span = max((r.times[-1] for r in done), default=hi) - lo
    return {"chat_requests": len(chat), "burst_requests": len(burst), "failed": len(failed), "errors": failed[:5],
            "short_outputs": sum(r.output_tokens < r.requested for r in done),
            "chat_prompt_tokens": sum(r.prompt_tokens for r in chat) / len(chat) if chat else None,
            "burst_prompt_tokens": sum(r.prompt_tokens for r in burst) / len(burst) if burst else None,
            "chat_ttft_ms": distribution([r.ttft for r in chat]),
            "chat_itl_ms": distribution([b - a for a, b in gaps]),
            "chat_itl_under_burst_ms": distribution(under), "itl_under_burst_samples": len(under),
            "burst_ttft_ms": distribution([r.ttft for r in burst]),
            "output_tokens": tokens, "output_tokens_per_s": tokens / span if span > 0 else None}


def kv_moved(before: list[dict[str, Any]], after: list[dict[str, Any]]) -> dict[str, Any]:
    """Bytes and ms per transfer, from the (prefill, decode) workers' ``stats.disaggregation``."""
    def delta(i: int, key: str) -> float:
        return after[i]["disaggregation"][key] - before[i]["disaggregation"][key]

    n = delta(1, "transfers")
    parts = {"send_ms": delta(0, "send_s"), "wire_ms": delta(1, "wire_s"), "write_ms": delta(1, "write_s"),
             "wait_ms": delta(1, "wait_s")}
    per = {k: 1000 * v / n if n else None for k, v in parts.items()}
    return {"transfers": n, "failed": delta(0, "failed") + delta(1, "failed"),
            "bytes_per_request": delta(1, "bytes") / n if n else None, **per,
            "transfer_ms_per_request": sum(per[k] for k in ("send_ms", "wire_ms", "write_ms")) if n else None}


def measure(name: str, router: str, urls: list[str], prompts: list[str]) -> dict[str, Any]:
    """``pd``: the prompts through smg (2 output tokens: the decode worker takes one); the KV
    moved per request.  ``colocated``: the prompts straight to the first worker, one output token:
    their TTFT is the prefill time, and so is the worker's step time (one step each)."""
    before = [worker_stats(u) for u in urls]
    base, max_tokens = (router, 2) if name.startswith("pd") else (urls[0], 1)
    replies = asyncio.run(sequential(base, prompts, max_tokens))
    after = [worker_stats(u) for u in urls]
    if failed := [r.error for r in replies if not r.ok]:
        raise RuntimeError(f"[{name}] {len(failed)} measurement requests failed, e.g. {failed[0]}")
    out = {"requests": len(replies), "prompt_tokens": sum(r.prompt_tokens for r in replies) / len(replies),
           "ttft_ms": 1000 * sum(r.ttft for r in replies) / len(replies)}
    if name.startswith("pd"):
        out["kv"] = kv_moved(before, after)
    else:
        out["step_ms"] = 1000 * (after[0]["step_seconds"] - before[0]["step_seconds"]) / len(replies)
    return out


# ---- the report -----------------------------------------------------------------------------
def overhead(rows: list[dict[str, Any]], pd: str = "pd") -> dict[str, Any] | None:
    """The PD pair's (config ``pd``) transfer ms per 1k-token prompt over a colocated worker's
    prefill ms."""
    by = {r["config"]: r["measure"] for r in rows}
    if pd not in by or "colocated" not in by:
        return None
    kv, prefill = by[pd]["kv"], by["colocated"]["ttft_ms"]
    transfer = kv["transfer_ms_per_request"]
    if transfer is None:  # no transfer counted: nothing to compare
        return None
    return {"config": pd, "prompt_tokens": by[pd]["prompt_tokens"], "kv_bytes": kv["bytes_per_request"],
            "transfer_ms": transfer, "send_ms": kv["send_ms"], "wire_ms": kv["wire_ms"], "write_ms": kv["write_ms"],
            "prefill_ms": prefill, "prefill_step_ms": by["colocated"]["step_ms"],
            "share": transfer / prefill}


def checks(rows: list[dict[str, Any]], cost: dict[str, Any] | None, dtype: str) -> list[dict[str, Any]]:
    def ratio(key: str) -> float | None:
        by = {r["config"]: r[key]["p99"] for r in rows}
        return by["colocated"] / by["pd"] if by.get("colocated") and by.get("pd") else None

    # the stream's ITL p99 over the whole run (the measure), and over the gaps a burst's
    # prefill overlapped (where the difference comes from)
    return [target(dtype, "colocated / pd chat ITL p99 (whole run) >=", ratio("chat_itl_ms"), TARGET_ITL_RATIO, True),
            target(dtype, "colocated / pd chat ITL p99 (during bursts) >=", ratio("chat_itl_under_burst_ms"),
                   TARGET_ITL_RATIO, True),
            target(dtype, "transfer / prefill ms of a 1k-token prompt <=", cost and cost["share"],
                   TARGET_TRANSFER_SHARE, False)]


def table(rows: list[dict[str, Any]]) -> str:
    def cell(value: float | None, spec: str = ".0f") -> str:
        return "-" if value is None else format(value, spec)

    lines = [["config", "chats", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "ITL p99 burst",
              "burst TTFT p50", "burst TTFT p99", "tok/s", "KV KiB/req", "xfer ms/req", "failed"]]
    for r in rows:
        chat_ttft, itl, burst, kv = r["chat_ttft_ms"], r["chat_itl_ms"], r["burst_ttft_ms"], r.get("kv") or {}
        kib = kv.get("bytes_per_request") and kv["bytes_per_request"] / 1024
        lines.append([r["config"], str(r["chat_requests"]), cell(chat_ttft["p50"]), cell(chat_ttft["p99"]),
                      cell(itl["p50"], ".1f"), cell(itl["p99"]), cell(r["chat_itl_under_burst_ms"]["p99"]),
                      cell(burst["p50"]), cell(burst["p99"]), cell(r["output_tokens_per_s"]), cell(kib),
                      cell(kv.get("transfer_ms_per_request"), ".1f"), str(r["failed"])])
    return align_columns(lines, left={0})


def overhead_text(cost: dict[str, Any] | None) -> str:
    if cost is None:
        return "Transfer overhead: not measured (it needs a pd config and colocated)"
    return (f"Transfer overhead, {cost['config']} ({cost['prompt_tokens']:.0f}-token prompts, loopback): KV "
            f"{cost['kv_bytes'] / 2**20:.1f} MiB, transfer {cost['transfer_ms']:.1f} ms (send {cost['send_ms']:.1f} "
            f"+ wire {cost['wire_ms']:.1f} + write {cost['write_ms']:.1f}) / prefill {cost['prefill_ms']:.0f} ms "
            f"(TTFT on a colocated worker; its step {cost['prefill_step_ms']:.0f} ms) = {cost['share']:.1%}")


# ---- command line -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="disagg.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    p.add_argument("--configs", default=",".join(CONFIGS), help="pd, colocated, pd-nixl (comma-separated)")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--pool-tokens", type=int, default=16384, help="KV pool per worker")
    p.add_argument("--duration", type=float, default=60.0, help="timed seconds (after --warmup)")
    p.add_argument("--warmup", type=float, default=5.0, help="seconds of the chat stream before the timing")
    p.add_argument("--chat-clients", type=int, default=4)
    p.add_argument("--chat-len", type=int, default=100, help="prompt tokens of a chat turn")
    p.add_argument("--chat-tokens", type=int, default=96, help="output tokens of a chat turn")
    p.add_argument("--chat-turns", type=int, default=40, help="messages per chat client (an upper bound)")
    p.add_argument("--burst-interval", type=float, default=5.0, help="seconds between bursts")
    p.add_argument("--burst-size", type=int, default=3, help="long prompts per burst")
    p.add_argument("--burst-len", type=int, default=1000, help="prompt tokens of a burst's prompt")
    p.add_argument("--burst-tokens", type=int, default=4, help="output tokens of a burst's prompt")
    p.add_argument("--measure", type=int, default=5, help="sequential prompts of the transfer overhead")
    p.add_argument("--measure-len", type=int, default=1024, help="their prompt tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "disagg.json")
    args = p.parse_args(argv)
    args.configs = [x for x in args.configs.split(",") if x]
    if unknown := set(args.configs) - set(CONFIGS):
        p.error(f"unknown config(s) {sorted(unknown)}; choose {', '.join(CONFIGS)}")
    if args.quick:
        args.duration, args.warmup, args.burst_interval = 8.0, 2.0, 3.0
        args.chat_clients, args.chat_len, args.chat_tokens, args.chat_turns = 2, 64, 16, 1000
        args.burst_size, args.burst_len, args.measure, args.measure_len = 1, 256, 2, 256
        args.pool_tokens = 4096
    if args.duration < args.burst_interval:
        p.error("--duration must be at least --burst-interval (one burst)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    args = parse_args(argv)
    started = time.perf_counter()
    work = build_workload(load_tokenizer(args.model or default_model_path()), args)
    rows = [run_config(name, work, args) for name in args.configs]
    cost = overhead(rows)
    nixl_cost = overhead(rows, "pd-nixl")
    found = checks(rows, cost, args.dtype)
    text = (f"PD disaggregation vs colocated, 2 workers x 1 thread behind smg, {args.dtype}: {args.chat_clients} "
            f"chat clients ({args.chat_len} -> {args.chat_tokens} tokens), bursts of {args.burst_size} x "
            f"{args.burst_len} -> {args.burst_tokens} tokens every {args.burst_interval:g} s, {args.duration:g} s "
            f"timed (ms; ITL p99 burst: the gaps overlapping a burst's prefill)\n{table(rows)}\n\n{overhead_text(cost)}"
            + (f"\n{overhead_text(nixl_cost)}" if nixl_cost else ""))
    report = {"benchmark": "disagg", "machine": machine_info(), "params": args_params(args),
              "router_flags": list(ROUTER_FLAGS), "runs": rows, "transfer_overhead": cost, "transfer_overhead_nixl": nixl_cost, "targets": found,
              "wall_s": time.perf_counter() - started}
    print("\n" + text + "\n" + "\n".join(target_lines(found)))
    write_report(report, args.out)
    args.out.with_suffix(".md").write_text(f"```\n{text}\n```\n\n" + "".join(f"- {x}\n" for x in target_lines(found)))
    return report


if __name__ == "__main__":
    try:
        main()
    except (RuntimeError, ValueError) as e:
        sys.exit(f"disagg.py: error: {e}")
