"""Prometheus metrics (``/metrics``), all prefixed ``radixserve:``.

Front-end counters and latency histograms are updated per request; scheduler-side numbers
(retractions, evictions, running / queued requests, KV pages) are read from the scheduler's
stats at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from radixserve.runtime.pieces import RequestMeta

FINISH_REASONS = ("stop", "length", "abort")  # messages.py's finish_reason types
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)


class _SchedulerCollector(Collector):
    def __init__(self) -> None:
        self.stats: dict[str, Any] = {}

    def collect(self) -> Iterator[Any]:
        s = self.stats
        if not s:
            return
        for name, key, doc in (
            ("radixserve:num_retractions", "retractions",
             "requests retracted when KV memory ran out"),
            ("radixserve:num_priority_preemptions", "priority_preemptions",
             "running requests retracted for a waiting one of higher priority"),
            ("radixserve:evicted_tokens", "evicted_tokens", "tokens evicted from the radix tree"),
            ("radixserve:prefill_tokens_computed", "prefill_tokens_computed",
             "prompt tokens computed (not served from the cache)"),
            ("radixserve:cache_near_misses", "near_misses",
             "requests whose prefix match stopped inside a long cached sequence "
             "(GET /cache/misses)"),
        ):
            yield CounterMetricFamily(name, doc, value=s.get(key, 0))
        page = s.get("page_size", 1) or 1
        gauges = (
            ("radixserve:num_running_requests", s.get("running", 0),
             "requests decoding or prefilling"),
            ("radixserve:num_queued_requests", s.get("waiting", 0),
             "requests waiting for admission"),
            ("radixserve:kv_pages_free", s.get("free_pages", 0), "free KV pages"),
            ("radixserve:kv_pages_cached", s.get("tree_tokens", 0) // page,
             "KV pages held by the radix tree"),
            ("radixserve:kv_pages_pinned", s.get("pinned_tokens", 0) // page,
             "KV pages on pinned prefixes"),
            ("radixserve:num_pins", s.get("num_pins", 0), "live pins (POST /cache/pin)"),
            ("radixserve:kv_pages_used", s.get("total_pages", 0) - s.get("free_pages", 0),
             "KV pages in use (tree or requests)"),
            ("radixserve:kv_pages_total", s.get("total_pages", 0), "KV pages in the pool"),
            ("radixserve:cache_hit_rate", s.get("cache_hit_rate", 0.0),
             "cached / prompt tokens since start"),
        )
        for name, value, doc in gauges:
            yield GaugeMetricFamily(name, doc, value=value)
        yield from self._tiers(s)
        yield from self._speculative(s)

    @staticmethod
    def _speculative(s: dict[str, Any]) -> Iterator[Any]:
        """Speculative decoding, when the server has it (SGLang's spec_accept_length)."""
        if "spec_verify_steps" not in s:
            return
        for name, key, doc in (
            ("radixserve:spec_verify_steps", "spec_verify_steps",
             "request decode steps that verified drafts (or none)"),
            ("radixserve:spec_draft_tokens", "spec_draft_tokens", "draft tokens proposed"),
            ("radixserve:spec_accepted_tokens", "spec_accepted_tokens", "draft tokens accepted"),
        ):
            yield CounterMetricFamily(name, doc, value=s[key])
        yield GaugeMetricFamily("radixserve:spec_accept_length",
                                "tokens per verify step since start",
                                value=s["spec_accept_length"])
        yield GaugeMetricFamily("radixserve:spec_accept_rate",
                                "accepted / proposed draft tokens since start",
                                value=s["spec_accept_rate"])

    @staticmethod
    def _tiers(s: dict[str, Any]) -> Iterator[Any]:
        """Host and disk KV tiers, when the server has them."""
        by_tier = s.get("cached_tokens_by_tier")
        if by_tier is None:
            return
        family = CounterMetricFamily(
            "radixserve:cached_tokens_by_tier",
            "prompt tokens served from the cache, by the tier they were found in",
            labels=["tier"],
        )
        for tier, n in by_tier.items():
            family.add_metric([tier], n)
        yield family
        for name, key, doc in (
            ("radixserve:kv_demoted_tokens", "demoted_tokens",
             "tokens evicted from the device pool into the host tier"),
            ("radixserve:kv_promoted_tokens", "promoted_tokens",
             "tokens copied back from the host tier"),
            ("radixserve:kv_swapped_out_tokens", "swapped_out_tokens",
             "tokens of retracted requests swapped to the host"),
            ("radixserve:kv_disk_loaded_tokens", "disk_loaded_tokens",
             "tokens loaded from the disk tier"),
            ("radixserve:kv_disk_corrupt_blocks", "disk_corrupt_blocks",
             "disk-tier files found damaged and deleted"),
        ):
            if key in s:
                yield CounterMetricFamily(name, doc, value=s[key])
        for name, key, doc in (
            ("radixserve:kv_host_tokens_cached", "host_tree_tokens",
             "tokens the radix tree holds in the host tier"),
            ("radixserve:kv_host_tokens_total", "host_tokens", "size of the host tier in tokens"),
            ("radixserve:kv_disk_blocks", "disk_blocks", "blocks in the disk tier"),
        ):
            if key in s:
                yield GaugeMetricFamily(name, doc, value=s[key])


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.prompt_tokens = Counter("radixserve:prompt_tokens",
                                     "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter("radixserve:generation_tokens", "generated tokens",
                                         registry=r)
        self.cached_tokens = Counter("radixserve:cached_tokens",
                                     "prompt tokens served from the radix cache", registry=r)
        self.requests = Counter("radixserve:requests", "finished requests", ["finish_reason"],
                                registry=r)
        for reason in FINISH_REASONS:  # every series from the start: a router that merges its
            self.requests.labels(finish_reason=reason)  # workers' metrics needs equal label names
        self.ttft = Histogram("radixserve:time_to_first_token_seconds", "time to first token",
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("radixserve:inter_token_latency_seconds",
                             "time between streamed tokens", buckets=_LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("radixserve:e2e_request_latency_seconds",
                             "request latency, arrival to last token",
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue_time = Histogram("radixserve:queue_time_seconds",
                                    "arrival to first admission in the scheduler",
                                    buckets=_LATENCY_BUCKETS, registry=r)
        self._scheduler = _SchedulerCollector()
        r.register(self._scheduler)

    def on_first_token(self, ttft: float) -> None:
        self.ttft.observe(ttft)

    def on_tokens(self, gap: float, n: int) -> None:
        """``n`` tokens arrived ``gap`` seconds after the previous ones."""
        if n > 0:
            for _ in range(n):
                self.itl.observe(gap / n)

    def on_finish(self, meta: RequestMeta, e2e: float) -> None:
        self.prompt_tokens.inc(meta.prompt_tokens)
        self.generation_tokens.inc(meta.completion_tokens)
        self.cached_tokens.inc(meta.cached_tokens)
        self.requests.labels(finish_reason=meta.finish_type or "unknown").inc()
        self.e2e.observe(e2e)
        if meta.queue_time is not None:
            self.queue_time.observe(meta.queue_time)

    def render(self, scheduler_stats: dict[str, Any]) -> bytes:
        self._scheduler.stats = scheduler_stats
        return generate_latest(self.registry)
