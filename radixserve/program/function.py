"""``@function``: a Python function over a program state, run once or over a batch.

    @function
    def qa(s, question):
        s += user(question)
        s += assistant(gen("answer", max_tokens=64))

    state = qa.run(question="Why is the sky blue?", backend=engine)
    print(state["answer"])

``run`` executes the function in the caller's thread (its ``+=`` steps run on the state's
own thread, see :mod:`radixserve.program.state`) and returns when every step of the state
and of its forks is done; ``stream=True`` returns at once, and ``state.text_iter()`` follows.
``run_batch`` runs many programs on a thread pool: their requests reach the scheduler
together, which computes a prefix they share once (it defers a request whose uncached prefix
another request of the same step is computing, then serves it from the radix cache).
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from radixserve.program.backends import Backend, as_backend
from radixserve.program.roles import ChatRenderer
from radixserve.program.state import ProgramState, Run

logger = logging.getLogger(__name__)
MAX_AUTO_THREADS = 128

_default_backend: Backend | None = None


def set_default_backend(backend: Any) -> None:
    """The backend of runs that name none: an ``Engine``, a server URL, or a ``Backend``."""
    global _default_backend
    _default_backend = as_backend(backend)


def _backend(backend: Any) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(engine or URL)")
    return _default_backend


def _renderer(backend: Backend) -> ChatRenderer:
    """One per backend, so runs share rendered conversations."""
    found = getattr(backend, "_chat_renderer", None)
    if found is None:
        found = backend._chat_renderer = ChatRenderer(backend)  # type: ignore[attr-defined]
    return found


# The sampling keywords of run / run_batch: defaults for every gen that does not set its own.
SAMPLING_DEFAULTS = ("max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop",
                     "frequency_penalty", "presence_penalty", "ignore_eos", "seed")


def _defaults(**sampling: Any) -> dict[str, Any]:
    return {k: v for k, v in sampling.items() if v is not None}


class Program:
    """What ``@function`` makes of ``def f(s, ...)``."""

    def __init__(self, fn: Callable[..., Any]) -> None:
        params = list(inspect.signature(fn).parameters)
        if not params:
            raise ValueError(
                f"a program function takes the state as its first argument: {fn.__name__}()"
            )
        self.fn = fn
        self.__name__ = fn.__name__
        self.__doc__ = fn.__doc__

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def run(
        self,
        *args: Any,
        backend: Any = None,
        stream: bool = False,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        min_p: float | None = None,
        stop: str | list[str] | None = None,
        frequency_penalty: float | None = None,
        presence_penalty: float | None = None,
        ignore_eos: bool | None = None,
        seed: int | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Run the program with ``args`` / ``kwargs``; the sampling keywords are defaults for
        every ``gen`` that does not set its own."""
        defaults = _defaults(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                             top_k=top_k, min_p=min_p, stop=stop,
                             frequency_penalty=frequency_penalty,
                             presence_penalty=presence_penalty, ignore_eos=ignore_eos, seed=seed)
        return self._run(_backend(backend), defaults, stream, args, kwargs)

    def _run(self, backend: Backend, defaults: dict[str, Any], stream: bool, args: tuple[Any, ...],
             kwargs: dict[str, Any], raise_errors: bool = True) -> ProgramState:
        run = Run(backend, defaults, stream, _renderer(backend))
        state = ProgramState(run)
        try:
            self.fn(state, *args, **kwargs)
        except BaseException:
            run.close()
            raise
        if stream:
            state._end_stream()
            return state
        error = run.finish()
        if error is not None:
            if raise_errors:
                raise error
            state.error = state.error or error  # a fork's error is the program's
        return state

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]],
        *,
        backend: Any = None,
        num_threads: int | str = "auto",
        progress_bar: bool = False,
        **sampling: Any,
    ) -> list[ProgramState]:
        """Run the program once per kwargs dict, concurrently; states in input order.  A
        program that fails leaves its error in ``state.error`` (and raises it when read); the
        others finish."""
        if not isinstance(batch_kwargs, list) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise ValueError("run_batch takes a list of keyword-argument dicts")
        if not batch_kwargs:
            return []
        be = _backend(backend)
        unknown = set(sampling) - set(SAMPLING_DEFAULTS)
        if unknown:
            raise ValueError(f"run_batch got unknown sampling arguments {sorted(unknown)}")
        defaults = _defaults(**sampling)
        threads = (min(len(batch_kwargs), MAX_AUTO_THREADS) if num_threads == "auto"
                   else int(num_threads))
        if threads < 1:
            raise ValueError(f"num_threads must be >= 1 or 'auto', got {num_threads!r}")

        def one(kwargs: dict[str, Any]) -> ProgramState:
            try:
                return self._run(be, defaults, False, (), kwargs, raise_errors=False)
            except Exception as e:  # the function itself raised: reported in that item's state
                logger.warning("program %s failed: %s", self.__name__, e)
                failed = ProgramState(Run(be, defaults, False, _renderer(be)))
                failed.error = e
                return failed

        bar = None
        if progress_bar:
            from tqdm import tqdm

            bar = tqdm(total=len(batch_kwargs), desc=self.__name__, unit="program")
        with ThreadPoolExecutor(threads, thread_name_prefix="radixserve-batch") as pool:
            futures = [pool.submit(one, kw) for kw in batch_kwargs]
            if bar is not None:
                for fut in futures:
                    fut.add_done_callback(lambda _: bar.update(1))
            states = [f.result() for f in futures]
        if bar is not None:
            bar.close()
        return states


def function(fn: Callable[..., Any]) -> Program:
    """Decorate ``def f(s, ...)`` to make it a program (``f.run``, ``f.run_batch``)."""
    return Program(fn)
