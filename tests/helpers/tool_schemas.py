"""Two tools' argument schemas shared by the parser and end-to-end tool-call tests.

They are finite (enums, bounded integers, booleans), so a random model held to a tool-call
grammar always finishes a call.
"""

from __future__ import annotations

from typing import Any

WEATHER: dict[str, Any] = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TIME: dict[str, Any] = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                        "required": ["zone"], "additionalProperties": False}
SCHEMAS: dict[str, dict[str, Any]] = {"get_weather": WEATHER, "get_time": TIME}
