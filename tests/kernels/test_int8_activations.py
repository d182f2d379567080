"""``--int8-activations``: decode rows through quantized weights with x quantized to int8 per
block of 32 (``int4_linear_q8`` / ``int8_linear_q8``, AVX-512 VNNI dot products).  The kernel against a float64 reference
of the same arithmetic, its error against the exact product, the settings that refuse it, and
the real server processes with it on.  Where the kernels were built without AVX-512 VNNI the
kernel's tests do not apply (the setting is refused there, which is tested everywhere)."""

from __future__ import annotations

import pytest
import torch

from radixserve import cpu_ext
from radixserve.config import ServerArgs
from radixserve.quantization import BLOCK4, KERNEL_MAX_ROWS, Int4Weight, Int8Weight, quantize_model

OPS = cpu_ext.load()
VNNI = OPS is not None and OPS.q8_supported()
needs_vnni = pytest.mark.skipif(not VNNI, reason="the CPU kernels were built without AVX-512 VNNI")


def _q8_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, centre: torch.Tensor | None) -> torch.Tensor:
    """float64: xq = round(x / dx) per block of 32 with dx = amax / 127, then per block scale dx
    sum q xq (+ centre sum x); ``q`` [N, K] as the kernel multiplies it (a 4-bit one less 8)."""
    m, k = x.shape
    xb = x.float().view(m, k // BLOCK4, BLOCK4)
    amax = xb.abs().amax(-1, keepdim=True)
    xq = torch.round(xb * torch.where(amax > 0, 127 / amax, torch.zeros_like(amax))).double()
    sums = torch.einsum("mbk,nbk->mnb", xq, q.double().view(q.shape[0], -1, BLOCK4))
    out = (sums * scale.double()[None] * (amax / 127).double()[:, None, :, 0]).sum(-1)
    if centre is not None:
        out += (centre.double()[None] * xb.sum(-1).double()[:, None, :]).sum(-1)
    return out


def _q8_int4_reference(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """d dx sum (q - 8) xq + (m + 8 d) sum x."""
    halves = w.qs.view(w.qs.shape[0], -1, BLOCK4 // 2)
    q = torch.cat([halves & 15, halves >> 4], dim=2).view(w.qs.shape[0], -1).double() - 8
    return _q8_reference(x, q, w.d.float(), w.m.float() + 8 * w.d.float())


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("n, blocks", [(5, 1), (13, 2), (130, 18), (7, 7), (64, 48)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_is_the_q8_arithmetic(rows: int, n: int, blocks: int, dtype: torch.dtype) -> None:
    """Every group tail (1-3 blocks past the last whole four), output-row tail and row pair."""
    gen = torch.Generator().manual_seed(rows * 100 + blocks)
    w = Int4Weight.quantize(torch.randn((n, blocks * BLOCK4), generator=gen) * 0.05)
    x = torch.randn((rows, blocks * BLOCK4), generator=gen).to(dtype)
    if x.numel() > BLOCK4:
        x[0, :BLOCK4] = 0  # an all-zero block: scale 0, no division by it
    got = OPS.int4_linear_q8(x, w.qs, w.d, w.m)
    assert got.shape == (rows, n) and got.dtype == dtype
    want = _q8_int4_reference(x, w)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol)
    # Against the exact product of the 4-bit weights: an error, small, never zero.
    exact = x.double() @ w.dequantized(torch.float32).double().T
    err = float((OPS.int4_linear_q8(x.float(), w.qs, w.d, w.m).double() - exact).norm() / exact.norm())
    assert 1e-4 < err < 3e-2


@needs_vnni
@pytest.mark.parametrize("kind", ["int4", "int8", "int8_offset"])
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(kind: str) -> None:
    """Each row of x gets the same bits alone as in a step of 2-17 rows (passes of 1-4 rows over
    4 output rows, 5-8 over pairs, more as passes of 8): a verify step's rows are the decode
    steps' own, so drafts keep the greedy tokens with the flag too."""
    gen = torch.Generator().manual_seed(7)
    n, k = 37, 11 * BLOCK4  # an output-row tail and a group tail of 3 blocks
    base = torch.randn((n, k), generator=gen) * 0.05
    if kind == "int4":
        w = Int4Weight.quantize(base)
        run = lambda x: OPS.int4_linear_q8(x, w.qs, w.d, w.m)  # noqa: E731
    else:
        w = Int8Weight.quantize(base, group=BLOCK4, asymmetric=kind == "int8_offset")
        offset = w.offset if w.offset is not None else torch.empty(0)
        run = lambda x: OPS.int8_linear_q8(x, w.q, w.scale, offset)  # noqa: E731
    x = torch.randn((17, k), generator=gen)
    alone = torch.cat([run(x[r : r + 1]) for r in range(17)])
    for rows in (2, 3, 4, 5, 7, 8, 9, 17):
        assert torch.equal(run(x[:rows]), alone[:rows]), rows


@needs_vnni
@pytest.mark.parametrize("rows", [1, 3, 6, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("n, blocks", [(5, 1), (13, 2), (130, 18), (7, 7)])
@pytest.mark.parametrize("asymmetric", [False, True])
def test_int8_kernel_is_the_q8_arithmetic(rows: int, n: int, blocks: int, asymmetric: bool) -> None:
    """Int8 groups of 32: a GGUF's Q8_0 (symmetric) and --quantization int8 (with offsets)."""
    gen = torch.Generator().manual_seed(rows * 10 + blocks)
    w = Int8Weight.quantize(torch.randn((n, blocks * BLOCK4), generator=gen) * 0.05, BLOCK4, asymmetric=asymmetric)
    x = torch.randn((rows, blocks * BLOCK4), generator=gen)
    got = OPS.int8_linear_q8(x, w.q, w.scale, w.offset if asymmetric else torch.empty(0))
    torch.testing.assert_close(got.double(), _q8_reference(x, w.q, w.scale, w.offset), rtol=1e-5, atol=1e-5)
    exact = x.double() @ w.dequantized(torch.float32).double().T
    err = float((got.double() - exact).norm() / exact.norm())
    assert 1e-4 < err < 3e-2
    with pytest.raises(RuntimeError, match="groups of 32"):
        wide = Int8Weight.quantize(torch.randn((n, 64), generator=gen), 64)
        OPS.int8_linear_q8(torch.randn((rows, 64)), wide.q, wide.scale, torch.empty(0))


@needs_vnni
def test_only_kernel_rows_take_int8_activations() -> None:
    """A decode step's rows go through int4_linear_q8; a prefill's rows stay on the exact
    dequantized matmul."""
    gen = torch.Generator().manual_seed(5)
    w = Int4Weight.quantize(torch.randn((40, 4 * BLOCK4), generator=gen) * 0.05)
    few, many = (torch.randn((r, 4 * BLOCK4), generator=gen) for r in (3, KERNEL_MAX_ROWS + 5))
    w.int8_activations = True
    assert torch.equal(w.matmul(few), OPS.int4_linear_q8(few, w.qs, w.d, w.m))
    assert not torch.equal(w.matmul(few), OPS.int4_linear(few, w.qs, w.d, w.m))
    torch.testing.assert_close(w.matmul(many).double(), many.double() @ w.dequantized(torch.float32).double().T,
                               rtol=1e-5, atol=1e-5)
    for asymmetric in (False, True):  # int8 groups of 32: a GGUF's Q8_0 and --quantization int8
        w8 = Int8Weight.quantize(torch.randn((40, 4 * BLOCK4), generator=gen) * 0.05, BLOCK4, asymmetric)
        w8.int8_activations = True
        offset = w8.offset if asymmetric else torch.empty(0)
        assert torch.equal(w8.matmul(few), OPS.int8_linear_q8(few, w8.q, w8.scale, offset))
        assert not torch.equal(w8.matmul(few), OPS.int8_linear(few, w8.q, w8.scale, offset))
        torch.testing.assert_close(w8.matmul(many).double(),
                                   many.double() @ w8.dequantized(torch.float32).double().T, rtol=1e-5, atol=1e-5)


def test_settings_refuse_it_without_quantized_weights(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="int8_activations multiplies quantized weights"):
        ServerArgs(model=tiny_model_dir("llama"), quantization="none", int8_activations=True).resolve()
    with pytest.raises(ValueError, match="int8_activations multiplies quantized weights"):
        ServerArgs(model=tiny_model_dir("llama"), quantization="auto", int8_activations=True).resolve()
    from radixserve.model.loader import load_model

    model = load_model(tiny_model_dir("llama"), torch.float32).model
    with pytest.raises(ValueError, match="int8_activations needs quantized weights"):
        quantize_model(model, "none", None, int8_activations=True)


@needs_vnni
@pytest.mark.parametrize("mode", ["int4", "int8"])
def test_every_quantized_layer_takes_it(tiny_model_dir, mode: str) -> None:
    """int4: the 4-bit layers; int8: every layer (groups of 32); the int8 LM head of both keeps
    float activations (int8_linear: faster there, and exact)."""
    from radixserve.model.loader import load_model

    model = load_model(tiny_model_dir("llama"), torch.float32).model
    quantize_model(model, mode, None, int8_activations=True)
    layers = [m.weight for m in model.model.layers.modules() if isinstance(getattr(m, "weight", None), (Int4Weight, Int8Weight))]
    assert len(layers) == 4 * model.config.num_layers
    assert all(w.int8_activations for w in layers)
    head = model.lm_head.weight
    assert isinstance(head, Int8Weight) and not head.int8_activations
    assert head.kernel_args(1)[0] == "int8_linear"


def test_no_kernels_or_no_vnni_refuses_it(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the CPU kernels did not build (no compiler; the loader's settled answer is then
    None) or were built without AVX-512 VNNI, the load refuses instead of running another path."""
    from radixserve.model.loader import load_model

    model = load_model(tiny_model_dir("llama"), torch.float32).model
    if not VNNI:
        with pytest.raises(ValueError, match="AVX-512 VNNI.*built without it"):
            quantize_model(model, "int4", None, int8_activations=True)
    monkeypatch.setitem(cpu_ext._loaded, "mod", None)
    with pytest.raises(ValueError, match="AVX-512 VNNI.*did not build"):
        quantize_model(model, "int4", None, int8_activations=True)


@needs_vnni
def test_the_default_model_through_the_engine(default_model_path: str) -> None:
    """The real server processes with int8 activations: greedy text that starts as float32's (a
    near tie later may part them), logprobs that are not the exact products' (the setting
    reached the scheduler's weights), and the KV memory back to free."""
    from radixserve.engine import Engine

    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    params = {"max_new_tokens": 8, "temperature": 0}
    logprobs = {}
    for flag in (False, True):
        with Engine(int8_activations=flag, dtype="float32", max_total_tokens=4096) as engine:
            out = engine.generate(prompt, params, return_logprob=True)
            assert engine.info.quantization == "gguf"
            report = engine.check_memory()
            assert report["ok"] and report["locked_tokens"] == 0 and report["request_pages"] == 0, report
        assert out["text"].startswith("The capital of France is Paris")
        logprobs[flag] = [entry[0] for entry in out["meta_info"]["output_token_logprobs"]]
    gaps = [abs(a - b) for a, b in zip(logprobs[False], logprobs[True], strict=True)]
    assert 1e-6 < max(gaps) < 0.5


def test_benchmarks_name_it_with_a_suffix() -> None:
    """bench/agent.py and bench/quant_accuracy.py take ``gguf+a8`` in ``--quantizations``."""
    from bench.common import weight_settings

    assert weight_settings("gguf+a8") == {"quantization": "gguf", "int8_activations": True}
    assert weight_settings("int8") == {"quantization": "int8", "int8_activations": False}
    with pytest.raises(ValueError, match=r"\+a8"):
        weight_settings("gguf+a4")
