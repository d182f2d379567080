"""Structured-generation benchmark: JSON-schema constrained decoding vs unconstrained.

Workload: ``--requests`` chat-templated prompts "Extract the customer record from this
support ticket: ..." over distinct support tickets built deterministically from ``--seed``,
all constrained by one realistic JSON schema (``TICKET_SCHEMA``: nested objects, enums, an
array with ``maxItems``, required keys, strings with ``maxLength``, bounded integers).
Greedy (temperature 0), ``--max-new-tokens`` for every mode, submitted as one batch.

Modes, each in every ``--dtype``, each on its own ``Engine`` (default model unless ``--model``):
  unconstrained             the same requests without a schema
  json_schema               constrained, ``disable_jump_forward=True``
  json_schema+jump-forward  constrained, grammar-forced text appended without decoding it

The engines of one dtype are up together and their timed batches interleave (A, B, C, A, B,
C, ... for ``--repeats``), so a change in machine load hits every mode alike; the reported
wall time is the median over repeats, the radix cache is flushed before each batch.  Wall
time runs from submit to the last result; engine start and a warm-up (one unconstrained
request, plus for constrained modes one request with the schema, so the schema is compiled
and cached in the engine) are excluded.  "output tokens" are ``len(output_ids)`` summed
(jump-forward tokens included).  Grammar compile time of the schema is measured directly on
``radixserve.grammar.GrammarCompiler``: cold (a fresh compiler) and cached (the same text
submitted again), median of ``--compile-repeats``.

    python bench/structured.py                           # float32, 32 requests, 3 repeats
    python bench/structured.py --dtype float32 bfloat16
    python bench/structured.py --requests 2 --repeats 1 --model PATH   # smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
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
from bench.structured_workload import (  # noqa: E402
    TICKET_SCHEMA,
    chat_prompts,
    check_outputs,
    ticket_texts,
)

MODES = ("unconstrained", "json_schema", "json_schema+jump-forward")
DTYPES = ("float32", "bfloat16", "float16")
TARGET_CONSTRAINED_RATIO = 0.9  # json_schema output tok/s >= 0.9 x unconstrained
TARGET_JUMP_FORWARD_RATIO = 1.3  # json_schema+jump-forward output tok/s >= 1.3 x unconstrained
TARGET_COMPILE_COLD_MS = 50.0
TARGET_COMPILE_CACHED_MS = 1.0
WARMUP_PROMPT = "Say hello."


# ---- runs ----------------------------------------------------------------------------------
def workload_pool_tokens(tokenizer: Any, prompts: list[str], max_new_tokens: int) -> int:
    """A KV pool that holds the whole batch at full length (plus slack), so that every mode's
    engine can stay up at once without taking its pool size from free memory."""
    prompt_tokens = sum(len(tokenizer.encode(p, add_special_tokens=False)) for p in prompts)
    return prompt_tokens + len(prompts) * max_new_tokens + 4096


def sampling_params(mode: str, schema_text: str, max_new_tokens: int) -> dict[str, Any]:
    params: dict[str, Any] = {"max_new_tokens": max_new_tokens, "temperature": 0}
    if mode != "unconstrained":
        params["json_schema"] = schema_text
    return params


def stats_delta(before: dict[str, Any], after: dict[str, Any], mask_steps_before: int) -> dict[str, Any]:
    """Counters of one timed batch, and its own mask ms/step.

    The scheduler reports the mask time as a running mean over the steps that masked, so the
    caller passes how many such steps came before (``mask_steps_before``).  Every forward of a
    constrained timed batch samples constrained rows (no prompt is longer than a prefill
    chunk), so its mask steps are its forward steps.
    """
    keys = ("forward_steps", "decode_steps", "generation_tokens", "decode_tokens",
            "prefill_tokens_computed", "jump_forward_tokens", "retractions", "forward_seconds",
            "step_seconds")
    d: dict[str, Any] = {k: after.get(k, 0) - before.get(k, 0) for k in keys}
    steps = d["forward_steps"]
    d["forward_ms_per_step"] = 1000 * d["forward_seconds"] / steps if steps else 0.0
    mean_before = before.get("grammar_mask_ms_per_step", 0.0)
    mean_after = after.get("grammar_mask_ms_per_step", 0.0)
    mask_steps = steps if mean_after else 0
    total_ms = mean_after * (mask_steps_before + mask_steps) - mean_before * mask_steps_before
    d["mask_steps"] = mask_steps
    d["grammar_mask_ms_per_step"] = total_ms / mask_steps if mask_steps else 0.0
    d["grammars_compiled"] = after.get("grammars_compiled", 0)
    d["grammar_compile_ms_total"] = after.get("grammar_compile_ms_total", 0.0)
    return d


class ModeEngine:
    """One mode's engine: warm-up, then timed batches (the radix cache flushed before each)."""

    def __init__(self, mode: str, dtype: str, args: argparse.Namespace, pool_tokens: int) -> None:
        from radixserve import Engine

        self.mode = mode
        self.schema_text = json.dumps(TICKET_SCHEMA)
        self.settings: dict[str, Any] = {
            "dtype": dtype,
            "disable_jump_forward": mode == "json_schema",
            "max_total_tokens": pool_tokens,
        }
        t0 = time.perf_counter()
        self.engine = Engine(model=args.model, **self.settings)
        self.start_s = time.perf_counter() - t0
        self.mask_steps = 0  # steps that applied a grammar mask so far (see stats_delta)
        try:
            self.engine.generate(WARMUP_PROMPT, sampling_params("unconstrained", self.schema_text, 4))
            if mode != "unconstrained":  # compiles the schema into the engine's cache
                before = self.engine.get_stats()["generation_tokens"]
                self.engine.generate(WARMUP_PROMPT, sampling_params(mode, self.schema_text, 4))
                self.mask_steps = self.engine.get_stats()["generation_tokens"] - before  # one row
        except BaseException:
            self.engine.shutdown()
            raise

    def timed(self, prompts: list[str], max_new_tokens: int, progress: bool) -> tuple[float, list, dict]:
        """(wall seconds, results, stats delta) of the batch submitted at once."""
        if not self.engine.flush_cache():
            raise RuntimeError("flush_cache refused between batches")
        before = self.engine.get_stats()
        t0 = time.perf_counter()
        results = self.engine.generate(
            prompts, sampling_params(self.mode, self.schema_text, max_new_tokens), progress=progress
        )
        wall = time.perf_counter() - t0
        stats = stats_delta(before, self.engine.get_stats(), self.mask_steps)
        self.mask_steps += stats["mask_steps"]
        return wall, results, stats

    def close(self) -> None:
        self.engine.shutdown()


