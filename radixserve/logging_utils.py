"""What the scheduler and detokenizer processes share: logging, signals, parent liveness,
sockets."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
from collections.abc import Callable

import zmq


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


_SIGTERM_HOOKS: list[Callable[[], None]] = []
_SIGNAL_WAKEUP: list[int] = []  # the read end of the signal wake-up pipe, once set
_POLLERS: dict[zmq.Socket, zmq.Poller] = {}  # wait_for_input's, by socket


def on_sigterm(hook: Callable[[], None]) -> None:
    """Run ``hook`` (briefly: the launcher kills after 5 s) when SIGTERM stops this process."""
    _SIGTERM_HOOKS.append(hook)


def exit_on_sigterm(process: str) -> None:
    """SIGTERM (the launcher stopping us, e.g. because the other process died) exits at once,
    as its default action would, but with a log line saying so (after the ``on_sigterm`` hooks)."""

    def stop(signum: int, frame: object) -> None:
        logging.getLogger("radixserve").info(
            "%s stops: asked to by the launcher (SIGTERM)", process
        )
        for hook in _SIGTERM_HOOKS:
            try:
                hook()
            except Exception:
                logging.getLogger("radixserve").exception("a shutdown hook failed")
        for handler in logging.getLogger().handlers:
            handler.flush()
        # then die of it: exit code -15, as without the hook
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    if not _SIGNAL_WAKEUP:
        # A signal may land on another thread (zmq's I/O thread, torch's workers): the main
        # thread's poll is then not interrupted, and the handler would wait for its timeout.
        # The C handler writes the signal's number here; wait_for_input polls it too.
        read, write = os.pipe()
        os.set_blocking(read, False)
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        _SIGNAL_WAKEUP.append(read)


def wait_for_input(sock: zmq.Socket, timeout_ms: int) -> bool:
    """``sock.poll(timeout_ms)``, also returning (False) as soon as a signal arrives, so that its
    handler runs at once: the launcher's SIGTERM stops an idle process in milliseconds."""
    if not _SIGNAL_WAKEUP:
        return bool(sock.poll(timeout_ms))
    poller = _POLLERS.get(sock)
    if poller is None:  # one per socket: the detokenizer and TP ranks wait once per step
        poller = _POLLERS[sock] = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(_SIGNAL_WAKEUP[0], zmq.POLLIN)
    ready = dict(poller.poll(timeout_ms))
    if _SIGNAL_WAKEUP[0] in ready:
        with contextlib.suppress(OSError):
            os.read(_SIGNAL_WAKEUP[0], 64)
    return sock in ready


def open_pipeline_sockets(in_addr: str, out_addr: str) -> tuple[zmq.Socket, zmq.Socket]:
    """A PULL socket bound at ``in_addr`` and a PUSH socket connected to ``out_addr``.

    LINGER 0: pending messages never keep an exiting process alive; SNDHWM 0: sends queue
    instead of blocking when the peer is slow or gone.
    """
    ctx = zmq.Context.instance()
    ctx.setsockopt(zmq.LINGER, 0)
    ctx.setsockopt(zmq.SNDHWM, 0)
    recv = ctx.socket(zmq.PULL)
    recv.bind(in_addr)
    send = ctx.socket(zmq.PUSH)
    send.connect(out_addr)
    return recv, send
