"""Scale-out on one machine: radixserve workers behind a router (smg, or its predecessor
sglang-router with ``--router sglang-router``), and tensor parallelism.

Routing (one run per configuration, same workload, every worker's cache flushed first): the
shared-prefix workload with many groups (bench/workloads.py: interleaved, g0q0 g1q0 ... g0q1 ...;
an odd number of groups, so that round-robin does not pin each group to one worker by
accident), each worker's KV pool holding a little more than half of the groups' system
prompts, so where a request lands decides whether its prefix is cached:
- ``cache_aware``: 2 workers (1 thread each) behind the router with its cache-aware
  policy (it keeps an approximate prefix tree of what it sent where);
- ``cache_aware+events``: the same workers as smg's ``grpc://`` workers (``--grpc-port``),
  their KV events (``--kv-events-config``) feeding smg's event-driven index: routing on what
  each worker's cache really holds instead of smg's approximate tree;
- ``sglang-router/cache_aware``: the same workers behind sglang-router's approximate tree;
- ``round_robin``: the same workers, the router alternating;
- ``direct``: the same workers, no router, the client sends group g to worker g % 2 (perfect
  affinity, what the router's cost is measured against);
- ``single``: one worker with 2 threads and both workers' pool.
It reports the hit rate (cached / prompt tokens, from each response's usage), wall time,
throughput and TTFT p50/p99 (streamed ``/v1/completions``).

Tensor parallelism (offline ``Engine``): TP=2 (1 thread per rank) against TP=1 (2 threads):
prefill tokens/s (unique prompts, one output token) and decode tokens/s (the time
of the decode-only steps of a batch decoding D tokens, from the scheduler's counters).

    python bench/cluster.py                       # both parts, bfloat16 (+ float32 for TP)
    python bench/cluster.py --parts routing --groups 8 --questions 16
    python bench/cluster.py --quick --model ./tiny   # a smoke run
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

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
from bench.serving import RequestResult, send  # noqa: E402
from bench.serving_report import summarize  # noqa: E402
from bench.workloads import shared_prefix_workload, unique_prompts  # noqa: E402

TARGET_HIT_RATE = 0.85  # cache_aware through the router
TARGET_HIT_VS_ROUND_ROBIN = 1.5  # cache_aware hit rate / round_robin hit rate
TARGET_HIT_VS_SINGLE = 0.05  # |cache_aware - one worker| hit rate
TARGET_ROUTER_COST = 0.95  # cache_aware throughput / direct throughput
ROUTER_FLAGS = ["--disable-circuit-breaker", "--log-level", "warn"]
# smg's settings for both of its cache_aware runs: no warm-up slice diverting hits to idle
# workers (it spreads load on purpose, at the cost of hits, in a worker's first minute), and no
# spill to the least loaded worker (a relative threshold it never reaches): the groups spread
# the load evenly by construction, and a spill copies a group's prefix onto the other worker,
# whose pool holds only half of the groups.  Measured with the spill at smg's default: the
# event-driven run at 88.0% and 54.8% hit rate in two runs, the approximate one 23.7%, 18.9%.
# Nor is a worker left out of routing as "overloaded" (smg's defaults: 80% KV token usage, 8
# queued requests): these pools are small on purpose (half of the groups), so 8 requests in
# flight on one worker fill 80% of it without any overload, and each such veto copies a group.
SMG_FLAGS = ("--worker-warmup-secs", "0", "--worker-warmup-divert-every", "0", "--worker-warmup-thin-ratio", "0",
             "--balance-rel-threshold", "100", "--worker-overload-token-usage", "1.0",
             "--worker-overload-waiting-requests", "1000")
# And for its event-driven run: a request is booked on the worker chosen for it until that
# worker's KV events report it (they follow a prefill by a step), so that the next request of
# its group goes there too (smg's advice: a little above the events' lag).
EVENTS_FLAGS = ("--selection-accounting-ttl-ms", "3000")


ROUTERS = {"smg": "smg.launch_router", "sglang-router": "sglang_router.launch_router"}


class Router(Launched):
    """The router (``ROUTERS``) in front of ``workers``; ready once it lists all of them healthy."""

    def __init__(self, workers: list[str], policy: str, router: str = "smg", startup_timeout: float = 120.0,
                 extra: tuple[str, ...] = ()) -> None:
        port = free_port()
        self.workers = workers
        cmd = [sys.executable, "-m", ROUTERS[router], "--host", "127.0.0.1",
               "--port", str(port), "--policy", policy, "--worker-urls", *workers, *ROUTER_FLAGS,
               "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
               *(SMG_FLAGS if router == "smg" else ()), *extra]
        super().__init__(f"router-{policy}", cmd, port, startup_timeout)

    def is_ready(self) -> bool:
        with urllib.request.urlopen(self.base_url + "/workers", timeout=2) as r:
            listed = json.loads(r.read())["workers"]
        return len(listed) == len(self.workers) and all(w.get("is_healthy", True) for w in listed)


# ---- routing ------------------------------------------------------------------------------
async def run_requests(bases: list[str], route: list[int], prompts: list[str], output_len: int,
                       concurrency: int) -> tuple[list[RequestResult], float]:
    """Stream every prompt (request i to ``bases[route[i]]``), ``concurrency`` at a time.
    Prompts are text: the router takes no token ids on ``/v1/completions``."""
    import httpx

    limit = asyncio.Semaphore(concurrency)
    timeout = httpx.Timeout(600.0, connect=30.0)
    clients = [httpx.AsyncClient(base_url=b, timeout=timeout) for b in bases]
    start = time.perf_counter()

    async def one(i: int) -> RequestResult:
        body = {"model": SERVED_MODEL, "prompt": prompts[i], "max_tokens": output_len, "temperature": 0,
                "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
        result = RequestResult(job=i, turn=0, requested_output=output_len)
        async with limit:
            result.start = time.perf_counter() - start
            return await send(clients[route[i]], body, result)

    try:
        results = await asyncio.gather(*(one(i) for i in range(len(prompts))))
    finally:
        for c in clients:
            await c.aclose()
    return list(results), time.perf_counter() - start


def post(url: str) -> None:
    req = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        r.read()


def warm(base: str) -> None:
    """One short request, so a run does not pay a worker's first forward."""
    body = json.dumps({"model": SERVED_MODEL, "prompt": "Hello", "max_tokens": 2}).encode()
    req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()


