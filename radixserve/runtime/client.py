"""The client of a started process group: the tokenizer manager and the watchdog, on one loop.

Both the ``Engine`` (on its background loop) and the HTTP app (on uvicorn's) hold one.
:meth:`RuntimeClient.start` opens the sockets and starts the watchdog; when the scheduler or
the detokenizer dies, every waiting request and control call fails with the reason, later
ones are refused, and ``on_dead`` runs (the server stops, the engine stops its processes).
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

from radixserve.ipc.messages import ModelInfo
from radixserve.runtime.jobs import Job
from radixserve.runtime.launcher import ProcessGroup
from radixserve.runtime.native_output import LogprobRequest
from radixserve.runtime.pieces import Piece
from radixserve.runtime.tokenizer_manager import TokenizerManager

logger = logging.getLogger(__name__)
WATCHDOG_INTERVAL_S = 0.5


class RuntimeClient:
    """``procs`` started (``info`` is what its start returned).  When a process dies, the
    error log line says it and then ``down_note`` (what happens next), the requests fail with
    ``down_prefix`` + the reason, and ``on_dead(reason)`` (a function or a coroutine function)
    runs."""

    def __init__(self, procs: ProcessGroup, info: ModelInfo, *, slow_reader_timeout: float = 30.0,
                 down_prefix: str = "", down_note: str = "in-flight and later requests fail",
                 on_dead: Callable[[str], Any] | None = None) -> None:
        self.procs = procs
        self.info = info
        self.tokenizer = procs.tokenizer
        self.tm = TokenizerManager(
            self.tokenizer,
            info,
            procs.paths.scheduler,
            procs.paths.frontend,
            slow_reader_timeout=slow_reader_timeout,
        )
        self.down_prefix = down_prefix
        self.down_note = down_note
        self.on_dead = on_dead
        self._watchdog: asyncio.Task | None = None

    async def start(self) -> None:
        await self.tm.start()
        self._watchdog = asyncio.create_task(self._watch())

    async def close(self, reason: str) -> None:
        """Stop watching, fail what still waits with ``reason``, close the sockets."""
        if self._watchdog is not None:
            self._watchdog.cancel()
        self.tm.fail_all(reason)
        await self.tm.close()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            dead = self.procs.dead_process()
            if dead:
                logger.error("%s; %s", dead, self.down_note)
                self.tm.fail_all(self.down_prefix + dead)
                if self.on_dead is not None:
                    result = self.on_dead(dead)
                    if inspect.isawaitable(result):
                        await result
                return

    def pieces(
        self, job: Job, lp: LogprobRequest, *, stream: bool, rid: str | None = None
    ) -> AsyncIterator[Piece]:
        """The pieces of one job (aborted in the scheduler if the consumer stops early)."""
        return self.tm.generate(
            job.ids,
            job.params,
            stream,
            lp.return_logprob,
            lp.top_logprobs_num,
            rid=rid,
            logprob_start_len=lp.scheduler_start(len(job.ids)),
            hints=job.hints,
        )

