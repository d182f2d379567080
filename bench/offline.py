"""Offline benchmark: radixserve with and without the radix cache vs HF generate.

Workloads (``--workload``), ``O`` greedy output tokens per request (``ignore_eos``), prompts
cut from real English text (standard-library docstrings, see ``bench/workloads.py``) to exact
token counts:
  shared-prefix  SGLang's "generated-shared-prefix" shape: ``G`` groups, each one system
                 prompt of ``S`` tokens followed by ``P`` questions of ``Q`` tokens; requests
                 interleaved across groups (g0q0, g1q0, ..., g0q1, ...), one batch
  multi-turn     ``C`` conversations of ``T`` turns, each its own system prompt of ``S``
                 tokens; turn ``t`` resends the history (system, earlier questions and
                 answers) and question ``t`` of ``Q`` tokens; the conversations' turn ``t`` is
                 one batch, submitted once turn ``t - 1`` is done

Configurations, each in every ``--dtypes`` entry, each with a fresh model:
  radix        radixserve, radix cache on (defaults: on a CPU the C++ kernels)
  radix-torch  radixserve, radix cache on, pure torch (``RADIXSERVE_CPU_KERNELS=0``: attention
               by SDPA over gathered K/V, unfused norms/RoPE/activation), the pre-kernel path
  radix-sampled  radixserve, radix cache on, every request sampled (temperature 0.7, top_p 0.9,
               seeded) instead of greedy: the sampler's cost beside the greedy run's
  radix-ngram  radixserve, radix cache on, n-gram speculative decoding (same greedy tokens)
  radix-int8kv radixserve, radix cache on, the KV cache in int8 (``--kv-cache-dtype int8``)
  radix-gguf   radixserve, radix cache on, the GGUF's own Q4_1 / Q8_0 blocks as the weights
               (``--quantization gguf``, what ``auto`` picks for the default model on a CPU);
               the other configs run the float weights (``--quantization none``)
  no-radix     radixserve, ``disable_radix_cache=True``
  hf-static  transformers ``generate`` in static left-padded batches of ``--hf-batch``

Wall time runs from each batch's submit to its last result, summed over the turns (model
load, engine start and a one-request warm-up excluded). A decode-only phase on the radix engine
(``--overhead-check``: 64 short prompts, 32 output tokens) measures the scheduler overhead per
step at 64 running requests.

Floor (``bench/matmul_floor.py``): the run's matmul FLOPs, from the tokens the scheduler
computed, at the matmul rate this machine gives the model's own shapes in that dtype (timed in
this process, on the scheduler's thread count, once per dtype); the table shows wall / floor.

``--breakdown`` (``bench/offline_breakdown.py``): after the timed run, separate profiled passes
(torch.profiler in the scheduler) split the step time into attention / linear / other /
scheduler / sampling, for the workload and for a decode step of the shared-prefix prompts (64
requests with 1k-token prefixes by default); the profiler's overhead stays out of the wall times.

    python bench/offline.py                    # full run (many minutes on a CPU)
    python bench/offline.py --quick            # tiny smoke run
    python bench/offline.py --dtypes float32,bfloat16 --configs radix,no-radix
    python bench/offline.py --configs radix --dtypes bfloat16,float32 --breakdown
    python bench/offline.py --workload multi-turn --conversations 16 --turns 4
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.common import args_params, cpu_kind, machine_info, target_lines, write_report  # noqa: E402
from bench.matmul_floor import MatmulShapes, matmul_floor, matmul_rates, model_matmul_shapes  # noqa: E402
from bench.offline_breakdown import Generate, decode_breakdown, format_breakdown, workload_breakdown  # noqa: E402
from bench.offline_report import (  # noqa: E402
    agreement_lines,
    check_targets,
    finish_rows,
    floor_lines,
    format_table,
    overhead_lines,
)
from bench.workloads import (  # noqa: E402
    OfflineTurns,
    multi_turn_workload,
    offline_multi_turn,
    offline_shared_prefix,
    shared_prefix_workload,
    short_prompts,
)

CONFIGS = ("radix", "radix-torch", "radix-sampled", "radix-ngram", "radix-int8kv", "radix-gguf", "no-radix",
           "hf-static")
WORKLOADS = ("shared-prefix", "multi-turn")
DTYPES = ("float32", "bfloat16", "float16")
# Counters of SchedulerStats that add up over requests, so a warm-up can be subtracted.
ADDITIVE_STATS = (
    "requests_finished", "prompt_tokens", "cached_tokens", "prefill_tokens_computed",
    "decode_tokens", "lm_head_rows", "generation_tokens", "forward_steps", "decode_steps", "mixed_steps",
    "retractions", "evicted_tokens", "forward_seconds", "step_seconds",
)
WARMUP_TEXT_IDS = [504, 3575, 314, 4649, 314]  # any few ids outside the timed workload


@dataclass
class RunContext:
    """What the engine runs of one invocation share."""

    shapes: MatmulShapes  # of the model, for the floor
    decode_prompts: list[list[int]]  # the shared-prefix prompts: --breakdown's decode scenario
    rates: dict[tuple[str, int], dict[str, float]] = field(default_factory=dict)  # (dtype, threads)


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


# radix-sampled: the sampling a chat client sends (seeded, so a run repeats itself).
SAMPLED = {"temperature": 0.7, "top_p": 0.9, "seed": 1234}


def engine_generate(engine: Any, sampled: bool = False) -> Generate:
    """``generate(prompts, output_len)``: output ids of one batch submitted at once."""
    def generate(prompts: list[list[int]], output_len: int) -> list[list[int]]:
        params = {**greedy_params(output_len), **(SAMPLED if sampled else {})}
        return results_ids(engine.generate(input_ids=prompts, sampling_params=params))

    return generate


def run_turns(work: OfflineTurns, generate: Generate) -> tuple[float, list]:
    """(wall seconds summed over the turns, outputs of every request in submit order)."""
    wall, outputs = 0.0, []
    prompts: list[list[int]] = []
    answers: list[list[int]] = []
    for turn in range(work.num_turns):
        prompts = work.prompts(turn, prompts, answers)
        t0 = time.perf_counter()
        answers = generate(prompts, work.output_len)
        wall += time.perf_counter() - t0
        outputs.extend(answers)
    return wall, outputs


def timed_generate(engine: Any, prompts: list[list[int]], output_len: int) -> tuple[float, list, dict]:
    """(wall seconds, results, stats delta) of one batch submitted at once."""
    before = engine.get_stats()
    t0 = time.perf_counter()
    results = engine.generate(input_ids=prompts, sampling_params=greedy_params(output_len))
    wall = time.perf_counter() - t0
    return wall, results, stats_delta(before, engine.get_stats())


def floor_of(stats: dict[str, Any], dtype: str, threads: int, wall: float, ctx: RunContext) -> dict[str, Any]:
    """The run's matmul floor; the rates are timed once per dtype and thread count."""
    key = (dtype, threads)
    if key not in ctx.rates:
        ctx.rates[key] = matmul_rates(ctx.shapes, dtype, threads)
    rates = ctx.rates[key]
    floor = matmul_floor(ctx.shapes, rates, stats["prefill_tokens_computed"],
                         stats["decode_tokens"], stats["lm_head_rows"])
    return {"threads": threads, "rates_flop_per_s": rates, **floor, "wall_over_floor": wall / floor["floor_s"]}


