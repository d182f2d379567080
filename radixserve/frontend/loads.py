"""SGLang's ``/v1/loads``: one load snapshot per data-parallel rank (a radixserve server is
one), which smg's load monitor polls (``?include=core``) for its load-aware policies and its
``/get_loads``.  The core keys are SGLang's, with the same meaning: requests running and
waiting, KV tokens in use (the pool less its free and evictable part), their share of the pool,
and counters since start; the sections (``memory``, ``spec``, ``lora``, ``disagg``,
``queues``) follow SGLang's names and are left out unless asked for (``all`` is the
default)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from radixserve import __version__
from radixserve.ipc.messages import ModelInfo

SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")


def parse_include(include: str | None) -> set[str]:
    """The sections a ``?include=`` query names (all of them when absent); ValueError naming
    an unknown one."""
    if not include:
        return {"all"}
    names = {s.strip() for s in include.split(",") if s.strip()}
    unknown = sorted(names - set(SECTIONS))
    if unknown:
        raise ValueError(f"unknown load sections {unknown}; valid: {list(SECTIONS)}")
    return names


@dataclass
class ThroughputWindow:
    """Generated tokens per second between two polls at least ``min_s`` apart (a poll sooner
    than that reads the last rate again)."""

    min_s: float = 1.0
    last: tuple[float, int] | None = None
    rate: float = 0.0

    def update(self, generated: int, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        if self.last is None:
            self.last = (now, generated)
        elif now - self.last[0] >= self.min_s:
            self.rate = (generated - self.last[1]) / (now - self.last[0])
            self.last = (now, generated)
        return self.rate


def load_snapshot(
    stats: dict[str, Any], info: ModelInfo, include: set[str], gen_rate: float
) -> dict[str, Any]:
    """One rank's snapshot from the scheduler's stats, with the sections ``include`` names."""
    page = info.page_size
    capacity = stats["total_pages"] * page
    used = max(0, (stats["total_pages"] - stats["free_pages"]) * page - stats["evictable_tokens"])
    waiting_tokens = stats.get("waiting_tokens", 0)
    usage = used / capacity if capacity else 0.0
    load: dict[str, Any] = {
        "timestamp": time.time(),
        "dp_rank": 0,
        "num_running_reqs": stats["running"],
        "num_waiting_reqs": stats["waiting"],
        "num_waiting_uncached_tokens": waiting_tokens,
        "num_used_tokens": used,
        "num_total_tokens": used + waiting_tokens,
        "num_active_tokens": used + waiting_tokens,
        "num_prealloc_ready_tokens": 0,
        "max_total_num_tokens": capacity,
        "max_running_requests": info.max_running_requests,
        "token_usage": round(usage, 4),
        "gen_throughput": round(gen_rate, 2),
        "cache_hit_rate": round(stats["cache_hit_rate"], 4),
        "utilization": round(max(usage, stats["running"] / max(1, info.max_running_requests)), 4),
        "total_prefill_uncached_tokens": stats["prefill_tokens_computed"],
        "total_prefill_busy_us": int(
            1e6 * max(0.0, stats["forward_seconds"] - stats["decode_only_seconds"])
        ),
        "decode_moments": None,
    }
    every = "all" in include
    if every or "memory" in include:
        load["memory"] = {"kv_cache_gb": round(capacity * info.kv_cache_bytes_per_token / 2**30, 3),
                          "token_capacity": capacity}
    if (every or "spec" in include) and stats.get("spec_verify_steps"):
        load["speculative"] = {
            "accept_length": stats["spec_accept_length"],
            "accept_rate": stats["spec_accepted_tokens"] / max(1, stats["spec_draft_tokens"]),
        }
    if (every or "lora" in include) and info.lora_enabled:
        # per LoRA adapter: its requests' prompt tokens and the share served from the cache
        load["lora"] = {"adapter_tokens": stats.get("adapter_tokens", {}),
                        "adapter_cache_hit_rate": stats.get("adapter_cache_hit_rate", {})}
    if every or "disagg" in include:
        # a prefill or decode worker's transfers: counts, bytes moved, seconds spent
        # (radixserve/disagg)
        load["disaggregation"] = stats.get("disaggregation") or {"mode": info.disaggregation_mode}
    if every or "queues" in include:
        load["queues"] = {"waiting": stats["waiting"], "grammar": stats.get("grammar_waiting", 0)}
    return load


def loads_document(loads: list[dict[str, Any]]) -> dict[str, Any]:
    return {"timestamp": datetime.now(timezone.utc).isoformat(), "version": __version__,
            "accelerator": None, "num_accelerators": 1, "loads": loads}
