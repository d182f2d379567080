"""``ServerArgs``' checks (``radixserve/config.py``) and the choices they hold the settings to.

Each check receives the args object and raises ValueError naming the setting that cannot
work, before the processes start.
"""

from __future__ import annotations

from typing import Any

from radixserve.settings.disagg import check_disaggregation
from radixserve.settings.kv_events_config import KVEventsConfig

# Weight formats of --quantization (radixserve/quantization/).
QUANTIZATIONS = ("none", "int8", "int4", "gguf", "auto")

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random", "priority")  # scheduler/policy.py
SCHEDULE_MODES = ("mixed", "prefill-first")  # scheduler/scheduler.py: Scheduler.step
KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")  # cache/kv_pool.py
_EVICTION_POLICIES = ("lru", "lfu", "slru")  # cache/radix_tree.py
_BACKENDS = ("auto", "torch", "triton")
_GRAMMAR_BACKENDS = ("xgrammar", "none")
TOOL_CALL_PARSERS = ("auto", "hermes", "qwen25", "qwen3", "llama3", "mistral", "prompted")
REASONING_PARSERS = ("qwen3", "deepseek-r1")
SPECULATIVE_ALGORITHMS = ("ngram",)  # speculative/registry.py


def check_choices_and_sizes(args: Any) -> None:
    if args.dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {_DTYPES}, got {args.dtype!r}")
    if args.schedule_policy not in _POLICIES:
        raise ValueError(
            f"schedule_policy must be one of {_POLICIES}, got {args.schedule_policy!r}"
        )
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {args.kv_cache_dtype!r}"
        )
    if args.schedule_mode not in SCHEDULE_MODES:
        raise ValueError(
            f"schedule_mode must be one of {SCHEDULE_MODES}, got {args.schedule_mode!r}"
        )
    if args.radix_eviction_policy not in _EVICTION_POLICIES:
        raise ValueError(f"radix_eviction_policy must be one of {_EVICTION_POLICIES}, "
                         f"got {args.radix_eviction_policy!r}")
    if args.attention_backend not in _BACKENDS:
        raise ValueError(
            f"attention_backend must be one of {_BACKENDS}, got {args.attention_backend!r}"
        )
    for name in (
        "page_size",
        "max_total_tokens",
        "max_running_requests",
        "context_length",
        "max_queued_requests",
        "schedule_policy_max_queue",
    ):
        value = getattr(args, name)
        if value is not None and (not isinstance(value, int) or value < 1):
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if args.max_request_body_bytes < 1024:
        raise ValueError("max_request_body_bytes must be >= 1024")
    if args.slow_reader_timeout <= 0:
        raise ValueError("slow_reader_timeout must be > 0")
    if args.response_store_size < 0 or args.response_store_bytes < 0:
        raise ValueError("response_store_size and response_store_bytes must be >= 0")
    if not 0 <= args.response_pin_ttl < 1e9:
        raise ValueError("response_pin_ttl must be >= 0 seconds (and < 1e9)")
    if args.max_prefill_tokens < 1:
        raise ValueError("max_prefill_tokens must be >= 1")
    if args.chunked_prefill_size is not None and (
        args.chunked_prefill_size == 0 or args.chunked_prefill_size < -1
    ):
        raise ValueError("chunked_prefill_size must be -1 (off) or >= 1")


