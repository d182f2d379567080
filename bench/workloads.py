"""Benchmark workloads built from real English text that is available offline.

The text is the docstrings of a fixed list of Python standard-library modules (and of their
public classes and functions), split into paragraphs. A seeded shuffle of the paragraphs is
tokenized into one stream, and every prompt piece is a fresh, non-overlapping window of that
stream cut to an exact token count, so no two pieces share text by construction.

``shared_prefix_workload`` is the "generated-shared-prefix" shape of SGLang's benchmarks:
``groups`` system prompts of ``system_len`` tokens, each followed by ``questions`` questions
of ``question_len`` tokens, interleaved across groups (g0q0, g1q0, ..., g0q1, g1q1, ...).
"""

from __future__ import annotations

import ast
import importlib
import inspect
import json
import random
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

# Pure-Python modules with long prose docstrings; order fixes the corpus.
CORPUS_MODULES = (
    "argparse", "asyncio.events", "asyncio.queues", "asyncio.tasks", "base64", "bisect",
    "calendar", "collections", "configparser", "contextlib", "copy", "csv", "dataclasses",
    "datetime", "decimal", "difflib", "email.message", "enum", "fractions", "ftplib",
    "functools", "gettext", "glob", "gzip", "heapq", "hmac", "http.client", "http.cookiejar",
    "imaplib", "inspect", "ipaddress", "json", "logging", "mailbox", "numbers", "optparse",
    "os", "pathlib", "pickle", "pprint", "pydoc", "queue", "random", "re", "sched", "shlex",
    "shutil", "smtplib", "socket", "statistics", "string", "subprocess", "tarfile",
    "tempfile", "textwrap", "threading", "timeit", "tokenize", "traceback", "typing",
    "unittest.case", "urllib.parse", "urllib.request", "uuid", "warnings", "weakref",
    "zipfile",
)
MIN_PARAGRAPH_WORDS = 8


def _source_functions(module: Any) -> dict[str, str]:
    """The docstrings of the module's top-level functions as its source defines them."""
    try:  # the file itself: inspect.getsource goes through the function that may be replaced
        with open(module.__file__, encoding="utf-8") as f:
            tree = ast.parse(f.read())
    except (OSError, TypeError, SyntaxError):
        return {}
    return {node.name: ast.get_docstring(node) or "" for node in tree.body
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))}


def _docstrings(module_name: str) -> Iterator[str]:
    """The module's docstring, then those of its own public classes, their methods, functions.
    A function another import replaced at run time (torch replaces ``inspect.getfile``) keeps
    its source's docstring, so the corpus does not depend on what the process imported first."""
    module = importlib.import_module(module_name)
    yield inspect.getdoc(module) or ""
    source_functions: dict[str, str] | None = None
    for name, obj in sorted(vars(module).items()):
        if name.startswith("_") or not (inspect.isclass(obj) or inspect.isfunction(obj)):
            continue
        if obj.__module__ != module.__name__:  # re-exported from elsewhere, or replaced
            if source_functions is None:
                source_functions = _source_functions(module)
            if inspect.isfunction(obj) and name in source_functions:
                yield source_functions[name]
            continue
        if inspect.isclass(obj):
            yield inspect.getdoc(obj) or ""
            for attr, member in sorted(vars(obj).items()):
                if not attr.startswith("_") and inspect.isfunction(member):
                    yield inspect.getdoc(member) or ""
        elif inspect.isfunction(obj):
            yield inspect.getdoc(obj) or ""


def _is_prose(paragraph: str) -> bool:
    """Keep paragraphs of English sentences; drop code samples, tables and signatures."""
    words = paragraph.split()
    if len(words) < MIN_PARAGRAPH_WORDS or paragraph.lstrip().startswith((">>>", "..")):
        return False
    letters = sum(c.isalpha() or c.isspace() for c in paragraph)
    return letters / len(paragraph) > 0.85


def english_paragraphs() -> list[str]:
    """Deduplicated prose paragraphs of the corpus modules, in a fixed order."""
    seen: set[str] = set()
    paragraphs: list[str] = []
    for module_name in CORPUS_MODULES:
        with warnings.catch_warnings():  # e.g. typing.io: deprecated names still get read
            warnings.simplefilter("ignore", DeprecationWarning)
            docs = list(_docstrings(module_name))
        for doc in docs:
            for block in doc.split("\n\n"):
                text = " ".join(block.split())
                if text not in seen and _is_prose(text):
                    seen.add(text)
                    paragraphs.append(text)
    return paragraphs


