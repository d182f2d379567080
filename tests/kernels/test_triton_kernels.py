"""Triton kernels against a float64 reference and the torch backend, on random paged inputs.

On a CPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET);
on a CUDA machine the same tests run compiled.  Every case draws fresh random inputs (never
zeros), scatters each request's KV over the pool (page size 1: single slots; page size 16:
aligned runs of 16 slots), leaves junk in the table beyond each sequence, and fills every
output buffer with NaN first, so an element a kernel forgets to write fails the check.
"""

from __future__ import annotations

import math
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from helpers.params import each_value_then_slow, pairwise_then_slow
from radixserve.kernels.decode_attention import alloc_decode_workspace, decode_attention
from radixserve.kernels.extend_attention import (
    ExtendConfig,
    build_extend_plan,
    extend_attention,
    extend_work_items,
)
from radixserve.kernels.kv_store import store_kv

from radixserve.attention import create_backend
from radixserve.attention.base import AttentionLayerInfo
from radixserve.batch import ForwardBatch
from radixserve.cache.kv_pool import KVPool

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# float32 on both (the GPU kernels keep float32 dots in IEEE precision); half types per issue.
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}
NUM_LAYERS = 2
LAYER = 1
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# ------------------------------------------------------------------------------ random cases


@dataclass
class Case:
    """One batch: request b has ``prefix_lens[b]`` cached keys and ``extend_lens[b]`` new
    tokens.  Its table row ``table_rows[b]`` holds ``slot_rows[b]`` (length seq_len) followed
    by junk; ``new_slots`` are the new tokens' slots in request order."""

    prefix_lens: list[int]
    extend_lens: list[int]
    slot_rows: list[list[int]]
    table_rows: list[int]
    req_to_token: torch.Tensor  # [R, max_ctx] int32
    pool: KVPool  # random contents everywhere (cached prefixes included)
    q: torch.Tensor  # [T, H, D]
    k: torch.Tensor  # [T, KV, D]
    v: torch.Tensor  # [T, KV, D]
    scale: float

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.extend_lens, strict=True)]

    @property
    def new_slots(self) -> torch.Tensor:
        return torch.tensor(
            [s for r, p in zip(self.slot_rows, self.prefix_lens, strict=True) for s in r[p:]],
            dtype=torch.int64, device=DEVICE,
        )

    @property
    def token_starts(self) -> list[int]:
        return [sum(self.extend_lens[:b]) for b in range(len(self.extend_lens))]

    @property
    def layer(self) -> AttentionLayerInfo:
        return AttentionLayerInfo(LAYER, self.q.shape[1], self.k.shape[1], self.q.shape[2], self.scale)


