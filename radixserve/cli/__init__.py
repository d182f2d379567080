"""Command line: ``radixserve generate``, ``radixserve serve``, ``radixserve chat``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from typing import Any

from radixserve.config import DEFAULT_MAX_RUNNING_REQUESTS, ServerArgs, env_default

# Help per setting.  Settings whose default is computed (None / "auto" in ServerArgs) say
# what it is here; the others get "(default: X)" appended.
_HELP = {
    "model": "local HF folder (config.json + safetensors) or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer folder (default: the model's)",
    "dtype": "weights and KV dtype: auto (bfloat16 on GPU and on CPUs with AMX or AVX-512 BF16, else float32), "
             "float32, bfloat16, float16",
    "device": "auto (cuda when available, else cpu), cpu or cuda",
    "attention_backend": "auto (triton on GPU, torch on CPU), torch or triton",
    "page_size": "tokens per KV page (default: 1 on CPU, 16 on GPU)",
    "max_total_tokens": "KV pool size in tokens (default: sized from free memory, see --kv-cache-memory-fraction)",
    "max_running_requests": f"most requests running at once (default: {DEFAULT_MAX_RUNNING_REQUESTS})",
    "max_prefill_tokens": "token budget of one prefill batch",
    "chunked_prefill_size": "longest prefill chunk; -1 off (default: 1024 on CPU, 8192 on GPU)",
    "schedule_policy": "waiting-queue order: lpm (longest cached prefix first), dfs-weight (finish one tree branch "
                       "while cached), fcfs, lof (longest output first), random, priority (the request's priority)",
    "schedule_policy_max_queue": "lpm and dfs-weight act as fcfs above this many waiting requests",
    "schedule_mode": "mixed (default): each step runs the running requests' decodes together with the next "
                     "prefill chunk; prefill-first: a step with prompt work runs it alone and the decodes wait "
                     "(lower TTFT under arrivals, longer gaps between a stream's tokens)",
    "schedule_low_priority_values_first": "priority policy: smaller priority values go first (vLLM's order; "
                                          "default: larger first, as SGLang)",
    "priority_preemption": "priority policy: retract running requests of lower priority when a waiting one "
                           "cannot be admitted",
    "kv_cache_dtype": "element type of the KV cache: auto (the model's dtype), int8 (symmetric, a float16 scale "
                      "per token and head: 1.94x the tokens of bfloat16 in the same memory, 3.88x float32's), "
                      "fp8_e4m3 or fp8_e5m2 (unit scale, saturated: 2x / 4x)",
    "max_pinned_fraction": "share of the KV pool that pinned prefixes (POST /cache/pin) may hold",
    "preemption_mode": "a request retracted when the KV pool is full: recompute its KV later, or swap it to the "
                       "host tier and back",
    "host_cache_size": "host KV tier in tokens: pages evicted from the pool wait there (default: none; with "
                       "--preemption-mode swap: twice the pool)",
    "disk_cache_dir": "disk KV tier folder: cached prefixes are written there and found again after a restart "
                      "(default: none)",
    "disk_cache_size": "disk KV tier size in tokens",
    "radix_eviction_policy": "prefix-cache eviction: lru, lfu, or slru (a prefix hit twice outlives one-off prompts)",
    "disable_radix_cache": "turn the prefix cache off",
    "tp_size": "tensor parallelism: split the model over N processes (gloo on a CPU, NCCL over N GPUs)",
    "cuda_graph_max_bs": "largest decode batch replayed from a captured CUDA graph (default 256 on CUDA; 0: none)",
    "disable_cuda_graph": "run every decode step eagerly on CUDA (no graph capture)",
    "quantization": "weight-only matmuls on a CPU: none; int8 (a scale and an offset per 32 weights, "
                    "~3x less weight memory than float32); int4 (blocks of 32, d*q+m, ~6x less); gguf (a .gguf model's "
                    "Q4_0/Q4_1/Q8_0 tensors as stored: the weights float32 computes with); auto (gguf "
                    "where the model has such tensors, else none)",
    "speculative_algorithm": "speculative decoding: ngram (drafts from the radix tree and the request's own "
                             "prompt and output, verified in one extend; output unchanged), or unset (off)",
    "speculative_num_draft_tokens": "tokens per speculative verify: the next token and N-1 drafts (default: 8)",
    "speculative_ngram_min_match_window_size": "ngram: shortest suffix of the request matched against its text",
    "speculative_ngram_max_match_window_size": "ngram: longest suffix matched (the longest match wins)",
    "speculative_disable_by_batch_size": "no drafts in a step with more running requests than this "
                                         "(default: 4 on CPU, 64 on GPU)",
    "load_format": "auto (the model's weights) or dummy (random weights from its config.json, for benchmarks)",
    "context_length": "longest sequence (default: the model's max_position_embeddings)",
    "random_seed": "seed of the seeds drawn for requests that give none",
    "stream_interval": "send streamed tokens every N steps",
    "kv_cache_memory_fraction": "share of free memory for the KV pool when --max-total-tokens is unset",
    "log_level": "debug, info, warning, error",
    "startup_timeout": "seconds to wait for the model to load",
    "host": "HTTP server address",
    "port": "HTTP server port",
    "served_model_name": "model name reported by /v1/models and accepted in requests (default: the model folder's name)",
    "max_queued_requests": "waiting requests beyond which new ones get HTTP 503 (default: unlimited)",
    "api_key": "require 'Authorization: Bearer <key>' on HTTP requests (default: none)",
    "grammar_backend": "constrained decoding backend: xgrammar, or none (json_schema/regex/ebnf refused)",
    "disable_jump_forward": "decode grammar-forced text token by token instead of appending it at once",
    "tool_call_parser": "tool-call format: auto (from the chat template), hermes, qwen25, qwen3, llama3, mistral, prompted",
    "reasoning_parser": "split <think> output into reasoning_content: qwen3 or deepseek-r1 (default: off)",
    "max_request_body_bytes": "HTTP request bodies larger than this get 413",
    "cors_allow_origins": "comma-separated origins allowed by CORS, '*' for any (default: CORS off)",
    "slow_reader_timeout": "seconds a stream's reader may stay behind before the request is cut off",
}

# Settings of the HTTP server only: not offered by `generate` and a local `chat`.
SERVER_ONLY = ("host", "port", "api_key", "max_queued_requests", "served_model_name",
               "max_request_body_bytes", "cors_allow_origins", "slow_reader_timeout")


def add_server_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = (),
                    defaults: dict[str, Any] | None = None) -> None:
    """One flag per ServerArgs field (but ``exclude``); defaults come from ServerArgs, then
    ``defaults`` (this command's own), then RADIXSERVE_<NAME>."""
    group = parser.add_argument_group("settings (also RADIXSERVE_<NAME> environment variables)")
    for f in dataclasses.fields(ServerArgs):
        if f.name in exclude:
            continue
        flag = "--" + f.name.replace("_", "-")
        default = env_default(f.name, (defaults or {}).get(f.name, f.default))
        help_text = _HELP.get(f.name, "")
        if default is not None and f.type not in ("bool", bool):
            help_text += f" (default: {default})"
        if f.type in ("bool", bool):
            if isinstance(default, str):
                default = default.lower() in ("1", "true", "yes")
            group.add_argument(flag, action="store_true", default=default, help=help_text)
            continue
        conv: Any = str
        if "int" in str(f.type):
            conv = int
        elif "float" in str(f.type):
            conv = float
        if default is not None and isinstance(default, str) and conv is not str:
            default = conv(default)
        group.add_argument(flag, type=conv, default=default, help=help_text)


def args_from_namespace(ns: argparse.Namespace) -> dict[str, Any]:
    return {f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs) if hasattr(ns, f.name)}


