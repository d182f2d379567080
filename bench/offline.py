"""Offline shared-prefix benchmark: radixserve with and without the radix cache vs HF generate.

Workload (SGLang's "generated-shared-prefix" shape): ``G`` groups, each one system prompt of
``S`` tokens followed by ``P`` questions of ``Q`` tokens; ``O`` greedy output tokens per
request (``ignore_eos``). Prompts are cut from real English text (standard-library docstrings,
see ``bench/workloads.py``) to exact token counts. Requests are interleaved across groups
(g0q0, g1q0, ..., g0q1, ...) and submitted at once as one ``Engine.generate`` batch.

Configurations, each in every ``--dtypes`` entry, each with a fresh model:
  radix      radixserve, radix cache on (defaults)
  no-radix   radixserve, ``disable_radix_cache=True``
  hf-static  transformers ``generate`` in static left-padded batches of ``--hf-batch``

Wall time runs from submit to the last result (model load, engine start and a one-request
warm-up excluded). A decode-only phase on the radix engine (``--overhead-check``: 64 short
prompts, 32 output tokens) measures the scheduler overhead per step at 64 running requests.

    python bench/offline.py                    # full run (many minutes on a CPU)
    python bench/offline.py --quick            # tiny smoke run
    python bench/offline.py --dtypes float32,bfloat16 --configs radix,no-radix
"""

from __future__ import annotations

import argparse
import sys
import time
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
from bench.workloads import (  # noqa: E402
    SharedPrefixWorkload,
    shared_prefix_workload,
    short_prompts,
)

CONFIGS = ("radix", "no-radix", "hf-static")
DTYPES = ("float32", "bfloat16", "float16")
# Counters of SchedulerStats that add up over requests, so a warm-up can be subtracted.
ADDITIVE_STATS = (
    "requests_finished", "prompt_tokens", "cached_tokens", "prefill_tokens_computed",
    "decode_tokens", "generation_tokens", "forward_steps", "decode_steps", "mixed_steps",
    "retractions", "evicted_tokens", "forward_seconds", "step_seconds",
)
TARGET_COMPUTED_OVER_UNIQUE = 1.1
TARGET_SPEEDUP_VS_NO_RADIX = 4.0
TARGET_SPEEDUP_VS_HF = 5.0
TARGET_HIT_RATE = 0.85
TARGET_OVERHEAD_MS = 2.0
WARMUP_TEXT_IDS = [504, 3575, 314, 4649, 314]  # any few ids outside the timed workload


