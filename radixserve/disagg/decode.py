"""The decode worker's end of a transfer: a DEALER socket per prefill worker.

A request that carries a bootstrap room waits here, not in the scheduler's queue: once the KV
pool has room for it, it takes its cached prefix from the tree and slots for the rest of its
prompt, and asks the prefill worker for that rest (``KVWant``).  :meth:`DecodeSide.poll`
returns the transfers whose KV arrived and the requests that failed: a timeout, a ``KVFail``,
or the prefill worker's connection closing while it owed KV.
"""

from __future__ import annotations

import logging
import time
import warnings
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from radixserve.disagg.wire import (
    KVAck,
    KVData,
    KVDrop,
    KVFail,
    KVWant,
    endpoint,
    keepalive,
    prompt_digest,
)
from radixserve.ipc import messages as m

logger = logging.getLogger(__name__)


@dataclass
class Transfer:
    req: Any
    endpoint: str
    since: float  # when the want was sent


@dataclass
class Arrival:
    transfer: Transfer
    data: KVData
    kv: torch.Tensor  # uint8, KVPool.gather's layout, flat


@dataclass
class Failed:
    req: Any
    error: str
    status: int


class DecodeSide:
    def __init__(self, timeout_s: float, layout: str) -> None:
        self.timeout_s = timeout_s
        self.layout = layout
        self.ctx = zmq.Context.instance()
        self.socks: dict[str, zmq.Socket] = {}
        self.monitors: dict[str, zmq.Socket] = {}
        self.queue: deque[Any] = deque()  # waiting for KV slots
        self.queued_at: dict[str, float] = {}
        self.inflight: dict[tuple[str, str], Transfer] = {}  # (endpoint, room)
        self.stats = {"transfers": 0, "failed": 0, "bytes": 0, "wait_s": 0.0, "wire_s": 0.0, "write_s": 0.0}

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.inflight)

    @staticmethod
    def key(req: Any) -> tuple[str, str]:
        b = req.bootstrap
        return endpoint(b.host, b.port), b.room

    def claim(self, req: Any) -> str | None:
        """Queue the request; the error when its room is taken or its prefill worker's address
        is not one ZeroMQ can connect to."""
        key = self.key(req)
        if key in self.inflight or any(self.key(r) == key for r in self.queue):
            return f"bootstrap_room {req.bootstrap.room} is already in use on this decode worker"
        try:
            self._socket(key[0])
        except zmq.ZMQError as e:
            return f"bootstrap_host {req.bootstrap.host!r} and bootstrap_port {req.bootstrap.port} are no address: {e}"
        self.queue.append(req)
        self.queued_at[req.rid] = time.monotonic()
        return None

    def want(self, req: Any) -> bool:
        """The request holds its slots: ask its prefill worker for the KV past its cached prefix.
        False when the ask cannot be queued (the prefill worker reads nothing)."""
        self.queue.remove(req)
        self.queued_at.pop(req.rid, None)
        ep, room = self.key(req)
        if not self._send(ep, KVWant(room=room, have=req.kv.cached_len, length=req.prompt_len,
                                     digest=prompt_digest(req.prompt_ids), layout=self.layout)):
            return False
        self.inflight[(ep, room)] = Transfer(req, ep, time.monotonic())
        return True

    def forget(self, req: Any, reason: str = "aborted") -> bool:
        """The request ended here: True when it was waiting here (its prefill worker is told)."""
        key = self.key(req)
        if req in self.queue:
            self.queue.remove(req)
            self.queued_at.pop(req.rid, None)
        elif self.inflight.get(key, Transfer(None, "", 0)).req is req:
            del self.inflight[key]
        else:
            return False
        self.drop(*key, reason)
        return True

    def drop(self, ep: str, room: str, reason: str) -> None:
        """Tell the prefill worker that the room ended here (its KV, sent or not, is not wanted)."""
        self._send(ep, KVDrop(room=room, reason=reason))

    def poll(self, now: float) -> tuple[list[Arrival], list[Failed]]:
        arrivals: list[Arrival] = []
        failed: list[Failed] = []
        for ep, sock in list(self.socks.items()):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._receive(ep, frames, arrivals, failed)
            self._watch(ep, failed)
        for key, t in list(self.inflight.items()):
            if now - t.since > self.timeout_s:
                del self.inflight[key]
                self._send(key[0], KVDrop(room=key[1], reason="timed out"))
                failed.append(Failed(t.req, f"no KV arrived from the prefill worker at {key[0]} for "
                                            f"bootstrap_room {key[1]} within {self.timeout_s:g} s", 504))
        for req in list(self.queue):
            if now - self.queued_at[req.rid] > self.timeout_s:
                self.forget(req)
                failed.append(Failed(req, f"the decode worker had no KV slots for the request within "
                                          f"{self.timeout_s:g} s", 503))
        self.stats["failed"] += len(failed)
        return arrivals, failed

    def _receive(self, ep: str, frames: list[Any], arrivals: list[Arrival], failed: list[Failed]) -> None:
        try:
            if len(frames) < 2:
                raise ValueError(f"{len(frames)} frame(s)")
            msg = m.decode(frames[1].bytes)
        except ValueError as e:
            logger.warning("dropped a malformed message from the prefill worker at %s: %s", ep, e)
            return
        t = self.inflight.pop((ep, msg.room), None) if isinstance(msg, (KVData, KVFail)) else None
        if t is None:
            return  # a room that already ended here (aborted, timed out)
        if isinstance(msg, KVFail):
            failed.append(Failed(t.req, f"the prefill worker at {ep} failed the request: {msg.reason}",
                                 msg.status))
            return
        with warnings.catch_warnings():  # read-only: the pool copies out of it
            warnings.simplefilter("ignore")
            kv = torch.frombuffer(frames[2].buffer, dtype=torch.uint8) if len(frames) > 2 else torch.empty(0)
        self.stats["wait_s"] += time.monotonic() - t.since
        self.stats["wire_s"] += max(0.0, time.time() - msg.sent_at)
        self.stats["bytes"] += kv.numel()
        arrivals.append(Arrival(t, msg, kv))

    def ack(self, ep: str, room: str) -> None:
        self._send(ep, KVAck(room=room))

    def _send(self, ep: str, msg: Any) -> bool:
        try:
            self._socket(ep).send_multipart([b"", m.encode(msg)], zmq.DONTWAIT)
        except zmq.ZMQError:  # EAGAIN: a thousand messages wait for a prefill worker that reads none
            return False
        return True

    def _watch(self, ep: str, failed: list[Failed]) -> None:
        """A closed connection to a prefill worker fails what it still owed."""
        mon = self.monitors[ep]
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            for key, t in list(self.inflight.items()):
                if key[0] == ep:
                    del self.inflight[key]
                    self.drop(*key, "the connection closed")  # read if the prefill worker comes back
                    failed.append(Failed(t.req, f"the connection to the prefill worker at {ep} closed "
                                                "before its KV arrived", 502))

    def _socket(self, ep: str) -> zmq.Socket:
        sock = self.socks.get(ep)
        if sock is None:
            sock = self.ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.IPV6, 1)
            keepalive(sock)
            try:
                sock.connect(ep)  # the address is checked here; the connection is made later
            except zmq.ZMQError:
                sock.close(0)
                raise
            self.monitors[ep] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            self.socks[ep] = sock
        return sock

    def close(self) -> None:
        for ep, sock in self.socks.items():
            sock.disable_monitor()
            self.monitors[ep].close(0)
            sock.close(0)
