"""Offline Python API: the same processes and messages the HTTP server uses.

    with Engine() as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out["text"], out["meta_info"])
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

from radixserve.config import ServerArgs
from radixserve.frontend.tokenizer_manager import RequestError, TokenizerManager
from radixserve.launcher import ProcessGroup
from radixserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)
WATCHDOG_INTERVAL_S = 0.5


def _merge(pieces: list[dict[str, Any]]) -> dict[str, Any]:
    """Join the streamed deltas of one request into its final result."""
    out: dict[str, Any] = {
        "text": "".join(p["text"] for p in pieces),
        "output_ids": [t for p in pieces for t in p["output_ids"]],
        "meta_info": dict(pieces[-1]["meta_info"]),
    }
    if any("logprobs" in p for p in pieces):
        out["meta_info"]["output_token_logprobs"] = [
            lp for p in pieces for lp in (p.get("logprobs") or [])
        ]
        out["meta_info"]["output_top_logprobs"] = [
            top for p in pieces for top in (p.get("top_logprobs") or [])
        ]
    first = next((p for p in pieces if "input_logprobs" in p), None)  # sent once
    if first is not None:
        out["meta_info"]["input_token_logprobs"] = first["input_logprobs"]
        out["meta_info"]["input_top_logprobs"] = first["input_top_logprobs"]
    return out


class Engine:
    """``Engine(model=None, **settings)``; settings are :class:`ServerArgs` fields."""

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        self.args = ServerArgs.from_kwargs(model=model, **settings)
        self.procs = ProcessGroup(self.args)
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            info = self.procs.start()
            self.tokenizer = load_tokenizer(info["tokenizer_path"])
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(target=self._loop.run_forever, name="radixserve-engine", daemon=True)
            self._thread.start()
            self.tm = TokenizerManager(self.tokenizer, info, self.procs.paths.scheduler, self.procs.paths.frontend)
            self._call(self.tm.start())
            self._watchdog = asyncio.run_coroutine_threadsafe(self._watch(), self._loop)
        except BaseException:
            self.shutdown()
            raise
        self.info = info

    # ---- plumbing ----------------------------------------------------------------------
    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
            dead = self.procs.dead_process()
            if dead:
                logger.error("%s; the engine fails in-flight and later requests and stops "
                             "its other process", dead)
                self.tm.fail_all(f"the engine is down: {dead}")
                await asyncio.get_running_loop().run_in_executor(None, self.procs.shutdown)
                return

    def _normalize(
        self,
        prompt: str | list[str] | None,
        sampling_params: dict | list[dict] | None,
        input_ids: list[int] | list[list[int]] | None,
        logprob_start_len: int = -1,
    ) -> tuple[bool, list[tuple[list[int], Any]]]:
        """Validate every request of the call up front; ValueError names the bad one."""
        if prompt is None and input_ids is None:
            raise ValueError("give prompt or input_ids")
        if prompt is not None and input_ids is not None:
            raise ValueError("give prompt or input_ids, not both")
        if prompt is not None:
            batched = isinstance(prompt, list)
            prompts: list[Any] = prompt if batched else [prompt]
            ids_list: list[Any] = [None] * len(prompts)
        else:
            batched = bool(input_ids) and isinstance(input_ids[0], list)
            ids_list = input_ids if batched else [input_ids]
            prompts = [None] * len(ids_list)
        if batched and not prompts:
            raise ValueError("the batch is empty")
        if isinstance(sampling_params, list):
            if len(sampling_params) != len(prompts):
                raise ValueError(
                    f"{len(sampling_params)} sampling_params for {len(prompts)} prompts"
                )
            params_list = sampling_params
        else:
            if sampling_params is not None and not isinstance(sampling_params, dict):
                raise ValueError("sampling_params must be a dict or a list of dicts")
            params_list = [sampling_params] * len(prompts)
        prepared = []
        for i, (p, ids, sp) in enumerate(zip(prompts, ids_list, params_list, strict=True)):
            try:
                prepared.append(self.tm.prepare(p, ids, sp, logprob_start_len))
            except ValueError as e:
                raise ValueError(f"request {i}: {e}" if batched else str(e)) from None
        return batched, prepared

    async def _collect(self, ids: list[int], params: Any, logprob: tuple[bool, int, int]) -> dict[str, Any]:
        return_logprob, top_n, start = logprob
        pieces = [
            p async for p in self.tm.generate(ids, params, False, return_logprob, top_n, logprob_start_len=start)
        ]
        return _merge(pieces)

    async def _generate_all(
        self, prepared: list[tuple[list[int], Any]], logprob: tuple[bool, int, int], progress: bool
    ) -> list[dict[str, Any]]:
        """``logprob``: ``(return_logprob, top_logprobs_num, logprob_start_len)``."""
        tasks = [asyncio.ensure_future(self._collect(ids, sp, logprob)) for ids, sp in prepared]
        try:
            if progress:
                from tqdm import tqdm

                with tqdm(total=len(tasks), desc="generate", unit="req") as bar:
                    for fut in asyncio.as_completed(tasks):
                        await fut
                        bar.update(1)
            return list(await asyncio.gather(*tasks))
        except BaseException:
            # One request failed (or the caller gave up): abort the others in the scheduler
            # instead of leaving them running, and wait until their aborts are sent.
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    # ---- public API ----------------------------------------------------------------------
    def generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
        progress: bool | None = None,
        logprob_start_len: int = -1,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict) or a batch (a list of dicts, in input order).

        Each result: ``text``, ``output_ids`` and ``meta_info`` (``prompt_tokens``,
        ``cached_tokens``, ``completion_tokens``, ``finish_reason``).  ``stream=True`` (one
        prompt) yields pieces whose ``text`` / ``output_ids`` are the new part only.  Batches
        of two or more show a progress bar unless ``progress=False``.

        ``return_logprob`` adds ``output_token_logprobs`` / ``output_top_logprobs`` (pairs
        ``[token_id, logprob]``, ``top_logprobs_num`` per token) to ``meta_info``; with
        ``logprob_start_len = k >= 0`` also ``input_token_logprobs`` / ``input_top_logprobs``
        for prompt positions ``[k, prompt_len)`` (None at position 0).  Prompt tokens whose
        logprobs are asked for are computed even when cached.
        """
        batched, prepared = self._normalize(prompt, sampling_params, input_ids, logprob_start_len)
        logprob = (return_logprob, top_logprobs_num, logprob_start_len)
        if stream:
            if batched:
                raise ValueError("stream=True takes a single prompt")
            return self._stream_sync(prepared[0], logprob)
        show = progress if progress is not None else len(prepared) > 1
        results = self._call(self._generate_all(prepared, logprob, show))
        return results if batched else results[0]

    def _stream_sync(self, prepared: tuple[list[int], Any], logprob: tuple[bool, int, int]) -> Iterator[dict[str, Any]]:
        q: queue.Queue = queue.Queue()
        done = object()
        return_logprob, top_n, start = logprob

        async def pump() -> None:
            try:
                async for piece in self.tm.generate(
                    prepared[0], prepared[1], True, return_logprob, top_n, logprob_start_len=start
                ):
                    q.put(piece)
            except BaseException as e:  # handed to the consumer thread, which re-raises it
                q.put(e)
            finally:
                q.put(done)

        fut = asyncio.run_coroutine_threadsafe(pump(), self._loop)
        try:
            while (item := q.get()) is not done:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            fut.cancel()  # consumer stopped early: the request is aborted

    async def async_generate(
        self,
        prompt: str | list[str] | None = None,
        sampling_params: dict | list[dict] | None = None,
        input_ids: list[int] | list[list[int]] | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        stream: bool = False,
        logprob_start_len: int = -1,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """The asyncio variant of :meth:`generate`, usable from any event loop."""
        batched, prepared = self._normalize(prompt, sampling_params, input_ids, logprob_start_len)
        logprob = (return_logprob, top_logprobs_num, logprob_start_len)
        if stream:
            if batched:
                raise ValueError("stream=True takes a single prompt")
            return self._stream_async(prepared[0], logprob)
        fut = asyncio.run_coroutine_threadsafe(self._generate_all(prepared, logprob, False), self._loop)
        results = await asyncio.wrap_future(fut)
        return results if batched else results[0]

    async def _stream_async(self, prepared: tuple[list[int], Any], logprob: tuple[bool, int, int]) -> AsyncIterator[dict[str, Any]]:
        return_logprob, top_n, start = logprob
        agen = self.tm.generate(prepared[0], prepared[1], True, return_logprob, top_n, logprob_start_len=start)
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                try:
                    piece = await asyncio.wrap_future(fut)
                except StopAsyncIteration:
                    return
                yield piece
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop)

    def get_stats(self) -> dict[str, Any]:
        """Scheduler counters: tokens, hit rate, retractions, evictions, step overhead."""
        return self._call(self.tm.control("stats"))

    def check_memory(self) -> dict[str, Any]:
        """The KV memory invariant: free + tree + requests == all pages, no lock when idle."""
        return self._call(self.tm.control("check_memory"))

    def flush_cache(self) -> bool:
        return bool(self._call(self.tm.control("flush_cache"))["success"])

    def shutdown(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._watchdog.cancel)
            try:
                asyncio.run_coroutine_threadsafe(self.tm.close(), self._loop).result(5)
            except (RuntimeError, TimeoutError, AttributeError) as e:
                logger.warning("front end did not close cleanly: %r", e)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._loop = None
        self.procs.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if getattr(self, "_loop", None) is not None or getattr(self, "procs", None) and self.procs.procs:
            self.shutdown()


__all__ = ["Engine", "RequestError"]
