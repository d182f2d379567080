"""A GGUF model's small files, written once into the cache folder; its weights stay in the file.

The folder holds what transformers reads from the GGUF's metadata (config.json,
generation_config.json, the tokenizer's files) and ``gguf.json``, which names the file the
weights are read from at every load (model/gguf_weights.py): a few megabytes, against the
weights' gigabytes.  It appears atomically (built under a temporary name next to the target and
renamed into place), so a crash never leaves half a folder.

The metadata is read once, by :func:`read_gguf_index`, and handed to transformers' own GGUF
tables, config classes and tokenizer builder (:func:`gguf_checkpoint`): the files are those
``from_pretrained(folder, gguf_file=name)`` gives, without the ``gguf`` package's reader, which
builds a numpy array per string of the vocabulary, once per call.

Every start checks the file first (:func:`check_gguf`, a header read): a file that is not a
GGUF, whose header or tensor data ends early, that holds a tensor of a type nothing here reads,
or whose architecture is not served, is refused with one error naming the file and the tensor.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr
from typing import Any

from radixserve.checkpoint.cache_dir import cache_root
from radixserve.checkpoint.gguf_index import GGUFIndex, read_gguf_index
from radixserve.checkpoint.gguf_tensors import ggml_type, tensor_bytes

logger = logging.getLogger(__name__)

SOURCE_FILE = "gguf.json"  # {"source": the .gguf path}: where the weights are read from
_REQUIRED_FILES = ("config.json", SOURCE_FILE)
# GGUF architectures served, with the transformers model type each becomes (a Mistral GGUF is
# written as "llama"; transformers tells it apart by the file's name field).
ARCHITECTURES = ("llama", "qwen2", "qwen3")


def is_ready(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, f)) for f in _REQUIRED_FILES)


def gguf_cache_path(gguf_path: str) -> str:
    """Cache folder for an arbitrary GGUF file, keyed by its path, size and mtime."""
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode()
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{hashlib.sha256(key).hexdigest()[:12]}")


def gguf_file_of(folder: str) -> str | None:
    """The .gguf whose weights a cache folder's model reads, or None for a plain HF folder."""
    try:
        with open(os.path.join(folder, SOURCE_FILE)) as f:
            return str(json.load(f)["source"])
    except (OSError, ValueError, KeyError):
        return None


def transformers_args(folder: str) -> tuple[str, dict[str, str]]:
    """What ``from_pretrained`` loads a model folder's weights from: the folder itself, or for a
    GGUF model's folder the file (``from_pretrained(path, **kwargs)``)."""
    source = gguf_file_of(folder)
    if source is None:
        return folder, {}
    where, name = os.path.split(source)
    return where, {"gguf_file": name}


def _dequantizable() -> set[object]:
    """The tensor types a float weight can be read from (the ``gguf`` package's readers)."""
    import gguf.quants

    return {gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16,
            *gguf.quants._type_traits}


def check_gguf(path: str) -> GGUFIndex:
    """The file's index, once it is known to hold a served architecture and only tensors of
    types that can be read, each inside the file; else a ValueError naming the file and the
    tensor."""
    import gguf

    try:
        index = read_gguf_index(path)
    except (UnicodeDecodeError, OverflowError, MemoryError, struct.error) as exc:
        raise ValueError(f"{path}: not a readable GGUF file ({exc})") from None
    if index.architecture not in ARCHITECTURES:
        raise ValueError(f"{path}: GGUF architecture {index.architecture!r} is not served "
                         f"(served: {', '.join(ARCHITECTURES)})")
    size = os.path.getsize(path)
    readable = _dequantizable()
    for tensor in index.tensors.values():
        kind = ggml_type(tensor.kind)
        if kind not in readable:
            raise ValueError(f"{path}: tensor {tensor.name} has GGUF type {tensor.kind}, which "
                             "radixserve does not read")
        block = gguf.GGML_QUANT_SIZES[kind][0]
        if not tensor.shape or tensor.shape[0] % block:
            raise ValueError(f"{path}: tensor {tensor.name} {tensor.kind} {tensor.shape}: rows "
                             f"are not whole blocks of {block}")
        if tensor.offset + tensor_bytes(tensor) > size:
            raise ValueError(f"{path}: tensor {tensor.name} ends past the end of the file "
                             f"({size} bytes): the file is truncated")
    return index


