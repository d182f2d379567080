"""The incremental tool-call parser: text deltas in, content and tool-call pieces out.

One state machine serves every format of ``tool_formats``.  It emits a call as soon as its
header (``{"name": "f", "arguments": {``) is certain, then the arguments text as it arrives,
so the client sees the same fragments whatever the chunking.  Text that only might start a
marker is held back until it is known; text that turns out not to be a call is content.
The non-streaming parser is this one fed everything at once (:func:`parse_tool_calls`).

States:
  lead       (llama3) before the first non-space character: "{" starts calls, else text
  text       content, looking for the start marker
  open_list  after the marker, expecting the list bracket (mistral)
  head       matching a call header
  args       inside the arguments object (streamed as fragments)
  obj_tail   rest of the call object after the arguments (skipped)
  sep        after a call: a separator starts the next call, anything else is text
  skip_end   after a hermes call's arguments: skipped up to the end marker
  fallback   a run that did not start like a header: kept whole, then parsed as JSON
             (calls with their keys in another order) or else given back as content
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from radixserve.chat.parsers.base import (
    ContentDelta,
    Delta,
    ParsedMessage,
    ToolArgsDelta,
    ToolCallParsed,
    ToolCallStart,
    assemble,
    marker_overlap,
    new_call_id,
)
from radixserve.chat.parsers.json_scan import (
    JsonDepth,
    Match,
    calls_from_json_text,
    match_call_head,
)
from radixserve.chat.parsers.tool_formats import ToolFormat


class ToolCallStream:
    def __init__(self, fmt: ToolFormat, tool_names: Iterable[str] | None = None,
                 max_calls: int | None = None, new_id: Callable[[], str] = new_call_id) -> None:
        self.fmt = fmt
        self.names = frozenset(tool_names) if tool_names is not None else None
        self.max_calls = max_calls
        self._new_id = new_id
        self._state = "lead" if fmt.calls_at_start else "text"
        self._buf = ""  # text received and not yet consumed by the current state
        self._raw = ""  # the current run's text since its marker, while it may fall back
        self._depth = JsonDepth(0)
        self._count = 0  # calls recognised (those past max_calls are muted)
        self._muted = False
        self._out: list[Delta] = []
        self._content_started = False
        self._pending_ws = ""  # leading whitespace of the content, dropped if nothing follows
        self._done = False

    # ---- public ------------------------------------------------------------------------
    def feed(self, text: str) -> list[Delta]:
        if self._done:
            raise ValueError("feed() after finish()")
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        """The end of the output: flush what was held back."""
        if not self._done:
            self._run(final=True)
            self._flush_end()
            self._done = True
        return self._take()

    # ---- emission ----------------------------------------------------------------------
    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _emit(self, piece: Delta) -> None:
        last = self._out[-1] if self._out else None
        if isinstance(piece, ContentDelta) and isinstance(last, ContentDelta):
            self._out[-1] = ContentDelta(last.text + piece.text)
        elif (
            isinstance(piece, ToolArgsDelta)
            and isinstance(last, ToolArgsDelta)
            and last.index == piece.index
        ):
            self._out[-1] = ToolArgsDelta(piece.index, last.text + piece.text)
        else:
            self._out.append(piece)

    def _content(self, text: str) -> None:
        if not text:
            return
        if not self._content_started:
            if not text.strip():
                self._pending_ws += text
                return
            text, self._pending_ws, self._content_started = self._pending_ws + text, "", True
        self._emit(ContentDelta(text))

    def _start_call(self, name: str) -> None:
        self._muted = self.max_calls is not None and self._count >= self.max_calls
        if not self._muted:
            self._emit(ToolCallStart(self._count, self._new_id(), name))
        self._count += 1

    def _args(self, text: str) -> None:
        if text and not self._muted:
            self._emit(ToolArgsDelta(self._count - 1, text))

    def _whole_calls(self, calls: list[ToolCallParsed]) -> None:
        for call in calls:
            self._start_call(call.name)
            self._args(call.arguments)

    # ---- the state machine -------------------------------------------------------------
    def _run(self, final: bool) -> None:
        while getattr(self, "_on_" + self._state)(final):
            pass

    def _on_lead(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            if final:
                self._content(self._buf)
                self._buf = ""
            return False
        if stripped[0] == "{":
            self._buf, self._raw, self._state = stripped, "", "head"
        else:
            self._state = "text"
        return True

    def _on_text(self, final: bool) -> bool:
        start = self.fmt.start
        idx = self._buf.find(start)
        if idx >= 0:
            self._content(self._buf[:idx])
            self._buf = self._buf[idx + len(start):]
            self._raw = start
            self._state = "open_list" if self.fmt.list_open else "head"
            return True
        keep = 0 if final else marker_overlap(self._buf, start)
        self._content(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _on_open_list(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            return False
        if stripped[0] == self.fmt.list_open:
            consumed = len(self._buf) - len(stripped) + 1
            self._raw += self._buf[:consumed]
            self._buf = self._buf[consumed:]
            self._state = "head"
        else:
            self._state = "fallback"
        return True

    def _on_head(self, final: bool) -> bool:
        m = match_call_head(self._buf, self.fmt.arg_keys)
        if m.status is Match.PARTIAL:
            return False
        if m.status is Match.FAIL or (self.names is not None and m.name not in self.names):
            self._state = "fallback"
            return True
        self._start_call(m.name)
        self._args("{")
        self._buf, self._raw = self._buf[m.end:], ""
        self._depth = JsonDepth(1)
        self._state = "args"
        return True

    def _on_args(self, final: bool) -> bool:
        n = self._depth.feed(self._buf)
        self._args(self._buf[:n])
        self._buf = self._buf[n:]
        if not self._depth.closed:
            return False
        self._depth = JsonDepth(1)  # the call object around the arguments
        self._state = "skip_end" if self.fmt.end else "obj_tail"
        return True

    def _on_obj_tail(self, final: bool) -> bool:
        n = self._depth.feed(self._buf)
        self._buf = self._buf[n:]
        if not self._depth.closed:
            return False
        self._state = "sep"
        return True

    def _on_sep(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        if not stripped:
            self._buf = ""
            return False
        c = stripped[0]
        if c == self.fmt.separator:
            self._buf, self._raw, self._state = stripped[1:], "", "head"
        elif self.fmt.list_close and c == self.fmt.list_close:
            self._buf, self._state = stripped[1:], "text"
        else:
            self._buf, self._state = stripped, "text"
        return True

    def _on_skip_end(self, final: bool) -> bool:
        end = self.fmt.end or ""
        idx = self._buf.find(end)
        if idx >= 0:
            self._buf, self._state = self._buf[idx + len(end):], "text"
            return True
        keep = marker_overlap(self._buf, end)
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _on_fallback(self, final: bool) -> bool:
        self._raw += self._buf
        self._buf = ""
        end = self.fmt.end
        if end is None:
            return False  # decided at finish()
        idx = self._raw.find(end, len(self.fmt.start))
        if idx < 0:
            return False
        block, rest = self._raw[:idx + len(end)], self._raw[idx + len(end):]
        calls = calls_from_json_text(
            self._raw[len(self.fmt.start) : idx], self.fmt.arg_keys, self.names
        )
        if calls is None:
            self._content(block)
        else:
            self._whole_calls(calls)
        self._buf, self._raw, self._state = rest, "", "text"
        return True

    def _flush_end(self) -> None:
        if self._state in ("open_list", "head", "fallback"):
            raw = self._raw + self._buf
            body = raw[len(self.fmt.start):] if raw.startswith(self.fmt.start) else raw
            calls = (
                None if self.fmt.end else calls_from_json_text(body, self.fmt.arg_keys, self.names)
            )
            if calls is None:
                self._content(raw)
            else:
                self._whole_calls(calls)
        self._buf = self._raw = ""


def parse_tool_calls(text: str, fmt: ToolFormat, tool_names: Iterable[str] | None = None,
                     max_calls: int | None = None) -> tuple[str | None, list[ToolCallParsed]]:
    """Non-streaming: ``(content, calls)`` of a whole output (content None when empty)."""
    stream = ToolCallStream(fmt, tool_names, max_calls)
    msg: ParsedMessage = assemble(stream.feed(text) + stream.finish())
    return msg.content, msg.calls
