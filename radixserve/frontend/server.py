"""The HTTP server: FastAPI app on uvicorn in front of the scheduler and detokenizer processes.

Start-up: once the settings and model path are checked, the port is bound, so a port in use
is a one-line error before anything loads, and nothing can take the port while the model
loads; the launcher starts both processes and waits until the model is loaded, and only then
does uvicorn serve on that socket (connections made meanwhile wait in its backlog), so
``/health`` answers 200 as soon as anything answers.  A watchdog stops the server with exit
code 1 when either process dies; SIGTERM / Ctrl-C stop accepting, give in-flight requests a
few seconds, abort the rest and exit 0.  What one request may cost (sizes, nesting, requests
in flight, the API key, CORS) is ``limits.py``'s.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import signal
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI

from radixserve.config import ServerArgs
from radixserve.frontend.anthropic_api import router as anthropic_router
from radixserve.frontend.cache_api import router as cache_router
from radixserve.frontend.cache_views import router as cache_views_router
from radixserve.frontend.chat_api import router as chat_router
from radixserve.frontend.errors import install_error_handlers
from radixserve.frontend.json_response import JSONBytesResponse
from radixserve.frontend.limits import MAX_INCOMPLETE_HEAD_BYTES, install_limits
from radixserve.frontend.lora_api import router as lora_router
from radixserve.frontend.native_api import router as native_router
from radixserve.frontend.openai_api import router as openai_router
from radixserve.frontend.responses_api import router as responses_router
from radixserve.frontend.state import ServerState
from radixserve.ipc.messages import ModelInfo
from radixserve.logging_utils import configure_logging
from radixserve.runtime.client import RuntimeClient
from radixserve.runtime.launcher import ProcessGroup
from radixserve.threads import use_one_thread

logger = logging.getLogger("radixserve.server")
GRACEFUL_SHUTDOWN_S = 5
LISTEN_BACKLOG = 2048  # uvicorn's default


def create_app(args: ServerArgs, procs: ProcessGroup, info: ModelInfo,
               on_dead: Callable[[str], Any] | None = None) -> FastAPI:
    model_name = args.served_model_name or os.path.basename(os.path.normpath(procs.model_path))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client = RuntimeClient(procs, info, slow_reader_timeout=args.slow_reader_timeout,
                               down_note="the server stops", on_dead=on_dead)
        await client.start()
        state = ServerState(args=args, client=client, info=info, model_name=model_name,
                            pids={name: p.pid for name, p in procs.procs.items()},
                            model_path=procs.model_path)
        app.state.server = state
        grpc_server = None
        if args.grpc_port is not None:
            from radixserve.frontend.grpc_service import start_grpc

            grpc_server = await start_grpc(state, args.host, args.grpc_port)
        try:
            yield
        finally:
            state.shutting_down = True
            if grpc_server is not None:
                await grpc_server.stop(1.0)
            await client.close("the server is shutting down")

    app = FastAPI(title="radixserve", lifespan=lifespan, default_response_class=JSONBytesResponse)
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(chat_router)
    app.include_router(anthropic_router)
    app.include_router(responses_router)
    app.include_router(native_router)
    app.include_router(cache_router)
    app.include_router(cache_views_router)
    app.include_router(lora_router)

    # The front end admits as many generation requests as the scheduler may hold (running
    # plus queued); beyond that a flood is refused before bodies are read or tokenized.
    max_in_flight = None
    if args.max_queued_requests is not None:
        max_in_flight = args.max_queued_requests + info.max_running_requests
    install_limits(app, max_body_bytes=args.max_request_body_bytes, max_in_flight=max_in_flight,
                   api_key=args.api_key, cors_allow_origins=args.cors_allow_origins)
    return app


def bind_port(host: str, port: int) -> socket.socket:
    """A socket bound to ``host:port`` and listening; ValueError (one line) if it cannot be."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
    except socket.gaierror as e:
        raise ValueError(f"cannot serve on host {host!r}: {e.strerror}") from None
    sock = socket.socket(family, kind, proto)
    try:
        # a restart need not wait out TIME_WAIT
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise ValueError(f"port {port} on {host} is in use; stop what is listening there or "
                             "choose another port with --port") from None
        raise ValueError(f"cannot listen on {host}:{port}: {e.strerror}") from None
    return sock


def raise_open_file_limit(want: int = 65536) -> None:
    """Every connection is a file descriptor: raise the soft limit towards the hard one, so
    that a flood of connections is answered (503) rather than left unaccepted."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = want if hard == resource.RLIM_INFINITY else min(want, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as e:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, e)


class _Server(uvicorn.Server):
    """Logs where it serves once it does (uvicorn stays silent when handed a socket)."""

    def __init__(self, config: uvicorn.Config, serving_line: str) -> None:
        super().__init__(config)
        self.serving_line = serving_line

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            logger.info("%s", self.serving_line)


def run_server(args: ServerArgs) -> int:
    """Serve until SIGTERM / Ctrl-C (exit 0) or until a process dies (exit 1)."""
    configure_logging("server", args.log_level)
    procs = ProcessGroup(args)  # settings and model path checked; nothing started or loaded yet
    try:
        sock = bind_port(args.host, args.port)
    except ValueError:
        procs.shutdown()  # removes its socket folder
        raise
    raise_open_file_limit()
    exit_code = 0
    try:
        info = procs.start()
        use_one_thread()  # the children are started: the scheduler owns the cores
        server: uvicorn.Server | None = None

        def on_dead(reason: str) -> None:
            nonlocal exit_code
            exit_code = 1
            if server is not None:
                server.should_exit = True

        app = create_app(procs.args, procs, info, on_dead)
        # h11 explicitly: the head-size limit below is h11's (httptools, when installed,
        # would be chosen by "auto" and has none).
        config = uvicorn.Config(
            app, log_level=args.log_level.lower(), http="h11",
            h11_max_incomplete_event_size=MAX_INCOMPLETE_HEAD_BYTES,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False,
        )
        host, port = sock.getsockname()[:2]
        url_host = f"[{host}]" if ":" in host else host
        server = _Server(config, f"serving {procs.model_path} on http://{url_host}:{port}")
        # uvicorn re-raises the signal that stopped it once it has shut down; with these
        # handlers in place that re-raise is a no-op and the processes below are cleaned up.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        server.run(sockets=[sock])
        if exit_code == 0 and not server.started:
            exit_code = 1
    finally:
        sock.close()
        procs.shutdown()
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code