# ---- radixserve ----------------------------------------------------------------------------
def stats_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Scheduler stats of what ran between two ``get_stats`` snapshots, derived values redone."""
    d: dict[str, Any] = {k: after[k] - before[k] for k in ADDITIVE_STATS}
    by_batch: dict[str, list[float]] = {}
    for bucket, (steps, seconds) in after["overhead_by_batch"].items():
        steps0, seconds0 = before["overhead_by_batch"].get(bucket, (0, 0.0))
        if steps > steps0:
            by_batch[bucket] = [steps - steps0, seconds - seconds0]
    d["overhead_by_batch"] = by_batch
    d["cache_hit_rate"] = d["cached_tokens"] / d["prompt_tokens"] if d["prompt_tokens"] else 0.0
    outside = d["step_seconds"] - d["forward_seconds"]
    d["overhead_ms_per_step"] = 1000 * outside / d["forward_steps"] if d["forward_steps"] else 0.0
    d["overhead_ms_by_batch"] = {
        k: 1000 * s / n for k, (n, s) in sorted(by_batch.items(), key=lambda kv: int(kv[0]))
    }
    return d


def greedy_params(output_len: int) -> dict[str, Any]:
    return {"max_new_tokens": output_len, "temperature": 0, "ignore_eos": True}


def timed_generate(engine: Any, prompts: list[list[int]], output_len: int) -> tuple[float, list, dict]:
    """(wall seconds, results, stats delta) of one batch submitted at once."""
    before = engine.get_stats()
    t0 = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=greedy_params(output_len))
    wall = time.perf_counter() - t0
    return wall, results, stats_delta(before, engine.get_stats())


def run_radixserve(
    config: str, dtype: str, work: SharedPrefixWorkload, args: argparse.Namespace, tokenizer: Any
) -> dict[str, Any]:
    from radixserve import Engine

    settings: dict[str, Any] = {"dtype": dtype, "disable_radix_cache": config == "no-radix"}
    for name in ("max_total_tokens", "chunked_prefill_size", "max_running_requests"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    t0 = time.perf_counter()
    with Engine(model=args.model, **settings) as engine:
        start_s = time.perf_counter() - t0
        engine.generate(input_ids=WARMUP_TEXT_IDS, sampling_params=greedy_params(2))
        if not engine.flush_cache():
            raise RuntimeError("flush_cache refused after the warm-up")
        wall, results, stats = timed_generate(engine, work.prompts, args.output_len)
        memory = engine.check_memory()
        row = make_row(config, dtype, work, args.output_len, wall, results_ids(results))
        row.update(
            prefill_computed=stats["prefill_tokens_computed"],
            hit_rate=stats["cache_hit_rate"],
            engine_start_s=start_s,
            engine_settings=settings,
            memory_invariant_ok=bool(memory.get("ok")),
            stats=stats,
        )
        if config == "radix" and args.overhead_check:
            if not engine.flush_cache():
                raise RuntimeError("flush_cache refused before the overhead check")
            row["overhead_check"] = overhead_check(engine, tokenizer, args)
    return row


def overhead_check(engine: Any, tokenizer: Any, args: argparse.Namespace) -> dict[str, Any]:
    """Decode-only phase: many short requests at once, scheduler time per step outside forward."""
    prompts = short_prompts(tokenizer, args.overhead_requests, args.overhead_prompt_len, args.seed)
    wall, _, stats = timed_generate(engine, prompts, args.overhead_output_len)
    bucket = str(1 << max(0, (args.overhead_requests - 1).bit_length()))
    return {
        "requests": args.overhead_requests,
        "prompt_len": args.overhead_prompt_len,
        "output_len": args.overhead_output_len,
        "wall_s": wall,
        "bucket": bucket,
        "overhead_ms_at_bucket": stats["overhead_ms_by_batch"].get(bucket),
        "overhead_ms_per_step": stats["overhead_ms_per_step"],
        "overhead_ms_by_batch": stats["overhead_ms_by_batch"],
        "forward_ms_per_step": 1000 * stats["forward_seconds"] / max(stats["forward_steps"], 1),
    }


# ---- Hugging Face static batching ----------------------------------------------------------
def hf_generate(model: Any, batch: list[list[int]], out_len: int, pad_id: int) -> list[list[int]]:
    """Greedy ``generate`` of one left-padded static batch; exactly ``out_len`` new tokens each."""
    import torch

    width = max(len(p) for p in batch)
    # Row i: [0, width - len(p)) pads hidden by the mask, [width - len(p), width) the prompt.
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, p in enumerate(batch):
        ids[i, width - len(p):] = torch.tensor(p)
        mask[i, width - len(p):] = 1
    with torch.inference_mode():
        out = model.generate(
            input_ids=ids.to(model.device), attention_mask=mask.to(model.device), do_sample=False,
            max_new_tokens=out_len, min_new_tokens=out_len, pad_token_id=pad_id,
        )
    return out[:, width:].tolist()


def run_hf_static(
    dtype: str, work: SharedPrefixWorkload, args: argparse.Namespace, model_path: str, pad_id: int
) -> dict[str, Any]:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    load_s = time.perf_counter() - t0
    hf_generate(model, [WARMUP_TEXT_IDS], 2, pad_id)
    batches = [work.prompts[i: i + args.hf_batch] for i in range(0, work.num_requests, args.hf_batch)]
    outputs: list[list[int]] = []
    t0 = time.perf_counter()
    for batch in tqdm(batches, desc=f"hf-static {dtype}", unit="batch", disable=args.no_progress):
        outputs.extend(hf_generate(model, batch, args.output_len, pad_id))
    wall = time.perf_counter() - t0
    row = make_row("hf-static", dtype, work, args.output_len, wall, outputs)
    row.update(
        # Static batches compute every padded position: batch size x longest prompt.
        prefill_computed=sum(len(b) * max(len(p) for p in b) for b in batches),
        hit_rate=0.0,
        model_load_s=load_s,
        hf_batch=args.hf_batch,
        device=device,
    )
    return row


# ---- report --------------------------------------------------------------------------------
def results_ids(results: list[dict[str, Any]]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def make_row(
    config: str, dtype: str, work: SharedPrefixWorkload, out_len: int, wall: float, outputs: list
) -> dict[str, Any]:
    produced = sum(len(o) for o in outputs)
    return {
        "config": config,
        "dtype": dtype,
        "wall_s": wall,
        "output_tokens": produced,
        "all_outputs_full_length": all(len(o) == out_len for o in outputs),
        "output_tok_per_s": work.num_requests * out_len / wall,
        "unique_tokens": work.unique_tokens,
        "output_ids": outputs,
    }


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
            if ref
            else None
        )


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("config", "dtype", "wall s", "out tok/s", "prefill computed", "unique",
              "computed/unique", "hit rate", "speedup vs radix")
    lines = [header]
    for r in rows:
        speedup = "-" if r["speedup_of_radix"] is None else f"{r['speedup_of_radix']:.2f}x"
        lines.append((
            r["config"], r["dtype"], f"{r['wall_s']:.2f}", f"{r['output_tok_per_s']:.1f}",
            str(r["prefill_computed"]), str(r["unique_tokens"]),
            f"{r['computed_over_unique']:.2f}", f"{r['hit_rate']:.1%}", speedup,
        ))
    return align_columns(lines, left=(0, 1))


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


def check_targets(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One entry per target and dtype: value, limit, ok (None when not measured)."""
    checks = []
    by = {(r["config"], r["dtype"]): r for r in rows}
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        radix = by.get(("radix", dtype))
        if radix is None:
            continue
        checks.append(target(dtype, "radix computed/unique <=", radix["computed_over_unique"],
                             TARGET_COMPUTED_OVER_UNIQUE, at_least=False))
        for other, limit in (("no-radix", TARGET_SPEEDUP_VS_NO_RADIX), ("hf-static", TARGET_SPEEDUP_VS_HF)):
            row = by.get((other, dtype))
            speedup = row["speedup_of_radix"] if row else None
            checks.append(target(dtype, f"{other} wall / radix wall >=", speedup, limit, at_least=True))
        checks.append(target(dtype, "radix hit rate >=", radix["hit_rate"], TARGET_HIT_RATE, at_least=True))
        check = radix.get("overhead_check") or {}
        bucket = check.get("bucket", "64")
        value = check.get("overhead_ms_at_bucket", radix["stats"]["overhead_ms_by_batch"].get("64"))
        checks.append(target(dtype, f"scheduler overhead ms at batch {bucket} <=", value,
                             TARGET_OVERHEAD_MS, at_least=False))
    return checks


