"""Speculative algorithms by name (``--speculative-algorithm``), each imported when it is used.

A new algorithm is a :class:`~radixserve.speculative.base.Proposer` subclass in its own file and
one entry here (and its name in ``config.SPECULATIVE_ALGORITHMS``, which the settings check reads:
the config sits below this package and cannot import it; a test keeps the two equal).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.config import ServerArgs
    from radixserve.speculative.base import Proposer

_REGISTRY: dict[str, str] = {
    "ngram": "radixserve.speculative.ngram:NgramProposer",
}


def proposer_names() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def proposer_class(name: str) -> type[Proposer]:
    """The proposer class registered as ``name``; ValueError for an unknown one."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown speculative algorithm {name!r}; "
                         f"known: {', '.join(proposer_names())}")
    module_name, class_name = _REGISTRY[name].split(":")
    return getattr(importlib.import_module(module_name), class_name)


def make_proposer(name: str, args: ServerArgs) -> Proposer:
    """The proposer ``name`` with the server's settings; ValueError for an unknown name."""
    return proposer_class(name).from_args(args)


def server_proposer(args: ServerArgs) -> Proposer | None:
    """The server's proposer: None without ``--speculative-algorithm``."""
    if args.speculative_algorithm is None:
        return None
    return make_proposer(args.speculative_algorithm, args)


def steps_carry_drafts(args: ServerArgs) -> bool:
    """Whether a step of this server can ever carry drafts (several rows of one request in a
    decode): its proposer's class says so, and without a proposer none does.  Known before the
    model loads, for the quantized weights' one-row path (``quantization/``)."""
    if args.speculative_algorithm is None:
        return False
    return proposer_class(args.speculative_algorithm).carries_drafts
