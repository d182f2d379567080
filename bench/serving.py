"""Serving benchmark: an asyncio client for any OpenAI-compatible server.

Sends streaming ``/v1/completions`` requests (token-id prompts; ``--prompt-format text`` for
servers that take only text) and measures what users feel: TTFT, TPOT, ITL and end-to-end
latency (mean, p50, p90, p99), request and token throughput, errors, and the prefix-cache hit
rate, from ``usage.prompt_tokens_details.cached_tokens`` and from the server's Prometheus
counters (``<prefix>:cached_tokens_total`` / ``<prefix>:prompt_tokens_total``) before and after.

Workloads, from real English text and deterministic by ``--seed`` (see bench/workloads.py):
  shared-prefix  G groups x P questions: a system prompt of S tokens, a question of Q tokens,
                 O output tokens; interleaved across groups (SGLang's generated-shared-prefix)
  multi-turn     C conversations x T turns; each turn resends the history (system prompt,
                 earlier questions and the server's answers) plus a new question of Q tokens
  no-reuse       N unique prompts of I tokens (default G*P prompts of S+Q tokens)
  trace          a JSONL file of timed requests (format: bench/workloads.py, load_trace)

Traffic: all at once (default), ``--request-rate`` (Poisson arrivals; for multi-turn, of
conversations), ``--max-concurrency``; ``--warmup`` requests first, then ``/flush_cache``
where the server has it, so the timed run starts with a cold cache.

    radixserve serve &                        # or any OpenAI-compatible server
    python bench/serving.py -G 4 -P 16 -S 1024 -Q 48 -O 32 --out bench/results/serving.json --plot
    radixserve bench serving --workload multi-turn -C 8 -T 4 --max-concurrency 4
    python bench/serving.py --base-url http://127.0.0.1:8000 --tokenizer ./model --no-ignore-eos
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.common import write_report  # noqa: E402
from bench.serving_report import (  # noqa: E402
    arrival_text,
    format_report,
    plot_latencies,
    summarize,
    traffic_text,
    workload_text,
)
from bench.workloads import (  # noqa: E402
    load_trace,
    multi_turn_workload,
    shared_prefix_workload,
    unique_prompts,
)
from radixserve.cli.bench import PROG_ENV  # noqa: E402

WORKLOADS = ("shared-prefix", "multi-turn", "no-reuse", "trace")
# (cached counter, prompt counter) pairs of /metrics: radixserve and SGLang name them alike.
CACHE_COUNTERS = (
    ("radixserve:cached_tokens_total", "radixserve:prompt_tokens_total"),
    ("sglang:cached_tokens_total", "sglang:prompt_tokens_total"),
    ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"),
)
WARMUP_PROMPT_LEN = 16
WARMUP_OUTPUT_LEN = 4


# ---- what to send -------------------------------------------------------------------------
@dataclass
class Job:
    """One request, or a conversation: each of ``followups`` is a later user turn, sent once
    the previous answer is in, with the whole history as its prompt."""

    prompt: list[int]
    output_len: int
    followups: list[list[int]] = field(default_factory=list)
    at: float | None = None  # trace: send time, seconds after the start

    @property
    def num_requests(self) -> int:
        return 1 + len(self.followups)


def build_jobs(args: argparse.Namespace, tokenizer: Any) -> tuple[list[Job], dict[str, Any]]:
    """The workload's jobs in send order, and a description of it for the report."""
    info: dict[str, Any] = {"name": args.workload, "seed": args.seed,
                            "text_source": "Python standard-library docstrings (bench/workloads.py)"}
    if args.workload == "shared-prefix":
        work = shared_prefix_workload(tokenizer, args.groups, args.questions, args.system_len,
                                      args.question_len, args.seed)
        jobs = [Job(p, args.output_len) for p in work.prompts]
        info.update(groups=work.groups, questions=work.questions, system_len=work.system_len,
                    question_len=work.question_len, output_len=args.output_len,
                    unique_prompt_tokens=work.unique_tokens)
    elif args.workload == "multi-turn":
        chats = multi_turn_workload(tokenizer, args.conversations, args.turns, args.system_len,
                                    args.question_len, args.seed)
        jobs = [Job(system + qs[0], args.output_len, followups=qs[1:])
                for system, qs in zip(chats.systems, chats.questions, strict=True)]
        info.update(conversations=chats.conversations, turns=chats.turns,
                    system_len=chats.system_len, question_len=chats.question_len,
                    output_len=args.output_len)
    elif args.workload == "no-reuse":
        count = args.num_prompts or args.groups * args.questions
        length = args.input_len or args.system_len + args.question_len
        jobs = [Job(p, args.output_len) for p in unique_prompts(tokenizer, count, length, args.seed)]
        info.update(num_prompts=count, input_len=length, output_len=args.output_len)
    else:
        unit = {"s": 1.0, "ms": 1e-3}[args.trace_time_unit]
        trace = load_trace(args.trace_file, tokenizer, args.seed, args.trace_block_size, unit)
        jobs = [Job(r.prompt, r.output_len, at=r.at) for r in trace]
        info.update(trace_file=str(args.trace_file), trace_span_s=trace[-1].at,
                    output_tokens=sum(r.output_len for r in trace))
    info["requests"] = sum(j.num_requests for j in jobs)
    info["first_turn_prompt_tokens"] = sum(len(j.prompt) for j in jobs)
    if args.workload == "shared-prefix":
        info["ideal_hit_rate"] = 1 - info["unique_prompt_tokens"] / info["first_turn_prompt_tokens"]
    return jobs, info


