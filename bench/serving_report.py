"""Summaries, the terminal report and latency charts for ``bench/serving.py``."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bench.serving import RequestResult

LATENCIES = (("ttft", "TTFT"), ("tpot", "TPOT"), ("itl", "ITL"), ("e2e", "E2E latency"))


def distribution(values: list[float]) -> dict[str, float | None]:
    """mean / p50 / p90 / p99 in milliseconds (None when there are no values)."""
    import numpy as np

    if not values:
        return {"mean": None, "p50": None, "p90": None, "p99": None}
    ms = np.asarray(values, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {"mean": float(ms.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}


def summarize(results: list[RequestResult], duration: float, server: dict[str, Any]) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    reported = [r for r in ok if r.cached_tokens is not None]
    prompt_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    reported_prompt = sum(r.prompt_tokens for r in reported)
    cached = sum(r.cached_tokens or 0 for r in reported)
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    per_s = (lambda n: n / duration) if duration > 0 else (lambda n: 0.0)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "request_throughput": per_s(len(ok)),
        "input_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "cached_tokens": cached,
        "input_throughput": per_s(prompt_tokens),
        "output_throughput": per_s(output_tokens),
        "total_throughput": per_s(prompt_tokens + output_tokens),
        "concurrency": sum(r.latency for r in ok) / duration if duration > 0 else 0.0,
        "short_outputs": sum(r.output_tokens < r.requested_output for r in ok),
        "cache_hit_rate": cached / reported_prompt if reported_prompt else None,
        "server_cache_hit_rate": server.get("hit_rate"),
        "ttft_ms": distribution([r.ttft for r in ok]),
        "tpot_ms": distribution([t for r in ok if (t := r.tpot) is not None]),
        "itl_ms": distribution([g for r in ok for g in r.itl]),
        "e2e_ms": distribution([r.latency for r in ok]),
        "errors": [{"error": e, "count": n} for e, n in sorted(errors.items(), key=lambda kv: -kv[1])][:20],
    }


def arrival_text(args: argparse.Namespace) -> str:
    if args.workload == "trace":
        return f"trace times / {args.trace_speedup:g}"
    if math.isinf(args.request_rate):
        return "all at once"
    return f"Poisson {args.request_rate:g} req/s"


def traffic_text(args: argparse.Namespace) -> str:
    return f"{arrival_text(args)}, max concurrency {args.max_concurrency or 'unlimited'}"


def _pct(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.1%}"


def workload_text(w: dict[str, Any]) -> str:
    """e.g. ``shared-prefix G=4 P=16 S=1024 Q=48 O=32``."""
    if w["name"] == "shared-prefix":
        shape = (f"G={w['groups']} P={w['questions']} S={w['system_len']} Q={w['question_len']} "
                 f"O={w['output_len']}")
    elif w["name"] == "multi-turn":
        shape = (f"C={w['conversations']} T={w['turns']} S={w['system_len']} Q={w['question_len']} "
                 f"O={w['output_len']}")
    elif w["name"] == "no-reuse":
        shape = f"N={w['num_prompts']} I={w['input_len']} O={w['output_len']}"
    else:
        shape = str(w["trace_file"])
    return f"{w['name']} {shape}"


def format_report(report: dict[str, Any]) -> str:
    s, w = report["summary"], report["workload"]
    rows = [
        ("Workload", workload_text(w)),
        ("Traffic", report["traffic"]),
        ("Server", f"{report['base_url']} ({report['model']})"),
        ("Successful requests", str(s["completed"])),
        ("Failed requests", str(s["failed"])),
        ("Duration (s)", f"{s['duration_s']:.2f}"),
        ("Request throughput (req/s)", f"{s['request_throughput']:.2f}"),
        ("Input token throughput (tok/s)", f"{s['input_throughput']:.1f}"),
        ("Output token throughput (tok/s)", f"{s['output_throughput']:.1f}"),
        ("Total token throughput (tok/s)", f"{s['total_throughput']:.1f}"),
        ("Mean concurrency", f"{s['concurrency']:.2f}"),
        ("Cache hit rate (usage)", _pct(s["cache_hit_rate"])),
        ("Cache hit rate (/metrics)", _pct(s["server_cache_hit_rate"])),
    ]
    if "ideal_hit_rate" in w:
        rows.append(("Ideal hit rate (unique tokens)", _pct(w["ideal_hit_rate"])))
    if s["short_outputs"]:
        rows.append(("Outputs shorter than asked", str(s["short_outputs"])))
    title = " Serving Benchmark Result "
    lines = [title.center(62, "=")] + [f"{k + ':':<40}{v:>22}" for k, v in rows]
    lines.append(f"{'latency (ms)':<22}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    for key, label in LATENCIES:
        d = s[f"{key}_ms"]
        cells = "".join("       n/a" if d[q] is None else f"{d[q]:>10.1f}" for q in ("mean", "p50", "p90", "p99"))
        lines.append(f"{label:<22}{cells}")
    for e in s["errors"][:5]:
        lines.append(f"error x{e['count']}: {e['error']}")
    lines.append("=" * 62)
    return "\n".join(lines)


def plot_latencies(results: list[RequestResult], title: str, path: Path) -> None:
    """Histograms of TTFT, TPOT, ITL and E2E latency, with p50 / p99 marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    ok = [r for r in results if r.ok]
    series = {
        "TTFT": [r.ttft for r in ok],
        "TPOT": [t for r in ok if (t := r.tpot) is not None],
        "ITL": [g for r in ok for g in r.itl],
        "E2E latency": [r.latency for r in ok],
    }
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (name, values) in zip(axes.flat, series.items(), strict=True):
        ax.set_title(name)
        ax.set_xlabel("ms")
        ax.set_ylabel("requests" if name in ("TTFT", "TPOT", "E2E latency") else "token gaps")
        if not values:
            ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
            continue
        ms = np.asarray(values) * 1000.0
        ax.hist(ms, bins=min(40, max(5, len(ms) // 2)), color="#4c72b0")
        for q, style in ((50, "--"), (99, ":")):
            v = float(np.percentile(ms, q))
            ax.axvline(v, color="black", linestyle=style, label=f"p{q} {v:.1f}")
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
