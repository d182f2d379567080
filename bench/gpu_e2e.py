"""The engine end to end on a GPU: the second half of bench/gpu_check.sh's proof run.

Parts, in order of importance; each runs under its own time budget (``--budgets``, cut to what
is left of ``--time-limit``), and an error or a timeout is recorded in the JSON and the table
while the run goes on (the JSON is rewritten after every part):

  parity          a few prompts (five short ones and one of ~400 tokens), greedy, by the
                  engine with every ``--backends`` entry in every ``--dtypes`` entry and by
                  Hugging Face transformers (``generate``, greedy, on the same device).
                  float32: the greedy tokens must be identical to transformers float32's.
                  bfloat16: greedy paths may part after a near tie, so the check is
                  teacher-forced: each system scores transformers float32's greedy tokens,
                  and its per-token logprobs must lie within mean |d| <= 0.1 and max |d| <= 0.5
                  nats of transformers float32's.  transformers' own bfloat16 run is scored
                  the same way and shown as the yardstick (SmolLM2-135M on a CPU: mean 0.025,
                  max 0.11; radixserve's torch backend: mean 0.022, max 0.16).  A row
                  "triton vs torch" compares the kernels with their oracle backend directly.
  shared_prefix   64 requests sharing one 1500-token system prompt, each with its own 32-token
                  question and 32 output tokens, submitted at once, with the radix cache on
                  and off (``disable_radix_cache``): wall time, tokens/s, cached tokens.
  decode_default  decode throughput of the default model at batch 1/16/64/256 (random
                  512-token prompts, 128 new tokens each), with CUDA graphs and without
                  (``disable_cuda_graph``): decode tokens/s from the scheduler's decode-only
                  counters.  Before each measured batch the same prompts run a few tokens:
                  Triton compiles that shape, and the measured batch finds its prompts cached.
  decode_llama    the same on a randomly initialised Llama-3-8B-shaped model in bfloat16
                  (``load_format="dummy"``: a folder with only config.json and the default
                  model's tokenizer; the model's vocabulary is larger than the tokenizer's,
                  which does not matter for throughput).  Target: CUDA graphs >= 2x eager at
                  batch 64.

Every engine starts with ``RADIXSERVE_SYNC_DEBUG=error`` (``--sync-debug``): on CUDA its
scheduler runs each step under ``torch.cuda.set_sync_debug_mode("error")``, so a hidden
host-device sync fails the step and its requests.  Such failures are counted ("sync errors",
0 expected).  After the first one, later engines start without sync debug and the failed batch
is rerun once, so that the part still gets its numbers.  Two engines stay alive and are reused
by equal settings (parity's bfloat16 triton engine is the shared-prefix and sweep engine).

``--device cpu --quick`` is a dry run of all of it on tiny sizes: float32 and the torch backend
only (Triton on a CPU is its slow interpreter), a tiny Llama for the 8B shape, one engine for
both CUDA-graph settings (a CPU has none), the pure-torch CPU path (RADIXSERVE_CPU_KERNELS=0:
no C++ build); tests/bench/test_bench_gpu_e2e.py runs it.

At the end it prints its checks against their targets: the same rows (``e2e_rows``) that
bench/gpu_summary.py puts in gpu_check.sh's closing table.

The engines and the part deadlines live in bench/gpu_engines.py, the parity part in
bench/gpu_parity.py; this file runs the parts and writes the report.

    python bench/gpu_e2e.py                          # JSON -> bench/results/gpu-e2e-<gpu>.json
    python bench/gpu_e2e.py --parts parity,decode_llama --budgets decode_llama=150
    python bench/gpu_e2e.py --device cpu --quick     # tiny dry run on a CPU (checks the script)
"""

from __future__ import annotations

import argparse
import os
import random
import re
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.common import args_params, machine_info, write_json, write_report  # noqa: E402
from bench.gpu_engines import PartTimeout, Run, default_settings, greedy  # noqa: E402
from bench.gpu_parity import PROMPTS, part_parity  # noqa: E402
from bench.gpu_summary import GRAPH_TARGET, e2e_rows, table  # noqa: E402
from bench.workloads import shared_prefix_workload, short_prompts  # noqa: E402

