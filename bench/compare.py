"""Serving comparison: a matrix of radixserve servers, started here, under one workload.

For each server configuration (radix cache on/off x schedule policy x schedule mode) this starts
``radixserve serve`` on a free port, waits for ``/health``, and runs ``bench/serving.py``
once per concurrency level (warm-up, ``/flush_cache``, timed run, so each run starts from a
cold cache), then stops the server. One workload, built once, serves every run. It writes one
table (Markdown), one chart (PNG: TTFT, throughput and hit rate across runs, TTFT
distributions) and one JSON file with every run's full report.

Flags not listed below are ``bench/serving.py``'s (workload, sizes, traffic, requests).

    python bench/compare.py -G 4 -P 16 -S 1024 -Q 48 -O 32 --radix on,off --policies lpm
    python bench/compare.py --workload multi-turn -C 8 -T 4 --concurrency all,4 --policies lpm,fcfs
    python bench/compare.py --radix on --schedule-modes mixed,prefill-first --request-rate 2 ...
    radixserve bench compare --model ./tiny --server-args "--context-length 2048" -G 2 -P 2
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench import serving  # noqa: E402
from bench.common import Launched, free_port, machine_info, target_lines, write_json  # noqa: E402
from radixserve.cli.bench import PROG_ENV  # noqa: E402
from radixserve.config import SCHEDULE_MODES  # noqa: E402

POLICIES = ("lpm", "fcfs")
TARGET_HIT_RATE = 0.85  # shared-prefix, radix on
TARGET_TTFT_RATIO = 0.25  # TTFT p50 radix on / radix off, same policy and concurrency


# ---- servers ------------------------------------------------------------------------------
class Server(Launched):
    """``radixserve serve`` on a free loopback port; its log goes to a temp file (removed by
    ``run_matrix`` after a clean exit).  ``env`` is added to this process's environment."""

    def __init__(self, model: str | None, flags: list[str], startup_timeout: float,
                 env: dict[str, str] | None = None) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), *flags]
        if model:
            cmd += ["--model", model]
        super().__init__("radixserve", cmd, port, startup_timeout, env)


def server_flags(radix: str, policy: str, extra: list[str], mode: str = "mixed") -> list[str]:
    flags = ["--schedule-policy", policy, "--schedule-mode", mode, *extra]
    return flags + ["--disable-radix-cache"] if radix == "off" else flags


# ---- the matrix ---------------------------------------------------------------------------
def run_matrix(args: argparse.Namespace, serving_argv: list[str]) -> list[dict[str, Any]]:
    """Every (radix, policy, schedule mode) server x concurrency level; one row per timed run."""
    from radixserve.tokenizer import load_tokenizer

    model_path = args.model
    if model_path is None:
        from radixserve.model.default_model import default_model_path

        model_path = default_model_path()
    base = serving.parse_args(serving_argv + ["--tokenizer", args.tokenizer or model_path],
                              prog="compare.py")
    tokenizer = load_tokenizer(base.tokenizer)
    jobs, workload = serving.build_jobs(base, tokenizer)
    print(f"{workload['name']}: {workload['requests']} requests per run; "
          f"{len(args.radix) * len(args.policies) * len(args.schedule_modes) * len(args.concurrency)} runs",
          flush=True)
    rows = []
    servers = [(radix, policy, mode) for radix in args.radix for policy in args.policies
               for mode in args.schedule_modes]
    for radix, policy, mode in servers:
        label = f"radix {radix}, {policy}" + (f", {mode}" if len(args.schedule_modes) > 1 else "")
        print(f"[{label}] starting the server ...", flush=True)
        t0 = time.perf_counter()
        server = Server(args.model, server_flags(radix, policy, args.server_args, mode), args.startup_timeout)
        try:
            start_s = time.perf_counter() - t0
            for concurrency in args.concurrency:
                run_args = serving.parse_args(
                    serving_argv + ["--tokenizer", base.tokenizer, "--base-url", server.base_url],
                    prog="compare.py")
                run_args.max_concurrency = concurrency
                run_args.disable_tqdm = args.disable_tqdm
                report, _ = serving.run_benchmark(run_args, jobs, workload, tokenizer)
                print(serving.format_report(report), flush=True)
                rows.append({"radix": radix, "policy": policy, "schedule_mode": mode, "concurrency": concurrency,
                             "label": label, "server_start_s": start_s,
                             "server_cmd": server.cmd, "report": report})
        finally:
            code = server.stop()
        if code == 0:
            os.unlink(server.log_path)
        else:  # keep the log for the post-mortem
            print(f"[{label}] warning: the server exited with {code}; log {server.log_path}",
                  flush=True)
    return rows


