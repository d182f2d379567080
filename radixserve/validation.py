"""Checks on a request's inputs (token ids, text), shared by the front end and the scheduler."""

from __future__ import annotations

import re

# JSON may spell a lone UTF-16 surrogate (``"\\ud800"``), and Python decodes it into a str
# that is not valid Unicode text: the tokenizer refuses it, and so does orjson between processes.
_SURROGATE = re.compile("[\ud800-\udfff]")


class FieldError(ValueError):
    """A request value is wrong; ``field`` names it as data (a sampling parameter's name, or
    ``logprob_start_len``; ``sampling_params``: the sampling object as a whole), so that an
    HTTP error body can say which request field it is about without reading the message."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def is_text(s: str) -> bool:
    """``s`` is valid Unicode text (it holds no lone surrogate)."""
    return _SURROGATE.search(s) is None


def check_input_ids(
    input_ids: object, vocab_size: int, context_len: int, pool_tokens: int
) -> list[int]:
    """Return the ids as a list of ints or raise ``ValueError`` saying what is wrong."""
    if not isinstance(input_ids, list | tuple) or not all(
        isinstance(t, int) and not isinstance(t, bool) for t in input_ids
    ):
        raise ValueError("input_ids must be a list of integers")
    if len(input_ids) == 0:
        raise ValueError("the prompt is empty")
    bad = [t for t in input_ids if t < 0 or t >= vocab_size]
    if bad:
        raise ValueError(
            f"token id {bad[0]} is outside the vocabulary [0, {vocab_size}) "
            f"({len(bad)} invalid id(s))"
        )
    if len(input_ids) >= context_len:
        raise ValueError(
            f"the prompt has {len(input_ids)} tokens; the context length is {context_len} "
            "(prompt plus at least one generated token must fit)"
        )
    if len(input_ids) + 1 > pool_tokens:
        raise ValueError(
            f"the prompt has {len(input_ids)} tokens but the KV pool holds {pool_tokens}"
        )
    return list(input_ids)


def check_logprob_start_len(logprob_start_len: object, prompt_len: int) -> None:
    """``-1`` (no prompt logprobs) or a prompt position ``[0, prompt_len]`` (``prompt_len``:
    none either, as SGLang allows); else ``ValueError``."""
    if not isinstance(logprob_start_len, int) or isinstance(logprob_start_len, bool):
        raise FieldError("logprob_start_len", "logprob_start_len must be an integer")
    if not -1 <= logprob_start_len <= prompt_len:
        raise FieldError(
            "logprob_start_len",
            f"logprob_start_len must be -1 or a prompt position in [0, {prompt_len}] "
            f"(the prompt has {prompt_len} tokens), got {logprob_start_len}"
        )
