"""The GPU step loop, checked on the CPU: device tables that refuse every read-back.

Under ``DeviceGuard`` (tests/helpers/device_guard.py) the scheduler runs with ``device="meta"``:
the request table's device copy, the KV pool and every per-step index live on a stand-in device
whose tensors fail on ``.numpy()``, ``.tolist()``, ``.item()``, boolean indexing or any copy to the
host outside ``transfer.read_back``, while the model computes on their CPU data.  A GPU-only
crash (a read-back of a device table) fails here, and the outputs must equal a plain CPU run's.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers.device_guard import DeviceGuard, DeviceReadback
from helpers.sched_driver import make_scheduler, run_until_idle, submit

from radixserve.attention import create_backend
from radixserve.batch import ForwardBatch
from radixserve.cache.kv_pool import KVPool
from radixserve.config import ServerArgs
from radixserve.model.loader import load_model
from radixserve.scheduler.scheduler import Scheduler
from radixserve.transfer import Upload, read_back, resolve


def guarded_scheduler(folder: str, guard_model: list, **settings) -> tuple[Scheduler, DeviceGuard]:
    """A scheduler whose device is the guard's stand-in; the model stays on the CPU."""
    loaded = load_model(folder, torch.float32)
    guard = DeviceGuard(loaded.model)
    guard_model.append(loaded.model)
    args = ServerArgs.from_kwargs(model=folder, device="meta", dtype="float32", attention_backend="torch",
                                  page_size=settings.pop("page_size", 1),
                                  chunked_prefill_size=settings.pop("chunked_prefill_size", 1024),
                                  cuda_graph_max_bs=0, **settings)
    # Device tensors are made in inference mode, where the step loop uses them (a wrapper made
    # outside it cannot be viewed inside it; a CUDA tensor can).
    with guard, torch.inference_mode():
        sched = Scheduler(args, loaded.model, loaded.config, None)
    return sched, guard


# ------------------------------------------------------------------------ the guard itself


def test_the_guard_refuses_what_a_gpu_step_must_not_do() -> None:
    with DeviceGuard() as guard:
        x = torch.arange(8, device="meta")  # a factory on the device: data on the CPU
        y = (x * 2 + 1).float()
        for read in (lambda: y.tolist(), lambda: y.sum().item(), lambda: int(x[3]), lambda: y.cpu(),
                     lambda: y[x > 3], lambda: x.nonzero(), lambda: bool(x.any()),
                     lambda: torch.repeat_interleave(x), lambda: torch.empty(8).copy_(y),
                     lambda: y + torch.ones(8), lambda: y.numpy(), lambda: np.asarray(y)):
            with pytest.raises(DeviceReadback):
                read()
        up = torch.from_numpy(np.arange(4)).to("meta")
        assert guard.counts() == (1, 0)
        host = read_back(y.index_select(0, up))
        assert guard.counts() == (1, 1)
    assert host.tolist() == [1.0, 3.0, 5.0, 7.0]


def test_an_upload_is_one_copy_and_resolves_placeholders() -> None:
    with DeviceGuard() as guard:
        upload = Upload("meta")
        staged = [upload.add(np.arange(5)), upload.add([1.5, 2.5], np.float32), upload.add([[1, 2], [3, 4]])]
        upload.send()
        a, b, c = resolve(staged)
        assert guard.counts() == (1, 0)
        assert (a.dtype, b.dtype, tuple(c.shape)) == (torch.int64, torch.float32, (2, 2))
        values = read_back(torch.cat([a.double(), b.double(), c.reshape(-1).double()]))
    assert values.tolist() == [0, 1, 2, 3, 4, 1.5, 2.5, 1, 2, 3, 4]


# ------------------------------------------------------------------------ the step loop


def workload(sched: Scheduler, rng: np.random.Generator, new_tokens: int) -> list[str]:
    """Shared prefixes (shared-prefix decode), long prompts chunked beside decodes (mixed
    steps), prompt logprobs, and sampling with every knob that uploads something."""
    system = rng.integers(3, 250, 96).tolist()
    rids = [submit(sched, system + rng.integers(3, 250, int(rng.integers(4, 20))).tolist(), max_new_tokens=new_tokens,
                   ignore_eos=True) for _ in range(5)]
    rids.append(submit(sched, rng.integers(3, 250, 150).tolist(), max_new_tokens=6, ignore_eos=True))
    rids.append(submit(sched, rng.integers(3, 250, 40).tolist(), {"return_logprob": True, "logprob_start_len": 0,
                                                                  "top_logprobs_num": 2},
                       max_new_tokens=5, ignore_eos=True))
    rids.append(submit(sched, system + [7, 8, 9], max_new_tokens=10, temperature=0.8, top_k=20, top_p=0.9,
                       min_p=0.05, repetition_penalty=1.2, frequency_penalty=0.3, presence_penalty=0.2,
                       logit_bias={"11": 5.0}, ignore_eos=True))
    return rids


