"""GGUF K-quant blocks (Q4_K, Q5_K, Q6_K) served as stored (quantization/kquant.py,
cpu_ext/kquant_ops.cpp): the few-row kernels against a float64 matmul by the ``gguf`` package's
dequantized weight, on random blocks and on bench/gguf_quantize.py's; the dequantization equal
to the package's bit for bit; the weight class's rows, joins and checks; a GGUF's K-quant
tensors served into a model; the fused decode layers' bits; and the AVX2 build's kernels."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize

from bench.gguf_quantize import quantize
from radixserve import cpu_ext
from radixserve.checkpoint.gguf_index import BLOCK_BYTES as INDEX_BLOCK_BYTES
from radixserve.checkpoint.gguf_index import SERVED_TYPES, read_gguf_index
from radixserve.quantization import KERNEL_MAX_ROWS, QuantizedWeight, mark_weights_changed
from radixserve.quantization.kquant import BLOCK_BYTES, QK_K, KQuantWeight
from radixserve.quantization.registry import get_gguf_type

OPS = cpu_ext.load()
pytestmark = pytest.mark.skipif(OPS is None, reason="the C++ kernels did not build here")
KINDS = list(BLOCK_BYTES)
SHAPES = [(1, QK_K), (3, 2 * QK_K), (37, 3 * QK_K)]  # odd output rows, 1-3 super-blocks a row


def random_blocks(n: int, k: int, kind: str, seed: int) -> torch.Tensor:
    """Random bytes (every scale, min and q), with sane float16 d (and dmin)."""
    gen = np.random.default_rng(seed)
    blocks = gen.integers(0, 256, size=(n, k // QK_K, BLOCK_BYTES[kind]), dtype=np.uint8)
    halves = (gen.standard_normal((n, k // QK_K, 2)) * 0.01).astype(np.float16).view(np.uint8)
    if kind == "Q6_K":
        blocks[..., 208:210] = halves[..., :2]
    else:
        blocks[..., 0:4] = halves
    return torch.from_numpy(blocks)


def quantized_blocks(n: int, k: int, kind: str, seed: int) -> torch.Tensor:
    w = np.random.default_rng(seed).standard_normal((n, k)).astype(np.float32) * 0.05
    return torch.from_numpy(quantize(w, kind).reshape(n, k // QK_K, BLOCK_BYTES[kind]))


def gguf_weight(blocks: torch.Tensor, kind: str) -> torch.Tensor:
    """The gguf package's dequantization of the blocks, float32 [N, K]."""
    n = blocks.shape[0]
    w = dequantize(blocks.reshape(n, -1).numpy(), getattr(GGMLQuantizationType, kind))
    return torch.from_numpy(w.reshape(n, -1))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    bits = torch.int32 if a.element_size() == 4 else torch.int16
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(bits), b.view(bits))


def check_kernel(kind: str, blocks: torch.Tensor, ops: Any = OPS) -> None:
    """The kernel at 1 to KERNEL_MAX_ROWS rows of float32 and bfloat16 x against the float64
    matmul by the gguf package's weight, within float32 sums' rounding; a row's result alone
    is its result beside others; bfloat16 x gives each float32 sum rounded once."""
    weight = KQuantWeight(blocks, kind, torch.float32)
    name, tensors = weight.kernel_args(1)
    kernel = getattr(ops, name)
    w = gguf_weight(blocks, kind).double()
    gen = torch.Generator().manual_seed(blocks.shape[0])
    for rows in range(1, KERNEL_MAX_ROWS + 1):
        x = torch.randn((rows, w.shape[1]), generator=gen)
        sums = kernel(x, *tensors)
        ref = x.double() @ w.T
        bound = 1e-5 * (x.double().abs() @ w.abs().T) + 1e-30
        assert sums.shape == (rows, w.shape[0]) and sums.dtype == torch.float32
        assert ((sums.double() - ref).abs() <= bound).all(), (kind, rows)
        for r in range(rows):
            assert same_bits(kernel(x[r:r + 1], *tensors), sums[r:r + 1]), (kind, rows, r)
        half = x.to(torch.bfloat16)
        assert same_bits(kernel(half, *tensors), kernel(half.float(), *tensors).to(torch.bfloat16))


