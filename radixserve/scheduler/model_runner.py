"""Owns the model, the KV pool and the attention backend; runs one forward and samples."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.attention import create_backend
from radixserve.batch import ForwardBatch
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.req_to_token import ReqToTokenPool
from radixserve.distributed.step_message import StepBatch, pack_rows
from radixserve.distributed.worker import WorkerLink
from radixserve.sampling import SampleOutput, SamplingBatch, sample
from radixserve.scheduler import prompt_logprobs
from radixserve.scheduler.cuda_graph import DecodeGraphs
from radixserve.scheduler.profiling import FORWARD_SCOPE, SAMPLING_SCOPE
from radixserve.scheduler.request import Req
from radixserve.transfer import resolve


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        vocab_size: int,
        kv_pool: KVPool,
        req_pool: ReqToTokenPool,
        attention_backend: str,
        device: torch.device,
    ) -> None:
        self.model = model
        self.vocab_size = vocab_size
        self.kv_pool = kv_pool
        self.req_pool = req_pool
        self.backend = create_backend(attention_backend)
        self.backend.layer = model.model.layers[0].self_attn.info
        self.device = device
        # Tensor parallelism: rank 0's link to the other ranks (None: a single rank).
        self.link: WorkerLink | None = None
        self.graphs: DecodeGraphs | None = None  # captured decode forwards (use_decode_graphs)

    def use_decode_graphs(self, max_bs: int, max_context_len: int) -> None:
        """Capture decode forwards for batches of up to ``max_bs`` requests (CUDA graphs on
        CUDA; elsewhere the same static path replayed eagerly, for tests)."""
        self.graphs = DecodeGraphs(self.model, self.backend, self.kv_pool, self.req_pool.table,
                                   max_bs, max_context_len, self.device)
        self.graphs.capture()

    @property
    def attention_path(self) -> str:
        """How attention runs, for the start-up log."""
        if getattr(self.backend, "uses_kernel", False):
            return f"{self.backend.name} (C++ paged kernel)"
        if self.backend.name == "torch":
            return "torch (gather + SDPA: the C++ kernel is not built)"
        return self.backend.name

    def build_batch(
        self, entries: list[tuple[Req, int]], extra_logits: np.ndarray | None = None
    ) -> ForwardBatch:
        """Entry ``(req, n)`` computes ``fill_ids[computed_len : computed_len + n]`` of ``req``; the forward
        also returns the logits of the batch tokens ``extra_logits`` (after the last-token rows)."""
        rows = [r.row for r, _ in entries]
        prefix_lens = [r.computed_len for r, _ in entries]
        extend_lens = [n for _, n in entries]
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
        input_ids = np.concatenate([r.tokens(r.computed_len, r.computed_len + n) for r, n in entries])
        # Output slots: row[computed_len + i] for i < n, gathered from the host table in one op.
        row_idx = np.repeat(np.asarray(rows, dtype=np.int64), extend_lens)
        starts = np.cumsum(extend_lens) - np.asarray(extend_lens)
        col_idx = np.arange(len(row_idx), dtype=np.int64) + np.repeat(
            np.asarray(prefix_lens, dtype=np.int64) - starts, extend_lens
        )
        table = self.req_pool.host
        out_cache_loc = table[row_idx, col_idx].astype(np.int64)
        if self.link is not None:  # the other tensor-parallel ranks run the same forward
            self.link.send(StepBatch(
                input_ids=input_ids,
                prefix_lens=np.asarray(prefix_lens, dtype=np.int64),
                extend_lens=np.asarray(extend_lens, dtype=np.int64),
                out_cache_loc=out_cache_loc,
                slots=pack_rows(table, rows, seq_lens),
                extra_logits=np.zeros(0, dtype=np.int64) if extra_logits is None else extra_logits,
            ))
        return ForwardBatch.build(
            input_ids=input_ids,
            prefix_lens=prefix_lens,
            extend_lens=extend_lens,
            req_pool_indices=rows,
            out_cache_loc=out_cache_loc,
            req_to_token=self.req_pool.table,
            kv_pool=self.kv_pool,
            attn_backend=self.backend,
            device=self.device,
            extra_logits_indices=extra_logits,
            table_host=table,
            table_updates=self.req_pool.sync_updates(rows, seq_lens),
        )

    @torch.inference_mode()
    def forward(self, entries: list[tuple[Req, int]], sample_rows: list[int] | None = None) -> torch.Tensor:
        """Float32 logits ``[len(sample_rows), vocab]`` at the last new token of the entries
        ``sample_rows`` (all of them when None).

        Requests that owe prompt logprobs get them from the same forward: the LM head also
        reads their prompt rows, and ``prompt_logprobs.record`` stores the result on them.
        """
        with torch.profiler.record_function(FORWARD_SCOPE):
            plan = prompt_logprobs.plan_rows(entries)
            fb = self.build_batch(entries, None if plan is None else plan.rows)
            num_entries = len(entries)
            targets = None if plan is None else fb.upload.add(plan.targets)
            select = None
            if sample_rows is not None and len(sample_rows) != num_entries:
                select = fb.upload.add(sample_rows)  # travels in the batch's upload
            if self.graphs is not None and self.graphs.can_run(fb):
                fb.send()  # the graph's plan is static: only the batch's arrays are needed
                logits = self.graphs.replay(fb)
            else:
                self.backend.prepare(fb)
                logits = self.model.forward(fb)
            if plan is not None:
                # Rows [0, B): last new tokens (sampling); [B, B + E): the plan's rows, in plan order.
                prompt_logprobs.record(plan, logits[num_entries:], resolve(targets))
            if select is not None:
                return logits.index_select(0, resolve(select))
            return logits[:num_entries]

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, reqs: list[Req]) -> SampleOutput:
        with torch.profiler.record_function(SAMPLING_SCOPE):
            batch = SamplingBatch.build(
                params=[r.params for r in reqs],
                seeds=[r.seed for r in reqs],
                output_ids=[r.output_ids for r in reqs],
                prompt_ids=[r.prompt_ids for r in reqs],
                vocab_size=self.vocab_size,
                device=logits.device,
            )
            return sample(
                logits,
                batch,
                return_logprob=[r.return_logprob for r in reqs],
                top_logprobs_num=[r.top_logprobs_num for r in reqs],
            )
