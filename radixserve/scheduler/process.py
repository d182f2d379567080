"""Scheduler process: socket I/O around :class:`Scheduler`."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from collections.abc import Iterator, Sequence
from typing import Any

import zmq

from radixserve.distributed import TensorParallelError
from radixserve.ipc import messages as m
from radixserve.scheduler.control import CONTROL_MESSAGES, run_control

logger = logging.getLogger(__name__)
STATS_LOG_INTERVAL_S = 10.0


def _handle(sched: Any, msg: Any, send: zmq.Socket) -> None:
    if isinstance(msg, m.GenerateReq):
        err = sched.add_request(msg)
        if err is not None:
            send.send(m.encode(err))
    elif isinstance(msg, m.AbortReq):
        sched.abort(msg.rid)
    elif isinstance(msg, CONTROL_MESSAGES):
        send.send(m.encode(m.ControlOut(cid=msg.cid, result=run_control(sched, msg))))
    else:
        logger.error("scheduler got an unexpected message %r", type(msg).__name__)


def handle_frame(sched: Any, data: bytes, send: zmq.Socket) -> None:
    """One incoming frame, behind the process's exception boundary.

    A frame that does not decode is logged and dropped, except a request whose id can be
    read, which is answered with an ErrorOut (400) saying what is wrong (a sampling value
    its record refuses); a message whose handling raises (anything, not only ValueError) is
    logged with its traceback and answered where it can be: a request with an ErrorOut (500),
    a control call with an ``error`` result.
    """
    try:
        msg = m.decode(data)
    except Exception as e:  # ValueError: not JSON, or not a well-typed message
        rid = m.request_id(data)
        if rid is None:
            logger.error("dropped a malformed message: %s", e)
        else:
            logger.warning("refused a malformed request %s: %s", rid, e)
            send.send(m.encode(m.ErrorOut(rid=rid, message=str(e), status=400)))
        return
    try:
        _handle(sched, msg, send)
    except Exception as e:
        logger.exception("handling a %r message failed", type(msg).TYPE)
        reason = f"internal error in the scheduler: {e!r}"
        if isinstance(msg, m.GenerateReq):
            sched.drop(msg.rid)
            send.send(m.encode(m.ErrorOut(rid=msg.rid, message=reason, status=500)))
        elif isinstance(msg, CONTROL_MESSAGES):
            send.send(m.encode(m.ControlOut(cid=msg.cid, result={"error": reason})))


def _fail_in_flight(sched: Any, send: zmq.Socket, reason: str, also: Sequence[str] = ()) -> None:
    """After an internal error, answer every live request (and the rids in ``also``, whose
    output could not be sent) with an error and drop it."""
    rids = dict.fromkeys([*sched.reqs, *also])
    for rid in rids:
        sched.drop(rid)
        send.send(m.encode(m.ErrorOut(rid=rid, message=reason, status=500)))


@contextlib.contextmanager
def sync_debug(device: Any) -> Iterator[None]:
    """``RADIXSERVE_SYNC_DEBUG=warn|error`` on CUDA: torch flags every host-device sync
    inside the step (the one read-back of sampled tokens waits on an event, which it allows).
    A sync in ``error`` mode fails the step, so its requests get the error."""
    mode = os.environ.get("RADIXSERVE_SYNC_DEBUG", "")
    if device.type != "cuda" or mode not in ("warn", "error"):
        yield
        return
    import torch

    torch.cuda.set_sync_debug_mode(mode)
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def _run_step(sched: Any, send: zmq.Socket) -> None:
    """One scheduler step and the sending of its output; an error fails what is in flight.
    A failed tensor-parallel collective is raised on: the group cannot step again."""
    unsent: list[str] = []  # rids of a step output that could not be sent
    try:
        with sync_debug(sched.device):
            out = sched.step()
        if out is not None:
            unsent = list(out.rids)
            send.send(m.encode(out))
            unsent = []
        for err in sched.take_errors():
            send.send(m.encode(err))
    except TensorParallelError as e:
        _fail_in_flight(sched, send, f"the tensor-parallel group failed: {e}", also=unsent)
        raise
    except Exception as e:  # logged and answered: every in-flight request gets an error
        logger.exception("scheduler step failed")
        _fail_in_flight(sched, send, f"internal error in the scheduler: {e!r}", also=unsent)


def serve(sched: Any, recv: zmq.Socket, send: zmq.Socket) -> None:
    """The loop: take every waiting frame, step while there is work, log the statistics."""
    from radixserve.logging_utils import parent_alive, wait_for_input

    parent = os.getppid()
    last_log = time.monotonic()
    last_gen = 0
    while True:
        if not parent_alive(parent):  # checked busy or idle: never outlive the launcher
            logger.info("launcher is gone; scheduler exits")
            sched.close()
            return
        if not sched.has_work and not wait_for_input(recv, 1000):
            continue
        while True:
            try:
                data = recv.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            handle_frame(sched, data, send)
        sched.publish_kv_events()  # an abort or a flush changes the tree too
        if not sched.has_work:
            continue
        try:
            _run_step(sched, send)
            sched.publish_kv_events()
        except TensorParallelError as e:
            logger.error("%s; the scheduler stops", e)
            sys.exit(1)
        # wait for a grammar or a transfer without spinning (or for new input)
        if sched.nothing_to_run:
            recv.poll(2)
        if time.monotonic() - last_log > STATS_LOG_INTERVAL_S:
            try:
                last_gen = _log_stats(sched, time.monotonic() - last_log, last_gen)
            except Exception:  # a statistics bug must not stop the serving
                logger.exception("could not log the statistics")
            last_log = time.monotonic()


def _log_stats(sched: Any, interval: float, last_gen: int) -> int:
    s = sched.get_stats()
    used = s["total_pages"] - s["free_pages"]
    logger.info(
        "running %d, queued %d, KV pages used %d/%d (tree %d tokens), hit rate %.1f%%, "
        "%.1f gen tokens/s",
        s["running"], s["waiting"], used, s["total_pages"], s["tree_tokens"],
        100 * s["cache_hit_rate"], (s["generation_tokens"] - last_gen) / max(interval, 1e-6),
    )
    return s["generation_tokens"]
