"""load_tokenizer: the class AutoTokenizer resolved is recorded once, and later loads of a folder
it resolved to transformers' generic tokenizer.json class build that class directly, with the
same tokenizer as a result."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import transformers

from radixserve.tokenizer import _BACKEND_CLASS, load_tokenizer

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Café 東京 🙂?"},
            {"role": "assistant", "content": "Yes."}, {"role": "user", "content": "<|im_end|> again"}]


@pytest.fixture
def folder(default_model_path, tmp_path, monkeypatch) -> str:
    """The default model's tokenizer files in a folder of their own, with a cache of its own."""
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "cache"))
    out = tmp_path / "model"
    out.mkdir()
    for name in os.listdir(default_model_path):
        if not name.endswith(".safetensors"):
            shutil.copy(os.path.join(default_model_path, name), out / name)
    return str(out)


def records(folder: str) -> list[dict]:
    found = os.path.join(os.environ["RADIXSERVE_CACHE_DIR"], "tokenizer-classes")
    if not os.path.isdir(found):
        return []
    return [json.load(open(os.path.join(found, name))) for name in sorted(os.listdir(found))]


def no_auto(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("AutoTokenizer was called")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", refuse)


def same_tokenizer(a, b) -> None:
    assert type(a) is type(b)
    assert a.get_vocab() == b.get_vocab()
    assert a.all_special_tokens == b.all_special_tokens and a.eos_token_id == b.eos_token_id
    for kwargs in ({}, {"tools": TOOLS}, {"add_generation_prompt": True}):
        assert a.apply_chat_template(MESSAGES, tokenize=False, **kwargs) == \
            b.apply_chat_template(MESSAGES, tokenize=False, **kwargs)
    text = a.apply_chat_template(MESSAGES, tokenize=False, tools=TOOLS)
    for special in (True, False):
        ids = a.encode(text, add_special_tokens=special)
        assert ids == b.encode(text, add_special_tokens=special)
        assert a.decode(ids, skip_special_tokens=special) == b.decode(ids, skip_special_tokens=special)


def test_a_recorded_generic_class_loads_without_auto_tokenizer(folder, monkeypatch) -> None:
    first = load_tokenizer(folder)
    if type(first).__name__ != _BACKEND_CLASS:
        pytest.skip(f"this transformers resolves the default model to {type(first).__name__}")
    assert records(folder) == [{"class": _BACKEND_CLASS}]
    no_auto(monkeypatch)
    second = load_tokenizer(folder)  # AutoTokenizer would raise
    same_tokenizer(first, second)


def test_another_class_or_changed_files_go_through_auto_tokenizer(folder, monkeypatch) -> None:
    load_tokenizer(folder)
    path = os.path.join(os.environ["RADIXSERVE_CACHE_DIR"], "tokenizer-classes")
    (name,) = os.listdir(path)
    with open(os.path.join(path, name), "w") as f:
        json.dump({"class": "SomeModelTokenizer"}, f)
    calls = []
    real = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda *a, **k: calls.append(a) or real(*a, **k))
    load_tokenizer(folder)
    assert len(calls) == 1  # a class other than the generic one is left to AutoTokenizer
    config = os.path.join(folder, "tokenizer_config.json")
    settings = json.load(open(config))
    settings["model_max_length"] = 4096
    json.dump(settings, open(config, "w"))
    tokenizer = load_tokenizer(folder)  # new files: a new record, made by AutoTokenizer
    assert len(calls) == 2 and tokenizer.model_max_length == 4096
    assert len(os.listdir(path)) == 2


def test_a_folder_without_a_config_loads_as_before(folder) -> None:
    os.remove(os.path.join(folder, "config.json"))
    assert load_tokenizer(folder).encode("hello") == load_tokenizer(folder).encode("hello")
