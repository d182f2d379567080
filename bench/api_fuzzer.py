"""Schemathesis cases from a server's own OpenAPI schema, sent and checked one by one.

Used by ``bench/fuzz_api.py`` (the long run) and ``tests/http/test_fuzz_api.py`` (a bounded run).

A route is fuzzed in units, each a Hypothesis run of schemathesis cases, half of them
schema-conforming ("positive"), half schema-violating ("negative": wrong types, missing
fields, bodies that are not JSON):

- ``schema``: the route's request schema as served;
- ``field:<name>`` (routes with a JSON body): a small valid request (``BASES``) with that one
  documented top-level field generated from its own schema, so every field's values reach
  the code behind validation (most whole-schema bodies are refused for some other field);
  each positive case holding a string is sent again with a lone UTF-16 surrogate in it
  (``field:<name>+surrogate``), which JSON can spell but schemathesis never generates.

Each case is checked (``response_problems``): no 5xx and no transport error, an answer within
the timeout (no hang), a JSON 2xx that parses, and, in the shape of the API the route belongs
to (``api_shape``), an error body on every 4xx and a complete event stream that ends as that
API ends its streams (OpenAI's: ``data: [DONE]``; Anthropic's Messages: ``message_stop``;
OpenAI's Responses: a terminal ``response.*`` event); and after it the server's processes
(the pids ``/server_info`` gives) are alive.  ``Target.soundness_problems`` checks the server
once idle: the KV memory invariant holds with no lock left and a plain chat request works.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import time
import zlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

# A small valid request per JSON-body route (``MODEL`` becomes the served model's name); its
# two generated tokens keep the cases that pass validation cheap.
MODEL = "<served model>"
BASES: dict[str, dict[str, Any]] = {
    "POST /v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                                  "max_tokens": 2},
    "POST /v1/completions": {"model": MODEL, "prompt": "Hi", "max_tokens": 2},
    "POST /generate": {"text": "Hi", "sampling_params": {"max_new_tokens": 2}},
    "POST /abort_request": {"rid": "fuzz"},
    "POST /apply_chat_template": {"messages": [{"role": "user", "content": "Hi"}]},
    "POST /cache/pin": {"text": "Hi", "ttl": 1},  # pins that expire: the fuzzing leaves none
    "POST /v1/messages": {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
                          "max_tokens": 2},
    "POST /v1/messages/count_tokens": {"model": MODEL,
                                       "messages": [{"role": "user", "content": "Hi"}]},
    # Not stored unless a case asks: a stored response pins its conversation for minutes.
    "POST /v1/responses": {"model": MODEL, "input": "Hi", "max_output_tokens": 2, "store": False},
}
# Fields that replace others of the base request: (route, field) -> base fields dropped.
REPLACES = {("POST /generate", "input_ids"): ("text",)}
FAILURE_BODY_CHARS = 2000


# ---------------------------------------------------------------- checks on one answer


def error_body_problems(content: bytes) -> list[str]:
    """Why ``content`` is not an OpenAI error body (empty when it is one)."""
    try:
        body = json.loads(content)
    except ValueError:
        return [f"4xx body is not JSON: {content[:200]!r}"]
    err = body.get("error") if isinstance(body, dict) else None
    if not isinstance(err, dict):
        return [f"4xx body has no 'error' object: {content[:200]!r}"]
    problems = []
    if not isinstance(err.get("message"), str) or not err["message"]:
        problems.append("4xx error.message is not a non-empty string")
    if not isinstance(err.get("type"), str):
        problems.append("4xx error.type is not a string")
    problems += [f"4xx error has no '{key}'" for key in ("param", "code") if key not in err]
    return problems


# The error types of Anthropic's API (its documented list), what its clients map to exceptions.
ANTHROPIC_ERROR_TYPES = frozenset({
    "invalid_request_error", "authentication_error", "billing_error", "permission_error",
    "not_found_error", "request_too_large", "rate_limit_error", "timeout_error", "api_error",
    "overloaded_error"})


def anthropic_error_problems(content: bytes) -> list[str]:
    """Why ``content`` is not an Anthropic error body, ``{"type": "error", "error": {"type",
    "message"}}`` (empty when it is one)."""
    try:
        body = json.loads(content)
    except ValueError:
        return [f"error body is not JSON: {content[:200]!r}"]
    if not isinstance(body, dict) or body.get("type") != "error":
        return [f"error body's type is not 'error' (Anthropic's shape): {content[:200]!r}"]
    err = body.get("error")
    if not isinstance(err, dict):
        return [f"error body has no 'error' object: {content[:200]!r}"]
    problems = []
    if err.get("type") not in ANTHROPIC_ERROR_TYPES:
        problems.append(f"error.type {err.get('type')!r} is none of Anthropic's error types")
    if not isinstance(err.get("message"), str) or not err["message"]:
        problems.append("error.message is not a non-empty string")
    return problems


def sse_events(content: bytes) -> list[tuple[str | None, bytes]]:
    """An event stream's events as ``(event name or None, data)``."""
    events = []
    for block in content.replace(b"\r\n", b"\n").split(b"\n\n"):
        name, data = None, []
        for line in block.split(b"\n"):
            if line.startswith(b"event:"):
                name = line[6:].strip().decode("utf-8", "replace")
            elif line.startswith(b"data:"):
                data.append(line[5:].strip())
        if name is not None or data:
            events.append((name, b"\n".join(data)))
    return events