def arrival_times(jobs: list[Job], args: argparse.Namespace) -> list[float]:
    """Seconds after the start at which each job begins: the trace's times, Poisson, or 0."""
    if args.workload == "trace":
        return [(j.at or 0.0) / args.trace_speedup for j in jobs]
    if math.isinf(args.request_rate):
        return [0.0] * len(jobs)
    rng, t, times = random.Random(args.seed), 0.0, []
    for _ in jobs:
        times.append(t)
        t += rng.expovariate(args.request_rate)
    return times


# ---- one request ----------------------------------------------------------------------------
@dataclass
class RequestResult:
    job: int
    turn: int
    start: float = 0.0  # seconds after the benchmark start
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0  # the server's count (usage), else the client's
    cached_tokens: int | None = None  # None: the server did not say
    output_tokens: int = 0
    requested_output: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        """Mean time per output token after the first."""
        return (self.latency - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def request_body(args: argparse.Namespace, prompt: list[int] | str, output_len: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": args.model, "prompt": prompt, "max_tokens": output_len,
        "temperature": args.temperature, "stream": True, "stream_options": {"include_usage": True},
    }
    if args.ignore_eos:
        body["ignore_eos"] = True  # exact output lengths (SGLang / vLLM / radixserve extension)
    body.update(args.extra_body)
    return body


async def send(client: Any, body: dict[str, Any], result: RequestResult) -> RequestResult:
    """Stream one completion; fill ``result`` with its timings, usage and text."""
    import httpx

    t0 = time.perf_counter()
    last: float | None = None
    parts: list[str] = []
    chunks, done, finished = 0, False, False
    try:
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:300]
                result.error = f"HTTP {resp.status_code}: {detail}"
                return result
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    done = True
                    break
                obj = json.loads(data)
                if obj.get("error"):
                    result.error = f"stream error: {json.dumps(obj['error'])[:300]}"
                    return result
                now = time.perf_counter()
                choices = obj.get("choices") or []
                text = "".join(c.get("text") or "" for c in choices)
                finished = finished or any(c.get("finish_reason") for c in choices)
                if text or (choices and last is None and finished):
                    if last is None:
                        result.ttft = now - t0
                    else:
                        result.itl.append(now - last)
                    last, chunks = now, chunks + 1
                    parts.append(text)
                usage = obj.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens") or result.prompt_tokens
                    result.output_tokens = usage.get("completion_tokens") or 0
                    details = usage.get("prompt_tokens_details") or {}
                    if details.get("cached_tokens") is not None:
                        result.cached_tokens = int(details["cached_tokens"])
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
        return result
    result.latency = time.perf_counter() - t0
    if not (done or finished):
        result.error = "the stream ended without a finish_reason or [DONE]"
        return result
    result.output_tokens = result.output_tokens or chunks
    result.text = "".join(parts)
    result.ok = True
    return result


