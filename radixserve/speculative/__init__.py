"""Speculative decoding: one proposer interface (``base.py``), one file per algorithm
(``ngram.py``), and the registry that builds the server's proposer by name (``registry.py``)."""

from __future__ import annotations

from radixserve.speculative.base import DraftReqView, DraftSlots, Proposer, SpecState
from radixserve.speculative.registry import (
    make_proposer,
    proposer_class,
    proposer_names,
    server_proposer,
    steps_carry_drafts,
)

__all__ = [
    "DraftReqView",
    "DraftSlots",
    "Proposer",
    "SpecState",
    "make_proposer",
    "proposer_class",
    "proposer_names",
    "server_proposer",
    "steps_carry_drafts",
]
