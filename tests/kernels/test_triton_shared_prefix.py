"""Cascade decode kernel (shared prefix read once per group) against the plain decode kernel
and a float64 reference, on random paged inputs; and its host plan.

Each case scatters KV pages at random over the pool; the members of a group point the first
columns of their table rows at the same pages (a radix-tree hit), then at pages of their own.
Table rows hold junk past each sequence, unused query rows and every output element start as
NaN, and so does the workspace, so an element a kernel forgets to write (or a split the reduce
reads without anyone having written it) fails the check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from helpers.params import pairwise_then_slow
from radixserve.kernels.decode_attention import alloc_decode_workspace, decode_attention
from radixserve.kernels.shared_prefix_decode import (
    CascadeHostPlan,
    alloc_cascade_workspace,
    build_cascade_plan,
    cascade_config,
    cascade_decode_attention,
)

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
MIN_SHARED = 16  # small cases; the default (64) is for real batches


# ------------------------------------------------------------------------------ random cases


@dataclass
class Case:
    """Decode row b reads table row ``rows[b]``, columns ``[0, seq_lens[b])``; its query is
    row ``token_idx[b]`` of ``q`` (the other rows are NaN)."""

    table: np.ndarray  # [R, C] int32, host
    rows: np.ndarray  # [B]
    seq_lens: np.ndarray  # [B]
    token_idx: torch.Tensor  # [B]
    q: torch.Tensor  # [B + 2, H, D]
    k_buf: torch.Tensor  # [slots, KV, D]
    v_buf: torch.Tensor
    scale: float

    @property
    def group(self) -> int:
        return self.q.shape[1] // self.k_buf.shape[1]


def make_case(groups: list[tuple[int, int]], solo_lens: list[int], ratio: int, head_dim: int,
              page_size: int, dtype: torch.dtype, seed: int, max_own: int = 40) -> Case:
    """``groups``: (members, shared length) each; a shared length is a multiple of the page
    size (the tree shares whole pages).  Every member owns 1..max_own further keys."""
    gen = torch.Generator().manual_seed(seed)
    kv = 1 if ratio == 8 else 2
    heads = ratio * kv

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    layout: list[tuple[int, int]] = []  # per decode row: (its group or -1, seq_len)
    for g, (members, shared) in enumerate(groups):
        assert shared % page_size == 0, "the tree shares whole pages"
        layout += [(g, shared + randint(1, max_own)) for _ in range(members)]
    layout += [(-1, n) for n in solo_lens]
    order = torch.randperm(len(layout), generator=gen).tolist()
    layout = [layout[i] for i in order]

    shared_pages = [math.ceil(s / page_size) for _, s in groups]
    own_pages = [math.ceil(n / page_size) - (shared_pages[g] if g >= 0 else 0) for g, n in layout]
    num_pages = 1 + sum(shared_pages) + sum(own_pages) + 2
    free = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()  # page 0 never used
    group_pages = [[free.pop() for _ in range(n)] for n in shared_pages]
    slot_rows = []
    for (g, seq_len), n_own in zip(layout, own_pages, strict=True):
        pages = (group_pages[g] if g >= 0 else []) + [free.pop() for _ in range(n_own)]
        slot_rows.append([p * page_size + o for p in pages for o in range(page_size)][:seq_len])

    num_slots = num_pages * page_size
    seq_lens = np.array([n for _, n in layout], dtype=np.int64)
    table = torch.randint(0, num_slots, (len(layout) + 3, int(seq_lens.max()) + 5),
                          generator=gen, dtype=torch.int32).numpy()
    rows = torch.randperm(table.shape[0], generator=gen)[: len(layout)].numpy()
    for r, slots in zip(rows, slot_rows, strict=True):
        table[r, : len(slots)] = slots
    batch = len(layout)
    token_idx = torch.randperm(batch + 2, generator=gen)[:batch]
    q = torch.full((batch + 2, heads, head_dim), float("nan"), dtype=dtype)
    q[token_idx] = torch.randn((batch, heads, head_dim), generator=gen).to(dtype)

    def pool() -> torch.Tensor:
        return torch.randn((num_slots, kv, head_dim), generator=gen).to(dtype).to(DEVICE)

    return Case(table=table, rows=rows, seq_lens=seq_lens, token_idx=token_idx.to(DEVICE),
                q=q.to(DEVICE), k_buf=pool(), v_buf=pool(), scale=head_dim**-0.5)


def reference(case: Case) -> torch.Tensor:
    """float64 attention of each decode row over its keys: [B, H * D]."""
    k_pool, v_pool = case.k_buf.double().cpu(), case.v_buf.double().cpu()
    q = case.q.double().cpu()[case.token_idx.cpu()]
    outs = []
    for b, row in enumerate(case.rows):
        slots = torch.from_numpy(case.table[row, : case.seq_lens[b]].astype(np.int64))
        keys = k_pool[slots].repeat_interleave(case.group, dim=1)  # [L, H, D]
        vals = v_pool[slots].repeat_interleave(case.group, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[b], keys) * case.scale
        outs.append(torch.einsum("hl,lhd->hd", torch.softmax(scores, dim=-1), vals).reshape(-1))
    return torch.stack(outs)


def poisoned(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device=DEVICE)


def device_tensor(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


def plan_for(case: Case) -> CascadeHostPlan | None:
    return build_cascade_plan(case.table, case.rows, case.seq_lens, case.group,
                              case.q.shape[2], case.k_buf.dtype, min_shared=MIN_SHARED)


def run_plain(case: Case, num_splits: int) -> torch.Tensor:
    batch, heads, dim = len(case.rows), case.q.shape[1], case.q.shape[2]
    out = poisoned(batch + 2, heads * dim, dtype=case.q.dtype)
    decode_attention(
        case.q, case.k_buf, case.v_buf, out, device_tensor(case.table), device_tensor(case.rows),
        device_tensor(case.seq_lens), case.token_idx, case.scale, num_splits,
        alloc_decode_workspace(batch, heads, num_splits, dim, DEVICE),
    )
    return out[case.token_idx]


def run_cascade(case: Case, plan: CascadeHostPlan, num_splits: int) -> torch.Tensor:
    """The cascade kernel into a poisoned output (and workspace); rows that are not decode
    tokens' must stay NaN."""
    batch, heads, dim = len(case.rows), case.q.shape[1], case.q.shape[2]
    out = poisoned(batch + 2, heads * dim, dtype=case.q.dtype)
    workspace = alloc_cascade_workspace(batch, heads, num_splits, dim, DEVICE)
    for t in workspace:
        t.fill_(float("nan"))
    cascade_decode_attention(
        case.q, case.k_buf, case.v_buf, out, device_tensor(case.table), device_tensor(case.rows),
        device_tensor(case.seq_lens), case.token_idx,
        device_tensor(plan.kv_start), device_tensor(plan.tile_row), device_tensor(plan.tile_len),
        device_tensor(plan.tile_ptr), device_tensor(plan.tile_members),
        case.scale, num_splits, workspace,
    )
    untouched = torch.ones(batch + 2, dtype=torch.bool, device=DEVICE)
    untouched[case.token_idx] = False
    assert out[untouched].isnan().all(), "cascade wrote rows that are not its tokens'"
    return out[case.token_idx]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max |out - ref| / max |ref|; NaN (an unwritten poisoned element) compares as failure."""
    out = out.double().cpu()
    if not torch.isfinite(out).all():
        return math.inf
    ref = ref.double().cpu()
    return float((out - ref).abs().max() / ref.abs().max())


def check(case: Case, num_splits: int, groups: int) -> None:
    plan = plan_for(case)
    assert plan is not None and plan.num_groups == groups
    out = run_cascade(case, plan, num_splits)
    tol = TOL[case.q.dtype]
    assert out.dtype == case.q.dtype
    assert rel_err(out, reference(case)) <= tol
    assert rel_err(out, run_plain(case, num_splits)) <= tol


# ------------------------------------------------------------------------------ kernel


@pytest.mark.parametrize("ratio, head_dim, page_size", pairwise_then_slow([1, 4, 8], [64, 128], [1, 16]))
def test_cascade_float32(ratio: int, head_dim: int, page_size: int) -> None:
    # Shared lengths: 37 / 70 keys (page 1) or 48 / 64 (page 16), against blocks of 32 keys.
    shared = (37, 70) if page_size == 1 else (48, 64)
    case = make_case([(2, shared[0]), (5, shared[1])], [1, 90], ratio, head_dim, page_size,
                     torch.float32, seed=10 * ratio + head_dim + page_size)
    check(case, num_splits=1 if head_dim == 64 else 3, groups=2)


@pytest.mark.parametrize("ratio, head_dim, page_size", [(4, 128, 16), (8, 64, 1)])
def test_cascade_bfloat16(ratio: int, head_dim: int, page_size: int) -> None:
    shared = 80 if page_size == 16 else 75  # blocks of 64 keys in bfloat16
    case = make_case([(3, shared), (2, 2 * shared)], [50], ratio, head_dim, page_size,
                     torch.bfloat16, seed=ratio + head_dim)
    check(case, num_splits=2, groups=2)


@pytest.mark.parametrize("ratio, members", [(4, 17), (8, 16)])
def test_cascade_group_bigger_than_a_tile(ratio: int, members: int) -> None:
    """A tile holds BLOCK_M // G members (16 at G = 4, 8 at G = 8): 17 members at G = 4 are
    two partial tiles, 16 at G = 8 two full ones."""
    case = make_case([(members, 32), (2, 48)], [3], ratio, 64, 16, torch.float32, seed=ratio,
                     max_own=8)
    plan = plan_for(case)
    cap = cascade_config(case.group, 64, torch.float32).block_m // case.group
    assert plan is not None and len(plan.tile_row) == math.ceil(members / cap) + 1
    check(case, num_splits=1, groups=2)


def test_cascade_odd_group_and_head_dim() -> None:
    """G = 3 (21 members per tile, one padding row) and a head dim padded to 128."""
    case = make_case([(21, 19), (2, 61)], [4], 3, 96, 1, torch.float32, seed=11, max_own=2)
    check(case, num_splits=2, groups=2)


def test_cascade_split_count_does_not_change_the_result() -> None:
    """Shared and own ranges cut into 1 to many splits (more splits than blocks included)."""
    case = make_case([(3, 130), (2, 17)], [5, 200], 4, 64, 1, torch.float32, seed=3)
    ref = reference(case)
    plan = plan_for(case)
    for splits in (1, 3, 16):
        assert rel_err(run_cascade(case, plan, splits), ref) <= TOL[torch.float32], splits


def test_cascade_whole_context_but_the_newest_key_shared() -> None:
    """Row a's keys but its newest are all shared with row b: a keeps exactly one own key."""
    case = make_case([(2, 40)], [70], 4, 64, 1, torch.float32, seed=5, max_own=1)
    a, b = np.flatnonzero(case.seq_lens == 41)
    solo = case.rows[case.seq_lens == 70][0]
    # b: a's 41 keys (a's newest included), then 19 more of its own.
    case.table[case.rows[b], :41] = case.table[case.rows[a], :41]
    case.table[case.rows[b], 41:60] = case.table[solo, 41:60]
    case.seq_lens[b] = 60
    plan = plan_for(case)
    assert plan is not None
    assert plan.kv_start[a] == plan.kv_start[b] == 40
    out = run_cascade(case, plan, 2)
    assert rel_err(out, reference(case)) <= TOL[torch.float32]
    assert rel_err(out, run_plain(case, 2)) <= TOL[torch.float32]