# ---- the server's side --------------------------------------------------------------------
def http_client(args: argparse.Namespace) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    return httpx.AsyncClient(
        base_url=args.base_url.rstrip("/"), headers=headers,
        timeout=httpx.Timeout(args.timeout, connect=30.0),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=None),
    )


def parse_prometheus(text: str) -> dict[str, float]:
    """Sample values by metric name, summed over label sets (counters only need that)."""
    values: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_part, _, value = line.rpartition(" ")
        name = name_part.split("{", 1)[0].strip()
        try:
            values[name] = values.get(name, 0.0) + float(value)
        except ValueError:
            continue  # a timestamped or malformed sample: not one of the counters we read
    return values


async def scrape_cache_counters(client: Any) -> dict[str, float] | None:
    """(cached, prompt) token counters from /metrics, or None when the server has none."""
    import httpx

    try:
        resp = await client.get("/metrics")
    except httpx.HTTPError:
        return None
    if resp.status_code != 200:
        return None
    values = parse_prometheus(resp.text)
    for cached, prompt in CACHE_COUNTERS:
        if cached in values and prompt in values:
            return {"cached_metric": cached, "prompt_metric": prompt,
                    "cached_tokens": values[cached], "prompt_tokens": values[prompt]}
    return None


async def flush_cache(client: Any) -> str:
    """POST /flush_cache; what happened, for the report."""
    for _ in range(50):  # 409 while the warm-up's last request is still being retired
        resp = await client.post("/flush_cache")
        if resp.status_code == 200:
            return "flushed"
        if resp.status_code != 409:
            return f"not flushed (HTTP {resp.status_code})"
        await asyncio.sleep(0.1)
    return "not flushed (the server stayed busy)"


async def discover_model(client: Any) -> str:
    """The first model ``/v1/models`` lists."""
    import httpx

    try:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as e:
        raise RuntimeError(f"cannot list the models of {client.base_url} ({e}); "
                           f"is the server up? (or pass --model)") from e


def resolve_tokenizer(args: argparse.Namespace) -> Any:
    """``--tokenizer``; else the path a radixserve server reports, when it exists here; else
    the default model's tokenizer."""
    import os

    import httpx

    from radixserve.tokenizer import load_tokenizer

    path = args.tokenizer
    if path is None:
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        try:
            resp = httpx.get(args.base_url.rstrip("/") + "/server_info", headers=headers, timeout=30)
            if resp.status_code == 200:
                path = resp.json().get("model_info", {}).get("tokenizer_path")
        except httpx.HTTPError:
            path = None
        if path and not os.path.exists(path):
            path = None
    if path is None:
        from radixserve.model.default_model import default_model_path

        path = default_model_path()
    args.tokenizer = path
    return load_tokenizer(path)


# ---- the run ------------------------------------------------------------------------------
async def run_jobs(args: argparse.Namespace, client: Any, jobs: list[Job],
                   tokenizer: Any) -> tuple[list[RequestResult], float]:
    """Send every job per the traffic settings; (results in completion order, duration)."""
    from tqdm import tqdm

    limit = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
    arrivals = arrival_times(jobs, args)
    results: list[RequestResult] = []
    bar = tqdm(total=sum(j.num_requests for j in jobs), unit="req", desc=args.workload,
               disable=args.disable_tqdm)
    start = time.perf_counter()

    def as_prompt(ids: list[int]) -> list[int] | str:
        return ids if args.prompt_format == "ids" else tokenizer.decode(ids)

    async def conversation(i: int, job: Job) -> None:
        await asyncio.sleep(max(0.0, arrivals[i] - (time.perf_counter() - start)))
        ids = job.prompt
        for turn in range(job.num_requests):
            result = RequestResult(job=i, turn=turn, prompt_tokens=len(ids),
                                   requested_output=job.output_len)
            async with limit or contextlib.nullcontext():
                result.start = time.perf_counter() - start
                await send(client, request_body(args, as_prompt(ids), job.output_len), result)
            results.append(result)
            bar.update(1)
            if not result.ok:  # the history is broken: the rest of the conversation fails too
                for later in range(turn + 1, job.num_requests):
                    results.append(RequestResult(job=i, turn=later, error=f"turn {turn} failed"))
                    bar.update(1)
                return
            if turn + 1 < job.num_requests:
                answer = tokenizer.encode(result.text, add_special_tokens=False)
                ids = ids + answer + job.followups[turn]

    try:
        await asyncio.gather(*(conversation(i, j) for i, j in enumerate(jobs)))
    finally:
        bar.close()
    return results, time.perf_counter() - start


