"""LoRA benchmark: one agent-style shared-prefix workload over 0, 1, 4 and 16 adapters.

``--requests`` requests arrive together; each is a shared system prompt (``--system-len``
tokens of text and a tool list), its own user message (``--user-len``) and an answer of
``--output-len`` tokens (``ignore_eos``).  Request ``i`` runs adapter ``i mod k`` of ``k``
random adapters (rank ``--rank`` on every projection, written in peft's format by this script),
so the system prompt is computed once per adapter and read from the cache by the others.  One
run, a fresh engine per row:

  base                LoRA off: the base model alone
  base, LoRA on       --enable-lora with adapters loaded, every request on the base model
  k adapters          the requests spread over k adapters (16 > --max-loras-per-batch's 8
                      slots: requests wait for a slot and adapters move in and out of slots)

and for each: wall seconds, output tokens per second, decode ms per step (decode-only steps
of the batch), the cache hit rate (prompt tokens served from the tree, over all requests and
the lowest of the adapters'), and one request alone (``4 * --output-len`` tokens, the median
of 3): decode ms/token on the first adapter (the base model in the base rows).

    python bench/lora.py            # 64 requests, system 1024, output 64
    python bench/lora.py --quick    # tiny smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.agent import conversation  # noqa: E402
from bench.common import align_columns, args_params, machine_info, write_report  # noqa: E402

ALONE_RUNS = 3
PROJECTIONS = {"self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
               "mlp": ("gate_proj", "up_proj", "down_proj")}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="model (default: the embedded default model)")
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--system-len", type=int, default=1024)
    p.add_argument("--user-len", type=int, default=32)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--adapters", default="1,4,16", help="comma list of adapter counts")
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--max-loras-per-batch", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "lora.json")
    args = p.parse_args(argv)
    if args.quick:
        args.requests, args.system_len, args.user_len, args.output_len = 8, 96, 8, 6
        args.adapters = "1,4"
    args.adapters = [int(k) for k in args.adapters.split(",") if k.strip()]
    if min(args.requests, args.system_len, args.user_len, args.rank, *args.adapters) < 1:
        p.error("--requests, --system-len, --user-len, --rank and the adapter counts must be "
                ">= 1")
    if args.output_len < 2:
        p.error("--output-len must be >= 2")
    return args


def write_random_adapter(folder: Path, config: dict[str, Any], rank: int, seed: int) -> str:
    """A peft-format adapter (``adapter_config.json``, ``adapter_model.safetensors``) with
    random A and B on every projection, small enough to leave the model's text readable."""
    import torch
    from safetensors.torch import save_file

    h, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config.get("num_key_value_heads")
    d = config.get("head_dim") or h // heads
    shapes = {"q_proj": (h, heads * d), "k_proj": (h, (kv or heads) * d),
              "v_proj": (h, (kv or heads) * d), "o_proj": (heads * d, h),
              "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for parent, projs in PROJECTIONS.items():
            for proj in projs:
                fan_in, fan_out = shapes[proj]
                key = f"base_model.model.model.layers.{layer}.{parent}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) / fan_in**0.5
                tensors[f"{key}.lora_B.weight"] = 0.02 * torch.randn(fan_out, rank, generator=gen)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    targets = [p for projs in PROJECTIONS.values() for p in projs]
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": targets,
        "bias": "none", "use_rslora": False}))
    return str(folder)


def _decode(before: dict[str, Any], after: dict[str, Any]) -> tuple[float | None, float | None]:
    """(ms per decode-only step, ms per token of those steps) between two stats snapshots."""
    seconds = after["decode_only_seconds"] - before["decode_only_seconds"]
    tokens = after["decode_only_tokens"] - before["decode_only_tokens"]
    steps = sum(v[0] for v in after["overhead_by_batch"].values()) - sum(
        v[0] for v in before["overhead_by_batch"].values())
    return (1000 * seconds / steps if steps else None, 1000 * seconds / tokens if tokens else None)


