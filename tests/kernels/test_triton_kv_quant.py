"""The Triton kernels over an 8-bit KV pool (``--kv-cache-dtype int8 | fp8_e4m3 | fp8_e5m2``).

- ``store_kv`` writes the bits of ``kv_pool.quantize_kv`` (the reference the C++ store matches
  too): int8 values and float16 scales, fp8 values rounded to nearest even and saturated;
- decode, extend and cascade attention read the pool in place and equal a float64 reference
  over the dequantized pool (exactly what the kernels were handed: the kernels know nothing of
  the rotation);
- the Triton backend turns q, k, v into the pool's rotated basis and back: its stored bytes
  equal the C++ store's, its output the torch backend's (C++ kernel) and a float64 reference
  over ``KVPool.read``; the scheduler on the Triton backend serves an int8 pool as the torch
  backend does.

Cases come from test_triton_kernels.py and test_triton_shared_prefix.py beside this file (random
paged pools, junk past each sequence, NaN-poisoned outputs).
"""

from __future__ import annotations

import numpy as np
import pytest
import test_triton_kernels as tk
import test_triton_shared_prefix as tsp
import torch
from helpers.params import each_value_then_slow
from radixserve.kernels.decode_attention import alloc_decode_workspace, decode_attention
from radixserve.kernels.extend_attention import build_extend_plan, extend_attention
from radixserve.kernels.kv_store import store_kv
from radixserve.kernels.shared_prefix_decode import (
    alloc_cascade_workspace,
    cascade_decode_attention,
)

from radixserve.cache.kv_pool import KVPool, dequantize_kv, kv_store_dtype, quantize_kv

DEVICE = tk.DEVICE
LAYER = tk.LAYER
KV_DTYPES = ["int8", "fp8_e4m3", "fp8_e5m2"]
# float32 compute: int8 x float16 scale and fp8 widen exactly, so only the summation order
# differs from the reference; bfloat16 compute rounds each widened element.
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def quantized_pool(case: tk.Case, kv_dtype: str) -> KVPool:
    """An 8-bit pool holding the case's random float pool, encoded as the engine stores it."""
    src = case.pool
    pool = KVPool(src.num_slots, tk.NUM_LAYERS, src.num_kv_heads, src.head_dim, src.dtype,
                  DEVICE, kv_cache_dtype=kv_dtype)
    every = torch.arange(src.num_slots, device=DEVICE)
    for layer in range(tk.NUM_LAYERS):
        pool.set_kv(layer, every, *src.get_kv(layer))
    return pool


def stored(pool: KVPool, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The pool's K and V as the kernels see them (dequantized, still rotated), float64."""
    k_scale, v_scale = pool.get_scales(layer)
    k_buf, v_buf = pool.get_kv(layer)
    return dequantize_kv(k_buf, k_scale, torch.float64), dequantize_kv(v_buf, v_scale, torch.float64)


def attention_reference(case: tk.Case, k_all: torch.Tensor, v_all: torch.Tensor,
                        new_k: torch.Tensor | None = None, new_v: torch.Tensor | None = None
                        ) -> torch.Tensor:
    """float64 causal attention of the case's new tokens over the pool's rows ``k_all`` /
    ``v_all`` [slots, KV, D]; with ``new_k`` / ``new_v`` [T, KV, D] the new tokens' own keys
    are those rows instead of the pool's (the extend kernel reads this step's keys as given)."""
    q = case.q.to(case.pool.dtype).double().cpu()
    group = q.shape[1] // k_all.shape[1]
    outs = []
    for b, slots in enumerate(case.slot_rows):
        p, e, t = case.prefix_lens[b], case.extend_lens[b], case.token_starts[b]
        keys, vals = k_all[slots].cpu().clone(), v_all[slots].cpu().clone()
        if new_k is not None:
            keys[p:] = new_k[t : t + e].double().cpu()
            vals[p:] = new_v[t : t + e].double().cpu()
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        scores = torch.einsum("ehd,lhd->hel", q[t : t + e], keys) * case.scale
        visible = torch.arange(p + e)[None, :] <= (p + torch.arange(e))[:, None]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hel,lhd->ehd", torch.softmax(scores, dim=-1), vals))
    return torch.cat(outs).reshape(q.shape[0], -1)


def as_bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8) if x.dtype.is_floating_point and x.element_size() == 1 else x