def make_case(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype,
    seed: int,
    share_first_pages: int = 0,
) -> Case:
    """Random case; with ``share_first_pages`` every request whose prefix allows it starts
    with the first pages of request 0 (a radix-tree hit shares slots)."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    pages_per_req = [math.ceil(s / page_size) for s in seq_lens]
    num_pages = sum(pages_per_req) + 4  # page 0 is never handed out; a few stay free
    free_pages = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    slot_rows: list[list[int]] = []
    for b, (n_pages, seq_len) in enumerate(zip(pages_per_req, seq_lens, strict=True)):
        pages = [free_pages.pop() for _ in range(n_pages)]
        # Only whole pages inside both cached prefixes can be shared (as the radix tree does).
        shared = min(share_first_pages, prefix_lens[b] // page_size, prefix_lens[0] // page_size)
        if b and shared:
            pages[:shared] = [s // page_size for s in slot_rows[0][: shared * page_size : page_size]]
        slot_rows.append([p * page_size + o for p in pages for o in range(page_size)][:seq_len])
    pool = KVPool(num_pages * page_size, NUM_LAYERS, num_kv, head_dim, dtype, DEVICE)
    for layer in range(NUM_LAYERS):
        for buf in pool.get_kv(layer):
            buf.copy_(torch.randn(buf.shape, generator=gen).to(dtype))
    table = torch.randint(0, num_pages * page_size, (len(seq_lens) + 3, max(seq_lens) + 7),
                          generator=gen, dtype=torch.int32)
    table_rows = torch.randperm(table.shape[0], generator=gen)[: len(seq_lens)].tolist()
    for r, slots in zip(table_rows, slot_rows, strict=True):
        table[r, : len(slots)] = torch.tensor(slots, dtype=torch.int32)
    total = sum(extend_lens)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=gen).to(dtype).to(DEVICE)

    return Case(
        prefix_lens=list(prefix_lens), extend_lens=list(extend_lens), slot_rows=slot_rows,
        table_rows=table_rows, req_to_token=table.to(DEVICE), pool=pool,
        q=rand(total, num_heads, head_dim), k=rand(total, num_kv, head_dim),
        v=rand(total, num_kv, head_dim), scale=head_dim**-0.5,
    )


def reference(case: Case) -> torch.Tensor:
    """float64 attention per request over the pool with the new K/V stored: new token i of
    request b sees keys [0, prefix_len + i]."""
    store_expected(case)
    k_pool, v_pool = (b.double().cpu() for b in case.pool.get_kv(LAYER))
    q = case.q.to(case.pool.dtype).double().cpu()
    group = q.shape[1] // k_pool.shape[1]
    outs = []
    for b, slots in enumerate(case.slot_rows):
        p, e, t = case.prefix_lens[b], case.extend_lens[b], case.token_starts[b]
        keys = k_pool[slots].repeat_interleave(group, dim=1)  # [L, H, D]
        vals = v_pool[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("ehd,lhd->hel", q[t : t + e], keys) * case.scale
        visible = torch.arange(p + e)[None, :] <= (p + torch.arange(e))[:, None]  # [e, L]
        scores = scores.masked_fill(~visible, float("-inf"))
        outs.append(torch.einsum("hel,lhd->ehd", torch.softmax(scores, dim=-1), vals))
    return torch.cat(outs).reshape(q.shape[0], -1)


def store_expected(case: Case) -> None:
    """What the KV store must do, with plain indexing (for kernel tests that skip it)."""
    case.pool.set_kv(LAYER, case.new_slots, case.k, case.v)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; NaN (an unwritten poisoned element) compares as failure."""
    out = out.double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    return float((out - ref.double().cpu()).abs().max() / ref.abs().max())


def poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def gqa(ratio: int) -> tuple[int, int]:
    """(query heads, KV heads) for a GQA ratio; 2 KV heads unless that makes too many."""
    kv = 1 if ratio == 8 else 2
    return ratio * kv, kv


# ------------------------------------------------------------------------------ KV store


@pytest.mark.parametrize("num_kv, head_dim", [(1, 128), (2, 16), (8, 64), (3, 96)])
@pytest.mark.parametrize("src_dtype, pool_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float16),
])
def test_store_kv_writes_exactly_the_new_slots(num_kv, head_dim, src_dtype, pool_dtype) -> None:
    case = make_case([3, 0, 40], [1, 17, 5], num_kv, num_kv, head_dim, 16, pool_dtype, seed=head_dim)
    # k and v as the model hands them over: strided views into one fused qkv projection.
    gen = torch.Generator().manual_seed(num_kv)
    total = case.q.shape[0]
    fused = torch.randn((total, 3 * num_kv, head_dim), generator=gen).to(src_dtype).to(DEVICE)
    k, v = fused[:, num_kv : 2 * num_kv], fused[:, 2 * num_kv :]
    k_buf, v_buf = case.pool.get_kv(LAYER)
    slots = case.new_slots
    k_buf[slots] = float("nan")
    v_buf[slots] = float("nan")
    keep = torch.ones(k_buf.shape[0], dtype=torch.bool, device=DEVICE)
    keep[slots] = False
    k_before, v_before = k_buf[keep].clone(), v_buf[keep].clone()
    store_kv(k_buf, v_buf, slots, k, v)
    assert torch.equal(k_buf[slots], k.to(pool_dtype))
    assert torch.equal(v_buf[slots], v.to(pool_dtype))
    assert torch.equal(k_buf[keep], k_before) and torch.equal(v_buf[keep], v_before)


# ------------------------------------------------------------------------------ decode kernel

DECODE_PREFIXES = [0, 1, 37, 300, 129]  # seq_len = prefix + 1: 1, 2, 38, 301, 130