def _typed_events(content: bytes) -> tuple[list[tuple[str, dict[str, Any]]], list[str]]:
    """The events of a stream whose events each name their type twice (``event:`` and the
    data's ``type``, as Anthropic's and the Responses API's do), and what is wrong with them."""
    out, problems = [], []
    for name, data in sse_events(content):
        try:
            body = json.loads(data)
        except ValueError:
            problems.append(f"event {name!r} data is not JSON: {data[:200]!r}")
            continue
        kind = body.get("type") if isinstance(body, dict) else None
        if name is None or kind != name:
            problems.append(f"event name {name!r} and data type {kind!r} differ")
            continue
        out.append((name, body))
    if not out and not problems:
        problems.append("event stream has no event")
    return out, problems


def openai_stream_problems(content: bytes) -> list[str]:
    if not content.rstrip().endswith(b"data: [DONE]"):
        return [f"event stream does not end with [DONE]: ...{content[-200:]!r}"]
    return []


def anthropic_stream_problems(content: bytes) -> list[str]:
    """An Anthropic stream ends with ``message_stop``, or with an ``error`` event in its
    error shape (a failure after the stream started)."""
    events, problems = _typed_events(content)
    if problems:
        return problems
    name, body = events[-1]
    if name == "error":
        return anthropic_error_problems(json.dumps(body).encode())
    if name != "message_stop":
        return [f"event stream ends with {name!r}, not message_stop: ...{content[-200:]!r}"]
    return []


RESPONSES_TERMINAL = frozenset({"response.completed", "response.incomplete", "response.failed"})


def responses_stream_problems(content: bytes) -> list[str]:
    """A Responses stream ends with the finished response's terminal event."""
    events, problems = _typed_events(content)
    if problems:
        return problems
    name, body = events[-1]
    if name not in RESPONSES_TERMINAL:
        return [f"event stream ends with {name!r}, none of {sorted(RESPONSES_TERMINAL)}: "
                f"...{content[-200:]!r}"]
    if not isinstance(body.get("response"), dict) or "status" not in body["response"]:
        return [f"{name} carries no response with a status: ...{content[-200:]!r}"]
    return []


@dataclass(frozen=True)
class ApiShape:
    """How one API's routes answer an error and end an event stream."""

    name: str
    error_problems: Callable[[bytes], list[str]]
    stream_problems: Callable[[bytes], list[str]]


