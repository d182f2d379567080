"""Agent benchmark: one agent loop at batch 1, as a single agent runs against a local server.

A system prompt of ``--system-len`` tokens (English text and a JSON tool list), then
``--turns`` turns; each turn resends the history (system, earlier user messages and answers)
with a new user message holding a tool result, and waits for an answer of ``--output-len``
tokens (``ignore_eos``) before the next turn: one request at a time.  For each weight format in
``--quantizations``, each sampling mode in ``--modes`` (greedy; sampled: temperature 0.7,
top_p 0.9) and each ``--speculative`` setting (none; ngram: n-gram speculative decoding), a fresh
engine runs the loop and the table shows

  ttft ms per turn   time to the first streamed token (turn 1: the whole prompt computed;
                     later turns: only what the radix cache does not hold)
  decode ms/token    (last token - first token) / (output tokens - 1), over all turns
  floor ms/token     bytes of weights one decode step reads / this machine's memory bandwidth
                     (a large tensor copy, read + write bytes / time, same run)
  wall s             the whole loop
  accept len         ngram: output tokens per verify step (SGLang's spec_accept_length)

``--workload edit`` makes every turn copy-heavy: its tool result is the source of a Python
standard-library function (``read_file``), and the user asks for the file back with the
function renamed -- the answer echoes the tool result, as an agent's edits do.  ``--workload
json`` does the same with JSON: each tool result is a task record, asked back with its
``status`` changed.

and, against float32 without speculation in the same mode, the share of identical output tokens
per turn: positions where the two replies agree.  Where the replies differ, only turn 1 compares
like with like (later prompts hold each run's own earlier answers).  Speculative decoding keeps
the output: its rows read 100% (greedy, and sampled with a seed).

    python bench/agent.py                           # float32, int8, int4 and the GGUF's blocks, greedy
                                                    # and sampled, ngram or not
    python bench/agent.py --quick                   # tiny smoke run
    python bench/agent.py --workload edit --quantizations none   # copy-heavy turns
    python bench/agent.py --workload json --quantizations gguf   # JSON edits
"""

from __future__ import annotations

import argparse
import json
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
    cpu_kind,
    machine_info,
    weight_settings,
    write_report,
)
from bench.workloads import TokenStream  # noqa: E402

