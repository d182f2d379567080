"""What one HTTP request may cost before any route sees it: pure ASGI middleware.

Pure ASGI (not ``@app.middleware("http")``, which wraps responses and breaks streaming and
disconnect detection).  Outermost first, :func:`install_limits` stacks:

- ``CORSMiddleware`` (Starlette's), only when ``--cors-allow-origins`` is set, so that
  browsers also see the refusals below and preflights are answered without a key;
- :class:`ApiKeyAuth`: ``Authorization: Bearer <key>`` on every route but ``/health``,
  compared in constant time → 401;
- :class:`RequestLimits`, in this order, each before the request costs more: too many or
  too large headers → 431; a ``Content-Length`` over the body limit → 413 before reading;
  a generation request while the in-flight limit is reached → 503 + ``Retry-After``, before
  reading or tokenizing; a body growing past the limit while read (chunked uploads) → 413,
  the rest left unread; a JSON body nested deeper than :data:`MAX_JSON_DEPTH` → 400.

Refusals that leave the body unread close the connection, so that uvicorn does not go on
reading and discarding it.  Request heads: uvicorn's parser (h11) buffers an incomplete head
up to :data:`MAX_INCOMPLETE_HEAD_BYTES`, then answers a plain-text 400 and closes the
connection; it checks only while the head is incomplete, so a head that arrives whole in one
read (up to 256 KiB) passes it, and every complete head is judged here, by
:data:`MAX_HEADER_BYTES` and :data:`MAX_HEADER_COUNT`.
"""

from __future__ import annotations

import hmac
from collections.abc import Iterable

import numpy as np
import orjson
from starlette.applications import Starlette
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from radixserve.frontend.errors import ANTHROPIC_PATHS, error_payload

MAX_JSON_DEPTH = 64  # arrays and objects inside each other
MAX_HEADER_BYTES = 32 * 1024  # names + values of all headers
MAX_HEADER_COUNT = 100  # as Apache's LimitRequestFields
# h11's limit on an incomplete head (the module's docstring).  Twice MAX_HEADER_BYTES, so
# that heads up to this size, however the network splits them, are answered 431 here.
MAX_INCOMPLETE_HEAD_BYTES = 2 * MAX_HEADER_BYTES
RETRY_AFTER_S = 1
# answered without an API key (the page holds no data)
OPEN_PATHS = frozenset({"/health", "/cache"})
GENERATION_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/generate",
                              "/v1/messages", "/v1/responses"})
_DEPTH_CHUNK = 1 << 20  # brackets summed per numpy step: bounded temporary memory


async def refuse(send: Send, status: int, message: str, headers: Iterable[tuple[str, str]] = (),
                 close: bool = True, path: str = "") -> None:
    """Answer ``status`` with an error body in the shape of ``path``'s API (OpenAI's, or
    Anthropic's on its routes); ``close`` when the body is unread."""
    body = orjson.dumps(error_payload(path, message, status))
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers]
    if close:
        raw.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


class ApiKeyAuth:
    """Every route but :data:`OPEN_PATHS` needs ``Authorization: Bearer <key>`` (the OpenAI
    convention; no other header is read).  The token is compared with
    :func:`hmac.compare_digest`, so the time taken says nothing about how much of it matched."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    def allows(self, authorization: bytes | None) -> bool:
        scheme, _, token = (authorization or b"").strip().partition(b" ")
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    def allows_anthropic(self, scope: Scope) -> bool:
        """Anthropic's clients send the key as ``x-api-key``; accepted on its routes only."""
        key = _header(scope, b"x-api-key")
        return (key is not None and scope["path"] in ANTHROPIC_PATHS
                and hmac.compare_digest(key.strip(), self.key))

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
        elif not (self.allows(_header(scope, b"authorization"))
                  or self.allows_anthropic(scope)):
            await refuse(send, 401,
                         "invalid or missing API key: send 'Authorization: Bearer <key>'",
                         [("www-authenticate", "Bearer")], path=scope["path"])
        else:
            await self.app(scope, receive, send)


