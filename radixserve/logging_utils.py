"""Logging set-up shared by the processes, and the parent-liveness check."""

from __future__ import annotations

import logging
import os
import signal


def configure_logging(process: str, level: str | None = None) -> None:
    level = (level or os.environ.get("RADIXSERVE_LOG_LEVEL", "info")).upper()
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"%(asctime)s [{process}] %(levelname)s %(name)s: %(message)s",
        force=True,
    )


def parent_alive(parent_pid: int) -> bool:
    """True while the process that started us lives (we are re-parented when it dies)."""
    return os.getppid() == parent_pid


def ignore_interrupts() -> None:
    """Child processes leave Ctrl-C to the launcher, which stops them in order."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
