"""The report of ``bench/offline.py``: ratios between its rows, the table, the lines under it
and the target checks (printed, never asserted)."""

from __future__ import annotations

from typing import Any

from bench.common import align_columns, target
from bench.offline_breakdown import breakdown_targets

TARGET_COMPUTED_OVER_UNIQUE = 1.1
TARGET_SPEEDUP_VS_NO_RADIX = 4.0
TARGET_SPEEDUP_VS_HF = 5.0
TARGET_HIT_RATE = 0.85
TARGET_OVERHEAD_MS = 1.0
TARGET_SAMPLED_OVER_GREEDY = 1.15  # temperature / top_p on every row against greedy, same workload
TARGET_NGRAM_OVER_PLAIN = 1.05  # --speculative-algorithm ngram beside the default, greedy
# Wall time over the matmul floor on the shared-prefix workload, by dtype.
TARGET_WALL_OVER_FLOOR = {"bfloat16": 3.0, "float32": 2.0}


def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Ratios against the unique tokens and against the radix row of the same dtype."""
    radix = {r["dtype"]: r for r in rows if r["config"] == "radix"}
    for r in rows:
        r["computed_over_unique"] = r["prefill_computed"] / r["unique_tokens"]
        ref = radix.get(r["dtype"])
        r["speedup_of_radix"] = r["wall_s"] / ref["wall_s"] if ref else None
        r["outputs_match_radix"] = (
            sum(a == b for a, b in zip(r["output_ids"], ref["output_ids"], strict=True))
            / len(r["output_ids"])
            if ref and r["config"] != "radix-sampled"  # sampled outputs are not greedy ones
            else None
        )


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("config", "dtype", "wall s", "out tok/s", "prefill computed", "unique",
              "computed/unique", "hit rate", "speedup vs radix", "matmul GFLOP", "floor s", "wall/floor")
    lines = [header]
    for r in rows:
        speedup = "-" if r["speedup_of_radix"] is None else f"{r['speedup_of_radix']:.2f}x"
        floor = r.get("floor")  # radixserve rows only: their scheduler counts what it computed
        lines.append((
            r["config"], r["dtype"], f"{r['wall_s']:.2f}", f"{r['output_tok_per_s']:.1f}",
            str(r["prefill_computed"]), str(r["unique_tokens"]),
            f"{r['computed_over_unique']:.2f}", f"{r['hit_rate']:.1%}", speedup,
            f"{floor['flops'] / 1e9:.0f}" if floor else "-",
            f"{floor['floor_s']:.2f}" if floor else "-",
            f"{floor['wall_over_floor']:.1f}x" if floor else "-",
        ))
    return align_columns(lines, left=(0, 1))


def floor_lines(rows: list[dict[str, Any]]) -> list[str]:
    """The matmul rates each dtype's floor used (GFLOP/s)."""
    seen: dict[str, str] = {}
    for r in rows:
        if r.get("floor") and r["dtype"] not in seen:
            rates = ", ".join(f"{k} {v / 1e9:.0f}" for k, v in r["floor"]["rates_flop_per_s"].items())
            seen[r["dtype"]] = f"matmul rate ({r['dtype']}, {r['floor']['threads']} threads, GFLOP/s): {rates}"
    return list(seen.values())


def overhead_lines(rows: list[dict[str, Any]]) -> list[str]:
    lines = []
    for r in rows:
        if r["config"] != "radix":
            continue
        by_batch = r["stats"]["overhead_ms_by_batch"]
        largest = max(by_batch, key=int, default=None)
        at_largest = f"{by_batch[largest]:.2f} ms at batch {largest}" if largest else "no decode-only step"
        lines.append(
            f"scheduler overhead ({r['dtype']}, workload): {at_largest}; "
            f"{r['stats']['overhead_ms_per_step']:.2f} ms/step overall"
        )
        check = r.get("overhead_check")
        if check:
            at = check["overhead_ms_at_bucket"]
            at_text = "n/a" if at is None else f"{at:.2f} ms"
            lines.append(
                f"scheduler overhead ({r['dtype']}, decode check, {check['requests']} requests): "
                f"{at_text} at batch {check['bucket']}; {check['overhead_ms_per_step']:.2f} ms/step "
                f"overall; forward {check['forward_ms_per_step']:.1f} ms/step"
            )
    return lines


def agreement_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Greedy outputs identical to the radix run's (expected in float32; bf16 may drift)."""
    return [
        f"outputs equal to radix ({r['dtype']}): {r['config']} {r['outputs_match_radix']:.0%} of requests"
        for r in rows
        if r["config"] != "radix" and r["outputs_match_radix"] is not None
    ]


def check_targets(rows: list[dict[str, Any]], workload: str) -> list[dict[str, Any]]:
    """One entry per target and dtype: value, limit, ok (None when not measured).  The hit
    rate target is the shared-prefix workload's (a multi-turn one cannot reach it)."""
    checks = []
    by = {(r["config"], r["dtype"]): r for r in rows}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        radix = by.get(("radix", dtype))
        if radix is None:
            continue
        checks.append(target(dtype, "radix computed/unique <=", radix["computed_over_unique"],
                             TARGET_COMPUTED_OVER_UNIQUE, at_least=False))
        # The default (C++ kernels) against the torch path it replaces, on this CPU: a kernel
        # slower than the fallback here must not be the default here.
        fallback = by.get(("radix-torch", dtype))
        checks.append(target(dtype, "radix wall / radix-torch wall <=",
                             radix["wall_s"] / fallback["wall_s"] if fallback else None, 1.0, at_least=False))
        sampled = by.get(("radix-sampled", dtype))
        checks.append(target(dtype, "radix-sampled wall / radix wall <=",
                             sampled["wall_s"] / radix["wall_s"] if sampled else None, TARGET_SAMPLED_OVER_GREEDY,
                             at_least=False))
        # n-gram drafts are for few running requests: a batch of many must not pay for them.
        ngram = by.get(("radix-ngram", dtype))
        checks.append(target(dtype, "radix-ngram wall / radix wall <=",
                             ngram["wall_s"] / radix["wall_s"] if ngram else None, TARGET_NGRAM_OVER_PLAIN,
                             at_least=False))
        for other, limit in (("no-radix", TARGET_SPEEDUP_VS_NO_RADIX), ("hf-static", TARGET_SPEEDUP_VS_HF)):
            row = by.get((other, dtype))
            speedup = row["speedup_of_radix"] if row else None
            checks.append(target(dtype, f"{other} wall / radix wall >=", speedup, limit, at_least=True))
        if workload == "shared-prefix":
            checks.append(target(dtype, "radix hit rate >=", radix["hit_rate"], TARGET_HIT_RATE, at_least=True))
            if dtype in TARGET_WALL_OVER_FLOOR:
                floor = radix.get("floor")
                checks.append(target(dtype, "radix wall / matmul floor <=",
                                     floor["wall_over_floor"] if floor else None,
                                     TARGET_WALL_OVER_FLOOR[dtype], at_least=False))
        check = radix.get("overhead_check") or {}
        bucket = check.get("bucket", "64")
        value = check.get("overhead_ms_at_bucket", radix["stats"]["overhead_ms_by_batch"].get("64"))
        checks.append(target(dtype, f"scheduler overhead ms at batch {bucket} <=", value,
                             TARGET_OVERHEAD_MS, at_least=False))
    return checks + breakdown_targets(rows)
