"""SGLang's scheduler gRPC service (``--grpc-port``) through the generated client of
``smg-grpc-proto``, as smg calls it: Generate answers what ``/generate`` answers for the same
token ids (whole, streamed, with logprobs, with a stop token), bad requests are
INVALID_ARGUMENT and the server keeps serving, a cancelled stream aborts its request and frees
its pages, the model info, loads, flush and tokenizer answers, and the KV event stream (a
snapshot first, then live batches; a resumed stream from its sequence number)."""

from __future__ import annotations

import hashlib
import io
import json
import zipfile
from collections.abc import Iterator

import grpc
import httpx
import pytest
from helpers.assertions import assert_eventually
from helpers.kv_events import KVIndex, sglang_block_hashes
from helpers.server import ServerProcess, check_memory_idle, free_port, server_info
from smg_grpc_proto.generated import common_pb2 as common
from smg_grpc_proto.generated import sglang_scheduler_pb2 as pb
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as pbg

PAGE = 16
PROMPT = [(7 + 13 * i) % 40000 + 200 for i in range(50)]


@pytest.fixture(scope="module")
def worker(tiny_chat_model: str) -> Iterator[tuple[ServerProcess, pbg.SglangSchedulerStub]]:
    ports = [free_port() for _ in range(3)]
    events = {"publisher": "zmq", "endpoint": f"tcp://*:{ports[0]}", "replay_endpoint": f"tcp://*:{ports[1]}"}
    srv = ServerProcess("--model", tiny_chat_model, "--served-model-name", "tiny", "--page-size", str(PAGE),
                        "--max-total-tokens", "4096", "--context-length", "1024", "--grpc-port", str(ports[2]),
                        "--kv-events-config", json.dumps(events)).wait_ready()
    channel = grpc.insecure_channel(f"127.0.0.1:{ports[2]}")
    yield srv, pbg.SglangSchedulerStub(channel)
    channel.close()
    assert srv.stop() == 0, srv.log()


@pytest.fixture(autouse=True)
def memory_invariant(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if "worker" in request.fixturenames:
        check_memory_idle(request.getfixturevalue("worker")[0])


def request(ids: list[int], max_new_tokens: int = 8, stream: bool = False, **kw) -> pb.GenerateRequest:
    sampling = {"temperature": 0.0, "max_new_tokens": max_new_tokens, **kw.pop("sampling", {})}
    return pb.GenerateRequest(request_id=kw.pop("rid", ""), tokenized=pb.TokenizedInput(input_ids=ids),
                              sampling_params=pb.SamplingParams(**sampling), stream=stream, **kw)


def http_generate(srv: ServerProcess, ids: list[int], **sampling) -> dict:
    body = {"input_ids": ids, "sampling_params": {"temperature": 0, "max_new_tokens": 8, **sampling},
            "return_logprob": True}
    r = httpx.post(srv.base_url + "/generate", json=body, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def test_generate_answers_what_the_generate_route_answers(worker) -> None:
    srv, stub = worker
    direct = http_generate(srv, PROMPT)
    (whole,) = list(stub.Generate(request(PROMPT)))
    assert whole.WhichOneof("response") == "complete"
    done = whole.complete
    assert list(done.output_ids) == direct["output_ids"] and done.finish_reason == "length"
    assert (done.prompt_tokens, done.completion_tokens) == (len(PROMPT), 8)
    assert not done.HasField("output_logprobs")  # not asked for
    streamed = list(stub.Generate(request(PROMPT, stream=True)))
    chunks = [r.chunk for r in streamed[:-1]]
    assert all(r.WhichOneof("response") == "chunk" for r in streamed[:-1])
    assert [t for c in chunks for t in c.token_ids] == direct["output_ids"]
    assert [c.completion_tokens for c in chunks] == list(range(1, 9))
    assert chunks[-1].cached_tokens == (len(PROMPT) - 1) // PAGE * PAGE  # the prompt was cached just before
    assert streamed[-1].complete.finish_reason == "length" and not streamed[-1].complete.output_ids
    # Logprobs, as the HTTP route computes them.
    (scored,) = list(stub.Generate(request(PROMPT, return_logprob=True, top_logprobs_num=2)))
    got = scored.complete.output_logprobs
    want = [lp for lp, _, _ in direct["meta_info"]["output_token_logprobs"]]
    assert list(got.token_ids) == direct["output_ids"]
    assert got.token_logprobs == pytest.approx(want, abs=1e-4)
    assert all(len(top.values) == 2 and top.token_ids[0] == t for top, t in zip(got.top_logprobs, got.token_ids,
                                                                                   strict=True))
    # A stop token: finish "stop", the token named.
    stop_at = direct["output_ids"][3]
    (stopped,) = list(stub.Generate(request(PROMPT, sampling={"stop_token_ids": [stop_at]})))
    first = direct["output_ids"].index(stop_at)
    assert stopped.complete.finish_reason == "stop" and stopped.complete.matched_token_id == stop_at
    assert list(stopped.complete.output_ids) == direct["output_ids"][:first + 1]


@pytest.mark.parametrize(("kw", "fragment"), [
    ({"sampling": {"top_p": 2.0}}, "top_p"),
    ({"sampling": {"n": 2}}, "n > 1"),
    ({"sampling": {"frequency_penalty": 5.0}}, "frequency_penalty"),
])
def test_bad_requests_are_invalid_argument(worker, kw, fragment) -> None:
    srv, stub = worker
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request(PROMPT, **kw)))
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and fragment in info.value.details()
    with pytest.raises(grpc.RpcError) as info:
        list(stub.Generate(request([60000], max_new_tokens=2)))  # beyond the vocabulary
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "vocab" in info.value.details()
    assert list(stub.Generate(request(PROMPT, max_new_tokens=2)))[-1].complete.completion_tokens == 2


