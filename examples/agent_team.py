"""A team of agents that share one long system prompt and tool list.

What it shows: agent frameworks send every agent the same long preamble (role, rules, tool
definitions) followed by that agent's own task. radixserve computes the preamble once and
serves it from the radix cache to every later call: the first call reports 0 cached tokens,
every later one reports nearly the whole preamble as ``usage.prompt_tokens_details.cached_tokens``.
In the second round each agent continues its own conversation, so its earlier turn is cached
as well.

    radixserve serve &
    python examples/agent_team.py                      # http://127.0.0.1:30000
    python examples/agent_team.py --base-url http://127.0.0.1:8000 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from openai import OpenAI

TOOLS = [
    {"name": "search_flights", "description": "Find flights between two airports on a date.",
     "parameters": {"origin": "IATA code", "destination": "IATA code", "date": "YYYY-MM-DD"}},
    {"name": "search_hotels", "description": "Find hotels in a city for a range of nights.",
     "parameters": {"city": "string", "check_in": "YYYY-MM-DD", "nights": "integer", "max_price": "EUR"}},
    {"name": "get_weather", "description": "Forecast for a city on a date.",
     "parameters": {"city": "string", "date": "YYYY-MM-DD"}},
    {"name": "convert_currency", "description": "Convert an amount between two currencies.",
     "parameters": {"amount": "number", "from": "ISO code", "to": "ISO code"}},
    {"name": "book", "description": "Book a flight or hotel offer by its id; needs the user's consent.",
     "parameters": {"offer_id": "string", "traveller": "full name"}},
]

SYSTEM_PROMPT = f"""You are one member of a team of travel-planning agents working for a small \
travel agency. The team plans trips for customers who write in with a short description of \
what they want. Every member of the team follows the same rules.

Rules:
1. Be concise and precise. Prefer short sentences and concrete numbers (dates, prices, times).
2. Never invent prices, flight numbers or hotel names: call a tool to look them up.
3. Ask the customer before booking anything, and never book without their explicit consent.
4. Keep the budget in mind: state the running total in euros after every step.
5. When a tool fails, say so and try one alternative before giving up.
6. Answer in the language of the customer.

To call a tool, answer with one line of JSON: {{"tool": "<name>", "arguments": {{...}}}}.
You may call one tool per answer. The tools available to every member of the team are:

{json.dumps(TOOLS, indent=2)}

The agency's opening hours are 9:00 to 18:00 on weekdays. Customers are mostly families and \
retired couples travelling in Europe; many prefer trains to planes for trips under six hours, \
quiet hotels near the centre, and direct flights. Keep that in mind when you choose options."""

AGENTS = {
    "flights": "Find the cheapest direct flight from Berlin to Lisbon on 2025-05-14 for two adults.",
    "hotels": "Find a quiet hotel in Lisbon's centre for four nights from 2025-05-14, under 150 EUR a night.",
    "weather": "Check the weather in Lisbon for 2025-05-14 and say whether to pack rain gear.",
    "budget": "The customer's budget is 1500 USD. Convert it to euros and split it between flights and hotel.",
}
FOLLOW_UP = "Summarise what you found in one sentence for the team lead."


def run(base_url: str, max_tokens: int, model: str | None = None, rounds: int = 2) -> list[dict[str, Any]]:
    """Each agent's calls, round by round; one record per call (tokens, cached tokens, answer)."""
    client = OpenAI(base_url=base_url.rstrip("/") + "/v1", api_key="none")
    model = model or client.models.list().data[0].id
    histories = {name: [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": task}]
                 for name, task in AGENTS.items()}
    records = []
    print(f"{'round':>5}  {'agent':<8} {'prompt':>6} {'cached':>6} {'hit':>5}  answer")
    for round_ in range(1, rounds + 1):
        for name, messages in histories.items():
            r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens,
                                               temperature=0)
            answer = r.choices[0].message.content or ""
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": FOLLOW_UP}]
            cached = r.usage.prompt_tokens_details.cached_tokens if r.usage.prompt_tokens_details else 0
            records.append({"round": round_, "agent": name, "prompt_tokens": r.usage.prompt_tokens,
                            "cached_tokens": cached or 0, "answer": answer})
            print(f"{round_:>5}  {name:<8} {r.usage.prompt_tokens:>6} {cached or 0:>6} "
                  f"{(cached or 0) / r.usage.prompt_tokens:>5.0%}  {answer[:60]!r}")
    prompt = sum(x["prompt_tokens"] for x in records)
    cached = sum(x["cached_tokens"] for x in records)
    print(f"{len(records)} calls: {cached} of {prompt} prompt tokens served from the cache ({cached / prompt:.0%})")
    return records


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base-url", default="http://127.0.0.1:30000", help="the server (default: %(default)s)")
    p.add_argument("--model", default=None, help="model name (default: the server's first)")
    p.add_argument("--max-tokens", type=int, default=64, help="tokens per answer")
    p.add_argument("--rounds", type=int, default=2, help="turns per agent")
    args = p.parse_args(argv)
    return run(args.base_url, args.max_tokens, args.model, args.rounds)


if __name__ == "__main__":
    main()
