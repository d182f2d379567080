"""Decode graphs (executor/cuda_graph.py): static buffers, buckets, padding and the static
Triton decode plan.  On a CPU the runner replays by running the forward over the same static
buffers (the capture itself needs CUDA; bench/gpu_check.sh runs this file on a GPU, where it
captures for real)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.sched_driver import make_scheduler, run_until_idle, submit

from radixserve.config import ServerArgs
from radixserve.executor.cuda_graph import graph_buckets

ON_CUDA = torch.cuda.is_available()
# On a GPU machine the kernels are compiled and the graphs captured for real.
DEVICE = "cuda" if ON_CUDA else "cpu"


def test_buckets() -> None:
    assert graph_buckets(1) == [1]
    assert graph_buckets(12) == [1, 2, 4, 8, 12]
    assert graph_buckets(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert graph_buckets(100)[-3:] == [80, 96, 100]
    assert graph_buckets(256)[-1] == 256 and len(graph_buckets(256)) == 23


def test_settings() -> None:
    cpu = ServerArgs(device="cpu").resolve()
    assert cpu.cuda_graph_max_bs == 0  # CUDA graphs exist only on CUDA
    with pytest.raises(ValueError, match="cuda_graph_max_bs"):
        ServerArgs(cuda_graph_max_bs=-1)
    if ON_CUDA:
        assert ServerArgs(device="cuda").resolve().cuda_graph_max_bs == 256
        assert ServerArgs(device="cuda", disable_cuda_graph=True).resolve().cuda_graph_max_bs == 0
        assert ServerArgs(device="cuda", cuda_graph_max_bs=32).resolve().cuda_graph_max_bs == 32


def run(folder: str, graphs: bool, prompts: list[list[int]], **settings) -> tuple[dict, object]:
    sched = make_scheduler(folder, attention_backend="triton", page_size=4, max_total_tokens=2048,
                           device=DEVICE, cuda_graph_max_bs=0, **settings)
    # A CPU pool starts as the OS maps it (slots are written before they are read); zeroed here
    # so that comparing two pools finds any slot a padded row wrote besides slot 0.
    for buf in sched.runner.kv_pool.k_buffers + sched.runner.kv_pool.v_buffers:
        buf.zero_()
    if graphs:
        sched.runner.use_decode_graphs(8, sched.context_len)
    rids = [submit(sched, p, max_new_tokens=3 + 2 * i, ignore_eos=True) for i, p in enumerate(prompts)]
    out = run_until_idle(sched)
    return {i: out[rid]["output_ids"] for i, rid in enumerate(rids)}, sched


def test_graph_decode_equals_eager_decode_and_padding_writes_only_slot_0(tiny_model_dir) -> None:
    """Five requests finishing one by one: batches of 5, 4, 3, 2, 1 replay the buckets 8, 4,
    4, 2, 1 with padded rows.  Outputs equal the eager run's, and the KV pools agree everywhere
    but the padding slot (padded rows write their K/V only there)."""
    folder = tiny_model_dir("llama")
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 250, int(n)).tolist() for n in (9, 21, 5, 30, 14)]
    eager, ref = run(folder, False, prompts)
    graph, sched = run(folder, True, prompts)
    assert graph == eager
    graphs = sched.runner.graphs
    assert graphs is not None and graphs.replays >= 9  # every decode step but the mixed ones
    pool, ref_pool = sched.runner.kv_pool, ref.runner.kv_pool
    for layer in range(pool.num_layers):
        for got, want in zip(pool.get_kv(layer), ref_pool.get_kv(layer), strict=True):
            torch.testing.assert_close(got[1:], want[1:], rtol=0, atol=1e-5)


def test_what_runs_eagerly(tiny_model_dir) -> None:
    """Prefill and mixed batches, and batches asking for prompt-logprob rows, do not replay."""
    folder = tiny_model_dir("llama")
    sched = make_scheduler(folder, attention_backend="triton", max_total_tokens=1024, device=DEVICE,
                           cuda_graph_max_bs=0)
    sched.runner.use_decode_graphs(2, sched.context_len)
    graphs = sched.runner.graphs
    submit(sched, list(range(3, 20)), max_new_tokens=2, ignore_eos=True)
    sched.step()  # prefill
    assert graphs.replays == 0
    sched.step()  # decode of one
    assert graphs.replays == 1
    run_until_idle(sched)
    submit(sched, list(range(3, 12)), {"return_logprob": True, "logprob_start_len": 0}, max_new_tokens=1)
    run_until_idle(sched)
    assert graphs.replays == 1
