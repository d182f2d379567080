"""HTTP API fuzzing: schemathesis cases from the server's own OpenAPI schema (``/openapi.json``).

Every documented route gets cases generated from its schema, schema-conforming and
schema-violating, and every top-level field of a JSON body gets cases of its own on an
otherwise valid request, also sent with a lone surrogate in its strings (see
``bench/api_fuzzer.py``).  Each case is sent to a real ``radixserve serve`` process and
checked: no 5xx, no hang (``--timeout``), no process death, an error body on every 4xx and
a complete event stream in the shape of the route's API (OpenAI's; Anthropic's on
``/v1/messages``; the Responses API's on ``/v1/responses``); after each route the server,
once idle, keeps its KV memory invariant with no lock left and still answers a chat request.

Cases are seeded (``--seed``): the same seed sends the same requests.  Without ``--base-url``
the benchmark serves the tiny random chat model the end-to-end tests use (the default
model's tokenizer and chat template) with a 256-token context, so any request, even one
asking for a huge ``max_tokens``, is bounded.  Prints a table per route and writes JSON.

    python bench/fuzz_api.py                          # 2000 cases, seed 0
    python bench/fuzz_api.py --cases 5000 --seed 7
    python bench/fuzz_api.py --base-url http://127.0.0.1:8000 --cases 300
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:  # run as a script from a source checkout
    sys.path.insert(0, str(REPO))

from bench.api_fuzzer import Target, fuzz, summary  # noqa: E402
from bench.common import align_columns, args_params, machine_info, write_report  # noqa: E402

# Share of the cases per route; the others (parameterless GETs, /flush_cache) get 2 each.
ROUTE_WEIGHTS = {
    "POST /v1/chat/completions": 4,
    "POST /v1/completions": 3,
    "POST /generate": 3,
    "POST /abort_request": 1,
    "POST /apply_chat_template": 1,
    "POST /cache/pin": 1,
    "POST /v1/messages": 3,
    "POST /v1/messages/count_tokens": 1,
    "POST /v1/responses": 3,
    "GET /v1/responses/{response_id}": 1,
    "DELETE /v1/responses/{response_id}": 1,
    "POST /v1/responses/{response_id}/cancel": 1,
}
SERVER_FLAGS = ("--max-total-tokens", "8192", "--context-length", "256")
# One torch thread: the tiny model gains nothing from more, and on a shared machine a second
# spinning thread makes every step many times slower (every request would look hung).
SERVER_ENV = {"OMP_NUM_THREADS": "1"}


def table(results: dict[str, Any]) -> str:
    rows = [["route", "cases", "units", "status codes", "failures", "sound", "s"]]
    for r in results["routes"]:
        codes = " ".join(f"{k}:{v}" for k, v in r["statuses"].items())
        sound = "ok" if not results["soundness"].get(r["route"]) else "FAIL"
        rows.append([r["route"], str(r["cases"]), str(len(r["units"])), codes, str(len(r["failures"])),
                     sound, f"{r['seconds']:.1f}"])
    s = summary(results)
    rows.append(["total", str(s["cases"]), "", "", str(s["failures"]),
                 "ok" if not s["soundness_failures"] else "FAIL", f"{s['seconds']:.1f}"])
    return align_columns(rows, left={0, 3})


@contextlib.contextmanager
def own_server(model: str | None) -> Iterator[str]:
    """A ``radixserve serve`` process: ``model``, or the tiny random chat model (with the
    default model's tokenizer) that the end-to-end tests serve, built in a temporary folder."""
    sys.path.insert(0, str(REPO / "tests"))
    from helpers.server import ServerProcess, build_chat_tiny_model

    with tempfile.TemporaryDirectory(prefix="radixserve-fuzz-") as folder:
        if model is None:
            from radixserve.model.default_model import default_model_path

            model = build_chat_tiny_model(default_model_path(), folder)
        srv = ServerProcess("--model", model, "--served-model-name", "tiny", *SERVER_FLAGS,
                            env=SERVER_ENV).wait_ready()
        try:
            yield srv.base_url
        finally:
            code = srv.stop()
        if code != 0:
            raise RuntimeError(f"the server exited with code {code}:\n{srv.log()[-3000:]}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", type=int, default=2000, help="total cases over all routes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--base-url", default=None, help="fuzz this server instead of starting one")
    p.add_argument("--model", default=None, help="model folder for the server started here "
                                                 "(default: a tiny random chat model)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a request may take")
    p.add_argument("--routes", default=None, help="comma-separated routes, e.g. 'POST /generate'")
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "fuzz_api.json")
    p.add_argument("--no-progress", action="store_true")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from tqdm import tqdm

    args = parse_args(argv)
    with contextlib.ExitStack() as stack:
        base_url = args.base_url or stack.enter_context(own_server(args.model))
        bar = stack.enter_context(tqdm(unit="case", disable=args.no_progress, file=sys.stderr))

        def on_case(route: str, unit: str) -> None:
            bar.set_postfix_str(f"{route} {unit}", refresh=False)
            bar.update()

        results = fuzz(Target(base_url, timeout=args.timeout), ROUTE_WEIGHTS, args.cases, args.seed,
                       routes=args.routes.split(",") if args.routes else None, on_case=on_case,
                       on_budgets=lambda n: setattr(bar, "total", n))
    print(table(results))
    for route, problems in results["soundness"].items():
        for p in problems:
            print(f"UNSOUND after {route}: {p}")
    for r in results["routes"]:
        for f in r["failures"][:5]:
            print(f"FAIL {r['route']} [{f['unit']}] -> {f['status']}: {'; '.join(f['problems'])}\n"
                  f"     body: {f['body'][:300]}")
    report = {"benchmark": "fuzz_api", "params": args_params(args), "machine": machine_info(),
              "server": None if args.base_url else {"flags": list(SERVER_FLAGS), "env": SERVER_ENV},
              "summary": summary(results), **results}
    write_report(report, args.out)
    return report


if __name__ == "__main__":
    main()
