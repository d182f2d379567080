"""Reasoning parsers: split ``<think> ... </think>`` off the start of an output.

- ``qwen3``: the reasoning block is there when the output starts with ``<think>``, or when
  the prompt already opened it (the chat template ended the prompt with ``<think>``).  With
  ``chat_template_kwargs={"enable_thinking": false}`` no reasoning is expected.
- ``deepseek-r1``: the output is reasoning from its start until ``</think>`` (a leading
  ``<think>`` is optional); without ``</think>`` all of it is reasoning.

The reasoning text is stripped of surrounding whitespace and the content of its leading
whitespace; the streaming splitter holds back any text that might be part of a tag, so it
never emits a partial ``<think>`` or ``</think>``.
"""

from __future__ import annotations

from radixserve.chat.parsers.base import ContentDelta, Delta, ReasoningDelta, marker_overlap

THINK_START = "<think>"
THINK_END = "</think>"
REASONING_PARSERS = ("qwen3", "deepseek-r1")


def prompt_opens_reasoning(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an opened ``<think>`` block."""
    return prompt.rstrip().endswith(THINK_START)


class ReasoningStream:
    """Text deltas in, :class:`ReasoningDelta` / :class:`ContentDelta` pieces out."""

    def __init__(self, parser: str, *, prompt_opened: bool = False, thinking: bool = True) -> None:
        if parser not in REASONING_PARSERS:
            raise ValueError(
                f"unknown reasoning parser {parser!r}; choose from {REASONING_PARSERS}"
            )
        if parser == "deepseek-r1":
            self._state = "optional_start"
        elif not thinking:
            self._state = "content"
        else:
            self._state = "reasoning" if prompt_opened else "detect"
        self._buf = ""
        self._held_ws = ""  # trailing whitespace of the reasoning, dropped at </think>
        self._reasoning_started = False
        self._out: list[Delta] = []

    def feed(self, text: str) -> list[Delta]:
        self._buf += text
        self._run(final=False)
        return self._take()

    def finish(self) -> list[Delta]:
        self._run(final=True)
        return self._take()

    def _take(self) -> list[Delta]:
        out, self._out = self._out, []
        return out

    def _emit(self, kind: type[ContentDelta] | type[ReasoningDelta], text: str) -> None:
        if not text:
            return
        last = self._out[-1] if self._out else None
        if isinstance(last, kind):
            self._out[-1] = kind(last.text + text)
        else:
            self._out.append(kind(text))

    def _reasoning(self, text: str) -> None:
        if not self._reasoning_started:
            text = text.lstrip()
            self._reasoning_started = bool(text)
        full = self._held_ws + text
        body = full.rstrip()
        self._emit(ReasoningDelta, body)
        self._held_ws = full[len(body):]

    def _run(self, final: bool) -> None:
        while getattr(self, "_on_" + self._state.replace("-", "_"))(final):
            pass

    def _starts_with_tag(self, final: bool) -> bool | None:
        """True/False once known whether the output opens with <think>; None: wait."""
        stripped = self._buf.lstrip()
        if stripped.startswith(THINK_START):
            self._buf = stripped[len(THINK_START):]
            return True
        if not final and THINK_START.startswith(stripped):
            return None
        return False

    def _on_detect(self, final: bool) -> bool:
        opens = self._starts_with_tag(final)
        if opens is None:
            return False
        self._state = "reasoning" if opens else "content"
        return True

    def _on_optional_start(self, final: bool) -> bool:
        if self._starts_with_tag(final) is None:
            return False
        self._state = "reasoning"
        return True

    def _on_reasoning(self, final: bool) -> bool:
        idx = self._buf.find(THINK_END)
        if idx >= 0:
            self._reasoning(self._buf[:idx])
            self._held_ws = ""
            self._buf = self._buf[idx + len(THINK_END):]
            self._state = "content_start"
            return True
        keep = 0 if final else marker_overlap(self._buf, THINK_END)
        self._reasoning(self._buf[:len(self._buf) - keep])
        self._buf = self._buf[len(self._buf) - keep:]
        return False

    def _on_content_start(self, final: bool) -> bool:
        stripped = self._buf.lstrip()
        self._buf = stripped
        if not stripped:
            return False
        self._state = "content"
        return True

    def _on_content(self, final: bool) -> bool:
        self._emit(ContentDelta, self._buf)
        self._buf = ""
        return False


def split_reasoning(text: str, parser: str, *, prompt_opened: bool = False,
                    thinking: bool = True) -> tuple[str | None, str]:
    """Non-streaming: ``(reasoning_content, content)``; reasoning None when there was none."""
    stream = ReasoningStream(parser, prompt_opened=prompt_opened, thinking=thinking)
    pieces = stream.feed(text) + stream.finish()
    reasoning = "".join(p.text for p in pieces if isinstance(p, ReasoningDelta))
    content = "".join(p.text for p in pieces if isinstance(p, ContentDelta))
    return reasoning or None, content
