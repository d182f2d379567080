"""Program benchmark: a branching structured-generation workload through the program API,
with and without the radix cache, against the same logic written as plain chat calls.

Workload (``bench/program_workload.py``): 64 programs over 4 shared documents of ~256 tokens
of real English text; each program puts one document and its own support ticket in a chat
prompt, ``select``s the ticket's category among 4 labels, ``fork``s into 3 branches of one
greedy 32-token ``gen`` each (``ignore_eos``), then joins them in a last 32-token ``gen``.
(``--doc-len 1000`` makes the documents long; then the cache-off runs alone take over 40
minutes on 2 CPU cores, as each of a program's 10 requests recomputes its document.)

Configurations, in every ``--dtypes`` entry, each on a fresh engine or server:
  program           ``triage.run_batch`` on an ``Engine``, radix cache on
  program-no-radix  the same, ``disable_radix_cache=True``
  openai-chat       the same logic as independent chat calls (official ``openai`` client, one
                    call per step with the whole message list, the select as a reply
                    constrained by ``regex`` to the labels) to a ``radixserve serve``
                    subprocess, radix cache on; the programs run on a thread pool as wide as
                    ``run_batch``'s, each program's branches as concurrent calls

Wall time runs from the first request to the last result (start-up and a warm-up excluded,
the cache flushed after it).  "prefill computed", "prompt tokens" and "hit rate" are the
scheduler's counters over the timed run.  "unique" is the number of distinct prefixes of the
token ids of every prompt the run sent (``unique_prefix_tokens``): what a perfect prefix
cache computes.  The prompts are exactly what reached the scheduler: the program configs
record every prompt their backend sends (select's scoring requests and fork's prefix request
included), the chat config renders each call's messages with the server's own
``/apply_chat_template``; both are tokenized as the server tokenizes a prompt, and their total
length is checked against the scheduler's ``prompt_tokens``.

Select micro-benchmark (program config's engine): ``select`` among k short choices after a
fresh ``--select-prefix-len``-token prefix (so every measured call computes its prefix), for
each k of ``--select-ks``, interleaved, median of ``--select-repeats``.

    python bench/program.py                              # float32 and bfloat16 (many minutes)
    python bench/program.py --quick                      # tiny smoke run
    python bench/program.py --dtypes bfloat16 --configs program program-no-radix
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
import urllib.request
from collections import Counter
from concurrent.futures import ThreadPoolExecutor, as_completed
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
from bench.offline import stats_delta  # noqa: E402
from bench.program_workload import (  # noqa: E402
    LABELS,
    BranchingWorkload,
    branching_workload,
    chat_triage,
    program_result,
    triage,
    unique_prefix_tokens,
)
from bench.workloads import TokenStream  # noqa: E402
from radixserve.program import EngineBackend, RuntimeEndpoint, function, select  # noqa: E402

CONFIGS = ("program", "program-no-radix", "openai-chat")
DTYPES = ("float32", "bfloat16", "float16")
MAX_THREADS = 128  # run_batch's own cap
TARGET_SPEEDUP_VS_NO_RADIX = 4.0
TARGET_COMPUTED_OVER_UNIQUE = 1.1
TARGET_SELECT_K4_OVER_K1 = 1.3
COLOURS = (" red", " green", " blue", " yellow", " black", " white", " orange", " purple")
SELECT_QUESTION = "\n\nQuestion: which colour fits this text best?\nAnswer:"
QUICK = {"programs": 8, "documents": 2, "doc_len": 128, "gen_len": 4, "select_prefix_len": 128, "select_repeats": 2}
WARMUP = {"document": "A short note.", "ticket": "Hello, my order is late.", "gen_len": 2}


class RecordingBackend(EngineBackend):
    """An :class:`EngineBackend` that keeps every request it sends: kind, prompt, and the
    prompt / cached token counts the scheduler reported for it."""

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        self.requests: list[tuple[str, Any, int, int]] = []
        self._lock = threading.Lock()

    def generate_many(self, prompts: list[Any], sampling: dict[str, Any], **logprob: Any) -> list[dict[str, Any]]:
        outs = super().generate_many(prompts, sampling, **logprob)
        kind = request_kind(sampling, logprob)
        with self._lock:
            for p, o in zip(prompts, outs, strict=True):
                meta = o["meta_info"]
                self.requests.append((kind, p, meta["prompt_tokens"], meta.get("cached_tokens", 0)))
        return outs


def request_kind(sampling: dict[str, Any], logprob: dict[str, Any]) -> str:
    """What a program request is for (``radixserve/program/select.py`` and ``state.fork``)."""
    if sampling.get("max_new_tokens") != 0:
        return "gen"
    if not logprob.get("return_logprob"):
        return "fork prefix"
    return "select choice" if logprob.get("logprob_start_len", -1) >= 0 else "select prompt"


def by_kind(requests: list[tuple[str, Any, int, int]]) -> dict[str, dict[str, int]]:
    """Requests, prompt tokens and tokens served from the cache, per kind of request."""
    out: dict[str, dict[str, int]] = {}
    for kind, _, prompt, cached in requests:
        d = out.setdefault(kind, {"requests": 0, "prompt_tokens": 0, "cached_tokens": 0})
        d["requests"] += 1
        d["prompt_tokens"] += prompt
        d["cached_tokens"] += cached
    return out


def token_row(config: str, dtype: str, wall: float, results: list[dict[str, Any]], prompt_ids: list[list[int]],
              requests: list[tuple[str, Any, int, int]], stats: dict[str, Any]) -> dict[str, Any]:
    """The columns every config shares, from the prompts it sent and the scheduler's counters."""
    sent = sum(len(p) for p in prompt_ids)
    return {
        "config": config,
        "dtype": dtype,
        "wall_s": wall,
        "programs": len(results),
        "requests": len(prompt_ids),
        "prompt_tokens": sent,
        "prompt_tokens_match_stats": sent == stats["prompt_tokens"]
        and all(len(p) == n for p, (_, _, n, _) in zip(prompt_ids, requests, strict=True)),
        "unique_tokens": unique_prefix_tokens(prompt_ids),
        "prefill_computed": stats["prefill_tokens_computed"],
        "hit_rate": stats["cache_hit_rate"],
        "by_kind": by_kind(requests),
        "labels": dict(Counter(r["label"] for r in results)),
        "example": results[0],
        "stats": stats,
        "results": results,
        "prompt_ids": prompt_ids,
    }


