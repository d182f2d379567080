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

from radixserve.disagg.nixl import NixlEnd
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
    hold: bool = False  # its slots stay reserved (a NIXL write may still land): freed when released


class DecodeSide:
    def __init__(
        self, timeout_s: float, layout: str, bytes_per_token: int, nixl: NixlEnd | None = None
    ) -> None:
        self.timeout_s = timeout_s
        self.bytes_per_token = bytes_per_token
        self.layout = layout
        self.nixl = nixl
        self.ctx = zmq.Context.instance()
        self.socks: dict[str, zmq.Socket] = {}
        self.monitors: dict[str, zmq.Socket] = {}
        self.queue: deque[Any] = deque()  # waiting for KV slots
        self.queued_at: dict[str, float] = {}
        self.inflight: dict[tuple[str, str], Transfer] = {}  # (endpoint, room)
        # Requests that ended while a NIXL write into their slots may be under way: the slots
        # stay theirs until the prefill worker answers for the room (or the timeout).
        self.held: dict[tuple[str, str], Transfer] = {}
        self.stats = {
            "transfers": 0,
            "failed": 0,
            "bytes": 0,
            "wait_s": 0.0,
            "wire_s": 0.0,
            "write_s": 0.0,
        }

    @property
    def busy(self) -> bool:
        return bool(self.queue or self.inflight or self.held)

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
            return (
                f"bootstrap_host {req.bootstrap.host!r} and bootstrap_port {req.bootstrap.port} "
                f"are no address: {e}"
            )
        self.queue.append(req)
        self.queued_at[req.rid] = time.monotonic()
        return None

    def want(self, req: Any, slots: Any) -> bool:
        """The request holds its slots (``slots``: those of ``[have, length)``): ask its prefill
        worker for the KV past its cached prefix, written there through NIXL when this worker
        has it.  False when the ask cannot be queued (the prefill worker reads nothing)."""
        self.queue.remove(req)
        self.queued_at.pop(req.rid, None)
        ep, room = self.key(req)
        target = self.nixl.target(slots) if self.nixl is not None else None
        if not self._send(
            ep,
            KVWant(
                room=room,
                have=req.kv.cached_len,
                length=req.prompt_len,
                digest=prompt_digest(req.prompt_ids),
                layout=self.layout,
                nixl=target,
            ),
        ):
            return False
        self.inflight[(ep, room)] = Transfer(req, ep, time.monotonic())
        return True

    def forget(self, req: Any, reason: str = "aborted") -> str:
        """The request ended here; its prefill worker is told.  "free": it waited here and its
        slots can go; "hold": a NIXL write may be landing in them, they go when the prefill
        worker answers (:meth:`poll`'s ``released``); "": it was not here."""
        key = self.key(req)
        if req in self.queue:
            self.queue.remove(req)
            self.queued_at.pop(req.rid, None)
            where = "free"
        elif self.inflight.get(key, Transfer(None, "", 0)).req is req:
            t = self.inflight.pop(key)
            where = "free"
            if self.nixl is not None:
                self.held[key] = Transfer(req, t.endpoint, time.monotonic())
                where = "hold"
        else:
            return ""
        self.drop(*key, reason)
        return where

    def drop(self, ep: str, room: str, reason: str) -> None:
        """Tell the prefill worker that the room ended here (its KV, sent or not, is not wanted)."""
        self._send(ep, KVDrop(room=room, reason=reason))

    def poll(self, now: float) -> tuple[list[Arrival], list[Failed], list[Any]]:
        """The KV that arrived, the requests that failed, and the requests whose held slots
        can be freed now."""
        arrivals: list[Arrival] = []
        failed: list[Failed] = []
        released: list[Any] = []
        if self.nixl is not None and (self.inflight or self.held):
            self.nixl.progress()
        for ep, sock in list(self.socks.items()):
            while True:
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._receive(ep, frames, arrivals, failed, released)
            self._watch(ep, failed, released)
        for key, t in list(self.inflight.items()):
            if now - t.since > self.timeout_s:
                del self.inflight[key]
                self._send(key[0], KVDrop(room=key[1], reason="timed out"))
                if self.nixl is not None:
                    self.held[key] = Transfer(t.req, t.endpoint, now)
                failed.append(
                    Failed(
                        t.req,
                        f"no KV arrived from the prefill worker at {key[0]} for "
                        f"bootstrap_room {key[1]} within {self.timeout_s:g} s",
                        504,
                        hold=self.nixl is not None,
                    )
                )
        for req in list(self.queue):
            if now - self.queued_at[req.rid] > self.timeout_s:
                self.forget(req)
                failed.append(
                    Failed(
                        req,
                        f"the decode worker had no KV slots for the request within "
                        f"{self.timeout_s:g} s",
                        503,
                    )
                )
        for key, t in list(self.held.items()):
            if now - t.since > self.timeout_s:
                released.append(self.held.pop(key).req)
        self.stats["failed"] += len(failed)
        return arrivals, failed, released

    def _receive(self, ep: str, frames: list[Any], arrivals: list[Arrival], failed: list[Failed],
                 released: list[Any]) -> None:
        try:
            if len(frames) < 2:
                raise ValueError(f"{len(frames)} frame(s)")
            msg = m.decode(frames[1].bytes)
        except ValueError as e:
            logger.warning("dropped a malformed message from the prefill worker at %s: %s", ep, e)
            return
        if not isinstance(msg, (KVData, KVFail)):
            return
        held = self.held.pop((ep, msg.room), None)
        if held is not None:  # the prefill worker is done with the room: nothing writes there now
            released.append(held.req)
            return
        t = self.inflight.pop((ep, msg.room), None)
        if t is None:
            return  # a room that already ended here (aborted, timed out)
        if isinstance(msg, KVFail):
            failed.append(
                Failed(
                    t.req,
                    f"the prefill worker at {ep} failed the request: {msg.reason}",
                    msg.status,
                )
            )
            return
        with warnings.catch_warnings():  # read-only: the pool copies out of it
            warnings.simplefilter("ignore")
            kv = (
                torch.frombuffer(frames[2].buffer, dtype=torch.uint8)
                if len(frames) > 2
                else torch.empty(0)
            )
        self.stats["wait_s"] += time.monotonic() - t.since
        self.stats["wire_s"] += max(0.0, time.time() - msg.sent_at)
        self.stats["bytes"] += (
            kv.numel() if not msg.written else (msg.length - msg.have) * self.bytes_per_token
        )
        arrivals.append(Arrival(t, msg, kv))

    def ack(self, ep: str, room: str) -> None:
        self._send(ep, KVAck(room=room))

    def _send(self, ep: str, msg: Any) -> bool:
        try:
            self._socket(ep).send_multipart([b"", m.encode(msg)], zmq.DONTWAIT)
        # EAGAIN: a thousand messages wait for a prefill worker that reads none
        except zmq.ZMQError:
            return False
        return True

    def _watch(self, ep: str, failed: list[Failed], released: list[Any]) -> None:
        """A closed connection to a prefill worker fails what it still owed."""
        mon = self.monitors[ep]
        while True:
            try:
                event = recv_monitor_message(mon, zmq.NOBLOCK)
            except zmq.Again:
                return
            if event["event"] != zmq.EVENT_DISCONNECTED:
                continue
            for key in [k for k in self.held if k[0] == ep]:
                released.append(self.held.pop(key).req)
            for key, t in list(self.inflight.items()):
                if key[0] == ep:
                    del self.inflight[key]
                    # read if the prefill worker comes back
                    self.drop(*key, "the connection closed")
                    failed.append(
                        Failed(
                            t.req,
                            f"the connection to the prefill worker at {ep} closed "
                            "before its KV arrived",
                            502,
                        )
                    )

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
        if self.nixl is not None:
            self.nixl.close()
        for ep, sock in self.socks.items():
            sock.disable_monitor()
            self.monitors[ep].close(0)
            sock.close(0)
