"""A multi-step generation pipeline whose steps share a prefix (fork and join).

What it shows: a structured-generation program reads one document, extracts its key facts,
then forks into parallel branches (title, summary, quiz question) that all continue from the
same conversation, and joins their outputs in a last step. Every step's prompt starts with the
document and the facts step, so radixserve computes that prefix once and serves it from the
radix cache to every branch and to the join: each step prints how many of its prompt tokens
were cached.

    radixserve serve &
    python examples/pipeline.py
    python examples/pipeline.py --base-url http://127.0.0.1:8000 --max-tokens 24
"""

from __future__ import annotations

import argparse
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from openai import OpenAI

DOCUMENT = """Lighthouses have guided sailors for more than two thousand years. The Pharos of \
Alexandria, finished around 280 BC, was one of the tallest buildings of the ancient world; a fire \
burned at its top at night, and polished metal mirrors are said to have reflected the sun by day. \
For centuries afterwards, most lights were open fires or candles, and a keeper's life was spent \
carrying fuel up narrow stairs and cleaning soot from the windows.

The great change came in 1822, when the French physicist Augustin Fresnel designed a lens made of \
concentric rings of glass prisms. It bent the scattered light of a single lamp into one strong \
beam that could be seen more than twenty miles away, while using far less oil. Within a few \
decades Fresnel lenses had been fitted to lighthouses on every continent.

In the twentieth century electric lamps, automatic timers and radio beacons made the keeper's \
work unnecessary, and one light after another was automated. Satellite navigation has since \
reduced the role of lighthouses further, yet many are still maintained, both as a backup for \
ships whose electronics fail and as monuments that coastal towns are proud of."""

SYSTEM = "You are a careful editor. Answer briefly and only from the document you are given."
FACTS_TASK = "List the three most important facts of this document, one line each."
BRANCHES = {
    "title": "Write a title for the document, at most eight words.",
    "summary": "Summarise the document in two sentences.",
    "question": "Write one quiz question about the document, with its answer.",
}
JOIN_TASK = "Combine these into a short newsletter entry:\n\n{parts}"


def run(base_url: str, max_tokens: int, model: str | None = None) -> list[dict[str, Any]]:
    """facts -> parallel branches -> join; one record per step (tokens, cached tokens, text)."""
    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none")
    model = model or client.models.list().data[0].id
    records: list[dict[str, Any]] = []

    def step(name: str, messages: list[dict[str, str]]) -> str:
        r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                           temperature=0)
        details = r.usage.prompt_tokens_details
        cached = (details.cached_tokens or 0) if details else 0
        text = r.choices[0].message.content or ""
        records.append({"step": name, "prompt_tokens": r.usage.prompt_tokens, "cached_tokens": cached,
                        "text": text})
        print(f"{name:<9} prompt {r.usage.prompt_tokens:>4}  cached {cached:>4}  {text.strip()[:60]!r}")
        return text

    # The shared prefix: system prompt, the document, the facts step and its answer.
    prefix = [{"role": "system", "content": SYSTEM},
              {"role": "user", "content": f"{DOCUMENT}\n\n{FACTS_TASK}"}]
    facts = step("facts", prefix)
    prefix = prefix + [{"role": "assistant", "content": facts}]

    # Fork: the branches run at once, each continuing from the same prefix.
    with ThreadPoolExecutor(len(BRANCHES)) as pool:
        futures = {name: pool.submit(step, name, prefix + [{"role": "user", "content": task}])
                   for name, task in BRANCHES.items()}
        outputs = {name: f.result() for name, f in futures.items()}

    # Join: the same prefix again, plus every branch's output.
    parts = "\n".join(f"{name}: {text.strip()}" for name, text in outputs.items())
    step("join", prefix + [{"role": "user", "content": JOIN_TASK.format(parts=parts)}])
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    print(f"{len(records)} steps: {cached} of {prompt} prompt tokens served from the cache ({cached / prompt:.0%})")
    return records


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per step")
    args = p.parse_args(argv)
    return run(args.base_url, args.max_tokens, args.model)


if __name__ == "__main__":
    main()
