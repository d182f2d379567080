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
from radixserve.runtime.client import RuntimeClient
from radixserve.runtime.jobs import Job, PromptSpec, prepare_jobs, split_batch
from radixserve.runtime.launcher import ProcessGroup
from radixserve.runtime.native_output import LogprobRequest, NativeOutput
from radixserve.runtime.pieces import Piece
from radixserve.runtime.tokenizer_manager import RequestError, SchedulingHints

logger = logging.getLogger(__name__)
# Aggregating a long profile (hundreds of thousands of ops) takes a while on a small CPU.
PROFILE_STOP_TIMEOUT_S = 600.0


class Engine:
    """``Engine(model=None, **settings)``; settings are :class:`ServerArgs` fields."""

    def __init__(self, model: str | None = None, **settings: Any) -> None:
        self.args = ServerArgs.from_kwargs(model=model, **settings)
        self.procs = ProcessGroup(self.args)
        self._loop: asyncio.AbstractEventLoop | None = None
        try:
            info = self.procs.start()
            self.tokenizer = self.procs.tokenizer
            self._loop = asyncio.new_event_loop()
            self._thread = threading.Thread(
                target=self._loop.run_forever, name="radixserve-engine", daemon=True
            )
            self._thread.start()
            self.client = RuntimeClient(
                self.procs, info, down_prefix="the engine is down: ", on_dead=self._on_dead,
                down_note=(
                    "the engine fails in-flight and later requests and stops its other processes"
                ),
            )
            self.tm = self.client.tm
            self._call(self.client.start())
        except BaseException:
            self.shutdown()
            raise
        self.info = info  # the ModelInfo record the scheduler reported

    # ---- plumbing ----------------------------------------------------------------------
    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result()

    async def _on_dead(self, reason: str) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.procs.shutdown)

    def _jobs(
        self,
        prompt: Any,
        sampling_params: Any,
        input_ids: Any,
        logprob_start_len: int = -1,
        extra_key: Any = None,
        priority: int = 0,
        return_cache_report: bool = False,
        lora_path: Any = None,
    ) -> tuple[bool, list[Job]]:
        """Validate every request of the call up front; ValueError names the bad one."""
        batched, specs = split_batch(
            prompt, input_ids, sampling_params, extra_key, priority=priority,
            cache_report=return_cache_report, lora_path=lora_path,
        )

        def prepare(spec: PromptSpec) -> Any:
            return self.tm.prepare(spec.text, spec.input_ids, spec.sampling, logprob_start_len)

        return batched, prepare_jobs(specs, batched, prepare)

    def _pieces(self, job: Job, stream: bool, lp: LogprobRequest) -> AsyncIterator[Piece]:
        return self.client.pieces(job, lp, stream=stream)

    async def _collect(self, job: Job, lp: LogprobRequest) -> dict[str, Any]:
        out = NativeOutput(job.ids, lp, self.tokenizer)
        async for piece in self._pieces(job, False, lp):
            out.add(piece)
        return out.result()

    async def _generate_all(
        self, prepared: list[Job], lp: LogprobRequest, progress: bool
    ) -> list[dict[str, Any]]:
        tasks = [asyncio.ensure_future(self._collect(job, lp)) for job in prepared]
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
        return_text_in_logprobs: bool = False,
        extra_key: str | list[str | None] | None = None,
        priority: int = 0,
        return_cache_report: bool = False,
        lora_path: str | list[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | Iterator[dict[str, Any]]:
        """Generate for one prompt (a dict) or a batch (a list of dicts, in input order).

        Each result: ``text``, ``output_ids`` and ``meta_info`` (``prompt_tokens``,
        ``cached_tokens``, ``completion_tokens``, ``finish_reason``), in the shape of the
        native ``/generate`` route (both are built by ``runtime/native_output.py``).
        ``max_new_tokens = 0`` computes and caches the prompt only (finish reason length).
        ``stream=True`` (one prompt) yields pieces whose ``text``, ``output_ids`` and logprob
        lists are the new part only.  Batches of two or more show a progress bar unless
        ``progress=False``.

        ``return_logprob`` adds SGLang's ``output_token_logprobs`` / ``output_top_logprobs``
        and ``input_token_logprobs`` / ``input_top_logprobs`` to ``meta_info``: entries
        ``[logprob, token_id, text]`` (text only with ``return_text_in_logprobs``, else None;
        ``top_logprobs_num`` per position in the top lists).  The input ones cover prompt
        positions ``[logprob_start_len, prompt_len)`` (logprob None at position 0), and with
        the default ``logprob_start_len = -1`` the last prompt position only.  Prompt tokens
        whose logprobs are asked for are computed even when cached.

        ``extra_key`` (one, or one per prompt): the cache namespace (the HTTP routes'
        ``cache_salt``); cached prefixes are shared only between requests with the same key.
        ``priority``: the level used by ``schedule_policy="priority"``.
        ``lora_path`` (one, or one per prompt): the name of a loaded LoRA adapter (SGLang's
        field; None: the base model); ValueError for an adapter that is not loaded.
        ``return_cache_report`` adds ``meta_info.cache_report``: where the prompt's prefix match
        stopped, and the request's and the cache's text from there (as ``/generate``).
        """
        batched, prepared = self._jobs(prompt, sampling_params, input_ids, logprob_start_len,
                                            extra_key, priority, return_cache_report, lora_path)
        lp = LogprobRequest(
            return_logprob, top_logprobs_num, logprob_start_len, return_text_in_logprobs
        )
        if stream:
            if batched:
                raise ValueError("stream=True takes a single prompt")
            return self._stream_sync(prepared[0], lp)
        show = progress if progress is not None else len(prepared) > 1
        results = self._call(self._generate_all(prepared, lp, show))
        return results if batched else results[0]

    def _stream_sync(self, job: Job, lp: LogprobRequest) -> Iterator[dict[str, Any]]:
        q: queue.Queue = queue.Queue()
        done = object()
        out = NativeOutput(job.ids, lp, self.tokenizer)

        async def pump() -> None:
            try:
                async for piece in self._pieces(job, True, lp):
                    q.put(out.add(piece))
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
        return_text_in_logprobs: bool = False,
        extra_key: str | list[str | None] | None = None,
        priority: int = 0,
        lora_path: str | list[str | None] | None = None,
    ) -> dict[str, Any] | list[dict[str, Any]] | AsyncIterator[dict[str, Any]]:
        """The asyncio variant of :meth:`generate`, usable from any event loop."""
        batched, prepared = self._jobs(prompt, sampling_params, input_ids, logprob_start_len,
                                            extra_key, priority, False, lora_path)
        lp = LogprobRequest(
            return_logprob, top_logprobs_num, logprob_start_len, return_text_in_logprobs
        )
        if stream:
            if batched:
                raise ValueError("stream=True takes a single prompt")
            return self._stream_async(prepared[0], lp)
        fut = asyncio.run_coroutine_threadsafe(self._generate_all(prepared, lp, False), self._loop)
        results = await asyncio.wrap_future(fut)
        return results if batched else results[0]

    async def _stream_async(self, job: Job, lp: LogprobRequest) -> AsyncIterator[dict[str, Any]]:
        out = NativeOutput(job.ids, lp, self.tokenizer)
        agen = self._pieces(job, True, lp)
        try:
            while True:
                fut = asyncio.run_coroutine_threadsafe(agen.__anext__(), self._loop)
                try:
                    piece = await asyncio.wrap_future(fut)
                except StopAsyncIteration:
                    return
                yield out.add(piece)
        finally:
            asyncio.run_coroutine_threadsafe(agen.aclose(), self._loop)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text the chat route renders for ``messages`` (OpenAI chat messages)
        without tools: the same function as ``/v1/chat/completions`` and
        ``/apply_chat_template``.  ``continue_final_message`` continues the last (assistant)
        message instead of opening a new one; ``template_kwargs`` are extra template
        variables (e.g. ``enable_thinking=False``).  ValueError for bad messages or a model
        without a chat template."""
        # the pydantic chat models: imported by the first call, not by every engine's start
        from pydantic import ValidationError

        from radixserve.chat.messages import ApplyChatTemplateRequest
        from radixserve.chat.render import render_without_tools, validation_message

        fields: dict[str, Any] = {
            "messages": messages,
            "continue_final_message": continue_final_message,
            "chat_template_kwargs": template_kwargs,
        }
        if not add_generation_prompt:
            fields["add_generation_prompt"] = False
        try:
            body = ApplyChatTemplateRequest.model_validate(fields)
        except ValidationError as e:
            raise ValueError(validation_message(e)) from None
        return render_without_tools(self.tokenizer, self.args.tool_call_parser, body)

    def _prefix_ids(self, prompt: str | None, input_ids: list[int] | None,
                    messages: list[dict[str, Any]] | None) -> list[int]:
        if sum(x is not None for x in (prompt, input_ids, messages)) != 1:
            raise ValueError("give exactly one of prompt, input_ids and messages")
        if messages is not None:
            prompt = self.apply_chat_template(messages, add_generation_prompt=False)
        ids, _ = self.tm.prepare(prompt, input_ids, {"max_new_tokens": 0})
        return ids

    def pin(self, prompt: str | None = None, input_ids: list[int] | None = None,
            messages: list[dict[str, Any]] | None = None, ttl: float | None = None,
            extra_key: str | None = None) -> dict[str, Any]:
        """Keep a prefix in the cache: computed now if it is not cached, then never evicted
        until :meth:`unpin` (or ``ttl`` seconds).  ``messages`` are rendered by the chat
        template without the generation prompt.  Returns ``pin_id``, ``tokens`` (the pinned
        page-aligned length), ``cache_salt``, ``expires_in``; ValueError when the pinned total
        would pass ``max_pinned_fraction`` of the pool."""
        ids = self._prefix_ids(prompt, input_ids, messages)
        return self._call(self.tm.pin(ids, SchedulingHints(extra_key or "", pin_ttl=ttl)))

    def unpin(
        self,
        pin_id: str | None = None,
        prompt: str | None = None,
        input_ids: list[int] | None = None,
        messages: list[dict[str, Any]] | None = None,
        extra_key: str | None = None,
    ) -> list[str]:
        """Drop the pin ``pin_id``, or every pin of exactly this prefix; the dropped pins' ids."""
        if pin_id is not None:
            result = self._call(self.tm.control("unpin", pin_id=pin_id))
        else:
            ids = self._prefix_ids(prompt, input_ids, messages)
            result = self._call(self.tm.control("unpin", input_ids=ids, extra_key=extra_key or ""))
        return list(result["unpinned"])

    def pins(self) -> list[dict[str, Any]]:
        """The live pins: ``pin_id``, ``tokens``, ``cache_salt``, ``expires_in``."""
        return list(self._call(self.tm.control("pins"))["pins"])

    def get_stats(self) -> dict[str, Any]:
        """Scheduler counters: tokens, hit rate, retractions, evictions, step overhead."""
        return self._call(self.tm.control("stats"))

    def check_memory(self) -> dict[str, Any]:
        """The KV memory invariant: free + tree + requests == all pages, no lock when idle."""
        return self._call(self.tm.control("check_memory"))

    def flush_cache(self) -> bool:
        return bool(self._call(self.tm.control("flush_cache"))["success"])

    def start_profile(self) -> None:
        """Run torch.profiler in the scheduler over the steps from now until
        :meth:`stop_profile`."""
        self._control_checked("start_profile")

    def stop_profile(self, timeout: float = PROFILE_STOP_TIMEOUT_S) -> dict[str, Any]:
        """Where the steps since :meth:`start_profile` spent their time: ``steps``, ``step_s``
        and ``attention_s``, ``linear_s``, ``other_s``, ``scheduler_s``, ``sampling_s`` (they
        add up to ``step_s``); see ``radixserve/scheduler/profiling.py``."""
        return self._control_checked("stop_profile", timeout)

    def load_lora_adapter(self, lora_name: str, lora_path: str) -> dict[str, str]:
        """Load the peft adapter folder ``lora_path`` as ``lora_name`` (needs
        ``enable_lora``); the loaded adapters ``{name: folder}``.  ValueError when the folder
        is not an adapter this model can serve or the name is taken."""
        result = self._call(self.tm.control("lora_load", lora_name=lora_name,
                                            lora_path=lora_path))
        if "error" in result:
            raise ValueError(result["error"])
        return dict(result["loaded_adapters"])

    def unload_lora_adapter(self, lora_name: str) -> dict[str, str]:
        """Forget the adapter; ValueError when it is not loaded or requests use it."""
        result = self._call(self.tm.control("lora_unload", lora_name=lora_name))
        if "error" in result:
            raise ValueError(result["error"])
        return dict(result["loaded_adapters"])

    def lora_adapters(self) -> dict[str, Any]:
        """The adapters ``{name: folder}`` and the LoRA settings in effect."""
        return self._call(self.tm.control("loras"))

    def _control_checked(self, command: str, timeout: float = 30.0) -> dict[str, Any]:
        result = self._call(self.tm.control(command, timeout))
        if "error" in result:
            raise RuntimeError(f"{command}: {result['error']}")
        return result

    def shutdown(self) -> None:
        if self._loop is not None and self._loop.is_running():
            try:
                close = self.client.close("the engine is shut down")
                asyncio.run_coroutine_threadsafe(close, self._loop).result(5)
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
        if (
            getattr(self, "_loop", None) is not None
            or getattr(self, "procs", None) and self.procs.procs
        ):
            self.shutdown()


__all__ = ["Engine", "RequestError"]
