"""Server settings: one frozen dataclass, SGLang's argument names, "auto" resolved up front."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

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
DEFAULT_MAX_RUNNING_REQUESTS = 128  # rows of the request-to-token table when unset
DEFAULT_CUDA_GRAPH_MAX_BS = 256
SPECULATIVE_ALGORITHMS = ("ngram",)  # scheduler/speculative.py
DEFAULT_SPECULATIVE_NUM_DRAFT_TOKENS = 8


def cpu_bf16_feature(cpuinfo: str = "/proc/cpuinfo") -> str | None:
    """The CPU feature that makes bfloat16 matmuls fast here ("AMX", "AVX-512 BF16"), or None.
    Without one, torch emulates bfloat16 and float32 is faster."""
    try:
        with open(cpuinfo) as f:
            flags = next((line.split() for line in f if line.startswith("flags")), [])
    except OSError:
        return None
    if "amx_bf16" in flags:
        return "AMX"
    if "avx512_bf16" in flags:
        return "AVX-512 BF16"
    return None


def _torch_version_fields() -> dict[str, str | None]:
    """``torch/version.py``'s fields, read as text: importing torch takes 1-2 s, which a CPU
    build (whose ``cuda`` and ``hip`` are None) never needs to know it has no GPU."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    fields: dict[str, str | None] = {}
    if spec is None or not spec.submodule_search_locations:
        return fields
    try:
        with open(os.path.join(list(spec.submodule_search_locations)[0], "version.py")) as f:
            for line in f:
                name, sep, value = line.partition("=")
                name = name.split(":")[0].strip()
                if sep and name in ("__version__", "cuda", "hip"):
                    value = value.strip()
                    fields[name] = None if value == "None" else value.strip("'\"")
    except OSError:
        pass
    return fields


def torch_build_has_cuda() -> bool:
    """Whether the installed torch is a CUDA (or ROCm) build; True when that cannot be read."""
    fields = _torch_version_fields()
    return "cuda" not in fields or fields.get("cuda") is not None or fields.get("hip") is not None


def torch_build_version() -> str:
    return _torch_version_fields().get("__version__") or "unknown"


def _torch_cuda() -> Any:
    import torch

    return torch.cuda


def resolve_quantization(mode: str, gguf_path: str | None, on_cpu: bool, tp_size: int) -> str:
    """``mode`` with ``auto`` resolved: ``gguf`` for a model from ``gguf_path`` (None: not a
    GGUF; see :func:`model.gguf_index.gguf_source`) that has Q4_0 / Q4_1 / Q8_0 tensors, on a CPU,
    one rank; else ``none``."""
    if mode != "auto":
        return mode
    from radixserve.model.gguf_index import served_tensor_count

    usable = gguf_path is not None and on_cpu and tp_size == 1
    return "gguf" if usable and served_tensor_count(gguf_path) else "none"


