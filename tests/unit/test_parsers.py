"""Tool-call and reasoning parsers, the prompted tool format, and the tool grammars.

Oracles: streaming parsers fed any chunking assemble to the non-streaming parse; grammars are
checked with an xgrammar matcher over the default model's vocabulary; arguments with jsonschema.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable

import jsonschema
import pytest
import transformers
import xgrammar as xgr
from helpers.tool_schemas import TIME, WEATHER
from hypothesis import given, settings
from hypothesis import strategies as st

from radixserve.chat.parsers import (
    HERMES,
    LLAMA3,
    MISTRAL,
    ContentDelta,
    ParseSpec,
    ReasoningDelta,
    ToolArgsDelta,
    ToolCallParsed,
    ToolCallStart,
    ToolCallStream,
    ToolFormat,
    ToolRequestError,
    assemble,
    detect_tool_parser,
    native_messages,
    openai_deltas,
    parse_tool_calls,
    plan_tools,
    prompt_opens_reasoning,
    prompted_messages,
    prompted_tools_text,
    split_reasoning,
    tool_call_grammar,
    tool_call_text,
)

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Weather forecast",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]


def counter_ids() -> Callable[[], str]:
    it = itertools.count()
    return lambda: f"call_{next(it)}"


def stream_pieces(make: Callable[[], object], chunks: list[str]) -> list:
    parser = make()
    out = []
    for c in chunks:
        out += parser.feed(c)  # type: ignore[attr-defined]
    return out + parser.finish()  # type: ignore[attr-defined]


def cut(text: str, cuts: list[int]) -> list[str]:
    points = sorted({0, len(text), *(c % (len(text) + 1) for c in cuts)})
    return [text[a:b] for a, b in itertools.pairwise(points)]


# ---- non-streaming tool parsing ---------------------------------------------------------

def test_hermes_content_and_calls() -> None:
    text = ('Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", '
            '"note": "a } and a \\" {", "n": [1, {"x": 2}]}}\n</tool_call>\n'
            '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>')
    content, calls = parse_tool_calls(text, HERMES)
    assert content == "Let me check.\n\n"
    assert calls == [
        ToolCallParsed("get_weather", '{"city": "Paris", "note": "a } and a \\" {", "n": [1, {"x": 2}]}'),
        ToolCallParsed("get_time", '{"zone": "UTC"}'),
    ]
    assert json.loads(calls[0].arguments)["note"] == 'a } and a " {'


def test_hermes_compact_and_reordered_keys() -> None:
    content, calls = parse_tool_calls('<tool_call>{"name":"f","arguments":{}}</tool_call>', HERMES)
    assert content is None and calls == [ToolCallParsed("f", "{}")]
    # "arguments" before "name" cannot stream, but parses once the block is closed
    content, calls = parse_tool_calls('<tool_call>\n{"arguments": {"a": 1}, "name": "f"}\n</tool_call> ok', HERMES)
    assert content == " ok" and calls == [ToolCallParsed("f", '{"a": 1}')]


def test_hermes_malformed_unknown_and_truncated() -> None:
    bad = "use <tool_call>not json</tool_call> like this"
    assert parse_tool_calls(bad, HERMES) == (bad, [])
    unknown = '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'
    assert parse_tool_calls(unknown, HERMES, tool_names=["f"]) == (unknown, [])
    assert parse_tool_calls("no calls at all", HERMES) == ("no calls at all", [])
    assert parse_tool_calls("a <tool_c", HERMES) == ("a <tool_c", [])
    # cut by max_tokens inside the arguments: the call keeps what was written
    assert parse_tool_calls('<tool_call>\n{"name": "f", "arguments": {"a": [1,', HERMES) == (
        None, [ToolCallParsed("f", '{"a": [1,')])


def test_max_calls_keeps_the_first() -> None:
    text = ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {"x": 1}}</tool_call>')
    assert parse_tool_calls(text, HERMES, max_calls=1) == (None, [ToolCallParsed("a", "{}")])
    assert len(parse_tool_calls(text, HERMES)[1]) == 2


def test_llama3_formats() -> None:
    text = '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}'
    assert parse_tool_calls(text, LLAMA3) == (None, [ToolCallParsed("a", '{"x": 1}'), ToolCallParsed("b", "{}")])
    assert parse_tool_calls('  {"name": "a", "parameters": {"x": 1}}', LLAMA3) == (
        None, [ToolCallParsed("a", '{"x": 1}')])
    assert parse_tool_calls('Sure: <|python_tag|>{"name": "a", "arguments": {}}', LLAMA3) == (
        "Sure: ", [ToolCallParsed("a", "{}")])
    # not a call: text, or JSON that is not a call object
    assert parse_tool_calls("The answer is 42.", LLAMA3) == ("The answer is 42.", [])
    assert parse_tool_calls('{"answer": 42}', LLAMA3) == ('{"answer": 42}', [])


def test_mistral_formats() -> None:
    text = 'Calling. [TOOL_CALLS] [{"name": "a", "arguments": {"x": "]"}}, {"name": "b", "arguments": {}}]'
    assert parse_tool_calls(text, MISTRAL) == (
        "Calling. ", [ToolCallParsed("a", '{"x": "]"}'), ToolCallParsed("b", "{}")])
    reordered = '[TOOL_CALLS] [{"arguments": {"x": 1}, "name": "a"}]'
    assert parse_tool_calls(reordered, MISTRAL) == (None, [ToolCallParsed("a", '{"x": 1}')])
    assert parse_tool_calls("[TOOL_CALLS] oops", MISTRAL) == ("[TOOL_CALLS] oops", [])


# ---- streaming == non-streaming ---------------------------------------------------------

SAMPLES: list[tuple[ToolFormat, str]] = [
    (HERMES, 'Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n'
             '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'),
    (HERMES, '<tool_call>{"arguments": {"zone": "UTC"}, "name": "get_time"}</tool_call>tail'),
    (HERMES, 'a <tool_call> b <tool_c <tool_call>\n{"name": "get_time", "arguments": {"s": "}{\\"<"}}'),
    (HERMES, "plain text with < and </ and <tool but no call"),
    (LLAMA3, '<|python_tag|>{"name": "get_time", "parameters": {"zone": "UTC"}} ; {"name": "x", "parameters": {"a": [1, 2]}}'),
    (LLAMA3, '\n {"name": "get_time", "parameters": {"zone": "UTC"}} and then text'),
    (LLAMA3, '{"parameters": {}, "name": "get_time"}'),
    (MISTRAL, 'ok [TOOL_CALLS] [{"name": "get_time", "arguments": {"zone": "UTC"}}, {"name": "b", "arguments": {"q": "[,]"}}] end'),
    (MISTRAL, '[TOOL_CALLS][{"name": "a", "arguments": {}}, {"arguments": {}, "name": "b"}]'),
]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(range(len(SAMPLES))), st.lists(st.integers(0, 400), max_size=12),
       st.sampled_from([None, 1]))
def test_tool_streaming_matches_non_streaming(sample: int, cuts: list[int], max_calls: int | None) -> None:
    fmt, text = SAMPLES[sample]
    whole = assemble(stream_pieces(lambda: ToolCallStream(fmt, None, max_calls, counter_ids()), [text]))
    pieces = stream_pieces(lambda: ToolCallStream(fmt, None, max_calls, counter_ids()), cut(text, cuts))
    assert assemble(pieces) == whole
    assert (whole.content, whole.calls) == parse_tool_calls(text, fmt, max_calls=max_calls)
    # OpenAI shape: each call opens with index, id, type, name and empty arguments
    starts = [d["tool_calls"][0] for d in openai_deltas(pieces)
              if "tool_calls" in d and "id" in d["tool_calls"][0]]
    assert [s["index"] for s in starts] == list(range(len(whole.calls)))
    assert all(s["type"] == "function" and s["function"]["arguments"] == "" for s in starts)


def test_streaming_emits_arguments_before_the_call_ends() -> None:
    parser = ToolCallStream(HERMES, new_id=counter_ids())
    first = parser.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert first == [ToolCallStart(0, "call_0", "get_weather"), ToolArgsDelta(0, '{"city": "Pa')]
    assert parser.feed('ris"}}\n</tool') == [ToolArgsDelta(0, 'ris"}')]
    assert parser.feed("_call>Done") == [ContentDelta("Done")]
    assert parser.finish() == []


def test_held_marker_prefix_is_content_at_the_end() -> None:
    parser = ToolCallStream(HERMES)
    assert parser.feed("x <tool") == [ContentDelta("x ")]
    assert parser.finish() == [ContentDelta("<tool")]


# ---- reasoning ---------------------------------------------------------------------------

# A Qwen3-style template: opens <think> in the prompt unless enable_thinking is false.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)


@pytest.fixture(scope="module")
def tokenizer(default_model_path: str) -> transformers.PreTrainedTokenizerBase:
    return transformers.AutoTokenizer.from_pretrained(default_model_path)


def token_stream(tok: transformers.PreTrainedTokenizerBase, text: str) -> list[str]:
    """``text`` as a detokenizer streams it: one delta per token (or fewer, when a token ends
    inside a character)."""
    ids = tok.encode(text, add_special_tokens=False)
    out, prev = [], ""
    for k in range(1, len(ids) + 1):
        cur = tok.decode(ids[:k])
        if not cur.endswith("\ufffd"):
            out.append(cur[len(prev):])
            prev = cur
    assert "".join(out) == text
    return out


def test_qwen3_reasoning_with_template(tokenizer) -> None:
    msgs = [{"role": "user", "content": "2+2?"}]
    opened = tokenizer.apply_chat_template(msgs, chat_template=THINKING_TEMPLATE, tokenize=False,
                                           add_generation_prompt=True)
    closed = tokenizer.apply_chat_template(msgs, chat_template=THINKING_TEMPLATE, tokenize=False,
                                           add_generation_prompt=True, enable_thinking=False)
    assert prompt_opens_reasoning(opened) and not prompt_opens_reasoning(closed)
    output = "Two and two.\nSo four.\n</think>\n\nThe answer is 4."
    assert split_reasoning(output, "qwen3", prompt_opened=True) == ("Two and two.\nSo four.", "The answer is 4.")
    # thinking off: nothing is reasoning, even a stray tag
    assert split_reasoning("The answer is 4.", "qwen3", thinking=False) == (None, "The answer is 4.")
    # the model opens the block itself
    assert split_reasoning("<think>\nhm\n</think>\n\n4", "qwen3") == ("hm", "4")
    assert split_reasoning("4, no thinking", "qwen3") == (None, "4, no thinking")
    # unterminated: all reasoning
    assert split_reasoning("<think>still going", "qwen3") == ("still going", "")


def test_deepseek_r1_reasoning() -> None:
    assert split_reasoning("plan</think>answer", "deepseek-r1") == ("plan", "answer")
    assert split_reasoning("<think>\nplan\n</think>\nanswer", "deepseek-r1") == ("plan", "answer")
    assert split_reasoning("no end tag", "deepseek-r1") == ("no end tag", "")


REASONING_OUTPUTS = [
    ("qwen3", True, "Let me see: 3 * 4 = 12.\n</think>\n\nIt is 12."),
    ("qwen3", False, "<think>\nhmm, hmm\n\n</think>\n\nOK then"),
    ("qwen3", False, "No thinking here"),
    ("deepseek-r1", False, "<think>step one\nstep two</think>Done."),
    ("deepseek-r1", False, "step one\n</think>\n\nDone."),
]


@pytest.mark.parametrize("parser,opened,output", REASONING_OUTPUTS)
def test_reasoning_token_stream_matches_split(tokenizer, parser: str, opened: bool, output: str) -> None:
    spec = ParseSpec(reasoning_parser=parser, prompt_opened=opened)
    pieces = stream_pieces(spec.new_parser, token_stream(tokenizer, output))
    for p in pieces:  # no partial (or whole) tag ever reaches the client
        assert "<" not in p.text and ">" not in p.text  # type: ignore[union-attr]
    msg = assemble(pieces)
    assert (msg.reasoning_content, msg.content or "") == split_reasoning(output, parser, prompt_opened=opened)


@settings(max_examples=40, deadline=None)
@given(st.sampled_from(range(len(REASONING_OUTPUTS))), st.lists(st.integers(0, 200), max_size=10))
def test_reasoning_any_chunking(sample: int, cuts: list[int]) -> None:
    parser, opened, output = REASONING_OUTPUTS[sample]
    spec = ParseSpec(reasoning_parser=parser, prompt_opened=opened)
    assert assemble(stream_pieces(spec.new_parser, cut(output, cuts))) == spec.new_parser().parse(output)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=10))
def test_reasoning_then_tool_calls(cuts: list[int]) -> None:
    output = ('I should check the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
              '"arguments": {"city": "Rome", "days": 2}}\n</tool_call>')
    spec = ParseSpec(tool_format=HERMES, tool_names=frozenset({"get_weather"}),
                     reasoning_parser="qwen3", prompt_opened=True)
    msg = assemble(stream_pieces(spec.new_parser, cut(output, cuts)))
    assert msg.reasoning_content == "I should check the weather."
    assert msg.content is None
    assert msg.calls == [ToolCallParsed("get_weather", '{"city": "Rome", "days": 2}')]
    assert all(isinstance(p, ReasoningDelta | ToolCallStart | ToolArgsDelta)
               for p in stream_pieces(spec.new_parser, cut(output, cuts)))


# ---- tool requests -------------------------------------------------------------------------

def test_plan_tools_choices() -> None:
    auto = plan_tools(TOOLS, None, None)
    assert auto.choice == "auto" and auto.parses and not auto.forced and auto.parallel
    assert plan_tools(None, None, None).choice == "none"
    none = plan_tools(TOOLS, "none", None)
    assert none.offered == [] and not none.parses
    named = plan_tools(TOOLS, {"type": "function", "function": {"name": "get_time"}}, False)
    assert (named.choice, named.function, named.parallel, named.forced) == ("function", "get_time", False, True)


@pytest.mark.parametrize("tools,choice,message", [
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "'nope', which is not in tools"),
    (TOOLS, "sometimes", "tool_choice must be"),
    (TOOLS, {"type": "function", "name": "get_time"}, "tool_choice must be"),
    (None, "required", "needs a non-empty tools list"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "strin"}}}], None,
     "tools[0].function.parameters is not a valid JSON schema"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], None,
     "must describe an object"),
    ([{"type": "function", "function": {"name": "f", "parameters": []}}], None, "must be a JSON schema object"),
    ([{"type": "function"}], None, "tools[0] must be"),
    ([{"type": "retrieval", "function": {"name": "f"}}], None, "tools[0] must be"),
    ([{"type": "function", "function": {"name": "has space"}}], None, "function.name must be"),
    ([{"type": "function", "function": {"name": "f", "params": {}}}], None, "unknown field(s) ['params']"),
    (TOOLS + TOOLS[:1], None, "several functions named ['get_weather']"),
])
def test_plan_tools_rejects(tools, choice, message: str) -> None:
    with pytest.raises(ToolRequestError) as e:
        plan_tools(tools, choice, None)
    assert message in str(e.value)
    assert e.value.param in ("tools", "tool_choice")


# ---- the prompted format and templates ------------------------------------------------------

def test_prompted_text_is_deterministic() -> None:
    shuffled = [{"function": {"parameters": TIME, "name": "get_time"}, "type": "function"}]
    assert prompted_tools_text(shuffled) == prompted_tools_text([TOOLS[1]])
    text = prompted_tools_text(TOOLS)
    assert text.count("\n{\"function\": ") == 2 and "<tool_call>\n{\"name\": <function-name>" in text
    # merged into an existing system message, or prepended as one
    merged = prompted_messages([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}], TOOLS)
    assert merged[0] == {"role": "system", "content": "Be brief.\n\n" + text}
    added = prompted_messages([{"role": "user", "content": "hi"}], TOOLS)
    assert added[0] == {"role": "system", "content": text} and len(added) == 2
    assert prompted_messages([{"role": "user", "content": "hi"}], []) == [{"role": "user", "content": "hi"}]


def test_prompted_history_round_trip() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "UTC"}'}}
    history = [
        {"role": "user", "content": "time?"},
        {"role": "assistant", "content": "", "tool_calls": [call, {**call, "id": "call_2"}]},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_1"},
        {"role": "tool", "content": "12:00", "tool_call_id": "call_2"},
        {"role": "assistant", "content": "Noon."},
    ]
    out = prompted_messages(history, [])
    block = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    assert out[1] == {"role": "assistant", "content": block + "\n" + block}
    assert out[2] == {"role": "user", "content": "<tool_response>\n12:00\n</tool_response>\n"
                                                 "<tool_response>\n12:00\n</tool_response>"}
    assert out[3] == {"role": "assistant", "content": "Noon."}
    # the rendered call parses back to itself
    assert parse_tool_calls(out[1]["content"], HERMES)[1] == [ToolCallParsed("get_time", '{"zone": "UTC"}')] * 2
    assert native_messages(history)[1]["tool_calls"][0]["function"]["arguments"] == {"zone": "UTC"}


def test_agent_loop_prompts_extend_each_other(tokenizer) -> None:
    """Each step's prompt tokens start with the previous step's (what the radix cache needs)."""
    system = [{"role": "system", "content": "You plan trips."}]
    steps = [[{"role": "user", "content": "Weather in Oslo?"}]]
    call = {"id": "call_9", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Oslo", "days": 1}'}}
    steps.append(steps[0] + [{"role": "assistant", "content": "", "tool_calls": [call]},
                             {"role": "tool", "content": '{"temp": -3}', "tool_call_id": "call_9"}])
    steps.append(steps[1] + [{"role": "assistant", "content": "It is -3 C."},
                             {"role": "user", "content": "And tomorrow?"}])
    prompts = [tokenizer.apply_chat_template(prompted_messages(system + s, TOOLS), tokenize=False,
                                             add_generation_prompt=True) for s in steps]
    ids = [tokenizer.encode(p, add_special_tokens=False) for p in prompts]
    for before, after in itertools.pairwise(ids):
        assert after[:len(before)] == before
    # the generated call (what the grammar forces) is exactly how the history renders it
    assert prompts[1].startswith(prompts[0] + tool_call_text("get_weather", '{"city": "Oslo", "days": 1}'))


HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
    "Answer with <tool_call></tool_call><|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
)
LLAMA_TEMPLATE = ("{% for t in tools or [] %}{{ t['function']['name'] }}{% endfor %}"
                  "{% for m in messages %}{% if m['role'] == 'ipython' %}<|python_tag|>{% endif %}"
                  "{{ m['content'] }}{% endfor %}")
MISTRAL_TEMPLATE = ("[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% for m in messages %}"
                    "{{ m['content'] }}{% if m.tool_calls %}[TOOL_CALLS]{% endif %}{% endfor %}")
IGNORES_TOOLS = "{% for m in messages %}{{ m['content'] }}<tool_call>{% endfor %}"


@pytest.mark.parametrize("template,expected", [
    (None, "prompted"), (HERMES_TEMPLATE, "hermes"), (LLAMA_TEMPLATE, "llama3"),
    (MISTRAL_TEMPLATE, "mistral"), (IGNORES_TOOLS, "prompted"),
])
def test_detect_tool_parser(tokenizer, template: str | None, expected: str) -> None:
    saved = tokenizer.chat_template
    try:
        if template is not None:
            tokenizer.chat_template = template
        assert detect_tool_parser(tokenizer) == expected
    finally:
        tokenizer.chat_template = saved


# ---- grammars -------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def compiler(tokenizer) -> xgr.GrammarCompiler:
    return xgr.GrammarCompiler(xgr.TokenizerInfo.from_huggingface(tokenizer))


def accepts(compiler: xgr.GrammarCompiler, fields: dict[str, str], text: str, eos: int) -> bool:
    """The matcher takes ``text`` and then may end (EOS accepted)."""
    matcher = xgr.GrammarMatcher(compiler.compile_structural_tag(fields["structural_tag"]))
    return matcher.accept_string(text) and matcher.accept_token(eos)


def calls_text(fmt: ToolFormat, calls: list[tuple[str, dict]]) -> str:
    if fmt is HERMES:
        return "\n".join(tool_call_text(n, json.dumps(a)) for n, a in calls)
    objs = [f'{{"name": "{n}", "{fmt.arg_keys[0]}": {json.dumps(a)}}}' for n, a in calls]
    return "; ".join(objs) if fmt is LLAMA3 else "[TOOL_CALLS] [" + ", ".join(objs) + "]"


GOOD_WEATHER = ("get_weather", {"city": "Oslo", "days": 3})
GOOD_TIME = ("get_time", {"zone": "UTC"})


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=["hermes", "llama3", "mistral"])
def test_required_grammar(compiler, tokenizer, fmt: ToolFormat) -> None:
    eos = tokenizer.eos_token_id
    fields = tool_call_grammar(plan_tools(TOOLS, "required", None), fmt)
    assert list(fields) == ["structural_tag"]
    for calls in ([GOOD_WEATHER], [GOOD_TIME, GOOD_WEATHER]):
        text = calls_text(fmt, calls)
        assert accepts(compiler, fields, text, eos), text
        content, parsed = parse_tool_calls(text, fmt)
        assert content is None and [c.name for c in parsed] == [n for n, _ in calls]
        for c in parsed:
            jsonschema.validate(json.loads(c.arguments), WEATHER if c.name == "get_weather" else TIME)
    refused = [
        "",  # no call
        "Sure! " + calls_text(fmt, [GOOD_TIME]),  # text first
        calls_text(fmt, [("get_weather", {"city": "Lima", "days": 3})]),  # not in the enum
        calls_text(fmt, [("get_weather", {"city": "Oslo", "days": 9})]),  # above maximum
        calls_text(fmt, [("get_weather", {"city": "Oslo"})]),  # required key missing
        calls_text(fmt, [("get_weather", {"city": "Oslo", "days": 1, "x": 1})]),  # extra key
        calls_text(fmt, [("get_news", {})]),  # unknown function
    ]
    for text in refused:
        assert not accepts(compiler, fields, text, eos), text


@pytest.mark.parametrize("fmt", [HERMES, LLAMA3, MISTRAL], ids=["hermes", "llama3", "mistral"])
def test_single_call_grammars(compiler, tokenizer, fmt: ToolFormat) -> None:
    eos = tokenizer.eos_token_id
    one = tool_call_grammar(plan_tools(TOOLS, "required", False), fmt)
    assert accepts(compiler, one, calls_text(fmt, [GOOD_TIME]), eos)
    assert not accepts(compiler, one, calls_text(fmt, [GOOD_TIME, GOOD_WEATHER]), eos)
    named = tool_call_grammar(plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None), fmt)
    assert accepts(compiler, named, calls_text(fmt, [GOOD_WEATHER]), eos)
    assert not accepts(compiler, named, calls_text(fmt, [GOOD_TIME]), eos)
    assert not accepts(compiler, named, calls_text(fmt, [GOOD_WEATHER, GOOD_WEATHER]), eos)


def test_auto_and_none_have_no_grammar() -> None:
    assert tool_call_grammar(plan_tools(TOOLS, "auto", None), HERMES) == {}
    assert tool_call_grammar(plan_tools(TOOLS, "none", None), HERMES) == {}


def test_reasoning_prefix_grammars(compiler, tokenizer) -> None:
    eos = tokenizer.eos_token_id
    plan = plan_tools(TOOLS, "required", None)
    call = calls_text(HERMES, [GOOD_TIME])
    opened = tool_call_grammar(plan, HERMES, reasoning="required")
    assert accepts(compiler, opened, "I need the time.</think>\n\n" + call, eos)
    assert not accepts(compiler, opened, call, eos)
    optional = tool_call_grammar(plan, HERMES, reasoning="optional")
    assert accepts(compiler, optional, "<think>hm</think>\n\n" + call, eos)
    assert accepts(compiler, optional, call, eos)
    output = "<think>hm</think>\n\n" + call
    spec = ParseSpec(tool_format=HERMES, reasoning_parser="qwen3")
    msg = spec.new_parser().parse(output)
    assert msg.reasoning_content == "hm" and msg.calls == [ToolCallParsed("get_time", '{"zone": "UTC"}')]


@settings(max_examples=25, deadline=None)
@given(city=st.sampled_from(["Paris", "Oslo", "Rome"]), days=st.integers(1, 7),
       metric=st.one_of(st.none(), st.booleans()), spaced=st.booleans())
def test_grammar_accepted_outputs_parse_and_validate(compiler, tokenizer, city: str, days: int,
                                                     metric: bool | None, spaced: bool) -> None:
    args: dict = {"city": city, "days": days}
    if metric is not None:
        args["metric"] = metric
    text = json.dumps(args, separators=(", ", ": ") if spaced else (",", ":"))
    fields = tool_call_grammar(plan_tools(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None),
                               HERMES)
    output = tool_call_text("get_weather", text)
    assert accepts(compiler, fields, output, tokenizer.eos_token_id)
    content, calls = parse_tool_calls(output, HERMES, ["get_weather", "get_time"])
    assert content is None and calls == [ToolCallParsed("get_weather", text)]
    jsonschema.validate(json.loads(calls[0].arguments), WEATHER)