def ensure_folder(gguf_path: str, target: str) -> str:
    """Return ``target``, writing the small files of ``gguf_path`` into it first if they are
    not there yet (the file is checked either way)."""
    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    check_gguf(gguf_path)
    if _is_ready_for(target, gguf_path):
        return target
    with _lock(target):
        if not _is_ready_for(target, gguf_path):  # another process may have finished meanwhile
            if os.path.isdir(target):  # an older layout, or the same file at another path
                logger.info("rewriting %s: an older cache layout or another file's", target)
                shutil.rmtree(target)
            write_folder(gguf_path, target)
    return target


def _is_ready_for(target: str, gguf_path: str) -> bool:
    """Whether ``target`` is complete and reads its weights from ``gguf_path`` (the default
    model's folder is keyed by its name alone: another environment's package, perhaps since
    removed, may have written it)."""
    return is_ready(target) and gguf_file_of(target) == os.path.abspath(gguf_path)


@contextmanager
def _lock(path: str) -> Iterator[None]:
    """Exclusive lock so two processes starting together write the folder only once."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _make_readable(folder: str) -> None:
    """mkdtemp creates 0700; give the folder and its files the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers draws its own progress bars while it reads a GGUF's metadata: keep them off
    the terminal, where ours already reports the step.  Logging keeps its own stream."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _reads_gguf_metadata() -> bool:
    """Whether the installed transformers has the GGUF tables :func:`gguf_config` and
    :func:`gguf_tokenizer` build from (5.x's ``integrations.gguf``); with an older one its own
    ``from_pretrained(..., gguf_file=...)`` reads the file."""
    try:
        from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING  # noqa: F401
        from transformers.integrations.gguf.gguf_tokenizer_mapping import (  # noqa: F401
            _SPECIAL_TOKENS,
            convert_gguf_tokenizer,
        )
        from transformers.modeling_gguf_pytorch_utils import (  # noqa: F401
            GGUF_TO_TRANSFORMERS_MAPPING,
        )
        from transformers.tokenization_utils_tokenizers import TokenizersBackend  # noqa: F401
    except ImportError:
        return False
    return True


def gguf_checkpoint(index: GGUFIndex) -> dict[str, dict[str, Any]]:
    """What transformers' ``load_gguf_checkpoint(path, return_tensors=False)`` returns for a
    file of a served architecture (its "ignore", "config", "tokenizer" and "tokenizer_config"
    groups), built from ``index.metadata`` (:func:`read_gguf_index` with ``values=True``) by
    transformers' own key tables; its steps for other architectures (t5, stablelm, ...) are not
    taken."""
    from transformers.integrations import GGUF_CONFIG_DEFAULTS_MAPPING
    from transformers.modeling_gguf_pytorch_utils import GGUF_TO_TRANSFORMERS_MAPPING

    arch, meta = index.architecture, index.metadata
    if meta is None:
        raise ValueError("gguf_checkpoint needs the index read with values=True")
    if arch not in ARCHITECTURES:
        raise ValueError(f"GGUF architecture {arch!r} is not served")
    # each field as the list of its values (one for a scalar), the gguf reader's own fields first
    fields: dict[str, list[Any]] = {
        "GGUF.version": [index.version], "GGUF.tensor_count": [len(index.tensors)],
        "GGUF.kv_count": [len(meta)]}
    fields.update((key, v if isinstance(v, list) else [v]) for key, v in meta.items())
    parsed: dict[str, dict[str, Any]] = {group: {} for group in GGUF_TO_TRANSFORMERS_MAPPING}
    # llama.cpp writes a Mistral as "llama": transformers takes it for one when a value of
    # ``general.name`` is exactly "mistral", and then writes "mistral" for "llama" in every key
    # and string value
    updated = "mistral" if "llama" in arch and "mistral" in fields.get("general.name", []) else arch
    config = parsed["config"]
    config["tie_word_embeddings"] = "output.weight" not in index.tensors
    defaults = GGUF_CONFIG_DEFAULTS_MAPPING
    for key, value in defaults.get(updated, defaults.get(arch) or {}).items():
        config.setdefault(key, value)
    for gguf_key, values in fields.items():
        prefix, _, key = gguf_key.replace(arch, updated).partition(".")
        value = values[0] if len(values) == 1 else values
        if isinstance(value, str) and arch in value:
            value = value.replace(arch, updated)
        for group, renames in GGUF_TO_TRANSFORMERS_MAPPING.items():
            renamed = renames.get(prefix, {}).get(key, -1)
            if renamed != -1 and renamed is not None:  # -1: not this group's; None: dropped
                parsed[group][renamed] = value
    if "vocab_size" not in config and "tokens" in parsed["tokenizer"]:
        config["vocab_size"] = len(parsed["tokenizer"]["tokens"])
    return parsed