@contextlib.contextmanager
def kernels_env(enabled: bool) -> Iterator[None]:
    """``RADIXSERVE_CPU_KERNELS`` for the engine processes started inside (they inherit it)."""
    before = os.environ.get("RADIXSERVE_CPU_KERNELS")
    os.environ["RADIXSERVE_CPU_KERNELS"] = "1" if enabled else "0"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("RADIXSERVE_CPU_KERNELS")
        else:
            os.environ["RADIXSERVE_CPU_KERNELS"] = before


def run_radixserve(
    config: str, dtype: str, work: OfflineTurns, args: argparse.Namespace, tokenizer: Any, ctx: RunContext
) -> dict[str, Any]:
    from radixserve import Engine

    settings: dict[str, Any] = {"dtype": dtype, "disable_radix_cache": config == "no-radix"}
    if config == "radix-ngram":
        settings["speculative_algorithm"] = "ngram"
    if config == "radix-int8kv":
        settings["kv_cache_dtype"] = "int8"
    settings["quantization"] = "gguf" if config == "radix-gguf" else "none"
    for name in ("max_total_tokens", "chunked_prefill_size", "max_running_requests"):
        if getattr(args, name) is not None:
            settings[name] = getattr(args, name)
    t0 = time.perf_counter()
    with kernels_env(config != "radix-torch"), Engine(model=args.model, **settings) as engine:
        start_s = time.perf_counter() - t0
        engine.generate(input_ids=WARMUP_TEXT_IDS, sampling_params=greedy_params(2))
        if not engine.flush_cache():
            raise RuntimeError("flush_cache refused after the warm-up")
        generate = engine_generate(engine, sampled=config == "radix-sampled")
        before = engine.get_stats()
        wall, outputs = run_turns(work, generate)
        stats = stats_delta(before, engine.get_stats())
        memory = engine.check_memory()
        row = make_row(config, dtype, work, wall, outputs)
        row.update(
            prefill_computed=stats["prefill_tokens_computed"],
            hit_rate=stats["cache_hit_rate"],
            engine_start_s=start_s,
            engine_settings=settings,
            memory_invariant_ok=bool(memory.get("ok")),
            stats=stats,
            floor=floor_of(stats, dtype, engine.info.torch_threads, wall, ctx),
        )
        if config == "radix" and args.overhead_check:
            if not engine.flush_cache():
                raise RuntimeError("flush_cache refused before the overhead check")
            row["overhead_check"] = overhead_check(engine, tokenizer, args)
        if args.breakdown:
            step_ms = 1000 * stats["step_seconds"] / max(stats["forward_steps"], 1)
            row["breakdown"] = {"workload": workload_breakdown(engine, lambda: run_turns(work, generate), step_ms)}
            if config in ("radix", "radix-torch", "radix-int8kv"):
                row["breakdown"]["decode"] = decode_breakdown(engine, generate, ctx.decode_prompts, args.output_len)
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
    dtype: str, work: OfflineTurns, args: argparse.Namespace, model_path: str, pad_id: int
) -> dict[str, Any]:
    import torch
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM

    device = "cuda" if torch.cuda.is_available() else "cpu"
    t0 = time.perf_counter()
    from radixserve.model.gguf_folder import transformers_args

    where, kwargs = transformers_args(model_path)  # a GGUF model's folder: the file itself
    model = AutoModelForCausalLM.from_pretrained(where, dtype=getattr(torch, dtype), **kwargs)
    model = model.to(device).eval()
    load_s = time.perf_counter() - t0
    hf_generate(model, [WARMUP_TEXT_IDS], 2, pad_id)
    bar = tqdm(total=work.num_requests, desc=f"hf-static {dtype}", unit="req", disable=args.no_progress)
    # Static batches compute every padded position: batch size x longest prompt.
    padded = 0

    def generate(prompts: list[list[int]], output_len: int) -> list[list[int]]:
        nonlocal padded
        outputs: list[list[int]] = []
        for i in range(0, len(prompts), args.hf_batch):
            batch = prompts[i: i + args.hf_batch]
            padded += len(batch) * max(len(p) for p in batch)
            outputs.extend(hf_generate(model, batch, output_len, pad_id))
            bar.update(len(batch))
        return outputs

    wall, outputs = run_turns(work, generate)
    bar.close()
    row = make_row("hf-static", dtype, work, wall, outputs)
    row.update(
        prefill_computed=padded,
        hit_rate=0.0,
        model_load_s=load_s,
        hf_batch=args.hf_batch,
        device=device,
    )
    return row