def run_decode(case: Case, num_splits: int) -> torch.Tensor:
    """Decode kernel over the case's rows; outputs land in a permutation of the rows of a
    poisoned [T + 2, H * D] tensor, whose two extra rows must stay NaN."""
    store_expected(case)
    batch = len(case.prefix_lens)
    heads, dim = case.q.shape[1], case.q.shape[2]
    gen = torch.Generator().manual_seed(batch)
    token_idx = torch.randperm(batch + 2, generator=gen)[:batch].to(DEVICE)
    q = poisoned(batch + 2, heads, dim, dtype=case.q.dtype)
    q[token_idx] = case.q
    out = poisoned(batch + 2, heads * dim, dtype=case.q.dtype)
    mid_o, mid_lse = alloc_decode_workspace(batch, heads, num_splits, dim, DEVICE)
    mid_o.fill_(float("nan"))
    mid_lse.fill_(float("nan"))
    k_buf, v_buf = case.pool.get_kv(LAYER)
    decode_attention(
        q, k_buf, v_buf, out, case.req_to_token,
        torch.tensor(case.table_rows, device=DEVICE),
        torch.tensor(case.seq_lens, device=DEVICE),
        token_idx, case.scale, num_splits, (mid_o, mid_lse),
    )
    untouched = torch.ones(batch + 2, dtype=torch.bool, device=DEVICE)
    untouched[token_idx] = False
    assert out[untouched].isnan().all(), "decode wrote rows that are not its tokens'"
    return out[token_idx]


@pytest.mark.parametrize("ratio, head_dim, page_size", pairwise_then_slow([1, 3, 4, 8], [64, 128], [1, 16]))
def test_decode_kernel_float32(ratio: int, head_dim: int, page_size: int) -> None:
    heads, kv = gqa(ratio)
    case = make_case(DECODE_PREFIXES, [1] * 5, heads, kv, head_dim, page_size, torch.float32,
                     seed=100 * ratio + head_dim + page_size)
    num_splits = {1: 1, 3: 3, 4: 4, 8: 16}[ratio]  # 16 splits > blocks of most rows
    out = run_decode(case, num_splits)
    assert rel_err(out, reference(case)) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_decode_kernel_half(dtype: torch.dtype) -> None:
    case = make_case(DECODE_PREFIXES, [1] * 5, 8, 2, 128, 16, dtype, seed=5)
    out = run_decode(case, 4)
    assert out.dtype == dtype
    assert rel_err(out, reference(case)) <= TOL[dtype]


def test_decode_split_count_does_not_change_the_result() -> None:
    case = make_case([700, 5, 64], [1, 1, 1], 4, 2, 16, 1, torch.float32, seed=9)
    ref = reference(case)
    for splits in (1, 2, 7, 64):
        assert rel_err(run_decode(case, splits), ref) <= TOL[torch.float32], splits


# ------------------------------------------------------------------------------ extend kernel

EXTEND_PREFIXES = [0, 1, 200, 37]
EXTEND_LENS = [23, 9, 70, 150]


def run_extend(case: Case, config: ExtendConfig | None = None) -> torch.Tensor:
    store_expected(case)
    heads, dim = case.q.shape[1], case.q.shape[2]
    out = poisoned(case.q.shape[0], heads * dim, dtype=case.q.dtype)
    plan = build_extend_plan(
        torch.tensor(case.table_rows, device=DEVICE), case.prefix_lens, case.extend_lens,
        case.token_starts, dim, case.pool.dtype, config,
    )
    k_buf, v_buf = case.pool.get_kv(LAYER)
    extend_attention(case.q, case.k, case.v, k_buf, v_buf, out, case.req_to_token, plan,
                     case.scale)
    return out