class RequestLimits:
    """Header, body-size, in-flight and JSON-depth limits (see the module's docstring).

    ``max_in_flight`` counts generation requests from the end of their body to the end of
    their response (streams included); ``None`` sets no limit.  A full house refuses before
    the body is read, and again after: a request takes its place only once its body is in,
    so clients that upload slowly (or never finish) hold no place.
    """

    def __init__(self, app: ASGIApp, max_body_bytes: int, max_in_flight: int | None = None,
                 max_json_depth: int = MAX_JSON_DEPTH) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.max_in_flight = max_in_flight
        self.max_json_depth = max_json_depth
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        problem = self._header_problem(scope["headers"])
        if problem:
            await refuse(send, 431, problem, path=path)
            return
        length = _header(scope, b"content-length")
        if length is not None and length.strip().isdigit() and int(length) > self.max_body_bytes:
            await refuse(send, 413, self._too_large(f"{int(length)} bytes"), path=path)
            return
        gated = (self.max_in_flight is not None and scope["method"] == "POST"
                 and scope["path"] in GENERATION_PATHS)
        if gated and self._full():
            await self._refuse_busy(send, close=True, path=path)
            return
        body = await self._read_body(receive, send, path)
        if body is None:
            return
        if (body and _is_json(_header(scope, b"content-type"))
                and json_depth_exceeds(body, self.max_json_depth)):
            await refuse(send, 400, f"the request body nests arrays and objects more than "
                                    f"{self.max_json_depth} levels deep", close=False, path=path)
            return
        if gated and self._full():
            await self._refuse_busy(send, close=False, path=path)
            return
        replayed = False

        async def replay() -> Message:
            # The body as one message; later calls go to the server, so that the app still
            # hears of a client that disconnects.
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        if gated:
            self.in_flight += 1
        try:
            await self.app(scope, replay, send)
        finally:
            if gated:
                self.in_flight -= 1

    async def _read_body(self, receive: Receive, send: Send, path: str) -> bytes | None:
        """The whole body, or None once answered 413 (the rest left unread) or when the
        client left before sending all of it (nobody to answer)."""
        chunks: list[bytes] = []
        size = 0
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                await refuse(send, 413, self._too_large(f"more than {self.max_body_bytes} bytes"),
                             path=path)
                return None
            chunks.append(chunk)
            more = message.get("more_body", False)
        return b"".join(chunks)

    def _full(self) -> bool:
        return self.max_in_flight is not None and self.in_flight >= self.max_in_flight

    async def _refuse_busy(self, send: Send, close: bool, path: str) -> None:
        await refuse(send, 503, f"the request queue is full ({self.in_flight} requests in flight, "
                                "the most this server accepts); retry later",
                     [("retry-after", str(RETRY_AFTER_S))], close=close, path=path)

    def _header_problem(self, headers: list[tuple[bytes, bytes]]) -> str | None:
        if len(headers) > MAX_HEADER_COUNT:
            return (f"the request has {len(headers)} headers; "
                    f"at most {MAX_HEADER_COUNT} are accepted")
        size = sum(len(k) + len(v) for k, v in headers)
        if size > MAX_HEADER_BYTES:
            return f"the request headers take {size} bytes; at most {MAX_HEADER_BYTES} are accepted"
        return None

    def _too_large(self, what: str) -> str:
        return (f"the request body has {what}; this server accepts at most {self.max_body_bytes} "
                "(--max-request-body-bytes)")


def _is_json(content_type: bytes | None) -> bool:
    """What FastAPI parses as JSON: no content type, ``application/json`` or ``*+json``."""
    if content_type is None:
        return True
    kind = content_type.split(b";", 1)[0].strip().lower()
    return kind == b"application/json" or (
        kind.startswith(b"application/") and kind.endswith(b"+json")
    )


_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"[]{}')
_STEP = bytes.maketrans(b'"[{]}', b"\x00\x01\x01\xff\xff")  # as int8: 0, +1, -1


def json_depth_exceeds(body: bytes, limit: int) -> bool:
    """Whether ``body`` nests arrays and objects more than ``limit`` deep, outside strings.

    A scan without recursion or parsing, vectorised, in time and memory linear in the body.
    Backslash escapes occur only inside strings (elsewhere the JSON is invalid, and a parser
    stops there), so once ``\\\\`` and then ``\\"`` are dropped every quote left opens or closes
    a string: a bracket is structure when an even number of quotes precede it.  Brackets
    become +1 / -1, and their running sum is the depth a parser recurses to, whether or not
    they match.
    """
    if body.count(b"[") + body.count(b"{") <= limit:
        return False  # cannot nest deeper than it has openers
    marks = body.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    is_quote = np.frombuffer(marks, np.uint8) == ord('"')
    steps = np.frombuffer(marks.translate(_STEP), np.int8)
    quotes = depth = 0
    for start in range(0, len(steps), _DEPTH_CHUNK):
        quotes_so_far = np.cumsum(is_quote[start:start + _DEPTH_CHUNK], dtype=np.int64) + quotes
        outside = (quotes_so_far & 1) == 0
        running = np.cumsum(
            np.where(outside, steps[start:start + _DEPTH_CHUNK], 0), dtype=np.int64
        ) + depth
        if int(running.max()) > limit:
            return True
        quotes, depth = int(quotes_so_far[-1]), int(running[-1])
    return False


def cors_origins(setting: str | None) -> list[str]:
    """``--cors-allow-origins`` as a list; empty means CORS stays off."""
    return [o.strip() for o in (setting or "").split(",") if o.strip()]


def install_limits(app: Starlette, *, max_body_bytes: int, max_in_flight: int | None,
                   api_key: str | None, cors_allow_origins: str | None) -> None:
    """Add the middleware in the order the module's docstring gives (``add_middleware``
    wraps what was added before, so the outermost comes last)."""
    app.add_middleware(RequestLimits, max_body_bytes=max_body_bytes, max_in_flight=max_in_flight)
    if api_key:
        app.add_middleware(ApiKeyAuth, api_key=api_key)
    origins = cors_origins(cors_allow_origins)
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=origins, allow_methods=["*"],
                           allow_headers=["*"], expose_headers=["Retry-After"])