@pytest.mark.parametrize(("settings", "new_tokens"), [
    ({"chunked_prefill_size": 32}, 12),
    ({"chunked_prefill_size": 32, "page_size": 4, "max_total_tokens": 260}, 60),  # retractions
], ids=["chunked", "paged-retracting"])
def test_the_step_loop_never_reads_the_device_and_matches_the_cpu(tiny_model_dir, settings, new_tokens) -> None:
    folder = tiny_model_dir("llama")
    keep: list = []
    sched, guard = guarded_scheduler(folder, keep, **dict(settings))
    assert not sched.req_pool.shared  # the device copy is separate: the packed sync is exercised
    with guard:
        rids = workload(sched, np.random.default_rng(0), new_tokens)
        got = run_until_idle(sched)
    ref = make_scheduler(folder, attention_backend="torch", **dict(settings))
    ref_rids = workload(ref, np.random.default_rng(0), new_tokens)
    want = run_until_idle(ref)
    for rid, ref_rid in zip(rids, ref_rids, strict=True):
        assert got[rid]["output_ids"] == want[ref_rid]["output_ids"], rid
        if want[ref_rid]["input"] is not None:
            np.testing.assert_allclose(got[rid]["input"][1:], want[ref_rid]["input"][1:], atol=1e-4)
    stats = sched.stats
    assert stats.mixed_steps > 0 and stats.cached_tokens > 0
    if "max_total_tokens" in settings:
        assert stats.retractions > 0


def test_uploads_and_reads_per_step_at_64_running_requests(tiny_model_dir) -> None:
    """Decode steps and mixed steps (a prompt chunked beside 64 decodes): at most two uploads
    (the batch, the sampling parameters) and one read-back (the sampled tokens) each."""
    folder = tiny_model_dir("llama")
    keep: list = []
    sched, guard = guarded_scheduler(folder, keep, chunked_prefill_size=48, max_running_requests=80,
                                     max_total_tokens=20000)
    rng = np.random.default_rng(1)
    per_step: list[tuple[str, int, int]] = []
    with guard:
        system = rng.integers(3, 250, 70).tolist()
        for i in range(64):
            prompt = (system if i % 2 else []) + rng.integers(3, 250, 12).tolist()
            submit(sched, prompt, max_new_tokens=40, ignore_eos=True, temperature=0.7 if i % 3 else 0.0)
        while len(sched.running) < 64:
            sched.step()
        late = None
        for step in range(12):
            if step == 4:
                late = submit(sched, rng.integers(3, 250, 150).tolist(), max_new_tokens=3, ignore_eos=True)
            before = guard.counts()
            mixed = sched.chunked is not None or any(r.rid == late for r in sched.waiting)
            sched.step()
            after = guard.counts()
            per_step.append(("mixed" if mixed else "decode", after[0] - before[0], after[1] - before[1]))
    kinds = {k for k, _, _ in per_step}
    assert kinds == {"decode", "mixed"}, per_step
    for kind, uploads, reads in per_step:
        assert uploads <= 2 and reads == 1, (kind, uploads, reads)


def test_triton_plan_reads_nothing_back(tiny_model_dir) -> None:
    """The Triton backend's plan and upload for a mixed batch, under the guard (its kernels
    need a GPU or the interpreter, which reads host memory, so only the plan runs here)."""
    loaded = load_model(tiny_model_dir("llama"), torch.float32)
    cfg = loaded.config
    with DeviceGuard(loaded.model) as guard, torch.inference_mode():
        pool = KVPool(512, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, torch.float32, "meta")
        host = np.zeros((4, 128), dtype=np.int32)
        host[0, :80] = np.arange(1, 81)
        host[1, :70] = np.arange(100, 170)
        host[2, :90] = np.arange(200, 290)
        table = torch.zeros((4, 128), dtype=torch.int32, device="meta")
        fb = ForwardBatch.build(
            input_ids=[5, 6, *range(10, 30)], prefix_lens=[79, 69, 70], extend_lens=[1, 1, 20],
            req_pool_indices=[0, 1, 2], out_cache_loc=np.r_[80, 169, np.arange(270, 290)],
            req_to_token=table, kv_pool=pool, attn_backend=create_backend("triton"), device="meta",
            table_host=host, table_updates=(np.arange(80), host[0, :80]),
        )
        before = guard.uploads
        fb.attn_backend.prepare(fb)
        assert guard.uploads - before == 1 and guard.reads == 0
        meta = fb.attn_metadata
        assert meta.decode is not None and meta.extend is not None
        assert read_back(meta.decode.table_rows).tolist() == [0, 1]
        assert read_back(table[0, :80]).tolist() == list(range(1, 81))  # the sync landed