def test_cascade_without_tiles_is_plain_decode() -> None:
    """An empty tile list (kv_start all 0) is legal and equals the plain kernel."""
    case = make_case([], [1, 33, 120], 4, 64, 16, torch.float32, seed=6)
    empty = np.zeros(0, dtype=np.int32)
    plan = CascadeHostPlan(np.zeros(3, np.int32), empty, empty, np.zeros(1, np.int32), empty, 0)
    out = run_cascade(case, plan, 3)
    assert rel_err(out, reference(case)) <= TOL[torch.float32]
    assert rel_err(out, run_plain(case, 3)) <= TOL[torch.float32]


def test_cascade_rejects_a_small_workspace() -> None:
    case = make_case([(2, 32)], [], 1, 64, 16, torch.float32, seed=7)
    plan = plan_for(case)
    heads, dim = case.q.shape[1], case.q.shape[2]
    small = alloc_decode_workspace(len(case.rows), heads, 3, dim, DEVICE)  # needs 2 * 3 splits
    out = poisoned(len(case.rows) + 2, heads * dim, dtype=torch.float32)
    with pytest.raises(ValueError, match="workspace"):
        cascade_decode_attention(
            case.q, case.k_buf, case.v_buf, out, device_tensor(case.table),
            device_tensor(case.rows), device_tensor(case.seq_lens), case.token_idx,
            device_tensor(plan.kv_start), device_tensor(plan.tile_row),
            device_tensor(plan.tile_len), device_tensor(plan.tile_ptr),
            device_tensor(plan.tile_members), case.scale, 3, small,
        )