def check_dequantization(kind: str, blocks: torch.Tensor, ops: Any = OPS) -> None:
    """The C++ dequantization is the gguf package's, bit for bit, and its bfloat16 rounding."""
    ref = gguf_weight(blocks, kind)
    for dtype in (torch.float32, torch.bfloat16):
        out = torch.empty(ref.shape, dtype=dtype)
        ops.kq_dequant_(blocks, kind, out)
        assert same_bits(out, ref.to(dtype)), (kind, dtype)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("n, k", SHAPES)
def test_kernel_matches_the_gguf_dequantized_matmul(kind: str, n: int, k: int) -> None:
    check_kernel(kind, random_blocks(n, k, kind, seed=n))
    check_kernel(kind, quantized_blocks(n, k, kind, seed=n))


@pytest.mark.parametrize("kind", KINDS)
def test_dequantization_is_the_gguf_packages_bit_for_bit(kind: str) -> None:
    for blocks in (random_blocks(37, 3 * QK_K, kind, 1), quantized_blocks(5, 2 * QK_K, kind, 2)):
        check_dequantization(kind, blocks)
        weight = KQuantWeight(blocks, kind, torch.bfloat16)
        ref = gguf_weight(blocks, kind)
        out = torch.empty(weight.shape, dtype=torch.bfloat16)
        weight.dequantize_into(out)
        assert same_bits(out, ref.to(torch.bfloat16))
        # the torch path (a tied embedding's lookups, no kernels)
        assert same_bits(weight.rows(None), ref)
        assert same_bits(weight.dequantized(torch.bfloat16), ref.to(torch.bfloat16))
        ids = torch.tensor([4, 0, 4])
        assert same_bits(weight.rows(ids), ref[ids])
        assert same_bits(weight.embedding(ids), ref[ids].to(torch.bfloat16))


@pytest.mark.parametrize("kind", KINDS)
def test_many_rows_go_through_the_dequantized_weight(kind: str) -> None:
    blocks = quantized_blocks(6, 2 * QK_K, kind, 3)
    weight = KQuantWeight(blocks, kind, torch.float32)
    x = torch.randn((KERNEL_MAX_ROWS + 3, 2 * QK_K), generator=torch.Generator().manual_seed(0))
    ref = x.double() @ gguf_weight(blocks, kind).double().T
    torch.testing.assert_close(weight.matmul(x).double(), ref, rtol=1e-5, atol=1e-5)


def test_rows_take_rows_cat_and_nbytes() -> None:
    blocks = quantized_blocks(7, 2 * QK_K, "Q5_K", 4)
    weight = KQuantWeight(blocks, "Q5_K", torch.float32)
    ref = gguf_weight(blocks, "Q5_K")
    assert weight.shape == (7, 2 * QK_K) and weight.nbytes == 7 * 2 * 176
    index = torch.tensor([6, 2, 2, 0])
    taken = weight.take_rows(index)
    assert isinstance(taken, KQuantWeight) and taken.kind == "Q5_K"
    assert same_bits(taken.rows(None), ref[index])
    other = KQuantWeight(quantized_blocks(2, 2 * QK_K, "Q5_K", 5), "Q5_K", torch.float32)
    joined = KQuantWeight.cat([weight, other])
    assert joined.shape == (9, 2 * QK_K) and joined.blocks.is_contiguous()
    assert same_bits(joined.rows(None), torch.cat([ref, other.rows(None)]))
    q4 = KQuantWeight(quantized_blocks(2, 2 * QK_K, "Q4_K", 5), "Q4_K", torch.float32)
    with pytest.raises(ValueError, match="at most 3 runs"):
        KQuantWeight.cat([weight, q4, weight, q4])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_weight_of_parts_of_several_types(dtype: torch.dtype) -> None:
    """A merged layer whose parts are of different K-quant types (a Q4_K_M file's q, k in Q4_K
    and v in Q6_K): one weight, one kernel call, each row as its own part's kernel gives it."""
    q = KQuantWeight(quantized_blocks(5, 2 * QK_K, "Q4_K", 6), "Q4_K", torch.float32)
    k = KQuantWeight(quantized_blocks(3, 2 * QK_K, "Q4_K", 7), "Q4_K", torch.float32)
    v = KQuantWeight(quantized_blocks(3, 2 * QK_K, "Q6_K", 8), "Q6_K", torch.float32)
    o = KQuantWeight(quantized_blocks(2, 2 * QK_K, "Q5_K", 9), "Q5_K", torch.float32)
    qkv = KQuantWeight.cat([q, k, v, o])
    assert qkv.kinds == ("Q4_K", "Q6_K", "Q5_K") and qkv.shape == (13, 2 * QK_K)
    assert qkv.nbytes == sum(p.nbytes for p in (q, k, v, o))
    ref = torch.cat([p.rows(None) for p in (q, k, v, o)])
    assert same_bits(qkv.rows(None), ref)
    assert same_bits(qkv.rows(torch.tensor([12, 0, 9, 5])), ref[[12, 0, 9, 5]])
    out = torch.empty(13, 2 * QK_K, dtype=dtype)
    qkv.dequantize_into(out)
    assert same_bits(out, ref.to(dtype))
    x = torch.randn(3, 2 * QK_K).to(dtype)
    name, tensors = qkv.kernel_args(3)
    got = getattr(OPS, name)(x, *tensors)
    parts = [getattr(OPS, p.kernel_args(3)[0])(x, *p.kernel_args(3)[1]) for p in (q, k, v, o)]
    assert same_bits(got, torch.cat(parts, dim=1))
    with pytest.raises(ValueError, match="one type"):
        qkv.take_rows(torch.tensor([0]))