async def warm_up(args: argparse.Namespace, client: Any, tokenizer: Any) -> None:
    if args.warmup < 1:
        return
    prompts = unique_prompts(tokenizer, args.warmup, WARMUP_PROMPT_LEN, args.seed + 777)
    results = await asyncio.gather(*(
        send(client, request_body(args, p if args.prompt_format == "ids" else tokenizer.decode(p),
                                  WARMUP_OUTPUT_LEN), RequestResult(job=-1, turn=0))
        for p in prompts
    ))
    failed = [r.error for r in results if not r.ok]
    if failed:
        raise RuntimeError(f"the warm-up failed ({len(failed)} of {len(results)}): {failed[0]}")


async def run_async(args: argparse.Namespace, jobs: list[Job],
                    tokenizer: Any) -> tuple[dict[str, Any], list[RequestResult]]:
    async with http_client(args) as client:
        if args.model is None:
            args.model = await discover_model(client)
        await warm_up(args, client, tokenizer)
        flushed = await flush_cache(client) if args.flush_cache else "not asked"
        before = await scrape_cache_counters(client)
        results, duration = await run_jobs(args, client, jobs, tokenizer)
        after = await scrape_cache_counters(client)
    server: dict[str, Any] = {"flush_cache": flushed, "metrics_before": before, "metrics_after": after}
    if before and after:
        cached = after["cached_tokens"] - before["cached_tokens"]
        prompt = after["prompt_tokens"] - before["prompt_tokens"]
        server.update(cached_tokens=cached, prompt_tokens=prompt,
                      hit_rate=cached / prompt if prompt else None)
    return {"duration_s": duration, "server": server}, results


# ---- metrics and report -------------------------------------------------------------------
def run_benchmark(args: argparse.Namespace, jobs: list[Job], workload: dict[str, Any],
                  tokenizer: Any) -> tuple[dict[str, Any], list[RequestResult]]:
    """One timed run against ``args.base_url``; the report (as written to JSON) and results."""
    run, results = asyncio.run(run_async(args, jobs, tokenizer))
    results.sort(key=lambda r: (r.job, r.turn))
    params = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    params["request_rate"] = None if math.isinf(args.request_rate) else args.request_rate
    params.pop("api_key", None)
    report = {
        "benchmark": "serving",
        "base_url": args.base_url,
        "model": args.model,
        "tokenizer": args.tokenizer,
        "traffic": traffic_text(args),
        "arrivals": arrival_text(args),
        "params": params,
        "workload": workload,
        "summary": summarize(results, run["duration_s"], run["server"]),
        "server": run["server"],
        "requests": [
            {k: v for k, v in asdict(r).items() if k not in ("itl", "text")} | {"tpot": r.tpot}
            for r in results
        ],
    }
    return report, results