# ------------------------------------------------------------------------------ host plan


def table_of(rows: list[list[int]]) -> np.ndarray:
    """A host table with one row per list (padded with junk slot 999_999)."""
    width = max(len(r) for r in rows) + 3
    table = np.full((len(rows), width), 999_999, dtype=np.int32)
    for i, r in enumerate(rows):
        table[i, : len(r)] = r
    return table


def members_of(plan: CascadeHostPlan) -> list[list[int]]:
    return [sorted(plan.tile_members[plan.tile_ptr[t] : plan.tile_ptr[t + 1]].tolist())
            for t in range(len(plan.tile_row))]


def test_plan_finds_groups_and_their_shared_lengths() -> None:
    sys_a, sys_b = list(range(1000, 1100)), list(range(2000, 2070))
    table = table_of([
        sys_a + [1, 2, 3],  # decode row 0: group A
        list(range(3000, 3200)),  # row 1: alone
        sys_b + [4],  # row 2: group B
        sys_a + [5, 6],  # row 3: group A
        sys_b + [7, 8, 9],  # row 4: group B
        sys_a + [10],  # row 5: group A
    ])
    rows = np.arange(6)
    seq_lens = np.array([103, 200, 71, 102, 73, 101])
    plan = build_cascade_plan(table, rows, seq_lens, 4, 128, torch.bfloat16)
    assert plan is not None and plan.num_groups == 2
    assert plan.kv_start.tolist() == [100, 0, 70, 100, 70, 100]
    assert members_of(plan) == [[0, 3, 5], [2, 4]]  # longest prefix first
    assert plan.tile_len.tolist() == [100, 70]
    assert plan.tile_row[0] in (0, 3, 5) and plan.tile_row[1] in (2, 4)
    assert plan.tile_ptr.tolist() == [0, 3, 5]
    for arr in (plan.kv_start, plan.tile_row, plan.tile_len, plan.tile_ptr, plan.tile_members):
        assert arr.dtype == np.int32