@pytest.mark.parametrize("ratio, head_dim, page_size", pairwise_then_slow([1, 3, 4, 8], [64, 128], [1, 16]))
def test_extend_kernel_float32(ratio: int, head_dim: int, page_size: int) -> None:
    heads, kv = gqa(ratio)
    case = make_case(EXTEND_PREFIXES, EXTEND_LENS, heads, kv, head_dim, page_size, torch.float32,
                     seed=200 * ratio + head_dim + page_size, share_first_pages=2)
    out = run_extend(case)
    assert rel_err(out, reference(case)) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_extend_kernel_half(dtype: torch.dtype) -> None:
    case = make_case(EXTEND_PREFIXES, EXTEND_LENS, 8, 2, 128, 16, dtype, seed=6)
    out = run_extend(case)
    assert out.dtype == dtype
    assert rel_err(out, reference(case)) <= TOL[dtype]


def test_extend_small_tiles_and_odd_head_dim() -> None:
    """Many tiles per request (prefix tails, diagonal blocks) and a head dim padded to 128."""
    case = make_case([0, 47, 1, 16], [33, 16, 2, 31], 6, 2, 96, 16, torch.float32, seed=8)
    out = run_extend(case, ExtendConfig(block_m=32, block_n=16, num_warps=4, num_stages=1))
    assert rel_err(out, reference(case)) <= TOL[torch.float32]


def test_extend_work_items_cover_every_token_once() -> None:
    req, start = extend_work_items([5, 0, 300], [130, 1, 64], block_m=64)
    blocks = sorted(zip(req.tolist(), start.tolist(), strict=True))
    assert blocks == [(0, 0), (0, 64), (0, 128), (1, 0), (2, 0)]
    assert req[0] == 2  # the most work (longest prefix) first


# ------------------------------------------------------------------------------ backend


def prepared_step(name: str, case: Case, pool: KVPool, cascade: bool = False) -> tuple[Any, ForwardBatch]:
    """Backend ``name`` with the case's step planned over ``pool`` (forward not yet run);
    ``cascade``: the Triton backend knows the head layout, so it plans shared prefixes."""
    backend = create_backend(name)
    if cascade:
        backend.layer = case.layer
    fb = ForwardBatch.build(
        input_ids=[0] * case.q.shape[0], prefix_lens=case.prefix_lens,
        extend_lens=case.extend_lens, req_pool_indices=case.table_rows,
        out_cache_loc=case.new_slots, req_to_token=case.req_to_token, kv_pool=pool,
        attn_backend=backend, device=DEVICE,
    )
    backend.prepare(fb)
    return backend, fb