def worker_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url + "/server_info", timeout=60) as r:
        return json.loads(r.read())["stats"]


def measure(label: str, bases: list[str], route: list[int], workers: list[str], prompts: list[str],
            args: argparse.Namespace) -> dict[str, Any]:
    """One timed run, and what each worker saw of it: requests, hit rate, evicted tokens."""
    for w in workers:
        post(w + "/flush_cache")
    before = [worker_stats(w) for w in workers]
    print(f"[{label}] {len(prompts)} requests ...", flush=True)
    results, duration = asyncio.run(run_requests(bases, route, prompts, args.output_len, args.concurrency))
    summary = summarize(results, duration, {})
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"[{label}] {len(failed)} requests failed, e.g. {failed[0]}")
    per_worker = []
    for w, b in zip(workers, before, strict=True):
        a = worker_stats(w)
        prompt = a["prompt_tokens"] - b["prompt_tokens"]
        cached = a["cached_tokens"] - b["cached_tokens"]
        per_worker.append({"url": w, "requests": a["requests_finished"] - b["requests_finished"],
                           "prompt_tokens": prompt, "cached_tokens": cached,
                           "hit_rate": cached / prompt if prompt else None,
                           "evicted_tokens": a["evicted_tokens"] - b["evicted_tokens"]})
    print(f"[{label}] hit rate {summary['cache_hit_rate']:.1%}, {duration:.1f} s; per worker "
          + ", ".join(f"{p['requests']} requests at {p['hit_rate'] or 0:.1%}" for p in per_worker), flush=True)
    return {"config": label, "summary": summary, "workers": per_worker}