# ---- program configs ----------------------------------------------------------------------
def run_program(config: str, dtype: str, work: BranchingWorkload, args: argparse.Namespace) -> dict[str, Any]:
    from radixserve import Engine

    settings: dict[str, Any] = {"dtype": dtype, "disable_radix_cache": config == "program-no-radix"}
    if args.max_total_tokens is not None:
        settings["max_total_tokens"] = args.max_total_tokens
    t0 = time.perf_counter()
    with Engine(model=args.model, **settings) as engine:
        start_s = time.perf_counter() - t0
        backend = RecordingBackend(engine)
        triage.run(backend=backend, **WARMUP)
        if not engine.flush_cache():
            raise RuntimeError("flush_cache refused after the warm-up")
        backend.requests.clear()
        before = engine.get_stats()
        t0 = time.perf_counter()
        states = triage.run_batch(work.program_kwargs(), backend=backend, num_threads=args.threads,
                                  progress_bar=not args.no_progress)
        wall = time.perf_counter() - t0
        stats = stats_delta(before, engine.get_stats())
        failed = [s.error for s in states if s.error is not None]
        if failed:
            raise RuntimeError(f"{len(failed)} programs failed, the first with: {failed[0]!r}")
        ids = [engine.tokenizer.encode(p, add_special_tokens=False) if isinstance(p, str) else list(p)
               for _, p, _, _ in backend.requests]
        row = token_row(config, dtype, wall, [program_result(s) for s in states], ids, backend.requests, stats)
        row.update(engine_start_s=start_s, engine_settings=settings,
                   memory_invariant_ok=bool(engine.check_memory().get("ok")))
        if config == "program" and args.select_repeats:
            if not engine.flush_cache():
                raise RuntimeError("flush_cache refused before the select micro-benchmark")
            row["select"] = select_benchmark(EngineBackend(engine), engine.tokenizer, args)
    return row


