"""Soak test: a real server with a small KV pool under a mixed, misbehaving load for minutes.

It starts ``radixserve serve`` itself with a KV pool small enough that eviction and retraction
happen all the time, then runs ``--concurrency`` clients (asyncio + httpx) until the time is up.
Each client picks a scenario at random (weights in ``SCENARIOS``): streaming and non-streaming
chat, ``n > 1``, clients that disconnect mid-prefill and mid-decode, ``/abort_request`` storms,
the same rid twice at once (one must get a 400 while the other completes), bad requests
(a 4xx with an OpenAI error body), ``/flush_cache`` (200 or 409), and slow readers (small
receive window, long pauses; the stream ends normally or with an error event when the server
cuts it off).  Every outcome is classified: ``ok``, an expected ``error`` (4xx, 409, a cut-off
stream), ``gone`` (the client left on purpose), ``unexpected`` (a clean answer the scenario
did not expect) or ``lost`` (no answer, hung past ``--timeout``, a 5xx, a broken stream).

Then it checks, printing PASS/FAIL per check: no request lost; no unexpected answer; once idle,
the KV memory invariant holds with no page held by a request and no lock left; the RSS of the
server, scheduler and detokenizer processes grew at most 5% after warm-up (warm-up: the first
20% of the run; the median of the samples in [20%, 30%) of the run against the median of the
last 10%); the p99 TTFT of normal streaming requests in the last quarter of the run is at most
1.5x that of the second quarter; eviction and retraction both happened; the server exits 0 on
SIGTERM.  Writes JSON (``--out``).

    python bench/soak.py                              # 10 minutes, the default model
    python bench/soak.py --minutes 2 --model tiny     # tiny random model, default tokenizer
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import signal
import socket
import statistics
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson
import psutil

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.common import align_columns, args_params, machine_info, write_report  # noqa: E402

RSS_GROWTH_LIMIT = 0.05
TTFT_RATIO_LIMIT = 1.5
SYSTEMS = [f"You are assistant number {i}. " + "Answer briefly, politely and precisely. " * (2 + i)
           for i in range(6)]
WORDS = "river mountain city train coffee music garden winter planet history robot ocean".split()
MSG = [{"role": "user", "content": "hi"}]
BAD_REQUESTS = [  # (route, body or raw bytes)
    ("/v1/chat/completions", b'{"model": "m", "messages": ['),
    ("/v1/chat/completions", {"model": "no-such-model", "messages": MSG}),
    ("/v1/chat/completions", {"messages": MSG, "max_tokens": -1}),
    ("/v1/chat/completions", {"messages": MSG, "temperature": -1}),
    ("/v1/chat/completions", {"messages": []}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 5000}]}),
    ("/v1/completions", {"prompt": [1, 2, 10**8]}),
    ("/generate", {"sampling_params": {}}),
]


@dataclass
class Outcome:
    kind: str
    start: float  # seconds since the load began
    seconds: float
    verdict: str  # ok | error | gone | unexpected | lost
    detail: str = ""
    ttft: float | None = None


class Lost(Exception):
    """The request got no clean answer."""


class Unexpected(Exception):
    """A clean answer the scenario did not expect."""


def classify_status(status: int, body: bytes, expected: tuple[int, ...] = (200,)) -> None:
    if status >= 500:
        raise Lost(f"HTTP {status}: {body[:200]!r}")
    if status not in expected:
        raise Unexpected(f"HTTP {status}: {body[:200]!r}")
    if status >= 400:
        err = orjson.loads(body).get("error") if body[:1] == b"{" else None
        if not (isinstance(err, dict) and err.get("message")):
            raise Unexpected(f"HTTP {status} without an OpenAI error body: {body[:200]!r}")


# ---------------------------------------------------------------- scenarios


class Load:
    def __init__(self, args: argparse.Namespace, base_url: str, t0: float) -> None:
        self.args, self.base_url, self.t0 = args, base_url, t0
        self.rng = random.Random(args.seed)
        self.client = httpx.AsyncClient(base_url=base_url, timeout=httpx.Timeout(args.timeout, connect=30),
                                        limits=httpx.Limits(max_connections=None))
        self.outcomes: list[Outcome] = []
        self.counter = 0

    def messages(self, long: bool = False) -> list[dict[str, str]]:
        words = self.rng.choices(WORDS, k=self.rng.randint(20, 60) if long else self.rng.randint(3, 15))
        return [{"role": "system", "content": self.rng.choice(SYSTEMS)},
                {"role": "user", "content": "Tell me about " + " ".join(words)}]

    def chat_body(self, **extra: Any) -> dict[str, Any]:
        """Half of the requests run to their max tokens, so the KV pool stays under pressure."""
        return {"messages": self.messages(), "max_tokens": self.rng.randint(8, self.args.max_tokens),
                "temperature": 0.8, "ignore_eos": self.rng.random() < 0.5, **extra}

    def rid(self) -> str:
        self.counter += 1
        return f"soak-{self.counter}"

    async def sse(self, route: str, body: dict[str, Any], stop_after: int | None = None,
                  pause: float = 0.0, client: httpx.AsyncClient | None = None,
                  on_event: Any = None) -> dict[str, Any]:
        """Stream ``body``; returns ``ttft``, ``events``, ``error`` (an error event), ``done``."""
        t0 = time.monotonic()
        out: dict[str, Any] = {"ttft": None, "events": 0, "error": None, "done": False, "finish": set()}
        async with (client or self.client).stream("POST", route, json={**body, "stream": True}) as r:
            if r.status_code != 200:
                out["status"], out["body"] = r.status_code, await r.aread()
                return out
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    out["done"] = True
                    break
                event = orjson.loads(line[6:])
                if out["ttft"] is None:
                    out["ttft"] = time.monotonic() - t0
                if "error" in event:
                    out["error"] = event["error"]
                    continue
                out["events"] += 1
                if on_event is not None:
                    on_event()
                for c in event.get("choices") or []:
                    if c.get("finish_reason"):
                        out["finish"].add(c.get("index", 0))
                if "meta_info" in event and event["meta_info"].get("finish_reason"):
                    out["finish"].add(0)
                if stop_after is not None and out["events"] >= stop_after:
                    break  # leaving the block closes the connection mid-stream
                if pause:
                    await asyncio.sleep(pause)
        out["status"] = 200
        return out

    @staticmethod
    def check_stream(out: dict[str, Any], choices: int = 1) -> None:
        if out["status"] != 200:
            classify_status(out["status"], out["body"])
        if out["error"] is not None:
            code = out["error"].get("code")
            if isinstance(code, int) and code >= 500:
                raise Lost(f"error event: {out['error']}")
            raise Unexpected(f"error event: {out['error']}")
        if not out["done"] or len(out["finish"]) != choices:
            raise Lost(f"stream ended without [DONE] or a finish_reason per choice: {out}")

    # Each scenario returns (verdict, detail, ttft) or raises Lost / Unexpected.
    async def chat_stream(self) -> tuple[str, str, float | None]:
        out = await self.sse("/v1/chat/completions", self.chat_body())
        self.check_stream(out)
        return "ok", "", out["ttft"]

    async def chat(self) -> tuple[str, str, float | None]:
        r = await self.client.post("/v1/chat/completions", json=self.chat_body())
        classify_status(r.status_code, r.content)
        if r.json()["choices"][0]["finish_reason"] not in ("stop", "length"):
            raise Unexpected(f"finish_reason {r.json()['choices'][0]['finish_reason']}")
        return "ok", "", None

    async def chat_n(self) -> tuple[str, str, float | None]:
        n = self.rng.randint(2, 4)
        if self.rng.random() < 0.5:
            out = await self.sse("/v1/chat/completions", self.chat_body(n=n))
            self.check_stream(out, choices=n)
        else:
            r = await self.client.post("/v1/chat/completions", json=self.chat_body(n=n))
            classify_status(r.status_code, r.content)
            if len(r.json()["choices"]) != n:
                raise Unexpected(f"{len(r.json()['choices'])} choices for n={n}")
        return "ok", f"n={n}", None

    async def gone_in_prefill(self) -> tuple[str, str, float | None]:
        body = {"messages": self.messages(long=True), "max_tokens": self.args.max_tokens, "stream": True}
        try:
            out = await asyncio.wait_for(self.sse("/v1/chat/completions", body), self.rng.uniform(0.01, 0.3))
        except TimeoutError:
            return "gone", "left before the first token", None
        self.check_stream(out)
        return "ok", "answered before the client left", None

    async def gone_in_decode(self) -> tuple[str, str, float | None]:
        body = self.chat_body(max_tokens=self.args.max_tokens, ignore_eos=True)
        out = await self.sse("/v1/chat/completions", body, stop_after=self.rng.randint(2, 6))
        if out["status"] != 200:
            classify_status(out["status"], out["body"])
        return ("ok", "finished before the client left", None) if out["done"] else ("gone", "", None)

    async def abort_storm(self) -> tuple[str, str, float | None]:
        rids = [self.rid() for _ in range(self.rng.randint(2, 5))]
        sp = {"max_new_tokens": self.args.max_tokens, "ignore_eos": True, "temperature": 0.8}
        gens = [asyncio.ensure_future(self.client.post("/generate", json={
            "text": "Story: " + " ".join(self.rng.choices(WORDS, k=8)), "rid": rid, "sampling_params": sp}))
            for rid in rids]
        await asyncio.sleep(self.rng.uniform(0.0, 1.0))
        aborts = await asyncio.gather(*[self.client.post("/abort_request", json={"rid": r})
                                        for r in [*rids, "soak-no-such-rid"]])
        for a in aborts:
            classify_status(a.status_code, a.content)
        reasons = Counter()
        for r in await asyncio.gather(*gens):
            classify_status(r.status_code, r.content)
            reasons[r.json()["meta_info"]["finish_reason"]["type"]] += 1
        return "ok", " ".join(f"{k}:{v}" for k, v in sorted(reasons.items())), None

    async def duplicate_rid(self) -> tuple[str, str, float | None]:
        """While a stream with a rid runs (read slowly, so it stays open), the same rid again
        must get a 400; the stream goes on to its end."""
        rid = self.rid()
        body = {"text": "Count slowly: one, two,", "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": self.args.max_tokens, "ignore_eos": True}}
        first_event = asyncio.Event()
        second: list[httpx.Response] = []

        async def duplicate() -> None:
            await first_event.wait()
            second.append(await self.client.post("/generate", json={**body, "stream": False}))

        dup = asyncio.ensure_future(duplicate())
        try:
            out = await self.sse("/generate", body, pause=0.05, on_event=first_event.set)
        finally:
            if not first_event.is_set():
                dup.cancel()
            await asyncio.gather(dup, return_exceptions=True)
        self.check_stream(out)
        if not second:
            raise Lost("the duplicate request got no answer")
        r = second[0]
        if r.status_code != 400:
            classify_status(r.status_code, r.content)
            raise Unexpected(f"the duplicate rid got {r.status_code}, not 400")
        classify_status(r.status_code, r.content, expected=(400,))
        return "ok", "", None

    async def bad_request(self) -> tuple[str, str, float | None]:
        route, body = self.rng.choice(BAD_REQUESTS)
        if isinstance(body, bytes):
            r = await self.client.post(route, content=body, headers={"Content-Type": "application/json"})
        else:
            r = await self.client.post(route, json=body)
        classify_status(r.status_code, r.content, expected=(400, 404, 413, 422))
        return "error", f"{route} -> {r.status_code}", None

    async def flush_cache(self) -> tuple[str, str, float | None]:
        r = await self.client.post("/flush_cache")
        classify_status(r.status_code, r.content, expected=(200, 409))
        return ("ok" if r.status_code == 200 else "error"), str(r.status_code), None

    async def slow_reader(self) -> tuple[str, str, float | None]:
        """A small receive window and long pauses; the stream must end, cut off or not."""
        transport = httpx.AsyncHTTPTransport(socket_options=[(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)])
        async with httpx.AsyncClient(base_url=self.base_url, transport=transport,
                                     timeout=httpx.Timeout(self.args.timeout, connect=30)) as client:
            body = self.chat_body(max_tokens=self.args.max_tokens, ignore_eos=True, n=2, logprobs=True,
                                  top_logprobs=20)
            out = await self.sse("/v1/chat/completions", body, pause=self.rng.uniform(0.05, 0.3), client=client)
        if out["status"] == 200 and out["error"] is not None and out["error"].get("code") == 408 and out["done"]:
            return "error", "cut off as a slow reader", None
        self.check_stream(out, choices=2)
        return "ok", "", None


SCENARIOS = {  # name -> weight
    "chat_stream": 30, "chat": 15, "chat_n": 10, "gone_in_prefill": 8, "gone_in_decode": 8,
    "abort_storm": 5, "duplicate_rid": 5, "bad_request": 10, "flush_cache": 3, "slow_reader": 2,
}


async def run_one(load: Load, kind: str) -> Outcome:
    start = time.monotonic()
    try:
        verdict, detail, ttft = await asyncio.wait_for(getattr(load, kind)(), load.args.timeout + 5)
    except Lost as e:
        verdict, detail, ttft = "lost", str(e), None
    except Unexpected as e:
        verdict, detail, ttft = "unexpected", str(e), None
    except (TimeoutError, httpx.TimeoutException):
        verdict, detail, ttft = "lost", f"no answer within {load.args.timeout:g} s", None
    except httpx.HTTPError as e:
        verdict, detail, ttft = "lost", f"{type(e).__name__}: {e}", None
    except Exception as e:  # a malformed answer (not JSON, missing fields): a bug to report
        verdict, detail, ttft = "unexpected", f"{type(e).__name__}: {e}", None
    return Outcome(kind, start - load.t0, time.monotonic() - start, verdict, detail[:300], ttft)


# ---------------------------------------------------------------- sampling and checks


def rss_mb(pids: dict[str, int]) -> dict[str, float | None]:
    out: dict[str, float | None] = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            out[name] = None
    return out


async def sampler(load: Load, pids: dict[str, int], seconds: float, samples: list[dict[str, Any]],
                  stop: asyncio.Event) -> None:
    interval = max(1.0, min(5.0, seconds / 100))
    last_print = 0.0
    while not stop.is_set():
        t = time.monotonic() - load.t0
        try:
            stats = (await load.client.get("/server_info")).json()["stats"]
        except (httpx.HTTPError, ValueError, KeyError) as e:
            stats = {"error": repr(e)}
        samples.append({"t": t, "rss_mb": rss_mb(pids), **{k: stats.get(k) for k in (
            "running", "waiting", "retractions", "evicted_tokens", "free_pages", "error")}})
        if t - last_print >= 10 or not last_print:
            last_print = t
            v = Counter(o.verdict for o in load.outcomes)
            rss = " ".join(f"{k} {x:.0f}MB" for k, x in samples[-1]["rss_mb"].items() if x is not None)
            print(f"[{t:5.0f}/{seconds:.0f} s] answers {len(load.outcomes)} (ok {v['ok']}, error {v['error']}, "
                  f"gone {v['gone']}, unexpected {v['unexpected']}, lost {v['lost']}); running "
                  f"{stats.get('running')} waiting {stats.get('waiting')} retractions {stats.get('retractions')} "
                  f"evicted {stats.get('evicted_tokens')}; RSS {rss}", flush=True)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), interval)


def p99(xs: list[float]) -> float | None:
    return statistics.quantiles(xs, n=100)[98] if len(xs) >= 10 else None


def check(name: str, ok: bool | None, value: str) -> dict[str, Any]:
    return {"check": name, "ok": ok, "value": value}


def checks(outcomes: list[Outcome], samples: list[dict[str, Any]], seconds: float,
           memory: dict[str, Any], final_stats: dict[str, Any], exit_code: int | None) -> list[dict[str, Any]]:
    v = Counter(o.verdict for o in outcomes)
    out = [check("no request lost (no answer, hung, 5xx, broken stream)", v["lost"] == 0, str(v["lost"])),
           check("no unexpected answer", v["unexpected"] == 0, str(v["unexpected"])),
           check("memory invariant when idle, no page or lock left",
                 bool(memory.get("ok")) and memory.get("request_pages") == 0 and memory.get("locked_tokens") == 0,
                 f"request_pages {memory.get('request_pages')}, locked_tokens {memory.get('locked_tokens')}")]
    for proc in ("server", "scheduler", "detokenizer"):
        warm = [s["rss_mb"][proc] for s in samples if 0.2 * seconds <= s["t"] < 0.3 * seconds and s["rss_mb"][proc]]
        last = [s["rss_mb"][proc] for s in samples if s["t"] >= 0.9 * seconds and s["rss_mb"][proc]]
        if warm and last:
            growth = statistics.median(last) / statistics.median(warm) - 1
            out.append(check(f"RSS of the {proc} grew <= {RSS_GROWTH_LIMIT:.0%} after warm-up",
                             growth <= RSS_GROWTH_LIMIT,
                             f"{statistics.median(warm):.0f} -> {statistics.median(last):.0f} MB ({growth:+.1%})"))
        else:
            out.append(check(f"RSS of the {proc} grew <= {RSS_GROWTH_LIMIT:.0%} after warm-up", None, "no samples"))
    ttft = [(o.start, o.ttft) for o in outcomes if o.kind == "chat_stream" and o.verdict == "ok" and o.ttft]
    q2 = p99([x for s, x in ttft if 0.25 * seconds <= s < 0.5 * seconds])
    q4 = p99([x for s, x in ttft if s >= 0.75 * seconds])
    ratio = q4 / q2 if q2 and q4 else None
    out.append(check(f"p99 TTFT last quarter / second quarter <= {TTFT_RATIO_LIMIT:g}",
                     None if ratio is None else ratio <= TTFT_RATIO_LIMIT,
                     "too few samples" if ratio is None else f"{q4:.3f} s / {q2:.3f} s = {ratio:.2f}"))
    out.append(check("eviction and retraction happened", bool(final_stats.get("retractions"))
                     and bool(final_stats.get("evicted_tokens")),
                     f"retractions {final_stats.get('retractions')}, evicted tokens {final_stats.get('evicted_tokens')}"))
    out.append(check("the server exits 0 on SIGTERM", exit_code == 0, str(exit_code)))
    return out


def table(outcomes: list[Outcome]) -> str:
    rows = [["scenario", "answers", "ok", "error", "gone", "unexpected", "lost", "p50 s", "p99 s"]]
    by_kind: dict[str, list[Outcome]] = defaultdict(list)
    for o in outcomes:
        by_kind[o.kind].append(o)
    for kind in [*SCENARIOS, "total"]:
        os_ = outcomes if kind == "total" else by_kind.get(kind, [])
        v = Counter(o.verdict for o in os_)
        secs = [o.seconds for o in os_]
        rows.append([kind, str(len(os_)), *(str(v[k]) for k in ("ok", "error", "gone", "unexpected", "lost")),
                     f"{statistics.median(secs):.2f}" if secs else "-", f"{p99(secs):.2f}" if p99(secs) else "-"])
    return align_columns(rows, left={0})


# ---------------------------------------------------------------- driver


def start_server(args: argparse.Namespace, folder: str) -> Any:
    sys.path.insert(0, str(REPO / "tests"))
    from helpers.server import ServerProcess, build_chat_tiny_model

    model = args.model
    if model == "tiny":
        from radixserve.model.default_model import default_model_path

        model = build_chat_tiny_model(default_model_path(), folder)
    flags = ["--max-total-tokens", str(args.max_total_tokens), "--context-length", str(args.context_length),
             "--slow-reader-timeout", str(args.slow_reader_timeout), *args.server_args.split()]
    if model:
        flags += ["--model", model]
    print(f"starting the server: {' '.join(flags)}", flush=True)
    srv = ServerProcess(*flags).wait_ready(args.startup_timeout)
    print(f"server {srv.base_url}, log {srv.log_path}", flush=True)
    return srv


async def soak(args: argparse.Namespace, srv: Any) -> dict[str, Any]:
    seconds = args.minutes * 60
    t0 = time.monotonic()
    load = Load(args, srv.base_url, t0)
    info = (await load.client.get("/server_info")).json()
    pids = info["pids"]
    kinds, weights = list(SCENARIOS), list(SCENARIOS.values())
    samples: list[dict[str, Any]] = []
    stop = asyncio.Event()

    async def client_loop() -> None:
        while time.monotonic() - t0 < seconds:
            load.outcomes.append(await run_one(load, load.rng.choices(kinds, weights)[0]))

    sampling = asyncio.ensure_future(sampler(load, pids, seconds, samples, stop))
    await asyncio.gather(*[client_loop() for _ in range(args.concurrency)])
    stop.set()
    await sampling
    idle_deadline = time.monotonic() + 60
    while True:  # idle: nothing running or waiting
        info = (await load.client.get("/server_info")).json()
        if (info["stats"]["running"] == 0 and info["stats"]["waiting"] == 0) or time.monotonic() > idle_deadline:
            break
        await asyncio.sleep(0.5)
    await load.client.aclose()
    return {"outcomes": load.outcomes, "samples": samples, "seconds": seconds, "memory": info["memory"],
            "stats": info["stats"], "pids": pids}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--minutes", type=float, default=10.0, help="length of the load (default: 10)")
    p.add_argument("--model", default=None, help="model folder or GGUF; 'tiny' for a tiny random model "
                                                 "with the default tokenizer (default: the default model)")
    p.add_argument("--concurrency", type=int, default=12, help="clients running at once (default: 12)")
    p.add_argument("--max-total-tokens", type=int, default=1024, help="KV pool of the server (default: 1024)")
    p.add_argument("--context-length", type=int, default=512, help="(default: 512)")
    p.add_argument("--max-tokens", type=int, default=128, help="most tokens a request asks for (default: 128)")
    p.add_argument("--slow-reader-timeout", type=float, default=5.0, help="(default: 5)")
    p.add_argument("--server-args", default="", help="more flags for `radixserve serve`, one string")
    p.add_argument("--timeout", type=float, default=180.0, help="seconds before a request counts as hung")
    p.add_argument("--startup-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "soak.json")
    return p.parse_args(argv)


def _interrupt_on_sigterm() -> None:
    """SIGTERM ends the run as Ctrl-C does, so the server started here is stopped too."""

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    _interrupt_on_sigterm()
    with tempfile.TemporaryDirectory(prefix="radixserve-soak-") as folder:
        srv = start_server(args, folder)
        try:
            run = asyncio.run(soak(args, srv))
        finally:
            exit_code = srv.stop(30)
    outcomes = run["outcomes"]
    results = checks(outcomes, run["samples"], run["seconds"], run["memory"], run["stats"], exit_code)
    print(table(outcomes))
    for kind in SCENARIOS:
        for o in [o for o in outcomes if o.kind == kind and o.verdict in ("lost", "unexpected")][:3]:
            print(f"{o.verdict.upper()} {kind} at {o.start:.0f} s: {o.detail}")
    for c in results:
        print(f"{ {True: 'PASS', False: 'FAIL', None: 'n/a '}[c['ok']] } {c['check']}: {c['value']}")
    if exit_code != 0:
        print(f"server log: {srv.log_path}")
    report = {"benchmark": "soak", "params": args_params(args), "machine": machine_info(),
              "checks": results, "passed": all(c["ok"] is not False for c in results),
              "verdicts": dict(Counter(o.verdict for o in outcomes)), "final_stats": run["stats"],
              "memory": run["memory"], "samples": run["samples"], "outcomes": [asdict(o) for o in outcomes]}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
