"""Grammar compilation off the step loop: one worker thread, a cache keyed by the grammar text.

The scheduler calls :meth:`GrammarCompiler.submit` when a constrained request arrives and
:meth:`GrammarCompiler.poll` each step; a request whose grammar is still compiling stays in
the waiting queue without holding up the others.  A grammar that does not compile is cached
as a :class:`GrammarError`, so a client repeating the same bad request is answered at once.
The compiled grammar is shared by every request that uses the same text; matchers are per
request (see ``matcher.py``).
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

logger = logging.getLogger(__name__)

GrammarKey = tuple[str, str]  # (kind, text): kind is a SamplingParams grammar field name
CACHE_ENTRIES = 1024  # compiled grammars kept (LRU); each is small next to the model


class GrammarError(ValueError):
    """The grammar text is not valid; the message names the field and the problem."""


class GrammarCompiler:
    """Compiles json_schema / regex / ebnf / structural_tag texts with xgrammar."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        import xgrammar as xgr

        self._xgr = xgr
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=list(stop_token_ids) or None
        )
        self.vocab_size = vocab_size
        # xgrammar parallelises the mask precomputation of one grammar; two threads leave the
        # step loop a core on small machines.  Its own cache is off: it has no size limit by
        # default (memory grew with every distinct grammar); ``_cache`` below is the LRU.
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=2,
                                             cache_enabled=False)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-compile")
        self._lock = threading.Lock()
        self._cache: OrderedDict[GrammarKey, Future] = OrderedDict()
        self.compile_seconds: dict[GrammarKey, float] = {}  # cold compile time, for stats
        self._utf8_words: torch.Tensor | None = None
        self._json_words: torch.Tensor | None = None
        # The token tables take a noticeable time to build: build them now in the worker, so the
        # first grammar request does not pay for them.
        self._pool.submit(lambda: self.json_words)

    def _words_without(self, bad: Callable[[bytes], bool]) -> torch.Tensor:
        allowed = np.ones(-(-self.vocab_size // 32) * 32, dtype=np.uint8)
        special = set(self.tokenizer_info.special_token_ids)
        for tok, piece in enumerate(self.tokenizer_info.decoded_vocab):
            if tok < self.vocab_size and tok not in special and bad(piece):
                allowed[tok] = 0
        return torch.from_numpy(np.packbits(allowed, bitorder="little").view(np.int32).copy())

    @property
    def utf8_words(self) -> torch.Tensor:
        """``[V/32]`` int32 bitmask ANDed into every grammar's mask: tokens that hold or end
        in the first bytes of a UTF-8-encoded surrogate (ED A0..BF) are refused.  xgrammar
        0.2.9's character classes admit such sequences, which are not UTF-8 and decode to
        three U+FFFD characters (breaking maxLength and regex matches)."""
        if self._utf8_words is None:
            self._utf8_words = self._words_without(
                lambda b: b.endswith(b"\xed") or _SURROGATE.search(b) is not None
            )
        return self._utf8_words

    @property
    def json_words(self) -> torch.Tensor:
        """``utf8_words`` less the tokens holding a control byte (< 0x20), for JSON-schema
        rows: xgrammar 0.2.9 lets raw control characters into strings with length bounds,
        which ``json.loads`` refuses; no valid one-line JSON contains such a byte."""
        if self._json_words is None:
            self._json_words = self.utf8_words & self._words_without(
                lambda b: any(c < 0x20 for c in b)
            )
        return self._json_words

    # ---- requests ----------------------------------------------------------------------
    def submit(self, key: GrammarKey) -> Future:
        """The (possibly finished) compilation of ``key``; compiled once, then shared."""
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                return fut
            fut = self._pool.submit(self._compile_timed, key)
            self._cache[key] = fut
            while len(self._cache) > CACHE_ENTRIES:
                old, _ = self._cache.popitem(last=False)
                self.compile_seconds.pop(old, None)  # keyed by the text: bounded with the cache
            return fut

    def compile_now(self, key: GrammarKey) -> Any:
        """Compile (or fetch) synchronously: the CompiledGrammar, or raises GrammarError."""
        return self.submit(key).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # ---- compilation -------------------------------------------------------------------
    def _compile_timed(self, key: GrammarKey) -> Any:
        self.json_words  # noqa: B018 - built by the warm-up task before any compile
        t0 = time.perf_counter()
        try:
            return self._compile(key)
        finally:
            with self._lock:
                if key in self._cache:  # not evicted while it compiled
                    self.compile_seconds[key] = time.perf_counter() - t0

    def _compile(self, key: GrammarKey) -> Any:
        kind, text = key
        c = self._compiler
        try:
            if kind == "json_schema":
                schema = _parse_json(kind, text)
                if not isinstance(schema, (dict, bool)):
                    raise GrammarError("json_schema must be a JSON object (a JSON schema)")
                # One-line JSON with ", " and ": " (json.dumps' default), not "any whitespace":
                # it keeps random or weak models out of endless whitespace, and it makes keys,
                # braces and separators forced text that jump-forward can append at once.
                return c.compile_json_schema(text, any_whitespace=False, strict_mode=True)
            if kind == "regex":
                return c.compile_regex(text)
            if kind == "ebnf":
                return c.compile_grammar(text, root_rule_name="root")
            if kind == "structural_tag":
                _parse_json(kind, text)
                return c.compile_structural_tag(text)
        except GrammarError:
            raise
        except Exception as e:  # xgrammar reports bad grammars as RuntimeError/ValueError
            raise GrammarError(f"invalid {kind}: {_short(e)}") from None
        raise GrammarError(f"unknown grammar kind {kind!r}")


def _parse_json(kind: str, text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"invalid {kind}: not valid JSON ({e})") from None


_SURROGATE = re.compile(rb"\xed[\xa0-\xbf]")
# xgrammar prefixes its messages with a time and a C++ source location.
_XGRAMMAR_PREFIX = re.compile(r"^(\[[\d:]+\] )?\S+\.(cc|h):\d+: (Check failed: .*? is false: )?")


def _short(e: Exception, limit: int = 500) -> str:
    msg = _XGRAMMAR_PREFIX.sub("", " ".join(str(e).split()))
    return msg if len(msg) <= limit else msg[: limit - 3] + "..."
