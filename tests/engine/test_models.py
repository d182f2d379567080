"""Our models against Hugging Face transformers (float32 greedy is the oracle)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable

import pytest
import torch
from helpers.model_runner import ModelRunner
from helpers.tiny_models import TINY_MODELS

from radixserve.model import get_model_class
from radixserve.model.config import ModelConfig, RopeConfig
from radixserve.model.loader import load_model, read_config

PROMPTS = [
    [1, 17, 99, 3, 250, 41, 8, 8, 120],
    [1, 200],
    [1, *range(30, 63)],
    [7],
]
NEW_TOKENS = 10


def _hf_model(folder: str, **kwargs: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager", **kwargs
    )
    model.generation_config.eos_token_id = None  # compare fixed-length continuations
    return model.eval()


def _hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0
        )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def hf_reference(tiny_model_dir: Callable[[str], str]) -> Callable[[str], list[list[int]]]:
    """Greedy HF continuations of PROMPTS per tiny model, computed once per module."""
    cache: dict[str, list[list[int]]] = {}

    def get(name: str) -> list[list[int]]:
        if name not in cache:
            hf = _hf_model(tiny_model_dir(name))
            cache[name] = [_hf_greedy(hf, p, NEW_TOKENS) for p in PROMPTS]
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_prefill_logits_match_hf(name: str, tiny_model_dir: Callable[[str], str]) -> None:
    folder = tiny_model_dir(name)
    loaded = load_model(folder, torch.float32)
    hf = _hf_model(folder)
    ours = ModelRunner(loaded.model).last_token_logits(PROMPTS)  # all prompts in one batch
    assert ours.dtype == torch.float32
    assert ours.shape == (len(PROMPTS), loaded.config.vocab_size)
    with torch.no_grad():
        ref = torch.stack([hf(torch.tensor([p])).logits[0, -1] for p in PROMPTS])
    torch.testing.assert_close(ours, ref, rtol=1e-4, atol=1e-4)


MODES = {
    # mode -> (runner kwargs, greedy kwargs, run prompts one at a time?)
    "whole_prompt": ({"scatter": False}, {}, True),
    "chunked_3": ({"scatter": False}, {"chunk_size": 3}, True),
    "scattered_slots": ({"scatter": True}, {}, True),
    "batched_mixed": ({"scatter": True}, {"stagger": 2}, False),
    "batched_mixed_chunked": ({"scatter": True, "seed": 1}, {"stagger": 1, "chunk_size": 4}, False),
}


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_greedy_matches_hf(
    name: str,
    mode: str,
    tiny_model_dir: Callable[[str], str],
    hf_reference: Callable[[str], list[list[int]]],
) -> None:
    runner_kw, greedy_kw, one_by_one = MODES[mode]
    runner = ModelRunner(load_model(tiny_model_dir(name), torch.float32).model, **runner_kw)
    if one_by_one:
        ours = [runner.greedy([p], NEW_TOKENS, **greedy_kw)[0] for p in PROMPTS]
    else:
        ours = runner.greedy(PROMPTS, NEW_TOKENS, **greedy_kw)
    assert ours == hf_reference(name)


def test_model_config_fields(tiny_model_dir: Callable[[str], str]) -> None:
    loaded = load_model(tiny_model_dir("qwen3-hd128"), torch.bfloat16)
    cfg = loaded.config
    assert cfg.architecture == "Qwen3ForCausalLM"
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim) == (4, 1, 128)
    assert cfg.eos_token_ids == (2, 5)  # config's 2 + generation_config's [2, 5]
    assert cfg.max_context_len == 512 and cfg.vocab_size == 256 and cfg.num_layers == 2
    assert cfg.dtype == torch.bfloat16
    assert all(p.dtype == torch.bfloat16 for p in loaded.model.parameters())
    assert loaded.tokenizer_path == tiny_model_dir("qwen3-hd128")
    with pytest.raises(AttributeError):
        cfg.vocab_size = 1  # frozen


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_saved_config_builds_what_transformers_config_builds(
    name: str, tiny_model_dir: Callable[[str], str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second read of a folder's config comes from the cache folder, without transformers,
    and gives the same ModelConfig and architecture spec as transformers' own config."""
    from transformers import AutoConfig

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    folder = tiny_model_dir(name)
    first = read_config(folder)
    assert isinstance(first, type(AutoConfig.from_pretrained(folder)))
    saved = read_config(folder)
    assert not isinstance(saved, type(first)) and len(list((tmp_path / "configs").iterdir())) == 1
    expected = ModelConfig.from_hf(AutoConfig.from_pretrained(folder), torch.float32, folder)
    assert ModelConfig.from_hf(saved, torch.float32, folder) == expected
    cls = get_model_class(expected.architecture)
    assert cls.arch_spec(saved) == cls.arch_spec(first)