# ---- command line --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--groups", "-G", type=int, default=4, help="system prompts (groups)")
    p.add_argument("--questions", "-P", type=int, default=16, help="questions per group")
    p.add_argument("--system-len", "-S", type=int, default=1024, help="tokens per system prompt")
    p.add_argument("--question-len", "-Q", type=int, default=48, help="tokens per question")
    p.add_argument("--output-len", "-O", type=int, default=32, help="output tokens per request")
    p.add_argument("--seed", type=int, default=0, help="seeds the choice of text")
    p.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    p.add_argument("--dtypes", default="float32", help="comma list, e.g. float32,bfloat16")
    p.add_argument("--hf-batch", type=int, default=16, help="static batch size of hf-static")
    p.add_argument("--model", default=None, help="HF model folder (default: the embedded model)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="radixserve KV pool size")
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--overhead-check", action=argparse.BooleanOptionalAction, default=True,
                   help="decode-only phase on the radix engine to measure scheduler overhead")
    p.add_argument("--overhead-requests", type=int, default=64)
    p.add_argument("--overhead-prompt-len", type=int, default=32)
    p.add_argument("--overhead-output-len", type=int, default=32)
    p.add_argument("--quick", action="store_true", help="tiny smoke run (G=2 P=2 S=64 Q=8 O=4)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar for hf-static")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "offline.json")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.questions, args.system_len, args.question_len, args.output_len = 2, 2, 64, 8, 4
        args.overhead_requests, args.overhead_prompt_len, args.overhead_output_len = 8, 16, 4
        args.hf_batch = min(args.hf_batch, 2)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [c for c in args.configs if c not in CONFIGS] + [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.configs or not args.dtypes:
        p.error(f"unknown or empty --configs/--dtypes {bad}; configs {CONFIGS}, dtypes {DTYPES}")
    for name in ("groups", "questions", "system_len", "question_len", "output_len", "hf_batch",
                 "overhead_requests", "overhead_prompt_len", "overhead_output_len"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from radixserve.model.default_model import default_model_path

    model_path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    work = shared_prefix_workload(
        tokenizer, args.groups, args.questions, args.system_len, args.question_len, args.seed
    )
    print(
        f"workload: {work.groups} groups x {work.questions} questions, system {work.system_len} + "
        f"question {work.question_len} tokens, {args.output_len} out; {work.num_requests} requests, "
        f"{work.prompt_tokens} prompt tokens, {work.unique_tokens} unique"
    )
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runs = [(d, c) for d in args.dtypes for c in args.configs]
    rows = []
    for i, (dtype, config) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {config} {dtype} ...", flush=True)
        if config == "hf-static":
            row = run_hf_static(dtype, work, args, model_path, pad_id)
        else:
            row = run_radixserve(config, dtype, work, args, tokenizer)
        print(f"[{i}/{len(runs)}] {config} {dtype}: {row['wall_s']:.2f} s, "
              f"{row['prefill_computed']} prefill tokens computed", flush=True)
        rows.append(row)
    finish_rows(rows)
    checks = check_targets(rows)
    print()
    print(format_table(rows))
    for line in overhead_lines(rows) + agreement_lines(rows) + target_lines(checks):
        print(line)
    report = {
        "benchmark": "offline_shared_prefix",
        "params": args_params(args),
        "machine": machine_info(),
        "workload": {
            "requests": work.num_requests,
            "prompt_tokens": work.prompt_tokens,
            "unique_tokens": work.unique_tokens,
            "output_tokens": work.num_requests * args.output_len,
            "text_source": "Python standard-library docstrings (bench/workloads.py)",
        },
        "results": [{k: v for k, v in r.items() if k != "output_ids"} for r in rows],
        "speedups": {
            f"{r['config']}/radix {r['dtype']}": r["speedup_of_radix"]
            for r in rows
            if r["config"] != "radix" and r["speedup_of_radix"] is not None
        },
        "targets": checks,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
