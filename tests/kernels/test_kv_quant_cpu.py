"""8-bit KV pools (``kv_cache_dtype`` int8 / fp8_e4m3 / fp8_e5m2) on the CPU backend: the C++
paged kernel and the pure-torch gather path against a float64 reference computed on the
dequantized pool values, the store kernel against ``quantize_kv``, and the pool's moves between
tiers (gather / scatter / copy) keeping values and scales together."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from radixserve.attention.base import AttentionLayerInfo
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.batch import ForwardBatch
from radixserve.cache.kv_pool import (
    KVPool,
    copy_slots,
    dequantize_kv,
    kv_bytes_per_token,
    quantize_kv,
)

KV_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
PATHS = ("kernel", "gather")
NUM_LAYERS = 2


def _dequantized(pool: KVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole layer as the kernels must read it, in float64: the stored values times their
    scales, turned back from the rotated basis."""
    k, v = pool.get_kv(layer)
    ks, vs = pool.get_scales(layer)
    k, v = dequantize_kv(k, ks, torch.float64), dequantize_kv(v, vs, torch.float64)
    if pool.rotated:
        h = hadamard(pool.head_dim)
        k, v = k @ h, v @ h
    return k, v


def hadamard(n: int) -> torch.Tensor:
    """The normalised Sylvester Hadamard matrix, float64 (symmetric, orthogonal)."""
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def _reference(q, k_pool, v_pool, slot_rows, extend_lens, num_heads, num_kv, scale):
    """Plain loop, float64: new token i of request b sees keys [0, prefix_len + i]."""
    group = num_heads // num_kv
    outs, t = [], 0
    for slots, e in zip(slot_rows, extend_lens, strict=True):
        p = len(slots) - e
        keys, vals = k_pool[slots], v_pool[slots]
        for i in range(e):
            row = []
            for h in range(num_heads):
                kh, vh = keys[: p + i + 1, h // group], vals[: p + i + 1, h // group]
                w = torch.softmax((kh @ q[t + i, h].double()) * scale, dim=0)
                row.append(w @ vh)
            outs.append(torch.cat(row))
        t += e
    return torch.stack(outs)


def _run(slot_rows: list[list[int]], extend_lens: list[int], num_heads: int, num_kv: int, head_dim: int,
         dtype: torch.dtype, kv_dtype: str, path: str, seed: int) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    gen = torch.Generator().manual_seed(seed)
    num_slots = max(max(r) for r in slot_rows) + 1
    pool = KVPool(num_slots, NUM_LAYERS, num_kv, head_dim, dtype, kv_cache_dtype=kv_dtype)
    for layer in range(NUM_LAYERS):  # random contents everywhere, with a wide range of magnitudes
        every = torch.arange(num_slots)
        k = torch.randn((num_slots, num_kv, head_dim), generator=gen) * 3
        v = torch.randn((num_slots, num_kv, head_dim), generator=gen) * torch.rand(num_slots, num_kv, 1, generator=gen)
        pool.set_kv(layer, every, k.to(dtype), v.to(dtype))
    req_to_token = torch.zeros((len(slot_rows) + 2, max(map(len, slot_rows)) + 3), dtype=torch.int32)
    req_to_token.random_(0, num_slots, generator=gen)  # junk past each row's keys must not matter
    for i, slots in enumerate(slot_rows):
        req_to_token[i + 1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    prefix_lens = [len(r) - e for r, e in zip(slot_rows, extend_lens, strict=True)]
    new_slots = torch.tensor([s for r, e in zip(slot_rows, extend_lens, strict=True) for s in r[len(r) - e:]])
    total = sum(extend_lens)
    q = torch.randn((total, num_heads, head_dim), generator=gen).to(dtype)
    k = (torch.randn((total, num_kv, head_dim), generator=gen) * 2).to(dtype)
    v = torch.randn((total, num_kv, head_dim), generator=gen).to(dtype)
    backend = TorchAttentionBackend(use_kernel=path == "kernel")
    assert backend.uses_kernel == (path == "kernel"), "the C++ attention kernel did not build"
    fb = ForwardBatch.build(
        input_ids=[0] * total, prefix_lens=prefix_lens, extend_lens=extend_lens,
        req_pool_indices=list(range(1, len(slot_rows) + 1)), out_cache_loc=new_slots,
        req_to_token=req_to_token, kv_pool=pool, attn_backend=backend,
    )
    backend.prepare(fb)
    scale = 1 / math.sqrt(head_dim)
    out = backend.forward(q, k, v, AttentionLayerInfo(1, num_heads, num_kv, head_dim, scale), fb)
    assert out.dtype == dtype and out.shape == (total, num_heads * head_dim)
    # This step's K/V were stored as the pool encodes them (the C++ store on the kernel path).
    k_pool, v_pool = pool.get_kv(1)
    k_scale, v_scale = pool.get_scales(1)
    for x, buf, sc in ((k, k_pool, k_scale), (v, v_pool, v_scale)):
        want, want_scale = pool.encode(x)
        got = buf[new_slots]
        if sc is None:
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
        else:
            assert torch.equal(sc[new_slots], want_scale)
            # The same rotation butterflies and x / scale per element in both: the same bits.
            assert torch.equal(got, want)
    kd, vd = _dequantized(pool, 1)
    ref = _reference(q, kd, vd, [torch.tensor(r) for r in slot_rows], extend_lens, num_heads, num_kv, scale)
    return out, ref, fb


def _rows(seed: int) -> tuple[list[list[int]], list[int]]:
    """A prompt, an extend after a cached prefix, decodes, and decode rows sharing a prefix."""
    gen = torch.Generator().manual_seed(seed)
    fresh = iter((torch.randperm(3000, generator=gen) + 64).tolist())
    trunk = [next(fresh) for _ in range(100)]
    rows, extend = [], []
    for n in (1, 7, 30):  # decode rows over one shared 100-token prefix
        rows.append(trunk + [next(fresh) for _ in range(n)])
        extend.append(1)
    rows.append(trunk + [next(fresh) for _ in range(12)])  # an extend row after the same prefix
    extend.append(12)
    rows.append([next(fresh) for _ in range(40)])  # a fresh prompt
    extend.append(40)
    rows.append([next(fresh) for _ in range(77)])  # a plain decode
    extend.append(1)
    return rows, extend


TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("head_dim", [16, 64])
def test_attention_reads_the_8bit_pool(kv_dtype: str, dtype: torch.dtype, path: str, head_dim: int) -> None:
    rows, extend = _rows(head_dim)
    out, ref, fb = _run(rows, extend, 6, 2, head_dim, dtype, kv_dtype, path, seed=head_dim)
    if path == "kernel":
        assert fb.attn_metadata.shared_groups == 1
    else:
        assert fb.attn_metadata.decode.shared is not None
    torch.testing.assert_close(out.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_lone_decode_over_a_long_context(kv_dtype: str, dtype: torch.dtype) -> None:
    """One request over 1.5k keys: the kernel reads the cached range in split jobs (under a
    bfloat16 model, on the pair path where the CPU has AVX-512 BF16)."""
    rows = [list(range(64, 64 + 1500))]
    out, ref, _ = _run(rows, [1], 9, 3, 64, dtype, kv_dtype, "kernel", seed=5)
    torch.testing.assert_close(out.double(), ref, rtol=TOL[dtype], atol=TOL[dtype])


def test_quantization_error_is_bounded() -> None:
    """int8 rows reproduce x within half a step of their scale; fp8 within the format's
    relative precision; zero rows stay zero; saturation instead of inf / NaN."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((50, 4, 64), generator=gen) * torch.rand(50, 4, 1, generator=gen) * 10
    x[3, 1] = 0.0
    q, s = quantize_kv(x, torch.int8)
    assert q.dtype == torch.int8 and s.dtype == torch.float16 and s.shape == (50, 4)
    back = dequantize_kv(q, s, torch.float32)
    assert ((back - x).abs() <= s.float()[..., None] * 0.5 + 1e-6).all()
    assert torch.equal(back[3, 1], torch.zeros(64))
    for store, rel in ((torch.float8_e4m3fn, 2**-4), (torch.float8_e5m2, 2**-3)):
        q, none = quantize_kv(x, store)
        assert none is None
        back = q.float()
        normal = x.abs() > 0.1
        assert ((back - x).abs()[normal] <= x.abs()[normal] * rel).all()
        big, _ = quantize_kv(torch.tensor([[[1e6, -1e6]]]), store)
        assert torch.isfinite(big.float()).all() and big.float()[0, 0, 0] == torch.finfo(store).max


def test_rotation_is_hadamard_and_shrinks_the_int8_error() -> None:
    """fwht is x @ H (normalised Sylvester), its own inverse; on keys with a few large channels
    (as a model's are) the rotated int8 rows come back with less error."""
    from radixserve.cache.kv_pool import fwht

    gen = torch.Generator().manual_seed(2)
    x = torch.randn((200, 3, 64), generator=gen)
    torch.testing.assert_close(fwht(x).double(), x.double() @ hadamard(64), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fwht(fwht(x)), x, rtol=1e-5, atol=1e-5)
    x[:, :, [3, 40]] *= 20  # outlier channels
    plain = KVPool(300, 1, 3, 64, torch.float32, kv_cache_dtype="int8")
    assert plain.rotated
    slots = torch.arange(64, 264)
    plain.set_kv(0, slots, x, x)
    err_rotated = (plain.read(0, slots)[0] - x).pow(2).mean()
    q, s = quantize_kv(x, torch.int8)
    err_plain = (dequantize_kv(q, s, torch.float32) - x).pow(2).mean()
    assert err_rotated < err_plain / 4


def test_pool_bytes_count_the_smaller_element() -> None:
    """Tokens per byte against the model's dtype (the default model's heads of 64)."""
    f32 = kv_bytes_per_token(30, 3, 64, torch.float32)
    bf16 = kv_bytes_per_token(30, 3, 64, torch.bfloat16)
    int8 = kv_bytes_per_token(30, 3, 64, torch.bfloat16, "int8")
    fp8 = kv_bytes_per_token(30, 3, 64, torch.float32, "fp8_e4m3")
    assert int8 == 2 * 30 * 3 * (64 + 2)  # values and one float16 scale per head
    assert bf16 / int8 >= 1.9 and f32 / int8 >= 3.8
    assert f32 / fp8 == 4
    pool = KVPool(256, 2, 3, 64, torch.bfloat16, kv_cache_dtype="int8")
    held = sum(t.numel() * t.element_size() for t in pool.k_buffers + pool.v_buffers + pool.k_scales + pool.v_scales)
    assert held == 256 * pool.bytes_per_token
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        KVPool(256, 2, 3, 64, torch.float32, kv_cache_dtype="int4")


@pytest.mark.parametrize("kv_dtype", ("auto",) + KV_DTYPES)
def test_tier_moves_keep_values_and_scales(kv_dtype: str) -> None:
    """gather -> scatter (the disk tier's bytes) and copy_slots (the host tier) move every
    layer's values and int8 scales together, bit for bit."""
    gen = torch.Generator().manual_seed(1)
    src = KVPool(200, 3, 2, 16, torch.bfloat16, kv_cache_dtype=kv_dtype)
    for layer in range(3):
        src.set_kv(layer, torch.arange(64, 200), torch.randn(136, 2, 16, generator=gen).bfloat16(),
                   torch.randn(136, 2, 16, generator=gen).bfloat16())
    slots = np.array([70, 71, 150, 199, 64])
    blob = src.gather(slots)
    assert blob.dtype == torch.uint8 and blob.shape == (2, 3, 5, src.slot_bytes)
    dst = KVPool(100, 3, 2, 16, torch.bfloat16, kv_cache_dtype=kv_dtype)
    dst.scatter(np.array([90, 91, 92, 93, 94]), blob)
    host = KVPool(100, 3, 2, 16, torch.bfloat16, kv_cache_dtype=kv_dtype)
    copy_slots(src, slots, host, np.array([65, 66, 67, 68, 69]))
    idx = torch.from_numpy(slots)
    for layer in range(3):
        want = _dequantized(src, layer)
        for pool, where in ((dst, torch.arange(90, 95)), (host, torch.arange(65, 70))):
            got = _dequantized(pool, layer)
            for g, w in zip(got, want, strict=True):
                assert torch.equal(g[where], w[idx])
    other = KVPool(100, 3, 2, 16, torch.bfloat16, kv_cache_dtype="auto" if kv_dtype != "auto" else "int8")
    with pytest.raises(ValueError, match="pool"):
        copy_slots(src, slots, other, np.array([65, 66, 67, 68, 69]))
