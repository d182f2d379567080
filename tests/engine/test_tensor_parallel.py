"""Tensor parallelism (``tp_size``): the split, the step message, and greedy parity of TP=2 with
TP=1 through real processes over gloo — prefill, chunked prefill, cache hits, retraction,
prompt logprobs — plus what happens when a rank dies."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import time

import numpy as np
import orjson
import psutil
import pytest
from helpers.server import ServerProcess

from radixserve import Engine
from radixserve.config import ServerArgs
from radixserve.distributed.group import TensorParallel, split_range
from radixserve.distributed.step_message import StepBatch, pack_rows

GREEDY = {"temperature": 0, "ignore_eos": True}


# --- the split -------------------------------------------------------------------------------

@pytest.mark.parametrize("n,parts", [(1, 1), (7, 2), (9, 3), (49152, 2), (10, 4), (5, 5)])
def test_split_range_tiles_evenly(n: int, parts: int) -> None:
    ranges = [split_range(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:], strict=False))  # contiguous, no overlap
    sizes = [b - a for a, b in ranges]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@pytest.mark.parametrize("heads,kv,size", [(9, 3, 2), (9, 3, 3), (4, 2, 2), (4, 1, 2), (4, 1, 4),
                                           (8, 2, 4), (32, 8, 4), (6, 6, 4)])
def test_head_ranges_cover_every_query_head_with_its_kv_head(heads: int, kv: int, size: int) -> None:
    group = heads // kv
    seen: list[int] = []
    for rank in range(size):
        (qs, qe), (ks, ke) = TensorParallel(rank, size).head_ranges(heads, kv)
        assert qe > qs and ke > ks
        # The local GQA layout must be the global one: local query head i reads local KV head
        # i // local_group, which must be global KV head (qs + i) // group.
        local_group = (qe - qs) // (ke - ks)
        assert (qe - qs) == local_group * (ke - ks)
        for i in range(qe - qs):
            assert ks + i // local_group == (qs + i) // group
        seen.extend(range(qs, qe))
    assert seen == list(range(heads))


def test_head_ranges_refuses_a_split_that_cannot_keep_gqa() -> None:
    with pytest.raises(ValueError, match="cannot be split over 4 tensor-parallel ranks"):
        TensorParallel(0, 4).head_ranges(6, 2)  # each KV head's 3 query heads over 2 ranks


def test_settings_refuse_what_tensor_parallelism_does_not_do() -> None:
    with pytest.raises(ValueError, match="tp_size must be a positive integer"):
        ServerArgs(tp_size=0)
    for tiers in ({"host_cache_size": 1000}, {"disk_cache_dir": "/tmp/x"}, {"preemption_mode": "swap"}):
        with pytest.raises(ValueError, match="not available with tp_size > 1"):
            ServerArgs(tp_size=2, **tiers)


def test_step_message_round_trip_rebuilds_the_rows() -> None:
    table = np.arange(4 * 10, dtype=np.int32).reshape(4, 10) + 100
    rows, prefix, extend = [2, 0], [3, 5], [2, 1]
    seq = [p + e for p, e in zip(prefix, extend, strict=True)]
    batch = StepBatch(
        input_ids=np.array([7, 8, 9], dtype=np.int64),
        prefix_lens=np.array(prefix, dtype=np.int64),
        extend_lens=np.array(extend, dtype=np.int64),
        out_cache_loc=np.array([123, 124, 105], dtype=np.int64),
        slots=pack_rows(table, rows, seq),
        extra_logits=np.zeros(0, dtype=np.int64),
    )
    back = StepBatch.decode(batch.encode())
    compact = back.table()
    assert compact.shape == (2, 6)
    assert compact[0, :5].tolist() == table[2, :5].tolist() and compact[0, 5] == 0
    assert compact[1].tolist() == table[0, :6].tolist()
    assert back.input_ids.tolist() == [7, 8, 9] and back.out_cache_loc.tolist() == [123, 124, 105]
    frames = batch.encode()
    lengths = orjson.loads(frames[1])
    with pytest.raises(ValueError, match="header says"):
        StepBatch.decode([*frames[:6], frames[6][:-4], frames[7]])
    lengths[4] -= 1  # one slot short of the sequences, consistently with the header
    with pytest.raises(ValueError, match="slots do not cover"):
        StepBatch.decode([frames[0], orjson.dumps(lengths), *frames[2:6], frames[6][:-4], frames[7]])


# --- parity through real processes ----------------------------------------------------------

def with_tokenizer(folder: str, default_model_path: str) -> str:
    """A tiny checkpoint folder the Engine can serve: it needs a tokenizer next to the weights."""
    for name in os.listdir(default_model_path):
        if name.startswith(("tokenizer", "special_tokens", "vocab", "merges")):
            shutil.copy(os.path.join(default_model_path, name), folder)
    return folder


def run(folder: str, tp: int, prompts: list[list[int]], params: list[dict], first: int = 0,
        logprob_start_len: int = -1, **settings: object) -> tuple[list, dict]:
    """Generate ``prompts[:first]`` then the rest, in two batches, with logprobs (of the prompt
    from ``logprob_start_len``: 0 computes every prompt token, cached or not)."""
    with Engine(folder, dtype="float32", tp_size=tp, **settings) as eng:
        out = []
        for part in (slice(0, first), slice(first, None)):
            if prompts[part]:
                out += eng.generate(input_ids=prompts[part], sampling_params=params[part], progress=False,
                                    return_logprob=True, logprob_start_len=logprob_start_len)
        stats = eng.get_stats()
        report = eng.check_memory()
        assert report["ok"] and report["locked_tokens"] == 0 and report["request_pages"] == 0, report
    return out, stats


def workload(seed: int, vocab: int = 256) -> tuple[list[list[int]], list[dict]]:
    """Three requests share a 40-token prefix (the first runs alone: the others hit it), one
    prompt is 90 tokens (chunked at 16), every request decodes 24 tokens."""
    rng = np.random.default_rng(seed)
    shared = rng.integers(6, vocab, 40).tolist()
    prompts = [shared + rng.integers(6, vocab, 5 + i).tolist() for i in range(3)]
    prompts.append(rng.integers(6, vocab, 90).tolist())
    return prompts, [{**GREEDY, "max_new_tokens": 24}] * len(prompts)


def assert_same(a: list[dict], b: list[dict]) -> None:
    """Same tokens; logprobs (output, and prompt where asked) equal to float32 rounding."""
    assert [x["output_ids"] for x in a] == [x["output_ids"] for x in b]
    for x, y in zip(a, b, strict=True):
        for key in ("input_token_logprobs", "output_token_logprobs"):
            lx = [e[0] for e in x["meta_info"][key] if e[0] is not None]
            ly = [e[0] for e in y["meta_info"][key] if e[0] is not None]
            assert len(lx) == len(ly) > 0
            np.testing.assert_allclose(lx, ly, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name,collectives", [
    pytest.param("llama", "shm", marks=pytest.mark.slow), ("llama", "gloo"), ("qwen3-hd128", "shm"),
    ("qwen2", "shm")])
def test_tp2_greedy_equals_tp1_with_hits_and_chunks(name: str, collectives: str, tiny_model_dir,
                                                     default_model_path, monkeypatch) -> None:
    """llama: 2 KV heads, one per rank; qwen3-hd128: 1 KV head, replicated (q/k norm); qwen2:
    q/k/v biases and tied embeddings (the LM head is the vocab-split embedding).  ``gloo``: every
    collective through torch.distributed's gloo instead of the shared-memory file."""
    monkeypatch.setenv("RADIXSERVE_TP_SHM", "1" if collectives == "shm" else "0")
    folder = with_tokenizer(tiny_model_dir(name), default_model_path)
    prompts, params = workload(1)
    settings = {"max_total_tokens": 2048, "chunked_prefill_size": 16}
    one, s1 = run(folder, 1, prompts, params, first=1, **settings)
    two, s2 = run(folder, 2, prompts, params, first=1, **settings)
    assert_same(one, two)
    assert s2["cached_tokens"] == s1["cached_tokens"] >= 2 * 40  # the shared prefix was hit
    assert s2["prefill_tokens_computed"] == s1["prefill_tokens_computed"]
    # The 90-token prompt took 6 chunks of 16, beside running decodes (how the steps fall
    # depends on when requests arrive, so only that they happened is checked).
    assert s1["mixed_steps"] > 0 and s2["mixed_steps"] > 0


