"""SGLang's scheduler gRPC service beside the HTTP server (``--grpc-port``): what smg talks to
a ``grpc://`` worker with.  smg tokenizes, renders chat templates and detokenizes itself; the
worker takes token ids and streams token ids back.  The service is ``SglangScheduler`` of
``smg-grpc-proto`` (``pip install "radixserve[router]"``).

- ``Generate``: a request of token ids and SGLang's sampling parameters, streamed back as chunks
  of new token ids and a closing ``complete`` (finish reason, matched stop, token counts,
  cached tokens, logprobs when asked).  A bad request is ``INVALID_ARGUMENT`` with the same
  message the HTTP routes give; a client that cancels aborts the request in the scheduler.
- ``SubscribeKvEvents``: the worker's KV events (``--kv-events-config``) as smg's batches, which
  its event-driven cache-aware routing reads.  A subscriber from sequence 0 (or from one the
  replay no longer reaches) first gets a snapshot of the whole tree (one batch, marked as a
  snapshot, that starts with AllBlocksCleared); one that resumes gets the batches it missed
  from the publisher's replay; then the live stream, in order, without gaps or repeats.
- ``HealthCheck``, ``Abort``, ``GetModelInfo``, ``GetServerInfo``, ``GetLoads``, ``FlushCache``
  and ``GetTokenizer`` (the model folder's tokenizer files as a zip) as SGLang answers them.
"""

from __future__ import annotations

import asyncio
import hashlib
import io
import json
import logging
import os
import time
import uuid
import zipfile
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import zmq
import zmq.asyncio

from radixserve import __version__
from radixserve.frontend.errors import APIError
from radixserve.frontend.loads import load_snapshot, parse_include
from radixserve.frontend.native_api import hf_config
from radixserve.runtime.jobs import bootstraps
from radixserve.runtime.tokenizer_manager import RequestError, SchedulingHints
from radixserve.settings.kv_events_config import KVEventsConfig, local_endpoint

if TYPE_CHECKING:
    import grpc

    from radixserve.frontend.state import ServerState

logger = logging.getLogger(__name__)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "tokenizer.model", "added_tokens.json",
                   "chat_template.jinja", "generation_config.json", "config.json")
TIERS = {"GPU": 1, "CPU_PINNED": 2, "DISK": 3}  # medium -> smg's KvCacheTier


def _protos() -> tuple[Any, Any, Any]:
    try:
        from smg_grpc_proto.generated import (
            common_pb2,
            sglang_scheduler_pb2,
            sglang_scheduler_pb2_grpc,
        )
    except ImportError as e:
        raise RuntimeError(
            "--grpc-port needs grpcio and smg-grpc-proto: pip install 'radixserve[router]'"
        ) from e
    return common_pb2, sglang_scheduler_pb2, sglang_scheduler_pb2_grpc


def sampling_dict(p: Any) -> dict[str, Any]:
    """SGLang's proto SamplingParams as radixserve's sampling fields.  proto3 cannot tell an unset
    number from 0: 0 means SGLang's default where 0 is not a meaningful value (top_p,
    top_k, repetition_penalty)."""
    d: dict[str, Any] = {
        "temperature": p.temperature, "top_p": p.top_p or 1.0,
        "top_k": p.top_k if p.top_k > 0 else -1,
        "min_p": p.min_p, "frequency_penalty": p.frequency_penalty,
        "presence_penalty": p.presence_penalty,
        "repetition_penalty": p.repetition_penalty or 1.0, "stop": list(p.stop),
        "stop_token_ids": list(p.stop_token_ids), "ignore_eos": p.ignore_eos,
        "no_stop_trim": p.no_stop_trim,
        "min_new_tokens": p.min_new_tokens, "skip_special_tokens": p.skip_special_tokens,
    }
    if p.HasField("max_new_tokens"):
        d["max_new_tokens"] = p.max_new_tokens
    if p.logit_bias:
        d["logit_bias"] = {str(k): v for k, v in p.logit_bias.items()}
    constraint = p.WhichOneof("constraint")
    if constraint is not None:
        d[{"ebnf_grammar": "ebnf"}.get(constraint, constraint)] = getattr(p, constraint)
    return d


def tokenizer_zip(folder: str) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for name in TOKENIZER_FILES:
            path = os.path.join(folder, name)
            if os.path.isfile(path):
                z.write(path, name)
    return buf.getvalue()


