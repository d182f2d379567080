"""Error bodies, and the handlers that turn every failure into one.

Every path answers errors in OpenAI's shape except Anthropic's two Messages routes
(exactly ``/v1/messages`` and ``/v1/messages/count_tokens``), whose clients read Anthropic's:
``{"type": "error", "error": {"type", "message"}}``.  The shape follows the request's path
(:func:`error_payload`), so validation errors, size limits and the API key check answer each
client in the shape it parses.

The Responses and Messages routes run as chat requests; :func:`renamed` turns an error about
the converted chat request into one about the field the client sent.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.runtime.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 503: "service_unavailable"}
# Anthropic's error types by status (its API's documented list); others are api_error.
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error",
                    403: "permission_error", 404: "not_found_error", 405: "invalid_request_error",
                    409: "invalid_request_error", 413: "request_too_large",
                    422: "invalid_request_error", 429: "rate_limit_error",
                    431: "invalid_request_error", 503: "overloaded_error"}
ANTHROPIC_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})


class APIError(Exception):
    """Raised by route code: becomes ``status`` with an OpenAI-style body."""

    def __init__(self, message: str, status: int = 400, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.param = param
        self.code = code
        self.headers = headers


class ClientGone(Exception):
    """The HTTP client disconnected; its request was aborted.  Nobody reads the answer."""


def error_body(
    message: str, status: int, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "object": "error",
        "error": {
            "message": message,
            "type": _TYPES.get(
                status, "server_error" if status >= 500 else "invalid_request_error"
            ),
            "param": param,
            "code": code or status,
        },
    }


def anthropic_error_body(message: str, status: int) -> dict:
    """Anthropic's error shape (what the ``anthropic`` client parses)."""
    kind = _ANTHROPIC_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def error_payload(path: str, message: str, status: int, param: str | None = None,
                  code: str | None = None) -> dict:
    """The error body in the shape of the API that ``path`` belongs to."""
    if path in ANTHROPIC_PATHS:
        return anthropic_error_body(message, status)
    return error_body(message, status, param, code)


def error_response(err: APIError, path: str = "") -> JSONResponse:
    return JSONResponse(error_payload(path, err.message, err.status, err.param, err.code),
                        err.status, headers=err.headers)


# A field path as error messages write it: ``max_tokens``, ``tools[0].function.parameters``.
_FIELD_PATH = re.compile(r"[a-z_]+(?:\[\d+\]|\.[a-z_]+)*")
# Where a bare name in a message is a field and not a word: the message's start, in quotes,
# in parentheses, or right after "'field': " (describe_validation's "invalid value for 'x': x
# must ...").
_NAMED_AFTER = ("'", "(", "': ")


def renamed(err: APIError, rename: Callable[[str], str | None],
            renames: Sequence[tuple[re.Pattern[str], str]] = (),
            phrases: dict[str, str] | None = None) -> APIError:
    """``err`` about a converted request, about the request the client sent: a field path of
    the converted request becomes the client's by ``rename``, or else by the first pattern of
    ``renames`` that matches (neither: the same name); the param and the field names in the
    message (paths anywhere, bare names where they stand as a field) follow, and ``phrases``
    (a converted value as the message writes it) are replaced."""

    def client(path: str) -> str | None:
        new = rename(path)
        if new is not None:
            return new
        for pattern, replacement in renames:
            new, n = pattern.subn(replacement, path)
            if n:
                return new
        return None

    def field(m: re.Match[str]) -> str:
        path, start = m.group(), m.start()
        named = ("[" in path or "." in path or start == 0
                 or any(err.message[:start].endswith(s) for s in _NAMED_AFTER))
        if not named or (start and (err.message[start - 1].isalnum()
                                    or err.message[start - 1] in "._[")):
            return path
        return client(path) or path

    param = (client(err.param) or err.param) if err.param else None
    message = _FIELD_PATH.sub(field, err.message)
    for converted, sent in (phrases or {}).items():
        message = message.replace(converted, sent)
    return APIError(message, err.status, param, err.code, err.headers)


def from_request_error(e: RequestError) -> APIError:
    headers = {"Retry-After": "1"} if e.status == 503 else None
    return APIError(str(e), e.status, param=e.param, headers=headers)


# Location parts pydantic adds for union branches ("str", "list[int]", "ContentPart"): they
# are not fields, so a param never shows them.
_BRANCH = re.compile(r"^[A-Z]|\[|^(str|int|float|bool|dict|list|none)$")


def _param(loc: tuple, below: str = "") -> str | None:
    """``("body", "messages", 0, "content")`` -> ``messages[0].content``; ``below`` (a
    validator's ``ctx.param``, e.g. ``"[1]"`` or ``"audio"``) is appended."""
    out = ""
    for part in loc[1:] if loc[:1] == ("body",) else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _BRANCH.search(str(part)):
            out += f".{part}" if out else str(part)
    if below:
        out += below if below.startswith("[") or not out else f".{below}"
    return out or None


def describe_validation(errors: Sequence[Any]) -> tuple[str, str | None]:
    """A validation error's message and the field it names, from pydantic's error list."""
    if not errors:
        return "invalid request body", None
    # Smart unions report one error per branch; the deepest is the branch the client meant.
    first = max(errors, key=lambda e: len(e.get("loc", ())))
    ctx = first.get("ctx") or {}
    param = _param(tuple(first.get("loc", ())), str(ctx.get("param", "")))
    if first.get("type") == "json_invalid":
        return f"the request body is not valid JSON: {first.get('msg')}", None
    if first.get("type") == "missing":
        return (
            f"missing required field '{param}'" if param else "the request body is missing"
        ), param
    if first.get("type") == "extra_forbidden":
        return f"unknown field '{param}'", param
    msg = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    if "param" in ctx:  # raised by protocol_base.reject: the message names the field already
        return msg, param
    # A value that fits no branch of a union: say what each branch wanted.
    depth = len(first.get("loc", ()))
    alike = [str(e.get("msg")) for e in errors
             if len(e.get("loc", ())) == depth and _param(tuple(e.get("loc", ()))) == param]
    msg = "; or ".join(dict.fromkeys([msg, *(m.removeprefix("Value error, ") for m in alike)]))
    return (f"invalid value for '{param}': {msg}" if param else msg), param


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    return describe_validation(exc.errors())


def install_error_handlers(app: FastAPI) -> None:
    def answer(request: Request, message: str, status: int, param: str | None = None
               ) -> JSONResponse:
        return JSONResponse(error_payload(request.url.path, message, status, param), status)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc, request.url.path)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(from_request_error(exc), request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = describe_validation(exc.errors())
        return answer(request, message, 400, param)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return answer(request, str(exc), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return answer(request, str(exc.detail), exc.status_code)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> JSONResponse:
        # 499 (nginx's "client closed request"): logged as what it is, not as a server error.
        logger.info("%s: the client disconnected; its request was aborted", request.url.path)
        return answer(request, "the client closed the request", 499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return answer(request, f"internal error: {exc!r}", 500)