def check_features(args: Any) -> None:
    """Tiers, tensor parallelism, quantization and speculative decoding, and how they combine."""
    if args.preemption_mode not in ("recompute", "swap"):
        raise ValueError(
            f"preemption_mode must be recompute or swap, got {args.preemption_mode!r}"
        )
    if args.host_cache_size < 0 or args.disk_cache_size < 1:
        raise ValueError("host_cache_size must be >= 0 and disk_cache_size >= 1 (tokens)")
    if args.disable_radix_cache and (args.host_cache_size or args.disk_cache_dir):
        raise ValueError("host and disk KV tiers hold the prefix cache: they need it on "
                         "(drop --disable-radix-cache)")
    KVEventsConfig.of(args.kv_events_config)  # refused here, before the model loads
    check_disaggregation(args)
    if not isinstance(args.tp_size, int) or args.tp_size < 1:
        raise ValueError(f"tp_size must be a positive integer, got {args.tp_size!r}")
    if args.tp_size > 1 and (
        args.host_cache_size or args.disk_cache_dir or args.preemption_mode == "swap"
    ):
        raise ValueError("host and disk KV tiers and swap preemption copy KV pages that tensor "
                         "parallelism splits over its ranks: they are not available with "
                         "tp_size > 1")
    if args.cuda_graph_max_bs is not None and (not isinstance(args.cuda_graph_max_bs, int)
                                               or args.cuda_graph_max_bs < 0):
        raise ValueError(
            "cuda_graph_max_bs must be >= 0 (0: no CUDA graphs), "
            f"got {args.cuda_graph_max_bs!r}"
        )
    if args.quantization not in QUANTIZATIONS:
        raise ValueError(
            f"quantization must be one of {', '.join(QUANTIZATIONS)}, "
            f"got {args.quantization!r}"
        )
    if args.quantization not in ("none", "auto") and args.tp_size > 1:
        raise ValueError(
            f"quantization: {args.quantization} weights are served by one rank (tp_size 1)"
        )
    if (
        args.speculative_algorithm is not None
        and args.speculative_algorithm.lower() not in SPECULATIVE_ALGORITHMS
    ):
        raise ValueError(
            f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)} "
            f"(or unset), got {args.speculative_algorithm!r}"
        )
    if args.speculative_num_draft_tokens is not None and (
            not isinstance(args.speculative_num_draft_tokens, int)
            or args.speculative_num_draft_tokens < 2):
        raise ValueError(
            "speculative_num_draft_tokens must be an integer >= 2 (the next token and at least "
            f"one draft), got {args.speculative_num_draft_tokens!r}"
        )
    low, high = (
        args.speculative_ngram_min_match_window_size,
        args.speculative_ngram_max_match_window_size,
    )
    if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
        raise ValueError(
            "speculative_ngram_min_match_window_size and speculative_ngram_max_match_window_size "
            f"must be integers with 1 <= min <= max, got {low!r} and {high!r}"
        )
    if args.speculative_disable_by_batch_size is not None and (
            not isinstance(args.speculative_disable_by_batch_size, int)
            or args.speculative_disable_by_batch_size < 1):
        raise ValueError("speculative_disable_by_batch_size must be a positive integer, "
                         f"got {args.speculative_disable_by_batch_size!r}")


def check_limits(args: Any) -> None:
    if args.load_format not in ("auto", "dummy"):
        raise ValueError(f"load_format must be auto or dummy, got {args.load_format!r}")
    if not 0 <= args.max_pinned_fraction <= 1:
        raise ValueError("max_pinned_fraction must be in [0, 1]")
    if not 0 < args.kv_cache_memory_fraction <= 0.95:
        raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
    if not 0 <= args.port < 65536:
        raise ValueError(f"port must be in [0, 65535], got {args.port}")
    if args.stream_interval < 1:
        raise ValueError("stream_interval must be >= 1")
    if args.grammar_backend not in _GRAMMAR_BACKENDS:
        raise ValueError(
            f"grammar_backend must be one of {_GRAMMAR_BACKENDS}, got {args.grammar_backend!r}"
        )
    if args.tool_call_parser not in TOOL_CALL_PARSERS:
        raise ValueError(
            f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {args.tool_call_parser!r}"
        )
    if args.reasoning_parser is not None and args.reasoning_parser not in REASONING_PARSERS:
        raise ValueError(
            f"reasoning_parser must be one of {REASONING_PARSERS}, got {args.reasoning_parser!r}"
        )
