"""Accuracy of the weight formats (``--quantization``) against float32, over a fixed prompt set.

For each of eight chat prompts the float32 model (``none``) decodes ``--tokens`` greedy tokens:
the reference.  Each weight format in ``--quantizations`` then, in a fresh engine,
- decodes its own greedy tokens: ``identical`` is the share of positions where they equal the
  reference's (averaged over the prompts; after a first difference the texts usually part),
  ``first diff`` the mean position of the first difference (``--tokens`` where none), and
  ``flip margin`` the reference's top-1 minus top-2 logprob at each first difference (how near
  a tie it was);
- scores the reference tokens teacher-forced (prompt + reference as the input, SGLang's
  ``input_token_logprobs``; for quantized weights one position at a time, each a one-row step,
  since a prefill's rows do not take the decode kernels): ``mean / max |d logprob|`` against float32's own logprobs of them,
  a measure that one near-tie does not decide, and ``forced``, the share of reference
  positions whose argmax (given the reference's prefix) is the reference token.
``weights MB`` is the bytes of the matmul weights as served.

    python bench/quant_accuracy.py                 # none, int8, int4, gguf
    python bench/quant_accuracy.py --quick         # two prompts, 8 tokens
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
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
    weight_settings,
    write_report,
)

QUESTIONS = (
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three uses of Python's itertools module.",
    "How do I reverse a list in Python?",
    "Give me a JSON object with a name and an age.",
    "Why is the sky blue?",
    "Translate 'good morning' into Spanish and German.",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quantizations", default="int8,int4,gguf",
                   help="comma list, compared with none (+a8: with --int8-activations, e.g. gguf+a8)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quick", action="store_true", help="two prompts, 8 tokens")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "quant_accuracy.json")
    args = p.parse_args(argv)
    args.quantizations = [q.strip() for q in args.quantizations.split(",") if q.strip() and q.strip() != "none"]
    if args.quick:
        args.tokens = 8
    if args.tokens < 1 or not args.quantizations:
        p.error("--tokens must be >= 1 and --quantizations name at least one format besides none")
    return args



def run_engine(settings: dict[str, Any], prompts: list[list[int]], reference: list[list[int]] | None,
               tokens: int, stepwise: bool = False) -> dict[str, Any]:
    """One engine with ``settings``: its greedy tokens for each prompt and its logprobs of
    ``reference`` (its own tokens when None), teacher-forced: in one prefill, or with
    ``stepwise`` one position at a time (:func:`score_stepwise`)."""
    from radixserve.engine import Engine

    params = {"temperature": 0.0, "max_new_tokens": tokens, "ignore_eos": True}
    with Engine(**settings) as engine:
        info = engine.info.to_dict()
        outs = [engine.generate(input_ids=p, sampling_params=params)["output_ids"] for p in prompts]
        scored = reference or outs
        score = score_stepwise if stepwise else score_prefill
        scores = [score(engine, prompt, ref) for prompt, ref in zip(prompts, scored, strict=True)]
    return {"info": info, "output_ids": outs, "reference_logprobs": [s[0] for s in scores],
            "top_ids": [s[1] for s in scores], "margins": [s[2] for s in scores]}


def score_prefill(engine: Any, prompt: list[int], ref: list[int]) -> tuple[list[float], list[int], list[float]]:
    """The logprob of each token of ``ref`` after ``prompt`` and what precedes it in ``ref``, the
    argmax there and its margin over the second, in one prefill of ``prompt + ref``."""
    res = engine.generate(input_ids=prompt + ref, sampling_params={"max_new_tokens": 0},
                          return_logprob=True, logprob_start_len=len(prompt), top_logprobs_num=2)
    tops = res["meta_info"]["input_top_logprobs"]
    return ([entry[0] for entry in res["meta_info"]["input_token_logprobs"]], [t[0][1] for t in tops],
            [t[0][0] - t[1][0] for t in tops])


STEPWISE_TOP = 20


def score_stepwise(engine: Any, prompt: list[int], ref: list[int]) -> tuple[list[float], list[int], list[float]]:
    """As :func:`score_prefill`, one position at a time: each call's prefix is in the radix cache
    but for its last token, so the logits come from a one-row step, the decode path (int8
    activations change only that path; a prefill's rows run the float matmul).  A reference token
    outside the step's top :data:`STEPWISE_TOP` counts with the last of them (a bound)."""
    logprobs, top_ids, margins = [], [], []
    for j in range(len(ref)):
        res = engine.generate(input_ids=prompt + ref[:j], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                              return_logprob=True, top_logprobs_num=STEPWISE_TOP)
        tops = res["meta_info"]["output_top_logprobs"][0]
        by_id = {t[1]: t[0] for t in tops}
        logprobs.append(by_id.get(ref[j], tops[-1][0]))
        top_ids.append(tops[0][1])
        margins.append(tops[0][0] - tops[1][0])
    return logprobs, top_ids, margins


def agreement(ref: dict[str, Any], got: dict[str, Any]) -> dict[str, Any]:
    """How far ``got`` (a :func:`run_engine` result scored on ``ref``'s tokens) is from ``ref``."""
    same = [sum(a == b for a, b in zip(x, y, strict=True)) / len(x)
            for x, y in zip(ref["output_ids"], got["output_ids"], strict=True)]
    first = [next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), len(x))
             for x, y in zip(ref["output_ids"], got["output_ids"], strict=True)]
    deltas = [abs(a - b) for xs, ys in zip(ref["reference_logprobs"], got["reference_logprobs"], strict=True)
              for a, b in zip(xs, ys, strict=True)]
    # Teacher-forced: at each position of the reference, given the reference's prefix, does the
    # argmax equal the reference token?  One near-tie costs one position here, not the rest.
    forced = [sum(a == b for a, b in zip(x, y, strict=True)) / len(x)
              for x, y in zip(ref["output_ids"], got["top_ids"], strict=True)]
    # How near a tie each first difference was: the reference's top-1 minus top-2 logprob there.
    flip_margins = [ref["margins"][i][f] for i, f in enumerate(first) if f < len(ref["output_ids"][i])]
    return {"identical": sum(same) / len(same), "identical_per_prompt": same,
            "first_diff_mean": sum(first) / len(first), "identical_forced": sum(forced) / len(forced),
            "flip_margins": flip_margins, "mean_abs_dlogprob": sum(deltas) / len(deltas),
            "max_abs_dlogprob": max(deltas), "output_ids": got["output_ids"]}


