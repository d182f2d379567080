"""LoRA adapters in the scheduler: output equal to transformers + peft, mixed batches, the slot
pool, the adapter as part of the cache namespace, loading and unloading while requests run."""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Callable

import pytest
import torch
from helpers.lora_adapters import peft_greedy, write_adapter
from helpers.sched_driver import make_scheduler, random_prompts, run_until_idle, submit
from safetensors.torch import load_file, save_file

from radixserve.cache.tree_view import summary_rows
from radixserve.lora import batch as lora_batch

N = 8
PROMPTS = random_prompts(3, 5, 40, seed=3)
SMALL = ("q_proj", "v_proj", "down_proj")


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Callable[[str], str], tmp_path_factory: pytest.TempPathFactory):
    """Per tiny model: ``{name: folder}`` of three adapters (all projections rank 8; three
    projections rank 4 with rsLoRA; per-module ranks) and their peft greedy outputs."""
    cache: dict[str, tuple[dict[str, str], dict[str | None, list[list[int]]]]] = {}

    def get(model: str):
        if model not in cache:
            folder = tiny_model_dir(model)
            root = tmp_path_factory.mktemp(f"lora-{model}")
            paths = {
                "a": write_adapter(folder, str(root / "a"), r=8, alpha=16, seed=1),
                "b": write_adapter(folder, str(root / "b"), r=4, alpha=8, targets=SMALL,
                                   use_rslora=True, seed=2),
                "c": write_adapter(folder, str(root / "c"), r=4, alpha=4, seed=3,
                                   rank_pattern={"o_proj": 2, "up_proj": 6}),
            }
            refs = {name: peft_greedy(folder, path, PROMPTS, N) for name, path in paths.items()}
            refs[None] = peft_greedy(folder, None, PROMPTS, N)
            assert all(refs[n] != refs[None] for n in paths)  # every adapter changes the output
            cache[model] = (paths, refs)
        return cache[model]

    return get


