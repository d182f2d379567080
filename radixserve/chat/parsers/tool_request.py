"""Validate a request's ``tools`` / ``tool_choice`` / ``parallel_tool_calls`` into a plan.

Every problem raises :class:`ToolRequestError` (a ``ValueError``) naming the offending field,
which the route turns into HTTP 400.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import jsonschema

_NAME = re.compile(r"^[A-Za-z0-9_.:-]{1,64}$")
_TOOL_KEYS = {"type", "function"}
_FUNCTION_KEYS = {"name", "description", "parameters", "strict"}


class ToolRequestError(ValueError):
    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class ToolPlan:
    tools: tuple[dict[str, Any], ...]  # validated tools ({"type": "function", "function": ...})
    choice: str  # "none", "auto", "required" or "function" (one named function)
    function: str | None  # the named function when choice == "function"
    parallel: bool  # parallel_tool_calls

    @property
    def offered(self) -> list[dict[str, Any]]:
        """The tools shown to the model (none with tool_choice "none")."""
        return [] if self.choice == "none" else list(self.tools)

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    @property
    def parses(self) -> bool:
        """Whether the output is parsed for tool calls."""
        return bool(self.offered)

    @property
    def forced(self) -> bool:
        """Whether a grammar must make the model call a tool."""
        return self.choice in ("required", "function")

    def parameters(self, name: str) -> dict[str, Any]:
        tool = next(t for t in self.tools if t["function"]["name"] == name)
        return tool["function"].get("parameters") or {"type": "object"}


def _check_tool(i: int, tool: Any) -> dict[str, Any]:
    where = f"tools[{i}]"
    shape = (
        f"{where} must be {{'type': 'function', "
        f"'function': {{'name': ..., 'parameters': {{...}}}}}}"
    )
    if (
        not isinstance(tool, dict)
        or tool.get("type") != "function"
        or not isinstance(tool.get("function"), dict)
    ):
        raise ToolRequestError(shape, "tools")
    extra = sorted(set(tool) - _TOOL_KEYS)
    if extra:
        raise ToolRequestError(f"{where} has unknown field(s) {extra}", "tools")
    fn = tool["function"]
    extra = sorted(set(fn) - _FUNCTION_KEYS)
    if extra:
        raise ToolRequestError(f"{where}.function has unknown field(s) {extra}", "tools")
    name = fn.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolRequestError(
            f"{where}.function.name must be 1 to 64 letters, digits, '_', '-', '.' or ':', "
            f"got {name!r}",
            "tools",
        )
    if "description" in fn and not isinstance(fn["description"], str | None):
        raise ToolRequestError(f"{where}.function.description must be a string", "tools")
    if "strict" in fn and not isinstance(fn["strict"], bool | None):
        raise ToolRequestError(f"{where}.function.strict must be a boolean", "tools")
    params = fn.get("parameters")
    if params is not None:
        if not isinstance(params, dict):
            raise ToolRequestError(
                f"{where}.function.parameters must be a JSON schema object", "tools"
            )
        try:
            jsonschema.validators.validator_for(params).check_schema(params)
        except jsonschema.SchemaError as e:
            raise ToolRequestError(
                f"{where}.function.parameters is not a valid JSON schema: {e.message}", "tools"
            ) from None
        if params.get("type", "object") != "object":
            raise ToolRequestError(
                f"{where}.function.parameters must describe an object (\"type\": \"object\"), "
                f"got type {params['type']!r}", "tools")
    return tool


def _check_choice(choice: Any, names: list[str]) -> tuple[str, str | None]:
    if choice is None:
        return ("auto" if names else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise ToolRequestError(
                "tool_choice must be 'none', 'auto', 'required' or a named function, "
                f"got {choice!r}",
                "tool_choice",
            )
        if choice == "required" and not names:
            raise ToolRequestError(
                "tool_choice 'required' needs a non-empty tools list", "tool_choice"
            )
        return choice, None
    fn = choice.get("function") if isinstance(choice, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(fn, dict)
            and isinstance(fn.get("name"), str) and set(choice) == {"type", "function"}):
        raise ToolRequestError(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}", "tool_choice")
    if fn["name"] not in names:
        known = ", ".join(names) or "no tools were given"
        raise ToolRequestError(
            f"tool_choice names the function {fn['name']!r}, which is not in tools ({known})",
            "tool_choice",
        )
    return "function", fn["name"]


def plan_tools(
    tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None
) -> ToolPlan:
    """The validated plan for a chat request's tool fields."""
    checked = [_check_tool(i, t) for i, t in enumerate(tools or [])]
    names = [t["function"]["name"] for t in checked]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ToolRequestError(f"tools has several functions named {dupes}", "tools")
    choice, function = _check_choice(tool_choice, names)
    return ToolPlan(tuple(checked), choice, function, parallel_tool_calls is not False)
