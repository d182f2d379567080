"""OpenAI-style error bodies, and the handlers that turn every failure into one."""

from __future__ import annotations

import logging
import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from radixserve.runtime.tokenizer_manager import RequestError

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          409: "conflict_error", 413: "invalid_request_error", 503: "service_unavailable"}


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


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.status, err.param, err.code), err.status,
                        headers=err.headers)


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


def _describe_validation(exc: RequestValidationError) -> tuple[str, str | None]:
    errors = exc.errors()
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


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> JSONResponse:
        return error_response(from_request_error(exc))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        message, param = _describe_validation(exc)
        return JSONResponse(error_body(message, 400, param), 400)

    @app.exception_handler(ValueError)
    async def _value_error(request: Request, exc: ValueError) -> JSONResponse:
        return JSONResponse(error_body(str(exc), 400), 400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body(str(exc.detail), exc.status_code), exc.status_code)

    @app.exception_handler(ClientGone)
    async def _client_gone(request: Request, exc: ClientGone) -> JSONResponse:
        # 499 (nginx's "client closed request"): logged as what it is, not as a server error.
        logger.info("%s: the client disconnected; its request was aborted", request.url.path)
        return JSONResponse(error_body("the client closed the request", 499), 499)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error on %s", request.url.path)
        return JSONResponse(error_body(f"internal error: {exc!r}", 500), 500)
