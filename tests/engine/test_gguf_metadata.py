"""A GGUF's metadata read once, by radixserve's own header reader, into the cache folder's small
files: the values are the ``gguf`` package's, the config and tokenizer are those transformers'
own ``from_pretrained(folder, gguf_file=name)`` builds (for llama, qwen2, qwen3, a Mistral
written as llama, and the embedded default model), and a damaged header is one ValueError
naming the file."""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from helpers.gguf_files import kind_of, small_model, write_gguf

from radixserve.checkpoint.default_gguf import default_gguf_path
from radixserve.checkpoint.gguf_index import read_gguf_index
from radixserve.model import gguf_folder
from radixserve.model.gguf_folder import gguf_checkpoint, write_folder

FILES = ["llama", "qwen2", "qwen3", "mistral", "default"]
# The default run compares llama and the default model; the other architectures run with -m slow.
DEFAULT_LANE = {"llama", "default"}


def _lanes(names: list[str]) -> list[Any]:
    return [n if n in DEFAULT_LANE else pytest.param(n, marks=pytest.mark.slow) for n in names]


FILE_PARAMS = _lanes(FILES)

TEXTS = [
    "Hello world! How are you today?",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>text after the end<|im_end|>",
    "  leading spaces, trailing spaces   \n\n\ttabs and\r\nnew lines",
    "héllo wörld — naïve café, 你好，世界 🙂🚀 Привет мир",
    "numbers 1234567890 3.14159 1e-5 0x1F",
    "def f(x):\n    return x ** 2  # code",
    "",
]
MESSAGES = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "You are terse."},
     {"role": "user", "content": "Répète: 你好 🙂"},
     {"role": "assistant", "content": "你好 🙂"},
     {"role": "user", "content": "<|im_end|> inside a message"}],
]


@pytest.fixture(scope="module", autouse=True)
def _one_parse_per_file() -> Iterator[None]:
    """transformers' own path parses the whole file with the ``gguf`` package's reader in each
    call (seconds, for SmolLM2's vocabulary); the reference calls here share one parse a file."""
    import gguf

    original = gguf.GGUFReader
    readers: dict[str, Any] = {}

    def reader(path: str, mode: str = "r") -> Any:
        key = os.path.abspath(path)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", reader)
        yield


@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], str]:
    """``gguf_file(name)``: a small GGUF of that architecture (F16 weights, SmolLM2's
    tokenizer), written once; "mistral" is a llama file named "mistral", as transformers tells
    a Mistral written by llama.cpp; "default" is the embedded default model's file."""
    import gguf

    folder = tmp_path_factory.mktemp("gguf-metadata")
    written: dict[str, str] = {"default": default_gguf_path()}

    def make(name: str) -> str:
        if name not in written:
            arch = "llama" if name == "mistral" else name
            path = str(folder / f"small-{name}.gguf")
            with pytest.MonkeyPatch.context() as patch:
                if name == "mistral":
                    add_name = gguf.GGUFWriter.add_name
                    patch.setattr(gguf.GGUFWriter, "add_name",
                                  lambda self, _: add_name(self, "mistral"))
                written[name] = write_gguf(path, small_model(arch), arch, kind_of({}, "F16"))
        return written[name]

    return make


@pytest.mark.parametrize("name", FILE_PARAMS)
def test_values_are_the_gguf_packages(name: str, gguf_file) -> None:
    """Every metadata key, in file order, with the value (and its Python type) the ``gguf``
    package's reader gives; the index itself is the one read without values."""
    import gguf

    path = gguf_file(name)
    index = read_gguf_index(path, values=True)
    fields = gguf.GGUFReader(path).fields
    want = {key: field.contents() for key, field in fields.items()
            if not key.startswith("GGUF.")}
    assert list(index.metadata) == list(want)
    for key, value in want.items():
        got = index.metadata[key]
        assert got == value, key
        assert type(got) is type(value), key
        if isinstance(value, list):
            assert [type(v) for v in got] == [type(v) for v in value], key
    assert index.version == fields["GGUF.version"].contents()
    plain = read_gguf_index(path)
    assert plain.metadata is None
    assert (plain.architecture, plain.tensors, plain.head_dim) == (
        index.architecture, index.tensors, index.head_dim)


@pytest.mark.parametrize("name", FILE_PARAMS)
def test_checkpoint_dict_is_transformers(name: str, gguf_file) -> None:
    """gguf_checkpoint's groups equal transformers' ``load_gguf_checkpoint`` (metadata only)."""
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    path = gguf_file(name)
    ours = gguf_checkpoint(read_gguf_index(path, values=True))
    assert ours == load_gguf_checkpoint(path, return_tensors=False)
    assert ours["config"]["model_type"] == ("mistral" if name == "mistral" else
                                            read_gguf_index(path).architecture)


