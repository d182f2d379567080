"""Weight-only int8 (radixserve/quantization/int8.py, cpu_ext/linear_ops.cpp): the C++ kernel and the
dequantize path against the dequantized weight, the rounding bound, a quantized tiny model
against its float twin, the settings' errors, and the default model through the Engine."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from helpers.model_runner import ModelRunner
from helpers.tiny_models import TINY_MODELS

from radixserve import cpu_ext
from radixserve.config import ServerArgs, cpu_bf16_feature
from radixserve.model.loader import load_model
from radixserve.quantization import GROUP, KERNEL_MAX_ROWS, Int8Weight, linear, quantize_model
from radixserve.quantization.float_linear import _float_kernel_fits, _kernel_rows

OPS = cpu_ext.load()


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((n, k), generator=gen) * 0.05
    w[0, :GROUP] *= 40  # one group far larger than the rest: its own scale keeps the others fine
    return w


def test_rounding_is_within_half_a_step_of_each_group() -> None:
    w = _weight(37, 3 * GROUP)
    q = Int8Weight.quantize(w)
    assert q.q.dtype == torch.int8 and q.scale.shape == (37, 3) and q.offset is None
    step = q.scale.repeat_interleave(GROUP, dim=1)
    assert ((q.dequantized(torch.float32) - w).abs() <= step / 2 + 1e-7).all()
    # a group's largest weight is exactly representable (scale = max / 127)
    assert torch.equal(q.q.abs().view(37, 3, GROUP).amax(dim=2), torch.full((37, 3), 127, dtype=torch.int8))


def test_asymmetric_groups_span_their_own_range() -> None:
    w = _weight(37, 3 * GROUP) + 0.3  # every group off-centre: symmetric steps would waste half their range
    sym, asym = Int8Weight.quantize(w), Int8Weight.quantize(w, asymmetric=True)
    assert asym.offset.shape == asym.scale.shape == (37, 3)
    step = asym.scale.repeat_interleave(GROUP, dim=1)
    err = (asym.dequantized(torch.float32) - w).abs()
    assert (err <= step / 2 + 1e-6).all()
    # both ends of each group are used: q spans [-128, 127]
    groups = asym.q.view(37, 3, GROUP)
    assert (groups.amin(dim=2) == -128).all() and (groups.amax(dim=2) == 127).all()
    assert err.mean() < 0.6 * (sym.dequantized(torch.float32) - w).abs().mean()
    # a grid of 4-bit steps (a Q4_1 block's values) lands on it, 17 int8 steps per 4-bit step,
    # within the scale's rounding to 11 bits
    d, low = 0.01, -0.05
    q4 = torch.randint(0, 16, (3, GROUP), generator=torch.Generator().manual_seed(1))
    q4[:, 0], q4[:, 1] = 0, 15
    grid = low + d * q4.float()
    q = Int8Weight.quantize(grid, asymmetric=True)
    assert torch.equal(q.q.long(), 17 * q4 - 128)
    torch.testing.assert_close(q.dequantized(torch.float32), grid, rtol=0, atol=0.005 * d)


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("n, k", [(5, GROUP), (130, 9 * GROUP)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_kernel_equals_the_dequantized_matmul(rows: int, n: int, k: int, dtype: torch.dtype, asymmetric: bool) -> None:
    """Every output row (NB-row tails included) and input row (MT tails) of the C++ kernel,
    with and without offsets."""
    q = Int8Weight.quantize(_weight(n, k, seed=rows) + 0.1 * asymmetric, asymmetric=asymmetric)
    x = torch.randn((rows, k), generator=torch.Generator().manual_seed(7)).to(dtype)
    ref = x.float() @ q.dequantized(torch.float32).T
    out = q.kernel_matmul(OPS, x)
    sums = q.kernel_matmul(OPS, x.float())  # the same products, in float32
    assert out.shape == (rows, n) and out.dtype == dtype and sums.dtype == torch.float32
    torch.testing.assert_close(sums, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, sums.to(dtype))  # x's dtype: each float32 sum rounded once
    for r in range(rows):  # a row's sums do not depend on the rows beside it (drafts on or off)
        assert torch.equal(q.kernel_matmul(OPS, x[r:r + 1].float()), sums[r:r + 1])
    torch.testing.assert_close(q.matmul(x).float(), ref, rtol=2e-2 if dtype == torch.bfloat16 else 1e-5,
                               atol=2e-2 if dtype == torch.bfloat16 else 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_many_rows_dequantize_into_the_shared_buffer(dtype: torch.dtype, asymmetric: bool) -> None:
    q = Int8Weight.quantize(_weight(70, 2 * GROUP).to(dtype), asymmetric=asymmetric)
    out = torch.empty((70, 2 * GROUP), dtype=dtype)
    q.dequantize_into(out)
    assert torch.equal(out, q.dequantized(dtype))
    x = torch.randn((KERNEL_MAX_ROWS + 5, 2 * GROUP)).to(dtype)
    torch.testing.assert_close(q.matmul(x), x @ q.dequantized(dtype).T)


@pytest.mark.parametrize("rows", [1, 2, 5, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("n, k", [(3, 32), (130, 576)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_float_kernel_equals_torch_linear(rows: int, n: int, k: int, dtype: torch.dtype) -> None:
    """The few-row float32 / bfloat16 loop (every NB tail), and linear() with a bias through it
    where this CPU's kernels take that many rows."""
    gen = torch.Generator().manual_seed(rows * n)
    w, x, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((n, k), (rows, k), (n,)))
    ref = (x.double() @ w.double().T).to(dtype)  # sums of ~24 products, rounded once
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 8e-3, "atol": 4e-2}
    torch.testing.assert_close(OPS.float_linear(x, w), ref, **tol)
    torch.testing.assert_close(linear(x, w, b), torch.nn.functional.linear(x, w, b), **tol)
    assert _float_kernel_fits(x, w) == (rows in _kernel_rows(dtype, OPS.vector_width(), cpu_bf16_feature()))
    assert not _float_kernel_fits(torch.randn((64, k)).to(dtype), w)  # many rows: torch's


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_rows_result_does_not_depend_on_the_rows_beside_it(dtype: torch.dtype) -> None:
    """Each row of x gets the same bits alone as in a step of 2-20 rows (passes of 1-8 rows,
    tiles of 4, 3 or 2 output rows, an output-row tail): a verify step's rows are the decode
    steps' own, so drafts keep the greedy tokens."""
    gen = torch.Generator().manual_seed(11)
    w = torch.randn((37, 96), generator=gen).to(dtype)
    x = torch.randn((20, 96), generator=gen).to(dtype)
    alone = torch.cat([OPS.float_linear(x[r : r + 1], w) for r in range(20)])
    for rows in (2, 3, 4, 5, 6, 7, 8, 9, 12, 15, 20):
        assert torch.equal(OPS.float_linear(x[:rows], w), alone[:rows]), rows


