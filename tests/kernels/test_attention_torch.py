"""The CPU attention backend against a naive per-request float64 reference on random inputs.

Every case runs on both paths of the backend: the C++ paged kernel (the default; the test
fails if it cannot be built) and the pure-torch gather path (the fallback).
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from radixserve.attention.base import AttentionLayerInfo
from radixserve.attention.torch_backend import TorchAttentionBackend
from radixserve.batch import ForwardBatch
from radixserve.cache.kv_pool import KVPool

NUM_LAYERS = 2
HEAD_DIM = 16
PATHS = ("kernel", "gather")


def _backend(path: str) -> TorchAttentionBackend:
    backend = TorchAttentionBackend(use_kernel=path == "kernel")
    assert backend.uses_kernel == (path == "kernel"), "the C++ attention kernel did not build"
    return backend


def _reference(q, k_pool, v_pool, slot_rows, prefix_lens, extend_lens, num_heads, num_kv, scale):
    """Plain loop, float64: new token i of request b sees keys [0, prefix_len + i]."""
    group = num_heads // num_kv
    outs, t = [], 0
    for slots, p, e in zip(slot_rows, prefix_lens, extend_lens, strict=True):
        keys = k_pool[slots[: p + e]].double()  # [L, KV, D]
        vals = v_pool[slots[: p + e]].double()
        for i in range(e):
            row = []
            for h in range(num_heads):
                qh = q[t + i, h].double()
                kh, vh = keys[: p + i + 1, h // group], vals[: p + i + 1, h // group]
                w = torch.softmax((kh @ qh) * scale, dim=0)
                row.append(w @ vh)
            outs.append(torch.cat(row))
        t += e
    return torch.stack(outs)


def _run_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv: int,
    dtype: torch.dtype,
    seed: int,
    path: str,
    layer_id: int = 1,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    num_slots = sum(seq_lens) + 37
    pool = KVPool(num_slots, NUM_LAYERS, num_kv, HEAD_DIM, dtype)
    # Scatter every request's slots over the pool (slot 0 is never handed out).
    perm = (torch.randperm(num_slots - 1, generator=gen) + 1).tolist()
    max_ctx = max(seq_lens) + 5
    req_to_token = torch.zeros((len(seq_lens) + 3, max_ctx), dtype=torch.int32)
    # Stale junk in the table beyond each seq_len must not matter.
    req_to_token.random_(0, num_slots, generator=gen)
    pool_rows = torch.randperm(req_to_token.shape[0], generator=gen)[: len(seq_lens)].tolist()
    slot_rows, new_slots = [], []
    for r, p, n in zip(pool_rows, prefix_lens, seq_lens, strict=True):
        slots = [perm.pop() for _ in range(n)]
        req_to_token[r, :n] = torch.tensor(slots, dtype=torch.int32)
        slot_rows.append(torch.tensor(slots))
        new_slots.extend(slots[p:])
    for layer in range(NUM_LAYERS):  # random, never-zero cache contents (prefix included)
        for buf in (*pool.get_kv(layer),):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    total = sum(extend_lens)
    q = torch.randn((total, num_heads, HEAD_DIM), generator=gen).to(dtype)
    k = torch.randn((total, num_kv, HEAD_DIM), generator=gen).to(dtype)
    v = torch.randn((total, num_kv, HEAD_DIM), generator=gen).to(dtype)
    backend = _backend(path)
    fb = ForwardBatch.build(
        input_ids=[0] * total,
        prefix_lens=prefix_lens,
        extend_lens=extend_lens,
        req_pool_indices=pool_rows,
        out_cache_loc=torch.tensor(new_slots),
        req_to_token=req_to_token,
        kv_pool=pool,
        attn_backend=backend,
    )
    backend.prepare(fb)
    scale = 1 / math.sqrt(HEAD_DIM)
    info = AttentionLayerInfo(layer_id, num_heads, num_kv, HEAD_DIM, scale)
    out = backend.forward(q, k, v, info, fb)
    assert out.shape == (total, num_heads * HEAD_DIM)
    assert out.dtype == dtype
    k_pool, v_pool = pool.get_kv(layer_id)
    # The backend must have stored this step's k/v at out_cache_loc.
    assert torch.equal(k_pool[torch.tensor(new_slots)], k)
    assert torch.equal(v_pool[torch.tensor(new_slots)], v)
    ref = _reference(
        q, k_pool, v_pool, slot_rows, prefix_lens, extend_lens, num_heads, num_kv, scale
    )
    return out, ref


CASES = {
    "prefill_one": ([0], [23]),
    "prefill_many": ([0, 0, 0], [5, 17, 2]),
    "prefill_similar_lengths": ([0, 0, 0], [20, 23, 22]),  # one padded group, out of length order
    "extend_similar_lengths": ([3, 9, 1], [20, 23, 22]),
    "extend_prefix_1": ([1], [9]),
    "extend_long_prefix": ([150, 3], [7, 30]),
    "decode_one": ([41], [1]),
    "decode_many": ([0, 1, 64, 200, 17], [1, 1, 1, 1, 1]),
    "mixed_prefill_and_decodes": ([30, 0, 5, 99], [1, 40, 1, 1]),
    "mixed_extend_and_decodes": ([12, 70, 0, 3, 1], [1, 25, 1, 6, 1]),
    "mixed_long_decodes": ([300] * 9 + [0], [1] * 9 + [11]),
}


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("ratio", [1, 3, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_reference_float32(case: str, ratio: int, path: str) -> None:
    prefix_lens, extend_lens = CASES[case]
    num_kv = 2
    out, ref = _run_case(prefix_lens, extend_lens, num_kv * ratio, num_kv, torch.float32, seed=7,
                         path=path)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", ["prefill_many", "extend_long_prefix", "mixed_extend_and_decodes"])
def test_matches_reference_half_precision(case: str, dtype: torch.dtype, path: str) -> None:
    prefix_lens, extend_lens = CASES[case]
    out, ref = _run_case(prefix_lens, extend_lens, 6, 2, dtype, seed=3, path=path)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, rtol=5e-2, atol=3e-2)


@pytest.mark.parametrize("chunk_bytes", [1, 100 * 256])  # 1 row per chunk / ~100 keys
def test_many_decode_chunks(monkeypatch: pytest.MonkeyPatch, chunk_bytes: int) -> None:
    """Decode rows split over several gather chunks (grouped by length) land in the right rows."""
    import radixserve.attention.gather_path as gp

    monkeypatch.setattr(gp, "DECODE_CHUNK_BYTES", chunk_bytes)
    prefix_lens = [5, 60, 0, 33, 8, 2, 90, 1, 3, 12]
    out, ref = _run_case(prefix_lens, [1] * 10, 8, 2, torch.float32, seed=11, path="gather")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    out, ref = _run_case([5, 0, 33, 70, 2], [1, 9, 1, 1, 1], 8, 2, torch.float32, seed=12,
                         path="gather")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


def _run_explicit(slot_rows: list[list[int]], extend_lens: list[int], num_heads: int, num_kv: int,
                  dtype: torch.dtype, seed: int,
                  path: str, head_dim: int = HEAD_DIM) -> tuple[torch.Tensor, torch.Tensor, ForwardBatch]:
    """Like _run_case, but every request's slots are given (so prefixes can be shared)."""
    gen = torch.Generator().manual_seed(seed)
    num_slots = max(max(r) for r in slot_rows) + 1
    pool = KVPool(num_slots, NUM_LAYERS, num_kv, head_dim, dtype)
    for layer in range(NUM_LAYERS):
        for buf in pool.get_kv(layer):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    req_to_token = torch.zeros((len(slot_rows) + 2, max(map(len, slot_rows)) + 3), dtype=torch.int32)
    req_to_token.random_(0, num_slots, generator=gen)
    for i, slots in enumerate(slot_rows):
        req_to_token[i + 1, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    prefix_lens = [len(r) - e for r, e in zip(slot_rows, extend_lens, strict=True)]
    new_slots = [s for r, e in zip(slot_rows, extend_lens, strict=True) for s in r[len(r) - e:]]
    total = sum(extend_lens)
    q = torch.randn((total, num_heads, head_dim), generator=gen).to(dtype)
    k = torch.randn((total, num_kv, head_dim), generator=gen).to(dtype)
    v = torch.randn((total, num_kv, head_dim), generator=gen).to(dtype)
    backend = _backend(path)
    fb = ForwardBatch.build(
        input_ids=[0] * total, prefix_lens=prefix_lens, extend_lens=extend_lens,
        req_pool_indices=list(range(1, len(slot_rows) + 1)), out_cache_loc=torch.tensor(new_slots),
        req_to_token=req_to_token, kv_pool=pool, attn_backend=backend,
    )
    backend.prepare(fb)
    scale = 1 / math.sqrt(head_dim)
    out = backend.forward(q, k, v, AttentionLayerInfo(0, num_heads, num_kv, head_dim, scale), fb)
    k_pool, v_pool = pool.get_kv(0)
    ref = _reference(q, k_pool, v_pool, [torch.tensor(r) for r in slot_rows], prefix_lens,
                     extend_lens, num_heads, num_kv, scale)
    return out, ref, fb


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("heads, kv", [(4, 4), (3, 1), (8, 2)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_rows_sharing_a_cached_prefix(heads: int, kv: int, dtype: torch.dtype,
                                             path: str) -> None:
    """Rows whose tables share prefix slots (radix-tree hits) use the shared-prefix path."""
    gen = torch.Generator().manual_seed(heads)
    fresh = iter((torch.randperm(5000, generator=gen) + 1).tolist())
    trunk_a = [next(fresh) for _ in range(120)]
    trunk_b = [next(fresh) for _ in range(70)]
    short = [next(fresh) for _ in range(10)]  # shared, but below the sharing threshold
    rows, extend = [], []
    for n in (1, 5, 17, 30, 2):  # group A: 5 rows, own suffixes of various lengths
        rows.append(trunk_a + [next(fresh) for _ in range(n)])
        extend.append(1)
    for n in (3, 9, 1):  # group B: the trunk is longer than one row's shared part
        rows.append(trunk_b + [next(fresh) for _ in range(n)])
        extend.append(1)
    rows.append(trunk_a[:90] + [next(fresh) for _ in range(4)])  # shares only 90 with A
    extend.append(1)
    for n in (40, 8):
        rows.append(short + [next(fresh) for _ in range(n)])
        extend.append(1)
    rows.append([next(fresh) for _ in range(33)])  # a plain decode row
    extend.append(1)
    rows.append(trunk_a + [next(fresh) for _ in range(6)])  # an extend row in the same batch
    extend.append(6)
    out, ref, fb = _run_explicit(rows, extend, heads, kv, dtype, seed=heads, path=path)
    if path == "gather":
        shared = fb.attn_metadata.decode.shared
        assert shared is not None and len(shared.groups) == 2
    else:  # the kernel also shares with the extend row of group A
        assert fb.attn_metadata.shared_groups == 2
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_extend_rows_of_very_different_lengths_are_not_padded_together() -> None:
    from radixserve.attention.gather_path import bucket_extend_rows

    extend = [1024] + [48] * 15
    seq = [1024] + [1072] * 15
    buckets = bucket_extend_rows(list(range(16)), extend, seq)
    assert buckets[0] == [0] and sorted(b for g in buckets[1:] for b in g) == list(range(1, 16))
    # ... and the result is still exact in such a batch.
    out, ref = _run_case([0, 300, 300, 5], [200, 12, 9, 1], 4, 2, torch.float32, seed=5,
                         path="gather")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_kernel_head_sizes_and_shared_extends(head_dim: int) -> None:
    """Every head size the kernel is built for, on a batch where extend rows (questions after a
    shared system prompt) and decode rows share one cached prefix, plus a fresh prompt."""
    gen = torch.Generator().manual_seed(head_dim)
    fresh = iter((torch.randperm(9000, generator=gen) + 1).tolist())
    trunk = [next(fresh) for _ in range(200)]
    rows, extend = [], []
    for n, e in ((13, 13), (40, 40), (25, 1), (3, 1), (70, 70)):
        rows.append(trunk + [next(fresh) for _ in range(n)])
        extend.append(e)
    rows.append([next(fresh) for _ in range(57)])  # fresh prompt, no prefix
    extend.append(57)
    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 3e-2)):
        out, ref, fb = _run_explicit(rows, extend, 8, 2, dtype, seed=head_dim, path="kernel",
                                     head_dim=head_dim)
        assert fb.attn_metadata.shared_groups == 1
        torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads, kv", [(2, 2), (4, 2), (9, 3), (8, 2), (5, 1)])
def test_kernel_few_row_tasks_in_bfloat16(heads: int, kv: int, head_dim: int) -> None:
    """Decode rows of 1-4 query heads per KV head (and 5: the next chunk size) over a bfloat16
    pool: the tasks of exactly that many rows, whose V pairs are formed in registers, in their
    own order of head dimensions (a wrong order or lane mixes rows' values up).  One request
    alone (its cached range split in parts), then with a short and a 2-token one."""
    gen = torch.Generator().manual_seed(heads * 100 + head_dim)
    fresh = iter((torch.randperm(4000, generator=gen) + 1).tolist())
    alone = [[next(fresh) for _ in range(700)]]
    batch = [[next(fresh) for _ in range(n)] for n in (75, 33, 9)]
    for rows, extend in ((alone, [1]), (batch, [1, 1, 2])):
        out, ref, _ = _run_explicit(rows, extend, heads, kv, torch.bfloat16, seed=heads, path="kernel",
                                    head_dim=head_dim)
        torch.testing.assert_close(out.double(), ref, rtol=3e-2, atol=3e-2)


def test_kernel_plan_does_not_grow_with_the_cached_context() -> None:
    """The pool is read in place: the per-step plan holds O(new tokens + requests) integers,
    the same for 10 or 5000 cached tokens."""
    from radixserve.attention.paged_plan import build_plan

    sizes = []
    for cached in (10, 5000):
        table = torch.arange(4 * (cached + 8), dtype=torch.int32).view(4, cached + 8)
        plan = build_plan(table.numpy(), [0, 1, 2, 3], [cached] * 4, [1, 1, 1, 5])
        sizes.append([t.numel() for t in plan.args()])
    assert sizes[0] == sizes[1]


def test_kernel_plan_groups_and_entries() -> None:
    """Rows sharing their first slots form one shared job over the common run; each of their
    query rows has two entries (shared, own); a row outside every group has one."""
    from radixserve.attention.paged_plan import build_plan

    table = torch.zeros((4, 120), dtype=torch.int32)
    common = torch.arange(1, 81, dtype=torch.int32)
    table[0, :80] = common
    table[1, :80] = common
    table[1, 50:80] += 1000  # row 1 diverges at column 50
    table[2, :100] = torch.arange(2001, 2101, dtype=torch.int32)
    plan = build_plan(table.numpy(), [0, 1, 2], [70, 75, 99], [2, 1, 1])
    assert plan.shared_groups == 1
    assert plan.job_row.tolist() == [0, 0, 1, 2]  # shared job, then one own job per request
    assert plan.job_kv_begin.tolist() == [0, 50, 50, 0]
    assert plan.job_entry_ptr.tolist() == [0, 3, 5, 6, 7]
    assert plan.entry_row.tolist() == [0, 1, 2, 0, 1, 2, 3]
    assert plan.entry_limit.tolist() == [50, 50, 50, 71, 72, 76, 100]
    assert plan.row_entry_ptr.tolist() == [0, 2, 4, 6, 7]
    assert plan.row_entries.tolist() == [3, 0, 4, 1, 5, 2, 6]


@pytest.mark.parametrize("prefix_lens,extend_lens", [([1500], [1]), ([900], [8]), ([700, 2000], [1, 3]),
                                                     ([513], [2]), ([2000, 30], [1, 1])])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_cached_ranges_of_a_lone_decode_match_the_reference(prefix_lens, extend_lens, dtype) -> None:
    """A batch of one or two requests reads each long cached range in SPLIT_PARTS jobs."""
    from radixserve.attention import paged_plan

    assert len(prefix_lens) <= paged_plan.SPLIT_MAX_REQUESTS
    out, ref = _run_case(prefix_lens, extend_lens, 9, 3, dtype, seed=11, path="kernel")
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def test_split_plan_reads_each_cached_range_in_parts() -> None:
    from radixserve.attention.paged_plan import SPLIT_MIN_KEYS, SPLIT_PARTS, build_plan

    sizes = []
    for cached in (SPLIT_MIN_KEYS, 5000, 50000):
        table = torch.arange(2 * (cached + 8), dtype=torch.int32).view(2, cached + 8)
        plan = build_plan(table.numpy(), [0, 1], [cached, 40], [2, 1])
        # Request 0: its own job over the 2 new tokens, then SPLIT_PARTS chunks of the cached
        # ones, seen whole by both tokens; request 1 (short) is not split.
        bounds = torch.linspace(0, cached, SPLIT_PARTS + 1).long().tolist()
        assert plan.job_row.tolist() == [0, 1] + [0] * SPLIT_PARTS
        assert plan.job_kv_begin.tolist() == [cached, 0] + bounds[:-1]
        assert plan.entry_limit.tolist()[:3] == [cached + 1, cached + 2, 41]
        assert plan.entry_limit.tolist()[3:] == [b for b in bounds[1:] for _ in range(2)]
        # Each of request 0's tokens merges 1 + SPLIT_PARTS entries; request 1's token one.
        assert plan.row_entry_ptr.tolist() == [0, 1 + SPLIT_PARTS, 2 + 2 * SPLIT_PARTS, 3 + 2 * SPLIT_PARTS]
        sizes.append([t.numel() for t in plan.args()])
    assert sizes[0] == sizes[1] == sizes[2]  # the plan does not grow with the cached context
    unsplit = build_plan(table.numpy(), [0, 1], [SPLIT_MIN_KEYS - 1, 40], [2, 1])
    assert unsplit.job_row.tolist() == [0, 1]


def test_a_lone_request_plan_is_the_batch_plan() -> None:
    """One request's plan (built from Python ints: a lone agent's decode and verify steps) is the
    general path's, tensor for tensor: split or not, every new-token count up to the bound."""
    from radixserve.attention import paged_plan

    table = np.zeros((4, 6000), dtype=np.int32)
    table[2, :5500] = np.arange(1, 5501)
    for pre in [*range(0, 20), 511, 512, 513, 515, 1100, 1103, 5001]:
        for ext in (1, 2, 3, 8, 9, 17, paged_plan.LONE_MAX_NEW_TOKENS):
            lone = paged_plan.build_plan(table, [2], [pre], [ext])
            batch = paged_plan._batch_plan(table, [2], [pre], [ext], True)
            assert lone.shared_groups == batch.shared_groups == 0
            for a, b in zip(lone.args(), batch.args(), strict=True):
                assert a.dtype == b.dtype == torch.int64 and a.is_contiguous()
                assert torch.equal(a, b), (pre, ext)


def test_more_query_heads_per_kv_head_than_the_kernel_takes_falls_back() -> None:
    """40 query heads on one KV head (beyond the kernel's 32): the forward gathers instead."""
    out, ref = _run_case([30, 0], [1, 12], 40, 1, torch.float32, seed=9, path="kernel")
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