def make_row(me: ModeEngine, runs: list[tuple[float, list, dict]], memory_ok: bool) -> dict[str, Any]:
    """The mode's row: wall time is the median over repeats; counts from the first repeat."""
    walls = [w for w, _, _ in runs]
    wall, results, stats = statistics.median(walls), runs[0][1], runs[0][2]
    outputs = [r["output_ids"] for r in results]
    produced = sum(len(o) for o in outputs)
    return {
        "mode": me.mode,
        "dtype": me.settings["dtype"],
        "requests": len(results),
        "output_tokens": produced,
        "wall_s": wall,
        "wall_s_all": walls,
        "output_tok_per_s": produced / wall,
        "forward_steps": stats["forward_steps"],
        "decode_steps": stats["decode_steps"],
        "sampled_tokens": stats["generation_tokens"],
        "jump_forward_tokens": stats["jump_forward_tokens"],
        "mask_ms_per_step": statistics.median(s["grammar_mask_ms_per_step"] for _, _, s in runs),
        "forward_ms_per_step": statistics.median(s["forward_ms_per_step"] for _, _, s in runs),
        "output_lens": [len(o) for o in outputs],
        "outputs_same_across_repeats": all(
            [r["output_ids"] for r in res] == outputs for _, res, _ in runs[1:]
        ),
        **check_outputs(results, TICKET_SCHEMA),
        "engine_start_s": me.start_s,
        "engine_settings": me.settings,
        "memory_invariant_ok": memory_ok,
        "stats": stats,
        "texts": [r["text"] for r in results],
    }


def run_dtype(dtype: str, prompts: list[str], pool_tokens: int, args: argparse.Namespace,
              label: str) -> list[dict[str, Any]]:
    """Every mode of one dtype: all engines up at once, timed batches interleaved by repeat
    (mode A, B, C, A, B, C, ...) so that a change in machine load hits every mode alike."""
    engines: list[ModeEngine] = []
    try:
        for mode in args.modes:
            engines.append(ModeEngine(mode, dtype, args, pool_tokens))
        runs: dict[str, list] = {me.mode: [] for me in engines}
        for rep in range(args.repeats):
            for me in engines:
                print(f"{label} {me.mode} {dtype}, repeat {rep + 1}/{args.repeats} ...", flush=True)
                wall, results, stats = me.timed(prompts, args.max_new_tokens, not args.no_progress)
                runs[me.mode].append((wall, results, stats))
                print(f"{label} {me.mode} {dtype}: {wall:.2f} s, "
                      f"{sum(len(r['output_ids']) for r in results)} output tokens, "
                      f"{stats['forward_steps']} forward steps", flush=True)
        return [make_row(me, runs[me.mode], bool(me.engine.check_memory().get("ok"))) for me in engines]
    finally:
        for me in engines:
            me.close()


