"""Agent SDKs against a real `radixserve serve` process on the tiny chat model, as their users
run them: the OpenAI Agents SDK (``openai-agents``) with its default model, which speaks the
Responses API (``OpenAIResponsesModel`` over ``AsyncOpenAI`` pointed at the server).

The agent must call its tool (``tool_choice="required"``, one call per turn): the tool-call
grammar holds the random model's arguments to the tool's schema, and its finite schema (enums,
a bounded integer) lets every call finish.  The agent's structured ``output_type`` then ends the
run on the next turn, whose ``text.format`` grammar holds the answer to its schema.  Tracing is
off (``RunConfig``): nothing leaves the machine.
"""

from __future__ import annotations

import asyncio
from typing import Annotated, Any, Literal

import agents  # the OpenAI Agents SDK, package openai-agents
import jsonschema
from helpers.server import memory_checked_after_each_test, openai_client, tiny_chat_server
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

server = tiny_chat_server("--context-length", "2048", "--max-total-tokens", "16384")
memory_invariant = memory_checked_after_each_test("server")

MAX_TURNS = 4


class Forecast(BaseModel):
    """The agent's final answer (its ``output_type``)."""

    sunny: bool


def weather_agent(server: Any, calls: list[dict[str, Any]]) -> Any:
    """An agent whose one tool records its arguments in ``calls``."""

    @agents.function_tool
    def get_weather(city: Literal["Oslo", "Paris", "Rome"],
                    days: Annotated[int, Field(ge=1, le=7)]) -> str:
        """The weather forecast of a city for the next days."""
        calls.append({"city": city, "days": days})
        return f"sunny in {city} for {days} days"

    client = AsyncOpenAI(base_url=server.base_url + "/v1", api_key="none", max_retries=0)
    settings = agents.ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                    temperature=0, max_tokens=64)
    return agents.Agent(name="forecaster", instructions="Look up the weather, then answer.",
                        tools=[get_weather], output_type=Forecast, model_settings=settings,
                        model=agents.OpenAIResponsesModel("tiny", client))


def run_agent(agent: Any, streamed: bool, **kwargs: Any) -> Any:
    config = agents.RunConfig(tracing_disabled=True)

    async def run() -> Any:
        if not streamed:
            return await agents.Runner.run(agent, "Will it be sunny in Oslo?",
                                           max_turns=MAX_TURNS, run_config=config, **kwargs)
        result = agents.Runner.run_streamed(agent, "Will it be sunny in Oslo?",
                                            max_turns=MAX_TURNS, run_config=config, **kwargs)
        async for _ in result.stream_events():
            pass
        return result

    return asyncio.run(run())


def check_tool_round_trip(agent: Any, result: Any, calls: list[dict[str, Any]]) -> None:
    """The tool ran once with arguments its schema accepts, the model saw its output, and the
    run finished with the structured answer."""
    [tool] = agent.tools
    assert len(calls) == 1, calls
    jsonschema.validate(calls[0], tool.params_json_schema)
    kinds = [item.type for item in result.new_items]
    assert kinds == ["tool_call_item", "tool_call_output_item", "message_output_item"], kinds
    assert result.new_items[1].output == f"sunny in {calls[0]['city']} for {calls[0]['days']} days"
    assert isinstance(result.final_output, Forecast)
    assert len(result.raw_responses) == 2


def test_agent_runs_a_tool_over_the_responses_api(server) -> None:
    """``Runner.run``: each turn sends the whole conversation (the SDK's default)."""
    calls: list[dict[str, Any]] = []
    agent = weather_agent(server, calls)
    result = run_agent(agent, streamed=False)
    check_tool_round_trip(agent, result, calls)
    first, second = (r.usage for r in result.raw_responses)
    # The second turn's prompt extends the first's: the radix tree serves all of it.
    assert second.input_tokens_details.cached_tokens >= first.input_tokens


def test_streamed_agent_continues_a_stored_response(server) -> None:
    """``Runner.run_streamed`` with ``auto_previous_response_id``: the second turn sends only
    the tool's output and continues the stored first response (the Responses event stream
    and ``previous_response_id`` together)."""
    calls: list[dict[str, Any]] = []
    agent = weather_agent(server, calls)
    result = run_agent(agent, streamed=True, auto_previous_response_id=True)
    check_tool_round_trip(agent, result, calls)
    first, second = result.raw_responses
    stored = openai_client(server).responses.retrieve(second.response_id)
    assert stored.previous_response_id == first.response_id
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens
