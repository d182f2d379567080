"""KV events end to end (``--kv-events-config``): a real server publishes its radix tree's
changes over ZeroMQ in SGLang's format, and a subscriber written from that format (``helpers/
kv_events.py``), joining as a router does (subscribe, then replay what it missed), knows exactly
what the worker's cache holds: the prompts it served under SGLang's block hashes, their cache
salts, what eviction moved to the host tier or dropped, and a flush.  Bad settings are refused
before the model loads."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import msgspec
import pytest
import zmq
from helpers.kv_events import KVIndex, sglang_block_hashes
from helpers.server import ServerProcess, check_memory_idle, free_port, server_info

from radixserve.config import ServerArgs

PAGE = 4


class Subscriber:
    """A router's view of one worker: SUB on the live stream, DEALER for the replay, and the
    index both feed, in sequence order without gaps or repeats."""

    def __init__(self, endpoint: str, replay: str, topic: str) -> None:
        self.ctx = zmq.Context()
        self.sub = self.ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.connect(endpoint)
        self.replay_endpoint, self.topic = replay, topic
        self.index = KVIndex()
        self.next_seq = 0
        self.batches: list[list] = []

    def _take(self, topic: bytes, seq_bytes: bytes, payload: bytes) -> None:
        assert topic == self.topic.encode()
        seq = int.from_bytes(seq_bytes, "big")
        if seq < self.next_seq:
            return  # already had it from the replay
        assert seq == self.next_seq, f"gap: sequence {seq} after {self.next_seq - 1}"
        batch = msgspec.msgpack.decode(payload)
        self.index.apply_batch(batch)
        self.batches.append(batch)
        self.next_seq += 1

    def replay(self, start: int | None = None) -> int:
        """Ask the replay socket for every kept batch from ``start`` (the next one missing);
        return how many came."""
        dealer = self.ctx.socket(zmq.DEALER)
        dealer.connect(self.replay_endpoint)
        dealer.send_multipart([b"", (self.next_seq if start is None else start).to_bytes(8, "big")])
        n = 0
        while True:
            assert dealer.poll(10_000), "the replay did not answer"
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == (-1).to_bytes(8, "big", signed=True):
                assert topic == b"" and payload == b""
                break
            self._take(topic, seq, payload)
            n += 1
        dealer.close(linger=0)
        return n

    def drain(self, until=lambda index: True, timeout: float = 20.0) -> KVIndex:
        deadline = time.monotonic() + timeout
        while True:
            while self.sub.poll(0):
                frames = self.sub.recv_multipart()
                if int.from_bytes(frames[1], "big") > self.next_seq:
                    self.replay()  # a gap (the first batches before SUB joined): fill it
                self._take(*frames)
            if until(self.index):
                return self.index
            assert time.monotonic() < deadline, f"the events never showed it: {self.index.held()}"
            self.sub.poll(200)

    def close(self) -> None:
        self.ctx.destroy(linger=0)


@pytest.fixture(scope="module")
def worker(tiny_chat_model: str) -> Iterator[tuple[ServerProcess, dict]]:
    ports = free_port(), free_port()
    config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ports[0]}", "bind": True,
              "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}", "topic": "kv"}
    srv = ServerProcess("--model", tiny_chat_model, "--served-model-name", "tiny", "--page-size", str(PAGE),
                        "--max-total-tokens", "640", "--host-cache-size", "256", "--context-length", "512",
                        "--kv-events-config", json.dumps(config)).wait_ready()
    yield srv, config
    assert srv.stop() == 0, srv.log()


@pytest.fixture
def sub(worker) -> Iterator[Subscriber]:
    _, config = worker
    s = Subscriber(config["endpoint"], config["replay_endpoint"], config["topic"])
    time.sleep(0.3)  # let SUB join
    s.replay(0)  # what the worker published before this subscriber joined
    yield s
    s.close()
    check_memory_idle(worker[0])


def generate(srv: ServerProcess, ids: list[int], max_new_tokens: int = 4, **extra) -> dict:
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}, **extra}
    r = httpx.post(srv.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def prompt(seed: int, n: int = 60) -> list[int]:
    return [(1000 + 37 * seed + 11 * i) % 49000 + 100 for i in range(n)]


def test_server_info_says_where_to_subscribe(worker) -> None:
    srv, config = worker
    described = server_info(srv)["kv_events"]
    assert described == {"publisher": "zmq", "endpoint_host": "127.0.0.1",
                         "endpoint_port_base": int(config["endpoint"].rsplit(":", 1)[1]), "topic": "kv",
                         "block_size": PAGE, "dp_size": 1,
                         "replay_endpoint_port_base": int(config["replay_endpoint"].rsplit(":", 1)[1])}


def test_a_served_prompt_is_in_the_index_under_sglangs_hashes(worker, sub) -> None:
    srv, _ = worker
    httpx.post(srv.base_url + "/flush_cache", timeout=30)
    sub.drain(lambda index: not index.held())
    ids = prompt(1)
    generate(srv, ids)
    tree_tokens = server_info(srv)["stats"]["tree_tokens"]
    index = sub.drain(lambda index: len(index.held().get("GPU", ())) * PAGE == tree_tokens)
    # The prompt's pages are there under the hashes SGLang computes from its tokens.
    assert index.prompt_blocks("GPU", ids, PAGE) == len(ids) // PAGE
    # The chain links: each page's parent is the page before it; the first has none.
    hashes = sglang_block_hashes(ids, PAGE)
    assert index.parents[hashes[0]] is None and all(index.parents[b] == a for a, b in zip(hashes, hashes[1:], strict=False))
    assert all(index.blocks["GPU"][h] == tuple(ids[i * PAGE:(i + 1) * PAGE]) for i, h in enumerate(hashes))


def test_a_salted_prompt_gets_its_own_hashes_and_salt(worker, sub) -> None:
    srv, _ = worker
    ids = prompt(2)
    generate(srv, ids, max_new_tokens=2, extra_key="tenant-7")
    salted = sglang_block_hashes(ids, PAGE, "tenant-7")
    index = sub.drain(lambda index: salted[-1] in index.held().get("GPU", ()))
    assert set(salted) <= index.held()["GPU"] and all(index.salts[h] == "tenant-7" for h in salted)
    assert not set(sglang_block_hashes(ids, PAGE)) & set(salted)


def test_eviction_to_host_and_out_and_a_flush(worker, sub) -> None:
    """A pool of 640 tokens and a host tier of 256: distinct prompts push pages to the host
    tier (stored there, removed from the pool) and out of it; at every point the index holds
    as many blocks per tier as the server's tree does; a flush clears it all."""
    srv, _ = worker
    for i in range(12):
        generate(srv, prompt(10 + i, 120), max_new_tokens=2)
    stats = server_info(srv)["stats"]
    assert stats["evicted_tokens"] > 0 and stats["host_tree_tokens"] > 0  # both tiers moved

    def agrees(index: KVIndex) -> bool:
        held = index.held()
        return (len(held.get("GPU", ())) * PAGE == stats["tree_tokens"]
                and len(held.get("CPU_PINNED", ())) * PAGE == stats["host_tree_tokens"])

    sub.drain(agrees)
    assert httpx.post(srv.base_url + "/flush_cache", timeout=30).status_code == 200
    index = sub.drain(lambda index: not index.held())
    assert {"type": "AllBlocksCleared"} in sub.batches[-1][1]
    assert index.held() == {}