OPENAI = ApiShape("OpenAI", error_body_problems, openai_stream_problems)
ANTHROPIC = ApiShape("Anthropic Messages", anthropic_error_problems, anthropic_stream_problems)
RESPONSES = ApiShape("OpenAI Responses", error_body_problems, responses_stream_problems)
# Path prefixes of the routes that are not OpenAI's chat and completions shape.
# Anthropic's shape on exactly its two routes (as the server chooses it); the Responses API's on
# /v1/responses and the routes of one response below it.
ANTHROPIC_ROUTES = ("/v1/messages", "/v1/messages/count_tokens")
RESPONSES_PREFIX = "/v1/responses"


def api_shape(path: str) -> ApiShape:
    """The API whose shape the answers on ``path`` take."""
    if path in ANTHROPIC_ROUTES:
        return ANTHROPIC
    if path == RESPONSES_PREFIX or path.startswith(RESPONSES_PREFIX + "/"):
        return RESPONSES
    return OPENAI


def response_problems(status: int, content_type: str, content: bytes, cut_short: bool,
                      path: str = "") -> list[str]:
    """What is wrong with one answer on ``path``, judged on its own (``cut_short``: the client
    stopped reading an event stream early)."""
    api = api_shape(path)
    if status >= 500:
        return [f"server error {status}: {content[:300]!r}"]
    if 400 <= status < 500:
        return [f"{api.name} error shape: {p}" for p in api.error_problems(content)]
    if content_type.startswith("application/json"):
        try:
            json.loads(content)
        except ValueError:
            return [f"{status} JSON body does not parse: {content[:200]!r}"]
    if content_type.startswith("text/event-stream") and not cut_short:
        return api.stream_problems(content)
    return []


# ---------------------------------------------------------------- the server under test


class Target:
    """The server under test: its URL, served model and the pids that must stay alive."""

    def __init__(self, base_url: str, timeout: float = 30.0) -> None:
        import requests

        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.session = requests.Session()
        info = self.server_info()
        self.pids: dict[str, int] = info["pids"]
        self.model: str = info["model"]

    def server_info(self) -> dict[str, Any]:
        r = self.session.get(self.base_url + "/server_info", timeout=self.timeout)
        r.raise_for_status()
        return r.json()

    def dead_processes(self) -> list[str]:
        import psutil

        dead = []
        for name, pid in self.pids.items():
            try:
                if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                    dead.append(f"{name} process ({pid}) is a zombie")
            except psutil.NoSuchProcess:
                dead.append(f"{name} process ({pid}) is gone")
        return dead

    def soundness_problems(self, idle_timeout: float = 60.0) -> list[str]:
        """Once idle: the memory invariant holds with no lock left, and a chat request works."""
        problems = self.dead_processes()
        if problems:
            return problems
        try:
            deadline = time.monotonic() + idle_timeout
            info = self.server_info()
            while info["stats"]["running"] or info["stats"]["waiting"]:
                if time.monotonic() > deadline:
                    return [f"not idle after {idle_timeout} s: {info['stats']}"]
                time.sleep(0.2)
                info = self.server_info()
            memory = info["memory"]
            if not memory["ok"] or memory["locked_tokens"] or memory["request_pages"]:
                problems.append(f"memory invariant broken when idle: {memory}")
            chat = {**BASES["POST /v1/chat/completions"], "model": self.model}
            r = self.session.post(self.base_url + "/v1/chat/completions", json=chat, timeout=self.timeout)
            if r.status_code != 200 or not isinstance(r.json()["choices"][0]["message"]["content"], str):
                problems.append(f"a plain chat request got {r.status_code}: {r.text[:300]}")
        except Exception as e:  # the server no longer answers as it should: that is the finding
            problems.append(f"server unsound: {e!r}")
        return problems


class ServerDied(Exception):
    """A server process died: no later case can tell anything."""


# ---------------------------------------------------------------- units of cases


