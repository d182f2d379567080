"""One-row steps of 4-bit weights with x in 16-bit integers per block of 32 (``int4_linear_q16``,
AVX-512 VNNI dot products over x's two bytes), as a server that drafts no tokens runs them: the
kernel's error against the exact product and its bound, a row's bits alone and beside others,
and which steps take it.  Where the kernels were built without AVX-512 VNNI the kernel's tests do
not apply (the weights are then never marked, which is tested everywhere)."""

from __future__ import annotations

import pytest
import torch

from radixserve import cpu_ext
from radixserve.quantization import BLOCK4, Int4Weight, Int8Weight, quantize_model

OPS = cpu_ext.load()
VNNI = OPS is not None and OPS.q8_supported()
needs_vnni = pytest.mark.skipif(not VNNI, reason="the CPU kernels were built without AVX-512 VNNI")
Q16_MAX = 32639  # the largest |x16| (linear_ops.cpp): x16 = 256 hi + lo in two signed bytes


def _exact_and_bound(x: torch.Tensor, w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact float64 product with the 4-bit weights, and the bound of x's rounding to 16 bits:
    per block half a step (amax / Q16_MAX / 2) times the sum of |w| over the block."""
    m, k = x.shape
    wd = w.dequantized(torch.float32).double()
    exact = x.double() @ wd.T
    half_step = x.double().view(m, k // BLOCK4, BLOCK4).abs().amax(-1) / Q16_MAX / 2  # [m, blocks]
    wsum = wd.abs().view(wd.shape[0], k // BLOCK4, BLOCK4).sum(-1)  # [n, blocks]
    return exact, half_step @ wsum.T


@needs_vnni
@pytest.mark.parametrize("rows", [1, 2, 5, 8])
@pytest.mark.parametrize("n, blocks", [(5, 1), (13, 2), (130, 18), (7, 7), (64, 48)])
def test_kernel_error_is_x_rounded_to_16_bits(rows: int, n: int, blocks: int) -> None:
    """Every group tail (1-3 blocks past the last whole four) and output-row tail: within the
    bound of x's rounding (plus float32 sums), and 50x under the int8 activations' error."""
    gen = torch.Generator().manual_seed(rows * 100 + blocks)
    w = Int4Weight.quantize(torch.randn((n, blocks * BLOCK4), generator=gen) * 0.05)
    x = torch.randn((rows, blocks * BLOCK4), generator=gen)
    if x.numel() > BLOCK4:
        x[0, :BLOCK4] = 0  # an all-zero block: scale 0, no division by it
    got = OPS.int4_linear_q16(x, w.qs, w.d, w.m)
    assert got.shape == (rows, n) and got.dtype == torch.float32
    exact, bound = _exact_and_bound(x, w)
    floats = 1e-6 * (x.double().abs() @ w.dequantized(torch.float32).double().abs().T)  # the float32 sums
    assert bool(((got.double() - exact).abs() <= bound + floats).all())
    err16 = float((got.double() - exact).norm() / exact.norm())
    err8 = float((OPS.int4_linear_q8(x, w.qs, w.d, w.m).double() - exact).norm() / exact.norm())
    assert 0 < err16 < err8 / 50
    xb = x.bfloat16()  # a bfloat16 model: the same sums, rounded once to bfloat16
    assert torch.equal(OPS.int4_linear_q16(xb, w.qs, w.d, w.m), OPS.int4_linear_q16(xb.float(), w.qs, w.d, w.m).bfloat16())


@needs_vnni
def test_a_rows_result_does_not_depend_on_the_rows_beside_it() -> None:
    gen = torch.Generator().manual_seed(3)
    w = Int4Weight.quantize(torch.randn((37, 11 * BLOCK4), generator=gen) * 0.05)
    x = torch.randn((17, 11 * BLOCK4), generator=gen)
    alone = torch.cat([OPS.int4_linear_q16(x[r : r + 1], w.qs, w.d, w.m) for r in range(17)])
    for rows in (2, 3, 4, 5, 8, 9, 17):
        assert torch.equal(OPS.int4_linear_q16(x[:rows], w.qs, w.d, w.m), alone[:rows]), rows


@needs_vnni
def test_only_one_row_steps_take_it(tiny_model_dir) -> None:
    """The 4-bit layers' one-row steps go through int4_linear_q16; 2-8 rows through the exact
    float kernel, a prefill through the dequantized matmul; the int8 head keeps int8_linear;
    --int8-activations wins where both are asked for."""
    from radixserve.model.loader import load_model

    model = load_model(tiny_model_dir("llama"), torch.float32).model
    quantize_model(model, "int4", None, wide_one_row=True)
    layers = [m.weight for m in model.model.layers.modules() if isinstance(getattr(m, "weight", None), Int4Weight)]
    assert len(layers) == 4 * model.config.num_layers and all(w.wide_one_row for w in layers)
    w = layers[0]
    assert [w.kernel_args(r)[0] for r in (1, 2, 8)] == ["int4_linear_q16", "int4_linear", "int4_linear"]
    head = model.lm_head.weight
    assert isinstance(head, Int8Weight) and head.kernel_args(1)[0] == "int8_linear"
    gen = torch.Generator().manual_seed(1)
    one, two = (torch.randn((r, w.shape[1]), generator=gen) for r in (1, 2))
    assert torch.equal(w.matmul(one), OPS.int4_linear_q16(one, w.qs, w.d, w.m))
    assert not torch.equal(w.matmul(one), OPS.int4_linear(one, w.qs, w.d, w.m))
    assert torch.equal(w.matmul(two), OPS.int4_linear(two, w.qs, w.d, w.m))
    both = load_model(tiny_model_dir("llama"), torch.float32, quantization="int4", int8_activations=True,
                      wide_one_row=True).model
    assert both.model.layers[0].mlp.down_proj.weight.kernel_args(1)[0] == "int4_linear_q8"


def test_without_vnni_no_weight_is_marked(tiny_model_dir, monkeypatch: pytest.MonkeyPatch) -> None:
    """Kernels built without AVX-512 VNNI (or none at all): every step keeps int4_linear."""
    from helpers.cpu_ops import WithoutVnni

    from radixserve import cpu_ext as quant_ext
    from radixserve.model.loader import load_model

    for ops in (WithoutVnni(OPS), None):
        monkeypatch.setattr(quant_ext, "load", lambda ops=ops: ops)
        model = load_model(tiny_model_dir("llama"), torch.float32).model
        quantize_model(model, "int4", None, wide_one_row=True)
        w = model.model.layers[0].mlp.down_proj.weight
        assert isinstance(w, Int4Weight) and not w.wide_one_row and w.kernel_args(1)[0] == "int4_linear"


@needs_vnni
def test_the_server_takes_it_without_drafts_only(default_model_path: str) -> None:
    """The real server processes: without drafts the one-row steps' logprobs differ from the same
    tokens scored in one 8-row step (the float kernel) by a 16-bit rounding's worth; with ngram
    drafts every step keeps the float kernel and the two agree to float order.  The same greedy
    text either way, and the KV memory back to free."""
    from radixserve.engine import Engine
    from radixserve.tokenizer import load_tokenizer

    prompt = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    ids = load_tokenizer(default_model_path).encode(prompt, add_special_tokens=False)
    texts, gaps = {}, {}
    for spec in (None, "ngram"):
        with Engine(dtype="float32", max_total_tokens=4096, speculative_algorithm=spec) as engine:
            out = engine.generate(input_ids=ids, sampling_params={"max_new_tokens": 8, "temperature": 0},
                                  return_logprob=True)
            scored = engine.generate(input_ids=ids + out["output_ids"], sampling_params={"max_new_tokens": 0},
                                     return_logprob=True, logprob_start_len=len(ids))
            report = engine.check_memory()
            assert report["ok"] and report["locked_tokens"] == 0 and report["request_pages"] == 0, report
        texts[spec] = out["output_ids"]
        decoded = [e[0] for e in out["meta_info"]["output_token_logprobs"]]
        forced = [e[0] for e in scored["meta_info"]["input_token_logprobs"]]
        gaps[spec] = max(abs(a - b) for a, b in zip(decoded, forced, strict=True))
    assert texts[None] == texts["ngram"]
    assert 5 * gaps["ngram"] < gaps[None] < 1e-2, gaps
