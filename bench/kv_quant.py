"""Accuracy and capacity of the 8-bit KV cache (``--kv-cache-dtype``) against the model's dtype.

For each model dtype in ``--dtypes`` (bfloat16 only where the CPU has bfloat16 instructions)
the pool in that dtype (``auto``) decodes ``--tokens`` greedy tokens for each prompt of a fixed
set: the eight chat questions of ``bench/quant_accuracy.py`` and ``--long`` questions about a
``--doc-len``-token document (the KV error grows with the keys each query reads).  Each KV
dtype in ``--kv-dtypes`` then, in a fresh engine:
- decodes its own greedy tokens: ``identical`` is the share of positions where they equal the
  reference's, ``first diff`` the mean position of the first difference, ``flip margin`` the
  reference's top-1 minus top-2 logprob at each first difference (how near a tie it was);
- scores the reference tokens teacher-forced (prompt + reference as the input):
  ``mean / max |d logprob|`` against the model-dtype pool's own logprobs of them, and
  ``forced`` the share of reference positions whose argmax (given the reference's prefix) is
  the reference token: a near-tie costs one position there, not every later one;
- ``vs float32``: where a float32 run exists, the share of identical greedy tokens against the
  float32 model's (the bfloat16 model's own distance from float32 beside its 8-bit pools');
- ``bytes/token`` is the pool's (every layer, K and V, scales included) and ``tokens per GiB``
  what a pool of the same memory holds, with its ratio to the model-dtype pool's.

    python bench/kv_quant.py                  # float32 and bfloat16, int8 / fp8_e4m3 / fp8_e5m2
    python bench/kv_quant.py --quick          # two short prompts, one long, 8 tokens
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    align_columns,
    args_params,
    cpu_kind,
    machine_info,
    target,
    target_lines,
    write_report,
)
from bench.quant_accuracy import (  # noqa: E402
    QUESTIONS,
    agreement,
    chat_prompts,
    margins_text,
    run_engine,
)
from bench.workloads import TokenStream  # noqa: E402

LONG_QUESTIONS = (
    "Summarize the text above in three sentences.",
    "What is the main subject of the text above?",
    "Write one question a reader of the text above might ask, and answer it.",
    "Which names or places does the text above mention?",
)
TARGET_INT8_IDENTICAL = 0.97
TARGET_INT8_MEAN_DLOGPROB = 0.05
TARGET_TOKENS_VS_BF16 = 1.9
TARGET_TOKENS_VS_F32 = 3.8
GIB = 1 << 30


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", default="float32,bfloat16", help="model dtypes (bfloat16 skipped without the instructions)")
    p.add_argument("--kv-dtypes", default="int8,fp8_e4m3,fp8_e5m2", help="comma list, compared with auto")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--long", type=int, default=4, help="questions about a long document")
    p.add_argument("--doc-len", type=int, default=1024, help="tokens of the long prompts' document")
    p.add_argument("--quick", action="store_true", help="two short prompts, one long, 8 tokens")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "kv_quant.json")
    args = p.parse_args(argv)
    args.dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    args.kv_dtypes = [k.strip() for k in args.kv_dtypes.split(",") if k.strip() and k.strip() != "auto"]
    if args.quick:
        args.tokens, args.long, args.doc_len = 8, 1, 256
    if args.tokens < 1 or not args.kv_dtypes or not args.dtypes:
        p.error("--tokens must be >= 1, --dtypes and --kv-dtypes not empty")
    return args


def same_memory_tokens(tokens: int, dtype: str, kv_cache_dtype: str) -> int:
    """Tokens a ``kv_cache_dtype`` pool holds in the memory of a ``tokens``-token pool of the
    default model in ``dtype``."""
    import torch

    from radixserve.cache.kv_pool import kv_bytes_per_token
    from radixserve.model.default_model import default_model_path
    from radixserve.model.loader import read_config

    cfg = read_config(default_model_path())
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layers, heads = cfg.num_hidden_layers, cfg.num_key_value_heads
    full = kv_bytes_per_token(layers, heads, head_dim, getattr(torch, dtype))
    return tokens * full // kv_bytes_per_token(layers, heads, head_dim, getattr(torch, dtype), kv_cache_dtype)


def share_identical(ref: list[list[int]], got: list[list[int]]) -> float:
    """Mean over prompts of the share of positions with the same token."""
    same = [sum(a == b for a, b in zip(x, y, strict=True)) / len(x) for x, y in zip(ref, got, strict=True)]
    return sum(same) / len(same)


def prompt_set(tokenizer: Any, args: argparse.Namespace) -> list[list[int]]:
    short = chat_prompts(tokenizer, QUESTIONS[:2] if args.quick else QUESTIONS)
    doc = tokenizer.decode(TokenStream(tokenizer, seed=3).take(args.doc_len))
    long = chat_prompts(tokenizer, [f"{doc}\n\n{q}" for q in LONG_QUESTIONS[: args.long]])
    return short + long


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixserve.hardware import cpu_bf16_feature
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    prompts = prompt_set(tokenizer, args)
    kind = cpu_kind()
    dtypes = [d for d in args.dtypes if d != "bfloat16" or cpu_bf16_feature()]
    print(f"cpu: {kind['cpu_model']} ({kind['cpu_kind']}); {len(prompts)} prompts "
          f"({max(map(len, prompts))} tokens the longest), {args.tokens} greedy tokens each; dtypes {dtypes}")
    rows: list[dict[str, Any]] = []
    float32_ids: list[list[int]] | None = None
    for dtype in dtypes:
        base = {"dtype": dtype, "max_total_tokens": 16384}
        print(f"[{dtype} auto] ...", flush=True)
        ref = run_engine(dict(base, kv_cache_dtype="auto"), prompts, None, args.tokens)
        ref_bytes = ref["info"]["kv_cache_bytes_per_token"]
        if dtype == "float32":
            float32_ids = ref["output_ids"]
        rows.append({"dtype": dtype, "kv_cache_dtype": "auto", "bytes_per_token": ref_bytes,
                     "tokens_per_gib": GIB // ref_bytes, "tokens_ratio": 1.0, "identical": 1.0,
                     "first_diff_mean": float(args.tokens), "flip_margins": [],
                     "identical_forced": agreement(ref, ref)["identical_forced"], "mean_abs_dlogprob": 0.0,
                     "max_abs_dlogprob": 0.0, "output_ids": ref["output_ids"]})
        for kv in args.kv_dtypes:
            print(f"[{dtype} {kv}] ...", flush=True)
            got = run_engine(dict(base, kv_cache_dtype=kv), prompts, ref["output_ids"], args.tokens)
            nbytes = got["info"]["kv_cache_bytes_per_token"]
            rows.append({"dtype": dtype, "kv_cache_dtype": kv, "bytes_per_token": nbytes,
                         "tokens_per_gib": GIB // nbytes, "tokens_ratio": ref_bytes / nbytes, **agreement(ref, got)})
    for r in rows:
        r["identical_vs_float32"] = None if float32_ids is None else share_identical(float32_ids, r["output_ids"])
    header = ["dtype", "KV cache", "bytes/token", "tokens per GiB", "x tokens", "identical", "first diff",
              "forced", "flip margin", "mean |d logprob|", "max |d logprob|", "vs float32"]
    lines = [header] + [[r["dtype"], r["kv_cache_dtype"], str(r["bytes_per_token"]), str(r["tokens_per_gib"]),
                         f"{r['tokens_ratio']:.2f}", f"{r['identical']:.1%}", f"{r['first_diff_mean']:.1f}",
                         f"{r['identical_forced']:.1%}", margins_text(r["flip_margins"]),
                         f"{r['mean_abs_dlogprob']:.4f}", f"{r['max_abs_dlogprob']:.4f}",
                         "-" if r["identical_vs_float32"] is None else f"{r['identical_vs_float32']:.1%}"]
                        for r in rows]
    checks = []
    for r in rows:
        if r["kv_cache_dtype"] != "int8":
            continue
        d = r["dtype"]
        # Judged teacher-forced (the reference tokens' argmax and |d logprob|); free-running
        # agreement is in the table, reported, not a target: one flip changes all that follows.
        checks.append(target(d, "int8 KV identical greedy tokens, teacher-forced >=", r["identical_forced"],
                             TARGET_INT8_IDENTICAL, True))
        checks.append(target(d, "int8 KV mean |d logprob| <=", r["mean_abs_dlogprob"], TARGET_INT8_MEAN_DLOGPROB,
                             False))
        goal = TARGET_TOKENS_VS_F32 if d == "float32" else TARGET_TOKENS_VS_BF16
        checks.append(target(d, f"int8 KV pool tokens vs {d} >=", r["tokens_ratio"], goal, True))
    print()
    print(align_columns(lines, left={0, 1}))
    print("\n".join(target_lines(checks)))
    report = {"benchmark": "kv_quant", "params": args_params(args), "machine": machine_info(),
              "prompt_tokens": [len(p) for p in prompts], "results": rows, "targets": checks}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