def _run(sched, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    rids = [submit(sched, p, {"lora": name} if name else None, max_new_tokens=N,
                   ignore_eos=True) for p, name in jobs]
    results = run_until_idle(sched)
    return [results[rid]["output_ids"] for rid in rids]


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3-hd128"])
def test_mixed_batch_matches_peft(model: str, tiny_model_dir, adapters) -> None:
    """Base and three adapters in one batch: every request gets transformers + peft's tokens
    (prefill rows through the segment matmuls, decode rows through the gather kernel)."""
    paths, refs = adapters(model)
    sched = make_scheduler(tiny_model_dir(model), lora_paths=[f"{n}={p}" for n, p in paths.items()],
                           max_total_tokens=4096)
    jobs = [(p, name) for p in PROMPTS for name in (None, *paths)]
    outs = _run(sched, jobs)
    for (prompt, name), out in zip(jobs, outs, strict=True):
        assert out == refs[name][PROMPTS.index(prompt)], (name, prompt)


def test_each_path_of_the_products(tiny_model_dir, adapters, monkeypatch) -> None:
    """With the gather kernel off every step uses the segment matmuls, and with a request
    interleaved (speculative drafts, chunked prefill) the segments are gathered rows."""
    paths, refs = adapters("llama")
    monkeypatch.setattr(lora_batch, "_cpu_kernel", lambda: None)
    sched = make_scheduler(tiny_model_dir("llama"), lora_paths=[f"a={paths['a']}"],
                           chunked_prefill_size=16, speculative_algorithm="ngram",
                           max_total_tokens=4096)
    jobs = [(p, name) for p in PROMPTS for name in (None, "a")]
    assert _run(sched, jobs) == [refs[name][PROMPTS.index(p)] for p, name in jobs]


def test_retraction_with_adapters_keeps_each_requests_tokens(tiny_model_dir, adapters) -> None:
    """Requests of three adapters outgrow a 256-token pool (pages 4) and two slots: retracted
    requests come back (their adapter reloaded into a slot if it left) with peft's tokens."""
    paths, _ = adapters("llama")
    folder = tiny_model_dir("llama")
    prompts = random_prompts(6, 16, 24, seed=11)
    names = ["a", "b", "c", "a", "b", "c"]
    mine = {n: [p for p, m in zip(prompts, names, strict=True) if m == n] for n in paths}
    refs = {n: peft_greedy(folder, paths[n], mine[n], 50) for n in paths}
    sched = make_scheduler(folder, lora_paths=[f"{n}={p}" for n, p in paths.items()],
                           max_loras_per_batch=2, page_size=4, max_total_tokens=256)
    rids = [submit(sched, p, {"lora": n}, max_new_tokens=50, ignore_eos=True)
            for p, n in zip(prompts, names, strict=True)]
    results = run_until_idle(sched)
    assert sched.get_stats()["retractions"] > 0
    for name in paths:
        got = [results[r]["output_ids"] for r, n in zip(rids, names, strict=True) if n == name]
        assert got == refs[name], name


def test_triton_kernels_serve_a_mixed_batch(tiny_model_dir, adapters, monkeypatch) -> None:
    """The GPU path (``kernels/lora.py``) run by the Triton interpreter on the CPU: the same
    tokens as transformers + peft for a batch of base and adapter rows."""
    paths, refs = adapters("llama")
    monkeypatch.setattr(lora_batch, "kernel_for", lambda device, rows: "triton")
    sched = make_scheduler(tiny_model_dir("llama"), lora_paths=[f"{n}={p}" for n, p in paths.items()],
                           max_total_tokens=4096)
    jobs = [(PROMPTS[0], name) for name in (None, "a", "c")]
    assert _run(sched, jobs) == [refs[name][0] for _, name in jobs]


def test_one_slot_serves_adapters_in_turn(tiny_model_dir, adapters) -> None:
    """``max_loras_per_batch=1``: requests of a second adapter wait for the slot, then load
    it; every request still gets its own adapter's tokens."""
    paths, refs = adapters("llama")
    sched = make_scheduler(tiny_model_dir("llama"), max_loras_per_batch=1,
                           lora_paths=[f"{n}={p}" for n, p in paths.items()], max_total_tokens=4096)
    jobs = [(p, name) for name in ("a", "b", "c", "a") for p in PROMPTS]
    assert _run(sched, jobs) == [refs[name][PROMPTS.index(p)] for p, name in jobs]
    assert sched.loras.max_loras == 1


def test_adapter_is_part_of_the_cache_namespace(tiny_model_dir, adapters) -> None:
    """The same prompt under the base model and two adapters: none reads another's KV; the
    same adapter again hits its own; the counters say so per adapter."""
    paths, _ = adapters("llama")
    sched = make_scheduler(tiny_model_dir("llama"), lora_paths=[f"{n}={p}" for n, p in paths.items()],
                           max_total_tokens=4096)
    prompt = PROMPTS[2]
    hits = []
    for name in (None, "a", "b", "a", None):
        rid = submit(sched, prompt, {"lora": name} if name else None, max_new_tokens=2)
        hits.append(run_until_idle(sched)[rid]["meta"]["cached_tokens"])
    assert hits[:3] == [0, 0, 0] and hits[3] > 0 and hits[4] > 0
    stats = sched.get_stats()
    assert stats["adapter_tokens"]["a"] == [2 * len(prompt), hits[3]]
    assert stats["adapter_cache_hit_rate"]["b"] == 0.0
    summary = summary_rows(sched.tree, "weight", None, 50)
    adapter = summary["fields"].index("adapter")
    assert {row[adapter] for row in summary["rows"]} == {None, "a", "b"}


def test_load_and_unload_while_serving(tiny_model_dir, adapters, tmp_path) -> None:
    paths, refs = adapters("llama")
    sched = make_scheduler(tiny_model_dir("llama"), enable_lora=True, max_lora_rank=8,
                           max_total_tokens=4096)
    assert sched.loras.listing() == {}
    with pytest.raises(ValueError, match="not loaded"):
        submit(sched, PROMPTS[0], {"lora": "a"})
    assert sched.load_adapter("a", paths["a"])["loaded_adapters"] == {"a": paths["a"]}
    assert sched.load_adapter("a", paths["b"])["param"] == "lora_name"  # the name is taken
    rid = submit(sched, PROMPTS[0], {"lora": "a"}, max_new_tokens=N, ignore_eos=True)
    sched.step()
    refused = sched.unload_adapter("a")  # a request uses it
    assert refused["status"] == 400 and "in use" in refused["error"]
    assert run_until_idle(sched)[rid]["output_ids"] == refs["a"][0]
    assert sched.unload_adapter("a")["loaded_adapters"] == {}
    assert sched.unload_adapter("a")["status"] == 404
    # loaded again (same files): its earlier KV is still valid, and it is read
    sched.load_adapter("a", paths["a"])
    rid = submit(sched, PROMPTS[0], {"lora": "a"}, max_new_tokens=N, ignore_eos=True)
    out = run_until_idle(sched)[rid]
    assert out["output_ids"] == refs["a"][0] and out["meta"]["cached_tokens"] > 0


def _broken(src: str, dst: str, edit: Callable[[dict, dict], None]) -> str:
    shutil.copytree(src, dst)
    with open(os.path.join(dst, "adapter_config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(dst, "adapter_model.safetensors"))
    edit(cfg, tensors)
    with open(os.path.join(dst, "adapter_config.json"), "w") as f:
        json.dump(cfg, f)
    save_file(tensors, os.path.join(dst, "adapter_model.safetensors"))
    return dst


def _first(tensors: dict, part: str) -> str:
    return next(k for k in sorted(tensors) if part in k)


def test_bad_adapters_are_refused_with_the_reason(tiny_model_dir, adapters, tmp_path) -> None:
    paths, _ = adapters("llama")
    src = paths["a"]
    sched = make_scheduler(tiny_model_dir("llama"), enable_lora=True, max_lora_rank=4,
                           lora_target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                "gate_proj", "up_proj", "down_proj"],
                           max_total_tokens=4096)

    def shape(cfg, t):
        t[_first(t, "lora_B")] = torch.zeros(3, 4)

    def extra_layer(cfg, t):
        key = _first(t, "lora_A").replace("layers.0.", "layers.9.")
        t[key] = torch.zeros(4, 64)

    def alone(cfg, t):
        del t[_first(t, "lora_B")]

    def dora(cfg, t):
        cfg["use_dora"] = True

    cases = {
        "above --max-lora-rank 4": src,  # rank 8
        "do not fit": _broken(paths["b"], str(tmp_path / "shape"), shape),
        "module the base model does not have": _broken(paths["b"], str(tmp_path / "l9"),
                                                       extra_layer),
        "lora_A only": _broken(paths["b"], str(tmp_path / "alone"), alone),
        "DoRA": _broken(paths["b"], str(tmp_path / "dora"), dora),
        "no adapter_config.json": str(tmp_path),
        "not a folder": str(tmp_path / "missing"),
    }
    for i, (reason, folder) in enumerate(cases.items()):
        result = sched.load_adapter(f"x{i}", folder)
        assert result["status"] == 400 and reason in result["error"], (reason, result)
    assert sched.loras.listing() == {}
    assert sched.load_adapter("ok", paths["b"])["loaded_adapters"] == {"ok": paths["b"]}


def test_target_modules_limit_what_adapters_may_touch(tiny_model_dir, adapters) -> None:
    paths, refs = adapters("llama")
    sched = make_scheduler(tiny_model_dir("llama"), lora_paths=[f"b={paths['b']}"],
                           max_total_tokens=4096)
    assert sched.loras.targets == frozenset(SMALL)  # from the adapters given at start
    assert set(sched.loras.modules) == {"qkv", "down"}
    refused = sched.load_adapter("a", paths["a"])  # it targets o_proj, gate_proj, ...
    assert refused["status"] == 400 and "--lora-target-modules" in refused["error"]
    assert _run(sched, [(PROMPTS[1], "b")]) == [refs["b"][1]]


def test_lora_settings_are_checked() -> None:
    from radixserve.config import ServerArgs

    with pytest.raises(ValueError, match="given twice"):
        ServerArgs(lora_paths=("a=/x", "a=/y"))
    with pytest.raises(ValueError, match="not projections"):
        ServerArgs(lora_target_modules=("embed_tokens",))
    with pytest.raises(ValueError, match="positive integer"):
        ServerArgs(max_loras_per_batch=0)
    with pytest.raises(ValueError, match="one rank"):
        ServerArgs(enable_lora=True, tp_size=2)
    assert ServerArgs(lora_paths={"a": "/x"}).lora_paths == ("a=/x",)
    assert ServerArgs(lora_paths=["/x/y"]).resolve().enable_lora


@pytest.fixture(scope="module")
def default_adapter(default_model_path: str, tmp_path_factory: pytest.TempPathFactory):
    """An adapter of the default model (all projections, rank 8, B scaled so the output
    changes without turning into noise) and transformers + peft's greedy tokens."""
    folder = write_adapter(default_model_path, str(tmp_path_factory.mktemp("lora-smol") / "a"),
                           r=8, alpha=16, seed=4, scale=0.3)
    prompts = [list(range(100, 130)), [1, 9690, 198, 2683, 314, 253, 5356, 30, 2]]
    refs = peft_greedy(default_model_path, folder, prompts, N)
    assert refs != peft_greedy(default_model_path, None, prompts, N)
    return folder, prompts, refs


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_default_model_with_an_adapter_matches_peft(default_model_path, default_adapter,
                                                    quantization: str) -> None:
    """Float32 weights: the tokens of transformers + peft; the GGUF's Q4_1 blocks served as
    stored (computed in float32 from the same values transformers dequantizes) with a float
    adapter: the same tokens but where the two top logits are within a near-tie margin."""
    from radixserve.model.gguf_folder import gguf_file_of

    folder, prompts, refs = default_adapter
    model = default_model_path if quantization == "none" else gguf_file_of(default_model_path)
    sched = make_scheduler(model, lora_paths=[f"a={folder}"], quantization=quantization,
                           max_total_tokens=4096)
    outs = _run(sched, [(p, "a") for p in prompts])
    if quantization == "none":
        assert outs == refs
    else:
        same = sum(a == b for out, ref in zip(outs, refs, strict=True)
                   for a, b in zip(out, ref, strict=True))
        assert same >= 0.95 * sum(len(r) for r in refs), (outs, refs)


def test_per_tier_counters_name_the_adapter(tiny_model_dir, adapters) -> None:
    """With a host tier, an adapter's cached tokens are counted by the tier that held them."""
    paths, _ = adapters("llama")
    sched = make_scheduler(tiny_model_dir("llama"), lora_paths=[f"a={paths['a']}"],
                           host_cache_size=4096, max_total_tokens=4096)
    for _ in range(2):
        rid = submit(sched, PROMPTS[2], {"lora": "a"}, max_new_tokens=2)
        cached = run_until_idle(sched)[rid]["meta"]["cached_tokens"]
    stats = sched.get_stats()
    assert cached > 0 and sum(stats["adapter_tier_tokens"]["a"].values()) == cached
    assert stats["adapter_tokens"]["a"][1] == cached


def test_engine_loads_serves_and_unloads_adapters(tiny_chat_model, tmp_path) -> None:
    """The Python API over the real processes: ``lora_path`` per prompt, load and unload."""
    from radixserve import Engine

    path = write_adapter(tiny_chat_model, str(tmp_path / "a"), r=8, alpha=16, seed=5)
    prompts = [[1, 520, 3400, 92, 18], [1, 7001, 311, 45]]
    ref, base = peft_greedy(tiny_chat_model, path, prompts[:1], N)[0], peft_greedy(
        tiny_chat_model, None, prompts[1:], N)[0]
    greedy = {"max_new_tokens": N, "temperature": 0, "ignore_eos": True}
    with Engine(tiny_chat_model, dtype="float32", enable_lora=True, max_lora_rank=8,
                max_total_tokens=4096) as engine:
        assert engine.lora_adapters()["adapters"] == {}
        with pytest.raises(ValueError, match="not loaded"):
            engine.generate(input_ids=prompts[0], sampling_params=greedy, lora_path="a")
        assert engine.load_lora_adapter("a", path) == {"a": path}
        with pytest.raises(ValueError, match="not a folder"):
            engine.load_lora_adapter("x", path + "-missing")
        outs = engine.generate(input_ids=prompts, sampling_params=greedy, lora_path=["a", None])
        assert [o["output_ids"] for o in outs] == [ref, base]
        assert engine.unload_lora_adapter("a") == {}
        with pytest.raises(ValueError, match="not loaded"):
            engine.unload_lora_adapter("a")
        assert engine.check_memory()["ok"]
