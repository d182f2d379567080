"""Server settings: one frozen dataclass, SGLang's argument names, "auto" resolved up front."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, fields
from typing import Any

# config.cpu_bf16_feature is what resolve() reads (tests patch it)
from radixserve.hardware import (
    _torch_cuda,
    check_quantization_device,
    cpu_bf16_feature,
    resolve_quantization,
    torch_build_has_cuda,
    torch_build_version,
)

# The settings' choices live with their checks; the package, bench/ and the tests read them here.
from radixserve.settings.checks import (  # noqa: F401
    KV_CACHE_DTYPES,
    QUANTIZATIONS,
    REASONING_PARSERS,
    SCHEDULE_MODES,
    SPECULATIVE_ALGORITHMS,
    TOOL_CALL_PARSERS,
    check_choices_and_sizes,
    check_features,
    check_limits,
)
from radixserve.settings.lora import check_lora

INT8_ACTIVATION_MODES = ("int4", "gguf", "int8")  # the formats --int8-activations multiplies
DEFAULT_MAX_RUNNING_REQUESTS = 128  # rows of the request-to-token table when unset
DEFAULT_CUDA_GRAPH_MAX_BS = 256
DEFAULT_SPECULATIVE_NUM_DRAFT_TOKENS = 8


def setting(default: Any, help: str, **kw: Any) -> Any:
    """A ``ServerArgs`` field with its help text: the CLI flag's ``--help`` and the
    documentation of the Engine keyword, written once.  A computed default (None / "auto")
    is described in the text; the CLI appends "(default: X)" for the others."""
    return dataclasses.field(default=default, metadata={"help": help}, **kw)


@dataclass(frozen=True)
class ServerArgs:
    """Every field is a CLI flag (``--page-size``) and an Engine keyword (``page_size``).

    ``None`` / ``"auto"`` fields are resolved by :meth:`resolve` before the processes start.
    """

    model: str | None = setting(
        None,
        "local HF folder (config.json + safetensors) or .gguf file "
        "(default: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = setting(None, "tokenizer folder (default: the model's)")
    dtype: str = setting(
        "auto",
        "weights and KV dtype: auto (bfloat16 on GPU and on CPUs with AMX or AVX-512 BF16, "
        "else float32), "
        "float32, bfloat16, float16")
    device: str = setting("auto", "auto (cuda when available, else cpu), cpu or cuda")
    attention_backend: str = setting("auto", "auto (triton on GPU, torch on CPU), torch or triton")
    page_size: int | None = setting(None, "tokens per KV page (default: 1 on CPU, 16 on GPU)")
    max_total_tokens: int | None = setting(
        None,
        "KV pool size in tokens (default: sized from free memory, see --kv-cache-memory-fraction)")
    max_running_requests: int | None = setting(
        None,
        f"most requests running at once (default: {DEFAULT_MAX_RUNNING_REQUESTS})")
    max_prefill_tokens: int = setting(16384, "token budget of one prefill batch")
    chunked_prefill_size: int | None = setting(
        None,
        "longest prefill chunk; -1 off (default: 1024 on CPU, 8192 on GPU)")
    schedule_policy: str = setting(
        "lpm",
        "waiting-queue order: lpm (longest cached prefix first), dfs-weight (finish one tree "
        "branch while cached), fcfs, lof (longest output first), random, priority (the "
        "request's priority)")
    schedule_policy_max_queue: int = setting(
        128,
        "lpm and dfs-weight act as fcfs above this many waiting requests")
    schedule_mode: str = setting(
        "mixed",
        "mixed (default): each step runs the running requests' decodes together with the next "
        "prefill chunk; prefill-first: a step with prompt work runs it alone and the decodes wait "
        "(lower TTFT under arrivals, longer gaps between a stream's tokens)")
    schedule_low_priority_values_first: bool = setting(
        False,
        "priority policy: smaller priority values go first (vLLM's order; "
        "default: larger first, as SGLang)")
    priority_preemption: bool = setting(
        False,
        "priority policy: retract running requests of lower priority when a waiting one "
        "cannot be admitted")
    radix_eviction_policy: str = setting(
        "lru",
        "prefix-cache eviction: lru, lfu, or slru (a prefix a second request reused outlives "
        "one-off prompts)")
    max_pinned_fraction: float = setting(
        0.5,
        "share of the KV pool that pinned prefixes (POST /cache/pin) may hold")
    preemption_mode: str = setting(
        "recompute",
        "a request retracted when the KV pool is full: recompute its KV later, or swap it to the "
        "host tier and back")
    host_cache_size: int = setting(
        0,
        "host KV tier in tokens: pages evicted from the pool wait there (default: none; with "
        "--preemption-mode swap: twice the pool)")
    disk_cache_dir: str | None = setting(
        None,
        "disk KV tier folder: cached prefixes are written there and found again after a restart "
        "(default: none)")
    disk_cache_size: int = setting(1_000_000, "disk KV tier size in tokens")
    disable_radix_cache: bool = setting(False, "turn the prefix cache off")
    grpc_port: int | None = setting(
        None,
        "also serve SGLang's scheduler gRPC service on this port: token ids in and out, and the KV "
        "events, for smg's grpc:// workers (needs radixserve[router]; default: off)")
    kv_events_config: str | None = setting(
        None,
        "publish the radix tree's changes for KV-aware routers, SGLang's JSON: "
        "'{\"publisher\": \"zmq\", \"endpoint\": \"tcp://*:5557\", "
        "\"replay_endpoint\": \"tcp://*:5558\"}' "
        "(default: off)")
    disaggregation_mode: str = setting(
        "null",
        "prefill-decode disaggregation (smg --pd-disaggregation pairs the workers): null (this "
        "worker prefills and decodes), prefill (computes prompts, sends their KV to the decode "
        "worker a request names) or decode (receives a prompt's KV, then decodes)")
    disaggregation_bootstrap_port: int = setting(
        8998, "a prefill worker's port for its decode workers: they fetch the KV of their requests "
              "here (give it to smg after the prefill URL)")
    disaggregation_transfer_backend: str = setting(
        "zmq", "how the KV moves from prefill to decode: zmq (TCP, between processes and hosts, "
               "CPU or GPU) or nixl (needs the nixl package)")
    disaggregation_timeout: float = setting(
        30.0, "seconds a prefill worker waits for the decode worker of a request (and a decode "
              "worker for the KV of one) before the request fails")
    tp_size: int = setting(
        1,
        "tensor parallelism: split the model over N processes (gloo on a CPU, NCCL over N GPUs)")
    cuda_graph_max_bs: int | None = setting(
        None,
        "largest decode batch replayed from a captured CUDA graph (default 256 on CUDA; 0: none)")
    disable_cuda_graph: bool = setting(
        False,
        "run every decode step eagerly on CUDA (no graph capture)")
    load_format: str = setting(
        "auto",
        "auto (the model's weights) or dummy (random weights from its config.json, for benchmarks)")
    quantization: str = setting(
        "auto",
        "weight-only matmuls on a CPU: none; int8 (a scale and an offset per 32 weights, "
        "~3x less weight memory than float32); int4 (blocks of 32, d*q+m, ~6x less); gguf "
        "(a .gguf model's Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K tensors as stored: the weights float32 "
        "computes with); auto (gguf "
        "where the model has such tensors, else none)")
    int8_activations: bool = setting(
        False,
        "decode rows through quantized weights (int4, gguf, int8) with activations quantized to "
        "int8 per 32, as llama.cpp's Q4 x Q8 dot products: faster matmuls where the CPU has "
        "AVX-512 VNNI, not exact")
    enable_lora: bool = setting(
        False, "serve LoRA adapters (on with --lora-paths; adapters load while serving too)")
    lora_paths: tuple[str, ...] = setting(
        (), "LoRA adapters to load at start: NAME=PATH ... (PATH: a peft adapter folder)")
    max_loras_per_batch: int = setting(
        8, "adapters one batch may mix: the slots of adapter weights on the device")
    max_lora_rank: int | None = setting(
        None, "the largest adapter rank served (default: the largest of --lora-paths, else 16)")
    lora_target_modules: tuple[str, ...] = setting(
        (), "projections adapters may target: q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj, or all (default: those of --lora-paths, else all)")
    speculative_algorithm: str | None = setting(
        None,
        "speculative decoding: ngram (drafts from the radix tree and the request's own "
        "prompt and output, verified in one extend; output unchanged), or unset (off)")
    speculative_num_draft_tokens: int | None = setting(
        None,
        "tokens per speculative verify: the next token and N-1 drafts (default: 8)")
    speculative_ngram_min_match_window_size: int = setting(
        1,
        "ngram: shortest suffix of the request matched against its text")
    speculative_ngram_max_match_window_size: int = setting(
        12,
        "ngram: longest suffix matched (the longest match wins)")
    speculative_disable_by_batch_size: int | None = setting(
        None,
        "no drafts in a step with more running requests than this "
        "(default: 4 on CPU, 64 on GPU)")
    context_length: int | None = setting(
        None,
        "longest sequence (default: the model's max_position_embeddings)")
    random_seed: int = setting(0, "seed of the seeds drawn for requests that give none")
    stream_interval: int = setting(1, "send streamed tokens every N steps")
    kv_cache_memory_fraction: float = setting(
        0.25,
        "share of free memory for the KV pool when --max-total-tokens is unset")
    kv_cache_dtype: str = setting(
        "auto",
        "element type of the KV cache: auto (the model's dtype), int8 (symmetric, a float16 scale "
        "per token and head: 1.94x the tokens of bfloat16 in the same memory, 3.88x float32's), "
        "fp8_e4m3 or fp8_e5m2 (unit scale, saturated: 2x / 4x)")
    log_level: str = setting("info", "debug, info, warning, error")
    host: str = setting("127.0.0.1", "HTTP server address")
    port: int = setting(30000, "HTTP server port")
    served_model_name: str | None = setting(
        None,
        "model name reported by /v1/models and accepted in requests "
        "(default: the model folder's name)")
    max_queued_requests: int | None = setting(
        None,
        "waiting requests beyond which new ones get HTTP 503 (default: unlimited)")
    api_key: str | None = setting(
        None,
        "require 'Authorization: Bearer <key>' on HTTP requests (default: none)", repr=False)
    startup_timeout: float = setting(600.0, "seconds to wait for the model to load")
    grammar_backend: str = setting(
        "xgrammar",
        "constrained decoding backend: xgrammar, or none (json_schema/regex/ebnf refused)")
    disable_jump_forward: bool = setting(
        False,
        "decode grammar-forced text token by token instead of appending it at once")
    tool_call_parser: str = setting(
        "auto",
        "tool-call format: auto (from the chat template), hermes, qwen25, qwen3, llama3, "
        "mistral, prompted")
    reasoning_parser: str | None = setting(
        None,
        "split <think> output into reasoning_content: qwen3 or deepseek-r1 (default: off)")
    max_request_body_bytes: int = setting(
        16 * 1024 * 1024,
        "HTTP request bodies larger than this get 413")
    cors_allow_origins: str | None = setting(
        None,
        "comma-separated origins allowed by CORS, '*' for any (default: CORS off)")
    slow_reader_timeout: float = setting(
        30.0,
        "seconds a stream's reader may stay behind before the request is cut off")
    response_store_size: int = setting(
        1024,
        "stored Responses (POST /v1/responses with store) kept in memory for "
        "previous_response_id and GET; the oldest go first (0 stores none)")
    response_store_bytes: int = setting(
        64 * 1024 * 1024,
        "bytes of stored Responses kept in memory; the oldest go first past it")
    response_pin_ttl: float = setting(
        600.0,
        "seconds a stored Response's conversation stays pinned in the radix cache, so that "
        "the next turn (after a tool call) is a cache hit under memory pressure (0: no pin)")
    def __post_init__(self) -> None:
        for name in ("lora_paths", "lora_target_modules"):  # lists and a dict from the Engine
            value = getattr(self, name)
            if isinstance(value, dict):
                value = [f"{k}={v}" for k, v in value.items()]
            if isinstance(value, str):
                value = [value]
            object.__setattr__(self, name, tuple(value))
        check_lora(self)
        check_choices_and_sizes(self)  # radixserve/settings/checks.py
        check_features(self)
        check_limits(self)

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
            raise ValueError(
                f"with tp_size > 1 the device is cuda (rank r runs on cuda:r), not {device!r}"
            )
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
        from radixserve.checkpoint.gguf_index import gguf_source

        # the blocks of the .gguf behind the model (random weights have none)
        source = (
            gguf_source(self.model)
            if self.quantization in ("auto", "gguf") and self.load_format != "dummy"
            else None
        )
        quantization = resolve_quantization(self.quantization, source, not on_gpu, self.tp_size)
        check_quantization_device(quantization, not on_gpu)
        if quantization == "gguf" and source is None:
            raise ValueError(
                f"quantization gguf serves a .gguf model's own blocks; {self.model!r} is not a "
                ".gguf file (int8 or int4 quantize a float checkpoint)"
            )
        if self.int8_activations and (on_gpu or quantization not in INT8_ACTIVATION_MODES):
            raise ValueError(
                "int8_activations multiplies quantized weights (int4, gguf, int8) on a CPU, not "
                f"{quantization} on {device}"
            )
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
            enable_lora=self.enable_lora or bool(self.lora_paths),
        )

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def env_default(name: str, default: Any) -> Any:
    """``RADIXSERVE_<NAME>`` overrides a default (used by the CLI)."""
    return os.environ.get(f"RADIXSERVE_{name.upper()}", default)
