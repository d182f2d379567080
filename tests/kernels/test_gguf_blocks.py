"""4-bit blocks and a GGUF's own blocks (radixserve/quantization/, cpu_ext/linear_ops.cpp): the
int4 kernel and dequantization against the dequantized weight, every row and block tail; a GGUF
written here with Q4_0 / Q4_1 / Q8_0 / F16 tensors (q and k rows in llama.cpp's order) served
into a tiny model; the default model's blocks equal its converted float32 weights bit for bit;
``auto``; and the default model through the Engine with its blocks against float32."""

from __future__ import annotations

import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.model_runner import ModelRunner

from radixserve import cpu_ext
from radixserve.checkpoint.gguf_index import gguf_source, read_gguf_index, served_tensor_count
from radixserve.config import ServerArgs
from radixserve.model.loader import load_model
from radixserve.quantization import (
    BLOCK4,
    KERNEL_MAX_ROWS,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    linear,
)

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from bench.gguf_model import llama_order  # noqa: E402

OPS = cpu_ext.load()


def _weight(n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn((n, k), generator=gen) * 0.05
    w[0, :BLOCK4] += 3.0  # a block far off the rest: its own d and m keep the others fine
    return w


def test_int4_rounding_is_within_half_a_step_of_each_block() -> None:
    w = _weight(37, 3 * BLOCK4)
    q = Int4Weight.quantize(w)
    assert q.qs.shape == (37, 3 * BLOCK4 // 2) and q.d.shape == q.m.shape == (37, 3)
    assert q.d.dtype == q.m.dtype == torch.float16  # as a GGUF's Q4_1 block holds them
    step = q.d.float().repeat_interleave(BLOCK4, dim=1)
    err = (q.dequantized(torch.float32) - w).abs()
    # half a step, plus what rounding d and m to float16 moves the grid (15 steps of d's error)
    assert (err <= 0.5 * step + 16 * 2**-11 * (step + q.m.float().abs().repeat_interleave(BLOCK4, dim=1))).all()
    assert q.nbytes == 37 * 3 * (16 + 4)  # 16 bytes of nibbles, d and m 2 bytes each


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, KERNEL_MAX_ROWS])
@pytest.mark.parametrize("n, k", [(5, BLOCK4), (130, 18 * BLOCK4), (9, 16 * BLOCK4), (6, 70 * BLOCK4)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_kernel_equals_the_dequantized_matmul(rows: int, n: int, k: int, dtype: torch.dtype) -> None:
    """Every output-row tail (NB), input-row tail (4, 2 and 1 rows a pass) and block; the
    float16 scales widened 16 at a time, with and without a tail, across the 64-block span."""
    q = Int4Weight.quantize(_weight(n, k, seed=rows))
    x = torch.randn((rows, k), generator=torch.Generator().manual_seed(7)).to(dtype)
    ref = x.double() @ q.dequantized(torch.float32).double().T
    out = OPS.int4_linear(x, q.qs, q.d, q.m)
    sums = OPS.int4_linear(x.float(), q.qs, q.d, q.m)  # the same products, in float32
    assert out.shape == (rows, n) and out.dtype == dtype and sums.dtype == torch.float32
    torch.testing.assert_close(sums.double(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(out, sums.to(dtype))  # x's dtype: each float32 sum rounded once
    for r in range(rows):  # a row's sums do not depend on the rows beside it (drafts on or off)
        assert torch.equal(OPS.int4_linear(x[r:r + 1].float(), q.qs, q.d, q.m), sums[r:r + 1])
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(linear(x, q).double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4_many_rows_dequantize_into_the_shared_buffer(dtype: torch.dtype) -> None:
    q = Int4Weight.quantize(_weight(70, 4 * BLOCK4))
    out = torch.empty((70, 4 * BLOCK4), dtype=dtype)
    OPS.int4_dequant_(q.qs, q.d, q.m, out)
    assert torch.equal(out, q.dequantized(dtype))
    wide = Int4Weight.quantize(_weight(3, 37 * BLOCK4))  # 16 + 16 + a tail of 5 scales a row
    out = torch.empty((3, 37 * BLOCK4), dtype=dtype)
    OPS.int4_dequant_(wide.qs, wide.d, wide.m, out)
    assert torch.equal(out, wide.dequantized(dtype))
    for rows in (KERNEL_MAX_ROWS + 1, 64):  # past the kernel: the float matmul on the buffer
        x = torch.randn((rows, 4 * BLOCK4)).to(dtype)
        torch.testing.assert_close(q.matmul(x), x @ q.dequantized(dtype).T)


def test_bfloat16_dequantization_rounds_ties_to_even() -> None:
    """d = 1 + 2^-8: odd q lands exactly between two bfloat16 values; the vector rounding of
    the dequantization kernels gives torch's (nearest, ties to even)."""
    n, k = 4, 2 * BLOCK4
    q = torch.arange(n * k).remainder(16).to(torch.uint8).view(n, k // BLOCK4, BLOCK4)
    d = torch.full((n, k // BLOCK4), 1 + 2**-8)
    m = torch.tensor([0.0, -8.0, 2**-9, -3.0]).repeat_interleave(k // BLOCK4).view(n, -1)
    w = Int4Weight((q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, k // 2), d, m, torch.float32)
    out = torch.empty((n, k), dtype=torch.bfloat16)
    OPS.int4_dequant_(w.qs, w.d, w.m, out)
    assert torch.equal(out, w.dequantized(torch.float32).to(torch.bfloat16))
    q8 = Int8Weight(torch.arange(-64, 64, dtype=torch.int8).repeat(n, 1), torch.full((n, 4), 1 + 2**-8),
                    torch.float32)
    out8 = torch.empty((n, 128), dtype=torch.bfloat16)
    OPS.int8_dequant_(q8.q, q8.scale, torch.empty(0), out8)
    assert torch.equal(out8, q8.dequantized(torch.float32).to(torch.bfloat16))


def test_int4_subnormal_float16_scales_are_widened_exactly() -> None:
    """d and m below float16's smallest normal (2^-14), as the smallest blocks of a GGUF hold."""
    n, k = 5, 20 * BLOCK4
    q = torch.arange(n * k).remainder(16).to(torch.uint8).view(n, k // BLOCK4, BLOCK4)
    d = (torch.arange(n * (k // BLOCK4)).view(n, -1) % 7 + 1) * 2.0**-24
    m = -(torch.arange(n * (k // BLOCK4)).view(n, -1) % 5) * 2.0**-22
    w = Int4Weight((q[:, :, :16] | (q[:, :, 16:] << 4)).reshape(n, k // 2), d, m, torch.float32)
    assert torch.equal(w.d.float(), d) and torch.equal(w.m.float(), m)  # representable as stored
    out = torch.empty((n, k))
    OPS.int4_dequant_(w.qs, w.d, w.m, out)
    assert torch.equal(out, w.dequantized(torch.float32))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(OPS.int4_linear(x, w.qs, w.d, w.m).double(),
                               x.double() @ out.double().T, rtol=1e-5, atol=1e-12)


def test_int4_rows_and_bad_shapes() -> None:
    q = Int4Weight.quantize(_weight(9, 2 * BLOCK4))
    ids = torch.tensor([8, 0, 3])
    assert torch.equal(q.embedding(ids), q.dequantized(torch.float32)[ids])
    with pytest.raises(RuntimeError, match="d and m must be"):
        OPS.int4_linear(torch.randn(1, 2 * BLOCK4), q.qs, q.d[:, :1], q.m)
    with pytest.raises(RuntimeError, match=r"d and m must be .* float16"):
        OPS.int4_linear(torch.randn(1, 2 * BLOCK4), q.qs, q.d.float(), q.m)
    with pytest.raises(RuntimeError, match="qs must be"):
        OPS.int4_linear(torch.randn(1, 3 * BLOCK4), q.qs, q.d, q.m)
    with pytest.raises(ValueError, match="divisible by 32"):
        Int4Weight.quantize(torch.randn(4, 48))


def _write_gguf(path: str, model: torch.nn.Module, kinds: dict[str, str]) -> None:
    """A GGUF of the model's matmul weights, each of the kind ``kinds`` gives its checkpoint
    name (default Q4_1); the model's float weights become what the file dequantizes to, as the
    converter's would.  A tokenizer-like string array exercises the header reader."""
    import gguf
    from gguf.quants import dequantize, quantize

    config = model.config
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, config.num_layers)
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_array("tokenizer.ggml.tokens", [f"tok{i}" for i in range(300)])
    writer.add_custom_alignment(64)
    for name, module in model.named_modules():
        shards = getattr(module, "shard_offsets", None)
        if not getattr(module, "quantizable", False) and not (model.lm_head is None and name == "model.embed_tokens"):
            continue
        parts = ([(f"{name.rsplit('.', 1)[0]}.{s}_proj.weight", s) for s in shards] if shards
                 else [(f"{name}.weight", None)])
        for hf_name, shard in parts:
            start, size = shards[shard] if shard else (0, module.weight.shape[0])
            w = module.weight.detach()[start:start + size].numpy().astype(np.float32)
            heads = {"q": config.num_heads, "k": config.num_kv_heads}.get(shard or "")
            stored = llama_order(w, heads) if heads else w
            kind = kinds.get(hf_name, "Q4_1")
            qtype = getattr(gguf.GGMLQuantizationType, kind)
            data = stored.astype(np.float16) if kind == "F16" else quantize(stored, qtype)
            back = data.astype(np.float32) if kind == "F16" else dequantize(data, qtype)
            if heads:  # undo the interleave: the float weight the converter would write
                back = back.reshape(heads, back.shape[0] // heads // 2, 2, -1).swapaxes(1, 2).reshape(back.shape)
            with torch.no_grad():
                module.weight[start:start + size] = torch.from_numpy(np.ascontiguousarray(back))
            gguf_name = names.get_name(hf_name, try_suffixes=(".weight",))
            writer.add_tensor(gguf_name, data, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_a_ggufs_blocks_served_into_a_tiny_model(tiny_model_dir: Callable[[str], str], tmp_path) -> None:
    """Q4_0, Q4_1 and Q8_0 tensors become the layers' weights, q and k rows reordered; an F16
    tensor, and a merged layer whose parts differ in type, keep their float weights; the
    model's output is the float model's."""
    from radixserve.quantization import quantize_model

    folder = tiny_model_dir("llama")
    model = load_model(folder, torch.float32).model
    kinds = {"model.layers.0.self_attn.q_proj.weight": "Q8_0", "model.layers.0.self_attn.k_proj.weight": "Q8_0",
             "model.layers.0.self_attn.v_proj.weight": "Q8_0", "model.layers.0.mlp.down_proj.weight": "Q4_0",
             "model.layers.1.self_attn.o_proj.weight": "F16", "model.layers.1.mlp.up_proj.weight": "Q8_0"}
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, model, kinds)
    index = read_gguf_index(path)
    assert index.architecture == "llama" and index.tensors["blk.0.ffn_down.weight"].kind == "Q4_0"
    assert served_tensor_count(path) == len(index.tensors) - 1  # all but the F16 one
    floats = {n: m.weight.detach().clone() for n, m in model.named_modules() if getattr(m, "quantizable", False)}
    prompts = [[1, 7, 9, 30, 4, 11, 60, 3] * 3, [5, 6, 200, 17]]
    ref_logits = ModelRunner(model).last_token_logits(prompts)
    quantize_model(model, "gguf", path)
    layers = dict(model.named_modules())
    assert isinstance(layers["model.layers.0.self_attn.qkv_proj"].weight, Int8Weight)
    assert layers["model.layers.0.self_attn.qkv_proj"].weight.group == 32
    assert isinstance(layers["model.layers.0.mlp.down_proj"].weight, Int4Weight)
    assert isinstance(layers["model.layers.1.self_attn.qkv_proj"].weight, Int4Weight)  # reordered q / k
    assert isinstance(layers["model.layers.1.self_attn.o_proj"].weight, torch.nn.Parameter)  # F16
    assert isinstance(layers["model.layers.1.mlp.gate_up_proj"].weight, torch.nn.Parameter)  # Q4_1 + Q8_0
    for name, weight in floats.items():
        now = layers[name].weight
        got = now.dequantized(torch.float32) if isinstance(now, QuantizedWeight) else now.detach()
        assert torch.equal(got, weight), name
    torch.testing.assert_close(ModelRunner(model).last_token_logits(prompts), ref_logits, rtol=1e-4, atol=1e-4)


def test_blocks_read_unlike_the_gguf_package_keep_the_float_weight(
        tiny_model_dir: Callable[[str], str], tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A reader that disagrees with the ``gguf`` package's on a layer's rows (here Q4_1 blocks
    read as Q4_0) leaves that layer its float weight; the other types are still served."""
    import dataclasses

    from radixserve.quantization import int4, quantize_model

    model = load_model(tiny_model_dir("llama"), torch.float32).model
    path = str(tmp_path / "tiny.gguf")
    _write_gguf(path, model, {"model.layers.1.mlp.down_proj.weight": "Q8_0"})

    def as_q4_0(blocks: torch.Tensor, dtype: torch.dtype) -> Int4Weight:
        return int4._read_q4_0(blocks[:, :, 2:], dtype)

    monkeypatch.setattr(int4, "Q4_1", dataclasses.replace(int4.Q4_1, read=as_q4_0))
    quantize_model(model, "gguf", path)
    layers = dict(model.named_modules())
    assert isinstance(layers["model.layers.0.mlp.down_proj"].weight, torch.nn.Parameter)
    assert isinstance(layers["model.layers.1.mlp.down_proj"].weight, Int8Weight)


def test_the_default_models_blocks_are_its_float32_weights(default_model_path: str) -> None:
    """Every matmul of the default model (Q4_1 layers, the Q8_0 table that is its tied LM
    head) served from the GGUF, dequantizing to the converted float32 weights exactly, in a
    fifth of the bytes."""
    ref = load_model(None, torch.float32).model
    quant = load_model(None, torch.float32, quantization="gguf").model
    ref_layers = dict(ref.named_modules())
    kinds = []
    before = after = 0
    for name, module in quant.named_modules():
        if isinstance(getattr(module, "weight", None), QuantizedWeight):
            kinds.append(type(module.weight).__name__)
            want = ref_layers[name].weight.detach()
            assert torch.equal(module.weight.dequantized(torch.float32), want), name
            before += want.numel() * 4
            after += module.weight.nbytes
    assert kinds.count("Int4Weight") == 4 * ref.config.num_layers and kinds.count("Int8Weight") == 1
    assert after < before / 4.5


def test_auto_resolves_to_the_ggufs_blocks_only_where_they_exist(tiny_model_dir: Callable[[str], str]) -> None:
    assert gguf_source(None) is not None
    assert ServerArgs(quantization="auto", device="cpu").resolve().quantization == "gguf"
    folder = tiny_model_dir("llama")
    assert ServerArgs(model=folder, quantization="auto", device="cpu").resolve().quantization == "none"
    assert ServerArgs(quantization="auto", device="cpu", tp_size=2).resolve().quantization == "none"
    with pytest.raises(ValueError, match="quantization gguf serves a .gguf model's own blocks"):
        ServerArgs(model=folder, quantization="gguf", device="cpu").resolve()
    with pytest.raises(ValueError, match="quantization: int4 weights are served by one rank"):
        ServerArgs(quantization="int4", tp_size=2).resolve()
    tiny = load_model(folder, torch.float32, quantization="int4").model  # the LM head in int8, as llama.cpp
    assert isinstance(tiny.lm_head.weight, Int8Weight) and tiny.lm_head.weight.group == 32
    layers = [m for m in tiny.modules() if getattr(m, "quantizable", False) and m is not tiny.lm_head]
    assert len(layers) == 4 * tiny.config.num_layers and all(isinstance(m.weight, Int4Weight) for m in layers)


def test_default_model_blocks_through_the_engine(default_model_path: str) -> None:
    """The real server processes serving the GGUF's blocks (``auto``): the float32 model's
    greedy tokens, prefill (the many-row path) and decode (the kernels) alike, and the KV
    memory back to free afterwards."""
    from radixserve.engine import Engine

    prompts = ["<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
               "<|im_start|>user\nWrite a haiku about the sea.<|im_end|>\n<|im_start|>assistant\n"]
    params = {"max_new_tokens": 24, "temperature": 0}
    outs = {}
    for quant in ("none", "auto"):
        with Engine(quantization=quant, dtype="float32", max_total_tokens=4096) as engine:
            outs[quant] = [engine.generate(p, params)["output_ids"] for p in prompts]
            assert engine.info.quantization == ("gguf" if quant == "auto" else "none")
            report = engine.check_memory()
            assert report["ok"] and report["locked_tokens"] == 0 and report["request_pages"] == 0, report
    assert outs["auto"] == outs["none"]
