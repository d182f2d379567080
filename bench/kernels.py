"""Kernel benchmark: the Triton attention kernels against the device's ceilings and the torch
backend, on a CUDA GPU.

For every point of a grid of batch sizes and context lengths (32 query / 8 KV heads, head dim
128, bfloat16, page size 16, pages scattered over the pool) it times, as medians of
``triton.testing.do_bench``:

  decode   one new token per request over ``ctx`` cached keys.  Bandwidth = bytes of K/V read
           (B x ctx x KV x D x 2 x 2 bytes) / time, next to the measured copy bandwidth (a
           large device-to-device tensor copy: read + write bytes / time).
  extend   ``new`` tokens per request over ``prefix`` cached keys + causal among themselves.
           FLOP rate = useful FLOPs (4 x H x D x sum of visible query-key pairs) / time, next
           to the measured dense bf16 matmul rate (8192^3 torch.matmul).
  store_kv writing T new tokens' K/V into their slots (bytes moved / time).
  cascade  decode of B requests sharing a cached prefix: the plain kernel (reads the prefix B
           times) against the cascade (once per group tile), backend forward each.

beside the torch backend's ``forward`` on the same inputs (and the Triton backend's full
``forward``, KV store included), plus each output's relative error against the torch
backend.  At the target points, sweeps over num_splits and over tile configurations (block
sizes, warps, pipeline stages) show how the shipped defaults fare against the alternatives.
The issue's targets on an H200: decode >= 70% of copy bandwidth at batch 64, ctx 4096;
extend >= 40% of the matmul rate at 4096 new tokens.

    python bench/kernels.py                     # full grid; JSON -> bench/results/kernels-<gpu>.json
    python bench/kernels.py --quick             # a few points
    python bench/kernels.py --interpret-smoke   # tiny shapes on a CPU under TRITON_INTERPRET
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import platform
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16
DECODE_GRID = [(b, c) for b in (1, 16, 64, 128) for c in (1024, 4096, 16384)]
EXTEND_GRID = [(1, 4096, 0), (1, 4096, 4096), (1, 8192, 0), (4, 1024, 1024), (8, 512, 0),
               (16, 256, 2048)]
QUICK_DECODE = [(1, 4096), (64, 4096)]
QUICK_EXTEND = [(1, 4096, 0), (4, 1024, 1024)]
SPLIT_SWEEP = (1, 2, 4, 8, 16, 32)
# batch, shared prefix, own keys per request: an agent's system prompt under many requests
CASCADE_GRID = [(16, 4096, 256), (64, 4096, 256), (64, 16384, 512), (256, 2048, 128)]
CASCADE_SMOKE = [(3, 64, 8)]
# Tile sweeps at the target points (block_n, num_warps, num_stages) / (block_m, block_n, ...):
# the first entry of each is the shipped default for bf16, head dim 128.
DECODE_TILES = [(64, 4, 2), (32, 4, 3), (64, 4, 3), (128, 4, 2), (64, 8, 2), (128, 8, 3), (32, 2, 4)]
EXTEND_TILES = [(128, 64, 8, 2), (128, 64, 4, 2), (128, 64, 8, 3), (128, 128, 8, 2),
                (128, 32, 4, 3), (64, 64, 4, 3), (64, 32, 4, 2)]
TORCH_MAX_TOKENS = 1 << 20  # skip the torch backend beyond this many cached tokens (slow)
TARGET_DECODE = (64, 4096, 0.70)  # batch, ctx, fraction of copy bandwidth
TARGET_EXTEND = (4096, 0.40)  # new tokens (batch 1, no prefix), fraction of matmul rate


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a few grid points only")
    p.add_argument("--interpret-smoke", action="store_true",
                   help="tiny shapes on a CPU under the Triton interpreter (checks the script runs)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/kernels-<gpu>.json)")
    return p.parse_args()


# ---------------------------------------------------------------------------- timing


def make_timer(on_gpu: bool) -> Callable[[Callable[[], Any]], float]:
    """Median milliseconds of ``fn``: do_bench on a GPU, a few wall-clock runs otherwise."""
    if on_gpu:
        import triton.testing

        return lambda fn: float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))

    def wall(fn: Callable[[], Any]) -> float:
        fn()
        runs = []
        for _ in range(3):
            t0 = time.perf_counter()
            fn()
            runs.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(runs)

    return wall


def device_ceilings(timer: Callable, device: torch.device, smoke: bool) -> dict[str, float]:
    """Measured copy bandwidth (GB/s) and dense bf16 matmul rate (TFLOP/s)."""
    n_bytes = (16 << 20) if smoke else (2 << 30)
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    dst = torch.empty_like(src)
    copy_ms = timer(lambda: dst.copy_(src))
    n = 256 if smoke else 8192
    a = torch.randn((n, n), dtype=torch.bfloat16, device=device)
    b = torch.randn((n, n), dtype=torch.bfloat16, device=device)
    mm_ms = timer(lambda: torch.matmul(a, b))
    return {"copy_gbps": 2 * n_bytes / copy_ms / 1e6, "matmul_tflops": 2 * n**3 / mm_ms / 1e9}


# ---------------------------------------------------------------------------- inputs


class Batch:
    """A random paged batch: request b has ``prefix[b]`` cached tokens (pages scattered over
    the pool) and ``new[b]`` new tokens, with one KV pool layer."""

    def __init__(self, prefix: list[int], new: list[int], heads: int, kv: int, dim: int,
                 page: int, dtype: torch.dtype, device: torch.device, seed: int = 0) -> None:
        from radixserve.cache.kv_pool import KVPool

        gen = torch.Generator(device="cpu").manual_seed(seed)
        self.prefix, self.new = prefix, new
        seq = [p + e for p, e in zip(prefix, new, strict=True)]
        pages = [math.ceil(s / page) for s in seq]
        num_pages = sum(pages) + 1
        order = (torch.randperm(num_pages - 1, generator=gen) + 1).to(device)
        self.table = torch.zeros((len(seq), max(seq) + page), dtype=torch.int32, device=device)
        offs = torch.arange(page, device=device)
        used = 0
        for b, n_pages in enumerate(pages):
            slots = (order[used : used + n_pages, None] * page + offs).reshape(-1)[: seq[b]]
            self.table[b, : seq[b]] = slots.to(torch.int32)
            used += n_pages
        self.pool = KVPool(num_pages * page, 1, kv, dim, dtype, device)
        for buf in self.pool.get_kv(0):
            buf.normal_()
        total = sum(new)
        self.q = torch.randn((total, heads, dim), dtype=dtype, device=device)
        self.k = torch.randn((total, kv, dim), dtype=dtype, device=device)
        self.v = torch.randn((total, kv, dim), dtype=dtype, device=device)
        rows = torch.arange(len(seq), device=device).repeat_interleave(torch.tensor(new, device=device))
        cols = torch.cat([torch.arange(p, p + e, device=device) for p, e in zip(prefix, new, strict=True)])
        self.out_cache_loc = self.table[rows, cols].to(torch.int64)
        from radixserve.attention.base import AttentionLayerInfo

        self.layer = AttentionLayerInfo(0, heads, kv, dim, dim**-0.5)

    def forward_batch(self, backend: Any) -> Any:
        from radixserve.batch import ForwardBatch

        fb = ForwardBatch.build(
            input_ids=[0] * self.q.shape[0], prefix_lens=self.prefix, extend_lens=self.new,
            req_pool_indices=list(range(len(self.prefix))), out_cache_loc=self.out_cache_loc,
            req_to_token=self.table, kv_pool=self.pool, attn_backend=backend,
            device=self.q.device,
        )
        backend.prepare(fb)
        return fb

    def run(self, backend: Any) -> tuple[Callable[[], torch.Tensor], Any]:
        fb = self.forward_batch(backend)
        return (lambda: backend.forward(self.q, self.k, self.v, self.layer, fb)), fb


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return float((out - ref).abs().max() / ref.abs().max())


# ---------------------------------------------------------------------------- benchmarks


def bench_decode(timer: Callable, grid: list[tuple[int, int]], shape: tuple, ceil: dict,
                 device: torch.device) -> list[dict]:
    from radixserve.kernels.decode_attention import decode_attention

    from radixserve.attention import create_backend

    heads, kv, dim, page, dtype = shape
    rows = []
    for batch, ctx in grid:
        # ctx keys per request: ctx - 1 cached plus the new token.
        data = Batch([ctx - 1] * batch, [1] * batch, heads, kv, dim, page, dtype, device)
        triton_be = create_backend("triton")
        fwd, fb = data.run(triton_be)
        out = fwd()
        plan = fb.attn_metadata.decode
        k_buf, v_buf = data.pool.get_kv(0)

        def kernel(plan=plan, out=out, k_buf=k_buf, v_buf=v_buf, fb=fb, data=data) -> None:
            decode_attention(data.q, k_buf, v_buf, out, fb.req_to_token, plan.table_rows,
                             plan.seq_lens, plan.token_idx, data.layer.scaling, plan.num_splits,
                             plan.workspace)

        kv_bytes = batch * ctx * kv * dim * 2 * data.pool.k_buffers[0].element_size()
        ms = timer(kernel)
        row: dict[str, Any] = {
            "kernel": "decode", "batch": batch, "ctx": ctx, "num_splits": plan.num_splits,
            "ms": ms, "gbps": kv_bytes / ms / 1e6, "triton_forward_ms": timer(fwd),
        }
        row["pct_of_copy"] = 100 * row["gbps"] / ceil["copy_gbps"]
        if batch * ctx <= TORCH_MAX_TOKENS:
            torch_fwd, _ = data.run(create_backend("torch"))
            row["torch_ms"] = timer(torch_fwd)
            row["torch_gbps"] = kv_bytes / row["torch_ms"] / 1e6
            row["rel_err"] = rel_err(fwd(), torch_fwd())
        rows.append(row)
        print(f"decode  B={batch:4d} ctx={ctx:6d} splits={plan.num_splits:3d}  "
              f"{ms:8.3f} ms {row['gbps']:8.1f} GB/s ({row['pct_of_copy']:5.1f}% of copy)  "
              f"torch {row.get('torch_ms', float('nan')):8.3f} ms  err {row.get('rel_err', float('nan')):.1e}",
              flush=True)
        del data, triton_be, fb, out, plan
    return rows


def bench_cascade(timer: Callable, batch: int, shared: int, own: int, shape: tuple,
                  device: torch.device) -> dict:
    """Decode of ``batch`` requests whose first ``shared`` keys are the same slots (a prefix
    shared through the tree) plus ``own`` keys each: the plain kernel against the cascade
    (kernels/shared_prefix_decode.py), which reads the shared keys once per group tile."""
    from radixserve.kernels.decode_attention import decode_attention

    from radixserve.attention.triton_backend import TritonAttentionBackend

    heads, kv, dim, page, dtype = shape
    data = Batch([shared + own - 1] * batch, [1] * batch, heads, kv, dim, page, dtype, device)
    data.table[1:, :shared] = data.table[0, :shared]  # every row starts with row 0's slots
    cascade_be = TritonAttentionBackend()
    cascade_be.layer = data.layer
    fwd, fb = data.run(cascade_be)
    out = fwd()
    plan = fb.attn_metadata.decode
    if plan.cascade is None:
        raise RuntimeError("the cascade plan found no shared prefix")
    plain_be = TritonAttentionBackend()  # no layer layout: plain decode
    plain_fwd, plain_fb = data.run(plain_be)
    k_buf, v_buf = data.pool.get_kv(0)
    pplan = plain_fb.attn_metadata.decode

    def plain_kernel() -> None:
        decode_attention(data.q, k_buf, v_buf, out, plain_fb.req_to_token, pplan.table_rows, pplan.seq_lens,
                         pplan.token_idx, data.layer.scaling, pplan.num_splits, pplan.workspace)

    row = {"kernel": "cascade-decode", "batch": batch, "shared": shared, "own": own,
           "plain_forward_ms": timer(plain_fwd), "cascade_forward_ms": timer(fwd),
           "plain_kernel_ms": timer(plain_kernel), "rel_err": rel_err(fwd(), plain_fwd())}
    row["speedup"] = row["plain_forward_ms"] / row["cascade_forward_ms"]
    print(f"cascade B={batch:4d} shared={shared:6d} own={own:4d}  plain {row['plain_forward_ms']:8.3f} ms  "
          f"cascade {row['cascade_forward_ms']:8.3f} ms  x{row['speedup']:.2f}  err {row['rel_err']:.1e}",
          flush=True)
    return row


def bench_splits(timer: Callable, batch: int, ctx: int, shape: tuple, ceil: dict,
                 device: torch.device, sweep: tuple[int, ...] = SPLIT_SWEEP) -> list[dict]:
    from radixserve.attention.triton_backend import TritonAttentionBackend

    heads, kv, dim, page, dtype = shape
    data = Batch([ctx - 1] * batch, [1] * batch, heads, kv, dim, page, dtype, device)
    kv_bytes = batch * ctx * kv * dim * 2 * data.pool.k_buffers[0].element_size()
    rows = []
    for splits in sweep:
        fwd, _ = data.run(TritonAttentionBackend(num_splits=splits))
        ms = timer(fwd)
        gbps = kv_bytes / ms / 1e6
        rows.append({"kernel": "decode_forward_splits", "batch": batch, "ctx": ctx,
                     "num_splits": splits, "ms": ms, "gbps": gbps,
                     "pct_of_copy": 100 * gbps / ceil["copy_gbps"]})
        print(f"  splits={splits:3d}  forward {ms:8.3f} ms  {gbps:8.1f} GB/s", flush=True)
    return rows


def bench_decode_tiles(timer: Callable, batch: int, ctx: int, shape: tuple, ceil: dict,
                       device: torch.device, tiles: list[tuple] = DECODE_TILES) -> list[dict]:
    from radixserve.kernels.decode_attention import DecodeConfig, decode_attention

    from radixserve.attention import create_backend

    heads, kv, dim, page, dtype = shape
    data = Batch([ctx - 1] * batch, [1] * batch, heads, kv, dim, page, dtype, device)
    fwd, fb = data.run(create_backend("triton"))
    out = fwd()
    plan = fb.attn_metadata.decode
    k_buf, v_buf = data.pool.get_kv(0)
    kv_bytes = batch * ctx * kv * dim * 2 * k_buf.element_size()
    rows = []
    for block_n, warps, stages in tiles:
        cfg = DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages)
        ms = timer(lambda cfg=cfg: decode_attention(
            data.q, k_buf, v_buf, out, fb.req_to_token, plan.table_rows, plan.seq_lens,
            plan.token_idx, data.layer.scaling, plan.num_splits, plan.workspace, cfg))
        gbps = kv_bytes / ms / 1e6
        rows.append({"kernel": "decode_tiles", "batch": batch, "ctx": ctx,
                     "num_splits": plan.num_splits, "block_n": block_n, "num_warps": warps,
                     "num_stages": stages, "ms": ms, "gbps": gbps,
                     "pct_of_copy": 100 * gbps / ceil["copy_gbps"]})
        print(f"  block_n={block_n:3d} warps={warps} stages={stages}  {ms:8.3f} ms "
              f"{gbps:8.1f} GB/s ({100 * gbps / ceil['copy_gbps']:5.1f}%)", flush=True)
    return rows


def bench_extend_tiles(timer: Callable, new: int, shape: tuple, ceil: dict,
                       device: torch.device, tiles: list[tuple] = EXTEND_TILES) -> list[dict]:
    from radixserve.kernels.extend_attention import (
        ExtendConfig,
        build_extend_plan,
        extend_attention,
    )

    heads, kv, dim, page, dtype = shape
    data = Batch([0], [new], heads, kv, dim, page, dtype, device)
    k_buf, v_buf = data.pool.get_kv(0)
    out = torch.empty((new, heads * dim), dtype=dtype, device=device)
    rows_t = torch.zeros(1, dtype=torch.int64, device=device)
    flops = extend_flops([0], [new], heads, dim)
    rows = []
    for block_m, block_n, warps, stages in tiles:
        cfg = ExtendConfig(block_m=block_m, block_n=block_n, num_warps=warps, num_stages=stages)
        plan = build_extend_plan(rows_t, [0], [new], [0], dim, dtype, cfg)
        try:
            ms = timer(lambda plan=plan: extend_attention(
                data.q, data.k, data.v, k_buf, v_buf, out, data.table, plan, data.layer.scaling))
        except Exception as e:  # e.g. out of shared memory for this tile: report, go on
            print(f"  {cfg}: failed: {type(e).__name__}: {e}", flush=True)
            rows.append({"kernel": "extend_tiles", "new": new, **dataclasses.asdict(cfg), "error": str(e)})
            continue
        tflops = flops / ms / 1e9
        rows.append({"kernel": "extend_tiles", "new": new, **dataclasses.asdict(cfg), "ms": ms,
                     "tflops": tflops, "pct_of_matmul": 100 * tflops / ceil["matmul_tflops"]})
        print(f"  block_m={block_m:3d} block_n={block_n:3d} warps={warps} stages={stages}  "
              f"{ms:8.3f} ms {tflops:7.1f} TFLOP/s ({100 * tflops / ceil['matmul_tflops']:5.1f}%)",
              flush=True)
    return rows


def extend_flops(prefix: list[int], new: list[int], heads: int, dim: int) -> float:
    pairs = sum(e * p + e * (e + 1) / 2 for p, e in zip(prefix, new, strict=True))
    return 4.0 * heads * dim * pairs


def bench_extend(timer: Callable, grid: list[tuple[int, int, int]], shape: tuple, ceil: dict,
                 device: torch.device) -> list[dict]:
    from radixserve.kernels.extend_attention import extend_attention

    from radixserve.attention import create_backend

    heads, kv, dim, page, dtype = shape
    rows = []
    for batch, new, prefix in grid:
        data = Batch([prefix] * batch, [new] * batch, heads, kv, dim, page, dtype, device)
        fwd, fb = data.run(create_backend("triton"))
        out = fwd()
        k_buf, v_buf = data.pool.get_kv(0)

        def kernel(fb=fb, out=out, k_buf=k_buf, v_buf=v_buf, data=data) -> None:
            extend_attention(data.q, data.k, data.v, k_buf, v_buf, out, fb.req_to_token,
                             fb.attn_metadata.extend, data.layer.scaling)

        flops = extend_flops(data.prefix, data.new, heads, dim)
        ms = timer(kernel)
        row: dict[str, Any] = {
            "kernel": "extend", "batch": batch, "new": new, "prefix": prefix, "ms": ms,
            "tflops": flops / ms / 1e9, "triton_forward_ms": timer(fwd),
        }
        row["pct_of_matmul"] = 100 * row["tflops"] / ceil["matmul_tflops"]
        torch_fwd, _ = data.run(create_backend("torch"))
        row["torch_ms"] = timer(torch_fwd)
        row["torch_tflops"] = flops / row["torch_ms"] / 1e9
        row["rel_err"] = rel_err(fwd(), torch_fwd())
        rows.append(row)
        print(f"extend  B={batch:3d} new={new:5d} prefix={prefix:5d}  {ms:8.3f} ms "
              f"{row['tflops']:7.1f} TFLOP/s ({row['pct_of_matmul']:5.1f}% of matmul)  "
              f"torch {row['torch_ms']:8.3f} ms  err {row['rel_err']:.1e}", flush=True)
        del data, fb, out
    return rows


def bench_store(timer: Callable, tokens: int, shape: tuple, device: torch.device) -> dict:
    from radixserve.kernels.kv_store import store_kv

    heads, kv, dim, page, dtype = shape
    data = Batch([0], [tokens], heads, kv, dim, page, dtype, device)
    k_buf, v_buf = data.pool.get_kv(0)
    ms = timer(lambda: store_kv(k_buf, v_buf, data.out_cache_loc, data.k, data.v))
    moved = 2 * 2 * data.k.numel() * data.k.element_size()  # read + write, K and V
    ref_ms = timer(lambda: data.pool.set_kv(0, data.out_cache_loc, data.k, data.v))
    print(f"store   T={tokens:6d}  {ms:8.3f} ms {moved / ms / 1e6:8.1f} GB/s  "
          f"(torch index_put {ref_ms:8.3f} ms)", flush=True)
    return {"kernel": "store_kv", "tokens": tokens, "ms": ms, "gbps": moved / ms / 1e6,
            "torch_ms": ref_ms}


# ---------------------------------------------------------------------------- main


def main() -> int:
    args = parse_args()
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not args.interpret_smoke:
        print("bench/kernels.py needs a CUDA GPU: it times compiled Triton kernels. "
              "On a CPU, `--interpret-smoke` runs tiny shapes under the Triton interpreter "
              "to check that the script works (its timings mean nothing).", file=sys.stderr)
        return 2
    if args.interpret_smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before anything imports triton
    elif os.environ.get("TRITON_INTERPRET", "0") == "1":
        print("bench/kernels.py times compiled kernels: unset TRITON_INTERPRET", file=sys.stderr)
        return 2
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import triton

    from bench.common import write_report

    device = torch.device("cuda" if on_gpu and not args.interpret_smoke else "cpu")
    smoke = args.interpret_smoke
    timer = make_timer(device.type == "cuda")
    if smoke:
        shape = (4, 2, 16, 4, torch.float32)
        decode_grid, extend_grid, store_tokens = [(2, 40)], [(2, 20, 10)], 8
    else:
        shape = (HEADS, KV_HEADS, HEAD_DIM, PAGE, torch.bfloat16)
        decode_grid = QUICK_DECODE if args.quick else DECODE_GRID
        extend_grid = QUICK_EXTEND if args.quick else EXTEND_GRID
        store_tokens = 4096
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu-interpreter"
    print(f"device: {name}  torch {torch.__version__}  triton {triton.__version__}", flush=True)
    ceil = device_ceilings(timer, device, smoke)
    print(f"copy {ceil['copy_gbps']:.1f} GB/s   bf16 matmul {ceil['matmul_tflops']:.1f} TFLOP/s",
          flush=True)

    # Target points (the on a GPU; tiny ones in the smoke run).
    dec_b, dec_c, dec_frac = (2, 40, 0.0) if smoke else TARGET_DECODE
    ext_new, ext_frac = (20, 0.0) if smoke else TARGET_EXTEND
    targets: dict[str, Any] = {}

    results = bench_decode(timer, decode_grid, shape, ceil, device)
    print(f"decode num_splits sweep at B={dec_b} ctx={dec_c} (backend forward):", flush=True)
    few = 2 if smoke else None  # the smoke run only checks that each sweep runs
    results += bench_splits(timer, dec_b, dec_c, shape, ceil, device, SPLIT_SWEEP[:few])
    print(f"decode tile sweep at B={dec_b} ctx={dec_c} (kernel only):", flush=True)
    results += bench_decode_tiles(timer, dec_b, dec_c, shape, ceil, device, DECODE_TILES[:few])
    hit = [r for r in results if r["kernel"] == "decode" and (r["batch"], r["ctx"]) == (dec_b, dec_c)]
    if hit and not smoke:
        targets["decode_b64_ctx4096_pct_of_copy"] = hit[0]["pct_of_copy"]
        targets["decode_target_met"] = hit[0]["pct_of_copy"] >= 100 * dec_frac

    print("decode over a shared prefix, plain kernel against the cascade (backend forward):", flush=True)
    for b, sh, own in CASCADE_SMOKE if smoke else CASCADE_GRID[1:3] if args.quick else CASCADE_GRID:
        results.append(bench_cascade(timer, b, sh, own, shape, device))

    results += bench_extend(timer, extend_grid, shape, ceil, device)
    print(f"extend tile sweep at {ext_new} new tokens (kernel only):", flush=True)
    results += bench_extend_tiles(timer, ext_new, shape, ceil, device, EXTEND_TILES[:few])
    hit = [r for r in results
           if r["kernel"] == "extend" and (r["batch"], r["new"], r["prefix"]) == (1, ext_new, 0)]
    if hit and not smoke:
        targets["extend_4096_pct_of_matmul"] = hit[0]["pct_of_matmul"]
        targets["extend_target_met"] = hit[0]["pct_of_matmul"] >= 100 * ext_frac
    results.append(bench_store(timer, store_tokens, shape, device))
    for key, value in targets.items():
        print(f"target {key}: {value}")

    heads, kv, dim, page, dtype = shape
    report = {
        "mode": "interpret-smoke" if smoke else "gpu",
        "device": name,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "shape": {"heads": heads, "kv_heads": kv, "head_dim": dim, "page_size": page,
                  "dtype": str(dtype).removeprefix("torch.")},
        **ceil,
        "targets": targets,
        "results": results,
    }
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-")
    out = Path(args.out) if args.out else REPO / "bench" / "results" / f"kernels-{slug}.json"
    write_report(report, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
