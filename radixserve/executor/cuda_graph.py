"""Decode forwards replayed from captured CUDA graphs.

A decode step of a small model on a GPU is mostly kernel-launch time: a few hundred launches
of microsecond kernels.  At start-up the runner captures one decode forward per batch-size
bucket (1, 2, 4, 8, then every 8 to 64, then every 16 to ``--cuda-graph-max-bs``) over static
buffers; a decode batch of ``bs`` requests then copies its arrays into the buffers of the
smallest bucket that holds it and replays that graph: one launch for the whole forward.

Static state of a graph: the input buffers below (rows ``[bs, bucket)`` are padding: their new
token's K/V goes to slot 0, the allocator's padding page, and their logits are not read), the
attention backend's decode plan over them (a fixed split count per bucket; the split-KV
workspace allocated once, before any capture), and the logits it writes.  Prefill and mixed
batches, batches asking for extra logit rows (prompt logprobs), batches above the largest bucket
and batches the backend wants to run otherwise (a shared prefix read once per group) run eagerly.

Without CUDA (tests on a CPU) the same runner replays by running the forward over the same
static buffers and plan: everything but the capture itself is exercised.
"""

from __future__ import annotations

import bisect
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve.batch import ForwardBatch
from radixserve.transfer import Upload

logger = logging.getLogger(__name__)


def graph_buckets(max_bs: int) -> list[int]:
    """Batch sizes captured: 1, 2, 4, 8, every 8 to 64, every 16 beyond, and ``max_bs``."""
    sizes = [1, 2, 4, 8, *range(16, 65, 8), *range(80, max_bs + 1, 16)]
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


@dataclass
class _StaticInputs:
    input_ids: torch.Tensor  # [max_bs] int64
    positions: torch.Tensor
    out_cache_loc: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    token_idx: torch.Tensor  # arange: token b is request b, and the LM head reads every row


class DecodeGraphs:
    """Captured (or, without CUDA, replayed eagerly) decode forwards for batch-size buckets."""

    def __init__(
        self,
        model: torch.nn.Module,
        backend: Any,
        kv_pool: Any,
        req_to_token: torch.Tensor,
        max_bs: int,
        max_context_len: int,
        device: torch.device,
    ) -> None:
        self.model, self.backend, self.kv_pool = model, backend, kv_pool
        self.req_to_token = req_to_token
        self.device = torch.device(device)
        self.buckets = graph_buckets(max_bs)
        self.max_bs = self.buckets[-1]
        self.use_cuda_graph = self.device.type == "cuda"
        upload = Upload(self.device)  # (on a CPU each buffer is its array: one array each)
        staged = (
            [upload.add(np.zeros(self.max_bs)) for _ in range(5)]
            + [upload.add(np.arange(self.max_bs))]
        )
        upload.send()
        self.inputs = _StaticInputs(
            *[s if isinstance(s, torch.Tensor) else s.tensor for s in staged]
        )
        self.inputs.seq_lens.fill_(1)
        # The backend's per-bucket decode plans over the static inputs; their workspace is
        # allocated here, once, outside any capture.
        layer = model.model.layers[0].self_attn.info  # this rank's heads
        self.plans = {
            bs: backend.graph_plan(
                self.inputs.req_pool_indices[:bs],
                self.inputs.seq_lens[:bs],
                self.inputs.token_idx[:bs],
                layer,
                kv_pool,
                max_context_len,
            )
            for bs in self.buckets
        }
        self.graphs: dict[int, Any] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.replays = 0  # graph replays so far (stats and tests)

    # ---- capture -----------------------------------------------------------------------
    def _batch(self, bs: int) -> ForwardBatch:
        """The static forward batch of bucket ``bs`` (host fields are placeholders)."""
        inp = self.inputs
        fb = ForwardBatch(
            input_ids=inp.input_ids[:bs],
            positions=inp.positions[:bs],
            out_cache_loc=inp.out_cache_loc[:bs],
            req_pool_indices=inp.req_pool_indices[:bs],
            prefix_lens=None,
            extend_lens=None,
            seq_lens=inp.seq_lens[:bs],
            logits_indices=inp.token_idx[:bs],
            req_to_token=self.req_to_token,
            rows_cpu=np.zeros(bs, dtype=np.int64),
            prefix_lens_cpu=[0] * bs,
            extend_lens_cpu=[1] * bs,
            table_host=np.zeros((0, 0), dtype=np.int32),
            num_tokens=bs,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            upload=Upload(self.device),
        )
        fb.attn_metadata = self.plans[bs]
        return fb

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first (the graphs share one memory pool)."""
        t0 = time.perf_counter()
        if not self.use_cuda_graph:
            for bs in self.buckets:
                self.logits[bs] = self.model.forward(self._batch(bs))
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs in reversed(self.buckets):
            fb = self._batch(bs)
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):  # warm up: autotuning, lazy buffers, allocator
                for _ in range(2):
                    self.model.forward(fb)
            torch.cuda.current_stream(self.device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                self.logits[bs] = self.model.forward(fb)
            self.graphs[bs] = graph
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs for decode batches of %s requests in %.1f s",
                    ",".join(map(str, self.buckets)), time.perf_counter() - t0)

    # ---- replay ------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.is_decode and fb.batch_size <= self.max_bs and fb.num_extra_logits == 0
                and fb.lora is None and self.backend.graph_compatible(fb))

    @torch.inference_mode()
    def replay(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits ``[bs, vocab]`` of a decode batch whose upload was sent (no plan needed)."""
        bs = fb.batch_size
        bucket = self.buckets[bisect.bisect_left(self.buckets, bs)]
        inp = self.inputs
        inp.input_ids[:bs].copy_(fb.input_ids)
        inp.positions[:bs].copy_(fb.positions)
        inp.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        inp.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        inp.seq_lens[:bs].copy_(fb.seq_lens)
        if bucket > bs:
            # Padding rows: K/V into the padding slot, one key each (whatever row they read).
            inp.out_cache_loc[bs:bucket].zero_()
            inp.seq_lens[bs:bucket].fill_(1)
        self.replays += 1
        if self.use_cuda_graph:
            self.graphs[bucket].replay()
            return self.logits[bucket][:bs]
        return self.model.forward(self._batch(bucket))[:bs]
