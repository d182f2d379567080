"""One-row steps of a GGUF's K-quant weights (Q4_K, Q5_K, Q6_K) with x in 16-bit integers per block of 32
(``kq_linear_q16``, cpu_ext/kquant_wide.cpp: AVX-512 VNNI dot products of the stored q with x's
two bytes), as a server that drafts no tokens runs them: the error against the float64 product
by the ``gguf`` package's weight and its bound, a row's bits alone and beside others, a weight of
parts of several types, which steps take it, and the fused decode layers' bits.  Where the
kernels were built without AVX-512 VNNI the kernel's tests do not apply (the weights are then
never marked, which is tested everywhere)."""

from __future__ import annotations

import pytest
import torch
from test_gguf_kquants import (
    _kquant_scheduler,
    gguf_weight,
    kq_model_dir,  # noqa: F401  (the module fixture the fused layers' test takes)
    quantized_blocks,
    random_blocks,
    same_bits,
)

from radixserve import cpu_ext
from radixserve.quantization import QuantizedWeight
from radixserve.quantization.kquant import QK_K, KQuantWeight

OPS = cpu_ext.load()
VNNI = OPS is not None and OPS.q8_supported()
needs_vnni = pytest.mark.skipif(not VNNI, reason="the CPU kernels were built without AVX-512 VNNI")
X16_MAX = 32639  # the largest |x16| (kquant_wide.cpp): x16 = 256 hi + lo in two signed bytes
EMPTY = torch.empty(0)