def test_tp2_greedy_equals_tp1_under_retraction(tiny_model_dir, default_model_path) -> None:
    folder = with_tokenizer(tiny_model_dir("llama"), default_model_path)
    rng = np.random.default_rng(5)
    prompts = [rng.integers(6, 256, 30).tolist() for _ in range(6)]
    params = [{**GREEDY, "max_new_tokens": 60}] * 6
    settings = {"max_total_tokens": 260, "max_running_requests": 8}
    one, s1 = run(folder, 1, prompts, params, logprob_start_len=0, **settings)
    two, s2 = run(folder, 2, prompts, params, logprob_start_len=0, **settings)
    assert all(len(x["meta_info"]["input_token_logprobs"]) == 30 for x in one)  # the extra rows
    assert s1["retractions"] > 0 and s2["retractions"] > 0  # the pool was too small for all six
    assert_same(one, two)


def test_default_model_tp2_equals_tp1(default_model_path) -> None:
    """SmolLM2: 9 query heads on 3 KV heads split 6+3 (2 KV heads on rank 0, 1 on rank 1)."""
    prompts = ["The capital of France is", "Write a haiku about the sea:", "def fib(n):"]
    outs = []
    for tp in (1, 2):
        with Engine(dtype="float32", tp_size=tp, max_total_tokens=4096) as eng:
            outs.append(eng.generate(prompts, sampling_params={**GREEDY, "max_new_tokens": 24},
                                     progress=False))
    assert [x["output_ids"] for x in outs[0]] == [x["output_ids"] for x in outs[1]]
    assert [x["text"] for x in outs[0]] == [x["text"] for x in outs[1]]


# --- a rank dies ------------------------------------------------------------------------------