@dataclass
class Unit:
    route: str  # "POST /v1/chat/completions"
    name: str  # "schema" or "field:<name>"
    operation: Any  # schemathesis APIOperation


@dataclass
class RouteResult:
    route: str
    cases: int = 0
    statuses: Counter = field(default_factory=Counter)
    units: dict[str, Counter] = field(default_factory=dict)  # unit -> statuses
    failures: list[dict[str, Any]] = field(default_factory=list)
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        def codes(c: Counter) -> dict[str, int]:
            return {str(k): v for k, v in sorted(c.items(), key=lambda kv: str(kv[0]))}

        return {"route": self.route, "cases": self.cases, "seconds": round(self.seconds, 2),
                "statuses": codes(self.statuses), "failures": self.failures,
                "units": {name: codes(c) for name, c in self.units.items()}}


def load_schema(base_url: str) -> dict[str, Any]:
    import requests

    r = requests.get(base_url.rstrip("/") + "/openapi.json", timeout=30)
    r.raise_for_status()
    return r.json()


def _operations(raw: dict[str, Any]) -> list[Any]:
    import schemathesis

    schema = schemathesis.openapi.from_dict(raw, config=schemathesis.Config())
    return [op.ok() for op in schema.get_all_operations()]


def _json_body(raw: dict[str, Any], path: str, method: str) -> dict[str, Any] | None:
    """The route's request body schema (a component), or None when it takes no JSON body."""
    body = raw["paths"][path][method].get("requestBody", {})
    schema = body.get("content", {}).get("application/json", {}).get("schema")
    if schema is None:
        return None
    ref = schema.get("$ref", "")
    return raw["components"]["schemas"][ref.rsplit("/", 1)[-1]] if ref else schema


def field_schema(raw: dict[str, Any], route: str, name: str, model: str) -> dict[str, Any]:
    """An OpenAPI document whose only operation is ``route`` with a body of the base request's
    fields as constants, plus the documented field ``name`` (required)."""
    method, path = route.split(" ", 1)
    body = _json_body(raw, path, method.lower())
    base = {k: (model if v == MODEL else v) for k, v in BASES[route].items()
            if k != name and k not in REPLACES.get((route, name), ())}
    schema = {"type": "object", "additionalProperties": False, "required": [*base, name],
              "properties": {**{k: {"const": v} for k, v in base.items()}, name: body["properties"][name]}}
    op = copy.deepcopy(raw["paths"][path][method.lower()])
    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": schema}}}
    return {**raw, "paths": {path: {method.lower(): op}}}


def units(raw: dict[str, Any], model: str) -> list[Unit]:
    """Every route's ``schema`` unit, then (JSON-body routes) one unit per documented field."""
    out = [Unit(op.label, "schema", op) for op in _operations(raw)]
    for unit in list(out):
        if unit.route not in BASES:
            continue
        method, path = unit.route.split(" ", 1)
        for name in _json_body(raw, path, method.lower())["properties"]:
            [op] = _operations(field_schema(raw, unit.route, name, model))
            out.append(Unit(unit.route, f"field:{name}", op))
    return out