def make_servicer(st: ServerState) -> Any:
    """The service's handler object: :class:`SchedulerService` on the generated base class."""
    common, pb, pbg = _protos()
    import grpc

    cls = type("SglangScheduler", (SchedulerService, pbg.SglangSchedulerServicer), {})
    return cls(st, common, pb, grpc)


class SchedulerService:
    """The RPCs (module docstring); ``common``, ``pb``: the generated messages, ``grpc``: the
    module (imported only when the service runs)."""

    def __init__(self, st: ServerState, common: Any, pb: Any, grpc_module: Any) -> None:
        self.st, self.common, self.pb, self.grpc = st, common, pb, grpc_module

    async def Generate(self, request: Any, context: grpc.aio.ServicerContext) -> AsyncIterator[Any]:
        rid = request.request_id or uuid.uuid4().hex
        hints = SchedulingHints()
        if request.HasField("disaggregated_params") and request.disaggregated_params.bootstrap_host:
            d = request.disaggregated_params  # smg's PD mode (radixserve/disagg)
            hints = SchedulingHints(bootstrap=bootstraps(d.bootstrap_host, d.bootstrap_port or None,
                                                         d.bootstrap_room, 1)[0])
        if request.sampling_params.n > 1:
            await context.abort(self.grpc.StatusCode.INVALID_ARGUMENT,
                                "n > 1 is not served over gRPC; send n requests")
        logprob = request.return_logprob
        start = request.logprob_start_len if logprob and request.logprob_start_len >= 0 else -1
        try:
            ids, params = self.st.prepare(None, list(request.tokenized.input_ids),
                                          sampling_dict(request.sampling_params),
                                          logprob_start_len=start, prompt_param="input_ids")
        except APIError as e:
            await context.abort(self.grpc.StatusCode.INVALID_ARGUMENT, e.message)
        out_ids: list[int] = []
        logprobs = self.pb.OutputLogProbs()
        try:
            async for piece in self.st.stream(ids, params, stream=request.stream, logprob=logprob,
                                              top_n=request.top_logprobs_num, rid=rid,
                                              logprob_start_len=start, hints=hints):
                out_ids += piece.output_ids
                delta = _logprobs(self.pb, piece) if logprob else None
                if delta is not None and not request.stream:  # the complete carries them whole
                    logprobs.MergeFrom(delta)
                meta = piece.meta
                if request.stream and piece.output_ids:
                    yield self.pb.GenerateResponse(
                        request_id=rid,
                        chunk=self.pb.GenerateStreamChunk(
                            token_ids=piece.output_ids, prompt_tokens=meta.prompt_tokens,
                            completion_tokens=meta.completion_tokens,
                            cached_tokens=meta.cached_tokens, output_logprobs=delta,
                        ),
                    )
                if piece.finished:
                    yield self.pb.GenerateResponse(request_id=rid, complete=_complete(
                        self.pb, meta, [] if request.stream else out_ids,
                        logprobs if logprob and not request.stream else None))
        except RequestError as e:
            code = (self.grpc.StatusCode.INVALID_ARGUMENT if e.status < 500
                    else self.grpc.StatusCode.UNAVAILABLE)
            await context.abort(code, str(e))

    async def HealthCheck(self, request: Any, context: Any) -> Any:
        dead = self.st.tm.dead_reason
        return self.pb.HealthCheckResponse(healthy=not dead, message=dead or "ok")

    async def Abort(self, request: Any, context: Any) -> Any:
        found = await self.st.tm.abort(request.request_id)
        return self.pb.AbortResponse(success=bool(found),
                                     message="" if found else "no such request")

    async def GetModelInfo(self, request: Any, context: Any) -> Any:
        info, hf = self.st.info, hf_config(self.st.model_path)
        return self.pb.GetModelInfoResponse(
            model_path=self.st.model_path, tokenizer_path=info.tokenizer_path, is_generation=True,
            weight_version="default", served_model_name=self.st.model_name,
            max_context_length=info.context_length, vocab_size=info.vocab_size,
            model_type=hf.get("model_type") or "", eos_token_ids=info.eos_token_ids,
            max_req_input_len=info.context_length, architectures=hf.get("architectures") or [])

    async def GetServerInfo(self, request: Any, context: Any) -> Any:
        from google.protobuf import struct_pb2

        args = self.st.args.to_dict()
        args.pop("api_key", None)
        # as resolved (smg's PD admission)
        args["max_running_requests"] = self.st.info.max_running_requests
        server_args, sched = struct_pb2.Struct(), struct_pb2.Struct()
        server_args.update(json.loads(json.dumps(args, default=str)))
        sched.update({"max_total_num_tokens": self.st.info.max_total_tokens,
                      "max_running_requests": self.st.info.max_running_requests,
                      "page_size": self.st.info.page_size})
        return self.pb.GetServerInfoResponse(
            server_args=server_args, scheduler_info=sched,
            active_requests=self.st.inflight_requests,
            uptime_seconds=time.time() - self.st.started_at, sglang_version=__version__,
            server_type="grpc", max_total_num_tokens=self.st.info.max_total_tokens)

    async def GetLoads(self, request: Any, context: Any) -> Any:
        stats = await self.st.tm.control("stats")
        load = load_snapshot(stats, self.st.info, parse_include(",".join(request.include) or None),
                             self.st.gen_rate.update(stats["generation_tokens"]))
        fields = {f.name for f in self.pb.SchedulerLoad.DESCRIPTOR.fields}
        row = self.pb.SchedulerLoad(
            **{k: v for k, v in load.items() if k in fields and not isinstance(v, dict)},
            num_total_reqs=stats["running"] + stats["waiting"])
        return self.pb.GetLoadsResponse(timestamp=str(load["timestamp"]), version=__version__,
                                        dp_rank_count=1, loads=[row])

    async def FlushCache(self, request: Any, context: Any) -> Any:
        ok = (await self.st.tm.control("flush_cache")).get("success", False)
        return self.common.FlushCacheResponse(success=bool(ok),
                                              message="" if ok else "requests are in flight")

    async def GetTokenizer(self, request: Any, context: Any) -> AsyncIterator[Any]:
        data = tokenizer_zip(self.st.info.tokenizer_path)
        step = 1 << 20
        for at in range(0, len(data), step):
            last = at + step >= len(data)
            yield self.common.GetTokenizerChunk(
                data=data[at:at + step], sha256=hashlib.sha256(data).hexdigest() if last else "")

    async def SubscribeKvEvents(self, request: Any, context: Any) -> AsyncIterator[Any]:
        config = KVEventsConfig.of(self.st.args.kv_events_config)
        if not config.enabled:
            await context.abort(self.grpc.StatusCode.UNIMPLEMENTED,
                                "KV events are off: start radixserve with "
                                "--kv-events-config '{\"publisher\": \"zmq\", ...}'")
        async for batch in KVEventRelay(self.st, config).batches(request.start_sequence_number):
            yield _batch_proto(self.common, *batch)


