"""What the executor reads of a request, and the prompt-logprob state it fills.

The scheduler decides which requests run and owns their state (``scheduler/request.py``'s
``Req``, ``KVRow`` and ``PromptLogprobs``); the executor runs them and sits below the scheduler,
so it names here the few fields it uses instead of importing those classes.  They satisfy these
protocols as they are.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from radixserve.sampling import SamplingParams


class KVRowView(Protocol):
    """A request's KV bookkeeping: its row of the request-to-token table and the tokens of
    ``fill_ids`` whose K/V is already written there."""

    @property
    def row(self) -> int | None: ...

    @property
    def computed_len(self) -> int: ...


class PromptLogprobView(Protocol):
    """One request's prompt logprobs, appended chunk by chunk (``executor/prompt_logprobs.py``).

    ``next_pos``: the next prompt position whose logits are owed; ``pending`` while it is
    below ``prompt_len - 1``.
    """

    prompt_len: int
    top_n: int
    next_pos: int
    sent: bool

    @property
    def logprobs(self) -> list[float | None]: ...

    @property
    def top(self) -> list[list[list[float]] | None]: ...

    @property
    def pending(self) -> bool: ...


class ReqView(Protocol):
    """A request in a forward: its tokens, where its K/V goes, and how to sample its next token."""

    prompt_ids: list[int]
    output_ids: list[int]
    params: SamplingParams
    seed: int
    return_logprob: bool
    top_logprobs_num: int
    lora_slot: int  # the slot of its LoRA adapter (lora/slots.py), -1: the base model

    @property
    def kv(self) -> KVRowView: ...

    @property
    def prompt_logprobs(self) -> PromptLogprobView | None: ...

    @property
    def output_len(self) -> int: ...

    def tokens(self, start: int, end: int | None = None) -> np.ndarray:
        """``fill_ids[start:end]`` (prompt then output ids) as an int64 view."""