def unit_budgets(all_units: list[Unit], weights: dict[str, int], cases: int,
                 schema_share: float = 0.4) -> dict[tuple[str, str], int]:
    """``cases`` split over the routes by ``weights`` (a route without a weight has no input
    to vary: 2 cases), each weighted route's share split between its ``schema`` unit
    (``schema_share``) and its field units (at least 2 cases each: 1 positive, 1 negative)."""
    fixed = {u.route for u in all_units if u.route not in weights}
    rest = max(cases - 2 * len(fixed), 0)
    total = sum(weights.get(u.route, 0) for u in all_units if u.name == "schema") or 1
    budgets = {}
    for u in all_units:
        if u.route in fixed:
            budgets[(u.route, u.name)] = 2
            continue
        share = rest * weights[u.route] // total
        n_fields = sum(1 for v in all_units if v.route == u.route and v.name != "schema")
        whole = int(share * schema_share) if n_fields else share
        budgets[(u.route, u.name)] = max(2, whole if u.name == "schema" else (share - whole) // n_fields)
    return budgets


# ---------------------------------------------------------------- running cases


def _header(headers: Any, name: str) -> str:
    value = next((v for k, v in headers.items() if k.lower() == name), "")
    return value[0] if isinstance(value, list) else value  # schemathesis: lists of values


def _send_checked(target: Target, send: Callable[[], tuple[Any, bool, Any]], method: str, path: str,
                  body: Any, unit: Unit, result: RouteResult) -> None:
    """Send one request (``send`` returns the response, whether reading it stopped early, and
    the bytes sent), check the answer and the processes, record it in ``result``."""
    import requests

    t0 = time.monotonic()
    status: int | str
    try:
        response, cut_short, sent = send()
        status = response.status_code
        problems = response_problems(status, _header(response.headers, "content-type"), response.content, cut_short,
                                     path)
        if cut_short and time.monotonic() - t0 >= target.timeout:
            # schemathesis stops reading an event stream after some events, or at the timeout
            problems.append(f"event stream still open after {target.timeout} s (hang)")
        body = sent if sent is not None else body
    except requests.Timeout:
        status, problems = "timeout", [f"no answer within {target.timeout} s (hang)"]
    except requests.RequestException as e:
        status, problems = "transport", [f"transport error: {e!r}"]
    dead = target.dead_processes()
    result.cases += 1
    result.statuses[status] += 1
    result.units.setdefault(unit.name, Counter())[status] += 1
    if problems or dead:
        text = body.decode("utf-8", "replace") if isinstance(body, bytes) else json.dumps(body, default=repr)
        result.failures.append({
            "unit": unit.name, "method": method, "path": path, "body": text[:FAILURE_BODY_CHARS],
            "status": status, "problems": problems + dead, "seconds": round(time.monotonic() - t0, 3),
        })
    if dead:
        raise ServerDied("; ".join(dead))


def send_and_check(target: Target, case: Any, unit: Unit, result: RouteResult) -> None:
    """Send one schemathesis case and check it."""

    def send() -> tuple[Any, bool, Any]:
        r = case.call(base_url=target.base_url, session=target.session, timeout=target.timeout)
        return r, r.stream_cut_short, r.request.body

    kwargs = case.as_transport_kwargs(base_url=target.base_url)
    _send_checked(target, send, case.method.upper(), case.formatted_path,
                  kwargs.get("json", kwargs.get("data")), unit, result)


def with_lone_surrogate(value: Any) -> tuple[Any, bool]:
    """``value`` with its first string ended by a lone surrogate, and whether it had one.

    JSON can spell one (``"\\ud800"``), but schemathesis never generates it (it cannot be
    encoded as UTF-8), so the field units send each case that has a string again, so spelled.
    """
    if isinstance(value, str):
        return value + "\ud800", True
    items = list(value.items()) if isinstance(value, dict) else list(enumerate(value)) if isinstance(value, list) else []
    for key, x in items:
        new, done = with_lone_surrogate(x)
        if done:
            out = dict(value) if isinstance(value, dict) else list(value)
            out[key] = new
            return out, True
    return value, False


def send_surrogate_twin(target: Target, case: Any, unit: Unit, result: RouteResult) -> None:
    """The case again with a lone surrogate in the unit's field, if that field holds a string."""
    import requests

    name = unit.name.removeprefix("field:")
    if not isinstance(case.body, dict) or name not in case.body:
        return
    value, changed = with_lone_surrogate(case.body[name])
    if not changed:
        return
    body = json.dumps({**case.body, name: value}).encode()  # ensure_ascii: "\ud800" escapes

    def send() -> tuple[requests.Response, bool, bytes]:
        r = target.session.request(case.method.upper(), target.base_url + case.formatted_path, data=body,
                                   headers={"Content-Type": "application/json"}, timeout=target.timeout)
        return r, False, body

    _send_checked(target, send, case.method.upper(), case.formatted_path, body,
                  Unit(unit.route, unit.name + "+surrogate", unit.operation), result)


def run_unit(target: Target, unit: Unit, budget: int, seed: int, result: RouteResult,
             on_case: Callable[[], None] = lambda: None) -> None:
    """Up to ``budget`` cases of one unit: half positive, half negative (an operation without
    inputs has one positive case and no negative one); a field unit's positive cases are also
    sent with a lone surrogate in the field (``send_surrogate_twin``).  ``seed`` fixes the cases."""
    from schemathesis import GenerationMode

    def check(case: Any, twin: bool) -> None:
        send_and_check(target, case, unit, result)
        if twin:
            send_surrogate_twin(target, case, unit, result)
        on_case()

    for mode, n in ((GenerationMode.POSITIVE, budget - budget // 2), (GenerationMode.NEGATIVE, budget // 2)):
        twin = mode == GenerationMode.POSITIVE and unit.name.startswith("field:")
        if n:
            _run_cases(unit, mode, n, zlib.crc32(f"{seed}/{unit.route}/{unit.name}/{mode.value}".encode()),
                       functools.partial(check, twin=twin))


def _run_cases(unit: Unit, mode: Any, n: int, seed: int, each: Callable[[Any], None]) -> None:
    """Hypothesis draws up to ``n`` cases of ``unit`` in ``mode``, each handed to ``each``."""
    import hypothesis
    from hypothesis import HealthCheck, Phase, Verbosity, given, settings

    @hypothesis.seed(seed)
    @settings(max_examples=n, database=None, deadline=None, derandomize=False,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
              verbosity=Verbosity.quiet)
    @given(case=unit.operation.as_strategy(generation_mode=mode))
    def run(case: Any) -> None:
        each(case)

    # An operation without inputs has no schema-violating case to generate.
    with contextlib.suppress(hypothesis.errors.Unsatisfiable):
        run()


def fuzz(target: Target, weights: dict[str, int], cases: int, seed: int,
         routes: list[str] | None = None, on_case: Callable[[str, str], None] = lambda r, u: None,
         on_budgets: Callable[[int], None] = lambda n: None) -> dict[str, Any]:
    """Fuzz every route (or those in ``routes``) of ``target``; after each route (and at the
    end) check the server's soundness.  Returns the per-route results and soundness checks."""
    raw = load_schema(target.base_url)
    all_units = [u for u in units(raw, target.model) if routes is None or u.route in routes]
    budgets = unit_budgets(all_units, weights, cases)
    on_budgets(sum(budgets.values()))
    results: dict[str, RouteResult] = {}
    soundness: dict[str, list[str]] = {}
    t0 = time.monotonic()
    for route in dict.fromkeys(u.route for u in all_units):
        result = results[route] = RouteResult(route)
        start = time.monotonic()
        try:
            for unit in (u for u in all_units if u.route == route):
                run_unit(target, unit, budgets[(unit.route, unit.name)], seed, result,
                         lambda r=route, n=unit.name: on_case(r, n))
        except ServerDied as e:
            result.seconds = time.monotonic() - start
            soundness[route] = [f"server died: {e}"]
            break
        result.seconds = time.monotonic() - start
        soundness[route] = target.soundness_problems()
    return {"routes": [r.as_dict() for r in results.values()], "soundness": soundness,
            "budget": sum(budgets.values()), "seconds": round(time.monotonic() - t0, 1)}


def summary(results: dict[str, Any]) -> dict[str, Any]:
    routes = results["routes"]
    return {
        "cases": sum(r["cases"] for r in routes),
        "failures": sum(len(r["failures"]) for r in routes),
        "soundness_failures": sum(len(p) for p in results["soundness"].values()),
        "seconds": results["seconds"],
    }