@pytest.mark.parametrize("group_size, head_dim, dtype", [
    (4, 128, torch.bfloat16), (3, 64, torch.float32), (8, 128, torch.float32),
    (128, 64, torch.bfloat16),
])
def test_plan_tiles_cap_their_members(group_size: int, head_dim: int, dtype: torch.dtype) -> None:
    table = table_of([list(range(500, 600)) + [i] for i in range(40)])
    plan = build_cascade_plan(table, np.arange(40), np.full(40, 101), group_size, head_dim, dtype)
    cap = cascade_config(group_size, head_dim, dtype).block_m // group_size
    assert cap >= 1
    sizes = np.diff(plan.tile_ptr)
    assert sizes.max() <= cap
    assert len(sizes) == math.ceil(40 / cap)
    assert sizes.max() - sizes.min() <= 1  # split evenly
    assert sorted(plan.tile_members.tolist()) == list(range(40))
    assert plan.num_groups == 1 and (plan.tile_len == 100).all()


def test_plan_is_none_without_sharing() -> None:
    distinct = table_of([list(range(100 * i, 100 * i + 90)) for i in range(1, 5)])
    assert build_cascade_plan(distinct, np.arange(4), np.full(4, 90), 4, 64, torch.float32) is None
    # Shared, but fewer keys than min_shared.
    short = table_of([list(range(10, 50)) + [i] for i in range(3)])
    assert build_cascade_plan(short, np.arange(3), np.full(3, 41), 4, 64, torch.float32) is None
    assert build_cascade_plan(short, np.arange(3), np.full(3, 41), 4, 64, torch.float32,
                              min_shared=32) is not None
    # One row alone cannot form a group, even with a long prefix.
    one = table_of([list(range(10, 300))])
    assert build_cascade_plan(one, np.arange(1), np.array([290]), 4, 64, torch.float32) is None


