"""``radixserve chat``: a terminal chat against a running server or a local engine."""

from __future__ import annotations

import json
import sys
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any


def _loop(reply: Callable[[list[dict[str, str]]], Iterator[str]], system: str | None) -> int:
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    print("radixserve chat: type a message, /reset to start over, /exit or Ctrl-D to quit.")
    while True:
        try:
            line = input("> ").strip()
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if not line:
            continue
        if line == "/exit":
            return 0
        if line == "/reset":
            history = history[:1] if system else []
            continue
        history.append({"role": "user", "content": line})
        parts = []
        for piece in reply(history):
            parts.append(piece)
            sys.stdout.write(piece)
            sys.stdout.flush()
        sys.stdout.write("\n")
        history.append({"role": "assistant", "content": "".join(parts)})


def chat_remote(
    base_url: str, max_tokens: int, temperature: float, system: str | None, api_key: str | None
) -> int:
    url = base_url.rstrip("/") + "/v1/chat/completions"

    def reply(history: list[dict[str, str]]) -> Iterator[str]:
        body = json.dumps({"messages": history, "stream": True, "max_tokens": max_tokens,
                           "temperature": temperature}).encode()
        headers = {"Content-Type": "application/json"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        req = urllib.request.Request(url, data=body, headers=headers)
        with urllib.request.urlopen(req) as resp:
            for raw in resp:
                line = raw.decode().strip()
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[6:]).get("choices", []):
                    yield choice.get("delta", {}).get("content") or ""

    return _loop(reply, system)


def chat_local(
    settings: dict[str, Any], max_tokens: int, temperature: float, system: str | None
) -> int:
    from radixserve.engine import Engine

    model = settings.pop("model")
    with Engine(model, **settings) as engine:
        tok = engine.tokenizer

        def reply(history: list[dict[str, str]]) -> Iterator[str]:
            prompt = tok.apply_chat_template(history, tokenize=False, add_generation_prompt=True)
            params = {"max_new_tokens": max_tokens, "temperature": temperature}
            for piece in engine.generate(prompt, params, stream=True):
                yield piece["text"]

        return _loop(reply, system)
