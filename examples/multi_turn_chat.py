"""A multi-turn chat whose later turns reuse the earlier ones from the radix cache.

What it shows: a chat client resends the whole conversation every turn (system prompt, every
earlier question and answer, the new question). radixserve keeps the KV cache of the previous
turn's prompt and answer in its radix tree, so each turn computes only what is new: watch
``cached`` grow with the history while ``new`` stays small. Answers stream as they are made.

    radixserve serve &
    python examples/multi_turn_chat.py
    python examples/multi_turn_chat.py --base-url http://127.0.0.1:8000 --max-tokens 16
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from openai import OpenAI

SYSTEM = ("You are a patient history teacher. Answer in two or three sentences, and connect each "
          "answer to what was said earlier in the conversation when you can.")
QUESTIONS = [
    "Who built the first lighthouses, and why?",
    "How were they lit before electricity?",
    "What changed when the Fresnel lens was invented?",
    "Why are so few lighthouses staffed today?",
    "Summarise our whole conversation in one sentence.",
]


def run(base_url: str, max_tokens: int, model: str | None = None, turns: int = len(QUESTIONS)) -> list[dict[str, Any]]:
    """Chat for ``turns`` turns; one record per turn (prompt, cached and new tokens, answer)."""
    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none")
    model = model or client.models.list().data[0].id
    messages = [{"role": "system", "content": SYSTEM}]
    records = []
    for turn, question in enumerate(QUESTIONS[:turns], 1):
        messages.append({"role": "user", "content": question})
        print(f"\n[{turn}] user: {question}\n[{turn}] assistant: ", end="", flush=True)
        stream = client.chat.completions.create(
            model=model, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
            stream_options={"include_usage": True},
        )
        parts, usage = [], None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                parts.append(chunk.choices[0].delta.content)
                sys.stdout.write(parts[-1])
                sys.stdout.flush()
            if chunk.usage:
                usage = chunk.usage
        answer = "".join(parts)
        messages.append({"role": "assistant", "content": answer})
        prompt = usage.prompt_tokens if usage else 0
        details = usage.prompt_tokens_details if usage else None
        cached = (details.cached_tokens or 0) if details else 0
        print(f"\n    prompt {prompt} tokens: cached {cached}, new {prompt - cached}")
        records.append({"turn": turn, "prompt_tokens": prompt, "cached_tokens": cached, "answer": answer})
    return records


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--max-tokens", type=int, default=96, help="tokens per answer")
    p.add_argument("--turns", type=int, default=len(QUESTIONS), help=f"turns, at most {len(QUESTIONS)}")
    args = p.parse_args(argv)
    return run(args.base_url, args.max_tokens, args.model, args.turns)


if __name__ == "__main__":
    main()