SERVED_MODEL = "default"  # the workers' model name, which smg routes by


def events_flags(grpc_port: int) -> list[str]:
    """SGLang's gRPC service and KV events on a worker (what ``cache_aware+events`` reads)."""
    events = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{free_port()}", "bind": True,
              "replay_endpoint": f"tcp://127.0.0.1:{free_port()}"}
    return ["--grpc-port", str(grpc_port), "--kv-events-config", json.dumps(events)]


def worker_flags(args: argparse.Namespace, pool_tokens: int) -> list[str]:
    return ["--dtype", args.dtype, "--max-total-tokens", str(pool_tokens), "--log-level", "warning",
            "--served-model-name", SERVED_MODEL,
            *(["--model", args.model] if args.model else [])]


def run_routing(args: argparse.Namespace, tokenizer: Any) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    work = shared_prefix_workload(tokenizer, args.groups, args.questions, args.system_len,
                                  args.question_len, args.seed)
    info = {"groups": work.groups, "questions": work.questions, "system_len": work.system_len,
            "question_len": work.question_len, "output_len": args.output_len,
            "requests": work.num_requests, "concurrency": args.concurrency,
            "ideal_hit_rate": 1 - work.unique_tokens / work.prompt_tokens,
            "pool_tokens_per_worker": args.pool_tokens, "router": args.router}
    if args.groups % 2 == 0:
        raise ValueError("--groups must be odd: in the interleaved order an even number of groups "
                         "gives each of 2 round-robin workers a fixed half of them")
    prompts = [tokenizer.decode(p) for p in work.prompts]
    rows = []
    print("starting 2 workers (1 thread each) ...", flush=True)
    grpc_ports = [free_port() for _ in range(2)]
    workers = [Server(None, worker_flags(args, args.pool_tokens) + events_flags(port), 600,
                      env={"OMP_NUM_THREADS": "1"}) for port in grpc_ports]
    try:
        urls = [w.base_url for w in workers]
        for url in urls:
            warm(url)
        for config in args.policies:  # "[router/]policy"
            name, _, policy = config.rpartition("/")
            if policy == "cache_aware+events":  # smg reads the workers' KV events over gRPC
                from radixserve.model.default_model import default_model_path

                router = Router([f"grpc://127.0.0.1:{p}" for p in grpc_ports], "cache_aware", "smg",
                                extra=("--model-path", args.model or default_model_path(), *EVENTS_FLAGS))
            else:
                router = Router(urls, policy, name or args.router)
            try:
                rows.append(measure(config, [router.base_url], [0] * work.num_requests, urls, prompts, args))
            finally:
                router.stop()
        rows.append(measure("direct", urls, [g % 2 for g in work.group_of], urls, prompts, args))
    finally:
        for w in workers:
            w.stop()
    print("starting 1 worker (2 threads) ...", flush=True)
    single = Server(None, worker_flags(args, 2 * args.pool_tokens), 600, env={"OMP_NUM_THREADS": "2"})
    try:
        warm(single.base_url)
        rows.append(measure("single", [single.base_url], [0] * work.num_requests, [single.base_url], prompts,
                            args))
    finally:
        single.stop()
    return rows, info


def routing_checks(rows: list[dict[str, Any]], dtype: str) -> list[dict[str, Any]]:
    by = {r["config"]: r["summary"] for r in rows}
    checks = []
    if "cache_aware" in by:
        hit = by["cache_aware"]["cache_hit_rate"]
        checks.append(target(dtype, "cache_aware hit rate >=", hit, TARGET_HIT_RATE, True))
        if "round_robin" in by:
            rr = by["round_robin"]["cache_hit_rate"]
            checks.append(target(dtype, "cache_aware / round_robin hit rate >=", hit / rr if rr else None,
                                 TARGET_HIT_VS_ROUND_ROBIN, True))
        if "single" in by:
            checks.append(target(dtype, "|cache_aware - single worker| hit rate <=",
                                 abs(hit - by["single"]["cache_hit_rate"]), TARGET_HIT_VS_SINGLE, False))
        if "direct" in by:
            checks.append(target(dtype, "router / direct throughput >=",
                                 by["cache_aware"]["total_throughput"] / by["direct"]["total_throughput"],
                                 TARGET_ROUTER_COST, True))
        if "cache_aware+events" in by:  # the bar: events never route worse than the guess
            checks.append(target(dtype, "cache_aware+events - cache_aware hit rate >=",
                                 by["cache_aware+events"]["cache_hit_rate"] - hit, 0.0, True))
    return checks