PARTS = ("parity", "shared_prefix", "decode_default", "decode_llama")
GPU_BUDGETS = {"parity": 90, "shared_prefix": 25, "decode_default": 30, "decode_llama": 80}  # s
LLAMA_SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
}
LLAMA_NAMES = {"8b": "Llama-3-8B shape, random", "tiny": "tiny Llama shape, random"}
TOKENIZER_FILES = ("tokenizer", "special_tokens", "vocab", "merges", "chat_template")
QUICK = dict(parity_prompts=2, parity_long=0, parity_tokens=6, sp_requests=6, sp_system_len=64,
             sp_question_len=8, sp_output_len=4, batches=[1, 4], prompt_len=32, decode_len=6, warm_tokens=1)


def decode_rate(c: dict[str, Any]) -> float | None:
    return c["decode_only_tokens"] / c["decode_only_seconds"] if c["decode_only_seconds"] > 0 else None


# ---- shared prefix -----------------------------------------------------------------------------
def part_shared_prefix(run: Run, out: dict[str, Any]) -> None:
    args, tok = run.args, run.tokenizer
    work = shared_prefix_workload(tok, 1, args.sp_requests, args.sp_system_len, args.sp_question_len, args.seed)
    requests = [{"input_ids": p, "sampling_params": greedy(args.sp_output_len)} for p in work.prompts]
    warm = [{"input_ids": p, "sampling_params": greedy(2)} for p in short_prompts(tok, 2, 32, args.seed)]
    out.update(requests=work.num_requests, system_len=work.system_len, question_len=work.question_len,
               output_len=args.sp_output_len, ideal_cached_tokens=work.prompt_tokens - work.unique_tokens, runs=[])
    for config, disable in (("radix", False), ("no-radix", True)):
        settings = {**default_settings(args), "disable_radix_cache": disable}
        run.batch(config, settings, warm)  # a fresh engine compiles its kernels here
        results, wall, c = run.batch(config, settings, requests, flush=True)
        output = sum(len(r["output_ids"]) for r in results)
        row = {"config": config, "wall_s": wall, "prompt_tokens": c["prompt_tokens"],
               "cached_tokens": c["cached_tokens"], "prefill_tokens_computed": c["prefill_tokens_computed"],
               "output_tokens": output, "output_tokens_per_s": output / wall,
               "total_tokens_per_s": (c["prompt_tokens"] + output) / wall, "decode_tokens_per_s": decode_rate(c)}
        out["runs"].append(row)
        print(f"[shared_prefix] {config}: {wall:.2f} s, {row['total_tokens_per_s']:.0f} tok/s, "
              f"{row['cached_tokens']} cached tokens", flush=True)
    out["speedup"] = out["runs"][1]["wall_s"] / out["runs"][0]["wall_s"]


# ---- decode sweep ------------------------------------------------------------------------------
def sweep(run: Run, out: dict[str, Any], name: str, settings: dict[str, Any]) -> None:
    """Decode tokens/s per batch size, CUDA graphs on and off (the target batch first)."""
    args = run.args
    rng = random.Random(args.seed)  # random ids: the corpus is too short for 256 x 512 tokens
    prompts = [[rng.randrange(16, len(run.tokenizer)) for _ in range(args.prompt_len)]
               for _ in range(max(args.batches))]
    out.update(prompt_len=args.prompt_len, decode_len=args.decode_len, rows=[])
    for b in sorted(args.batches, key=lambda b: b != GRAPH_TARGET[0]):
        for graphs in (True, False):
            label = f"{name}-{'graphs' if graphs else 'eager'}"
            s = {**settings, "disable_cuda_graph": not graphs}
            run.batch(label, s, [{"input_ids": p, "sampling_params": greedy(args.warm_tokens)} for p in prompts[:b]],
                      flush=True)
            _, wall, c = run.batch(label, s, [{"input_ids": p, "sampling_params": greedy(args.decode_len)}
                                              for p in prompts[:b]])
            steps = c["decode_only_steps"]
            row = {"batch": b, "cuda_graphs": graphs, "decode_tokens_per_s": decode_rate(c),
                   "ms_per_decode_step": 1000 * c["decode_only_seconds"] / steps if steps else None,
                   "decode_only_steps": steps, "wall_s": wall}
            out["rows"].append(row)
            print(f"[{run.part}] batch {b:3d} {'graphs' if graphs else 'eager '}: "
                  f"{row['decode_tokens_per_s'] or 0:9.1f} decode tok/s, "
                  f"{row['ms_per_decode_step'] or 0:.2f} ms/step ({steps} steps)", flush=True)


