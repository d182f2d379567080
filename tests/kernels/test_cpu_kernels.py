"""The C++ CPU kernels (radixserve/cpu_ext): fused elementwise ops against the torch code they
replace, and whole tiny models with the kernels against the same models without them."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from helpers.model_runner import ModelRunner, _Request
from helpers.tiny_models import TINY_MODELS

from radixserve import cpu_ext
from radixserve.model.loader import load_model

OPS = cpu_ext.load()


def test_the_kernels_build_here() -> None:
    assert OPS is not None, "the C++ kernels did not build (is a C++ compiler installed?)"


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_start() -> None:
    """torch's build lock is a plain file; a build killed mid-way leaves it, and torch waits
    for it forever.  The next load removes it (it holds the OS lock every builder takes).
    A server that the other pytest worker starts meanwhile loads the kernels too and may be the
    one that finds the file and removes it: then the load here is tried again."""
    stale = cpu_ext.build_dir() / "lock"
    code = "from radixserve import cpu_ext; assert cpu_ext.load() is not None"
    for _ in range(5):
        stale.touch()
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=300)
        assert done.returncode == 0, done.stderr
        assert not stale.exists()
        if "removing the lock of an interrupted build" in done.stderr:
            break
    assert "removing the lock of an interrupted build" in done.stderr


def test_the_build_runs_the_ninja_package_whatever_path_finds_first(tmp_path) -> None:
    """A system ninja of another version cannot read the build log the package's ninja wrote
    (nor the other way round), and would rebuild the folder.  With another ``ninja`` first on
    PATH, a start still loads the built kernels, without rebuilding, and never runs that one."""
    fake = tmp_path / "bin" / "ninja"
    fake.parent.mkdir()
    fake.write_text(f"#!/bin/sh\ntouch {tmp_path / 'ran'}\nexit 1\n")
    fake.chmod(0o755)
    built = {p: p.stat().st_mtime_ns for p in cpu_ext.build_dir().glob("*.[os]*")}
    env = {**os.environ, "PATH": f"{fake.parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    code = "from radixserve import cpu_ext; assert cpu_ext.load() is not None"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert done.returncode == 0, done.stderr
    assert not (tmp_path / "ran").exists()
    assert {p: p.stat().st_mtime_ns for p in built} == built


def _rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _close(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> None:
    tol = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_rms_norm_and_residual_add(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    x = torch.randn((37, 96), generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(96, generator=gen)).to(dtype)
    _close(OPS.rms_norm(x, w, 1e-5), _rms_ref(x, w, 1e-5), dtype)
    delta = torch.randn((37, 96), generator=gen).to(dtype)
    residual = x.clone()
    out = OPS.add_rms_norm(residual, delta, w, 1e-6)
    assert torch.equal(residual, x + delta)  # updated in place, rounded as torch rounds
    _close(out, _rms_ref(x + delta, w, 1e-6), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rotary_in_place_on_a_strided_view(dtype: torch.dtype) -> None:
    """Rotates q inside the fused q/k/v output (rows strided), leaving k/v columns alone."""
    gen = torch.Generator().manual_seed(1)
    heads, kv, dim, tokens = 4, 2, 32, 11
    qkv = torch.randn((tokens, (heads + 2 * kv) * dim), generator=gen).to(dtype)
    before = qkv.clone()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    angles = torch.rand((tokens, dim // 2), generator=gen) * 6
    emb = torch.cat((angles, angles), dim=-1)
    cos, sin = emb.cos().to(dtype), emb.sin().to(dtype)
    half = dim // 2
    ref = q.float() * cos[:, None].float() + torch.cat(
        (-q[..., half:], q[..., :half]), dim=-1).float() * sin[:, None].float()
    OPS.rotary_(q, cos, sin)
    _close(q, ref, dtype)
    assert torch.equal(qkv[:, heads * dim:], before[:, heads * dim:])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    gate_up = (3 * torch.randn((9, 2 * 80), generator=gen)).to(dtype)
    gate, up = gate_up.split(80, dim=-1)
    _close(OPS.silu_mul(gate_up), F.silu(gate) * up, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens", [1, 300])
def test_store_kv_writes_the_rows_at_their_slots(dtype: torch.dtype, tokens: int) -> None:
    """A decode step's row and a prompt's rows (shared out over the threads), from the strided
    k/v views of a fused q/k/v output; every other slot keeps its bytes."""
    gen = torch.Generator().manual_seed(3)
    heads, kv, dim, num_slots = 6, 2, 16, 512
    qkv = torch.randn((tokens, (heads + 2 * kv) * dim), generator=gen).to(dtype)
    k = qkv[:, heads * dim:(heads + kv) * dim].view(tokens, kv, dim)
    v = qkv[:, (heads + kv) * dim:].view(tokens, kv, dim)
    k_pool = torch.randn((num_slots, kv, dim), generator=gen).to(dtype)
    v_pool = torch.randn((num_slots, kv, dim), generator=gen).to(dtype)
    want_k, want_v = k_pool.clone(), v_pool.clone()
    slots = torch.randperm(num_slots, generator=gen)[:tokens]
    want_k[slots], want_v[slots] = k, v
    OPS.store_kv(k, v, k_pool, v_pool, slots)
    assert torch.equal(k_pool, want_k) and torch.equal(v_pool, want_v)
    with pytest.raises(RuntimeError, match="outside the pool"):
        OPS.store_kv(k, v, k_pool, v_pool, torch.full((tokens,), num_slots))
    with pytest.raises(RuntimeError, match="share a dtype"):
        OPS.store_kv(k, v, k_pool.to(torch.float64), v_pool.to(torch.float64), slots)


def test_bad_shapes_are_clear_errors() -> None:
    with pytest.raises(RuntimeError, match="weight must be"):
        OPS.rms_norm(torch.ones(3, 8), torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="silu_mul"):
        OPS.silu_mul(torch.ones(3, 7))


PROMPTS = [[1, 17, 33, 80, 4, 99, 23, 6, 7, 200, 3], [1, 50, 60], list(range(6, 70))]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_model_with_and_without_the_kernels(name: str, dtype: torch.dtype,
                                            tiny_model_dir: Callable[[str], str],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """Logits of a batched prefill and of two decode steps: the kernels (paged attention and
    fused ops) against the pure-torch model (gather attention, unfused ops)."""
    model = load_model(tiny_model_dir(name), dtype).model

    def run() -> torch.Tensor:
        runner = ModelRunner(model, scatter=True, seed=3)
        reqs = [_Request(tokens=[*p, 7, 8, 9], row=runner.free_rows.pop(), join_step=0)
                for p in PROMPTS]
        logits = [runner.forward(reqs, [len(p) for p in PROMPTS])]
        logits += [runner.forward(reqs, [1] * len(reqs)) for _ in range(3)]
        return torch.cat(logits)

    with_kernels = run()
    monkeypatch.setattr(cpu_ext, "load", lambda: None)
    without = run()
    if dtype == torch.float32:
        torch.testing.assert_close(with_kernels, without, rtol=1e-4, atol=1e-4)
    else:  # bfloat16 roundings differ (fused ops round once): a few ulps, never a wrong row
        diff = (with_kernels - without).abs()
        scale = without.abs().mean()
        assert diff.mean() < 0.02 * scale and diff.max() < 0.25 * scale, (diff.max(), diff.mean(), scale)


def test_kernels_can_be_switched_off() -> None:
    code = ("from radixserve import cpu_ext; from radixserve.attention import create_backend; "
            "assert cpu_ext.load() is None; assert not create_backend('torch').uses_kernel")
    env = {**os.environ, "RADIXSERVE_CPU_KERNELS": "0"}
    subprocess.run([sys.executable, "-c", code], env=env, check=True, timeout=120)


@pytest.mark.parametrize("flags, feature", [
    ("fpu avx512f avx512_bf16 amx_bf16 amx_tile", "AMX"),
    ("fpu avx512f avx512_bf16", "AVX-512 BF16"),
    ("fpu avx2 avx512f", None),
])
def test_dtype_auto_follows_the_cpu(tmp_path, monkeypatch: pytest.MonkeyPatch, flags: str,
                                    feature: str | None) -> None:
    import radixserve.config as config

    info = tmp_path / "cpuinfo"
    info.write_text(f"processor\t: 0\nflags\t\t: {flags}\n")
    assert config.cpu_bf16_feature(str(info)) == feature
    monkeypatch.setattr(config, "cpu_bf16_feature", lambda: feature)
    resolved = config.ServerArgs(device="cpu").resolve()
    assert resolved.dtype == ("bfloat16" if feature else "float32")
    assert config.ServerArgs(device="cpu", dtype="float32").resolve().dtype == "float32"