class KVEventRelay:
    """One subscriber's stream of (sequence, events, is_snapshot) from the scheduler's publisher:
    a snapshot or the replay first, then live batches, in order without repeats."""

    def __init__(self, st: ServerState, config: KVEventsConfig) -> None:
        self.st, self.config = st, config

    async def batches(self, start: int) -> AsyncIterator[tuple[int, list[dict[str, Any]], bool]]:
        import msgspec

        ctx = zmq.asyncio.Context.instance()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, self.config.topic.encode())
        sub.connect(local_endpoint(self.config.endpoint))
        await asyncio.sleep(0.2)  # subscribed before anything is asked, so nothing falls between
        try:
            missed = await self._replay(ctx, start) if start > 0 else None
            snapshot = missed is None  # from the current state: the snapshot batch comes first
            if snapshot:
                next_seq = await self._snapshot()
            else:
                for seq, events in missed:
                    yield seq, events, False
                next_seq = missed[-1][0] + 1 if missed else start
            while True:
                _, seq_bytes, payload = await sub.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big")
                if seq < next_seq:
                    continue
                if seq > next_seq:  # a gap: the replay fills it, else a new snapshot starts over
                    filled = None if snapshot else await self._replay(ctx, next_seq)
                    if filled is None:
                        snapshot, next_seq = True, await self._snapshot()
                        continue
                    for seq_missed, events in filled:
                        if seq_missed < seq:
                            yield seq_missed, events, False
                _, events, _ = msgspec.msgpack.decode(payload)
                yield seq, events, snapshot
                snapshot, next_seq = False, seq + 1
        finally:
            sub.close(linger=0)

    async def _snapshot(self) -> int:
        """Have the scheduler publish the whole tree as one batch; its sequence number."""
        result = await self.st.tm.control("kv_events_snapshot")
        if "sequence" not in result:
            raise RuntimeError(result.get("error", "no KV event snapshot"))
        return result["sequence"]

    async def _replay(
        self, ctx: zmq.asyncio.Context, start: int
    ) -> list[tuple[int, list[dict[str, Any]]]] | None:
        """The kept batches from ``start``; None when the replay no longer reaches back to it."""
        import msgspec

        if self.config.replay_endpoint is None:
            return None
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(local_endpoint(self.config.replay_endpoint))
        try:
            await dealer.send_multipart([b"", start.to_bytes(8, "big")])
            out = []
            while True:
                if not await dealer.poll(10_000):
                    raise RuntimeError("the KV event replay did not answer")
                _, _, seq_bytes, payload = await dealer.recv_multipart()
                seq = int.from_bytes(seq_bytes, "big", signed=True)
                if seq == -1:
                    break
                out.append((seq, msgspec.msgpack.decode(payload)[1]))
        finally:
            dealer.close(linger=0)
        return out if not out or out[0][0] == start else None