def check_targets(rows: list[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """The issue's targets, for shared-prefix: hit rate and TTFT p50 of radix on vs off."""
    if workload != "shared-prefix":
        return []
    checks = []
    by = {(r["radix"], r["policy"], r.get("schedule_mode", "mixed"), r["concurrency"]): r for r in rows}
    for (radix, policy, mode, conc), row in by.items():
        if radix != "on":
            continue
        s = row["report"]["summary"]
        hit = s["server_cache_hit_rate"] if s["server_cache_hit_rate"] is not None else s["cache_hit_rate"]
        checks.append({"run": f"{policy} c={conc or 'all'}", "target": "radix-on hit rate >=",
                       "limit": TARGET_HIT_RATE, "value": hit,
                       "ok": None if hit is None else hit >= TARGET_HIT_RATE})
        off = by.get(("off", policy, mode, conc))
        ratio = None
        if off:
            on_ttft, off_ttft = s["ttft_ms"]["p50"], off["report"]["summary"]["ttft_ms"]["p50"]
            ratio = on_ttft / off_ttft if on_ttft is not None and off_ttft else None
        checks.append({"run": f"{policy} c={conc or 'all'}", "target": "TTFT p50 radix on / off <=",
                       "limit": TARGET_TTFT_RATIO, "value": ratio,
                       "ok": None if ratio is None else ratio <= TARGET_TTFT_RATIO})
    return checks


# ---- output -------------------------------------------------------------------------------
def _ms(d: dict[str, Any], q: str) -> str:
    return "-" if d[q] is None else f"{d[q]:.0f}"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    header = ("radix", "policy", "schedule", "concurrency", "ok / failed", "duration s", "req/s", "out tok/s",
              "hit rate", "TTFT p50 ms", "TTFT p99 ms", "TPOT p50 ms", "ITL p50 ms", "ITL p99 ms", "E2E p50 ms")
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for r in rows:
        s = r["report"]["summary"]
        hit = s["server_cache_hit_rate"] if s["server_cache_hit_rate"] is not None else s["cache_hit_rate"]
        cells = (
            r["radix"], r["policy"], r.get("schedule_mode", "mixed"), str(r["concurrency"] or "all"),
            f"{s['completed']} / {s['failed']}",
            f"{s['duration_s']:.1f}", f"{s['request_throughput']:.2f}", f"{s['output_throughput']:.1f}",
            "n/a" if hit is None else f"{hit:.1%}", _ms(s["ttft_ms"], "p50"), _ms(s["ttft_ms"], "p99"),
            _ms(s["tpot_ms"], "p50"), _ms(s["itl_ms"], "p50"), _ms(s["itl_ms"], "p99"), _ms(s["e2e_ms"], "p50"),
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_target_lines(checks: list[dict[str, Any]]) -> list[str]:
    return target_lines(checks, scope="run", value_format=".3f")


def plot_matrix(rows: list[dict[str, Any]], title: str, path: Path) -> None:
    """Bars across runs (TTFT p50, output throughput, hit rate) and TTFT distributions."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    labels = list(dict.fromkeys(r["label"] for r in rows))
    levels = list(dict.fromkeys(r["concurrency"] for r in rows))
    by = {(r["label"], r["concurrency"]): r["report"] for r in rows}

    def value(report: dict[str, Any], metric: str) -> float:
        s = report["summary"]
        if metric == "hit":
            hit = s["server_cache_hit_rate"] if s["server_cache_hit_rate"] is not None else s["cache_hit_rate"]
            return 100.0 * (hit or 0.0)
        if metric == "ttft":
            return s["ttft_ms"]["p50"] or 0.0
        return s["output_throughput"]

    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    x = np.arange(len(levels))
    width = 0.8 / max(1, len(labels))
    panels = (("ttft", "TTFT p50 (ms)"), ("tput", "output throughput (tok/s)"), ("hit", "cache hit rate (%)"))
    for ax, (metric, name) in zip(axes.flat, panels, strict=False):
        for i, label in enumerate(labels):
            heights = [value(by[(label, c)], metric) if (label, c) in by else 0.0 for c in levels]
            bars = ax.bar(x + i * width - 0.4 + width / 2, heights, width, label=label)
            ax.bar_label(bars, fmt=lambda v: f"{v:.0f}" if v >= 100 else f"{v:.1f}", fontsize=7)
        ax.set_xticks(x, [f"concurrency {c or 'all'}" for c in levels])
        ax.set_title(name)
    axes.flat[0].legend(fontsize=8)
    ax = axes.flat[3]
    styles = ("-", "--", ":", "-.")
    for r in rows:  # colour: the server configuration (as in the bars); line style: concurrency
        ttfts = sorted(q["ttft"] * 1000.0 for q in r["report"]["requests"] if q["ok"])
        if ttfts:
            ax.plot(ttfts, np.arange(1, len(ttfts) + 1) / len(ttfts),
                    color=f"C{labels.index(r['label']) % 10}",
                    linestyle=styles[levels.index(r["concurrency"]) % len(styles)],
                    label=f"{r['label']}, c={r['concurrency'] or 'all'}")
    ax.set_title("TTFT distribution (CDF)")
    ax.set_xlabel("ms")
    ax.set_xscale("log")
    ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---- command line -------------------------------------------------------------------------
def _choices(text: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    bad = [t for t in items if t not in allowed]
    if bad or not items:
        raise argparse.ArgumentTypeError(f"{flag}: choose from {','.join(allowed)}, got {text!r}")
    return items


def _concurrency(text: str) -> list[int | None]:
    levels: list[int | None] = []
    for t in (t.strip() for t in text.split(",") if t.strip()):
        if t == "all":
            levels.append(None)
        elif t.isdigit() and int(t) > 0:
            levels.append(int(t))
        else:
            raise argparse.ArgumentTypeError(f"--concurrency: 'all' or positive integers, got {t!r}")
    return levels


def parse_args(argv: list[str] | None = None, prog: str | None = None) -> tuple[argparse.Namespace, list[str]]:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--radix", type=lambda t: _choices(t, ("on", "off"), "--radix"), default=["on", "off"],
                   help="radix cache settings to run (default: on,off)")
    p.add_argument("--policies", type=lambda t: _choices(t, POLICIES, "--policies"), default=["lpm"],
                   help="schedule policies to run, e.g. lpm,fcfs (default: lpm)")
    p.add_argument("--schedule-modes", type=lambda t: _choices(t, SCHEDULE_MODES, "--schedule-modes"),
                   default=["mixed"], help="schedule modes to run, e.g. mixed,prefill-first (default: mixed)")
    p.add_argument("--concurrency", type=_concurrency, default=[None],
                   help="max-concurrency levels, 'all' = unlimited (default: all)")
    p.add_argument("--model", default=None, help="model the servers load (default: the embedded one)")
    p.add_argument("--tokenizer", default=None, help="tokenizer for the prompts (default: the model's)")
    p.add_argument("--server-args", type=shlex.split, default=[],
                   help="more flags for every 'radixserve serve', e.g. \"--max-total-tokens 40000\"")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "compare.json",
                   help="JSON report; the table (.md) and chart (.png) go beside it")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG chart")
    p.add_argument("--disable-tqdm", action="store_true", help="no progress bars")
    args, rest = p.parse_known_args(argv)
    for flag in ("--base-url", "--out", "--plot", "--max-concurrency", "--model", "--tokenizer"):
        if any(a == flag or a.startswith(flag + "=") for a in rest):
            p.error(f"{flag} is set by compare.py itself")
    serving.parse_args(rest, prog=f"{p.prog} (serving flags)")  # unknown flags fail here, early
    return args, rest


def main(argv: list[str] | None = None, prog: str | None = None) -> dict[str, Any]:
    args, serving_argv = parse_args(argv, prog)
    rows = run_matrix(args, serving_argv)
    first = rows[0]["report"]
    checks = check_targets(rows, first["workload"]["name"])
    table = markdown_table(rows)
    shape = serving.workload_text(first["workload"])
    print()
    print(f"workload: {shape}; {first['arrivals']}")
    print(table)
    for line in run_target_lines(checks):
        print(line)
    machine = machine_info()
    report = {
        "benchmark": "serving_compare",
        "machine": machine,
        "matrix": {"radix": args.radix, "policies": args.policies, "schedule_modes": args.schedule_modes,
                   "concurrency": args.concurrency,
                   "model": args.model or "default (SmolLM2-135M-Instruct)",
                   "server_args": args.server_args, "serving_args": serving_argv},
        "workload": first["workload"],
        "targets": checks,
        "runs": rows,
    }
    out: Path = args.out
    write_json(report, out)
    md = out.with_suffix(".md")
    cpu = f"{machine['cpus_usable'] or machine['cpu_count']} CPUs, {machine['processor'] or machine['machine']}"
    md.write_text(f"Workload: {shape}; {first['arrivals']}. Machine: {cpu}, torch {machine['torch']}"
                  f"{', GPU ' + machine['gpu'] if machine.get('gpu') else ''}.\n\n{table}\n\n"
                  + "".join(f"- {line}\n" for line in run_target_lines(checks)))
    written = [out, md]
    if not args.no_plot:
        png = out.with_suffix(".png")
        plot_matrix(rows, f"{shape}; {first['arrivals']}", png)
        written.append(png)
    print("wrote " + ", ".join(str(p) for p in written))
    return report


if __name__ == "__main__":
    PROG = os.environ.get(PROG_ENV)  # set by ``radixserve bench``
    try:
        sys.exit(0 if all(r["report"]["summary"]["completed"] for r in main(prog=PROG)["runs"]) else 1)
    except (RuntimeError, ValueError) as e:
        sys.exit(f"{PROG or 'compare.py'}: error: {e}")
