"""Command line: ``radixserve generate``, ``radixserve serve``, ``radixserve chat``."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from typing import Any

from radixserve.config import ServerArgs, env_default

_HELP = {
    "model": "local HF folder (config.json + safetensors) or .gguf file; default: embedded SmolLM2-135M-Instruct",
    "tokenizer": "tokenizer folder, if not the model's",
    "dtype": "weights and KV dtype: auto (float32 on CPU, bfloat16 on GPU), float32, bfloat16, float16",
    "device": "auto, cpu or cuda",
    "attention_backend": "auto (triton on GPU, torch on CPU), torch or triton",
    "page_size": "tokens per KV page (1 on CPU, 16 on GPU when unset)",
    "max_total_tokens": "KV pool size in tokens (sized from free memory when unset)",
    "max_running_requests": "most requests decoding at once",
    "max_prefill_tokens": "token budget of one prefill batch",
    "chunked_prefill_size": "longest prefill chunk (1024 on CPU, 8192 on GPU when unset; -1 off)",
    "schedule_policy": "lpm (longest cached prefix first) or fcfs",
    "disable_radix_cache": "turn the prefix cache off",
    "context_length": "longest sequence (default: the model's)",
    "random_seed": "seed of the seeds drawn for requests that give none",
    "stream_interval": "send streamed tokens every N steps",
    "kv_cache_memory_fraction": "share of free memory for the KV pool when max_total_tokens is unset",
    "log_level": "debug, info, warning, error",
    "startup_timeout": "seconds to wait for the model to load",
    "host": "HTTP server address",
    "port": "HTTP server port",
    "served_model_name": "model name reported by /v1/models and accepted in requests",
    "max_queued_requests": "waiting requests beyond which new ones get HTTP 503 (unlimited when unset)",
    "api_key": "require 'Authorization: Bearer <key>' on HTTP requests",
    "grammar_backend": "constrained decoding backend: xgrammar, or none (json_schema/regex/ebnf refused)",
    "disable_jump_forward": "decode grammar-forced text token by token instead of appending it at once",
    "tool_call_parser": "tool-call format: auto (from the chat template), hermes, qwen25, qwen3, llama3, mistral, prompted",
    "reasoning_parser": "split <think> output into reasoning_content: qwen3 or deepseek-r1",
}


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """One flag per ServerArgs field; defaults also read from RADIXSERVE_<NAME>."""
    for f in dataclasses.fields(ServerArgs):
        flag = "--" + f.name.replace("_", "-")
        default = env_default(f.name, f.default)
        help_text = f"{_HELP.get(f.name, '')} (default: {default})"
        if f.type in ("bool", bool):
            if isinstance(default, str):
                default = default.lower() in ("1", "true", "yes")
            parser.add_argument(flag, action="store_true", default=default, help=help_text)
            continue
        conv: Any = str
        if "int" in str(f.type):
            conv = int
        elif "float" in str(f.type):
            conv = float
        if default is not None and isinstance(default, str) and conv is not str:
            default = conv(default)
        parser.add_argument(flag, type=conv, default=default, help=help_text)


def args_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs)}


def cmd_generate(ns: argparse.Namespace) -> int:
    from radixserve.engine import Engine

    settings = args_from_namespace(ns)
    model = settings.pop("model")
    with Engine(model, **settings) as engine:
        tok = engine.tokenizer
        prompt = ns.prompt
        if not ns.raw and getattr(tok, "chat_template", None):
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": ns.prompt}], tokenize=False, add_generation_prompt=True
            )
        params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
        for piece in engine.generate(prompt, params, stream=True):
            sys.stdout.write(piece["text"])
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from radixserve.frontend.server import run_server

    return run_server(ServerArgs.from_kwargs(**args_from_namespace(ns)))


def cmd_chat(ns: argparse.Namespace) -> int:
    from radixserve.chat import chat_local, chat_remote

    if ns.base_url:
        return chat_remote(ns.base_url, ns.max_new_tokens, ns.temperature, ns.system, ns.api_key)
    settings = args_from_namespace(ns)
    return chat_local(settings, ns.max_new_tokens, ns.temperature, ns.system)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmarks parse their own flags
        from radixserve.bench_cli import main as bench_main

        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="radixserve", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print a completion for one prompt")
    gen.add_argument("prompt", help="the prompt (the chat template is applied for instruct models)")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_server_args(gen)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    add_server_args(serve)
    chat = sub.add_parser("chat", help="interactive chat in the terminal")
    chat.add_argument("--base-url", default=None,
                      help="chat with a running server (e.g. http://127.0.0.1:30000); default: a local engine")
    chat.add_argument("--system", default=None, help="system prompt")
    chat.add_argument("--max-new-tokens", type=int, default=512)
    chat.add_argument("--temperature", type=float, default=0.7)
    add_server_args(chat)
    sub.add_parser("bench", help="benchmarks: radixserve bench {serving,compare} --help")
    ns = parser.parse_args(argv)
    try:
        if ns.command == "generate":
            return cmd_generate(ns)
        if ns.command == "serve":
            return cmd_serve(ns)
        if ns.command == "chat":
            return cmd_chat(ns)
    except ValueError as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