# ---- command line -------------------------------------------------------------------------
def build_parser(prog: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="server address (default: %(default)s)")
    p.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    p.add_argument("--model", default=None, help="model name to request (default: the server's first)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder for building prompts (default: the one a radixserve server "
                        "reports, else the default model's)")
    p.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    p.add_argument("--seed", type=int, default=0, help="seeds the text and the arrival times")
    w = p.add_argument_group("workload sizes (tokens)")
    w.add_argument("--groups", "-G", type=int, default=4, help="shared-prefix: system prompts")
    w.add_argument("--questions", "-P", type=int, default=16, help="shared-prefix: questions per group")
    w.add_argument("--system-len", "-S", type=int, default=1024, help="system prompt tokens")
    w.add_argument("--question-len", "-Q", type=int, default=48, help="question (user turn) tokens")
    w.add_argument("--output-len", "-O", type=int, default=32, help="output tokens per request")
    w.add_argument("--conversations", "-C", type=int, default=8, help="multi-turn: conversations")
    w.add_argument("--turns", "-T", type=int, default=4, help="multi-turn: turns per conversation")
    w.add_argument("--num-prompts", "-N", type=int, default=None, help="no-reuse: prompts (default G*P)")
    w.add_argument("--input-len", "-I", type=int, default=None, help="no-reuse: prompt tokens (default S+Q)")
    w.add_argument("--trace-file", type=Path, default=None, help="trace: JSONL of timed requests")
    w.add_argument("--trace-time-unit", choices=("s", "ms"), default="s", help="unit of the trace's timestamps")
    w.add_argument("--trace-speedup", type=float, default=1.0, help="replay the trace this many times faster")
    w.add_argument("--trace-block-size", type=int, default=512, help="tokens per trace hash_id block")
    t = p.add_argument_group("traffic")
    t.add_argument("--request-rate", type=float, default=math.inf,
                   help="Poisson arrivals per second (default: all at once)")
    t.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight")
    t.add_argument("--warmup", type=int, default=1, help="untimed requests first (default: %(default)s)")
    t.add_argument("--flush-cache", action=argparse.BooleanOptionalAction, default=True,
                   help="POST /flush_cache after the warm-up (servers without it are left as they are)")
    t.add_argument("--timeout", type=float, default=3600.0, help="seconds one request may take")
    r = p.add_argument_group("requests")
    r.add_argument("--prompt-format", choices=("ids", "text"), default="ids",
                   help="send token ids (exact lengths) or the decoded text")
    r.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so outputs have exactly O tokens (--no-ignore-eos for "
                        "servers that reject it)")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into each request")
    o = p.add_argument_group("output")
    o.add_argument("--out", type=Path, default=None, help="write the JSON report here")
    o.add_argument("--plot", nargs="?", const="auto", default=None, metavar="PNG",
                   help="latency histograms (default file: --out with .png, else serving.png)")
    o.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    return p


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> argparse.Namespace:
    p = build_parser(prog)
    args = p.parse_args(argv)
    for name in ("groups", "questions", "system_len", "question_len", "output_len",
                 "conversations", "turns", "num_prompts", "input_len", "max_concurrency",
                 "trace_block_size"):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.warmup < 0 or args.request_rate <= 0 or args.trace_speedup <= 0 or args.timeout <= 0:
        p.error("--warmup must be >= 0; --request-rate, --trace-speedup and --timeout > 0")
    if args.workload == "trace" and args.trace_file is None:
        p.error("--workload trace needs --trace-file")
    if not isinstance(args.extra_body, dict):
        p.error("--extra-body must be a JSON object")
    return args


def plot_path(args: argparse.Namespace) -> Path | None:
    if args.plot is None:
        return None
    if args.plot != "auto":
        return Path(args.plot)
    return args.out.with_suffix(".png") if args.out else Path("serving.png")


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    args = parse_args(argv, prog)
    tokenizer = resolve_tokenizer(args)
    jobs, workload = build_jobs(args, tokenizer)
    print(f"{workload['name']}: {workload['requests']} requests to {args.base_url} "
          f"({traffic_text(args)}), tokenizer {args.tokenizer}", flush=True)
    report, results = run_benchmark(args, jobs, workload, tokenizer)
    print(format_report(report))
    if args.out:
        write_report(report, args.out)
    png = plot_path(args)
    if png:
        plot_latencies(results, f"{workload_text(workload)}; {report['traffic']}", png)
        print(f"wrote {png}")
    return report


if __name__ == "__main__":
    PROG = os.environ.get(PROG_ENV)  # set by ``radixserve bench``
    try:
        sys.exit(0 if main(prog=PROG)["summary"]["completed"] else 1)
    except (RuntimeError, ValueError) as e:  # server unreachable, corpus too small, bad trace
        sys.exit(f"{PROG or 'serving.py'}: error: {e}")
