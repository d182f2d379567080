"""Steps of few rows through every decoder layer in one C++ call (model/fused_decode.py): the
same logits, bit for bit, as the Python layers, for every weight kind and pool it takes, and the
Python layers wherever it does not apply."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.sched_driver import run_until_idle, submit

from radixserve import cpu_ext
from radixserve.config import ServerArgs
from radixserve.model.fused_decode import FusedDecode
from radixserve.model.loader import load_model
from radixserve.scheduler.scheduler import Scheduler

pytestmark = pytest.mark.skipif(cpu_ext.load() is None, reason="the C++ kernels did not build here")

SHARED = list(range(10, 40))
PROMPTS = [SHARED + [50, 51, 52], SHARED + [60, 61], SHARED + [70, 71, 72, 73], list(range(100, 121))]


class Counting(FusedDecode):
    """Counts the steps that took the fused layers."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__(model)
        self.calls = 0

    def run(self, *args: Any) -> torch.Tensor | None:
        out = super().run(*args)
        self.calls += out is not None
        return out


class Off:
    """The Python layers at every step."""

    def run(self, *args: Any) -> None:
        return None


def scheduler(folder: str | None, dtype: str, quantization: str = "none", int8_activations: bool = False,
              wide_one_row: bool = False, **settings: Any) -> Scheduler:
    args = ServerArgs.from_kwargs(model=folder, dtype=dtype, device="cpu", quantization=quantization,
                                  int8_activations=int8_activations, **settings).resolve()
    loaded = load_model(folder, getattr(torch, dtype), args.device, quantization=quantization,
                        int8_activations=int8_activations, wide_one_row=wide_one_row)
    return Scheduler(args, loaded.model, loaded.config, None)


def run(sched: Scheduler, fused: Any, prompts: list[list[int]], max_new_tokens: int = 6,
        **params: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
    """Every forward's logits and the requests' results, with ``fused`` in the model."""
    model = sched.runner.model
    model.fused = fused
    logits: list[torch.Tensor] = []
    forward = model.forward

    def recording(fb: Any) -> torch.Tensor | None:
        out = forward(fb)
        logits.append(out.clone())
        return out

    model.forward = recording
    try:
        for p in prompts:
            submit(sched, p, max_new_tokens=max_new_tokens, ignore_eos=True, **params)
        results = run_until_idle(sched)
    finally:
        del model.forward
    return logits, results


def assert_same_bits(folder: str | None, dtype: str, prompts: list[list[int]] = PROMPTS, expect_fused: bool = True,
                     params: dict[str, Any] | None = None, **settings: Any) -> int:
    """Fused and Python layers give the same logits at every step; returns the fused steps."""
    a = scheduler(folder, dtype, **settings)
    counting = Counting(a.runner.model)
    fused_logits, fused_out = run(a, counting, prompts, **(params or {}))
    b = scheduler(folder, dtype, **settings)
    plain_logits, plain_out = run(b, Off(), prompts, **(params or {}))
    assert len(fused_logits) == len(plain_logits)
    for x, y in zip(fused_logits, plain_logits, strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    assert [r["output_ids"] for r in fused_out.values()] == [r["output_ids"] for r in plain_out.values()]
    assert (counting.calls > 0) == expect_fused, counting.calls
    return counting.calls


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("quantization", ["none", "int8", "int4"])
def test_fused_layers_give_the_python_layers_bits(tiny_model_dir, dtype: str, quantization: str) -> None:
    calls = assert_same_bits(tiny_model_dir("llama"), dtype, quantization=quantization)
    assert calls >= 5  # the decode steps (4 rows each) after the prefill


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_fused_layers_with_8_bit_pools_and_pages(tiny_model_dir, kv_cache_dtype: str, page_size: int) -> None:
    assert_same_bits(tiny_model_dir("llama"), "float32", quantization="int4", kv_cache_dtype=kv_cache_dtype,
                     page_size=page_size)


@pytest.mark.parametrize("name", ["qwen2", "mistral-mha", "llama-tied-llama3"])
def test_fused_layers_across_architectures(tiny_model_dir, name: str) -> None:
    """q/k/v biases (qwen2), one query head per KV head, a tied head and llama3 rope."""
    assert_same_bits(tiny_model_dir(name), "float32", quantization="int8")


def test_fused_layers_with_int8_activations(tiny_model_dir) -> None:
    if not cpu_ext.load().q8_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: --int8-activations is refused here")
    assert_same_bits(tiny_model_dir("llama"), "float32", quantization="int4", int8_activations=True)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_layers_with_wide_one_row_steps(tiny_model_dir, dtype: str) -> None:
    """A lone request's one-row steps through int4_linear_q16, a batch's through int4_linear."""
    if not cpu_ext.load().q8_supported():
        pytest.skip("this CPU has no AVX-512 VNNI: one-row steps keep int4_linear here")
    assert assert_same_bits(tiny_model_dir("llama"), dtype, prompts=PROMPTS[:1], quantization="int4",
                            wide_one_row=True) >= 5
    assert_same_bits(tiny_model_dir("llama"), dtype, quantization="int4", wide_one_row=True)


def test_fused_layers_verify_speculative_drafts(tiny_model_dir) -> None:
    """One request's verify steps (its next token and 7 drafts: 8 rows) take the fused layers."""
    prompt = [7, 8, 9, 10, 11] * 8
    assert_same_bits(tiny_model_dir("llama"), "float32", prompts=[prompt], quantization="int4",
                     speculative_algorithm="ngram", params={"max_new_tokens": 24})


def test_python_layers_where_fused_does_not_apply(tiny_model_dir) -> None:
    """q/k norm (Qwen3) keeps the Python layers, as does a step of more rows than the kernels take."""
    assert_same_bits(tiny_model_dir("qwen3-hd128"), "float32", expect_fused=False, quantization="int8")
    many = [[20 + i, 21 + i, 22 + i] for i in range(12)]  # 12 decode rows per step
    assert_same_bits(tiny_model_dir("llama"), "float32", prompts=many, expect_fused=False, quantization="int8",
                     params={"max_new_tokens": 3})


def test_profiled_steps_take_the_python_layers(tiny_model_dir) -> None:
    """Under torch's profiler the layers' ranges must exist (the step breakdown reads them)."""
    sched = scheduler(tiny_model_dir("llama"), "float32", quantization="int8")
    counting = Counting(sched.runner.model)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]):
        run(sched, counting, PROMPTS[:2])
    assert counting.calls == 0
    run(sched, counting, PROMPTS[:2])
    assert counting.calls > 0