@dataclass(frozen=True)
class ServerArgs:
    """Every field is a CLI flag (``--page-size``) and an Engine keyword (``page_size``).

    ``None`` / ``"auto"`` fields are resolved by :meth:`resolve` before the processes start.
    """

    model: str | None = None  # HF folder or .gguf file; None = embedded SmolLM2-135M-Instruct
    tokenizer: str | None = None  # defaults to the model's
    dtype: str = "auto"  # bfloat16 on GPU and on CPUs with AMX or AVX-512 BF16, else float32
    device: str = "auto"  # cuda when available, else cpu
    attention_backend: str = "auto"  # triton on GPU, torch on CPU
    page_size: int | None = None  # tokens per KV page; 1 on CPU, 16 on GPU
    max_total_tokens: int | None = None  # KV pool size in tokens; sized from memory when None
    max_running_requests: int | None = None  # rows of the request-to-token table
    max_prefill_tokens: int = 16384  # token budget of one prefill batch
    chunked_prefill_size: int | None = None  # longest prefill chunk; 1024 on CPU, 8192 on GPU; -1 off
    schedule_policy: str = "lpm"  # lpm, dfs-weight, fcfs, lof, random, priority (scheduler/policy.py)
    schedule_policy_max_queue: int = 128  # lpm/dfs-weight act as fcfs above this many waiting requests
    schedule_mode: str = "mixed"  # mixed: decodes share each step with a prefill chunk; prefill-first: prompts alone
    schedule_low_priority_values_first: bool = False  # priority policy: smaller values first (vLLM's order)
    priority_preemption: bool = False  # priority policy: retract lower levels for a waiting request
    radix_eviction_policy: str = "lru"  # lru, lfu or slru (scan resistant)
    max_pinned_fraction: float = 0.5  # of the KV pool that pinned prefixes may hold
    preemption_mode: str = "recompute"  # a retracted request's KV: recompute, or swap to the host tier
    host_cache_size: int = 0  # host KV tier in tokens (0: none; swap mode without it: twice the pool)
    disk_cache_dir: str | None = None  # disk KV tier folder (survives restarts); None: none
    disk_cache_size: int = 1_000_000  # disk KV tier in tokens
    disable_radix_cache: bool = False
    tp_size: int = 1  # tensor-parallel ranks (processes), each with a shard of the model and KV
    cuda_graph_max_bs: int | None = None  # largest decode batch replayed from a CUDA graph; 256 on CUDA
    disable_cuda_graph: bool = False  # run every decode eagerly on CUDA
    load_format: str = "auto"  # "dummy": random weights from the model's config.json (benchmarks)
    quantization: str = "auto"  # none, int8, int4, gguf (a GGUF's own blocks); auto: gguf for a GGUF on a CPU
    speculative_algorithm: str | None = None  # "ngram": drafts from the radix tree and the request's own text
    speculative_num_draft_tokens: int | None = None  # tokens per verify: the next one and N-1 drafts; 8 with ngram
    speculative_ngram_min_match_window_size: int = 1  # shortest suffix matched against the request's text
    speculative_ngram_max_match_window_size: int = 12  # longest suffix matched
    speculative_disable_by_batch_size: int | None = None  # no drafts while more run; 4 on CPU, 64 on GPU
    context_length: int | None = None  # defaults to the model's max_position_embeddings
    random_seed: int = 0  # seeds the draw of per-request seeds when the user gives none
    stream_interval: int = 1  # send streamed tokens every N decode steps
    kv_cache_memory_fraction: float = 0.25  # of free host/GPU memory, when max_total_tokens is None
    kv_cache_dtype: str = "auto"  # auto (the model's dtype), int8 (a scale per token and head), fp8_e4m3, fp8_e5m2
    log_level: str = "info"
    host: str = "127.0.0.1"  # HTTP server address
    port: int = 30000  # HTTP server port
    served_model_name: str | None = None  # name in /v1/models; defaults to the model folder's
    max_queued_requests: int | None = None  # waiting requests beyond which new ones get 503
    api_key: str | None = dataclasses.field(default=None, repr=False)  # HTTP requests need "Authorization: Bearer <key>"
    startup_timeout: float = 600.0  # seconds to wait for the model to load
    grammar_backend: str = "xgrammar"  # constrained decoding (json_schema/regex/ebnf); "none" refuses them
    disable_jump_forward: bool = False  # decode grammar-forced text token by token
    tool_call_parser: str = "auto"  # auto (detected from the chat template), hermes, qwen25, qwen3, llama3, mistral, prompted
    reasoning_parser: str | None = None  # qwen3 or deepseek-r1: split <think> into reasoning_content
    max_request_body_bytes: int = 16 * 1024 * 1024  # larger HTTP bodies get 413
    cors_allow_origins: str | None = None  # comma-separated origins ("*" for any); CORS off when unset
    slow_reader_timeout: float = 30.0  # a stream whose reader falls behind for this long is cut off

    def __post_init__(self) -> None:
        self._check_choices_and_sizes()
        self._check_features()
        self._check_limits()

    def _check_choices_and_sizes(self) -> None:
        if self.dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {_DTYPES}, got {self.dtype!r}")
        if self.schedule_policy not in _POLICIES:
            raise ValueError(f"schedule_policy must be one of {_POLICIES}, got {self.schedule_policy!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.schedule_mode not in SCHEDULE_MODES:
            raise ValueError(f"schedule_mode must be one of {SCHEDULE_MODES}, got {self.schedule_mode!r}")
        if self.radix_eviction_policy not in _EVICTION_POLICIES:
            raise ValueError(f"radix_eviction_policy must be one of {_EVICTION_POLICIES}, "
                             f"got {self.radix_eviction_policy!r}")
        if self.attention_backend not in _BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {_BACKENDS}, got {self.attention_backend!r}"
            )
        for name in (
            "page_size",
            "max_total_tokens",
            "max_running_requests",
            "context_length",
            "max_queued_requests",
            "schedule_policy_max_queue",
        ):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_request_body_bytes < 1024:
            raise ValueError("max_request_body_bytes must be >= 1024")
        if self.slow_reader_timeout <= 0:
            raise ValueError("slow_reader_timeout must be > 0")
        if self.max_prefill_tokens < 1:
            raise ValueError("max_prefill_tokens must be >= 1")
        if self.chunked_prefill_size is not None and (
            self.chunked_prefill_size == 0 or self.chunked_prefill_size < -1
        ):
            raise ValueError("chunked_prefill_size must be -1 (off) or >= 1")

    def _check_features(self) -> None:
        """Tiers, tensor parallelism, quantization and speculative decoding, and how they combine."""
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be recompute or swap, got {self.preemption_mode!r}")
        if self.host_cache_size < 0 or self.disk_cache_size < 1:
            raise ValueError("host_cache_size must be >= 0 and disk_cache_size >= 1 (tokens)")
        if self.disable_radix_cache and (self.host_cache_size or self.disk_cache_dir):
            raise ValueError("host and disk KV tiers hold the prefix cache: they need it on "
                             "(drop --disable-radix-cache)")
        if not isinstance(self.tp_size, int) or self.tp_size < 1:
            raise ValueError(f"tp_size must be a positive integer, got {self.tp_size!r}")
        if self.tp_size > 1 and (self.host_cache_size or self.disk_cache_dir or self.preemption_mode == "swap"):
            raise ValueError("host and disk KV tiers and swap preemption copy KV pages that tensor "
                             "parallelism splits over its ranks: they are not available with "
                             "tp_size > 1")
        if self.cuda_graph_max_bs is not None and (not isinstance(self.cuda_graph_max_bs, int)
                                                   or self.cuda_graph_max_bs < 0):
            raise ValueError(f"cuda_graph_max_bs must be >= 0 (0: no CUDA graphs), got {self.cuda_graph_max_bs!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}")
        if self.quantization not in ("none", "auto") and self.tp_size > 1:
            raise ValueError(f"quantization: {self.quantization} weights are served by one rank (tp_size 1)")
        if self.speculative_algorithm is not None and self.speculative_algorithm.lower() not in SPECULATIVE_ALGORITHMS:
            raise ValueError(f"speculative_algorithm must be one of {', '.join(SPECULATIVE_ALGORITHMS)} "
                             f"(or unset), got {self.speculative_algorithm!r}")
        if self.speculative_num_draft_tokens is not None and (
                not isinstance(self.speculative_num_draft_tokens, int) or self.speculative_num_draft_tokens < 2):
            raise ValueError("speculative_num_draft_tokens must be an integer >= 2 (the next token and at least "
                             f"one draft), got {self.speculative_num_draft_tokens!r}")
        low, high = self.speculative_ngram_min_match_window_size, self.speculative_ngram_max_match_window_size
        if not (isinstance(low, int) and isinstance(high, int) and 1 <= low <= high):
            raise ValueError("speculative_ngram_min_match_window_size and speculative_ngram_max_match_window_size "
                             f"must be integers with 1 <= min <= max, got {low!r} and {high!r}")
        if self.speculative_disable_by_batch_size is not None and (
                not isinstance(self.speculative_disable_by_batch_size, int) or self.speculative_disable_by_batch_size < 1):
            raise ValueError("speculative_disable_by_batch_size must be a positive integer, "
                             f"got {self.speculative_disable_by_batch_size!r}")

    def _check_limits(self) -> None:
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be auto or dummy, got {self.load_format!r}")
        if not 0 <= self.max_pinned_fraction <= 1:
            raise ValueError("max_pinned_fraction must be in [0, 1]")
        if not 0 < self.kv_cache_memory_fraction <= 0.95:
            raise ValueError("kv_cache_memory_fraction must be in (0, 0.95]")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.stream_interval < 1:
            raise ValueError("stream_interval must be >= 1")
        if self.grammar_backend not in _GRAMMAR_BACKENDS:
            raise ValueError(
                f"grammar_backend must be one of {_GRAMMAR_BACKENDS}, got {self.grammar_backend!r}"
            )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"
            )
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}"
            )

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown setting(s) {unknown}; valid settings: {sorted(names)}")
        return cls(**kwargs)

    def resolve(self) -> ServerArgs:
        """Return a copy whose hardware-dependent "auto" values are filled in.

        Model-dependent values (context length, pool size) are resolved by the scheduler once
        the model is loaded, and reported back in its ready message.
        """
        device = self.device
        if device not in ("auto", "cpu") and not device.startswith("cuda"):
            raise ValueError(f"device must be auto, cpu or cuda[:N], got {device!r}")
        cuda = None if device == "cpu" or not torch_build_has_cuda() else _torch_cuda()
        if device == "auto":
            device = "cuda" if cuda is not None and cuda.is_available() else "cpu"
        elif device.startswith("cuda") and (cuda is None or not cuda.is_available()):
            raise ValueError(
                f"device {device!r} was asked for, but this torch build has no usable CUDA device "
                f"(torch {torch_build_version()}); use --device cpu or auto"
            )
        on_gpu = device.startswith("cuda")
        dtype = self.dtype
        if dtype == "auto":  # the scheduler's start-up line says what was detected
            dtype = "bfloat16" if on_gpu or cpu_bf16_feature() else "float32"
        backend = self.attention_backend
        if backend == "auto":
            backend = "triton" if on_gpu else "torch"
        if on_gpu and self.tp_size > 1 and device != "cuda":
            raise ValueError(f"with tp_size > 1 the device is cuda (rank r runs on cuda:r), not {device!r}")
        if on_gpu and self.tp_size > cuda.device_count():
            raise ValueError(f"tp_size {self.tp_size} needs as many GPUs; "
                             f"{cuda.device_count()} are visible")
        page_size = self.page_size or (16 if on_gpu else 1)
        chunk = self.chunked_prefill_size or (8192 if on_gpu else 1024)
        graph_bs = self.cuda_graph_max_bs
        if graph_bs is None:
            graph_bs = DEFAULT_CUDA_GRAPH_MAX_BS if on_gpu else 0
        if self.disable_cuda_graph or not on_gpu:
            graph_bs = 0  # CUDA graphs exist only on CUDA
        algorithm = self.speculative_algorithm.lower() if self.speculative_algorithm else None
        drafts, spec_bs = self.speculative_num_draft_tokens, self.speculative_disable_by_batch_size
        if algorithm is not None:
            drafts = drafts or DEFAULT_SPECULATIVE_NUM_DRAFT_TOKENS
            spec_bs = spec_bs or (64 if on_gpu else 4)
        from radixserve.model.gguf_index import gguf_source

        # the blocks of the .gguf behind the model (random weights have none)
        source = gguf_source(self.model) if self.quantization in ("auto", "gguf") and self.load_format != "dummy" else None
        quantization = resolve_quantization(self.quantization, source, not on_gpu, self.tp_size)
        if quantization == "gguf":
            if source is None:
                raise ValueError(f"quantization gguf serves a .gguf model's own blocks; {self.model!r} is not a "
                                 ".gguf file (int8 or int4 quantize a float checkpoint)")
        return dataclasses.replace(
            self,
            device=device,
            dtype=dtype,
            quantization=quantization,
            attention_backend=backend,
            page_size=page_size,
            chunked_prefill_size=chunk,
            cuda_graph_max_bs=graph_bs,
            speculative_algorithm=algorithm,
            speculative_num_draft_tokens=drafts,
            speculative_disable_by_batch_size=spec_bs,
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def env_default(name: str, default: Any) -> Any:
    """``RADIXSERVE_<NAME>`` overrides a default (used by the CLI)."""
    return os.environ.get(f"RADIXSERVE_{name.upper()}", default)
