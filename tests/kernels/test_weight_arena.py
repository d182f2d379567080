"""A CPU model's weights in one huge-page block (model/weight_arena.py): every weight tensor a
view of it, the same values, tied weights still one tensor, and what held the old tensors (the
fused decode layers) multiplying the new ones."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers.sched_driver import run_until_idle, submit

from radixserve.config import ServerArgs
from radixserve.model import loader
from radixserve.model.fused_decode import FusedDecode
from radixserve.model.weight_arena import HUGE_PAGE, pack_weights
from radixserve.quantization import QuantizedWeight, weights_changes
from radixserve.scheduler.scheduler import Scheduler

PROMPTS = [list(range(10, 40)), list(range(100, 121))]


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and every tensor of a quantized weight, by name."""
    out = dict(model.named_parameters())
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, QuantizedWeight):
            out.update({f"{name}.weight.{k}": t for k, t in vars(weight).items() if isinstance(t, torch.Tensor)})
    return out


def _unpacked(folder: str, quantization: str, monkeypatch: pytest.MonkeyPatch) -> torch.nn.Module:
    with monkeypatch.context() as m:
        m.setattr(loader, "pack_weights", lambda model: 0)
        return loader.load_model(folder, torch.float32, quantization=quantization).model


@pytest.mark.parametrize("name, quantization", [("llama", "none"), ("llama", "int4"), ("qwen2", "int8"),
                                                ("llama-tied-llama3", "none")])
def test_weights_are_views_of_one_block_with_the_same_values(tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch,
                                                             name: str, quantization: str) -> None:
    folder = tiny_model_dir(name)
    packed = loader.load_model(folder, torch.float32, quantization=quantization).model
    plain = _unpacked(folder, quantization, monkeypatch)
    weights, reference = _weights(packed), _weights(plain)
    assert weights.keys() == reference.keys() and len(weights) > 10
    assert len({t.untyped_storage().data_ptr() for t in weights.values()}) == 1  # one block
    assert len({t.untyped_storage().data_ptr() for t in reference.values()}) > 1  # as loaded: many
    assert min(t.data_ptr() for t in weights.values()) % HUGE_PAGE == 0  # on a huge page's boundary
    assert all(t.data_ptr() % 64 == 0 for t in weights.values())
    for key, t in weights.items():
        assert t.dtype == reference[key].dtype and torch.equal(t, reference[key]), key
    head, table = packed.lm_head, packed.model.embed_tokens
    if head is not None and plain.lm_head.weight is plain.model.embed_tokens.weight:
        assert head.weight is table.weight  # a tied table stays one tensor


def _scheduler(model: torch.nn.Module, folder: str) -> Scheduler:
    args = ServerArgs.from_kwargs(model=folder, dtype="float32", device="cpu").resolve()
    loaded = loader.load_model(folder, torch.float32, "cpu", load_format="dummy")  # config only
    return Scheduler(args, model, loaded.config, None)


def _logits(sched: Scheduler, fused: Any) -> list[torch.Tensor]:
    model = sched.runner.model
    model.fused = fused
    logits: list[torch.Tensor] = []
    forward = model.forward
    model.forward = lambda fb: logits.append(forward(fb).clone()) or logits[-1]
    try:
        for p in PROMPTS:
            submit(sched, p, max_new_tokens=5, ignore_eos=True)
        run_until_idle(sched)
    finally:
        del model.forward
    return logits


class _Off:
    def run(self, *args: Any) -> None:
        return None


def test_fused_layers_built_before_packing_multiply_the_packed_weights(
        tiny_model_dir: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packed after a first forward: the fused decode layers (which hold the weights' tensors)
    rebuild, so a change to a packed weight reaches them."""
    folder = tiny_model_dir("llama")
    model = _unpacked(folder, "int4", monkeypatch)
    sched = _scheduler(model, folder)
    fused = FusedDecode(model)
    _logits(sched, fused)
    built = fused.version
    before = weights_changes()
    assert pack_weights(model) > 0 and weights_changes() == before + 1
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.d.mul_(2)  # in the block, after packing
    want = _logits(sched, _Off())
    got = _logits(sched, fused)
    assert fused.version != built
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


_FREED_BUFFER = """
import sys, torch
from radixserve.model.weight_arena import unmap_large_frees
if sys.argv[1] == "fixed":
    unmap_large_frees()
def rss():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
big = torch.ones(24 << 20, dtype=torch.uint8); del big  # freed: glibc's threshold grows to 24 MB
before = rss()
buffer = torch.ones(16 << 20, dtype=torch.uint8); del buffer  # a prefill's activations
print(rss() - before)
"""


@pytest.mark.parametrize("mode", ["fixed", "default"])
def test_a_freed_prefill_buffer_leaves_the_process(mode: str) -> None:
    """With the threshold fixed (as every CPU load sets it), a freed 16 MB buffer is unmapped;
    glibc's default, its threshold grown by an earlier large free, keeps it resident."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", _FREED_BUFFER, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    kept = int(done.stdout.split()[-1])
    assert kept < 2 << 20 if mode == "fixed" else kept >= 15 << 20, kept