TOOLS = [
    {"type": "function", "function": {"name": name, "description": desc, "parameters": {
        "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    for name, desc, arg in (
        ("read_file", "Read a file of the repository and return its text.", "path"),
        ("search", "Search the repository for a regular expression; return matching lines.", "pattern"),
        ("run_tests", "Run the test suite, or one test file, and return the summary.", "target"),
        ("edit_file", "Replace a span of a file with new text; return the diff.", "patch"),
    )
]
MODES = {"greedy": {"temperature": 0.0}, "sampled": {"temperature": 0.7, "top_p": 0.9, "seed": 7}}


def add_loop_args(p: argparse.ArgumentParser) -> None:
    """The loop's shape (also bench/agent_http.py's)."""
    p.add_argument("--system-len", type=int, default=1024, help="system prompt tokens (text + tools)")
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-len", type=int, default=64, help="tokens of each turn's user message")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--workload", choices=("agent", "edit", "json"), default="agent",
                   help="agent: tool results of English text; edit: tool results of code, echoed back "
                        "renamed; json: tool results of JSON, echoed back with one field changed")
    p.add_argument("--quick", action="store_true", help="tiny smoke run (system 128, 2 turns, 8 out)")


def check_loop_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.quick:
        args.system_len, args.turns, args.user_len, args.output_len = 128, 2, 16, 8
    if min(args.system_len, args.turns, args.user_len) < 1 or args.output_len < 2:
        p.error("--system-len, --turns and --user-len must be >= 1, --output-len >= 2")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_loop_args(p)
    p.add_argument("--quantizations", default="none,int8,int4,gguf",
                   help="comma list of --quantization values (+a8: with --int8-activations, e.g. gguf+a8)")
    p.add_argument("--modes", default="greedy,sampled", help=f"comma list of {sorted(MODES)}")
    p.add_argument("--speculative", default="none,ngram", help="comma list: none, ngram")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "agent.json")
    args = p.parse_args(argv)
    check_loop_args(p, args)
    args.quantizations = [q.strip() for q in args.quantizations.split(",") if q.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    args.speculative = [m.strip() for m in args.speculative.split(",") if m.strip()]
    bad = [m for m in args.modes if m not in MODES]
    if bad or not args.modes or not args.quantizations:
        p.error(f"unknown or empty --modes {bad}; choose from {sorted(MODES)}")
    if not args.speculative or set(args.speculative) - {"none", "ngram"}:
        p.error(f"--speculative takes none and/or ngram, got {args.speculative}")
    return args


def memory_bandwidth_gbs() -> float:
    """Read + write bytes of a 256 MB tensor copy per second, best of 5 (GB/s)."""
    import torch

    src = torch.ones(64 * 2**20, dtype=torch.float32)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def weight_bytes_per_step(model_path: str | None, dtype: str, quantization: str) -> int:
    """Bytes of the matmul weights one decode step reads (the embedding row lookup aside)."""
    import torch

    from radixserve.model.loader import load_model
    from radixserve.quantization import QuantizedWeight

    model = load_model(model_path, getattr(torch, dtype), quantization=quantization).model
    total = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            total += weight.nbytes
        elif isinstance(weight, torch.nn.Parameter) and weight.dim() == 2:
            is_table = module is model.model.embed_tokens
            if not is_table or model.lm_head is None:  # a tied table is the LM head, read whole
                total += weight.numel() * weight.element_size()
    return total


# Python functions whose source is an edit turn's tool result (short ones; one per turn).
EDIT_SOURCES = ("textwrap.dedent", "statistics.median", "base64.b64encode", "colorsys.rgb_to_hsv",
                "statistics.mode", "textwrap.indent", "shlex.quote", "calendar.isleap")


def edit_turn(name: str) -> str:
    import importlib
    import inspect

    module, func = name.rsplit(".", 1)
    source = inspect.getsource(getattr(importlib.import_module(module), func))
    return (f"Tool result (read_file {module}.py, lines of {func}):\n```python\n{source}```\n"
            f"Return this code with `{func}` renamed to `{func}_v2` and nothing else changed.")


JSON_WORDS = ("parser", "cache", "router", "worker", "schema", "index", "loader", "tokenizer", "metrics",
              "scheduler", "backend", "grammar")


def json_turn(seed: int, turn: int) -> str:
    """A JSON record (a task tracker's issue) as a tool result, to be returned with its status
    changed: an agent's JSON edit, most of the answer copied from the prompt."""
    import random

    rng = random.Random(seed * 1000 + turn)
    words = rng.sample(JSON_WORDS, 6)
    record = {
        "id": f"TASK-{rng.randint(100, 999)}", "title": f"Refactor the {words[0]} and its {words[1]}",
        "status": "open", "priority": rng.choice(["low", "medium", "high"]),
        "assignee": {"name": f"dev-{words[2]}", "team": words[3]},
        "labels": [words[4], words[5], "refactor"],
        "steps": [{"name": f"split the {w} module", "done": rng.random() < 0.5} for w in words[:3]],
        "estimate_hours": rng.randint(2, 40),
    }
    return (f"Tool result (get_task {record['id']}):\n```json\n{json.dumps(record, indent=2)}\n```\n"
            'Return this JSON with "status" set to "in_progress" and nothing else changed.')


def conversation(tokenizer: Any, args: argparse.Namespace) -> tuple[str, list[str]]:
    """The system prompt (text then the tool list, ``--system-len`` tokens) and each turn's
    user message: a tool result of ``--user-len`` tokens of text, or (``--workload edit``) a
    function's source to echo back renamed."""
    stream = TokenStream(tokenizer, args.seed)
    tools = "\n\nTools:\n" + json.dumps(TOOLS, indent=1)
    tool_len = len(tokenizer.encode(tools, add_special_tokens=False))
    system = tokenizer.decode(stream.take(max(1, args.system_len - tool_len))) + tools
    if args.workload == "edit":
        return system, [edit_turn(EDIT_SOURCES[(args.seed + t) % len(EDIT_SOURCES)]) for t in range(args.turns)]
    if args.workload == "json":
        return system, [json_turn(args.seed, t) for t in range(args.turns)]
    users = [f"Tool result {t + 1}:\n" + tokenizer.decode(stream.take(args.user_len)) for t in range(args.turns)]
    return system, users


def run_loop(engine: Any, system: str, users: list[str], params: dict[str, Any]) -> dict[str, Any]:
    """One agent loop; per turn: TTFT, token times, output ids, cached tokens."""
    messages = [{"role": "system", "content": system}]
    turns = []
    started = time.perf_counter()
    for user in users:
        messages.append({"role": "user", "content": user})
        prompt = engine.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        t0 = time.perf_counter()
        stamps, ids, meta = [], [], {}
        for piece in engine.generate(prompt, params, stream=True):  # each piece: the new ids
            if piece["output_ids"]:
                stamps.append(time.perf_counter() - t0)
                ids += piece["output_ids"]
            meta = piece["meta_info"]
        turns.append({"ttft_s": stamps[0], "last_s": stamps[-1], "output_ids": list(ids),
                      "prompt_tokens": meta.get("prompt_tokens"), "cached_tokens": meta.get("cached_tokens")})
        messages.append({"role": "assistant", "content": engine.tokenizer.decode(ids, skip_special_tokens=True)})
    return {"wall_s": time.perf_counter() - started, "turns": turns}


def result_row(quant: str, mode: str, spec: str, dtype: str, loop: dict[str, Any], step_bytes: int,
               bandwidth: float, before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """One table row: the loop's timings, the decode floor, and the drafts' acceptance."""
    decode = [(t["last_s"] - t["ttft_s"]) / (len(t["output_ids"]) - 1) for t in loop["turns"]]
    verifies = after.get("spec_verify_steps", 0) - before.get("spec_verify_steps", 0)
    accepted = after.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0)
    return {
        "quantization": quant, "mode": mode, "speculative": spec, "dtype": dtype, "wall_s": loop["wall_s"],
        "ttft_ms": [1e3 * t["ttft_s"] for t in loop["turns"]],
        "decode_ms_per_token": 1e3 * sum(decode) / len(decode),
        "floor_ms_per_token": 1e3 * step_bytes / (bandwidth * 1e9),
        "weight_bytes_per_step": step_bytes,
        "spec_accept_length": (verifies + accepted) / verifies if verifies else None,
        "spec_draft_tokens": after.get("spec_draft_tokens", 0) - before.get("spec_draft_tokens", 0),
        "spec_accepted_tokens": accepted,
        "cached_tokens": [t["cached_tokens"] for t in loop["turns"]],
        "prompt_tokens": [t["prompt_tokens"] for t in loop["turns"]],
        "output_ids": [t["output_ids"] for t in loop["turns"]],
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    from radixserve.engine import Engine
    from radixserve.model.default_model import default_model_path

    default_model_path()  # converted once (the engines and the byte count load it)
    model_path = None  # the default model: its GGUF's blocks for --quantization gguf / auto
    bandwidth = memory_bandwidth_gbs()
    kind = cpu_kind()
    print(f"cpu: {kind['cpu_model']} ({kind['cpu_kind']}); memory bandwidth {bandwidth:.1f} GB/s (copy)")
    rows: list[dict[str, Any]] = []
    for quant in args.quantizations:
        step_bytes = weight_bytes_per_step(model_path, args.dtype, weight_settings(quant)["quantization"])
        for mode in args.modes:
            for spec in args.speculative:
                name = f"[{quant} {mode} spec={spec}]"
                print(f"{name} ...", flush=True)
                params = {**MODES[mode], "max_new_tokens": args.output_len, "ignore_eos": True}
                algorithm = None if spec == "none" else spec
                with Engine(dtype=args.dtype, speculative_algorithm=algorithm, **weight_settings(quant)) as engine:
                    system, users = conversation(engine.tokenizer, args)
                    engine.generate("warm-up", {"max_new_tokens": 2})
                    before = engine.get_stats()
                    loop = run_loop(engine, system, users, params)
                    after = engine.get_stats()
                rows.append(result_row(quant, mode, spec, args.dtype, loop, step_bytes, bandwidth, before, after))
                print(f"{name} {loop['wall_s']:.1f} s", flush=True)
    reference = {r["mode"]: r for r in rows if r["quantization"] == "none" and r["speculative"] == "none"}
    for r in rows:
        ref = reference.get(r["mode"])
        r["identical_vs_none"] = None if ref is None or ref is r else [
            sum(a == b for a, b in zip(x, y, strict=True)) / len(x)
            for x, y in zip(ref["output_ids"], r["output_ids"], strict=True)]
    header = ["weights", "mode", "spec", "wall s", "ttft ms per turn", "decode ms/tok", "floor ms/tok",
              "decode/floor", "accept len", "identical vs none"]
    lines = [header] + [[
        r["quantization"], r["mode"], r["speculative"], f"{r['wall_s']:.1f}", " ".join(f"{t:.0f}" for t in r["ttft_ms"]),
        f"{r['decode_ms_per_token']:.1f}", f"{r['floor_ms_per_token']:.1f}",
        f"{r['decode_ms_per_token'] / r['floor_ms_per_token']:.2f}x",
        "-" if r["spec_accept_length"] is None else f"{r['spec_accept_length']:.2f}",
        "-" if r["identical_vs_none"] is None else " ".join(f"{x:.0%}" for x in r["identical_vs_none"]),
    ] for r in rows]
    print()
    print(align_columns(lines, left={0, 1, 2, 4, 9}))
    report = {"benchmark": "agent", "params": args_params(args), "machine": machine_info(),
              "memory_bandwidth_gbs": bandwidth, "results": rows}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
