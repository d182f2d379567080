"""The HTTP server: FastAPI app on uvicorn in front of the scheduler and detokenizer processes.

Start-up: the launcher starts both processes and waits until the model is loaded, only then
does uvicorn bind the port, so ``/health`` answers 200 as soon as anything answers.  A
watchdog stops the server with exit code 1 when either process dies; SIGTERM / Ctrl-C stop
accepting, give in-flight requests a few seconds, abort the rest and exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
from collections.abc import AsyncIterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from radixserve.config import ServerArgs
from radixserve.frontend.chat_api import router as chat_router
from radixserve.frontend.errors import error_body, install_error_handlers
from radixserve.frontend.native_api import router as native_router
from radixserve.frontend.openai_api import router as openai_router
from radixserve.frontend.responses import JSONBytesResponse
from radixserve.frontend.serving import ServerState
from radixserve.frontend.tokenizer_manager import TokenizerManager
from radixserve.launcher import ProcessGroup
from radixserve.logging_utils import configure_logging
from radixserve.tokenizer import load_tokenizer

logger = logging.getLogger("radixserve.server")
WATCHDOG_INTERVAL_S = 0.5
GRACEFUL_SHUTDOWN_S = 5


def create_app(args: ServerArgs, procs: ProcessGroup, info: dict[str, Any], tokenizer: Any,
               on_dead: Any = None) -> FastAPI:
    model_name = args.served_model_name or os.path.basename(os.path.normpath(procs.model_path))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        tm = TokenizerManager(tokenizer, info, procs.paths.scheduler, procs.paths.frontend)
        await tm.start()
        state = ServerState(args=args, tm=tm, info=info, model_name=model_name,
                            pids={name: p.pid for name, p in procs.procs.items()})
        app.state.server = state

        async def watchdog() -> None:
            while True:
                await asyncio.sleep(WATCHDOG_INTERVAL_S)
                dead = procs.dead_process()
                if dead:
                    logger.error("%s; the server stops", dead)
                    tm.fail_all(dead)
                    if on_dead is not None:
                        on_dead(dead)
                    return

        task = asyncio.create_task(watchdog())
        try:
            yield
        finally:
            state.shutting_down = True
            task.cancel()
            tm.fail_all("the server is shutting down")
            await tm.close()

    app = FastAPI(title="radixserve", lifespan=lifespan, default_response_class=JSONBytesResponse)
    install_error_handlers(app)
    app.include_router(openai_router)
    app.include_router(chat_router)
    app.include_router(native_router)

    if args.api_key:
        expected = f"Bearer {args.api_key}"

        @app.middleware("http")
        async def check_key(request: Request, call_next: Any) -> Any:
            if request.url.path != "/health" and request.headers.get("authorization") != expected:
                return JSONResponse(error_body("invalid or missing API key", 401), 401)
            return await call_next(request)

    return app


def run_server(args: ServerArgs) -> int:
    """Serve until SIGTERM / Ctrl-C (exit 0) or until a process dies (exit 1)."""
    configure_logging("server", args.log_level)
    procs = ProcessGroup(args)
    exit_code = 0
    try:
        info = procs.start()
        tokenizer = load_tokenizer(info["tokenizer_path"])
        server: uvicorn.Server | None = None

        def on_dead(reason: str) -> None:
            nonlocal exit_code
            exit_code = 1
            if server is not None:
                server.should_exit = True

        app = create_app(procs.args, procs, info, tokenizer, on_dead)
        config = uvicorn.Config(
            app, host=args.host, port=args.port, log_level=args.log_level.lower(),
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, access_log=False,
        )
        server = uvicorn.Server(config)
        # uvicorn re-raises the signal that stopped it once it has shut down; with these
        # handlers in place that re-raise is a no-op and the processes below are cleaned up.
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: None)
        logger.info("serving %s on http://%s:%d", procs.model_path, args.host, args.port)
        server.run()
        if exit_code == 0 and not server.started:
            exit_code = 1  # e.g. the port was taken
    finally:
        procs.shutdown()
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code
