"""Convert a GGUF checkpoint into a cached Hugging Face folder, once.

transformers dequantizes GGUF on load (seconds to tens of seconds), so the result is written
as a plain folder (config.json, generation_config.json, model.safetensors, tokenizer files)
and later loads read that.  The folder appears atomically: it is built under a temporary
name next to the target and renamed into place, so a crash never leaves half a folder.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager, redirect_stderr

from radixserve.checkpoint.cache_dir import cache_root

logger = logging.getLogger(__name__)

_REQUIRED_FILES = ("config.json", "model.safetensors")


def is_converted(folder: str) -> bool:
    return all(os.path.isfile(os.path.join(folder, f)) for f in _REQUIRED_FILES)


def gguf_cache_path(gguf_path: str) -> str:
    """Cache folder for an arbitrary GGUF file, keyed by its path, size and mtime."""
    st = os.stat(gguf_path)
    key = f"{os.path.abspath(gguf_path)}:{st.st_size}:{st.st_mtime_ns}".encode()
    stem = os.path.splitext(os.path.basename(gguf_path))[0]
    return os.path.join(cache_root(), "gguf", f"{stem}-{hashlib.sha256(key).hexdigest()[:12]}")


@contextmanager
def _lock(path: str) -> Iterator[None]:
    """Exclusive lock so two processes starting together convert only once."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def ensure_converted(gguf_path: str, target: str) -> str:
    """Return ``target``, converting ``gguf_path`` into it first if it is not there yet."""
    if is_converted(target):
        return target
    with _lock(target):
        if not is_converted(target):  # another process may have finished meanwhile
            convert_gguf(gguf_path, target)
    return target


def _make_readable(folder: str) -> None:
    """mkdtemp creates 0700; give the folder and its files the usual umask-based modes."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(folder, 0o777 & ~umask)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o666 & ~umask)


@contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers draws its own progress bars while it reads a GGUF (one of them with
    ``tqdm.auto`` directly, which its progress-bar switch does not reach): keep them off the
    terminal, where ours already reports the conversion.  Logging keeps its own stream."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        with redirect_stderr(io.StringIO()):
            yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def convert_gguf(gguf_path: str, target: str) -> None:
    """Dequantize ``gguf_path`` through transformers and write an HF folder at ``target``."""
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not os.path.isfile(gguf_path):
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    folder, name = os.path.split(os.path.abspath(gguf_path))
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-" + os.path.basename(target) + "-", dir=parent)
    logger.info("converting %s -> %s (one time)", gguf_path, target)
    steps = ["dequantize GGUF", "write weights", "write config + tokenizer", "finish"]
    try:
        with tqdm(total=len(steps), desc=f"radixserve: converting {name}", unit="step") as bar:
            bar.set_postfix_str(steps[0])
            with _quiet_transformers():
                model = AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=name, dtype=torch.float32
                )
            bar.update(1)

            bar.set_postfix_str(steps[1])
            state = model.state_dict()
            if model.config.tie_word_embeddings:
                state.pop("lm_head.weight", None)  # shares storage with the embedding
            state = {k: v.detach().contiguous() for k, v in state.items()}
            save_file(state, os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
            bar.update(1)

            bar.set_postfix_str(steps[2])
            config = model.config.to_dict()
            config.pop("quantization_config", None)  # weights are plain float32 now
            config.pop("_model_name_or_path", None)
            config["architectures"] = [type(model).__name__]
            config["dtype"] = "float32"
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f, indent=2, sort_keys=True)
            model.generation_config.to_json_file(os.path.join(tmp, "generation_config.json"))
            with _quiet_transformers():
                AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(tmp)
            bar.update(1)

            bar.set_postfix_str(steps[3])
            _make_readable(tmp)
            os.rename(tmp, target)  # atomic: the folder is complete or absent
            bar.update(1)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
