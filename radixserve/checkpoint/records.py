"""Small JSON records in the cache folder of what transformers resolved once (a model's config,
the class of its tokenizer), so that later starts skip importing it: its import takes seconds."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
from importlib.metadata import version
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