def _batch_proto(common: Any, seq: int, events: list[dict[str, Any]], snapshot: bool) -> Any:
    out = []
    for e in events:
        if e["type"] == "BlockStored":
            size, tokens = e["block_size"], e["token_ids"]
            blocks = [common.KvBlock(block_hash=h, token_ids=tokens[i * size:(i + 1) * size],
                                     block_size=size)
                      for i, h in enumerate(e["block_hashes"])]
            stored = common.KvBlocksStored(blocks=blocks, medium=e["medium"],
                                           tier=TIERS[e["medium"]])
            if e["parent_block_hash"] is not None:
                stored.parent_block_hash = e["parent_block_hash"]
            if e.get("cache_salt"):
                stored.cache_salt = e["cache_salt"]
            out.append(common.KvCacheEvent(stored=stored))
        elif e["type"] == "BlockRemoved":
            out.append(common.KvCacheEvent(removed=common.KvBlocksRemoved(
                block_hashes=e["block_hashes"], medium=e["medium"], tier=TIERS[e["medium"]])))
        else:
            out.append(common.KvCacheEvent(cleared=common.KvCacheCleared()))
    batch = common.KvEventBatch(sequence_number=seq, timestamp=time.time(), events=out, dp_rank=0)
    if snapshot:
        batch.snapshot.CopyFrom(common.KvSnapshotChunk(index=0, count=1, blocks=sum(
            len(e.get("block_hashes", ())) for e in events if e["type"] == "BlockStored")))
    return batch


def _logprobs(pb: Any, piece: Any) -> Any:
    out = pb.OutputLogProbs(token_logprobs=[lp if lp is not None else 0.0 for lp in piece.logprobs],
                            token_ids=piece.output_ids)
    for top in piece.top_logprobs:
        out.top_logprobs.append(pb.TopLogProbs(values=[v for _, v in top],
                                               token_ids=[int(t) for t, _ in top]))
    return out


def _complete(pb: Any, meta: Any, output_ids: list[int], logprobs: Any) -> Any:
    finish = meta.finish_reason
    done = pb.GenerateComplete(output_ids=output_ids,
                               finish_reason=finish.type if finish else "stop",
                               prompt_tokens=meta.prompt_tokens,
                               completion_tokens=meta.completion_tokens,
                               cached_tokens=meta.cached_tokens, output_logprobs=logprobs)
    if finish is not None and isinstance(finish.matched, int):
        done.matched_token_id = finish.matched
    elif finish is not None and isinstance(finish.matched, str):
        done.matched_stop_str = finish.matched
    return done


async def start_grpc(st: ServerState, host: str, port: int) -> grpc.aio.Server:
    """Serve the service on ``host:port`` (started; stop it with ``await server.stop(grace)``)."""
    _, _, pbg = _protos()
    import grpc

    server = grpc.aio.server()
    pbg.add_SglangSchedulerServicer_to_server(make_servicer(st), server)
    if server.add_insecure_port(f"{host}:{port}") == 0:
        raise ValueError(f"cannot serve gRPC on {host}:{port} (in use?)")
    await server.start()
    logger.info("serving SGLang's scheduler gRPC service on %s:%d", host, port)
    return server