def _folder_files(folder: str) -> dict[str, Any]:
    files: dict[str, Any] = {}
    for name in sorted(os.listdir(folder)):
        with open(os.path.join(folder, name), encoding="utf-8") as f:
            files[name] = json.load(f) if name.endswith(".json") else f.read()
    return files


@pytest.fixture(scope="module")
def folders(gguf_file, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[str, str]]:
    """``folders(name)``: (the folder write_folder writes from the metadata read once, the one
    it writes through transformers' own ``from_pretrained(folder, gguf_file=name)``)."""
    root = tmp_path_factory.mktemp("gguf-folders")
    written: dict[str, tuple[str, str]] = {}

    def make(name: str) -> tuple[str, str]:
        if name not in written:
            path = gguf_file(name)
            ours, theirs = str(root / f"{name}-ours"), str(root / f"{name}-theirs")
            write_folder(path, ours)
            with pytest.MonkeyPatch.context() as patch:  # transformers reads the file itself
                patch.setattr(gguf_folder, "_reads_gguf_metadata", lambda: False)
                write_folder(path, theirs)
            written[name] = ours, theirs
        return written[name]

    return make


@pytest.mark.parametrize("name", FILE_PARAMS)
def test_folder_is_what_transformers_writes(name: str, gguf_file, folders) -> None:
    """The folder from the metadata read once holds the files transformers' own path writes;
    its config.json is ``AutoConfig.from_pretrained(folder, gguf_file=name)``'s, as a dict."""
    from transformers import AutoConfig

    path = gguf_file(name)
    ours, theirs = folders(name)
    got, want = _folder_files(ours), _folder_files(theirs)
    assert got.pop("gguf.json") == want.pop("gguf.json") == {"source": os.path.abspath(path)}
    assert got == want

    where, file = os.path.split(path)
    config = AutoConfig.from_pretrained(where, gguf_file=file).to_dict()
    config.pop("_name_or_path", None)
    config.pop("_model_name_or_path", None)
    saved = dict(got["config.json"])
    for key in ("architectures", "dtype", "head_dim"):  # write_folder sets these
        config.pop(key, None)
        saved.pop(key, None)
    assert saved == json.loads(json.dumps(config))
    index = read_gguf_index(path)
    if index.head_dim:  # the file's key length, over transformers' reading
        assert got["config.json"]["head_dim"] == index.head_dim
    assert got["config.json"]["tie_word_embeddings"] == ("output.weight" not in index.tensors)
    assert got["config.json"]["model_type"] == ("mistral" if name == "mistral" else
                                                index.architecture)


def _same_tokenizer(tokenizer: Any, reference: Any) -> None:
    """Same vocabulary, special and added tokens, chat template, ids for :data:`TEXTS` (with
    and without special tokens) and for :data:`MESSAGES` through the chat template."""
    assert len(tokenizer) == len(reference)
    for attr in ("bos_token", "eos_token", "unk_token", "pad_token", "all_special_tokens",
                 "all_special_ids", "chat_template", "add_bos_token", "add_eos_token"):
        assert getattr(tokenizer, attr) == getattr(reference, attr), attr
    assert {i: str(t) for i, t in tokenizer.added_tokens_decoder.items()} == {
        i: str(t) for i, t in reference.added_tokens_decoder.items()}
    for text in TEXTS:
        ids = reference(text)["input_ids"]
        assert tokenizer(text)["input_ids"] == ids, text
        assert tokenizer.encode(text, add_special_tokens=False) == reference.encode(
            text, add_special_tokens=False), text
        assert tokenizer.decode(ids) == reference.decode(ids), text
    for messages in MESSAGES:
        for tokenize in (False, True):
            kwargs = {"add_generation_prompt": True, "tokenize": tokenize}
            assert (tokenizer.apply_chat_template(messages, **kwargs)
                    == reference.apply_chat_template(messages, **kwargs)), messages


@pytest.mark.parametrize("name", FILE_PARAMS)
def test_tokenizer_written_is_transformers(name: str, gguf_file, folders) -> None:
    """The tokenizer written (tokenizer.json and tokenizer_config.json, read as they are) is the
    one ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` builds."""
    from transformers import AutoTokenizer
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    where, file = os.path.split(gguf_file(name))
    reference = AutoTokenizer.from_pretrained(where, gguf_file=file)
    ours, _ = folders(name)
    _same_tokenizer(TokenizersBackend.from_pretrained(ours), reference)