def test_kernel_rows_are_the_measured_ones() -> None:
    """Per CPU kind: AVX2 (8 lanes), AVX-512 with AMX, AVX-512 (BF16) without AMX."""
    for feature in (None, "AVX-512 BF16", "AMX"):
        assert list(_kernel_rows(torch.float32, 8, feature)) == list(range(1, KERNEL_MAX_ROWS + 1))
        assert list(_kernel_rows(torch.float16, 16, feature)) == []
    for feature in (None, "AVX-512 BF16", "AMX"):
        assert list(_kernel_rows(torch.float32, 16, feature)) == list(range(1, 33))
    assert list(_kernel_rows(torch.bfloat16, 16, "AMX")) == list(range(1, KERNEL_MAX_ROWS + 1))
    assert list(_kernel_rows(torch.bfloat16, 16, "AVX-512 BF16")) == list(range(1, 25))
    assert list(_kernel_rows(torch.bfloat16, 8, None)) == list(range(1, KERNEL_MAX_ROWS + 1))


def test_kernel_rejects_bad_shapes() -> None:
    q = Int8Weight.quantize(_weight(4, GROUP))
    with pytest.raises(RuntimeError, match="scale must be"):
        OPS.int8_linear(torch.randn(1, GROUP), q.q, q.scale[:, :0], torch.empty(0))
    with pytest.raises(RuntimeError, match="offset must be empty or shaped as scale"):
        OPS.int8_linear(torch.randn(1, GROUP), q.q, q.scale, torch.zeros(4, 2))
    with pytest.raises(RuntimeError, match="offset must be empty or shaped as scale"):
        OPS.int8_dequant_(q.q, q.scale, torch.zeros(3, 1), torch.empty(4, GROUP))
    with pytest.raises(ValueError, match="divisible by 32"):
        Int8Weight.quantize(torch.randn(4, 48))


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3-hd128"])
def test_quantized_tiny_model_follows_its_float_twin(name: str, tiny_model_dir: Callable[[str], str]) -> None:
    """Every matmul weight replaced (a tied embedding too: it is the LM head), and
    logits within a few percent of the float model's: prefill (dequantize path) and decode
    (the kernel) rows alike."""
    assert name in TINY_MODELS
    folder = tiny_model_dir(name)
    ref = load_model(folder, torch.float32).model
    quant = load_model(folder, torch.float32, quantization="int8").model
    left = [n for n, p in quant.named_parameters() if p.dim() == 2]
    # no float matmul weight remains; an untied model's embedding table is only looked up
    assert left == ([] if ref.lm_head is None else ["model.embed_tokens.weight"]), left
    assert sum(isinstance(m.weight, Int8Weight) for m in quant.modules() if hasattr(m, "weight")) >= 8
    prompts = [[1, 7, 9, 30, 4, 11, 60, 3] * 3, [5, 6, 200, 17]]
    greedy_ref = ModelRunner(ref).greedy(prompts, 6)
    runner = ModelRunner(quant)
    assert runner.greedy(prompts, 6)[0][:2] == greedy_ref[0][:2]
    # One prompt per forward: 24 rows (the dequantize path), then a single row (the kernel).
    for rows in (prompts[0], prompts[1][:1]):
        a = ModelRunner(ref).last_token_logits([rows])
        b = ModelRunner(quant).last_token_logits([rows])
        assert ((a - b).norm() / a.norm()).item() < 0.05


def test_settings_name_the_field() -> None:
    with pytest.raises(ValueError, match="quantization must be one of none, int8, int4, gguf, auto"):
        ServerArgs(quantization="int2").resolve()
    with pytest.raises(ValueError, match="quantization: int8 weights are served by one rank"):
        ServerArgs(quantization="int8", tp_size=2).resolve()
    with pytest.raises(ValueError, match="quantization must be one of"):
        quantize_model(torch.nn.Linear(64, 64), "fp4")


def test_default_model_int8_through_the_engine(default_model_path: str) -> None:
    """The real server processes with int8 weights: the same greedy opening as float32 on a
    plain question, and the KV memory back to free afterwards."""
    from radixserve.engine import Engine

    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    params = {"max_new_tokens": 8, "temperature": 0}
    outs = {}
    for quant in ("none", "int8"):
        with Engine(quantization=quant, max_total_tokens=4096) as engine:
            outs[quant] = engine.generate(prompt, params)["output_ids"]
            assert engine.info.quantization == quant
            report = engine.check_memory()
            assert report["ok"] and report["locked_tokens"] == 0 and report["request_pages"] == 0, report
    assert outs["int8"] == outs["none"]
