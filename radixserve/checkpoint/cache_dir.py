"""The cache folder: converted models, compiled CPU kernels, small records."""

from __future__ import annotations

import os


def cache_root() -> str:
    """``$RADIXSERVE_CACHE_DIR``, else ``~/.cache/radixserve``."""
    root = os.environ.get("RADIXSERVE_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "radixserve"
    )
    return os.path.abspath(root)