# ------------------------------------------------------------------------------ store


@pytest.mark.parametrize("src_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_store_kv_writes_quantize_kv_bits(kv_dtype: str, src_dtype: torch.dtype) -> None:
    """Every new slot holds quantize_kv's bits (values and int8 scales); no other slot changes.
    The rows span fp8's subnormals, its saturation and an all-zero row (int8 scale 0)."""
    case = tk.make_case([3, 0, 40], [1, 17, 5], 4, 2, 64, 16, src_dtype, seed=11)
    pool = quantized_pool(case, kv_dtype)
    gen = torch.Generator().manual_seed(5)
    total = case.q.shape[0]
    magnitude = torch.tensor([1e-6, 1e-3, 0.2, 3.0, 90.0, 700.0, 7e4])
    pick = torch.randint(0, len(magnitude), (total, 2, 1), generator=gen)
    k = (torch.randn((total, 2, 64), generator=gen) * magnitude[pick]).to(src_dtype).to(DEVICE)
    v = (torch.randn((total, 2, 64), generator=gen) * magnitude[pick]).to(src_dtype).to(DEVICE)
    k[2, 1] = 0.0
    slots = case.new_slots
    k_buf, v_buf = pool.get_kv(LAYER)
    k_scale, v_scale = pool.get_scales(LAYER)
    keep = torch.ones(k_buf.shape[0], dtype=torch.bool, device=DEVICE)
    keep[slots] = False
    before = [as_bits(t[keep]).clone() for t in (k_buf, v_buf)]
    store_kv(k_buf, v_buf, slots, k, v, k_scale, v_scale)
    for src, buf, scales in ((k, k_buf, k_scale), (v, v_buf, v_scale)):
        want, want_scale = quantize_kv(src, kv_store_dtype(kv_dtype, src_dtype))
        assert torch.equal(as_bits(buf[slots]), as_bits(want))
        if kv_dtype == "int8":
            assert torch.equal(scales[slots], want_scale)
    assert [torch.equal(as_bits(t[keep]), b) for t, b in zip((k_buf, v_buf), before, strict=True)] == [True, True]
    if kv_dtype == "int8":
        assert k_scale[slots[2], 1] == 0 and (k_buf[slots[2], 1] == 0).all()


def test_an_int8_pool_without_scales_is_refused() -> None:
    case = tk.make_case([0], [4], 2, 2, 16, 1, torch.float32, seed=1)
    pool = quantized_pool(case, "int8")
    with pytest.raises(ValueError, match="k_scale and v_scale"):
        store_kv(*pool.get_kv(LAYER), case.new_slots, case.k, case.v)
    k_scale, v_scale = pool.get_scales(LAYER)
    with pytest.raises(ValueError, match="KV scales must be"):
        store_kv(*pool.get_kv(LAYER), case.new_slots, case.k, case.v, k_scale[:, :1], v_scale)


# ------------------------------------------------------------------------------ attention


@pytest.mark.parametrize("kv_dtype, dtype", each_value_then_slow(KV_DTYPES, [torch.float32, torch.bfloat16]))
def test_decode_reads_the_8bit_pool(kv_dtype: str, dtype: torch.dtype) -> None:
    case = tk.make_case([0, 37, 300, 129], [1, 1, 1, 1], 8, 2, 64, 16, dtype, seed=21)
    pool = quantized_pool(case, kv_dtype)
    k_buf, v_buf = pool.get_kv(LAYER)
    k_scale, v_scale = pool.get_scales(LAYER)
    store_kv(k_buf, v_buf, case.new_slots, case.k, case.v, k_scale, v_scale)
    batch, heads, dim = len(case.prefix_lens), case.q.shape[1], case.q.shape[2]
    out = tk.poisoned(batch, heads * dim, dtype=dtype)
    decode_attention(
        case.q, k_buf, v_buf, out, case.req_to_token, torch.tensor(case.table_rows, device=DEVICE),
        torch.tensor(case.seq_lens, device=DEVICE), torch.arange(batch, device=DEVICE),
        case.scale, 3, alloc_decode_workspace(batch, heads, 3, dim, DEVICE),
        k_scale=k_scale, v_scale=v_scale,
    )
    assert out.dtype == dtype
    assert tk.rel_err(out, attention_reference(case, *stored(pool, LAYER))) <= TOL[dtype]


@pytest.mark.parametrize("kv_dtype, dtype", each_value_then_slow(KV_DTYPES, [torch.float32, torch.bfloat16]))
def test_extend_reads_the_8bit_pool(kv_dtype: str, dtype: torch.dtype) -> None:
    """Cached prefixes come from the 8-bit pool, this step's keys as given."""
    case = tk.make_case([0, 1, 90, 37], [23, 9, 40, 70], 6, 2, 64, 16, dtype, seed=31,
                        share_first_pages=2)
    pool = quantized_pool(case, kv_dtype)
    k_buf, v_buf = pool.get_kv(LAYER)
    k_scale, v_scale = pool.get_scales(LAYER)
    store_kv(k_buf, v_buf, case.new_slots, case.k, case.v, k_scale, v_scale)
    out = tk.poisoned(case.q.shape[0], case.q.shape[1] * case.q.shape[2], dtype=dtype)
    plan = build_extend_plan(torch.tensor(case.table_rows, device=DEVICE), case.prefix_lens,
                             case.extend_lens, case.token_starts, case.q.shape[2], dtype)
    extend_attention(case.q, case.k, case.v, k_buf, v_buf, out, case.req_to_token, plan,
                     case.scale, k_scale=k_scale, v_scale=v_scale)
    ref = attention_reference(case, *stored(pool, LAYER), new_k=case.k, new_v=case.v)
    assert tk.rel_err(out, ref) <= TOL[dtype]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_cascade_reads_the_8bit_pool(kv_dtype: str) -> None:
    """Shared prefixes read once per group tile from the 8-bit pool; the plain decode kernel
    over the same pool agrees, and both equal the float64 reference."""
    case = tsp.make_case([(3, 48), (2, 32)], [20, 7], 4, 64, 16, torch.float32, seed=41)
    store = kv_store_dtype(kv_dtype, torch.float32)
    (k8, k_scale), (v8, v_scale) = quantize_kv(case.k_buf, store), quantize_kv(case.v_buf, store)
    dequantized = tsp.Case(**{**vars(case), "k_buf": dequantize_kv(k8, k_scale, torch.float32),
                              "v_buf": dequantize_kv(v8, v_scale, torch.float32)})
    plan = tsp.plan_for(case)
    assert plan is not None and plan.num_groups == 2
    batch, heads, dim = len(case.rows), case.q.shape[1], case.q.shape[2]
    outs = []
    for cascade in (True, False):
        out = tsp.poisoned(batch + 2, heads * dim, dtype=torch.float32)
        args = (case.q, k8, v8, out, tsp.device_tensor(case.table), tsp.device_tensor(case.rows),
                tsp.device_tensor(case.seq_lens), case.token_idx)
        if cascade:
            cascade_args = [tsp.device_tensor(a) for a in (plan.kv_start, plan.tile_row,
                                                           plan.tile_len, plan.tile_ptr,
                                                           plan.tile_members)]
            cascade_decode_attention(*args, *cascade_args, case.scale, 2,
                                     alloc_cascade_workspace(batch, heads, 2, dim, DEVICE),
                                     k_scale=k_scale, v_scale=v_scale)
        else:
            decode_attention(*args, case.scale, 2, alloc_decode_workspace(batch, heads, 2, dim, DEVICE),
                             k_scale=k_scale, v_scale=v_scale)
        outs.append(out[case.token_idx])
    ref = tsp.reference(dequantized)
    assert tsp.rel_err(outs[0], ref) <= TOL[torch.float32]
    assert tsp.rel_err(outs[1], ref) <= TOL[torch.float32]


# ------------------------------------------------------------------------------ backend


def run_backend(name: str, case: tk.Case, pool: KVPool, cascade: bool) -> torch.Tensor:
    backend, fb = tk.prepared_step(name, case, pool, cascade)
    if name == "triton":
        out = tk.poisoned(case.q.shape[0], case.q.shape[1] * case.q.shape[2], dtype=case.q.dtype)
        got = backend.forward(case.q, case.k, case.v, case.layer, fb, out=out)
        assert got is out
        if cascade:
            assert fb.attn_metadata.decode.cascade is not None
        return out
    return backend.forward(case.q, case.k, case.v, case.layer, fb)


BATCHES = {
    "decode_shared": ([64, 64, 70, 3], [1, 1, 1, 1]),
    "mixed": ([30, 0, 5, 99, 1], [1, 40, 1, 1, 6]),
}


@pytest.mark.parametrize("kv_dtype, batch", each_value_then_slow(KV_DTYPES, sorted(BATCHES)))
def test_backend_turns_the_basis_as_the_torch_backend(kv_dtype: str, batch: str) -> None:
    """Same 8-bit pool, same step: the Triton backend (rotation in torch around the kernels)
    stores the C++ store's bytes and attends as the torch backend's C++ kernel and a float64
    reference over the pool read back (un-rotated) do."""
    prefix_lens, extend_lens = BATCHES[batch]
    case = tk.make_case(prefix_lens, extend_lens, 8, 2, 64, 16, torch.float32, seed=51,
                        share_first_pages=4)
    pools = {name: quantized_pool(case, kv_dtype) for name in ("triton", "torch")}
    assert pools["triton"].rotated
    outs = {name: run_backend(name, case, pools[name], cascade=batch == "decode_shared")
            for name in pools}
    new = case.new_slots.cpu().numpy()
    assert torch.equal(pools["triton"].gather(new), pools["torch"].gather(new))
    every = torch.arange(case.pool.num_slots, device=DEVICE)
    read = pools["triton"].read(LAYER, every)
    ref = attention_reference(case, read[0].double(), read[1].double())
    # The extend kernel attends to this step's keys unquantized, the C++ kernel to the stored
    # ones: within int8's / fp8's error of each other.
    tol = TOL[torch.float32] if batch == "decode_shared" else {"int8": 0.02, "fp8_e4m3": 0.1, "fp8_e5m2": 0.2}[kv_dtype]
    assert tk.rel_err(outs["triton"], ref) <= tol
    assert tk.rel_err(outs["triton"], outs["torch"].double()) <= tol


def test_scheduler_serves_an_int8_pool_on_triton(tiny_model_dir) -> None:
    """Greedy requests with a shared cached prefix on an int8 pool: the Triton backend's
    tokens equal the torch backend's."""
    from helpers.sched_driver import make_scheduler, run_until_idle, submit

    folder = tiny_model_dir("llama")
    rng = np.random.default_rng(7)
    system = rng.integers(3, 250, 40).tolist()
    prompts = [system + rng.integers(3, 250, int(n)).tolist() for n in (3, 9, 5)]
    outs = {}
    for backend in ("torch", "triton"):
        sched = make_scheduler(folder, attention_backend=backend, page_size=4, max_total_tokens=1024,
                               device=DEVICE.type, cuda_graph_max_bs=0, kv_cache_dtype="int8")
        assert sched.runner.kv_pool.store_dtype == torch.int8
        rids = [submit(sched, prompts[0], max_new_tokens=1)]
        run_until_idle(sched)
        rids = [submit(sched, p, max_new_tokens=5, ignore_eos=True) for p in prompts]
        got = run_until_idle(sched)
        outs[backend] = [got[r]["output_ids"] for r in rids]
    assert outs["triton"] == outs["torch"]
