"""The structured-generation benchmark's workload: one JSON schema, support tickets, prompts.

``TICKET_SCHEMA`` is what a ticket-triage service would ask for: a nested customer object,
enums, an array of line items with ``maxItems``, every key required, strings with
``maxLength`` and bounded integers.  ``ticket_texts`` builds distinct, realistic tickets
from a seed; ``chat_prompts`` puts the schema in the system message and one ticket in the
user message; ``check_outputs`` parses and validates what the model wrote.
"""

from __future__ import annotations

import json
import random
from typing import Any

TICKET_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "customer": {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 40},
                "email": {"type": "string", "maxLength": 60},
                "plan": {"type": "string", "enum": ["free", "pro", "enterprise"]},
            },
            "required": ["name", "email", "plan"],
            "additionalProperties": False,
        },
        "category": {"type": "string", "enum": ["billing", "shipping", "technical", "account", "other"]},
        "priority": {"type": "string", "enum": ["low", "medium", "high", "urgent"]},
        "order": {
            "type": "object",
            "properties": {
                "order_id": {"type": "string", "maxLength": 16},
                "items": {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "properties": {
                            "sku": {"type": "string", "maxLength": 16},
                            "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                        },
                        "required": ["sku", "quantity"],
                        "additionalProperties": False,
                    },
                    "maxItems": 3,
                },
            },
            "required": ["order_id", "items"],
            "additionalProperties": False,
        },
        "sentiment": {"type": "integer", "minimum": -2, "maximum": 2},
        "summary": {"type": "string", "maxLength": 100},
    },
    "required": ["customer", "category", "priority", "order", "sentiment", "summary"],
    "additionalProperties": False,
}

_FIRST = ("Maria", "James", "Aiko", "Tomasz", "Priya", "Lucas", "Fatima", "Oliver", "Chen",
          "Sofia", "Kwame", "Elena", "Rahul", "Grace", "Mateo", "Ingrid")
_LAST = ("Lopez", "Smith", "Tanaka", "Nowak", "Sharma", "Martin", "Haddad", "Brown", "Wei",
         "Rossi", "Mensah", "Petrova", "Gupta", "Kim", "Silva", "Larsen")
_DOMAINS = ("example.com", "mail.example.org", "corp.example.net")
_PLANS = ("Free", "Pro", "Enterprise")
_PRODUCTS = (("USB-C dock", "DCK-220"), ("HDMI cable 2m", "CBL-HD2"), ("wireless mouse", "MSE-310"),
             ("mechanical keyboard", "KBD-870"), ("27-inch monitor", "MON-27Q"),
             ("laptop stand", "STD-105"), ("webcam 1080p", "CAM-108"), ("noise-cancelling headset", "HST-550"))
_ISSUES = (
    ("Charged twice for order {order}", "my card was charged twice for the same order. "
     "Please refund the duplicate payment as soon as possible."),
    ("Order {order} has not arrived", "the tracking page has said 'in transit' for nine days "
     "and nobody answers the phone. I need these for an office move on Monday."),
    ("Wrong item in order {order}", "the box contained a different model than the one I ordered. "
     "How do I return it and get the right one shipped?"),
    ("Cannot log in after password reset", "after resetting my password I get 'invalid token' "
     "on every attempt, so I cannot see my invoices for order {order}."),
    ("Device stopped working", "the {product} from order {order} stopped responding after a "
     "firmware update yesterday. I already tried another cable and a restart."),
    ("Question about my invoice", "the invoice for order {order} lists the wrong company name "
     "and VAT number. Can you issue a corrected invoice?"),
)
_TONES = ("Thanks in advance.", "This is really frustrating.", "No rush, just let me know.",
          "This is urgent, our team is blocked.", "Love your products otherwise!")


def ticket_texts(n: int, seed: int) -> list[str]:
    """``n`` distinct support tickets, deterministic for ``seed``."""
    rng = random.Random(seed)
    tickets = []
    for i in range(n):
        first, last = rng.choice(_FIRST), rng.choice(_LAST)
        order = f"A-{rng.randrange(10000, 99999)}"
        lines = [(rng.randint(1, 4), *rng.choice(_PRODUCTS)) for _ in range(rng.randint(1, 3))]
        subject, body = rng.choice(_ISSUES)
        items = ", ".join(f"{q} x {name} (SKU {sku})" for q, name, sku in lines)
        fill = {"order": order, "product": lines[0][1]}
        tickets.append(
            f"Ticket #{48000 + 37 * i + rng.randrange(37)} from {first} {last} "
            f"<{first.lower()}.{last.lower()}@{rng.choice(_DOMAINS)}> ({rng.choice(_PLANS)} plan)\n"
            f"Subject: {subject.format(**fill)}\n\n"
            f"Hello, I ordered {items} and {body.format(**fill)} {rng.choice(_TONES)}\n"
            f"{first}"
        )
    return tickets


def chat_prompts(tokenizer: Any, tickets: list[str], schema_text: str) -> list[str]:
    """Chat-templated prompts: the schema in the system message, one ticket per user message."""
    system = ("You are a support assistant. Reply with one JSON object that follows this JSON "
              f"schema:\n{schema_text}")
    return [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": system},
             {"role": "user", "content": f"Extract the customer record from this support ticket:\n\n{t}"}],
            tokenize=False, add_generation_prompt=True,
        )
        for t in tickets
    ]


def check_outputs(results: list[dict[str, Any]], schema: dict[str, Any]) -> dict[str, Any]:
    """Finish reasons, and how many outputs parse as JSON and validate against ``schema``."""
    import jsonschema

    validator = jsonschema.Draft202012Validator(schema)
    stopped = valid = valid_stopped = 0
    invalid_examples: list[str] = []
    for r in results:
        finish = (r["meta_info"].get("finish_reason") or {}).get("type")
        try:
            ok = validator.is_valid(json.loads(r["text"]))
        except json.JSONDecodeError:
            ok = False
        stopped += finish == "stop"
        valid += ok
        valid_stopped += ok and finish == "stop"
        if finish == "stop" and not ok and len(invalid_examples) < 3:
            invalid_examples.append(r["text"][:300])
    return {
        "finished_stop": stopped,
        "hit_max_tokens": sum((r["meta_info"].get("finish_reason") or {}).get("type") == "length"
                              for r in results),
        "valid": valid,
        "valid_share_of_stop": valid_stopped / stopped if stopped else None,
        "invalid_stop_examples": invalid_examples,
    }