@pytest.mark.parametrize("wide", [False, True])
def test_the_threads_split_changes_no_bit(wide: bool) -> None:
    """kq_linear's threads each own a share of every part's rows and take what is left of the
    others' shares: whatever the number of threads (more than the cores, so that one is held up
    and its share taken), each output is computed whole by one thread, the same bits."""
    if wide and not OPS.q8_supported():
        pytest.skip("the CPU kernels were built without AVX-512 VNNI")
    parts = [quantized_blocks(n, 4 * QK_K, kind, 20 + i)
             for i, (n, kind) in enumerate([(301, "Q4_K"), (130, "Q6_K"), (67, "Q5_K")])]
    x = torch.randn(1, 4 * QK_K)
    name = "kq_linear_q16" if wide else "kq_linear"
    before = torch.get_num_threads()
    try:
        outs = []
        for threads in (1, 2, 3, 5):
            torch.set_num_threads(threads)
            outs += [getattr(OPS, name)(x, *parts) for _ in range(3)]
    finally:
        torch.set_num_threads(before)
    assert all(same_bits(out, outs[0]) for out in outs[1:])
    single = [getattr(OPS, name)(x, part, torch.empty(0, dtype=torch.uint8),
                                 torch.empty(0, dtype=torch.uint8)) for part in parts]
    assert same_bits(outs[0], torch.cat(single, dim=1))


def test_bad_shapes_and_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="kind must be one of"):
        KQuantWeight(torch.zeros((2, 1, 110), dtype=torch.uint8), "Q3_K", torch.float32)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        KQuantWeight(torch.zeros((2, 1, 143), dtype=torch.uint8), "Q4_K", torch.float32)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        KQuantWeight(torch.zeros((2, 144), dtype=torch.uint8), "Q4_K", torch.float32)
    with pytest.raises(ValueError, match="blocks must be uint8"):
        KQuantWeight(torch.zeros((2, 1, 210), dtype=torch.int8), "Q6_K", torch.float32)
    blocks = quantized_blocks(3, QK_K, "Q4_K", 0)
    empty = torch.empty(0, dtype=torch.uint8)
    with pytest.raises(ValueError, match="x must be"):
        OPS.kq_linear(torch.randn(2, 2 * QK_K), blocks, empty, empty)
    with pytest.raises(ValueError, match="143 bytes a super-block is not Q4_K"):
        OPS.kq_linear(torch.randn(2, QK_K), blocks, torch.zeros((2, 1, 143), dtype=torch.uint8),
                      empty)
    with pytest.raises(ValueError, match="each part must be"):
        OPS.kq_linear(torch.randn(2, QK_K), blocks, quantized_blocks(3, 2 * QK_K, "Q6_K", 1),
                      empty)
    with pytest.raises(ValueError, match="out must be"):
        OPS.kq_dequant_(blocks, "Q4_K", torch.empty(3, 2 * QK_K))
    with pytest.raises(ValueError, match="kind must be"):
        OPS.kq_dequant_(blocks, "Q4_0", torch.empty(3, QK_K))