def compile_times(model_path: str, repeats: int) -> dict[str, Any]:
    """Compile time of the schema in ms, from the caller's side (``submit(key).result()``).

    Per repeat, a fresh ``GrammarCompiler`` (building its tokenizer info is not timed):
      first   its very first compile: the schema plus the compiler's one-time setup
      cold    the schema on a compiler that has already compiled another grammar (not cached)
      cached  the same schema submitted again (the compiler's cache)
    """
    from transformers import AutoConfig

    from radixserve.grammar import GrammarCompiler
    from radixserve.model.config import collect_eos_ids
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model_path)
    config = AutoConfig.from_pretrained(model_path)
    stop_ids = list(collect_eos_ids(config, model_path))
    key = ("json_schema", json.dumps(TICKET_SCHEMA))
    other = ("json_schema", json.dumps({"type": "object", "properties": {"ok": {"type": "boolean"}}}))
    times: dict[str, list[float]] = {"first": [], "cold": [], "cached": []}

    def timed_ms(compiler: Any, k: tuple[str, str]) -> float:
        t0 = time.perf_counter()
        compiler.submit(k).result()
        return 1000 * (time.perf_counter() - t0)

    for _ in range(repeats):
        for name, warm_with in (("first", None), ("cold", other)):
            compiler = GrammarCompiler(tokenizer, config.vocab_size, stop_ids)
            try:
                if warm_with is not None:
                    compiler.submit(warm_with).result()
                times[name].append(timed_ms(compiler, key))
                if name == "cold":
                    times["cached"].append(timed_ms(compiler, key))
            finally:
                compiler.shutdown()
    return {
        "repeats": repeats,
        **{f"{name}_ms": statistics.median(values) for name, values in times.items()},
        **{f"{name}_ms_all": values for name, values in times.items()},
    }


# ---- report --------------------------------------------------------------------------------
def finish_rows(rows: list[dict[str, Any]]) -> None:
    """Ratio of output tok/s to the unconstrained row of the same dtype; text agreement."""
    by = {(r["mode"], r["dtype"]): r for r in rows}
    for r in rows:
        ref = by.get(("unconstrained", r["dtype"]))
        r["ratio_vs_unconstrained"] = r["output_tok_per_s"] / ref["output_tok_per_s"] if ref else None
        plain = by.get(("json_schema", r["dtype"]))
        r["same_text_as_json_schema"] = (
            sum(a == b for a, b in zip(r["texts"], plain["texts"], strict=True)) / len(r["texts"])
            if plain and r["mode"] == "json_schema+jump-forward" else None
        )


def format_table(rows: list[dict[str, Any]]) -> str:
    header = ("mode", "dtype", "requests", "output tokens", "wall s", "output tok/s",
              "vs unconstrained", "forward steps", "jump-forward tokens", "mask ms/step", "valid")
    lines = [header]
    for r in rows:
        ratio = "-" if r["ratio_vs_unconstrained"] is None else f"{r['ratio_vs_unconstrained']:.2f}x"
        share = r["valid_share_of_stop"]
        valid = f"{r['valid']}/{r['requests']}" + ("" if share is None else f" ({share:.0%} of stop)")
        if r["hit_max_tokens"]:
            valid += f", {r['hit_max_tokens']} at max"
        lines.append((
            r["mode"], r["dtype"], str(r["requests"]), str(r["output_tokens"]), f"{r['wall_s']:.2f}",
            f"{r['output_tok_per_s']:.1f}", ratio, str(r["forward_steps"]),
            str(r["jump_forward_tokens"]), f"{r['mask_ms_per_step']:.3f}", valid,
        ))
    return align_columns(lines, left=(0, 1, len(header) - 1))


