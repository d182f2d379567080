"""The program benchmark's workload: the branching program, the same logic as chat calls, and
the count of a workload's unique prompt tokens.

Each of ``programs`` programs reads one of ``documents`` long documents (a fresh window of
real English text cut to ``doc_len`` tokens, see ``bench/workloads.py``; program ``i`` reads
document ``i % documents``) in its system message, and one support ticket of its own
(``bench/structured_workload.py``) in the user message, then:

1. ``select`` the ticket's category among :data:`LABELS`;
2. ``fork`` into :data:`BRANCH_TASKS`, one greedy ``gen`` of ``gen_len`` tokens each
   (``ignore_eos``, so every length is fixed);
3. join, and one last ``gen`` of ``gen_len`` tokens from the branches' notes.

:func:`triage` is that program in the program API; :func:`chat_triage` is the same logic as
independent chat-completion calls, one per step, each with the whole message list.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from bench.structured_workload import ticket_texts
from bench.workloads import TokenStream
from radixserve.program import assistant, function, gen, select, system, user

SYSTEM = ("You are a support assistant of an online shop. Use the reference document below when "
          "it helps.\n\nReference document:\n{document}")
QUESTION = "{ticket}\n\nWhich category is this ticket: {labels}? Answer with the category only."
LABELS = ("billing", "shipping", "technical", "account")
LABEL_REGEX = "(" + "|".join(re.escape(label) for label in LABELS) + ")"
LABEL_MAX_TOKENS = 8  # room for the longest label (the grammar ends the answer there)
BRANCH_TASKS = (
    "Summarise the ticket in one sentence.",
    "Write the first lines of a reply to the customer.",
    "Which next step should the support team take?",
)
FINAL_TASK = "Notes from your colleagues:\n{notes}\n\nWrite the final answer to the customer."


@dataclass(frozen=True)
class BranchingWorkload:
    documents: list[str]
    tickets: list[str]  # one per program
    gen_len: int

    @property
    def programs(self) -> int:
        return len(self.tickets)

    def program_kwargs(self) -> list[dict[str, Any]]:
        """One ``triage`` / ``chat_triage`` argument dict per program, documents interleaved."""
        return [{"document": self.documents[i % len(self.documents)], "ticket": t, "gen_len": self.gen_len}
                for i, t in enumerate(self.tickets)]


def branching_workload(tokenizer: Any, programs: int, documents: int, doc_len: int, gen_len: int,
                       seed: int) -> BranchingWorkload:
    """Documents are disjoint windows of ``doc_len`` corpus tokens (decoded: a document re-encodes
    to about that many tokens); tickets are distinct and deterministic for ``seed``."""
    if min(programs, documents, doc_len, gen_len) < 1:
        raise ValueError("programs, documents, doc_len and gen_len must be >= 1")
    stream = TokenStream(tokenizer, seed + 5_000_011)  # text apart from the other workloads'
    docs = [tokenizer.decode(stream.take(doc_len)).strip() for _ in range(documents)]
    return BranchingWorkload(docs, ticket_texts(programs, seed), gen_len)


def first_messages(document: str, ticket: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": SYSTEM.format(document=document)},
            {"role": "user", "content": QUESTION.format(ticket=ticket, labels=", ".join(LABELS))}]


def final_task(notes: list[str]) -> str:
    return FINAL_TASK.format(notes="\n".join(f"{i}. {n.strip()}" for i, n in enumerate(notes, 1)))


@function
def triage(s: Any, document: str, ticket: str, gen_len: int) -> None:
    """The branching program; ``s.forks`` keeps the branches for the caller to read."""
    first_system, first_user = first_messages(document, ticket)
    s += system(first_system["content"])
    s += user(first_user["content"])
    s += assistant(select("label", choices=list(LABELS)))
    forks = s.fork(len(BRANCH_TASKS))
    for f, task in zip(forks, BRANCH_TASKS, strict=True):
        f += user(task)
        f += assistant(gen("note", max_tokens=gen_len, temperature=0, ignore_eos=True))
    forks.join()
    s += user(final_task([f["note"] for f in forks]))
    s += assistant(gen("answer", max_tokens=gen_len, temperature=0, ignore_eos=True))
    s.forks = forks


def program_result(state: Any) -> dict[str, Any]:
    return {"label": state["label"], "notes": [f["note"] for f in state.forks], "answer": state["answer"]}


# A chat call: (step kind, messages, extra create() arguments) -> the reply's text.
ChatCall = Callable[[str, list[dict[str, str]], dict[str, Any]], str]


def chat_triage(call: ChatCall, document: str, ticket: str, gen_len: int) -> dict[str, Any]:
    """:func:`triage` as independent chat calls: the select is a reply constrained to the
    labels (``regex``), the branches are concurrent calls, the join one more call."""
    messages = first_messages(document, ticket)
    label = call("select", messages, {"max_tokens": LABEL_MAX_TOKENS, "temperature": 0,
                                      "extra_body": {"regex": LABEL_REGEX}})
    messages = [*messages, {"role": "assistant", "content": label}]
    greedy = {"max_tokens": gen_len, "temperature": 0, "extra_body": {"ignore_eos": True}}
    with ThreadPoolExecutor(len(BRANCH_TASKS), thread_name_prefix="chat-branch") as pool:
        notes = list(pool.map(lambda task: call("branch", [*messages, {"role": "user", "content": task}], greedy),
                              BRANCH_TASKS))
    answer = call("final", [*messages, {"role": "user", "content": final_task(notes)}], greedy)
    return {"label": label, "notes": notes, "answer": answer}


def unique_prefix_tokens(prompts: list[list[int]]) -> int:
    """The number of distinct non-empty prefixes of ``prompts`` (token-id sequences): the nodes
    of their trie, i.e. the tokens a perfect prefix cache computes, each shared prefix once.

    In lexicographic order, the longest prefix a sequence shares with any earlier sequence is
    the one it shares with its predecessor, so each sequence adds ``len - lcp(predecessor)``
    prefixes not seen before.
    """
    total, prev = 0, []
    for p in sorted(prompts):
        lcp = 0
        for a, b in zip(prev, p, strict=False):
            if a != b:
                break
            lcp += 1
        total += len(p) - lcp
        prev = p
    return total
