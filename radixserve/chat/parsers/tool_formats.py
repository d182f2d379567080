"""How each chat-template family writes tool calls in its output.

- ``hermes`` (Hermes, Qwen2.5, Qwen3, and radixserve's ``prompted`` format): any text, and
  calls as ``<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>`` blocks.
- ``llama3``: the output is ``{"name": "f", "parameters": {...}}`` objects separated by ``;``,
  from its start or after ``<|python_tag|>`` (text before the tag is content).
- ``mistral``: text, then ``[TOOL_CALLS] [{"name": "f", "arguments": {...}}, ...]``.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ToolFormat:
    name: str
    start: str  # the marker that opens a run of calls
    end: str | None  # the marker that closes one call (hermes), else None
    list_open: str | None  # a bracket after ``start`` opening a list of calls (mistral)
    separator: str | None  # between calls of one run (";" or ","), None: one call per run
    list_close: str | None  # closes the list (mistral)
    calls_at_start: bool  # a "{" opening the output starts a run without the marker (llama3)
    arg_keys: tuple[str, ...]  # names of the arguments field, preferred first
    marker_is_special: bool  # the marker is a special token: keep special tokens in the text


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", None, None, None, False,
                    ("arguments", "parameters"), False)
LLAMA3 = ToolFormat("llama3", "<|python_tag|>", None, None, ";", None, True,
                    ("parameters", "arguments"), True)
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None, "[", ",", "]", False,
                     ("arguments", "parameters"), True)

# --tool-call-parser values (besides "auto") and the output format each one parses.
PARSER_FORMATS: dict[str, ToolFormat] = {
    "hermes": HERMES, "qwen25": HERMES, "qwen3": HERMES, "prompted": HERMES,
    "llama3": LLAMA3, "mistral": MISTRAL,
}


def tool_format(parser: str) -> ToolFormat:
    try:
        return PARSER_FORMATS[parser]
    except KeyError:
        raise ValueError(
            f"unknown tool call parser {parser!r}; choose from {sorted(PARSER_FORMATS)}"
        ) from None