def part_decode_default(run: Run, out: dict[str, Any]) -> None:
    settings = default_settings(run.args)
    out.update(model="default model", dtype=settings["dtype"])
    sweep(run, out, "default", settings)


def write_llama_folder(folder: str, shape: dict[str, Any], tokenizer_dir: str, tokenizer: Any) -> None:
    """config.json of a Llama with ``shape`` (no weights: load_format dummy) and the tokenizer."""
    import transformers

    config = transformers.LlamaConfig(**shape, architectures=["LlamaForCausalLM"], rms_norm_eps=1e-5,
                                      tie_word_embeddings=False, bos_token_id=tokenizer.bos_token_id,
                                      eos_token_id=tokenizer.eos_token_id)
    config.save_pretrained(folder)
    for name in os.listdir(tokenizer_dir):
        if name.startswith(TOKENIZER_FILES):
            shutil.copy(os.path.join(tokenizer_dir, name), folder)


def part_decode_llama(run: Run, out: dict[str, Any]) -> None:
    args = run.args
    run.close_all()  # room for the big model
    out.update(model=LLAMA_NAMES[args.llama], llama=args.llama, dtype=args.llama_dtype,
               shape=LLAMA_SHAPES[args.llama])
    with tempfile.TemporaryDirectory(prefix=f"llama-{args.llama}-") as folder:
        write_llama_folder(folder, LLAMA_SHAPES[args.llama], run.folder, run.tokenizer)
        settings = {"model": folder, "load_format": "dummy", "dtype": args.llama_dtype,
                    "max_total_tokens": args.pool_tokens, "max_running_requests": args.max_running}
        try:
            sweep(run, out, f"llama-{args.llama}", settings)
        finally:
            run.close_all()  # before its folder goes


PART_FUNCTIONS: dict[str, Callable[[Run, dict[str, Any]], None]] = {
    "parity": part_parity, "shared_prefix": part_shared_prefix,
    "decode_default": part_decode_default, "decode_llama": part_decode_llama,
}


def run_part(run: Run, report: dict[str, Any], name: str, end: float) -> None:
    """One part under its budget (and before ``end``, monotonic seconds); what it measured
    stays in the report whatever happens."""
    budget = min(run.args.budgets[name], end - time.monotonic())
    entry = report["parts"][name] = {"status": "running", "budget_s": budget}
    if budget < 5:
        entry.update(status="skipped", error="no time left of --time-limit", seconds=0.0)
        print(f"== {name}: skipped (no time left of --time-limit)", flush=True)
        return
    run.part, run.deadline = name, time.monotonic() + budget
    print(f"== {name} (budget {budget:.0f} s)", flush=True)
    t0 = time.perf_counter()
    try:
        PART_FUNCTIONS[name](run, entry)
        entry["status"] = "ok"
    except PartTimeout as e:
        entry["status"], entry["error"] = "timeout", str(e)
    except Exception as e:  # recorded in the JSON and the table; the next part runs
        entry["status"], entry["error"] = "error", f"{type(e).__name__}: {e}"
        traceback.print_exc()
    except KeyboardInterrupt:  # gpu_check.sh's time limit: the report is still written
        entry["status"], entry["error"] = "interrupted", "stopped by SIGINT"
        raise
    finally:
        entry["seconds"] = time.perf_counter() - t0
        print(f"== {name}: {entry['status']} in {entry['seconds']:.1f} s", flush=True)