def _sampling(ns: argparse.Namespace) -> dict[str, Any]:
    """The command's sampling flags, checked before anything loads (ValueError if bad)."""
    from radixserve.sampling import SamplingParams

    params = {"max_new_tokens": ns.max_new_tokens, "temperature": ns.temperature}
    SamplingParams.from_dict(params)
    return params


def cmd_generate(ns: argparse.Namespace) -> int:
    if not ns.prompt:
        raise ValueError("the prompt is empty")
    params = _sampling(ns)
    settings = args_from_namespace(ns)
    ServerArgs.from_kwargs(**settings)  # bad settings fail here, before the model loads
    from radixserve.engine import Engine

    model = settings.pop("model")
    with Engine(model, **settings) as engine:
        tok = engine.tokenizer
        prompt = ns.prompt
        if not ns.raw and getattr(tok, "chat_template", None):
            prompt = tok.apply_chat_template(
                [{"role": "user", "content": ns.prompt}], tokenize=False, add_generation_prompt=True
            )
        for piece in engine.generate(prompt, params, stream=True):
            sys.stdout.write(piece["text"])
            sys.stdout.flush()
        sys.stdout.write("\n")
    return 0


def cmd_serve(ns: argparse.Namespace) -> int:
    from radixserve.frontend.server import run_server

    return run_server(ServerArgs.from_kwargs(**args_from_namespace(ns)))


