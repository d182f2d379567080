"""The closing table of bench/gpu_check.sh: every check of a GPU proof run against its target,
read from the files the run left in the results folder:

  gpu-steps-<gpu>.tsv           each step's exit code and seconds (or why it was left out)
  gpu-junit-<test>-<gpu>.xml    each test file's JUnit XML (passed, failed, skipped)
  gpu-e2e-<gpu>.json            bench/gpu_e2e.py: parity, sync debug, KV memory, shared prefix, decode
  kernels-<gpu>.json            bench/kernels.py: the kernel targets, the device ceilings, and the
                                plain decode against the cascade over a shared prefix

A file older than ``--since`` is from an earlier run and counts as missing.  bench/gpu_e2e.py
prints its own rows (``e2e_rows``) at the end of its run.  No torch needed: it only reads files.

    python bench/gpu_summary.py --slug NVIDIA-H200 --since 1767000000
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.common import align_columns  # noqa: E402

HALF_MEAN, HALF_MAX = 0.1, 0.5  # nats: bfloat16 / float16 teacher-forced logprobs vs float32
GRAPH_TARGET = (64, 2.0)  # 8B-shaped decode at batch 64: tokens/s with CUDA graphs >= 2x eager
KERNEL_TARGETS = (  # bench/kernels.py's "targets" keys, what they are, limit (%)
    ("decode_b64_ctx4096_pct_of_copy", "decode B=64 ctx=4096, % of copy bandwidth", 70.0),
    ("extend_4096_pct_of_matmul", "extend 4096 new tokens, % of bf16 matmul rate", 40.0),
)
CASCADE_MAX_ERR = 1e-2  # cascade decode vs plain decode, relative error (bf16); no speed target


def check(part: str, what: str, value: str, target: str = "-", ok: bool | None = None) -> dict[str, Any]:
    return {"part": part, "check": what, "value": value, "target": target, "ok": ok}


def fmt(x: float | None, spec: str = ".0f") -> str:
    return "-" if x is None else format(x, spec)


def table(rows: list[dict[str, Any]]) -> str:
    verdict = {True: "PASS", False: "FAIL", None: "-"}
    lines = [["part", "check", "value", "target", "verdict"]]
    lines += [[r["part"], r["check"], r["value"], r["target"], verdict[r["ok"]]] for r in rows]
    counts = {v: sum(r["ok"] is k for r in rows) for k, v in verdict.items()}
    return align_columns(lines, left={0, 1, 2, 3}) + f"\n{counts['PASS']} PASS, {counts['FAIL']} FAIL"


# ---- bench/gpu_e2e.py's report -----------------------------------------------------------------
def e2e_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The checks of one gpu_e2e.py report, with their targets."""
    parts, rows = report["parts"], []
    for name, p in parts.items():
        if p["status"] != "ok":
            rows.append(check(name, "part", f"{p['status']}: {p.get('error', '')}"[:100], "completes", False))
    for r in parts.get("parity", {}).get("rows", []):
        if "error" in r:
            value, target = f"error: {r['error']}"[:100], "runs"
        elif r["dtype"] == "float32":
            value = "identical" if r["identical"] else f"differ from token {min(r['greedy_match'])}"
            target = "identical"
        else:
            value = f"mean {r['mean_abs_dlogprob']:.3f}, max {r['max_abs_dlogprob']:.3f}"
            target = f"<= {HALF_MEAN:g}, <= {HALF_MAX:g}"
        yardstick = r.get("yardstick", False)
        what = f"{r['system']} vs {r['against']}" + (" (yardstick)" if yardstick else "")
        rows.append(check(f"parity {r['dtype']}", what, value, target, None if yardstick else r["ok"]))
    sync = report["sync"]
    acts = sync["acts"] and sync["mode"] != "off"
    value = str(sync["sync_errors"]) + ("" if acts else " (acts on CUDA only)")
    if sync["sync_errors"]:  # what synced, and where sync debug was turned off for the rest
        first = next(f for f in sync["failures"] if "synchroniz" in f["error"])
        value += f" ({first['part']}/{first['engine']}: {first['error'][:60]}; off after {sync['turned_off_at']})"
    rows.append(check("sync debug", f"requests failed on a host-device sync ({sync['mode']})", value, "0",
                      sync["sync_errors"] == 0 if acts else None))
    if sync["other_failures"]:
        rows.append(check("sync debug", "requests failed otherwise", str(sync["other_failures"]), "0", False))
    engines = report["engines"]
    rows.append(check("engines", "KV memory invariant at shutdown",
                      f"{sum(bool(e.get('memory_ok')) for e in engines)} of {len(engines)}", "all",
                      all(e.get("memory_ok") for e in engines) if engines else None))
    sp = parts.get("shared_prefix", {})
    for r in sp.get("runs", []):
        rows.append(check("shared prefix", f"{r['config']}: {sp['requests']} x ({sp['system_len']} shared + "
                          f"{sp['question_len']})", f"{r['wall_s']:.2f} s, {r['total_tokens_per_s']:.0f} tok/s, "
                          f"{r['cached_tokens']} cached"))
    if "speedup" in sp:
        rows.append(check("shared prefix", "radix cache on vs off, wall time", f"{sp['speedup']:.2f}x"))
    for name in ("decode_default", "decode_llama"):
        d = parts.get(name, {})
        if not d.get("rows"):
            continue
        by = {(r["batch"], r["cuda_graphs"]): r["decode_tokens_per_s"] for r in d.get("rows", [])}
        for b in sorted({b for b, _ in by}):
            on, off = by.get((b, True)), by.get((b, False))
            ratio = on / off if on and off else None
            value = f"graphs {fmt(on)}, eager {fmt(off)} tok/s ({fmt(ratio, '.2f')}x)"
            if report.get("device") == "cpu":
                value += ", one engine (CPU)"
            is_target = d.get("llama") == "8b" and b == GRAPH_TARGET[0]
            target = f">= {GRAPH_TARGET[1]:g}x" if is_target else "-"
            ok = (ratio >= GRAPH_TARGET[1] if ratio else False) if is_target else None
            what = f"batch {b}, {d['prompt_len']} + {d['decode_len']} tokens"
            rows.append(check(f"decode {d['model']}, {d['dtype']}", what, value, target, ok))
    return rows


