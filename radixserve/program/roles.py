"""Chat roles in a program's text, rendered with the model's own chat template.

A program's ``system(...)`` / ``user(...)`` / ``assistant(...)`` must produce exactly the text
the chat API would send for the same messages, so that a program and a chat client share
cached prefixes.  The template renders whole conversations, so each message's text is the
difference between the rendering with it and the rendering without it:

- a message whose content is plain text: ``render(messages + [m])`` minus ``render(messages)``;
- a message that generates (``assistant(gen(...))``): the opening is what the chat API sends to
  ask for a reply (``render(messages, add_generation_prompt=True)`` minus ``render(messages)``);
  for other roles it is read from a rendering with a placeholder content; the closing comes
  from that placeholder rendering, after the placeholder.

A template that rewrites earlier messages when a new one is added (so the renderings are not
prefixes of each other) cannot be rendered message by message: that is a ``ValueError``.
"""

from __future__ import annotations

import json
import threading
from typing import Any

from radixserve.program.backends import Backend

_PLACEHOLDER = "\u2063PROGRAM-CONTENT\u2063"
_CACHE_SIZE = 4096


class ChatRenderer:
    """Renders through the backend, remembering results (programs repeat conversations)."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self._cache: dict[str, str] = {}
        self._lock = threading.Lock()

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        if not messages and not add_generation_prompt:
            return ""
        key = json.dumps([messages, add_generation_prompt], sort_keys=True)
        with self._lock:
            hit = self._cache.get(key)
        if hit is not None:
            return hit
        text = self.backend.render_chat(messages, add_generation_prompt)
        with self._lock:
            if len(self._cache) >= _CACHE_SIZE:
                self._cache.clear()
            self._cache[key] = text
        return text

    def delta(self, before: str, after: str, what: str) -> str:
        if not after.startswith(before):
            raise ValueError(
                f"the model's chat template renders {what} by rewriting the earlier messages, so a "
                "program cannot append it message by message; write the prompt as text instead"
            )
        return after[len(before):]

    def message_text(self, messages: list[dict[str, Any]], role: str, content: str) -> str:
        """The text one plain message adds after ``messages``."""
        before = self.render(messages)
        return self.delta(before, self.render([*messages, {"role": role, "content": content}]),
                          f"a {role} message")

    def open_close(self, messages: list[dict[str, Any]], role: str) -> tuple[str, str]:
        """The text before and after the content of a message that generates."""
        before = self.render(messages)
        probe = self.delta(before,
                           self.render([*messages, {"role": role, "content": _PLACEHOLDER}]),
                           f"a {role} message")
        at = probe.find(_PLACEHOLDER)
        if at < 0:
            raise ValueError(f"the model's chat template does not show a {role} message's "
                             "content as given")
        opening, closing = probe[:at], probe[at + len(_PLACEHOLDER):]
        if role == "assistant":
            opening = self.delta(before, self.render(messages, add_generation_prompt=True),
                                 "a reply prompt")
        return opening, closing