def cmd_chat(ns: argparse.Namespace) -> int:
    from radixserve.cli.chat import chat_local, chat_remote

    _sampling(ns)
    if ns.base_url:
        return chat_remote(ns.base_url, ns.max_new_tokens, ns.temperature, ns.system, ns.api_key)
    settings = args_from_namespace(ns)
    settings.pop("api_key", None)  # a local engine has no HTTP side
    ServerArgs.from_kwargs(**settings)
    return chat_local(settings, ns.max_new_tokens, ns.temperature, ns.system)


_DESCRIPTION = """\
radixserve: an LLM serving runtime built around a radix-tree prefix cache.

  radixserve generate "What is the capital of France?"   one completion, streamed
  radixserve serve                                       OpenAI-compatible HTTP server
  radixserve chat                                        chat in the terminal
  radixserve build-kernels                               compile the CPU kernels ahead of time
  radixserve bench serving --help                        benchmarks

Without --model, the embedded default model (SmolLM2-135M-Instruct) is used."""

_QUIET = {"log_level": "warning"}  # commands that print to the terminal keep INFO logs off it


def _build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="radixserve", description=_DESCRIPTION, formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True, metavar="{generate,serve,chat,cache,build-kernels,bench}")
    gen = sub.add_parser("generate", help="print a completion for one prompt",
                         description="Print a completion for one prompt, as it is generated.")
    gen.add_argument("prompt", help="the prompt (the chat template is applied for instruct models)")
    gen.add_argument("--max-new-tokens", type=int, default=128, help="most tokens to generate (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 is greedy (default: 0.0)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_server_args(gen, exclude=SERVER_ONLY, defaults=_QUIET)
    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server",
                           description="Run the OpenAI-compatible HTTP server (and SGLang's native routes).")
    add_server_args(serve)
    chat = sub.add_parser("chat", help="interactive chat in the terminal",
                          description="Chat in the terminal, with a running server (--base-url) or a local engine.")
    chat.add_argument("--base-url", default=None,
                      help="chat with a running server, e.g. http://127.0.0.1:30000 (default: a local engine)")
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    chat.add_argument("--max-new-tokens", type=int, default=512, help="most tokens per reply (default: 512)")
    chat.add_argument("--temperature", type=float, default=0.7, help="sampling temperature; 0 is greedy (default: 0.7)")
    chat.add_argument("--api-key", default=None, help="the server's API key, with --base-url (default: none)")
    add_server_args(chat, exclude=SERVER_ONLY, defaults=_QUIET)
    cache = sub.add_parser("cache", help="a running server's cached prefixes and recent near-misses",
                           description="Print a running server's heaviest cached prefixes (GET /cache/tree) "
                                       "and its recent near-misses (GET /cache/misses).")
    cache.add_argument("--url", default="http://127.0.0.1:30000", help="the server (default: http://127.0.0.1:30000)")
    cache.add_argument("--sort", choices=("weight", "tokens"), default="weight",
                       help="weight: tokens x hits of each prefix; tokens: tokens held below it (default: weight)")
    cache.add_argument("--limit", type=int, default=10, help="prefixes to show (default: 10)")
    cache.add_argument("--api-key", default=None, help="the server's API key (default: none)")
    sub.add_parser("build-kernels", help="compile the CPU kernels now (else the first CPU start does)",
                   description="Compile the C++ CPU kernels for this machine into the cache folder "
                               "(else the first CPU start compiles them).")
    sub.add_parser("bench", help="benchmarks: radixserve bench {serving,compare} --help", add_help=False)
    return parser


def cmd_cache(ns: argparse.Namespace) -> int:
    from radixserve.cli.cache_report import print_cache_report

    return print_cache_report(ns.url, ns.sort, ns.limit, ns.api_key)


def cmd_build_kernels(ns: argparse.Namespace) -> int:
    from radixserve import cpu_ext

    if cpu_ext.load() is None:  # why was logged by the build
        print("radixserve: the CPU kernels could not be built; CPU runs use the torch path", file=sys.stderr)
        return 1
    print(f"CPU kernels ready in {cpu_ext.build_dir()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["bench"]:  # the benchmarks parse their own flags
        from radixserve.cli.bench import main as bench_main

        return bench_main(argv[1:])
    ns = _build_parser().parse_args(argv)
    commands = {"generate": cmd_generate, "serve": cmd_serve, "chat": cmd_chat, "cache": cmd_cache,
                "build-kernels": cmd_build_kernels}
    try:
        return commands[ns.command](ns)
    except (ValueError, FileNotFoundError) as e:  # the user's input: one line, exit 2
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # start-up failed; the process that failed logged the details
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    """The ``radixserve`` command: :func:`main`, then an exit that skips the interpreter's
    teardown once the output is flushed.  Every process it started has stopped by then; what
    remains is unloading torch and transformers: about a second on a 2-core CPU."""
    rc = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # a closed pipe (`| head`) loses nothing more
            stream.flush()
    os._exit(rc)