# ---- bench/kernels.py's report -----------------------------------------------------------------
def kernel_rows(report: dict[str, Any]) -> list[dict[str, Any]]:
    targets = report.get("targets", {})
    rows = []
    for key, what, limit in KERNEL_TARGETS:
        value = targets.get(key)
        rows.append(check("kernels", what, fmt(value, ".1f") + ("%" if value is not None else ""),
                          f">= {limit:g}%", None if value is None else value >= limit))
    for r in report.get("results", []):
        if r.get("kernel") == "cascade-decode":  # checked for its error only: the speedup is shown
            rows.append(check("kernels", f"cascade decode B={r['batch']} shared={r['shared']} own={r['own']}",
                              f"x{r['speedup']:.2f} (plain {r['plain_forward_ms']:.3f} ms, cascade "
                              f"{r['cascade_forward_ms']:.3f} ms), err {r['rel_err']:.1e}",
                              f"err <= {CASCADE_MAX_ERR:g}", r["rel_err"] <= CASCADE_MAX_ERR))
    rows.append(check("kernels", "device ceilings", f"copy {fmt(report.get('copy_gbps'))} GB/s, "
                      f"bf16 matmul {fmt(report.get('matmul_tflops'))} TFLOP/s"))
    return rows


# ---- gpu_check.sh's steps ----------------------------------------------------------------------
def junit_counts(path: Path) -> dict[str, int]:
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    return {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}


def step_rows(results: Path, slug: str, fresh: Callable[[Path], bool]) -> list[dict[str, Any]]:
    """One row per test file (from its JUnit XML) and per other step that did not exit 0."""
    steps = results / f"gpu-steps-{slug}.tsv"
    if not fresh(steps):
        return [check("steps", steps.name, "missing", "present", False)]
    rows = []
    for line in steps.read_text().splitlines():
        name, rc, seconds = line.split("\t")
        limit = " (time limit)" if rc in ("124", "137") else ""
        if not rc.lstrip("-").isdigit():  # a step left out: why, in words
            rows.append(check("tests", name, rc) if name.startswith("test_") else check(name, "step", rc))
        elif name.startswith("test_"):
            xml = results / f"gpu-junit-{name}-{slug}.xml"
            if not fresh(xml):
                rows.append(check("tests", name, f"no report, exit {rc}{limit} after {seconds} s", "all pass", False))
                continue
            c = junit_counts(xml)
            bad = c["failures"] + c["errors"]
            value = (f"{c['tests'] - bad - c['skipped']} passed, {bad} failed, {c['skipped']} skipped, "
                     f"{seconds} s{limit}")
            rows.append(check("tests", name, value, "all pass", None if rc == "5" else rc == "0" and bad == 0))
        elif rc != "0":
            rows.append(check(name, "step", f"exit {rc}{limit} after {seconds} s", "exit 0", False))
    return rows


def summary_rows(results: Path, slug: str, since: float) -> list[dict[str, Any]]:
    """Every check of the run: its steps, then gpu_e2e.py's and bench/kernels.py's reports."""

    def fresh(path: Path) -> bool:  # written by this run, not left from an earlier one
        return path.is_file() and path.stat().st_mtime >= since

    rows = step_rows(results, slug, fresh)
    for step, to_rows in (("e2e", e2e_rows), ("kernels", kernel_rows)):
        path = results / f"{'gpu-e2e' if step == 'e2e' else 'kernels'}-{slug}.json"
        missing = [check(step, path.name, "missing", "present", False)]
        rows += to_rows(json.loads(path.read_text())) if fresh(path) else missing
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="gpu_summary.py", description="gpu_check.sh's closing table, from the files of one run")
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results", help="the results folder")
    p.add_argument("--slug", required=True, help="the GPU's name in the file names, e.g. NVIDIA-H200")
    p.add_argument("--since", type=float, default=0.0, help="ignore files older than this (epoch s)")
    args = p.parse_args(argv)
    print(table(summary_rows(args.results, args.slug, args.since)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