def gguf_config(index: GGUFIndex) -> Any:
    """The config ``AutoConfig.from_pretrained(folder, gguf_file=name)`` gives: the class of
    the model type, from the "config" group of :func:`gguf_checkpoint`."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    config_dict = gguf_checkpoint(index)["config"]
    return CONFIG_MAPPING[config_dict["model_type"]].from_dict(config_dict)


def gguf_tokenizer(index: GGUFIndex, config: Any) -> Any:
    """The tokenizer ``AutoTokenizer.from_pretrained(folder, gguf_file=name)`` gives, from
    ``index.metadata``: transformers 5's ``get_gguf_tokenizer`` groups of the ``tokenizer.*``
    keys, its ``convert_gguf_tokenizer`` backend, in the class AutoTokenizer picks for
    ``config`` (a GGUF folder has no tokenizer files to name one)."""
    from transformers.integrations.gguf.gguf_tokenizer_mapping import (
        _SPECIAL_TOKENS,
        GGUF_TOKENIZER_MAPPING,
        convert_gguf_tokenizer,
    )
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    meta = index.metadata
    if meta is None:
        raise ValueError("gguf_tokenizer needs the index read with values=True")
    tokenizer, tokenizer_config = (
        {name: meta[f"tokenizer.{key}"] for key, name in GGUF_TOKENIZER_MAPPING[group].items()
         if f"tokenizer.{key}" in meta}
        for group in ("tokenizer", "tokenizer_config"))
    if tokenizer.get("tokenizer_type") == "llama":  # sentencepiece: BOS unless the file says not
        tokenizer_config.setdefault("add_bos_token", True)
    for name, key in _SPECIAL_TOKENS.items():
        token_id = meta.get(f"tokenizer.ggml.{key}")
        tokenizer_config[name] = None if token_id is None else tokenizer["tokens"][token_id]
    backend, extra = convert_gguf_tokenizer(index.architecture, tokenizer)
    cls = TOKENIZER_MAPPING.get(type(config), TokenizersBackend) or TokenizersBackend
    if cls.__name__ == "MistralCommonBackend":  # needs a tekken.json, which a GGUF is not
        cls = TokenizersBackend
    # is_local / local_files_only: as from_pretrained passes them (tokenizer_config.json keeps them)
    return cls(tokenizer_object=backend, **tokenizer_config, **extra, is_local=True,
               local_files_only=False)


def write_folder(gguf_path: str, target: str) -> None:
    """Write the config, generation config, tokenizer and source record of ``gguf_path`` into
    ``target``: transformers' config and tokenizer of the file, from its metadata read once
    (:func:`read_gguf_index`)."""
    from tqdm import tqdm
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    folder, name = os.path.split(os.path.abspath(gguf_path))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(target) + "-", dir=parent)
    logger.info("reading the metadata of %s into %s (one time)", gguf_path, target)
    try:
        with tqdm(total=2, desc=f"radixserve: reading {name}", unit="step") as bar:
            bar.set_postfix_str("config")
            hf_reads = not _reads_gguf_metadata()  # then the values are transformers' to read
            index = read_gguf_index(gguf_path, values=not hf_reads)
            with _quiet_transformers():
                config = (AutoConfig.from_pretrained(folder, gguf_file=name) if hf_reads
                          else gguf_config(index))
            saved = config.to_dict()
            saved.pop("_name_or_path", None)
            saved.pop("_model_name_or_path", None)
            saved["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
            if index.head_dim:  # transformers reads it for some architectures only (not qwen3)
                saved["head_dim"] = index.head_dim
            saved["dtype"] = "float32"
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(saved, f, indent=2, sort_keys=True)
            GenerationConfig.from_model_config(config).to_json_file(
                os.path.join(tmp, "generation_config.json"))
            bar.update(1)
            bar.set_postfix_str("tokenizer")
            with _quiet_transformers():
                tokenizer = (AutoTokenizer.from_pretrained(folder, gguf_file=name) if hf_reads
                             else gguf_tokenizer(index, config))
                tokenizer.save_pretrained(tmp)
            with open(os.path.join(tmp, SOURCE_FILE), "w") as f:
                json.dump({"source": os.path.abspath(gguf_path)}, f)
            _make_readable(tmp)
            os.rename(tmp, target)  # atomic: the folder is complete or absent
            bar.update(1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