def routing_table(rows: list[dict[str, Any]]) -> str:
    lines = [["config", "hit rate", "wall s", "tok/s", "TTFT p50 ms", "TTFT p99 ms"]]
    for r in rows:
        s = r["summary"]
        lines.append([r["config"], f"{s['cache_hit_rate']:.1%}", f"{s['duration_s']:.1f}",
                      f"{s['total_throughput']:.0f}", f"{s['ttft_ms']['p50']:.0f}", f"{s['ttft_ms']['p99']:.0f}"])
    return align_columns(lines, left={0})


# ---- tensor parallelism ---------------------------------------------------------------------
def timed(engine: Any, prompts: list[list[int]], new_tokens: int) -> tuple[float, dict[str, Any]]:
    """Wall seconds of one cold batch, and the scheduler's counters over it."""
    engine.flush_cache()
    before = engine.get_stats()
    t0 = time.perf_counter()
    engine.generate(input_ids=prompts, sampling_params={"temperature": 0, "ignore_eos": True,
                                                        "max_new_tokens": new_tokens}, progress=False)
    wall = time.perf_counter() - t0
    after = engine.get_stats()
    return wall, {k: after[k] - before[k] for k in ("decode_only_seconds", "decode_only_tokens")}


def run_tp(args: argparse.Namespace, tokenizer: Any) -> list[dict[str, Any]]:
    from radixserve import Engine

    prefill = unique_prompts(tokenizer, args.prefill_prompts, args.prefill_len, args.seed + 1)
    batch = unique_prompts(tokenizer, args.decode_batch, 32, args.seed + 2)
    rows = []
    for dtype in args.tp_dtypes:
        for tp in (1, 2):
            label = f"TP={tp} ({'2 threads' if tp == 1 else '1 thread per rank'})"
            print(f"[{dtype} {label}] ...", flush=True)
            with Engine(args.model, dtype=dtype, tp_size=tp, max_total_tokens=args.tp_pool_tokens,
                        log_level="warning") as eng:
                timed(eng, batch[:2], 2)  # warm
                prefill_s, _ = timed(eng, prefill, 1)
                # Decode speed: the decode-only steps' own time (scheduler counters), so
                # that the batch's prefill is not counted.
                _, decode = timed(eng, batch, 1 + args.decode_len)
            decode_s = decode["decode_only_seconds"]
            rows.append({"dtype": dtype, "tp": tp, "config": label,
                         "prefill_tokens_per_s": len(prefill) * args.prefill_len / prefill_s,
                         "decode_tokens_per_s": decode["decode_only_tokens"] / decode_s,
                         "prefill_s": prefill_s, "decode_s": decode_s})
            print(f"[{dtype} {label}] prefill {rows[-1]['prefill_tokens_per_s']:.0f} tok/s, "
                  f"decode {rows[-1]['decode_tokens_per_s']:.0f} tok/s", flush=True)
    return rows


def tp_table(rows: list[dict[str, Any]]) -> str:
    lines = [["dtype", "config", "prefill tok/s", "decode tok/s"]]
    for r in rows:
        lines.append([r["dtype"], r["config"], f"{r['prefill_tokens_per_s']:.0f}", f"{r['decode_tokens_per_s']:.0f}"])
    return align_columns(lines, left={0, 1})