def test_the_launcher_keeps_the_config_record_the_scheduler_reads(
    tiny_model_dir: Callable[[str], str], tmp_path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A first start resolves the config in the launcher (which imports transformers for the
    tokenizer anyway): the scheduler then finds the record and never imports transformers."""
    import shutil

    from radixserve.checkpoint.records import read_record, record_path
    from radixserve.config import ServerArgs
    from radixserve.runtime.launcher import ProcessGroup

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    folder = tiny_model_dir("llama")
    with open(os.path.join(folder, "config.json"), "rb") as f:
        record = record_path("configs", f.read())
    assert read_record(record) is None
    group = ProcessGroup(ServerArgs(model=folder))
    shutil.rmtree(group.paths.folder)
    from transformers import AutoConfig

    assert read_record(record) == json.loads(json.dumps(AutoConfig.from_pretrained(folder).to_dict()))


def test_rope_config_variants() -> None:
    from transformers import LlamaConfig

    llama3 = RopeConfig.from_hf(LlamaConfig(**json.loads(LlamaConfig().to_json_string())))
    assert llama3.rope_type == "default"
    old_style = type("Cfg", (), {"rope_theta": 5e5, "rope_scaling": {"type": "linear", "factor": 2}})
    assert RopeConfig.from_hf(old_style) == RopeConfig(theta=5e5, rope_type="linear", factor=2.0)
    with pytest.raises(ValueError, match="unsupported rope scaling type 'yarn'"):
        RopeConfig.from_hf(LlamaConfig(rope_scaling={"rope_type": "yarn", "factor": 4.0}))


def test_unsupported_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'GPT2LMHeadModel'"):
        get_model_class("GPT2LMHeadModel")


def test_missing_weight_is_a_clear_error(tiny_model_dir: Callable[[str], str], tmp_path) -> None:
    from safetensors.torch import load_file, save_file

    src = tiny_model_dir("llama")
    for f in os.listdir(src):
        data = open(os.path.join(src, f), "rb").read()
        open(tmp_path / f, "wb").write(data)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.self_attn.k_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="missing 1 weights"):
        load_model(str(tmp_path), torch.float32)


def test_sharded_checkpoint_loads(tiny_model_dir: Callable[[str], str], tmp_path) -> None:
    """A checkpoint split into several safetensors shards gives the same logits."""
    from transformers import AutoModelForCausalLM

    src = tiny_model_dir("qwen2")
    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    a = ModelRunner(load_model(src, torch.float32).model).last_token_logits(PROMPTS[:2])
    b = ModelRunner(load_model(str(tmp_path), torch.float32).model).last_token_logits(PROMPTS[:2])
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_bad_model_path_is_a_clear_error(tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="never downloaded"):
        load_model("some-org/some-model", torch.float32)
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_model(str(tmp_path), torch.float32)


# ---------------------------------------------------------------- the default model

CHAT = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
DEFAULT_NEW_TOKENS = 16


def _chat_prompt(tokenizer_path: str) -> list[int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    ids = tok.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True, return_dict=False)
    return list(ids)


@pytest.fixture(scope="module")
def default_f32(default_model_path: str):
    return load_model(default_model_path, torch.float32)


def test_default_model_config(default_f32) -> None:
    cfg = default_f32.config
    assert cfg.architecture == "LlamaForCausalLM"
    assert (cfg.num_layers, cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads) == (30, 576, 9, 3)
    assert cfg.tie_word_embeddings and cfg.vocab_size == 49152
    assert 2 in cfg.eos_token_ids  # <|im_end|>


def test_default_model_matches_transformers_on_its_gguf(default_f32, default_model_path: str) -> None:
    """Chat prompt, 16 greedy tokens against transformers reading the GGUF itself; chunked
    prefill sharing batches with another request."""
    from helpers.oracle import hf_greedy

    from radixserve.model.default_model import default_gguf_path
    from radixserve.model.gguf_folder import transformers_args

    # The oracle's model (shared with the other tests of the default model) is transformers
    # reading the GGUF itself.
    folder, name = os.path.split(default_gguf_path())
    assert transformers_args(default_model_path) == (folder, {"gguf_file": name})
    prompt = _chat_prompt(default_f32.tokenizer_path)
    ref = hf_greedy(default_model_path, prompt, DEFAULT_NEW_TOKENS)
    runner = ModelRunner(default_f32.model, max_context=256, num_slots=1024)
    assert runner.greedy([prompt], DEFAULT_NEW_TOKENS) == [ref]
    other = prompt[:5] + prompt[9:20]
    alone = runner.greedy([other], DEFAULT_NEW_TOKENS)[0]
    # Batched: `other` decodes while the chat prompt prefills in chunks of 16 (mixed rows).
    both = runner.greedy([other, prompt], DEFAULT_NEW_TOKENS, chunk_size=16, stagger=1)
    assert both == [alone, ref]


def test_default_model_folder_is_written_once(
    default_model_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The folder's small files are written once; its weights stay in the GGUF (no float
    copy of them in the cache)."""
    from radixserve.model import gguf_folder

    def no_writing(*args: object) -> None:
        raise AssertionError("the cached folder should have been reused")

    monkeypatch.setattr(gguf_folder, "write_folder", no_writing)
    loaded = load_model(None, torch.float32)
    assert loaded.tokenizer_path == default_model_path
    assert os.path.isfile(os.path.join(default_model_path, "tokenizer.json"))
    assert not [f for f in os.listdir(default_model_path) if f.endswith(".safetensors")]
    assert sum(os.path.getsize(os.path.join(default_model_path, f))
               for f in os.listdir(default_model_path)) < 8 * 2**20


def test_a_folder_that_reads_another_path_is_rewritten(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default model's folder is keyed by its name: a folder written by another environment's
    package (its gguf.json naming a file that may be gone) is written again for this one's."""
    import json
    import shutil

    from radixserve.model.default_model import default_gguf_path, default_model_path
    from radixserve.model.gguf_folder import SOURCE_FILE, gguf_file_of

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    elsewhere = tmp_path / "other-env" / os.path.basename(default_gguf_path())
    elsewhere.parent.mkdir()
    shutil.copyfile(default_gguf_path(), elsewhere)
    folder = default_model_path()
    with open(os.path.join(folder, SOURCE_FILE), "w") as f:
        json.dump({"source": str(elsewhere)}, f)
    elsewhere.unlink()  # that environment is gone
    assert default_model_path() == folder
    assert gguf_file_of(folder) == os.path.abspath(default_gguf_path())


def test_failed_folder_write_leaves_nothing(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    import transformers

    from radixserve.model import gguf_folder
    from radixserve.model.default_model import default_model_path

    def boom(*args: object, **kwargs: object) -> None:
        raise RuntimeError("simulated crash while reading the tokenizer")

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    # the tokenizer from the metadata read once, or through transformers' own GGUF reading
    monkeypatch.setattr(gguf_folder, "gguf_tokenizer", boom)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        default_model_path()
    leftovers = [p for p in os.listdir(tmp_path) if not p.endswith(".lock")]
    assert leftovers == []


def test_default_model_bfloat16(default_model_path: str) -> None:
    from transformers import AutoTokenizer

    loaded = load_model(default_model_path, torch.bfloat16)
    assert loaded.model.model.embed_tokens.weight.dtype == torch.bfloat16
    prompt = _chat_prompt(loaded.tokenizer_path)
    runner = ModelRunner(loaded.model, max_context=256)
    logits = runner.last_token_logits([prompt])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()
    out = runner.greedy([prompt], DEFAULT_NEW_TOKENS)[0]
    text = AutoTokenizer.from_pretrained(loaded.tokenizer_path).decode(out)
    assert "Paris" in text, text


@pytest.mark.slow
def test_any_gguf_path_loads(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A .gguf path gets its folder in the cache (``gguf/<name>-<hash>``) and loads from it."""
    from transformers import AutoTokenizer

    from radixserve.model.default_model import default_gguf_path

    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path))
    loaded = load_model(default_gguf_path(), torch.float32)
    assert loaded.tokenizer_path.startswith(str(tmp_path / "gguf"))
    assert AutoTokenizer.from_pretrained(loaded.tokenizer_path).eos_token == "<|im_end|>"
    assert loaded.config.num_layers == 30
