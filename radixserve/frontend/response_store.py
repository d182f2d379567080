"""Stored Responses (``store: true``): what ``GET /v1/responses/{id}`` returns and what a later
``previous_response_id`` continues.

In memory, in the HTTP process, per server: a restart forgets every response.  Bounded by
count and bytes (``--response-store-size``, ``--response-store-bytes``); past either, the
oldest go first.  Every entry belongs to a tenant, the pair of the request's API key (a digest
of its ``Authorization`` header's bearer token) and its ``cache_salt``: a lookup from any other
tenant finds nothing, exactly as for an id that never existed.  ``running`` maps the responses
being generated to their request ids, for ``POST /v1/responses/{id}/cancel``.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from radixserve.chat.responses import size_of


def tenant(request: Request, cache_salt: str | None) -> str:
    """The namespace of a request's stored responses: its bearer token's digest and salt."""
    token = request.headers.get("authorization", "").strip()
    return hashlib.sha256(token.encode()).hexdigest()[:32] + "/" + (cache_salt or "")


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the response object as returned
    messages: list[dict[str, Any]]  # its conversation (input and output) as chat messages
    # its conversation's token ids as the model saw and generated them (prompt + output): the
    # next turn's prompt starts with them where the chat template renders them again
    ids: list[int] = field(default_factory=list)
    pinned: bool = False  # ``ids`` are pinned in the radix tree
    salt: str = ""  # the cache namespace of the pin
    lora: str | None = None  # and its LoRA adapter
    size: int = 0

    def __post_init__(self) -> None:
        self.size = size_of(self.response) + size_of(self.messages) + 8 * len(self.ids)


class ResponseStore:
    def __init__(self, max_count: int, max_bytes: int) -> None:
        self.max_count = max_count
        self.max_bytes = max_bytes
        self.bytes = 0
        self._entries: OrderedDict[tuple[str, str], StoredResponse] = OrderedDict()
        self.running: set[tuple[str, str]] = set()  # (tenant, response id) being generated

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, namespace: str, rid: str, entry: StoredResponse) -> list[StoredResponse]:
        """Store ``entry``; the entries dropped to make room (oldest first), it included when
        it alone is over the bounds."""
        key = (namespace, rid)
        old = self._entries.pop(key, None)
        if old is not None:
            self.bytes -= old.size
        self._entries[key] = entry
        self.bytes += entry.size
        dropped = []
        while self._entries and (len(self._entries) > self.max_count
                                 or self.bytes > self.max_bytes):
            _, gone = self._entries.popitem(last=False)
            self.bytes -= gone.size
            dropped.append(gone)
        return dropped

    def get(self, namespace: str, rid: str) -> StoredResponse | None:
        return self._entries.get((namespace, rid))

    def pop(self, namespace: str, rid: str) -> StoredResponse | None:
        entry = self._entries.pop((namespace, rid), None)
        if entry is not None:
            self.bytes -= entry.size
        return entry
