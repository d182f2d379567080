"""The KV event publisher (``--kv-events-config``): SGLang's settings and wire, so that a router
that subscribes to SGLang workers (smg, Dynamo, llm-d) subscribes to radixserve's the same way.

Settings (a JSON object; SGLang's names and defaults)::

    {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
     "topic": "", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000}

The wire: a PUB socket sends each batch as three frames, ``topic``, an 8-byte big-endian
sequence number (0, 1, ... from the publisher's start) and the msgpack batch
``[timestamp, [event, ...], dp_rank]`` (events: ``cache/kv_events.py``).  The last
``buffer_steps`` batches are kept for the replay socket (ROUTER): a subscriber that joins late
or missed sequence numbers sends ``["", start_seq as 8 bytes]`` from a DEALER (or REQ) and gets
every kept batch from ``start_seq`` on, in the same three frames after its envelope, then an
end marker (sequence -1, empty topic and payload).

The publisher runs on its own thread in the scheduler process: the scheduler queues a batch
after each step that changed the tree and never waits on a subscriber.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from typing import Any

import zmq

logger = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    publisher: str = "null"  # null (off) or zmq
    endpoint: str = "tcp://*:5557"  # PUB: bound when it is a wildcard, ipc or inproc, else connected
    bind: bool | None = None  # force bind (true) or connect (false)
    replay_endpoint: str | None = None  # ROUTER for replay requests (always bound)
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""
    format: str = "default"  # SGLang's event format (its "dynamo" variant is not offered)

    @classmethod
    def of(cls, text: str | None) -> KVEventsConfig:
        """The settings ``--kv-events-config`` gives (publishing off when it is unset)."""
        return cls.parse(text) if text else cls()

    @classmethod
    def parse(cls, text: str) -> KVEventsConfig:
        """The settings from their JSON text; ValueError naming what is wrong."""
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ValueError(f"kv_events_config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ValueError("kv_events_config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ValueError(f"kv_events_config: unknown keys {unknown}; known: {sorted(known)}")
        kinds = {"publisher": str, "endpoint": str, "bind": (bool, type(None)), "replay_endpoint": (str, type(None)),
                 "buffer_steps": int, "hwm": int, "max_queue_size": int, "topic": str, "format": str}
        for key, value in raw.items():
            if not isinstance(value, kinds[key]) or (kinds[key] is int and (isinstance(value, bool) or value < 1)):
                raise ValueError(f"kv_events_config: {key!r} has the wrong type or value: {value!r}")
        config = cls(**raw)
        if config.publisher not in ("null", "zmq"):
            raise ValueError(f"kv_events_config: publisher must be zmq or null, got {config.publisher!r}")
        if config.format != "default":
            raise ValueError(f"kv_events_config: format must be default, got {config.format!r}")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(config, key)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(f"kv_events_config: {key} must be a tcp://, ipc:// or inproc:// address, "
                                 f"got {value!r}")
        return config

    @property
    def enabled(self) -> bool:
        return self.publisher == "zmq"

    def describe(self, block_size: int) -> dict[str, Any] | None:
        """SGLang's ``kv_events`` entry of ``/server_info``: where a router subscribes (the
        worker's own host when the endpoint's is a wildcard); None when nothing is published
        on a TCP port."""
        pub = _tcp_host_port(self.endpoint)
        if not self.enabled or pub is None:
            return None
        out: dict[str, Any] = {"publisher": "zmq", "endpoint_host": pub[0], "endpoint_port_base": pub[1],
                               "topic": self.topic, "block_size": block_size, "dp_size": 1}
        replay = _tcp_host_port(self.replay_endpoint)
        if replay is not None:
            out["replay_endpoint_port_base"] = replay[1]
        return out


def local_endpoint(endpoint: str) -> str:
    """The address a process on this host connects to for a publisher bound at ``endpoint``."""
    for wildcard in ("tcp://*:", "tcp://0.0.0.0:"):
        if endpoint.startswith(wildcard):
            return "tcp://127.0.0.1:" + endpoint[len(wildcard):]
    return endpoint


def _tcp_host_port(endpoint: str | None) -> tuple[str, int] | None:
    if not endpoint or not endpoint.startswith("tcp://"):
        return None
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    return (host, int(port)) if port.isdigit() else None


class KVEventPublisher:
    """PUB and replay sockets on a thread of their own (module docstring)."""

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self._queue: queue.Queue[tuple[int, list[dict[str, Any]]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        bind = config.bind
        if bind is None:
            bind = any(w in config.endpoint for w in ("*", "0.0.0.0", "::")) or not config.endpoint.startswith("tcp://")
        (self._pub.bind if bind else self._pub.connect)(config.endpoint)
        self._replay = None
        if config.replay_endpoint is not None:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self.dropped = 0  # batches refused because the queue was full
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s%s", config.endpoint,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish(self, events: list[dict[str, Any]]) -> int:
        """Queue one batch and return its sequence number (never blocks: a full queue drops
        the batch, counted, and subscribers see a gap)."""
        seq, self._next_seq = self._next_seq, self._next_seq + 1
        try:
            self._queue.put_nowait((seq, events))
        except queue.Full:
            self.dropped += 1
        return seq

    def close(self, timeout: float = 1.0) -> None:
        """Send what is queued (up to ``timeout`` seconds), then close the sockets."""
        try:
            self._queue.put(None, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._pub.close(linger=int(timeout * 1000))
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        import msgspec

        encode = msgspec.msgpack.Encoder().encode
        while True:
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if item is None:
                return
            seq, events = item
            payload = encode([time.time(), events, self.dp_rank])
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
            self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        start_seq = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= start_seq:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
