"""An extraction pipeline written with radixserve's program API: classify, fork, extract, join.

What it shows: one program reads a document, classifies it with ``select``, forks into one
branch per field to extract (each a ``gen`` constrained by its own JSON schema, the branches
running at once), joins them, and writes a summary from the extracted facts. Every step's
prompt starts with the same conversation (system prompt, the document), so radixserve computes
it once and serves it from the radix cache to the select's choices, to every branch and to the
summary: each step prints how many of its prompt tokens were cached.

    radixserve serve &
    python examples/pipeline.py
    python examples/pipeline.py --base-url http://127.0.0.1:8000 --max-tokens 48
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from radixserve.program import RuntimeEndpoint, assistant, function, gen, select, system, user

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
CLASSIFY_TASK = "What kind of document is this? Answer with one word."
KINDS = ["history", "science", "news", "fiction"]


def _object(properties: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _names(max_items: int) -> dict[str, Any]:
    return {"type": "array", "items": {"type": "string", "maxLength": 24}, "maxItems": max_items}


# One branch per field: the question asked, and the JSON schema its answer must follow.
FIELDS: dict[str, tuple[str, dict[str, Any]]] = {
    "invention": ("Which invention changed lighthouses, who made it, and in which year?",
                  _object({"name": {"type": "string", "maxLength": 24},
                           "inventor": {"type": "string", "maxLength": 24},
                           "year": {"type": "integer", "minimum": 1000, "maximum": 2100}})),
    "places": ("Which places does the document name?", _object({"places": _names(3)})),
    "technologies": ("Which technologies made the keepers unnecessary?", _object({"technologies": _names(3)})),
}
FIELD_TOKENS = 128  # room for the longest answer the schemas above allow
SUMMARY_TASK = "Facts extracted from the document:\n{facts}\n\nWrite a two-sentence summary from these facts."


@function
def extract(s: Any, document: str, max_tokens: int) -> None:
    s += system(SYSTEM)
    s += user(f"{document}\n\n{CLASSIFY_TASK}")
    s += assistant(select("kind", choices=KINDS))
    # Fork: one branch per field, all continuing from the same conversation, run at once.
    branches = s.fork(len(FIELDS))
    for branch, (name, (question, schema)) in zip(branches, FIELDS.items(), strict=True):
        branch += user(question)
        branch += assistant(gen(name, max_tokens=FIELD_TOKENS, json_schema=schema, temperature=0))
    branches.join()
    # Join: the same conversation again, plus every branch's answer.
    facts = "\n".join(f"{name}: {b[name]}" for b, name in zip(branches, FIELDS, strict=True))
    s += user(SUMMARY_TASK.format(facts=facts))
    s += assistant(gen("summary", max_tokens=max_tokens, temperature=0))
    s.branches = branches


def _parse(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:  # cut off by max_tokens: shown as text
        return None


def _record(step: str, meta: dict[str, Any], text: str, cached: int, note: str = "") -> dict[str, Any]:
    print(f"{step:<13} prompt {meta['prompt_tokens']:>4}  cached {cached:>4}  {text.strip()[:60]!r}{note}")
    return {"step": step, "prompt_tokens": meta["prompt_tokens"], "cached_tokens": cached, "text": text}


def run(base_url: str, max_tokens: int) -> list[dict[str, Any]]:
    """classify -> one branch per field -> summary; one record per step (tokens, cached, text;
    a field's record also holds its parsed ``value`` and its ``schema``)."""
    state = extract.run(document=DOCUMENT, max_tokens=max_tokens, backend=RuntimeEndpoint(base_url))
    # The select computes its prompt once, then scores every choice on top of it from the cache.
    kind = state.get_meta_info("kind")
    records = [_record("classify", kind, state["kind"], min(kind["cached_tokens"]),
                       f"  (each of {len(KINDS)} choices; the prompt itself computed once)")]
    records[0]["choices_cached_tokens"] = kind["cached_tokens"]
    for branch, (name, (_, schema)) in zip(state.branches, FIELDS.items(), strict=True):
        meta = branch.get_meta_info(name)
        records.append(_record(name, meta, branch[name], meta["cached_tokens"]))
        records[-1].update(value=_parse(branch[name]), schema=schema)
    meta = state.get_meta_info("summary")
    records.append(_record("summary", meta, state["summary"], meta["cached_tokens"]))
    prompt = sum(r["prompt_tokens"] for r in records)
    cached = sum(r["cached_tokens"] for r in records)
    print(f"{len(records)} steps: {cached} of {prompt} prompt tokens served from the cache ({cached / prompt:.0%})")
    print("extracted:", json.dumps({r["step"]: r["value"] for r in records if "value" in r}))
    return records


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens of the summary")
    args = p.parse_args(argv)
    return run(args.base_url, args.max_tokens)


if __name__ == "__main__":
    main()