def test_replaced_weights_rebuild_the_fused_lists(tiny_model_dir) -> None:
    """A weight replaced after a first forward (quantize_model at load) is the one multiplied."""
    from radixserve.quantization import quantize_model

    sched = scheduler(tiny_model_dir("llama"), "float32")
    model = sched.runner.model
    counting = Counting(model)
    run(sched, counting, PROMPTS[:1])
    float_calls = counting.calls
    quantize_model(model, "int4")
    fused_logits, _ = run(sched, counting, PROMPTS[3:])  # shares no prefix with the first run
    assert counting.calls > float_calls
    plain_logits, _ = run(scheduler(tiny_model_dir("llama"), "float32", quantization="int4"), Off(), PROMPTS[3:])
    assert len(fused_logits) == len(plain_logits)
    assert all(torch.equal(x, y) for x, y in zip(fused_logits, plain_logits, strict=True))


def test_default_model_fused_decode_is_exact(default_model_path: str) -> None:
    """The default model as served (the GGUF's 4-bit blocks and Q8_0 head), bfloat16 (the
    fixture converts it; None names it)."""
    prompts = [[1, 9690, 198, 2683, 359, 253, 5356, 11173, 30], [1, 9690, 198, 22503, 346, 2]]
    calls = assert_same_bits(None, "bfloat16", prompts=prompts, quantization="gguf",
                             params={"max_new_tokens": 8})
    assert calls >= 7
    # a server that drafts nothing: one request's one-row steps through int4_linear_q16 where the
    # CPU has AVX-512 VNNI
    assert assert_same_bits(None, "bfloat16", prompts=prompts[:1], quantization="gguf", wide_one_row=True,
                            params={"max_new_tokens": 8}) >= 7


def test_a_model_off_the_cpu_never_builds_the_cpu_kernels(tiny_model_dir, monkeypatch) -> None:
    """A GPU server's first forward must not compile the CPU extension (a meta-device model
    stands in for a GPU's here)."""
    import radixserve.model.fused_decode as fused_decode

    def refuse() -> None:
        raise AssertionError("cpu_ext.load() called for a model off the CPU")

    model = load_model(tiny_model_dir("llama"), torch.float32).model.to("meta")
    monkeypatch.setattr(fused_decode.cpu_ext, "load", refuse)
    fused = FusedDecode(model)
    assert fused.ops is None and not fused.model_fits
