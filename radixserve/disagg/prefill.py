"""The prefill worker's end of a transfer: a ROUTER socket on the bootstrap port.

A request that carries a bootstrap room is computed as any other; when its first token is
sampled the scheduler hands it here (:meth:`PrefillSide.prefilled`) instead of finishing it.
It is sent once its decode worker has asked (``KVWant``, which may come before or after the
prefill), and finished once the decode worker acknowledges: until then its KV stays locked.
:meth:`PrefillSide.poll` returns what ended: ``Ended(request)`` acknowledged, or with an error:
failed, whether parked here or still in the scheduler's lists (a decode worker that dropped the
request while it waited: it is not computed for nobody).

A room that ended is remembered for the timeout: a want for it is answered with the reason at
once, and a request that comes with it again is refused (a room is used once).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import zmq

from radixserve.disagg.nixl import NixlEnd
from radixserve.disagg.wire import KVAck, KVData, KVDrop, KVFail, KVWant, keepalive, prompt_digest
from radixserve.ipc import messages as m

logger = logging.getLogger(__name__)


@dataclass
class _Want:
    peer: bytes
    msg: KVWant
    since: float


@dataclass
class _Closed:
    since: float
    reason: str  # what a decode worker asking for the room is told
    status: int
    before_arrival: bool = False  # the decode worker dropped it before its request came here


@dataclass
class _Write:
    """A NIXL write posted, its header sent once it is done."""

    handle: Any
    peer: bytes
    header: KVData
    t0: float
    nbytes: int


@dataclass
class Ended:
    req: Any
    error: str | None = None  # None: acknowledged
    status: int = 504


class PrefillSide:
    def __init__(self, port: int, timeout_s: float, pool: Any, req_pool: Any, layout: str,
                 nixl: NixlEnd | None = None) -> None:
        self.timeout_s = timeout_s
        self.nixl = nixl
        self.pool, self.req_pool, self.layout = pool, req_pool, layout
        self.sock = zmq.Context.instance().socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer raises on send
        self.sock.setsockopt(zmq.IPV6, 1)
        keepalive(self.sock)
        try:
            self.sock.bind(f"tcp://*:{port}")
        except zmq.ZMQError as e:
            self.sock.close(0)
            raise ValueError(
                f"cannot listen on the disaggregation bootstrap port {port}: {e}"
            ) from None
        self.live: dict[str, Any] = {}  # room -> its request, from arrival until it ends
        self.wants: dict[str, _Want] = {}
        self.parked: dict[str, float] = {}  # prefilled, waiting for its decode worker's want
        self.sent: dict[str, float] = {}  # sent, waiting for the acknowledgement
        self.writing: dict[str, _Write] = {}  # NIXL writes in progress
        self.draining: list[Any] = []  # NIXL writes of requests that ended: released when done
        self.arrival: dict[str, float] = {}
        self.closed: dict[str, _Closed] = {}  # rooms that ended here, kept for the timeout
        self.stats = {"transfers": 0, "failed": 0, "bytes": 0, "send_s": 0.0}

    @property
    def busy(self) -> bool:
        return bool(self.parked or self.sent or self.writing)

    def holds(self, req: Any) -> bool:
        """The request is prefilled and waits here (for its want, its write, its
        acknowledgement)."""
        room = req.bootstrap.room
        return self.live.get(room) is req and (
            room in self.parked or room in self.sent or room in self.writing
        )

    def claim(self, req: Any) -> tuple[str, int] | None:
        """Take the request's room; the error and status when it cannot have it."""
        room = req.bootstrap.room
        if room in self.live:
            return f"bootstrap_room {room} is already in use on this prefill worker", 400
        closed = self.closed.get(room)
        if closed is not None:
            if closed.before_arrival:
                return closed.reason, closed.status
            return f"bootstrap_room {room} was used by an earlier request", 400
        self.live[room] = req
        self.arrival[room] = time.monotonic()
        return None

    def forget(self, req: Any, reason: str = "the prefill worker's request was aborted") -> None:
        """The request ended here: a decode worker that asked is told why."""
        room = req.bootstrap.room
        if self.live.get(room) is not req:
            return
        want = self.wants.get(room)
        self._close(room, reason, 502)
        if want is not None:
            self._send(want.peer, KVFail(room=room, reason=reason))

    def sweep(self, alive: Any) -> None:
        """Forget the rooms of requests the scheduler no longer holds (``alive``: its ids)."""
        for req in [r for r in self.live.values() if r.rid not in alive]:
            self.forget(req, "the prefill worker's request failed")

    def prefilled(self, req: Any) -> list[Ended]:
        """The request's prompt is computed and its first token sampled."""
        room = req.bootstrap.room
        self.parked[room] = time.monotonic()
        want = self.wants.get(room)
        return self._serve(room, want) if want is not None else []

    def poll(self, now: float) -> list[Ended]:
        ended: list[Ended] = []
        while True:
            try:
                frames = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) == 3:
                ended += self._receive(frames[0], frames[2])
        for room in list(self.writing):
            ended += self._check_write(room)
        for handle in [
            h for h in self.draining if self.nixl is not None and self.nixl.state(h) != "PROC"
        ]:
            self.draining.remove(handle)
            handle.release()
        for room, since in list(self.parked.items()):
            if now - since > self.timeout_s:
                ended.append(
                    self._end(
                        room,
                        f"no decode worker asked for the KV of bootstrap_room {room} "
                        f"within {self.timeout_s:g} s",
                        504,
                    )
                )
        for room, since in list(self.sent.items()):
            if now - since > self.timeout_s:
                ended.append(
                    self._end(
                        room,
                        f"the decode worker did not acknowledge the KV of bootstrap_room "
                        f"{room} within {self.timeout_s:g} s",
                        504,
                    )
                )
        for room, want in list(self.wants.items()):
            if room not in self.live and now - want.since > self.timeout_s:
                del self.wants[room]  # its prefill request never came; the decode side times out
        while self.closed:  # oldest first: rooms close in time order
            room, closed = next(iter(self.closed.items()))
            if now - closed.since <= self.timeout_s:
                break
            del self.closed[room]
        return ended

    def _receive(self, peer: bytes, data: bytes) -> list[Ended]:
        try:
            msg = m.decode(data)
        except ValueError as e:
            logger.warning("dropped a malformed message from a decode worker: %s", e)
            return []
        if isinstance(msg, KVWant):
            return self._want(peer, msg)
        if isinstance(msg, KVAck) and msg.room in self.sent:
            return [self._end(msg.room, None)]
        if isinstance(msg, KVDrop):
            reason = f"the decode worker dropped the request: {msg.reason}"
            if msg.room in self.live:
                return [self._end(msg.room, reason, 502)]
            self.wants.pop(msg.room, None)
            self.closed.pop(msg.room, None)  # re-entered at the end: the dict stays in time order
            # it may come
            self.closed[msg.room] = _Closed(time.monotonic(), reason, 502, before_arrival=True)
        return []

    def _want(self, peer: bytes, msg: KVWant) -> list[Ended]:
        held = self.wants.get(msg.room)
        if held is not None and held.peer != peer:
            self._send(
                peer,
                KVFail(
                    room=msg.room,
                    reason=f"bootstrap_room {msg.room} is already claimed by another decode worker",
                    status=400,
                ),
            )
            return []
        closed = self.closed.get(msg.room) if msg.room not in self.live else None
        if closed is not None:
            self._send(peer, KVFail(room=msg.room, reason=closed.reason, status=closed.status))
            return []
        if msg.layout != self.layout:
            reason = f"the KV layouts differ: prefill {self.layout}; decode {msg.layout}"
            self._send(peer, KVFail(room=msg.room, reason=reason, status=500))
            return [self._end(msg.room, reason, 500)] if msg.room in self.live else []
        self.wants[msg.room] = _Want(peer, msg, time.monotonic())
        return self._serve(msg.room, self.wants[msg.room]) if msg.room in self.parked else []

    def _serve(self, room: str, want: _Want) -> list[Ended]:
        """Send the KV the want asks for (the request is prefilled)."""
        req = self.live[room]
        msg = want.msg
        if msg.length != req.prompt_len or msg.digest != prompt_digest(req.prompt_ids):
            reason = (
                f"the decode worker's prompt ({msg.length} tokens) differs from the prefill "
                f"worker's ({req.prompt_len}): both must serve the same model and chat template"
            )
            self._send(want.peer, KVFail(room=room, reason=reason, status=400))
            return [self._end(room, reason, 400)]
        t0 = time.perf_counter()
        slots = self.req_pool.read(req.kv.row, msg.have, msg.length)
        lp = req.return_logprob and bool(req.out.logprobs)
        top = req.out.top_logprobs[0] if lp and req.out.top_logprobs else []
        header = KVData(room=room, have=msg.have, length=msg.length, token=int(req.output_ids[0]),
                        logprob=float(req.out.logprobs[0]) if lp else None,
                        top_ids=[int(t) for t, _ in top] if lp else None,
                        top_logprobs=[float(x) for _, x in top] if lp else None,
                        prefill_s=time.monotonic() - self.arrival[room])
        del self.parked[room]
        # both ends have NIXL: write into its slots
        if self.nixl is not None and msg.nixl is not None:
            try:
                handle = self.nixl.write(slots, msg.nixl, room)
            except (RuntimeError, ValueError) as e:
                self._send(want.peer, KVFail(room=room, reason=f"the NIXL transfer failed: {e}"))
                return [self._end(room, f"the NIXL transfer failed: {e}", 502)]
            self.writing[room] = _Write(
                handle, want.peer, header, t0, len(slots) * self.pool.bytes_per_token
            )
            return self._check_write(room)
        payload = self.pool.gather(slots).cpu().numpy()
        header.sent_at = time.time()
        if not self._send(want.peer, header, payload):
            return [self._end(room, "the decode worker went away before the KV was sent", 502)]
        self._sent(room, t0, payload.nbytes)
        return []

    def _check_write(self, room: str) -> list[Ended]:
        """A NIXL write in progress: once done, tell the decode worker (the header alone)."""
        w = self.writing[room]
        state = self.nixl.state(w.handle) if self.nixl is not None else "ERR"
        if state == "PROC":
            return []
        del self.writing[room]
        w.handle.release()
        if state != "DONE":
            self._send(w.peer, KVFail(room=room, reason="the NIXL transfer failed"))
            return [self._end(room, "the NIXL transfer to the decode worker failed", 502)]
        w.header.written = True
        w.header.sent_at = time.time()
        if not self._send(w.peer, w.header):
            return [self._end(room, "the decode worker went away before the KV was written", 502)]
        self._sent(room, w.t0, w.nbytes)
        return []

    def _sent(self, room: str, t0: float, nbytes: int) -> None:
        self.stats["send_s"] += time.perf_counter() - t0
        self.stats["bytes"] += nbytes
        self.sent[room] = time.monotonic()

    def _send(self, peer: bytes, msg: Any, payload: Any = None) -> bool:
        frames = (
            [peer, b"", m.encode(msg)]
            + ([memoryview(payload).cast("B")] if payload is not None else [])
        )
        try:
            self.sock.send_multipart(frames, zmq.DONTWAIT, copy=payload is None)
        except zmq.ZMQError:  # EHOSTUNREACH: the peer is gone; EAGAIN: it reads nothing
            return False
        return True

    def _close(self, room: str, reason: str, status: int) -> Any:
        req = self.live.pop(room)
        for table in (self.arrival, self.parked, self.sent, self.wants):
            table.pop(room, None)
        write = self.writing.pop(room, None)
        if write is not None:  # ended mid-write (aborted): released once NIXL is done with it
            self.draining.append(write.handle)
        self.closed[room] = _Closed(
            time.monotonic(), reason or f"bootstrap_room {room} was served already", status
        )
        return req

    def _end(self, room: str, error: str | None, status: int = 504) -> Ended:
        req = self._close(room, error or "", 400 if error is None else status)
        self.stats["transfers" if error is None else "failed"] += 1
        if error is not None:
            logger.warning("request %s (bootstrap_room %s) failed: %s", req.rid, room, error)
        return Ended(req, error, status)

    def close(self) -> None:
        self.sock.close(0)
        if self.nixl is not None:
            self.nixl.close()