@function
def pick(s: Any, prefix: str, choices: list[str]) -> None:
    s += prefix
    s += select("choice", choices=choices)


def select_benchmark(backend: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Seconds per ``select`` over k choices after a fresh prefix, median over repeats."""
    stream = TokenStream(tokenizer, args.seed + 6_000_007)
    pick.run(prefix="Warm-up." + SELECT_QUESTION, choices=list(COLOURS[:max(args.select_ks)]), backend=backend)
    seconds: dict[int, list[float]] = {k: [] for k in args.select_ks}
    prefix_tokens: list[int] = []
    choice_cached: list[int] = []  # tokens each choice's request was served from the cache
    for _ in range(args.select_repeats):
        for k in args.select_ks:
            prefix = tokenizer.decode(stream.take(args.select_prefix_len)).strip() + SELECT_QUESTION
            t0 = time.perf_counter()
            state = pick.run(prefix=prefix, choices=list(COLOURS[:k]), backend=backend)
            seconds[k].append(time.perf_counter() - t0)
            meta = state.get_meta_info("choice")
            prefix_tokens.append(meta["prompt_tokens"])
            choice_cached += meta["cached_tokens"]
    median = {k: statistics.median(v) for k, v in seconds.items()}
    base = median.get(1)
    return {
        "repeats": args.select_repeats,
        "prefix_tokens_min": min(prefix_tokens),
        "prefix_tokens_max": max(prefix_tokens),
        "choice_cached_tokens_min": min(choice_cached),
        "median_s": {str(k): v for k, v in median.items()},
        "all_s": {str(k): v for k, v in seconds.items()},
        "ratio_vs_k1": {str(k): (v / base if base else None) for k, v in median.items()},
    }


# ---- chat calls to a server ----------------------------------------------------------------
def server_info(base_url: str) -> dict[str, Any]:
    with urllib.request.urlopen(base_url + "/server_info", timeout=60) as r:
        return json.loads(r.read())


def run_openai_chat(dtype: str, work: BranchingWorkload, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    from openai import OpenAI

    from bench.compare import Server

    flags = ["--dtype", dtype]
    if args.max_total_tokens is not None:
        flags += ["--max-total-tokens", str(args.max_total_tokens)]
    t0 = time.perf_counter()
    srv = Server(args.model, flags, startup_timeout=600)
    try:
        start_s = time.perf_counter() - t0
        client = OpenAI(base_url=srv.base_url + "/v1", api_key="none", max_retries=0, timeout=3600)
        model = client.models.list().data[0].id
        endpoint = RuntimeEndpoint(srv.base_url)
        calls: list[tuple[str, list[dict[str, str]], int, int]] = []
        lock = threading.Lock()

        def call(kind: str, messages: list[dict[str, str]], params: dict[str, Any]) -> str:
            r = client.chat.completions.create(model=model, messages=messages, **params)
            details = r.usage.prompt_tokens_details
            with lock:
                calls.append((kind, messages, r.usage.prompt_tokens, (details.cached_tokens or 0) if details else 0))
            return r.choices[0].message.content or ""

        chat_triage(call, **WARMUP)
        if not endpoint.flush_cache():
            raise RuntimeError("flush_cache refused after the warm-up")
        calls.clear()
        before = endpoint.get_stats()
        t0 = time.perf_counter()
        with ThreadPoolExecutor(args.threads, thread_name_prefix="chat-program") as pool:
            futures = [pool.submit(chat_triage, call, **kw) for kw in work.program_kwargs()]
            if not args.no_progress:
                from tqdm import tqdm

                for _ in tqdm(as_completed(futures), total=len(futures), desc="chat_triage", unit="program"):
                    pass
            results = [f.result() for f in futures]
        wall = time.perf_counter() - t0
        stats = stats_delta(before, endpoint.get_stats())
        # The prompt of each call: its messages rendered by the server's own template.
        ids = [tokenizer.encode(endpoint.render_chat(m, True), add_special_tokens=False) for _, m, _, _ in calls]
        row = token_row("openai-chat", dtype, wall, results, ids, calls, stats)
        row.update(engine_start_s=start_s, engine_settings={"dtype": dtype, "server_flags": flags},
                   memory_invariant_ok=bool(server_info(srv.base_url)["memory"].get("ok")))
    finally:
        srv.stop()
    return row


# ---- report --------------------------------------------------------------------------------
def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Ratios: computed / unique, speed-up against radix off, results equal to the program's."""
    no_radix = {r["dtype"]: r for r in rows if r["config"] == "program-no-radix"}
    program = {r["dtype"]: r for r in rows if r["config"] == "program"}
    for r in rows:
        r["computed_over_unique"] = r["prefill_computed"] / r["unique_tokens"]
        ref = no_radix.get(r["dtype"])
        r["speedup_vs_no_radix"] = ref["wall_s"] / r["wall_s"] if ref else None
        same = program.get(r["dtype"])
        r["results_equal_to_program"] = (
            sum(a == b for a, b in zip(r["results"], same["results"], strict=True)) / r["programs"]
            if same and r is not same else None
        )


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("config", "dtype", "wall s", "requests", "prefill computed", "unique prompt tokens",
              "computed/unique", "hit rate", "speedup vs radix off")
    lines = [header]
    for r in rows:
        speedup = "-" if r["speedup_vs_no_radix"] is None else f"{r['speedup_vs_no_radix']:.2f}x"
        lines.append((r["config"], r["dtype"], f"{r['wall_s']:.2f}", str(r["requests"]), str(r["prefill_computed"]),
                      str(r["unique_tokens"]), f"{r['computed_over_unique']:.3f}", f"{r['hit_rate']:.1%}", speedup))
    return align_columns(lines, left=(0, 1))


def detail_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        kinds = ", ".join(f"{k} {d['requests']} req {d['cached_tokens']}/{d['prompt_tokens']} cached"
                          for k, d in r["by_kind"].items())
        lines.append(f"requests ({r['config']}, {r['dtype']}): {kinds}")
        if r["results_equal_to_program"] is not None:
            lines.append(f"results equal to program ({r['config']}, {r['dtype']}): "
                         f"{r['results_equal_to_program']:.0%} of programs; labels {r['labels']}")
        sel = r.get("select")
        if sel:
            times = ", ".join(f"k={k} {1000 * s:.0f} ms ({sel['ratio_vs_k1'][k]:.2f}x)"
                              for k, s in sel["median_s"].items())
            lines.append(f"select ({r['dtype']}, fresh {sel['prefix_tokens_min']}-{sel['prefix_tokens_max']}-token "
                         f"prefix, median of {sel['repeats']}): {times}")
    return lines


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per target and dtype (ok None when not measured); printed, never asserted."""
    by = {(r["config"], r["dtype"]): r for r in rows}
    checks = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        program = by.get(("program", dtype))
        if program is None:
            continue
        checks.append(target(dtype, "program: no-radix wall / radix wall >=", program["speedup_vs_no_radix"],
                             TARGET_SPEEDUP_VS_NO_RADIX, at_least=True))
        checks.append(target(dtype, "program: prefill computed / unique <=", program["computed_over_unique"],
                             TARGET_COMPUTED_OVER_UNIQUE, at_least=False))
        ratio = (program.get("select") or {}).get("ratio_vs_k1", {}).get("4")
        checks.append(target(dtype, "select: k=4 time / k=1 time <=", ratio, TARGET_SELECT_K4_OVER_K1,
                             at_least=False))
    return checks


# ---- command line --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--programs", type=int, default=64)
    p.add_argument("--documents", type=int, default=4, help="shared documents")
    p.add_argument("--doc-len", type=int, default=256,
                   help="tokens per document (256 keeps the full run under ~25 minutes on 2 CPU cores)")
    p.add_argument("--gen-len", type=int, default=32, help="tokens per gen (branches and join)")
    p.add_argument("--threads", type=int, default=None, help="programs at once (default: all, up to 128)")
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=DTYPES)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    p.add_argument("--select-ks", type=int, nargs="+", default=[1, 4, 8], help=f"choices, 1..{len(COLOURS)}")
    p.add_argument("--select-prefix-len", type=int, default=1000, help="tokens of each fresh prefix")
    p.add_argument("--select-repeats", type=int, default=5, help="0 skips the select micro-benchmark")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="HF model folder (default: the embedded model)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size of every engine and server")
    p.add_argument("--quick", action="store_true",
                   help=f"tiny smoke run: defaults {QUICK}")
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "program.json")
    if p.parse_known_args(argv)[0].quick:  # smaller defaults; flags given still win
        p.set_defaults(**QUICK)
    args = p.parse_args(argv)
    args.threads = args.threads or min(args.programs, MAX_THREADS)
    for name in ("programs", "documents", "doc_len", "gen_len", "threads", "select_prefix_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.select_repeats < 0 or any(not 1 <= k <= len(COLOURS) for k in args.select_ks):
        p.error(f"--select-repeats must be >= 0 and --select-ks in 1..{len(COLOURS)}")
    args.dtypes = list(dict.fromkeys(args.dtypes))
    args.configs = [c for c in CONFIGS if c in args.configs]
    args.select_ks = sorted(set(args.select_ks))
    return args


def run(args: argparse.Namespace) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The report (as written to ``args.out``) and the full rows (results, prompt ids)."""
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(args.model or default_model_path())
    work = branching_workload(tokenizer, args.programs, args.documents, args.doc_len, args.gen_len, args.seed)
    print(f"workload: {work.programs} programs over {len(work.documents)} documents of ~{args.doc_len} tokens; "
          f"select among {len(LABELS)} labels, fork 3 x gen {args.gen_len}, join gen {args.gen_len}; "
          f"{args.threads} programs at once")
    runs = [(d, c) for d in args.dtypes for c in args.configs]
    rows = []
    for i, (dtype, config) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {config} {dtype} ...", flush=True)
        row = (run_openai_chat(dtype, work, args, tokenizer) if config == "openai-chat"
               else run_program(config, dtype, work, args))
        print(f"[{i}/{len(runs)}] {config} {dtype}: {row['wall_s']:.2f} s, {row['prefill_computed']} prefill "
              f"tokens computed, {row['unique_tokens']} unique", flush=True)
        rows.append(row)
    finish_rows(rows)
    checks = check_targets(rows)
    print()
    print(format_table(rows))
    for line in detail_lines(rows) + target_lines(checks):
        print(line)
    report = {
        "benchmark": "program_branching",
        "params": args_params(args),
        "machine": machine_info(),
        "workload": {
            "programs": work.programs,
            "documents": len(work.documents),
            "document_tokens": [len(tokenizer.encode(d, add_special_tokens=False)) for d in work.documents],
            "labels": list(LABELS),
            "text_source": "Python standard-library docstrings (bench/workloads.py); tickets from "
                           "bench/structured_workload.py",
        },
        "results": [{k: v for k, v in r.items() if k not in ("results", "prompt_ids")} for r in rows],
        "targets": checks,
    }
    write_report(report, args.out)
    return report, rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    return run(parse_args(argv))[0]


if __name__ == "__main__":
    main()
