"""The scheduler's KV memory, built once from the settings and the model.

Sizes the pool (``--max-total-tokens``, else from free memory and
``--kv-cache-memory-fraction``), then builds what shares it: the page allocator, the
request-to-token table, the radix tree over the pool's slots, the KV pool itself, the host and
disk tiers when asked for, the KV manager that moves requests' slots between them, the pins, and
the publisher of the tree's KV events when ``--kv-events-config`` asks for one.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.cache.allocator import PageAllocator
from radixserve.cache.kv_events import KVEventRecorder
from radixserve.cache.kv_pool import KVPool, kv_bytes_per_token
from radixserve.cache.radix_tree import RadixCache
from radixserve.cache.req_to_token import ReqToTokenPool
from radixserve.cache.tiers import TierManager
from radixserve.config import DEFAULT_MAX_RUNNING_REQUESTS, ServerArgs
from radixserve.ipc.kv_publisher import KVEventPublisher
from radixserve.scheduler.kv_manager import KVManager
from radixserve.scheduler.pins import Pins
from radixserve.settings.kv_events_config import KVEventsConfig

MAX_AUTO_POOL_TOKENS = 1 << 17


def weights_fingerprint(model: torch.nn.Module) -> str:
    """A cheap hash of the weights (a few values of every tensor): a disk KV tier written by
    other weights under the same name is not read."""
    h = hashlib.blake2b(digest_size=16)
    for name, p in model.state_dict().items():
        h.update(name.encode() + str(tuple(p.shape)).encode())
        h.update(p.detach().reshape(-1)[:64].float().cpu().numpy().tobytes())
    return h.hexdigest()


def auto_pool_tokens(bytes_per_token: int, fraction: float, device: torch.device) -> int:
    """KV pool size from free memory when ``max_total_tokens`` is not given."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return max(1024, min(MAX_AUTO_POOL_TOKENS, int(free * fraction) // bytes_per_token))


@dataclass
class KVMemory:
    pool_tokens: int  # whole pages
    max_running: int
    allocator: PageAllocator
    req_pool: ReqToTokenPool
    tree: RadixCache
    kv_pool: KVPool
    tiers: TierManager | None
    kv: KVManager
    pins: Pins
    kv_events: KVEventPublisher | None

    @classmethod
    def build(
        cls,
        args: ServerArgs,
        model: torch.nn.Module,
        model_config: Any,
        device: torch.device,
        dtype: torch.dtype,
    ) -> KVMemory:
        context_len = args.context_length or model_config.max_context_len
        # This rank's KV heads (all of them without tensor parallelism).  Ranks on one CPU share
        # its memory: the pool is sized for all of them.
        kv_heads = getattr(model, "num_local_kv_heads", model_config.num_kv_heads)
        head_dim, layers = model_config.head_dim, model_config.num_layers
        ranks_per_memory = args.tp_size if device.type == "cpu" else 1
        token_bytes = kv_bytes_per_token(layers, kv_heads, head_dim, dtype, args.kv_cache_dtype)
        pool_tokens = args.max_total_tokens or auto_pool_tokens(
            token_bytes * ranks_per_memory, args.kv_cache_memory_fraction, device)
        num_pages = max(1, pool_tokens // args.page_size)
        pool_tokens = num_pages * args.page_size
        max_running = args.max_running_requests or DEFAULT_MAX_RUNNING_REQUESTS

        allocator = PageAllocator(num_pages, args.page_size)
        req_pool = ReqToTokenPool(max_running, context_len + args.page_size, device)
        events = KVEventsConfig.of(args.kv_events_config)
        recorder = KVEventRecorder(args.page_size, events.enabled)
        tree = RadixCache(args.page_size, allocator.free_slots, disable=args.disable_radix_cache,
                          eviction_policy=args.radix_eviction_policy, events=recorder)
        kv_pool = KVPool(allocator.num_slots, layers, kv_heads, head_dim, dtype, device,
                         kv_cache_dtype=args.kv_cache_dtype)
        tiers = _tiers(args, kv_pool, tree, pool_tokens, model, model_config)
        kv = KVManager(allocator, req_pool, tree, tiers, swap=args.preemption_mode == "swap")
        pins = Pins(tree, int(args.max_pinned_fraction * pool_tokens))
        publisher = KVEventPublisher(events) if events.enabled else None
        return cls(
            pool_tokens, max_running, allocator, req_pool, tree, kv_pool, tiers, kv, pins, publisher
        )


def _tiers(
    args: ServerArgs,
    kv_pool: KVPool,
    tree: RadixCache,
    pool_tokens: int,
    model: torch.nn.Module,
    model_config: Any,
) -> TierManager | None:
    """The host and disk KV tiers the settings ask for (None: neither)."""
    host = args.host_cache_size
    if args.preemption_mode == "swap" and not host:
        host = 2 * pool_tokens  # swapping needs somewhere to go
    if not host and not args.disk_cache_dir:
        return None
    identity = {"model": args.model or "default", "config": repr(model_config),
                "weights": weights_fingerprint(model), "quantization": args.quantization}
    tiers = TierManager(
        kv_pool, args.page_size, host, args.disk_cache_dir, args.disk_cache_size, identity
    )
    tiers.attach(tree)
    return tiers