# ---- command line ------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="gpu_e2e.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="auto", choices=("auto", "cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="tiny sizes (a dry run of the script)")
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    p.add_argument("--budgets", default="", help="seconds per part, e.g. parity=120,decode_llama=150")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for all the parts: a part gets at most what is left (gpu_check.sh's step limit)")
    p.add_argument("--dtypes", default=None, help="parity dtypes, float32 first (cuda: float32,bfloat16)")
    p.add_argument("--backends", default=None, help="attention backends (cuda: triton,torch; cpu: torch)")
    p.add_argument("--sync-debug", default="error", choices=("error", "warn", "off"))
    p.add_argument("--parity-prompts", type=int, default=len(PROMPTS), help="short prompts (at most 5)")
    p.add_argument("--parity-long", type=int, default=400, help="tokens of one more, long prompt (0: none)")
    p.add_argument("--parity-tokens", type=int, default=32)
    p.add_argument("--sp-requests", type=int, default=64)
    p.add_argument("--sp-system-len", type=int, default=1500)
    p.add_argument("--sp-question-len", type=int, default=32)
    p.add_argument("--sp-output-len", type=int, default=32)
    p.add_argument("--batches", default="1,16,64,256")
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--decode-len", type=int, default=128)
    p.add_argument("--warm-tokens", type=int, default=8, help="tokens of the warm-up before each measured batch")
    p.add_argument("--llama", default=None, choices=tuple(LLAMA_SHAPES), help="cuda: 8b; cpu: tiny")
    p.add_argument("--llama-dtype", default=None, help="cuda: bfloat16; cpu: float32")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="default bench/results/gpu-e2e-<gpu>.json")
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else None
    if args.device is None or (args.device == "cuda" and not torch.cuda.is_available()):
        p.error("no CUDA device: this script checks the GPU path; `--device cpu --quick` is a dry run of it")
    on_gpu = args.device == "cuda"
    if args.quick:
        for name, value in QUICK.items():
            setattr(args, name, list(value) if isinstance(value, list) else value)
    else:
        args.batches = [int(b) for b in args.batches.split(",")]
    args.parts = [x for x in args.parts.split(",") if x]
    args.dtypes = (args.dtypes or ("float32,bfloat16" if on_gpu else "float32")).split(",")
    args.backends = (args.backends or ("triton,torch" if on_gpu else "torch")).split(",")
    args.llama = args.llama or ("8b" if on_gpu else "tiny")
    args.llama_dtype = args.llama_dtype or ("bfloat16" if on_gpu else "float32")
    budgets = dict(GPU_BUDGETS) if on_gpu else dict.fromkeys(PARTS, 600.0)
    for item in filter(None, args.budgets.split(",")):
        name, _, seconds = item.partition("=")
        budgets[name] = float(seconds)
    args.budgets = budgets
    if unknown := (set(args.parts) | set(budgets)) - set(PARTS):
        p.error(f"unknown part(s) {sorted(unknown)}; choose from {', '.join(PARTS)}")
    if args.dtypes[0] != "float32":
        p.error("--dtypes starts with float32: transformers float32 is the reference")
    # Room for the largest batch of the sweep or of the shared-prefix run without the cache.
    args.pool_tokens = max(max(args.batches) * (args.prompt_len + args.warm_tokens + args.decode_len + 32),
                           args.sp_requests * (args.sp_system_len + args.sp_question_len + args.sp_output_len + 32))
    args.max_running = max(max(args.batches), args.sp_requests, args.parity_prompts + 1)
    return args


def main(argv: list[str] | None = None) -> int:
    started = time.monotonic()
    args = parse_args(argv)
    if args.device == "cpu":  # the dry run checks this script, not the CPU kernels (no build)
        os.environ.setdefault("RADIXSERVE_CPU_KERNELS", "0")
    from radixserve.model.loader import resolve_model_path
    from radixserve.tokenizer import load_tokenizer

    folder = resolve_model_path(None)
    run = Run(args, folder, load_tokenizer(folder))
    device = torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu"
    slug = re.sub(r"[^A-Za-z0-9]+", "-", device).strip("-")
    out = args.out or REPO / "bench" / "results" / f"gpu-e2e-{slug}.json"
    report: dict[str, Any] = {"benchmark": "gpu_e2e", "device": device, "machine": machine_info(),
                              "params": args_params(args), "parts": {}, "sync": run.sync, "engines": run.engines}
    print(f"device: {device}, parts: {', '.join(args.parts)}", flush=True)
    end = started + args.time_limit if args.time_limit else float("inf")
    try:
        for name in args.parts:
            run_part(run, report, name, end)
            write_json(report, out)  # what is done so far survives a kill
    finally:
        run.close_all()
        report["summary"] = e2e_rows(report)
        print()
        print(table(report["summary"]))
        write_report(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
