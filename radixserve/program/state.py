"""A running program's state: its text, messages and variables, and the thread that extends it.

``s += expr`` queues ``expr`` and returns at once; the state's own thread executes queued
expressions in order (requests to the backend, text appended).  That is what lets forks run
concurrently: ``for f in s.fork(3): f += gen(...)`` queues one generation on each of three
states, and their requests reach the scheduler together.  Reading (``s["x"]``, ``s.text()``)
waits until everything queued before has run, and raises the error of a failed step there,
in the program's code.  After a step fails, the state's later steps are skipped.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import Any

from radixserve.program.backends import Backend
from radixserve.program.ir import Concat, Expr, Gen, Role, Select, Text, as_exprs
from radixserve.program.roles import ChatRenderer
from radixserve.program.select import choice_meta, score_choices

_END = object()  # queued last by a streaming run: the program has no more steps


class Run:
    """What the states of one program run share: backend, defaults, every state created."""

    def __init__(
        self, backend: Backend, defaults: dict[str, Any], stream: bool, renderer: ChatRenderer
    ) -> None:
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.renderer = renderer
        self.states: list[ProgramState] = []
        self._lock = threading.Lock()

    def add(self, state: ProgramState) -> None:
        with self._lock:
            self.states.append(state)

    def finish(self) -> BaseException | None:
        """Wait for every state (forks included) and stop their threads; the first error."""
        error: BaseException | None = None
        for st in list(self.states):
            st._wait()
            st._close()
            error = error or st.error
        return error

    def close(self) -> None:
        for st in list(self.states):
            st._close()


class ProgramState:
    """``s`` in ``def program(s, ...)``."""

    def __init__(self, run: Run, text: str = "", messages: list[dict[str, Any]] | None = None,
                 variables: dict[str, Any] | None = None,
                 meta: dict[str, Any] | None = None) -> None:
        self._run = run
        self._text = text
        self._messages = list(messages or [])
        self._vars = dict(variables or {})
        self._meta = dict(meta or {})
        self.fork_start = len(text)
        self.error: BaseException | None = None
        self._queue: queue.Queue = queue.Queue()
        self._pending = 0
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._role: list[str] | None = None  # the content of the message being generated
        # Streaming: every appended piece as (variable or None, text), in order.
        self._pieces: list[tuple[str | None, str]] = []
        self._done_vars: set[str] = set()
        self._ended = False
        run.add(self)

    # ---- building the program ------------------------------------------------------------
    def __iadd__(self, other: Any) -> ProgramState:
        self._submit(as_exprs(other))
        return self

    def _submit(self, item: Any) -> None:
        with self._cv:
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="radixserve-program",
                                                daemon=True)
                self._thread.start()
            self._pending += 1
        self._queue.put(item)

    def fork(self, n: int = 1) -> ProgramStateGroup:
        """``n`` states that continue from this one's text; their steps run concurrently.  With
        ``n > 1`` the text so far is computed once first, so every branch is served it from
        the radix cache instead of each computing it."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"fork takes a number of branches >= 1, got {n!r}")
        self._sync()
        if n > 1 and self._text:
            self._run.backend.generate(self._text, {"max_new_tokens": 0})
        forks = []
        for _ in range(n):
            forks.append(ProgramState(self._run, self._text, self._messages, self._vars,
                                      self._meta))
        return ProgramStateGroup(forks, self)

    # ---- reading -------------------------------------------------------------------------
    def _wait(self) -> None:
        with self._cv:
            self._cv.wait_for(lambda: self._pending == 0)

    def _sync(self) -> None:
        self._wait()
        if self.error is not None:
            raise self.error

    def __getitem__(self, name: str) -> Any:
        self._sync()
        if name not in self._vars:
            raise ValueError(f"the program has no variable {name!r}; it has {sorted(self._vars)}")
        return self._vars[name]

    def __contains__(self, name: str) -> bool:
        self._sync()
        return name in self._vars

    def get_var(self, name: str) -> Any:
        return self[name]

    def get_meta_info(self, name: str) -> dict[str, Any]:
        """The ``meta_info`` of the request behind variable ``name`` (for a select: every
        choice's scores)."""
        self[name]  # noqa: B018 - waits and checks the name
        return self._meta[name]

    def variables(self) -> dict[str, Any]:
        self._sync()
        return dict(self._vars)

    def text(self) -> str:
        self._sync()
        return self._text

    def messages(self) -> list[dict[str, Any]]:
        self._sync()
        return [dict(m) for m in self._messages]

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Yield the text as it is appended (only variable ``var_name``'s, if given) until the
        program ends (or that variable is complete); a failed step raises here."""
        seen = 0

        def ready() -> bool:
            return (seen < len(self._pieces) or self._ended or self.error is not None
                    or var_name in self._done_vars)

        while True:
            with self._cv:
                self._cv.wait_for(ready)
                pieces = self._pieces[seen:]
                seen = len(self._pieces)
                stop = self._ended or self.error is not None or var_name in self._done_vars
            for var, piece in pieces:
                if var_name is None or var == var_name:
                    yield piece
            if stop:
                if self.error is not None:
                    raise self.error
                return

    def __repr__(self) -> str:
        return f"ProgramState(text={self._text[-40:]!r}, variables={sorted(self._vars)})"

    # ---- the state's thread ----------------------------------------------------------------
    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            try:
                if item is _END:
                    with self._cv:
                        self._ended = True
                    # Every step of the run is queued by now: threads stop once theirs are done.
                    self._run.close()
                elif self.error is None:
                    for expr in item:
                        self._execute(expr)
            except BaseException as e:  # raised where the program reads the state
                self.error = e
            finally:
                with self._cv:
                    self._pending -= 1
                    self._cv.notify_all()

    def _end_stream(self) -> None:
        self._submit(_END)

    def _close(self) -> None:
        with self._cv:
            if self._thread is not None:
                self._queue.put(None)
                self._thread = None

    def _append(self, text: str, var: str | None = None) -> None:
        if not text:
            return
        with self._cv:
            self._text += text
            if self._role is not None:
                self._role.append(text)
            self._pieces.append((var, text))
            self._cv.notify_all()

    def _execute(self, expr: Expr) -> None:
        if isinstance(expr, Text):
            self._append(expr.value)
        elif isinstance(expr, Gen):
            self._gen(expr)
        elif isinstance(expr, Select):
            result = score_choices(self._run.backend, self._text, expr.choices, expr.method)
            self._append(result.decision, expr.name)
            self._store(expr.name, result.decision, choice_meta(result))
        elif isinstance(expr, Role):
            self._role_message(expr)
        elif isinstance(expr, Concat):
            for part in expr.parts:
                self._execute(part)
        else:  # as_exprs admits nothing else
            raise ValueError(f"cannot execute {expr!r}")

    def _store(self, name: str | None, value: Any, meta: dict[str, Any]) -> None:
        with self._cv:
            if name is not None:
                self._vars[name] = value
                self._meta[name] = meta
                self._done_vars.add(name)
            self._cv.notify_all()

    def _gen(self, g: Gen) -> None:
        sampling = {**self._run.defaults, **g.sampling}
        logprob: dict[str, Any] = {}
        if g.return_logprob:
            logprob = {"return_logprob": True, "top_logprobs_num": g.top_logprobs_num,
                       "logprob_start_len": g.logprob_start_len,
                       "return_text_in_logprobs": g.return_text_in_logprobs}
        backend = self._run.backend
        if not self._run.stream:
            out = backend.generate(self._text, sampling, **logprob)
            self._append(out["text"], g.name)
            self._store(g.name, out["text"], out["meta_info"])
            return
        parts: list[str] = []
        last: dict[str, Any] = {}
        for piece, meta in backend.stream(self._text, sampling, **logprob):
            parts.append(piece)
            last = meta
            self._append(piece, g.name)
        self._store(g.name, "".join(parts), last)

    def _role_message(self, r: Role) -> None:
        if self._role is not None:
            raise ValueError("a chat message cannot contain another")
        renderer = self._run.renderer
        if all(isinstance(p, Text) for p in r.content):
            content = "".join(p.value for p in r.content)  # type: ignore[attr-defined]
            self._append(renderer.message_text(self._messages, r.role, content))
        else:
            opening, closing = renderer.open_close(self._messages, r.role)
            self._append(opening)
            self._role = []
            try:
                for part in r.content:
                    self._execute(part)
                content = "".join(self._role)
            finally:
                self._role = None
            self._append(closing)
        with self._cv:
            self._messages.append({"role": r.role, "content": content})


class ProgramStateGroup(list):
    """The states :meth:`ProgramState.fork` returns."""

    def __init__(self, forks: list[ProgramState], parent: ProgramState) -> None:
        super().__init__(forks)
        self.parent = parent

    def join(self, mode: str = "gather_variable") -> None:
        """Wait for every branch.  ``mode="concate_and_append"`` also appends each branch's
        new text to the parent, in order."""
        if mode not in ("gather_variable", "concate_and_append"):
            raise ValueError(
                f"join mode must be gather_variable or concate_and_append, got {mode!r}"
            )
        for f in self:
            f._sync()
        if mode == "concate_and_append":
            self.parent += "".join(f._text[f.fork_start:] for f in self)