# ---- command line -----------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="cluster.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="model folder (default: the embedded default model)")
    p.add_argument("--parts", default="routing,tp", help="routing, tp or both (comma-separated)")
    p.add_argument("--dtype", default="bfloat16", help="the routing workers' dtype")
    p.add_argument("--router", choices=sorted(ROUTERS), default="smg", help="the router in front of the workers")
    p.add_argument("--policies", default="cache_aware,cache_aware+events,sglang-router/cache_aware,round_robin",
                   help="[router/]policy runs (the router: --router's by default; cache_aware+events: smg over "
                        "gRPC with the workers' KV events)")
    p.add_argument("--groups", type=int, default=15, help="odd")
    p.add_argument("--questions", type=int, default=16, help="per group")
    p.add_argument("--system-len", type=int, default=384)
    p.add_argument("--question-len", type=int, default=16)
    p.add_argument("--output-len", type=int, default=16)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--pool-tokens", type=int, default=4000,
                   help="KV pool per worker (the single worker gets twice this)")
    p.add_argument("--tp-dtypes", default="bfloat16,float32")
    p.add_argument("--prefill-prompts", type=int, default=8)
    p.add_argument("--prefill-len", type=int, default=512)
    p.add_argument("--decode-batch", type=int, default=16)
    p.add_argument("--decode-len", type=int, default=64)
    p.add_argument("--tp-pool-tokens", type=int, default=16384)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "cluster.json")
    args = p.parse_args(argv)
    args.parts = [x for x in args.parts.split(",") if x]
    args.policies = [x for x in args.policies.split(",") if x]
    args.tp_dtypes = [x for x in args.tp_dtypes.split(",") if x]
    if unknown := set(args.parts) - {"routing", "tp"}:
        p.error(f"unknown part(s) {sorted(unknown)}; choose routing, tp")
    if args.quick:
        args.groups, args.questions, args.system_len, args.question_len = 5, 3, 96, 8
        args.output_len, args.concurrency, args.pool_tokens = 4, 4, 400
        args.prefill_prompts, args.prefill_len, args.decode_batch, args.decode_len = 2, 64, 4, 8
        args.tp_pool_tokens = 2048
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    args = parse_args(argv)
    tokenizer = load_tokenizer(args.model or default_model_path())
    report: dict[str, Any] = {"benchmark": "cluster", "machine": machine_info(), "params": args_params(args)}
    checks: list[dict[str, Any]] = []
    text = []
    if "routing" in args.parts:
        rows, info = run_routing(args, tokenizer)
        report["routing"] = {"workload": info, "runs": rows}
        checks += routing_checks(rows, args.dtype)
        text.append(f"Routing: {info['groups']} groups x {info['questions']} questions, system "
                    f"{info['system_len']} + question {info['question_len']} tokens, {info['output_len']} "
                    f"out, concurrency {info['concurrency']}, {info['pool_tokens_per_worker']} KV tokens "
                    f"per worker, {args.dtype}, router {info['router']} (ideal hit rate {info['ideal_hit_rate']:.1%})\n"
                    + routing_table(rows))
    if "tp" in args.parts:
        rows = run_tp(args, tokenizer)
        report["tensor_parallel"] = {"runs": rows, "prefill": [args.prefill_prompts, args.prefill_len],
                                     "decode": [args.decode_batch, args.decode_len]}
        text.append(f"Tensor parallelism: prefill {args.prefill_prompts} x {args.prefill_len} tokens, "
                    f"decode {args.decode_batch} requests x {args.decode_len} tokens\n" + tp_table(rows))
    report["targets"] = checks
    print()
    print("\n\n".join(text))
    for line in target_lines(checks):
        print(line)
    write_report(report, args.out)
    args.out.with_suffix(".md").write_text("\n\n".join(f"```\n{t}\n```" for t in text) + "\n\n"
                                           + "".join(f"- {line}\n" for line in target_lines(checks)))
    return report


if __name__ == "__main__":
    try:
        main()
    except (RuntimeError, ValueError) as e:
        sys.exit(f"cluster.py: error: {e}")