def test_the_k_quants_are_registered_gguf_types() -> None:
    for kind in KINDS:
        reader = get_gguf_type(kind)
        assert reader.kind == kind and reader.weight is KQuantWeight
        assert reader.block_weights == QK_K and reader.block_bytes == BLOCK_BYTES[kind]
        assert kind in SERVED_TYPES and INDEX_BLOCK_BYTES[kind] == BLOCK_BYTES[kind]
        blocks = random_blocks(2, QK_K, kind, 0)
        weight = reader.read(blocks, torch.bfloat16)
        assert isinstance(weight, KQuantWeight) and weight.dtype == torch.bfloat16
        assert weight.blocks.data_ptr() == blocks.data_ptr()  # taken as stored, no copy
    assert all(hasattr(OPS, name) for name in KQuantWeight.kernels)


def test_the_weight_arena_takes_the_blocks() -> None:
    """model/weight_arena.py moves a K-quant weight's blocks (its one tensor) into the arena."""
    from radixserve.model.weight_arena import pack_weights

    layer = torch.nn.Module()
    layer.weight = KQuantWeight(quantized_blocks(5, 2 * QK_K, "Q6_K", 6), "Q6_K", torch.float32)
    x = torch.randn(2, 2 * QK_K)
    before, place = layer.weight.matmul(x), layer.weight.blocks.data_ptr()
    assert pack_weights(layer) >= layer.weight.nbytes
    assert layer.weight.blocks.data_ptr() != place and layer.weight.blocks.is_contiguous()
    assert same_bits(layer.weight.matmul(x), before)


# -- a model with K-quant weights: hidden 256, so that every matmul is whole super-blocks --

HEADS, KV_HEADS = 4, 2