def run_row(args: argparse.Namespace, name: str, paths: dict[str, str], used: list[str],
            prompts: list[str]) -> dict[str, Any]:
    """One engine: the batch of requests on adapters ``used`` (round robin; none: the base
    model), then one request alone."""
    from radixserve import Engine

    settings: dict[str, Any] = {"random_seed": args.seed}
    if paths:
        settings.update(lora_paths=[f"{n}={p}" for n, p in paths.items()],
                        max_loras_per_batch=args.max_loras_per_batch, max_lora_rank=args.rank)
    print(f"[{name}] starting the engine ...", flush=True)
    sampling = {"max_new_tokens": args.output_len, "temperature": 0, "ignore_eos": True}
    with Engine(args.model, **settings) as engine:
        loras = [used[i % len(used)] for i in range(len(prompts))] if used else None
        before = engine.get_stats()
        t0 = time.perf_counter()
        outs = engine.generate(prompts, sampling, lora_path=loras, progress=True)
        wall = time.perf_counter() - t0
        after = engine.get_stats()
        step_ms, _ = _decode(before, after)
        alone = {"max_new_tokens": 4 * args.output_len, "temperature": 0, "ignore_eos": True}
        token_ms = []
        for i in range(ALONE_RUNS):  # one request at a time, its decode speed (median of 3)
            before_one = engine.get_stats()
            engine.generate(prompts[i % len(prompts)] + " Once more.", alone,
                            lora_path=used[0] if used else None)
            token_ms.append(_decode(before_one, engine.get_stats())[1])
    out_tokens = sum(len(o["output_ids"]) for o in outs)
    hit = after["cached_tokens"] - before["cached_tokens"]
    prompt = after["prompt_tokens"] - before["prompt_tokens"]
    per_adapter = after.get("adapter_cache_hit_rate", {})
    return {
        "config": name, "adapters": len(used), "requests": len(prompts),
        "wall_s": wall, "output_tokens": out_tokens, "tokens_per_s": out_tokens / wall,
        "decode_ms_per_step": step_ms,
        "one_request_decode_ms_per_token": statistics.median(token_ms),
        "cache_hit_rate": hit / prompt if prompt else 0.0,
        "adapter_cache_hit_rate": {n: per_adapter[n] for n in used if n in per_adapter},
        "lowest_adapter_hit_rate": min((per_adapter[n] for n in used if n in per_adapter),
                                       default=None),
    }


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def table(rows: list[dict[str, Any]]) -> str:
    lines = [["config", "wall s", "tok/s", "decode ms/step", "hit rate", "lowest adapter hit",
              "1 request ms/token"]]
    for r in rows:
        lines.append([r["config"], f"{r['wall_s']:.1f}", f"{r['tokens_per_s']:.1f}",
                      _fmt(r["decode_ms_per_step"], ".1f"), f"{r['cache_hit_rate']:.3f}",
                      _fmt(r["lowest_adapter_hit_rate"], ".3f"),
                      _fmt(r["one_request_decode_ms_per_token"], ".2f")])
    return align_columns(lines, left={0})


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixserve.model.default_model import resolve_model_path
    from radixserve.tokenizer import load_tokenizer

    folder = resolve_model_path(args.model)
    config = json.loads((Path(folder) / "config.json").read_text())
    tokenizer = load_tokenizer(folder)
    loop = argparse.Namespace(system_len=args.system_len, user_len=args.user_len,
                              turns=args.requests, seed=args.seed, workload="agent")
    system, users = conversation(tokenizer, loop)
    prompts = [system + "\n\n" + u for u in users]
    top = max(args.adapters)
    with tempfile.TemporaryDirectory(prefix="radixserve-lora-") as tmp:
        print(f"writing {top} random adapters (rank {args.rank}) ...", flush=True)
        paths = {f"adapter-{i}": write_random_adapter(Path(tmp) / f"a{i}", config, args.rank,
                                                      args.seed + i) for i in range(top)}
        rows = [run_row(args, "base", {}, [], prompts),
                run_row(args, "base, LoRA on", paths, [], prompts)]
        for k in args.adapters:
            rows.append(run_row(args, f"{k} adapter{'s' if k > 1 else ''}", paths,
                                list(paths)[:k], prompts))
    print(table(rows))
    report = {"benchmark": "lora", "machine": machine_info(), "params": args_params(args),
              "rows": rows}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
