"""Offline batch inference with the Engine API: no HTTP server, one call for a list of prompts.

What it shows: ``Engine.generate`` takes a list of prompts and returns the results in order
(with a progress bar); the engine schedules them in continuous batches. The prompts share one
instruction prefix, which the radix cache computes once: each result's ``meta_info`` says how
many of its prompt tokens came from the cache, and ``get_stats()`` gives the totals.

    python examples/offline_batch.py                           # the embedded default model
    python examples/offline_batch.py --model ./my-llama --max-tokens 32
"""

from __future__ import annotations

import argparse
from typing import Any

from radixserve import Engine

INSTRUCTION = ("You label customer reviews for an online bookshop. For each review, answer with "
               "one word, positive, negative or mixed, then one short sentence that explains why. "
               "Judge the review, not the book.")
REVIEWS = [
    "The story dragged in the middle, but the ending made up for it.",
    "Arrived two weeks late and the cover was torn.",
    "My daughter read it twice in one weekend. Wonderful illustrations.",
    "Good translation, though the footnotes are printed far too small.",
    "Exactly what the description promised. Fast delivery.",
    "I expected a cookbook and got a memoir about cooking.",
    "The audiobook narrator has a lovely voice and perfect pacing.",
    "Half of the pages were blank. I want a refund.",
]


def run(model: str | None, max_tokens: int, **settings: Any) -> list[dict[str, Any]]:
    """Label every review in one batch call; the results, in the order of REVIEWS."""
    with Engine(model, **settings) as engine:
        tok = engine.tokenizer
        prompts = []
        for review in REVIEWS:
            messages = [{"role": "system", "content": INSTRUCTION}, {"role": "user", "content": review}]
            if getattr(tok, "chat_template", None):
                prompts.append(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))
            else:  # a base model: plain text
                prompts.append(f"{INSTRUCTION}\n\nReview: {review}\nLabel:")
        results = engine.generate(prompts, {"max_new_tokens": max_tokens, "temperature": 0})
        for review, r in zip(REVIEWS, results, strict=True):
            meta = r["meta_info"]
            print(f"{review[:48]!r:<52} cached {meta['cached_tokens']:>3}/{meta['prompt_tokens']:<3} "
                  f"-> {r['text'].strip()[:60]!r}")
        stats = engine.get_stats()
        print(f"{len(results)} prompts: cache hit rate {stats['cache_hit_rate']:.0%}, "
              f"{stats['prefill_tokens_computed']} of {stats['prompt_tokens']} prompt tokens computed")
    return results


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="HF folder or .gguf file (default: the embedded model)")
    p.add_argument("--max-tokens", type=int, default=24, help="tokens per answer")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    args = p.parse_args(argv)
    settings = {"max_total_tokens": args.max_total_tokens} if args.max_total_tokens else {}
    return run(args.model, args.max_tokens, **settings)


if __name__ == "__main__":
    main()
