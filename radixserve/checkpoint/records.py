"""Small JSON records in the cache folder of what transformers resolved once (a model's config,
the class of its tokenizer), so that later starts skip importing it: its import takes seconds."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from importlib.metadata import version
from types import SimpleNamespace
from typing import Any

from radixserve.checkpoint.cache_dir import cache_root

log = logging.getLogger("radixserve")


def record_path(kind: str, *keys: bytes) -> str:
    """The record of ``kind`` for these key bytes under the installed transformers version."""
    digest = hashlib.sha256(b"".join(keys) + version("transformers").encode()).hexdigest()[:20]
    return os.path.join(cache_root(), kind, f"{digest}.json")


def read_record(path: str) -> Any:
    """The record's data, or None when there is none (or it cannot be read)."""
    try:
        with open(path, "rb") as f:
            return json.loads(f.read())
    except (OSError, ValueError):
        return None


def write_record(path: str, data: Any) -> None:
    """Keep ``data`` at ``path`` (atomically: starts may race); a read-only cache only costs the
    next start the same work again."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(data, f)
        os.replace(tmp, path)
    except (OSError, TypeError, ValueError) as e:  # TypeError: a value JSON cannot hold
        log.debug("could not keep %s: %s", path, e)
        with contextlib.suppress(OSError):
            os.remove(tmp)


def read_config(folder: str) -> Any:
    """The folder's config as transformers resolves it (its defaults filled in), with its
    attributes read by ``getattr``.  transformers' import takes seconds of every start and about
    80 MB that the scheduler would keep, so the resolved attributes are kept in the cache folder,
    keyed by the config.json bytes and the transformers version: the launcher reads them first
    (runtime/launcher.py), and the scheduler reads them back without importing it."""
    with open(os.path.join(folder, "config.json"), "rb") as f:
        saved = record_path("configs", f.read())
    attributes = read_record(saved)
    if isinstance(attributes, dict):
        return SimpleNamespace(**attributes)
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(folder)
    write_record(saved, hf_config.to_dict())
    return hf_config
