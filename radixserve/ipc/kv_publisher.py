"""The KV event publisher (``--kv-events-config``): SGLang's settings and wire, so that a router
that subscribes to SGLang workers (smg, Dynamo, llm-d) subscribes to radixserve's the same way.

Its settings (``--kv-events-config``) are parsed by ``settings/kv_events_config.py``.

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

import logging
import queue
import threading
import time
from collections import deque
from typing import Any

import zmq

from radixserve.settings.kv_events_config import KVEventsConfig

logger = logging.getLogger(__name__)
END_SEQ = (-1).to_bytes(8, "big", signed=True)


class KVEventPublisher:
    """PUB and replay sockets on a thread of their own (module docstring)."""

    def __init__(self, config: KVEventsConfig, dp_rank: int = 0) -> None:
        self.config = config
        self.dp_rank = dp_rank
        self._queue: queue.Queue[tuple[int, list[dict[str, Any]]] | None] = queue.Queue(
            maxsize=config.max_queue_size
        )
        self._next_seq = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._ctx = zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        bind = config.bind
        if bind is None:
            bind = (
                any(w in config.endpoint for w in ("*", "0.0.0.0", "::"))
                or not config.endpoint.startswith("tcp://")
            )
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
                self._replay.send_multipart(
                    (client, b"", self._topic, seq.to_bytes(8, "big"), payload)
                )
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
