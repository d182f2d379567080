"""What a decode worker and a prefill worker say to each other (typed messages of
``ipc.messages``'s registry; the KV itself travels as one binary frame after a ``KVData``).

decode -> prefill: ``KVWant`` (send me the room's KV from token ``have`` on), ``KVAck`` (it is
written; let it go), ``KVDrop`` (the request ended here; forget the room).
prefill -> decode: ``KVData`` + the KV frame, or ``KVFail`` (the room cannot be served).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.ipc.messages import message


@dataclass(frozen=True)
class NixlTarget:
    """Where a prefill worker writes a prompt's KV through NIXL (``nixl.py``): the decode
    worker's agent (its NIXL metadata, base64), its pool planes' base addresses, the slots."""

    agent: str
    metadata: str
    bases: list[int]
    slots: list[int]


@message("kv_want")
class KVWant:
    room: str
    have: int  # prompt tokens the decode worker's tree holds: send [have, length)
    length: int  # the prompt's length
    digest: str  # of the prompt's token ids: both workers must hold the same prompt
    layout: str  # of the decode worker's KV pool (``pool_layout``): both must store alike
    nixl: NixlTarget | None = None  # write the KV there through NIXL (else: send it on this socket)


@message("kv_ack")
class KVAck:
    room: str


@message("kv_drop")
class KVDrop:
    room: str
    reason: str


@message("kv_data")
class KVData:
    room: str
    have: int
    length: int
    token: int  # the first output token, sampled by the prefill worker
    logprob: float | None = None  # its logprob, when the request asked for logprobs
    top_ids: list[int] | None = None  # its top logprobs
    top_logprobs: list[float] | None = None
    prefill_s: float = 0.0  # from the prefill worker's arrival of the request to this send
    sent_at: float = 0.0  # wall clock (time.time) just before the send: the wire time, on one host
    written: bool = False  # the KV is in the decode worker's slots already (NIXL): no frame follows


@message("kv_fail")
class KVFail:
    room: str
    reason: str
    status: int = 502


def room_key(room: int, index: int | None = None) -> str:
    """The name of a request on both workers: SGLang's room number, and for choice ``index``
    of several (n > 1) or prompt ``index`` of a batch given one room, that index too."""
    return str(room) if index is None else f"{room}.{index}"


def prompt_digest(ids: Any) -> str:
    return hashlib.blake2b(np.asarray(ids, dtype=np.int64).tobytes(), digest_size=12).hexdigest()


def pool_layout(pool: Any, page_size: int) -> str:
    """What must agree between two pools for one's gathered rows to be the other's."""
    return (f"layers={pool.num_layers} kv_heads={pool.num_kv_heads} head_dim={pool.head_dim} "
            f"dtype={str(pool.dtype).removeprefix('torch.')} kv_cache_dtype={pool.kv_cache_dtype} "
            f"slot_bytes={pool.slot_bytes} page_size={page_size}")


def keepalive(sock: Any) -> None:
    """TCP keepalive on a transfer socket: a peer host that vanished without closing its
    connection is noticed within about 10 s of silence (a dead process closes it at once)."""
    import zmq

    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, 5)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, 2)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, 3)


def endpoint(host: str, port: int) -> str:
    host = host.strip("[]")
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