@pytest.fixture(scope="module")
def kq_model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A 2-layer Llama of hidden 256, intermediate 512 (random weights)."""
    import transformers

    folder = str(tmp_path_factory.mktemp("kq-llama"))
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
        rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.2 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.save_pretrained(folder, safe_serialization=True)
    with open(os.path.join(folder, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": 1, "eos_token_id": [2, 5]}, f)
    return folder


# the GGUF type of each of a layer's parts (each layer's merged q/k/v and gate/up of one type)
LAYER_KINDS = [{"q": "Q4_K", "k": "Q4_K", "v": "Q4_K", "o": "Q5_K", "gate": "Q6_K", "up": "Q6_K",
                "down": "Q4_K"},
               {"q": "Q6_K", "k": "Q6_K", "v": "Q6_K", "o": "Q4_K", "gate": "Q5_K", "up": "Q5_K",
                "down": "Q6_K"}]


def _interleaved(rows: int, heads: int) -> np.ndarray:
    """llama.cpp's order of a Llama's q / k rows (its RoPE's pairs interleaved)."""
    return np.arange(rows).reshape(heads, 2, rows // heads // 2).swapaxes(1, 2).reshape(rows)


def test_a_ggufs_k_quant_tensors_served_into_a_model(kq_model_dir: str, tmp_path: Path) -> None:
    """Each matmul's K-quant tensor (q and k rows in llama.cpp's order) becomes its weight, as
    stored; the layers' float weights were set to the file's dequantization, which the served
    blocks equal bit for bit."""
    import gguf

    from radixserve.model.loader import load_model
    from radixserve.quantization import quantize_model

    model = load_model(kq_model_dir, torch.float32).model
    path = str(tmp_path / "kq.gguf")
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
    writer = gguf.GGUFWriter(path, "llama")
    for layer, kinds in enumerate(LAYER_KINDS):
        for part, kind in kinds.items():
            owner = "self_attn" if part in ("q", "k", "v", "o") else "mlp"
            merged = {"q": "qkv_proj", "k": "qkv_proj", "v": "qkv_proj", "gate": "gate_up_proj",
                      "up": "gate_up_proj"}.get(part)
            module = model.get_submodule(f"model.layers.{layer}.{owner}.{merged or part + '_proj'}")
            start, size = module.shard_offsets[part] if merged else (0, module.weight.shape[0])
            w = module.weight.detach()[start:start + size].numpy()
            heads = {"q": HEADS, "k": KV_HEADS}.get(part)
            order = _interleaved(size, heads) if heads else np.arange(size)
            data = quantize(np.ascontiguousarray(w[order]), kind)
            back = np.empty_like(w)
            back[order] = dequantize(data, getattr(GGMLQuantizationType, kind))
            with torch.no_grad():
                module.weight[start:start + size] = torch.from_numpy(back)
            hf_name = f"model.layers.{layer}.{owner}.{part}_proj.weight"
            writer.add_tensor(names.get_name(hf_name, try_suffixes=(".weight",)), data,
                              raw_dtype=getattr(GGMLQuantizationType, kind))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert {t.kind for t in read_gguf_index(path).tensors.values()} == set(KINDS)
    wanted = {name: module.weight.detach().clone() for name, module in model.named_modules()
              if getattr(module, "quantizable", False) and "layers" in name}
    quantize_model(model, "gguf", path)
    for name, before in wanted.items():
        weight = model.get_submodule(name).weight
        assert isinstance(weight, KQuantWeight), name
        assert same_bits(weight.dequantized(torch.float32), before), name


def _kquant_scheduler(folder: str, dtype: str) -> Any:
    """A scheduler over the model with each matmul's weight in K-quant blocks (the three types
    across the layers), as the GGUF would serve them."""
    from radixserve.config import ServerArgs
    from radixserve.model.loader import load_model
    from radixserve.scheduler.scheduler import Scheduler

    args = ServerArgs.from_kwargs(model=folder, dtype=dtype, device="cpu").resolve()
    loaded = load_model(folder, getattr(torch, dtype), args.device)
    for i, layer in enumerate(loaded.model.model.layers):
        attn, mlp = layer.self_attn, layer.mlp
        for j, module in enumerate((attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)):
            kind = KINDS[(i + j) % len(KINDS)]
            w = module.weight.detach().float().numpy()
            blocks = quantize(w, kind).reshape(w.shape[0], -1, BLOCK_BYTES[kind])
            del module.weight
            module.weight = KQuantWeight(torch.from_numpy(blocks), kind, getattr(torch, dtype))
    mark_weights_changed()
    return Scheduler(args, loaded.model, loaded.config, None)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_decode_layers_give_the_python_layers_bits(kq_model_dir: str, dtype: str) -> None:
    from test_fused_decode import Counting, Off, run  # the fused layers' own test's helpers

    prompts = [[10, 11, 12, 13, 50], [10, 11, 12, 60, 61, 62], [100, 101]]
    sched = _kquant_scheduler(kq_model_dir, dtype)
    counting = Counting(sched.runner.model)
    fused, _ = run(sched, counting, prompts)
    assert isinstance(sched.runner.model.model.layers[0].mlp.down_proj.weight, QuantizedWeight)
    plain, _ = run(_kquant_scheduler(kq_model_dir, dtype), Off(), prompts)
    assert counting.calls >= 5  # the decode steps after the prefill
    assert len(fused) == len(plain)
    assert all(same_bits(a, b) for a, b in zip(fused, plain, strict=True))


def avx2_checks() -> None:
    """The kernel and dequantization checks on this process's build (run by the test below in
    a process whose kernels are built for AVX2)."""
    assert OPS.vector_width() == 8
    for kind in KINDS:
        for n, k in SHAPES:
            check_kernel(kind, random_blocks(n, k, kind, seed=n))
            check_kernel(kind, quantized_blocks(n, k, kind, seed=n))
        check_dequantization(kind, random_blocks(37, 3 * QK_K, kind, 1))
        check_dequantization(kind, quantized_blocks(5, 2 * QK_K, kind, 2))


def _has_avx2() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return all(f" {flag}" in flags for flag in ("avx2", "fma", "f16c"))


@pytest.mark.slow  # the AVX2 build of every kernel file: minutes on 2 cores, then cached
@pytest.mark.skipif(not _has_avx2(), reason="this CPU cannot run the AVX2 build")
def test_the_avx2_build_runs_the_kernel_checks() -> None:
    here = Path(__file__).resolve().parent
    root = here.parents[1]
    env = {**os.environ, "RADIXSERVE_CPU_MARCH": "haswell",
           "PYTHONPATH": os.pathsep.join([str(here), str(root), str(root / "tests")])}
    done = subprocess.run([sys.executable, "-c", "import test_gguf_kquants as t; t.avx2_checks()"],
                          cwd=root, env=env, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stderr[-4000:]