class TokenStream:
    """Seeded shuffle of the corpus paragraphs, tokenized lazily; hands out disjoint windows."""

    def __init__(self, tokenizer: Any, seed: int) -> None:
        self.tokenizer = tokenizer
        self.paragraphs = english_paragraphs()
        random.Random(seed).shuffle(self.paragraphs)
        self.next_paragraph = 0
        self.buffer: list[int] = []

    def take(self, n: int) -> list[int]:
        """The next ``n`` tokens of the stream, exactly."""
        while len(self.buffer) < n:
            if self.next_paragraph == len(self.paragraphs):
                raise ValueError(
                    f"the corpus ran out of text: {len(self.paragraphs)} paragraphs are not "
                    f"enough for this workload; shrink it"
                )
            text = self.paragraphs[self.next_paragraph] + "\n\n"
            self.next_paragraph += 1
            self.buffer.extend(self.tokenizer.encode(text, add_special_tokens=False))
        window, self.buffer = self.buffer[:n], self.buffer[n:]
        return window


@dataclass(frozen=True)
class SharedPrefixWorkload:
    groups: int
    questions: int  # per group
    system_len: int
    question_len: int
    prompts: list[list[int]]  # interleaved: prompts[i] belongs to group i % groups
    group_of: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.prompts)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def unique_tokens(self) -> int:
        """Tokens a perfect prefix cache computes: each system prompt once, every question."""
        return self.groups * self.system_len + self.num_requests * self.question_len


def shared_prefix_workload(
    tokenizer: Any, groups: int, questions: int, system_len: int, question_len: int, seed: int
) -> SharedPrefixWorkload:
    """``groups`` x ``questions`` prompts of exactly ``system_len + question_len`` tokens."""
    if min(groups, questions, system_len, question_len) < 1:
        raise ValueError("groups, questions, system_len and question_len must be >= 1")
    stream = TokenStream(tokenizer, seed)
    systems = [stream.take(system_len) for _ in range(groups)]
    prompts, group_of = [], []
    for _ in range(questions):
        for g in range(groups):
            prompts.append(systems[g] + stream.take(question_len))
            group_of.append(g)
    return SharedPrefixWorkload(groups, questions, system_len, question_len, prompts, group_of)