def test_a_late_subscriber_rebuilds_the_same_index_from_the_replay(worker, sub) -> None:
    srv, config = worker
    generate(srv, prompt(3))
    tree_tokens = server_info(srv)["stats"]["tree_tokens"]
    live = sub.drain(lambda index: len(index.held().get("GPU", ())) * PAGE == tree_tokens)
    late = Subscriber(config["endpoint"], config["replay_endpoint"], config["topic"])
    try:
        assert late.replay(0) == sub.next_seq  # every batch since the worker started
        assert late.index.held() == live.held()
    finally:
        late.close()


def test_bad_settings_are_refused_before_the_model_loads(tiny_chat_model) -> None:
    for text, fragment in [("{not json", "not JSON"), ('{"publisher": "kafka"}', "publisher must be zmq"),
                           ('{"publisher": "zmq", "endpoint": "5557"}', "tcp://"),
                           ('{"publisher": "zmq", "port": 5557}', "unknown keys ['port']"),
                           ('{"publisher": "zmq", "buffer_steps": 0}', "'buffer_steps'"),
                           ('{"publisher": "zmq", "format": "dynamo"}', "format must be default")]:
        with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("]", r"\]")):
            ServerArgs(model=tiny_chat_model, kv_events_config=text)
    out = subprocess.run([sys.executable, "-m", "radixserve.cli", "serve", "--model", tiny_chat_model,
                          "--kv-events-config", '{"publisher": "kafka"}'], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "publisher must be zmq" in out.stderr


def test_the_disk_tier_is_announced_and_its_blocks_found_again_after_a_restart(tiny_chat_model, tmp_path) -> None:
    """A disk tier of 4 blocks (64 tokens each): every block written is stored in ``DISK`` under
    its pages' hashes, every block the tier trims is removed; a server restarted on the same
    folder announces a block of the earlier run once a request hashes its tokens again."""
    disk = tmp_path / "kv"

    def start() -> tuple[ServerProcess, Subscriber]:
        ports = free_port(), free_port()
        config = {"publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ports[0]}", "bind": True,
                  "replay_endpoint": f"tcp://127.0.0.1:{ports[1]}"}
        srv = ServerProcess("--model", tiny_chat_model, "--page-size", str(PAGE), "--max-total-tokens", "1024",
                            "--disk-cache-dir", str(disk), "--disk-cache-size", "256", "--context-length", "512",
                            "--kv-events-config", json.dumps(config)).wait_ready()
        s = Subscriber(config["endpoint"], config["replay_endpoint"], "")
        time.sleep(0.3)
        s.replay(0)
        return srv, s

    def disk_pages(srv: ServerProcess) -> int:
        stats = server_info(srv)["stats"]
        return stats["disk_blocks"] * stats["disk_block_tokens"] // PAGE

    srv, sub = start()
    try:
        first = prompt(30, 130)  # two disk blocks
        generate(srv, first, max_new_tokens=1)
        sub.drain(lambda index: len(index.held().get("DISK", ())) == disk_pages(srv) == 32)
        assert sub.index.prompt_blocks("DISK", first, PAGE) == 32  # its first 128 tokens, in order
        for i in range(4):  # eight more blocks through a tier of four: the oldest are trimmed
            generate(srv, prompt(31 + i, 130), max_new_tokens=1)
        index = sub.drain(lambda index: len(index.held().get("DISK", ())) == disk_pages(srv) == 64)
        assert index.prompt_blocks("DISK", first, PAGE) == 0  # trimmed, and said so
        last = prompt(34, 130)
    finally:
        sub.close()
        assert srv.stop() == 0, srv.log()
    srv, sub = start()  # the same folder: the blocks are there, not yet announced
    try:
        assert server_info(srv)["stats"]["disk_blocks"] == 4
        assert not sub.index.held().get("DISK")
        out = generate(srv, last, max_new_tokens=1)
        assert out["meta_info"]["cached_tokens"] >= 128  # loaded from the disk
        index = sub.drain(lambda index: index.prompt_blocks("DISK", last, PAGE) == 32)
        assert len(index.held()["DISK"]) == 32
    finally:
        sub.close()
        assert srv.stop() == 0, srv.log()