def _exact_and_bound(x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact float64 product with the float64 weight w, and the bound of x's rounding to 16
    bits (half a step, amax / X16_MAX / 2 per block of 32, times the block's sum of |w|) plus
    float32 sums' rounding."""
    m, k = x.shape
    exact = x.double() @ w.T
    half_step = x.double().view(m, k // 32, 32).abs().amax(-1) / X16_MAX / 2
    wsum = w.abs().view(w.shape[0], k // 32, 32).sum(-1)
    return exact, half_step @ wsum.T + 1e-5 * (x.double().abs() @ w.abs().T)


@needs_vnni
@pytest.mark.parametrize("kind", ["Q4_K", "Q5_K", "Q6_K"])
@pytest.mark.parametrize("n, k", [(1, QK_K), (3, 2 * QK_K), (37, 3 * QK_K), (6, 8 * QK_K)])
def test_error_is_x_rounded_to_16_bits(kind: str, n: int, k: int) -> None:
    """Random blocks (every scale, min and q) and quantized ones, 1-5 rows, output-row tails
    (1-3 past whole tiles of 4), a block of zeros: within the bound, and not the float kernel's
    bits (the products are taken another way)."""
    gen = torch.Generator().manual_seed(n * 10 + k)
    for blocks in (random_blocks(n, k, kind, seed=n), quantized_blocks(n, k, kind, seed=n)):
        w = gguf_weight(blocks, kind).double()
        for rows in (1, 2, 5):
            x = torch.randn((rows, k), generator=gen)
            x[0, 32:64] = 0  # a block of zeros: scale 0, no division by it
            x[-1, 64:96] *= 1e-3  # a block far smaller than its neighbours
            got = OPS.kq_linear_q16(x, blocks, EMPTY, EMPTY)
            assert got.shape == (rows, n) and got.dtype == torch.float32
            exact, bound = _exact_and_bound(x, w)
            assert bool(((got.double() - exact).abs() <= bound).all()), (kind, rows)
            assert not torch.equal(got, OPS.kq_linear(x, blocks, EMPTY, EMPTY))
            half = x.bfloat16()  # a bfloat16 model: the same sums, rounded once
            assert same_bits(OPS.kq_linear_q16(half, blocks, EMPTY, EMPTY),
                             OPS.kq_linear_q16(half.float(), blocks, EMPTY, EMPTY).bfloat16())


@needs_vnni
def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    blocks = random_blocks(13, 2 * QK_K, "Q4_K", seed=3)
    x = torch.randn((9, 2 * QK_K), generator=torch.Generator().manual_seed(3))
    alone = torch.cat([OPS.kq_linear_q16(x[r:r + 1], blocks, EMPTY, EMPTY) for r in range(9)])
    for rows in (2, 3, 9):
        assert same_bits(OPS.kq_linear_q16(x[:rows], blocks, EMPTY, EMPTY), alone[:rows]), rows


@needs_vnni
def test_a_weight_of_parts_of_several_types() -> None:
    """Q4_K, Q5_K and Q6_K parts in one call (x laid out once for Q4_K and Q5_K, once for Q6_K):
    each part's columns are that part's own products, bit for bit."""
    parts = {kind: random_blocks(n, 2 * QK_K, kind, seed=n) for kind, n in
             (("Q4_K", 5), ("Q5_K", 3), ("Q6_K", 6))}
    x = torch.randn((1, 2 * QK_K), generator=torch.Generator().manual_seed(5))
    got = OPS.kq_linear_q16(x, *parts.values())
    for (kind, blocks), cols in zip(parts.items(), got.split([5, 3, 6], dim=1), strict=True):
        assert same_bits(cols, OPS.kq_linear_q16(x, blocks, EMPTY, EMPTY)), kind


def _kquant_layers(model: torch.nn.Module) -> list[KQuantWeight]:
    return [m.weight for m in model.modules() if isinstance(getattr(m, "weight", None), KQuantWeight)]


@pytest.fixture(scope="module")
def q4_k_m_file(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A small Llama GGUF of llama.cpp's Q4_K_M mix (Q4_K; v, down, the embedding in Q6_K),
    its o in Q5_K."""
    from helpers.gguf_files import Q4_K_M, kind_of, small_model, write_gguf

    path = str(tmp_path_factory.mktemp("wide") / "small.Q4_K_M.gguf")
    return write_gguf(path, small_model("llama"), "llama", kind_of({"attn_output": "Q5_K", **Q4_K_M}, "Q4_K"))


@needs_vnni
def test_only_one_row_steps_take_it(q4_k_m_file: str) -> None:
    """A server without drafts marks every K-quant weight: its one-row steps go through
    kq_linear_q16, 2-8 rows through the float kernel (a speculative verify's rows are the float
    kernel's bits, as are the one-row steps of a server with drafts, which marks none)."""
    from radixserve.model.loader import load_model

    plain = _kquant_layers(load_model(q4_k_m_file, torch.float32, quantization="gguf").model)
    marked = _kquant_layers(load_model(q4_k_m_file, torch.float32, quantization="gguf",
                                       wide_one_row=True).model)
    assert {w.kind for w in marked} >= {"Q4_K", "Q5_K", "Q4_K+Q6_K", "Q6_K"}
    assert all(w.wide_one_row for w in marked) and not any(w.wide_one_row for w in plain)
    for w, p in zip(marked, plain, strict=True):
        assert [w.kernel_args(r)[0] for r in (1, 2, 8)] == ["kq_linear_q16", "kq_linear", "kq_linear"]
        assert p.kernel_args(1)[0] == "kq_linear"
        one = torch.randn((1, w.shape[1]), generator=torch.Generator().manual_seed(2))
        name, tensors = w.kernel_args(1)
        assert same_bits(w.matmul(one), OPS.kq_linear_q16(one, *tensors))
        assert same_bits(p.matmul(one), OPS.kq_linear(one, *tensors))
        assert not torch.equal(w.matmul(one), p.matmul(one)), w.kind


def test_without_vnni_no_weight_is_marked(q4_k_m_file: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels built without AVX-512 VNNI (or none at all): every step keeps kq_linear."""
    from helpers.cpu_ops import WithoutVnni

    from radixserve.model.loader import load_model

    for ops in (WithoutVnni(OPS), None):
        monkeypatch.setattr(cpu_ext, "load", lambda ops=ops: ops)
        model = load_model(q4_k_m_file, torch.float32, quantization="gguf", wide_one_row=True).model
        assert not any(w.wide_one_row for w in _kquant_layers(model))


@needs_vnni
def test_fused_decode_layers_give_the_python_layers_bits(kq_model_dir: str) -> None:  # noqa: F811
    """With every K-quant layer marked, the one C++ call of the decode layers runs the same
    kernels as the Python layers: the same logits, bit for bit."""
    from test_fused_decode import Counting, Off, run

    prompts = [[10, 11, 12, 13, 50], [10, 11, 12, 60, 61, 62], [100, 101]]
    logits = []
    for fused in (True, False):
        sched = _kquant_scheduler(kq_model_dir, "bfloat16")
        layers = _kquant_layers(sched.runner.model)
        assert len(layers) == 8 and isinstance(layers[0], QuantizedWeight)
        for w in layers:
            w.wide_one_row = True
        counting = Counting(sched.runner.model) if fused else Off()
        logits.append(run(sched, counting, prompts)[0])
        if fused:
            assert counting.calls >= 5
    assert len(logits[0]) == len(logits[1])
    assert all(same_bits(a, b) for a, b in zip(*logits, strict=True))
