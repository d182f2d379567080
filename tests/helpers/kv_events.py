"""A KV event consumer for tests, written from SGLang's format (not from radixserve's code): it
rebuilds which blocks each medium holds from BlockStored / BlockRemoved / AllBlocksCleared, and
refuses what a router could not make sense of (a block stored twice in one medium, a removal of
a block it never saw, a store whose parent it does not know).  ``sglang_block_hashes`` computes
the hashes SGLang gives the pages of a prompt, for comparison."""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from typing import Any


def sglang_block_hashes(tokens: Sequence[int], page_size: int, salt: str = "") -> list[int]:
    """SGLang's event hash of each whole page of ``tokens``: SHA-256 over the previous page's
    digest (or the salt's, for the first page of a salted prompt) and the page's token ids as
    little-endian uint32; the first 16 hex digits as a signed int64."""
    prior = hashlib.sha256(b"sglang-cache-salt-v1\0" + salt.encode()).digest() if salt else b""
    out = []
    for start in range(0, len(tokens) // page_size * page_size, page_size):
        page = tokens[start:start + page_size]
        digest = hashlib.sha256(prior + struct.pack(f"<{len(page)}I", *page)).digest()
        value = int(digest.hex()[:16], 16)
        out.append(value - (1 << 64) if value >= 1 << 63 else value)
        prior = digest
    return out


class KVIndex:
    """What a router knows of one worker's cache from its events."""

    def __init__(self) -> None:
        self.blocks: dict[str, dict[int, tuple[int, ...]]] = {}  # medium -> hash -> the page's tokens
        self.parents: dict[int, int | None] = {}  # hash -> the block before it (None: first)
        self.salts: dict[int, str] = {}  # hash -> its store's cache_salt ("" when none)

    def apply(self, event: dict[str, Any]) -> None:
        kind = event["type"]
        if kind == "AllBlocksCleared":
            self.blocks.clear()
            return
        medium = self.blocks.setdefault(event["medium"], {})
        if kind == "BlockRemoved":
            for h in event["block_hashes"]:
                assert h in medium, f"removal of {h} not held in {event['medium']}"
                del medium[h]
            return
        assert kind == "BlockStored", event
        size, hashes, tokens = event["block_size"], event["block_hashes"], event["token_ids"]
        assert len(tokens) == size * len(hashes), event
        parent = event["parent_block_hash"]
        assert parent is None or parent in self.parents, f"store after the unknown block {parent}"
        for i, h in enumerate(hashes):
            assert h not in medium, f"block {h} stored twice in {event['medium']}"
            medium[h] = tuple(tokens[i * size:(i + 1) * size])
            self.parents[h] = parent
            self.salts[h] = event.get("cache_salt", "")
            parent = h

    def apply_batch(self, batch: list[Any]) -> None:
        """A decoded msgpack batch ``[ts, events, dp_rank]``."""
        _, events, dp_rank = batch
        assert dp_rank == 0
        for event in events:
            self.apply(event)

    def held(self) -> dict[str, set[int]]:
        return {medium: set(blocks) for medium, blocks in self.blocks.items() if blocks}

    def prompt_blocks(self, medium: str, tokens: Sequence[int], page_size: int, salt: str = "") -> int:
        """How many leading pages of ``tokens`` this worker holds in ``medium``, as a router's
        lookup finds them."""
        held = self.blocks.get(medium, {})
        n = 0
        for h in sglang_block_hashes(tokens, page_size, salt):
            if h not in held:
                break
            n += 1
        return n