def test_killing_a_rank_mid_request_fails_it_and_stops_the_engine(tiny_model_dir, default_model_path) -> None:
    folder = with_tokenizer(tiny_model_dir("llama"), default_model_path)
    eng = Engine(folder, dtype="float32", tp_size=2, max_total_tokens=4096)
    try:
        rank = eng.procs.procs["tensor-parallel rank 1"]
        pids = [p.pid for p in eng.procs.procs.values()]
        stream = eng.generate(input_ids=[3] * 20, sampling_params={**GREEDY, "max_new_tokens": 400},
                              stream=True)
        next(stream)  # running
        os.kill(rank.pid, signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(Exception, match="tensor-parallel"):
            for _ in stream:
                pass
        assert time.monotonic() - t0 < 60  # answered, not hung (bound only; never a timing claim)
        deadline = time.monotonic() + 30
        while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
            assert time.monotonic() < deadline, "a process of the engine outlived its dead rank"
            time.sleep(0.2)
        with pytest.raises(Exception, match="down"):
            eng.generate(input_ids=[3] * 5, sampling_params={"max_new_tokens": 2})
    finally:
        eng.shutdown()


def test_killing_a_rank_stops_the_server_with_a_clear_line(tiny_chat_model: str) -> None:
    srv = ServerProcess("--model", tiny_chat_model, "--tp-size", "2").wait_ready()
    try:
        m = re.search(r"\[tp-rank-1\].*ready: rank 1 of 2 \(pid (\d+)\)", srv.log())
        assert m, srv.log()
        children = srv.children()
        os.kill(int(m.group(1)), signal.SIGKILL)
        code = srv.proc.wait(60)
        assert code != 0
        assert "tensor-parallel rank 1 process exited with code -9; the server stops" in srv.log()
        gone, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, alive
    finally:
        srv.stop()


def test_ranks_start_and_stop_together(tiny_model_dir, default_model_path) -> None:
    folder = with_tokenizer(tiny_model_dir("llama"), default_model_path)
    eng = Engine(folder, dtype="float32", tp_size=2, max_total_tokens=1024)
    procs = dict(eng.procs.procs)
    assert set(procs) == {"scheduler", "detokenizer", "tensor-parallel rank 1"}
    assert all(p.is_alive() for p in procs.values())
    out = eng.generate(input_ids=[4] * 8, sampling_params={**GREEDY, "max_new_tokens": 3})
    assert len(out["output_ids"]) == 3
    stopper = threading.Thread(target=eng.shutdown)
    stopper.start()
    stopper.join(30)
    assert not stopper.is_alive() and not any(p.is_alive() for p in procs.values())



# --- the collectives themselves ---------------------------------------------------------------

def _collectives_rank(rank: int, folder: str, queue: object) -> None:
    """One rank: the same all-reduces through shared memory and through gloo, and a gather."""
    import torch

    from radixserve.distributed.group import TensorParallel, init_group, leave_group

    tp = init_group(rank, 2, folder, "cpu")
    plain = TensorParallel(rank, 2)  # no shared memory: every call through gloo
    gen = torch.Generator().manual_seed(rank)
    out = {}
    for name, shape, dtype in (("f32", (3, 7), torch.float32), ("bf16", (5, 16), torch.bfloat16),
                               ("rows", (300, 576), torch.float32)):
        x = torch.randn(shape, generator=gen).to(dtype)
        out[name] = [t.float().numpy() for t in (x, tp.all_reduce(x.clone()), plain.all_reduce(x.clone()))]
    logits = torch.full((2, 5 if rank == 0 else 4), float(rank + 1))  # 9 = 5 + 4 vocabulary rows
    out["gather"] = [None if g is None else g.numpy() for g in (tp.gather_vocab(logits, 9),
                                                                plain.gather_vocab(logits, 9))]
    queue.put((rank, out))  # numpy: the queue must not hand over this process's shared tensors
    leave_group()


def test_shared_memory_and_gloo_collectives_agree(tmp_path) -> None:
    import multiprocessing as mp

    import torch

    from radixserve.distributed import shm

    assert shm.usable("cpu")  # this suite runs on x86: the shared-memory path is the one tested
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_collectives_rank, args=(r, str(tmp_path), queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    for name in ("f32", "bf16", "rows"):
        x0, x1 = got[0][name][0], got[1][name][0]
        dtype = torch.bfloat16 if name == "bf16" else torch.float32
        expected = torch.from_numpy(x0 + x1).to(dtype).float().numpy()  # one rounding of the sum
        for rank in (0, 1):
            via_shm, via_gloo = got[rank][name][1], got[rank][name][2]
            np.testing.assert_array_equal(via_shm, expected, err_msg=f"{name} rank {rank}")
            np.testing.assert_allclose(via_gloo, expected, rtol=1e-2 if name == "bf16" else 1e-6)
    for gathered in got[0]["gather"]:
        assert gathered.shape == (2, 9)
        assert (gathered[:, :5] == 1).all() and (gathered[:, 5:] == 2).all()
    assert got[1]["gather"] == [None, None]
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(tmp_path.name)]  # removed at start
