"""The LoRA adapter in the radix tree's namespace: no sharing across adapters, and KV events
that name the adapter."""

from __future__ import annotations

import numpy as np

from radixserve.cache.kv_events import KVEventRecorder, lora_id
from radixserve.cache.namespace import cache_namespace, split_namespace
from radixserve.cache.radix_tree import RadixCache


def test_namespaces_split_back_into_salt_and_adapter() -> None:
    assert split_namespace(cache_namespace("tenant", None)) == ("tenant", None)
    assert split_namespace(cache_namespace("", "sql@0123abcd")) == ("", "sql")
    assert split_namespace(cache_namespace("tenant", "sql@0123abcd")) == ("tenant", "sql")
    # a salt that looks like an adapter's namespace is still a plain salt of the base model
    assert cache_namespace("lora:sql", None) != cache_namespace("", "sql@0123abcd")


def test_adapters_never_share_a_prefix_and_their_events_name_them() -> None:
    tree = RadixCache(page_size=4, free_slots=lambda _: None, events=KVEventRecorder(4))
    tokens = np.arange(10, 26, dtype=np.int64)
    spaces = ["", cache_namespace("", "a@1111"), cache_namespace("t", "a@1111"),
              cache_namespace("", "a@2222"), cache_namespace("", "b@1111")]
    for i, ns in enumerate(spaces):
        assert len(tree.match_prefix(tokens, ns).slots) == 0  # nothing another one computed
        tree.insert(tokens, np.arange(16, dtype=np.int64) + 16 * i, ns)
        assert len(tree.match_prefix(tokens, ns).slots) == 16
    stored = [e for e in tree.events.take() if e["type"] == "BlockStored"]
    assert len(stored) == len(spaces)
    assert [e.get("lora_name") for e in stored] == [None, "a", "a", "a", "b"]
    assert [e["lora_id"] for e in stored] == [None, lora_id("a"), lora_id("a"), lora_id("a"),
                                              lora_id("b")]
    assert [e.get("cache_salt") for e in stored] == [None, None, "t", None, None]
    hashes = [h for e in stored for h in e["block_hashes"]]
    assert len(set(hashes)) == len(hashes) == 4 * len(spaces)  # every namespace its own hashes
