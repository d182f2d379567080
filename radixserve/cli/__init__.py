"""Command line: ``radixserve generate``, ``radixserve serve``, ``radixserve chat``."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import logging
import os
import sys
from typing import Any

from radixserve.config import ServerArgs, env_default

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
        help_text = f.metadata["help"]
        if default is not None and f.type not in ("bool", bool):
            help_text += f" (default: {default})"
        if f.type in ("bool", bool):
            if isinstance(default, str):
                default = default.lower() in ("1", "true", "yes")
            group.add_argument(flag, action="store_true", default=default, help=help_text)
            continue
        if "tuple" in str(f.type):  # NAME=PATH ... lists
            if isinstance(default, str):  # from the environment: space-separated
                default = default.split()
            group.add_argument(flag, nargs="*", default=tuple(default), help=help_text)
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
    return {
        f.name: getattr(ns, f.name) for f in dataclasses.fields(ServerArgs) if hasattr(ns, f.name)
    }


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
    parser = argparse.ArgumentParser(prog="radixserve", description=_DESCRIPTION,
                                     formatter_class=fmt)
    sub = parser.add_subparsers(dest="command", required=True,
                                metavar="{generate,serve,chat,cache,build-kernels,bench}")
    gen = sub.add_parser("generate", help="print a completion for one prompt",
                         description="Print a completion for one prompt, as it is generated.")
    gen.add_argument("prompt", help="the prompt (the chat template is applied for instruct models)")
    gen.add_argument("--max-new-tokens", type=int, default=128,
                     help="most tokens to generate (default: 128)")
    gen.add_argument("--temperature", type=float, default=0.0,
                     help="sampling temperature; 0 is greedy (default: 0.0)")
    gen.add_argument("--raw", action="store_true", help="do not apply the chat template")
    add_server_args(gen, exclude=SERVER_ONLY, defaults=_QUIET)
    serve = sub.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Run the OpenAI-compatible HTTP server (and SGLang's native routes).")
    add_server_args(serve)
    chat = sub.add_parser(
        "chat", help="interactive chat in the terminal",
        description="Chat in the terminal, with a running server (--base-url) or a local engine.")
    chat.add_argument("--base-url", default=None,
                      help="chat with a running server, e.g. http://127.0.0.1:30000 "
                           "(default: a local engine)")
    chat.add_argument("--system", default=None, help="system prompt (default: none)")
    chat.add_argument("--max-new-tokens", type=int, default=512,
                      help="most tokens per reply (default: 512)")
    chat.add_argument("--temperature", type=float, default=0.7,
                      help="sampling temperature; 0 is greedy (default: 0.7)")
    chat.add_argument("--api-key", default=None,
                      help="the server's API key, with --base-url (default: none)")
    add_server_args(chat, exclude=SERVER_ONLY, defaults=_QUIET)
    cache = sub.add_parser(
        "cache", help="a running server's cached prefixes and recent near-misses",
        description="Print a running server's heaviest cached prefixes (GET /cache/tree) "
                    "and its recent near-misses (GET /cache/misses).")
    cache.add_argument("--url", default="http://127.0.0.1:30000",
                       help="the server (default: http://127.0.0.1:30000)")
    cache.add_argument("--sort", choices=("weight", "tokens"), default="weight",
                       help="weight: tokens x hits of each prefix; tokens: tokens held below it "
                            "(default: weight)")
    cache.add_argument("--limit", type=int, default=10, help="prefixes to show (default: 10)")
    cache.add_argument("--api-key", default=None, help="the server's API key (default: none)")
    sub.add_parser(
        "build-kernels", help="compile the CPU kernels now (else the first CPU start does)",
        description="Compile the C++ CPU kernels for this machine into the cache folder "
                    "(else the first CPU start compiles them).")
    sub.add_parser("bench", help="benchmarks: radixserve bench {serving,compare} --help",
                   add_help=False)
    return parser


def cmd_cache(ns: argparse.Namespace) -> int:
    from radixserve.cli.cache_report import print_cache_report

    return print_cache_report(ns.url, ns.sort, ns.limit, ns.api_key)


def cmd_build_kernels(ns: argparse.Namespace) -> int:
    from radixserve import cpu_ext

    if cpu_ext.load() is None:  # why was logged by the build
        print(
            "radixserve: the CPU kernels could not be built; CPU runs use the torch path",
            file=sys.stderr,
        )
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
        # a closed pipe (`| head`) loses nothing more
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    os._exit(rc)