def margins_text(margins: list[float]) -> str:
    """The flip margins of a row, for the table ("-" where no prompt parted)."""
    return " ".join(f"{m:.3f}" for m in sorted(margins)) or "-"


def chat_prompts(tokenizer: Any, questions: Sequence[str]) -> list[list[int]]:
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tokenize=False,
                                           add_generation_prompt=True) for q in questions]
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    prompts = chat_prompts(tokenizer, QUESTIONS[:2] if args.quick else QUESTIONS)
    kind = cpu_kind()
    print(f"cpu: {kind['cpu_model']} ({kind['cpu_kind']}); {len(prompts)} prompts, {args.tokens} greedy tokens each")
    print("[none] ...", flush=True)
    base = {"dtype": args.dtype, "max_total_tokens": 8192}
    ref = run_engine(dict(base, quantization="none"), prompts, None, args.tokens)
    rows = []
    for quant in args.quantizations:
        print(f"[{quant}] ...", flush=True)
        # quantized weights' decode rows go through kernels of their own (int8 activations; one-row
        # steps of 4-bit weights in 16-bit x on an AVX-512 VNNI CPU), a prefill's through the float matmul
        got = run_engine(dict(base, **weight_settings(quant)), prompts, ref["output_ids"], args.tokens,
                         stepwise=quant != "none")
        rows.append({"quantization": quant, "served_as": got["info"]["quantization"], **agreement(ref, got)})
    header = ["weights", "served as", "identical", "first diff", "forced", "flip margin", "mean |d logprob|",
              "max |d logprob|"]
    lines = [header] + [[r["quantization"], r["served_as"], f"{r['identical']:.0%}", f"{r['first_diff_mean']:.1f}",
                         f"{r['identical_forced']:.1%}", margins_text(r["flip_margins"]),
                         f"{r['mean_abs_dlogprob']:.4f}", f"{r['max_abs_dlogprob']:.4f}"] for r in rows]
    print()
    print(align_columns(lines, left={0, 1}))
    report = {"benchmark": "quant_accuracy", "params": args_params(args), "machine": machine_info(),
              "reference_output_ids": ref["output_ids"], "results": rows}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