# qwen2 / qwen3 are left out: AutoTokenizer gives their folder to Qwen2Tokenizer, which builds
# its own normalizer and pre-tokenizer over those tokenizer.json holds (here SmolLM2's
# byte-level ones), so it differs from transformers' GGUF tokenizer for these synthetic files.
@pytest.mark.parametrize("name", _lanes([n for n in FILES if not n.startswith("qwen")]))
def test_tokenizer_served_is_transformers(name: str, gguf_file, folders, cache: str) -> None:
    """The tokenizer the server loads from the folder (radixserve.tokenizer.load_tokenizer,
    twice: its class resolved, then recorded) is the one transformers builds from the file."""
    from transformers import AutoTokenizer

    from radixserve.tokenizer import load_tokenizer

    where, file = os.path.split(gguf_file(name))
    reference = AutoTokenizer.from_pretrained(where, gguf_file=file)
    ours, _ = folders(name)
    for _ in range(2):
        tokenizer = load_tokenizer(ours)
        assert type(tokenizer) is type(reference)
        _same_tokenizer(tokenizer, reference)


@pytest.fixture
def cache(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    """An empty cache folder for the test (load_tokenizer records a folder's class there)."""
    folder = tmp_path / "cache"
    folder.mkdir()
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(folder))
    return str(folder)


def _key_end(data: bytes, key: str) -> int:
    """Where the value type of metadata ``key`` starts in the file's bytes."""
    encoded = key.encode()
    return data.index(struct.pack("<Q", len(encoded)) + encoded) + 8 + len(encoded)


def _damaged_files(source: str, folder) -> Iterator[tuple[str, str]]:
    """(path, what the error says) for copies of ``source``'s header, each damaged one way."""
    data = open(source, "rb").read(8 << 20)
    tokens = _key_end(data, "tokenizer.ggml.tokens")  # u32 9, u32 8, u64 count, strings
    first = tokens + 16  # the first token's length, then its bytes
    bad: dict[str, tuple[bytes, str]] = {
        "cut-in-tokens": (data[:tokens + 16 + 5000], "ends early"),
        "cut-in-keys": (data[:_key_end(data, "general.architecture") + 2], "ends early"),
        "count-too-big": (data[:tokens + 8] + struct.pack("<Q", 1 << 40) + data[tokens + 16:],
                          "ends early"),
        "length-too-big": (data[:first] + struct.pack("<Q", 1 << 50) + data[first + 8:],
                           "ends early"),
        "unknown-type": (data[:tokens + 4] + struct.pack("<I", 99) + data[tokens + 8:],
                         "unknown metadata value type 99"),
        "not-utf8": (data[:first + 8] + b"\xff" + data[first + 9:], "not UTF-8"),
    }
    for what, (damaged, says) in bad.items():
        path = os.path.join(folder, f"{what}.gguf")
        with open(path, "wb") as f:
            f.write(damaged)
        yield path, says


def test_damaged_metadata_is_one_error_naming_the_file(gguf_file, tmp_path) -> None:
    """A header cut short or garbled in its metadata is a ValueError naming the file, read with
    or without values; write_folder leaves nothing behind."""
    for path, says in _damaged_files(gguf_file("default"), tmp_path):
        with pytest.raises(ValueError) as raised:
            read_gguf_index(path, values=True)
        assert path in str(raised.value) and says in str(raised.value), str(raised.value)
        if says != "not UTF-8":  # the index alone reads names leniently
            with pytest.raises(ValueError, match="ends early|unknown metadata"):
                read_gguf_index(path)
        target = str(tmp_path / "cache" / os.path.basename(path))
        with pytest.raises(ValueError, match=re.escape(path)):
            write_folder(path, target)
        assert not os.path.exists(target)
        assert os.listdir(tmp_path / "cache") == []


def test_arrays_nested_too_deep_are_refused(tmp_path) -> None:
    """An array of arrays of arrays... past any model's metadata: a ValueError naming the file,
    not a RecursionError."""
    key = b"deep"
    data = struct.pack("<4sIQQ", b"GGUF", 3, 0, 1) + struct.pack("<Q", len(key)) + key
    data += struct.pack("<I", 9) + struct.pack("<IQ", 9, 1) * 5000
    path = tmp_path / "deep.gguf"
    path.write_bytes(data)
    for values in (False, True):
        with pytest.raises(ValueError, match=re.escape(f"{path}: ") + ".*nested"):
            read_gguf_index(str(path), values=values)
