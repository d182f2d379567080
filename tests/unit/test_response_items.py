"""The Responses API's output items (radixserve/frontend/response_items.py): a whole answer's
items (``output_items``) and a streamed answer's (``ItemStream``, fed a character at a time)
are the same items, with the same texts and statuses, for answers with and without reasoning,
text and tool calls, finished or cut off by ``max_output_tokens``."""

from __future__ import annotations

import json

import pytest

from radixserve.chat.parsers.output import ParseSpec
from radixserve.chat.parsers.tool_formats import tool_format
from radixserve.frontend.response_items import ItemStream, output_items
from radixserve.ipc.messages import FinishReason
from radixserve.runtime.pieces import Piece, RequestMeta

REASONING = ParseSpec(reasoning_parser="qwen3", prompt_opened=True)
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>'


def _shape(items: list[dict]) -> list[tuple]:
    """What a client reads of the items (their ids aside)."""
    out = []
    for item in items:
        if item["type"] == "function_call":
            out.append(("function_call", item["name"], json.loads(item["arguments"]),
                        item["status"]))
        elif item["type"] == "message":
            out.append(("message", [p["text"] for p in item["content"]], item["status"]))
        else:
            out.append(("reasoning", [p["text"] for p in item["content"]]))
    return out


def _streamed(spec: ParseSpec, text: str, cut: bool) -> list[dict]:
    stream = ItemStream(spec.new_parser() if spec.active else None)
    reason = FinishReason("length" if cut else "stop")
    pieces = list(text) or [""]  # an empty answer: one empty last piece
    for i, ch in enumerate(pieces):
        last = i == len(pieces) - 1
        meta = RequestMeta("r", 3, 0, i + 1, finish_reason=reason if last else None)
        stream.feed(Piece(ch, [i], meta, last))
    return stream.output


def _whole(spec: ParseSpec, text: str, cut: bool) -> list[dict]:
    parsed = spec.new_parser().parse(text) if spec.active else None
    return output_items(text, parsed, cut_off=cut)


CASES = [
    # (parse spec, output text, cut off, the items a client reads)
    (REASONING, "Two plus two</think>Four.", False,
     [("reasoning", ["Two plus two"]), ("message", ["Four."], "completed")]),
    (REASONING, "Two plus two</think>Fo", True,
     [("reasoning", ["Two plus two"]), ("message", ["Fo"], "incomplete")]),
    (REASONING, "Two plus", True, [("reasoning", ["Two plus"])]),  # cut off in its reasoning
    # a finished answer with no text still ends with a message: an agent SDK's final output
    (REASONING, "Two plus two</think>", False,
     [("reasoning", ["Two plus two"]), ("message", [""], "completed")]),
    (ParseSpec(), "", False, [("message", [""], "completed")]),
    (ParseSpec(), "Four", True, [("message", ["Four"], "incomplete")]),
]


@pytest.mark.parametrize(("spec", "text", "cut", "want"), CASES)
def test_a_streamed_answer_has_the_whole_answers_items(spec: ParseSpec, text: str, cut: bool,
                                                       want: list[tuple]) -> None:
    assert _shape(_whole(spec, text, cut)) == want
    assert _shape(_streamed(spec, text, cut)) == want


def test_tool_calls_end_an_answer_without_an_empty_message() -> None:
    spec = ParseSpec(tool_format=tool_format("qwen25"), reasoning_parser="qwen3",
                     prompt_opened=True)
    text = "Adding.</think>" + CALL
    want = [("reasoning", ["Adding."]), ("function_call", "add", {"a": 1}, "completed")]
    assert _shape(_whole(spec, text, False)) == want
    assert _shape(_streamed(spec, text, False)) == want
