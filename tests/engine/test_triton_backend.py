"""The scheduler with the Triton backend decodes the same greedy tokens as with the torch one.

On a CPU the kernels run in Triton's interpreter, so prompts are short and few tokens are
generated; the batches still mix prefills, cache hits (extend over a cached prefix), chunked
prefill and decodes.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from helpers.sched_driver import make_scheduler, run_until_idle, submit

from radixserve.attention import available_backends, create_backend
from radixserve.config import ServerArgs
from radixserve.model.loader import load_model
from radixserve.scheduler.scheduler import Scheduler

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def scheduler(folder: str, **settings: Any) -> Scheduler:
    if DEVICE == "cpu":
        return make_scheduler(folder, **settings)
    # Same as make_scheduler, on the GPU (float32 both ways, so greedy tokens must agree).
    args = ServerArgs.from_kwargs(model=folder, device=DEVICE, dtype="float32", **settings).resolve()
    loaded = load_model(folder, torch.float32, DEVICE)
    return Scheduler(args, loaded.model, loaded.config, None)


def generate(folder: str, backend: str, prompts: list[list[int]], late: list[int], max_new: int,
             **settings: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """Greedy outputs of ``prompts`` (submitted at once) and ``late`` (submitted after the
    second step, while the others decode)."""
    sched = scheduler(folder, attention_backend=backend, max_total_tokens=1024, **settings)
    assert sched.runner.backend.name == backend
    rids = [submit(sched, p, max_new_tokens=max_new, ignore_eos=True) for p in prompts]

    def submit_late(step: int, s: Scheduler) -> None:
        if step == 1:
            rids.append(submit(s, late, max_new_tokens=max_new, ignore_eos=True))

    results = run_until_idle(sched, on_step=submit_late)
    return [results[r]["output_ids"] for r in rids], sched.get_stats()


def test_registered_and_lazy() -> None:
    assert "triton" in available_backends()
    assert create_backend("triton").name == "triton"


@pytest.mark.parametrize(
    "arch, page_size",
    [("llama", 1), ("qwen3-hd128", 16), ("mistral-mha", 4)],  # GQA 2 / 4 / 1; head dim 16 / 128 / 16
)
def test_same_greedy_tokens_as_torch(tiny_model_dir, arch: str, page_size: int) -> None:
    folder = tiny_model_dir(arch)
    rng = random.Random(page_size)
    shared = [rng.randrange(6, 256) for _ in range(20)]
    prompts = [shared + [rng.randrange(6, 256) for _ in range(3)],
               [rng.randrange(6, 256) for _ in range(7)]]
    late = shared + [rng.randrange(6, 256) for _ in range(5)]  # extends the first one's prefix
    # Chunks of 16 tokens: the first prompt takes two steps, its first chunk enters the cache.
    settings = dict(page_size=page_size, chunked_prefill_size=16)
    want, _ = generate(folder, "torch", prompts, late, 5, **settings)
    got, stats = generate(folder, "triton", prompts, late, 5, **settings)
    assert got == want
    assert stats["mixed_steps"] > 0  # the late prompt's prefill ran beside decodes
    assert stats["cached_tokens"] >= 16 // page_size * page_size  # ... over a cached prefix
