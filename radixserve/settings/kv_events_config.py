"""``--kv-events-config``: the KV event publisher's settings, SGLang's JSON object with SGLang's
names and defaults::

    {"publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558",
     "topic": "", "buffer_steps": 10000, "hwm": 100000, "max_queue_size": 100000}

Parsed and checked here, where ``ServerArgs`` can refuse a bad value before anything loads;
the publisher itself is ``ipc/kv_publisher.py``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any


@dataclass(frozen=True)
class KVEventsConfig:
    publisher: str = "null"  # null (off) or zmq
    # PUB: bound when it is a wildcard, ipc or inproc, else connected
    endpoint: str = "tcp://*:5557"
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
        kinds = {
            "publisher": str,
            "endpoint": str,
            "bind": (bool, type(None)),
            "replay_endpoint": (str, type(None)),
            "buffer_steps": int,
            "hwm": int,
            "max_queue_size": int,
            "topic": str,
            "format": str,
        }
        for key, value in raw.items():
            if not isinstance(value, kinds[key]) or (
                kinds[key] is int and (isinstance(value, bool) or value < 1)
            ):
                raise ValueError(
                    f"kv_events_config: {key!r} has the wrong type or value: {value!r}"
                )
        config = cls(**raw)
        if config.publisher not in ("null", "zmq"):
            raise ValueError(
                f"kv_events_config: publisher must be zmq or null, got {config.publisher!r}"
            )
        if config.format != "default":
            raise ValueError(f"kv_events_config: format must be default, got {config.format!r}")
        for key in ("endpoint", "replay_endpoint"):
            value = getattr(config, key)
            if value is not None and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ValueError(
                    f"kv_events_config: {key} must be a tcp://, ipc:// or inproc:// address, "
                    f"got {value!r}"
                )
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
        out: dict[str, Any] = {
            "publisher": "zmq",
            "endpoint_host": pub[0],
            "endpoint_port_base": pub[1],
            "topic": self.topic,
            "block_size": block_size,
            "dp_size": 1,
        }
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