# ---- report --------------------------------------------------------------------------------
def results_ids(results: list[dict[str, Any]]) -> list[list[int]]:
    return [r["output_ids"] for r in results]


def make_row(config: str, dtype: str, work: OfflineTurns, wall: float, outputs: list) -> dict[str, Any]:
    produced = sum(len(o) for o in outputs)
    return {
        "config": config,
        "dtype": dtype,
        "wall_s": wall,
        "output_tokens": produced,
        "all_outputs_full_length": all(len(o) == work.output_len for o in outputs),
        "output_tok_per_s": work.num_requests * work.output_len / wall,
        "unique_tokens": work.unique_tokens,
        "output_ids": outputs,
    }


# ---- command line --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workload", choices=WORKLOADS, default="shared-prefix")
    p.add_argument("--groups", "-G", type=int, default=4, help="system prompts (groups)")
    p.add_argument("--questions", "-P", type=int, default=16, help="questions per group")
    p.add_argument("--system-len", "-S", type=int, default=1024, help="tokens per system prompt")
    p.add_argument("--question-len", "-Q", type=int, default=48, help="tokens per question")
    p.add_argument("--output-len", "-O", type=int, default=32, help="output tokens per request")
    p.add_argument("--conversations", "-C", type=int, default=16, help="multi-turn: conversations")
    p.add_argument("--turns", "-T", type=int, default=4, help="multi-turn: turns per conversation")
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
    p.add_argument("--breakdown", action="store_true",
                   help="profiled passes: step time by attention/linear/other/scheduler/sampling")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (G=2 P=2 S=64 Q=8 O=4, C=2 T=2)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar for hf-static")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "offline.json")
    args = p.parse_args(argv)
    if args.quick:
        args.groups, args.questions, args.system_len, args.question_len, args.output_len = 2, 2, 64, 8, 4
        args.overhead_requests, args.overhead_prompt_len, args.overhead_output_len = 8, 16, 4
        args.conversations, args.turns = 2, 2
        args.hf_batch = min(args.hf_batch, 2)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    bad = [c for c in args.configs if c not in CONFIGS] + [d for d in args.dtypes if d not in DTYPES]
    if bad or not args.configs or not args.dtypes:
        p.error(f"unknown or empty --configs/--dtypes {bad}; configs {CONFIGS}, dtypes {DTYPES}")
    for name in ("groups", "questions", "system_len", "question_len", "output_len", "hf_batch",
                 "overhead_requests", "overhead_prompt_len", "overhead_output_len", "conversations", "turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def build_workload(args: argparse.Namespace, tokenizer: Any) -> tuple[OfflineTurns, list[list[int]], str]:
    """The timed workload, the shared-prefix prompts (the decode scenario of --breakdown), and
    a line describing the workload."""
    shared = shared_prefix_workload(
        tokenizer, args.groups, args.questions, args.system_len, args.question_len, args.seed
    )
    if args.workload == "shared-prefix":
        work = offline_shared_prefix(shared, args.output_len)
        shape = (f"{shared.groups} groups x {shared.questions} questions, system {shared.system_len} + "
                 f"question {shared.question_len} tokens")
    else:
        chats = multi_turn_workload(tokenizer, args.conversations, args.turns, args.system_len,
                                    args.question_len, args.seed)
        work = offline_multi_turn(chats, args.output_len)
        shape = (f"{chats.conversations} conversations x {chats.turns} turns, system {chats.system_len} + "
                 f"question {chats.question_len} tokens a turn")
    line = (f"workload {work.name}: {shape}, {args.output_len} out; {work.num_requests} requests, "
            f"{work.prompt_tokens} prompt tokens, {work.unique_tokens} unique")
    return work, shared.prompts, line


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from transformers import AutoTokenizer

    from radixserve.model.default_model import default_model_path

    model_path = args.model or default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    work, decode_prompts, line = build_workload(args, tokenizer)
    print(line)
    print("cpu: {cpu_model} ({cpu_kind})".format(**cpu_kind()))
    ctx = RunContext(model_matmul_shapes(args.model), decode_prompts)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    runs = [(d, c) for d in args.dtypes for c in args.configs]
    rows = []
    for i, (dtype, config) in enumerate(runs, 1):
        print(f"[{i}/{len(runs)}] {config} {dtype} ...", flush=True)
        if config == "hf-static":
            row = run_hf_static(dtype, work, args, model_path, pad_id)
        else:
            row = run_radixserve(config, dtype, work, args, tokenizer, ctx)
        print(f"[{i}/{len(runs)}] {config} {dtype}: {row['wall_s']:.2f} s, "
              f"{row['prefill_computed']} prefill tokens computed", flush=True)
        rows.append(row)
    finish_rows(rows)
    checks = check_targets(rows, work.name)
    print()
    print(format_table(rows))
    if args.breakdown:
        print(format_breakdown(rows))
    lines = floor_lines(rows) + overhead_lines(rows) + agreement_lines(rows) + target_lines(checks)
    for text in lines:
        print(text)
    report = {
        "benchmark": f"offline_{work.name.replace('-', '_')}",
        "params": args_params(args),
        "machine": machine_info(),
        "workload": {
            "name": work.name,
            "turns": work.num_turns,
            "requests": work.num_requests,
            "prompt_tokens": work.prompt_tokens,
            "unique_tokens": work.unique_tokens,
            "output_tokens": work.num_requests * args.output_len,
            "text_source": "Python standard-library docstrings (bench/workloads.py)",
        },
        "matmul_shapes": {
            "layers": [[k, m, n] for (k, m), n in ctx.shapes.layers.items()],  # in, out, count
            "head": list(ctx.shapes.head),
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