def step_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Where the time goes: steps, time per forward (mask and sampling included), tokens/step."""
    return [
        f"steps ({r['mode']}, {r['dtype']}): {r['forward_steps']} forward / {r['decode_steps']} decode, "
        f"{r['forward_ms_per_step']:.1f} ms per forward, {r['sampled_tokens']} sampled + "
        f"{r['jump_forward_tokens']} forced tokens = {r['output_tokens'] / max(r['forward_steps'], 1):.1f} "
        f"output tokens per step, longest output {max(r['output_lens'])} tokens"
        for r in rows
    ]


def check_targets(rows: list[dict[str, Any]], compile_ms: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One entry per target (ok None when not measured); printed, never asserted."""
    by = {(r["mode"], r["dtype"]): r for r in rows}
    checks = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for mode, limit in (("json_schema", TARGET_CONSTRAINED_RATIO),
                            ("json_schema+jump-forward", TARGET_JUMP_FORWARD_RATIO)):
            row = by.get((mode, dtype))
            checks.append(target(dtype, f"{mode} output tok/s / unconstrained >=",
                                 row["ratio_vs_unconstrained"] if row else None, limit, at_least=True))
    if compile_ms is not None:
        checks.append(target("-", "compile cold ms <=", compile_ms["cold_ms"], TARGET_COMPILE_COLD_MS, False))
        checks.append(target("-", "compile cached ms <=", compile_ms["cached_ms"], TARGET_COMPILE_CACHED_MS, False))
    return checks


# ---- command line --------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", "-n", type=int, default=32, help="prompts in the batch")
    p.add_argument("--max-new-tokens", type=int, default=384, help="per request, every mode")
    p.add_argument("--dtype", nargs="+", default=["float32"], choices=DTYPES, help="one or more dtypes")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--seed", type=int, default=0, help="seeds the ticket texts")
    p.add_argument("--model", default=None, help="HF model folder (default: the embedded model)")
    p.add_argument("--repeats", type=int, default=3, help="timed batches per mode (median wall)")
    p.add_argument("--max-total-tokens", type=int, default=None,
                   help="radixserve KV pool size (default: the batch at full length + 4096)")
    p.add_argument("--compile-repeats", type=int, default=5, help="0 skips the compile timing")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar per batch")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "structured.json")
    args = p.parse_args(argv)
    for name in ("requests", "max_new_tokens", "repeats"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.compile_repeats < 0:
        p.error("--compile-repeats must be >= 0")
    args.dtype = list(dict.fromkeys(args.dtype))
    args.modes = [m for m in MODES if m in args.modes]
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    model_path = args.model or default_model_path()
    schema_text = json.dumps(TICKET_SCHEMA)
    tokenizer = load_tokenizer(model_path)
    prompts = chat_prompts(tokenizer, ticket_texts(args.requests, args.seed), schema_text)
    print(f"workload: {len(prompts)} support-ticket prompts, one JSON schema ({len(schema_text)} chars), "
          f"max_new_tokens {args.max_new_tokens}, temperature 0; model {args.model or 'default'}")
    compile_ms = None
    if args.compile_repeats:
        print(f"compiling the schema ({args.compile_repeats} repeats) ...", flush=True)
        compile_ms = compile_times(model_path, args.compile_repeats)
    pool_tokens = args.max_total_tokens or workload_pool_tokens(tokenizer, prompts, args.max_new_tokens)
    rows = []
    for i, dtype in enumerate(args.dtype, 1):
        rows += run_dtype(dtype, prompts, pool_tokens, args, f"[{i}/{len(args.dtype)}]")
    finish_rows(rows)
    checks = check_targets(rows, compile_ms)
    print()
    print(format_table(rows))
    if compile_ms is not None:
        print(f"schema compile: cold {compile_ms['cold_ms']:.2f} ms, cached {compile_ms['cached_ms']:.4f} ms, "
              f"first on a fresh compiler {compile_ms['first_ms']:.1f} ms (median of {compile_ms['repeats']})")
    for line in step_lines(rows):
        print(line)
    for r in rows:
        if r["same_text_as_json_schema"] is not None:
            print(f"jump-forward outputs equal to json_schema ({r['dtype']}): {r['same_text_as_json_schema']:.0%}")
    for line in target_lines(checks):
        print(line)
    report = {
        "benchmark": "structured_generation",
        "params": args_params(args),
        "machine": machine_info(),
        "workload": {"requests": len(prompts), "schema": TICKET_SCHEMA, "example_prompt": prompts[0]},
        "compile_ms": compile_ms,
        "results": [{k: v for k, v in r.items() if k != "texts"} | {"example_output": r["texts"][0]}
                    for r in rows],
        "targets": checks,
    }
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