def test_plan_shared_length_leaves_every_row_an_own_key() -> None:
    base = list(range(100, 300))
    table = table_of([base, base, base + [7, 8]])  # rows 0 and 1 identical
    seq_lens = np.array([150, 200, 202])
    plan = build_cascade_plan(table, np.arange(3), seq_lens, 1, 64, torch.float32)
    assert plan is not None
    assert (plan.kv_start < seq_lens).all()
    assert plan.kv_start.tolist() == [149, 149, 149]


def test_plan_ignores_rows_too_short_to_share() -> None:
    """A row sharing only a few keys with a group does not cut the group's shared run."""
    prompt = list(range(100, 400))
    table = table_of([prompt + [1], prompt[:30] + [2], prompt + [3, 4]])
    plan = build_cascade_plan(table, np.arange(3), np.array([301, 31, 302]), 4, 64,
                              torch.bfloat16)
    assert plan is not None
    assert plan.kv_start.tolist() == [300, 0, 300]
    assert members_of(plan) == [[0, 2]]


def test_plan_shared_run_is_common_to_all_members() -> None:
    """Members that share more among themselves still get the run common to all."""
    prompt = list(range(100, 400))
    table = table_of([prompt + [1], prompt + [2], prompt[:150] + [3] * 160])
    plan = build_cascade_plan(table, np.arange(3), np.array([301, 301, 311]), 4, 64,
                              torch.float32)
    assert plan is not None
    assert plan.kv_start.tolist() == [150, 150, 150]


# ------------------------------------------------------------------------------ slow sweep


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("head_dim", [16, 64, 96, 128])
@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 8])
def test_sweep(ratio: int, head_dim: int, page_size: int, dtype: torch.dtype) -> None:
    seed = ratio * 1000 + head_dim * 10 + page_size
    gen = torch.Generator().manual_seed(seed)

    def randint(lo: int, hi: int) -> int:
        return int(torch.randint(lo, hi + 1, (), generator=gen))

    groups = [(randint(2, 20), page_size * randint(-(-MIN_SHARED // page_size), 200 // page_size))
              for _ in range(randint(1, 3))]
    solo = [randint(1, 300) for _ in range(randint(0, 3))]
    case = make_case(groups, solo, ratio, head_dim, page_size, dtype, seed)
    check(case, num_splits=randint(1, 8), groups=len(groups))


# ------------------------------------------------------------------------ in the engine


def test_scheduler_decodes_shared_prefixes_through_the_cascade(tiny_model_dir) -> None:
    """Requests sharing a cached 80-token prefix: the Triton backend's decode steps run the
    cascade, and the greedy outputs equal the torch backend's (float32)."""
    from helpers.sched_driver import make_scheduler, run_until_idle, submit

    folder = tiny_model_dir("llama")
    rng = np.random.default_rng(3)
    system = rng.integers(3, 250, 80).tolist()
    prompts = [system + rng.integers(3, 250, int(n)).tolist() for n in (3, 9, 5, 12)]
    outs = {}
    for backend in ("torch", "triton"):
        sched = make_scheduler(folder, attention_backend=backend, page_size=4, max_total_tokens=2048,
                               device=DEVICE.type, cuda_graph_max_bs=0)
        rids = [submit(sched, prompts[0], max_new_tokens=1)]  # caches the prefix first
        run_until_idle(sched)
        rids = [submit(sched, p, max_new_tokens=6, ignore_eos=True) for p in prompts]
        got = run_until_idle(sched)
        outs[backend] = [got[r]["output_ids"] for r in rids]
        if backend == "triton":
            assert sched.runner.backend.cascade_steps >= 5
    assert outs["triton"] == outs["torch"]