def short_prompts(tokenizer: Any, count: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``count`` distinct prompts of exactly ``prompt_len`` tokens (a decode-heavy load)."""
    stream = TokenStream(tokenizer, seed + 1_000_003)  # text apart from the main workload's
    return [stream.take(prompt_len) for _ in range(count)]


# ---- serving workloads (bench/serving.py) ----------------------------------------------------
@dataclass(frozen=True)
class MultiTurnWorkload:
    """``conversations`` chats of ``turns`` user turns each; every chat opens with its own
    system prompt. Turn ``t``'s prompt is the whole history: system, then for each earlier turn
    its question and the answer the server gave, then question ``t`` (answers are only known
    at run time, so the client appends them)."""

    conversations: int
    turns: int
    system_len: int
    question_len: int
    systems: list[list[int]]
    questions: list[list[list[int]]]  # questions[c][t]


def multi_turn_workload(
    tokenizer: Any, conversations: int, turns: int, system_len: int, question_len: int, seed: int
) -> MultiTurnWorkload:
    """Distinct text for every system prompt and question (reuse comes from the history only)."""
    if min(conversations, turns, system_len, question_len) < 1:
        raise ValueError("conversations, turns, system_len and question_len must be >= 1")
    stream = TokenStream(tokenizer, seed + 2_000_003)
    systems = [stream.take(system_len) for _ in range(conversations)]
    questions = [[stream.take(question_len) for _ in range(turns)] for _ in range(conversations)]
    return MultiTurnWorkload(conversations, turns, system_len, question_len, systems, questions)


def unique_prompts(tokenizer: Any, count: int, prompt_len: int, seed: int) -> list[list[int]]:
    """``count`` prompts of exactly ``prompt_len`` tokens with no text in common (no reuse)."""
    if min(count, prompt_len) < 1:
        raise ValueError("count and prompt_len must be >= 1")
    stream = TokenStream(tokenizer, seed + 3_000_017)
    return [stream.take(prompt_len) for _ in range(count)]


# ---- offline runs (bench/offline.py) -------------------------------------------------------
@dataclass(frozen=True)
class OfflineTurns:
    """A workload as batches submitted one after the other, each once the previous one is done.

    Turn 0 submits ``first``; turn ``t >= 1`` resends each request's turn ``t - 1`` prompt and
    answer (exactly ``output_len`` tokens), followed by ``followups[t - 1][i]``.
    """

    name: str
    first: list[list[int]]
    followups: list[list[list[int]]]
    output_len: int
    unique_tokens: int  # prompt tokens a perfect prefix cache computes

    @property
    def num_turns(self) -> int:
        return 1 + len(self.followups)

    @property
    def num_requests(self) -> int:
        return self.num_turns * len(self.first)

    @property
    def prompt_tokens(self) -> int:
        turn = sum(len(p) for p in self.first)
        total = turn
        for extra in self.followups:
            turn += len(extra) * self.output_len + sum(len(q) for q in extra)
            total += turn
        return total

    def prompts(self, turn: int, previous: list[list[int]], answers: list[list[int]]) -> list[list[int]]:
        """Turn ``turn``'s prompts, given turn ``turn - 1``'s prompts and answers."""
        if turn == 0:
            return self.first
        extra = self.followups[turn - 1]
        return [p + a + q for p, a, q in zip(previous, answers, extra, strict=True)]


def offline_shared_prefix(work: SharedPrefixWorkload, output_len: int) -> OfflineTurns:
    """The shared-prefix prompts as one batch."""
    return OfflineTurns("shared-prefix", work.prompts, [], output_len, work.unique_tokens)


def offline_multi_turn(work: MultiTurnWorkload, output_len: int) -> OfflineTurns:
    """Turn ``t`` of every conversation in one batch, turn after turn.  A perfect cache computes
    each system prompt and question once and, of each earlier answer, only its last token:
    the others went through the model while it was decoded, and stay in the cache."""
    first = [system + qs[0] for system, qs in zip(work.systems, work.questions, strict=True)]
    followups = [[qs[t] for qs in work.questions] for t in range(1, work.turns)]
    unique = work.conversations * (work.system_len + work.turns * work.question_len + work.turns - 1)
    return OfflineTurns("multi-turn", first, followups, output_len, unique)


class BlockTexts:
    """Token blocks named by ids: equal ids give equal blocks, distinct ids distinct text.

    Blocks are consecutive windows of the corpus stream, handed out in order of first use;
    when the corpus runs out a reshuffled pass continues (text may then repeat, but not at the
    same position of a prompt, so prefixes stay distinct).
    """

    def __init__(self, tokenizer: Any, block_len: int, seed: int) -> None:
        self.tokenizer, self.block_len, self.seed = tokenizer, block_len, seed
        self.passes = 0
        self.stream = TokenStream(tokenizer, seed + 4_000_037)
        self.blocks: dict[Any, list[int]] = {}

    def block(self, key: Any) -> list[int]:
        if key not in self.blocks:
            try:
                self.blocks[key] = self.stream.take(self.block_len)
            except ValueError:  # the corpus ran out: start another shuffled pass
                self.passes += 1
                self.stream = TokenStream(self.tokenizer, self.seed + 4_000_037 + self.passes)
                self.blocks[key] = self.stream.take(self.block_len)
        return self.blocks[key]

    def prompt(self, keys: list[Any], length: int, salt: Any) -> list[int]:
        """Blocks ``keys`` joined, then cut to ``length`` tokens or extended by text of its own
        (``salt`` names the prompt, so two prompts never share their filler)."""
        ids = [t for k in keys for t in self.block(k)][:length]
        filler = 0
        while len(ids) < length:
            ids += self.block(("filler", salt, filler))[: length - len(ids)]
            filler += 1
        return ids


@dataclass(frozen=True)
class TraceRequest:
    at: float  # seconds after the first request of the trace
    prompt: list[int]
    output_len: int


def _first(record: dict[str, Any], names: tuple[str, ...], line: int) -> Any:
    for name in names:
        if name in record:
            return record[name]
    raise ValueError(f"trace line {line}: needs one of {', '.join(names)}")


def load_trace(
    path: str, tokenizer: Any, seed: int, block_len: int = 512, time_unit: float = 1.0
) -> list[TraceRequest]:
    """Requests of a JSONL trace, sorted by time; one JSON object a line.

    Fields: ``timestamp`` (send time, in units of ``time_unit`` seconds; relative to the
    first line); the prompt as ``prompt`` (text), ``input_ids`` (token ids) or
    ``input_length`` (tokens of corpus text; with ``hash_ids`` the prompt is those blocks of
    ``block_len`` tokens, so lines that share leading hash ids share a prefix: the Mooncake
    trace format); ``output_length`` (or ``output_len`` / ``max_tokens``).
    """
    blocks = BlockTexts(tokenizer, block_len, seed)
    out: list[tuple[float, int, list[int], int]] = []
    with open(path) as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                rec = json.loads(raw)
            except json.JSONDecodeError as e:
                raise ValueError(f"trace line {n}: not JSON ({e})") from None
            if not isinstance(rec, dict):
                raise ValueError(f"trace line {n}: expected a JSON object")
            at = float(_first(rec, ("timestamp",), n)) * time_unit
            if "prompt" in rec:
                ids = tokenizer.encode(str(rec["prompt"]), add_special_tokens=False)
            elif "input_ids" in rec:
                ids = [int(t) for t in rec["input_ids"]]
            else:
                length = int(_first(rec, ("input_length", "input_len"), n))
                ids = blocks.prompt(list(rec.get("hash_ids") or []), length, salt=n)
            output_len = int(_first(rec, ("output_length", "output_len", "max_tokens"), n))
            if not ids or output_len < 1:
                raise ValueError(f"trace line {n}: empty prompt or output length < 1")
            out.append((at, n, ids, output_len))
    if not out:
        raise ValueError(f"trace {path} has no requests")
    out.sort(key=lambda r: (r[0], r[1]))
    t0 = out[0][0]
    return [TraceRequest(at - t0, ids, output_len) for at, _, ids, output_len in out]
