"""bench/gpu_e2e.py's parity part: a few prompts, greedy, by the engine with every backend in every
dtype and by Hugging Face transformers on the same device; float32 must match transformers
float32's tokens, other dtypes are scored teacher-forced on them (bench/gpu_e2e.py says how)."""

from __future__ import annotations

import re
import traceback
from typing import Any

import torch

from bench.gpu_engines import PartTimeout, Run, default_settings, engine_settings, greedy
from bench.gpu_summary import HALF_MAX, HALF_MEAN
from bench.workloads import unique_prompts

PROMPTS = ("The capital of France is", "def fibonacci(n):\n", "Once upon a time, in a small village by the sea,",
           "The three laws of thermodynamics are", "Q: What is 17 times 23?\nA:")
PARITY_GRAPH_BS = 8  # CUDA graphs captured by the engines only parity uses (it runs 6 prompts)


def load_hf(folder: str, dtype: str, device: str) -> Any:
    import transformers

    version = tuple(int(x) for x in re.findall(r"\d+", transformers.__version__)[:2])
    key = "dtype" if version >= (4, 56) else "torch_dtype"
    from radixserve.model.gguf_folder import transformers_args

    where, kwargs = transformers_args(folder)  # a GGUF model's folder: the file itself
    model = transformers.AutoModelForCausalLM.from_pretrained(where, **{key: getattr(torch, dtype)},
                                                              **kwargs)
    model = model.to(device).eval()
    model.generation_config.eos_token_id = None  # exactly n tokens, as the engine's ignore_eos
    return model


@torch.inference_mode()
def hf_generate(model: Any, prompt: list[int], n: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=n,
                         pad_token_id=0)
    return out[0, len(prompt):].tolist()


@torch.inference_mode()
def hf_logprobs(model: Any, prompt: list[int], cont: list[int]) -> list[float]:
    """Per-token logprobs of ``cont`` after ``prompt`` (one forward over both)."""
    ids = torch.tensor([prompt + cont], device=model.device)
    logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
    picked = torch.log_softmax(logits, -1).gather(1, torch.tensor(cont, device=model.device)[:, None])
    return picked[:, 0].tolist()


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def score(dtype: str, system: str, against: str, outs: list[list[int]], lps: list[list[float]],
          ref: list[list[int]], ref_lps: list[list[float]]) -> dict[str, Any]:
    """Greedy agreement with ``ref`` and the teacher-forced logprob gap to ``ref_lps``."""
    match = [common_prefix(o, r) for o, r in zip(outs, ref, strict=True)]
    gaps = [abs(a - b) for x, y in zip(lps, ref_lps, strict=True) for a, b in zip(x, y, strict=True)]
    identical = all(m == len(r) for m, r in zip(match, ref, strict=True))
    mean, worst = sum(gaps) / len(gaps), max(gaps)
    ok = identical if dtype == "float32" else (mean <= HALF_MEAN and worst <= HALF_MAX)
    return {"dtype": dtype, "system": system, "against": against, "greedy_match": match,
            "identical": identical, "mean_abs_dlogprob": mean, "max_abs_dlogprob": worst, "ok": ok}


def engine_parity(run: Run, dtype: str, backend: str, prompts: list[list[int]],
                  ref: list[list[int]]) -> tuple[list[list[int]], list[list[float]]]:
    """The engine's greedy tokens, and its logprobs of the reference's tokens (teacher-forced)."""
    settings = engine_settings(run.args, dtype, backend)
    if settings != default_settings(run.args):  # parity-only engine: capture a few graphs only
        settings["cuda_graph_max_bs"] = PARITY_GRAPH_BS
    label = f"{backend}-{dtype}"
    res, _, _ = run.batch(label, settings, [{"input_ids": p, "sampling_params": greedy(run.args.parity_tokens)}
                                            for p in prompts])
    forced = [{"input_ids": p + c, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
               "logprob_start_len": len(p)} for p, c in zip(prompts, ref, strict=True)]
    scored, _, _ = run.batch(label, settings, forced)
    lps = [[lp for lp, _, _ in r["meta_info"]["input_token_logprobs"]] for r in scored]
    return [r["output_ids"] for r in res], lps


def part_parity(run: Run, out: dict[str, Any]) -> None:
    args, tok = run.args, run.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS[: args.parity_prompts]]
    if args.parity_long:
        prompts += unique_prompts(tok, 1, args.parity_long, args.seed)
    n = args.parity_tokens
    out.update(prompt_lens=[len(p) for p in prompts], new_tokens=n, rows=[], criteria={
        "float32": "greedy tokens identical to transformers float32's",
        "half": f"logprobs of transformers float32's greedy tokens within mean {HALF_MEAN}, max {HALF_MAX} nats"})
    ref: list[list[int]] = []
    ref_lps: list[list[float]] = []

    def add(row: dict[str, Any]) -> None:
        out["rows"].append(row)
        print(f"[parity] {row['dtype']} {row['system']} vs {row['against']}: " + (
            f"error: {row['error']}" if "error" in row else f"greedy match {row['greedy_match']}, "
            f"|dlogprob| mean {row['mean_abs_dlogprob']:.2e} max {row['max_abs_dlogprob']:.2e}"), flush=True)

    for dtype in args.dtypes:  # float32 first: transformers float32 is the reference
        model = load_hf(run.folder, dtype, args.device)
        outs = []
        for p in prompts:
            run.check_time()
            outs.append(hf_generate(model, p, n))
        if not ref:
            ref, ref_lps = outs, [hf_logprobs(model, p, c) for p, c in zip(prompts, outs, strict=True)]
        else:
            lps = [hf_logprobs(model, p, c) for p, c in zip(prompts, ref, strict=True)]
            add({**score(dtype, "transformers", "transformers float32", outs, lps, ref, ref_lps), "yardstick": True})
        del model
        if args.device == "cuda":
            torch.cuda.empty_cache()
        systems = {}
        for backend in args.backends:
            try:
                systems[backend] = engine_parity(run, dtype, backend, prompts, ref)
            except PartTimeout:
                raise
            except Exception as e:  # one backend failing (e.g. at start) leaves the others to run
                traceback.print_exc()
                add({"dtype": dtype, "system": f"radixserve {backend}", "against": "transformers float32",
                     "error": f"{type(e).__name__}: {e}"[:300], "ok": False})
                continue
            add(score(dtype, f"radixserve {backend}", "transformers float32", *systems[backend], ref, ref_lps))
        if {"triton", "torch"} <= systems.keys():
            add(score(dtype, "radixserve triton", "radixserve torch", *systems["triton"], *systems["torch"]))