def test_a_cancelled_stream_aborts_its_request(worker) -> None:
    srv, stub = worker
    aborted = server_info(srv)["stats"]["requests_aborted"]
    call = stub.Generate(request(PROMPT, max_new_tokens=900, stream=True, sampling={"ignore_eos": True}))
    for _ in range(3):
        next(call)
    call.cancel()
    assert_eventually(lambda: server_info(srv)["stats"]["requests_aborted"] == aborted + 1, 20,
                      "the scheduler aborts the cancelled request")
    # Abort by id answers whether the request was there.
    assert not stub.Abort(pb.AbortRequest(request_id="no-such-request")).success


def test_model_info_loads_flush_and_tokenizer(worker, tiny_chat_model) -> None:
    srv, stub = worker
    info = stub.GetModelInfo(pb.GetModelInfoRequest())
    assert info.served_model_name == "tiny" and info.max_context_length == 1024 and info.vocab_size == 49152
    assert info.model_path == tiny_chat_model and list(info.architectures) == ["LlamaForCausalLM"]
    assert stub.HealthCheck(pb.HealthCheckRequest()).healthy
    loads = stub.GetLoads(pb.GetLoadsRequest())
    assert loads.dp_rank_count == 1 and loads.loads[0].max_total_num_tokens == 4096
    served = stub.GetServerInfo(pb.GetServerInfoRequest())
    assert served.server_type == "grpc" and served.max_total_num_tokens == 4096
    assert stub.FlushCache(common.FlushCacheRequest()).success
    assert server_info(srv)["stats"]["tree_tokens"] == 0
    chunks = list(stub.GetTokenizer(common.GetTokenizerRequest()))
    data = b"".join(c.data for c in chunks)
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    names = zipfile.ZipFile(io.BytesIO(data)).namelist()
    assert "tokenizer.json" in names and "tokenizer_config.json" in names


def test_kv_events_stream_a_snapshot_then_live_batches_and_resume(worker) -> None:
    srv, stub = worker
    stub.FlushCache(common.FlushCacheRequest())
    list(stub.Generate(request(PROMPT, max_new_tokens=4)))  # in the tree before anyone subscribes
    stream = stub.SubscribeKvEvents(common.SubscribeKvEventsRequest(start_sequence_number=0))
    index = KVIndex()

    def apply(batch) -> None:
        for e in batch.events:
            kind = e.WhichOneof("data")
            if kind == "cleared":
                index.apply({"type": "AllBlocksCleared"})
            elif kind == "stored":
                s = e.stored
                index.apply({"type": "BlockStored", "block_hashes": [b.block_hash for b in s.blocks],
                             "token_ids": [t for b in s.blocks for t in b.token_ids], "block_size": PAGE,
                             "parent_block_hash": s.parent_block_hash if s.HasField("parent_block_hash") else None,
                             "medium": s.medium})
            else:
                index.apply({"type": "BlockRemoved", "block_hashes": list(e.removed.block_hashes),
                             "medium": e.removed.medium})

    first = next(stream)
    assert first.HasField("snapshot") and first.snapshot.count == 1
    assert first.events[0].WhichOneof("data") == "cleared"
    apply(first)
    assert index.prompt_blocks("GPU", PROMPT, PAGE) == len(PROMPT) // PAGE  # the tree as it was
    other = [t + 1 for t in PROMPT]
    list(stub.Generate(request(other, max_new_tokens=4)))
    live = next(stream)
    assert live.sequence_number == first.sequence_number + 1 and not live.HasField("snapshot")
    apply(live)
    assert index.prompt_blocks("GPU", other, PAGE) == len(other) // PAGE
    assert all(e.stored.tier == common.KV_CACHE_TIER_DEVICE for e in live.events)
    assert {b for e in live.events for b in (x.block_hash for x in e.stored.blocks)} >= set(
        sglang_block_hashes(other, PAGE))
    stream.cancel()
    # Resuming from the live batch's sequence number gets that batch again, from the replay.
    resumed = stub.SubscribeKvEvents(common.SubscribeKvEventsRequest(start_sequence_number=live.sequence_number))
    again = next(resumed)
    assert again.sequence_number == live.sequence_number and again.events == live.events
    resumed.cancel()