def run_backends(case: Case) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(triton out, torch backend out, float64 reference) on the same inputs.

    Each backend gets its own copy of the pool; both must store the new K/V first."""
    outs = []
    for name in ("triton", "torch"):
        pool = KVPool(case.pool.num_slots, NUM_LAYERS, case.pool.num_kv_heads,
                      case.pool.head_dim, case.pool.dtype, DEVICE)
        for dst, src in zip(pool.k_buffers + pool.v_buffers,
                            case.pool.k_buffers + case.pool.v_buffers, strict=True):
            dst.copy_(src)
        backend, fb = prepared_step(name, case, pool)
        if name == "triton":
            width = case.q.shape[1] * case.q.shape[2]
            out = backend.forward(case.q, case.k, case.v, case.layer, fb,
                                  out=poisoned(case.q.shape[0], width, dtype=case.q.dtype))
            if fb.attn_metadata.decode is not None:  # the next layer reuses the workspace
                for t in fb.attn_metadata.decode.workspace:
                    t.fill_(float("nan"))
                backend.forward(case.q, case.k, case.v, case.layer, fb,
                                out=out.fill_(float("nan")))
            k_buf, v_buf = pool.get_kv(LAYER)
            assert torch.equal(k_buf[case.new_slots], case.k.to(pool.dtype))
            assert torch.equal(v_buf[case.new_slots], case.v.to(pool.dtype))
        else:
            out = backend.forward(case.q, case.k, case.v, case.layer, fb)
        outs.append(out)
    return outs[0], outs[1], reference(case)


BATCHES = {
    "prefill_one": ([0], [37]),
    "prefill_many": ([0, 0, 0], [5, 17, 2]),
    "extend_prefix_1": ([1], [9]),
    "extend_long_prefix": ([260, 3], [7, 30]),
    "decode_many": ([0, 1, 64, 200, 17], [1, 1, 1, 1, 1]),
    "mixed": ([30, 0, 5, 99, 1, 300], [1, 40, 1, 1, 6, 12]),
}


@pytest.mark.parametrize("batch, shape", each_value_then_slow(
    sorted(BATCHES), [(1, 64, 16), (3, 128, 1), (4, 64, 1), (8, 128, 16)]))
def test_backend_matches_torch_backend(batch: str, shape: tuple[int, int, int]) -> None:
    ratio, head_dim, page_size = shape
    heads, kv = gqa(ratio)
    prefix_lens, extend_lens = BATCHES[batch]
    case = make_case(prefix_lens, extend_lens, heads, kv, head_dim, page_size, torch.float32,
                     seed=ratio + head_dim + page_size, share_first_pages=1)
    out, torch_out, ref = run_backends(case)
    assert out.shape == torch_out.shape and out.dtype == torch_out.dtype
    assert rel_err(out, ref) <= TOL[torch.float32]
    assert rel_err(out, torch_out.double()) <= TOL[torch.float32]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_backend_half(dtype: torch.dtype) -> None:
    prefix_lens, extend_lens = BATCHES["mixed"]
    case = make_case(prefix_lens, extend_lens, 8, 2, 64, 16, dtype, seed=4)
    out, torch_out, ref = run_backends(case)
    assert out.dtype == dtype
    assert rel_err(out, ref) <= TOL[dtype]
    assert rel_err(torch_out, ref) <= TOL[dtype]


# ------------------------------------------------------------------------------ slow sweep


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [16, 64, 96, 128])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 8])
def test_sweep(ratio: int, head_dim: int, page_size: int, dtype: torch.dtype) -> None:
    heads, kv = gqa(ratio)
    seed = ratio * 1000 + head_dim * 10 + page_size
    gen = torch.Generator().manual_seed(seed)
    n = int(torch.randint(2, 7, (1,), generator=gen))
    prefix = torch.randint(0, 400, (n,), generator=gen).tolist()
    extend = [1 if torch.rand((), generator=gen) < 0.5 else int(torch.randint(2, 200, (), generator=gen))
              for _ in range(n)]
    prefix[-1] = 0
    case = make_case(prefix, extend, heads, kv, head_dim, page_size, dtype, seed, share_first_pages=3)
    out, torch_out, ref = run_backends(case)
    assert rel_err(out, ref) <= TOL[dtype]
    assert rel_err(out, torch_out.double()) <= 2 * TOL[dtype]


# ------------------------------------------------------------------------------ GPU build


def compile_check(*args: str) -> subprocess.CompletedProcess:
    """Compile the kernels for a GPU architecture ahead of time (works without a GPU)."""
    return subprocess.run(
        [sys.executable, "-m", "radixserve.kernels.compile_check", *args],
        capture_output=True, text=True, timeout=1200, env={**os.environ, "TRITON_INTERPRET": "0"},
    )


@pytest.mark.skipif(torch.cuda.is_available(), reason="the other tests compile them for real")
def test_kernels_compile_for_h200() -> None:
    """The interpreter does not compile anything: build the bf16 / head dim 128 / GQA 4
    kernels for sm_90 through Triton's ahead-of-time path (shared memory within limits)."""
    proc = compile_check("--arch", "90", "--level", "headline")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "decode_split" in proc.stdout and "extend" in proc.stdout


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the other tests compile them for real")
@pytest.mark.parametrize("arch", ["80", "90"])
def test_kernels_compile_everywhere(arch: str) -> None:
    proc = compile_check("--arch", arch, "--level", "full")
    assert proc.returncode == 0, proc.stdout + proc.stderr


# ------------------------------------------------------------------------------ bench smoke


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run calls bench/kernels.py itself")
def test_bench_interpret_smoke(tmp_path) -> None:
    out = tmp_path / "kernels.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "kernels.py"), "--interpret-smoke",
         "--out", str(out)],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "TRITON_INTERPRET": "1"},
    )
    assert proc.returncode == 0, proc.stderr
    import json

    data = json.loads(out.read_text())
    assert data["mode"] == "interpret-smoke"
    assert {r["kernel"] for r in data["results"]} >= {"decode", "extend", "store_kv"}
    assert all(r["rel_err"] <= 1e-5 for r in data["results"] if "rel_err" in r)
