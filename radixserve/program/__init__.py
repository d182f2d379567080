"""The program API: structured-generation pipelines whose branches share the radix cache.

    from radixserve.program import assistant, function, gen, select, set_default_backend, user

    @function
    def triage(s, ticket):
        s += user(f"Ticket: {ticket}\\nIs this a bug, a question or a request?")
        s += assistant(select("kind", choices=["bug", "question", "request"]))
        branches = s.fork(2)
        branches[0] += user("Summarise it.") + assistant(gen("summary", max_tokens=48))
        branches[1] += user("Reply to it.") + assistant(gen("reply", max_tokens=64))
        branches.join()

    set_default_backend(engine)          # an Engine, or "http://host:port" of radixserve serve
    state = triage.run(ticket="...")
    print(state["kind"], branches...)
"""

from radixserve.program.backends import Backend, EngineBackend, RuntimeEndpoint
from radixserve.program.choices import (
    ChoicesMethod,
    greedy_token_selection,
    token_length_normalized,
    unconditional_likelihood_normalized,
)
from radixserve.program.function import Program, function, set_default_backend
from radixserve.program.ir import assistant, gen, select, system, user
from radixserve.program.state import ProgramState, ProgramStateGroup

__all__ = [
    "Backend",
    "ChoicesMethod",
    "EngineBackend",
    "Program",
    "ProgramState",
    "ProgramStateGroup",
    "RuntimeEndpoint",
    "assistant",
    "function",
    "gen",
    "greedy_token_selection",
    "select",
    "set_default_backend",
    "system",
    "token_length_normalized",
    "unconditional_likelihood_normalized",
    "user",
]
