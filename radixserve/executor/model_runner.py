"""Owns the model, the KV pool and the attention backend; runs one forward and samples."""

from __future__ import annotations

import numpy as np
import torch

from radixserve.attention import create_backend
from radixserve.batch import ForwardBatch
from radixserve.cache.kv_pool import KVPool
from radixserve.cache.req_to_token import ReqToTokenPool
from radixserve.distributed.step_message import StepBatch, pack_rows
from radixserve.executor import prompt_logprobs
from radixserve.executor.cuda_graph import DecodeGraphs
from radixserve.executor.req_view import ReqView
from radixserve.executor.tp_worker import WorkerLink
from radixserve.lora.batch import LoraBatch
from radixserve.lora.slots import LoraPool
from radixserve.profiler_scopes import scope
from radixserve.sampling import SampleOutput, SamplingBatch, sample
from radixserve.transfer import resolve

# torch.profiler ranges of a step's forward and sampling (the scheduler's StepProfiler reads them).
FORWARD_SCOPE = "radixserve.forward"  # ModelRunner.forward: batch building and the model
SAMPLING_SCOPE = "radixserve.sampling"  # ModelRunner.sample


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
        self.lora: LoraPool | None = None  # the LoRA adapters and their slots (--enable-lora)

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
        self, entries: list[tuple[ReqView, int]], extra_logits: np.ndarray | None = None
    ) -> ForwardBatch:
        """Entry ``(req, n)`` computes ``fill_ids[computed_len : computed_len + n]`` of ``req``;
        the forward also returns the logits of the batch tokens ``extra_logits`` (after the
        last-token rows)."""
        rows = [r.kv.row for r, _ in entries]
        prefix_lens = [r.kv.computed_len for r, _ in entries]
        extend_lens = [n for _, n in entries]
        seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens, strict=True)]
        input_ids = np.concatenate(
            [r.tokens(r.kv.computed_len, r.kv.computed_len + n) for r, n in entries]
        )
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
        fb = ForwardBatch.build(
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
        if self.lora is not None:
            fb.lora = LoraBatch.build(self.lora, [r.lora_slot for r, _ in entries], extend_lens,
                                      fb.upload)
        return fb

    @torch.inference_mode()
    def forward(self, entries: list[tuple[ReqView, int]], sample_rows: list[int] | None = None,
                drafts: dict[int, int] | None = None) -> torch.Tensor:
        """Float32 logits at the last new token of the entries ``sample_rows`` (all of them
        when None), in that order.  An entry with ``k = drafts[i]`` speculative draft tokens at
        the end of its new tokens has ``k + 1`` rows instead: at the token before each draft,
        then at the last one (``speculative/ngram.py``).

        Requests that owe prompt logprobs get them from the same forward: the LM head also
        reads their prompt rows, and ``prompt_logprobs.record`` stores the result on them.
        """
        with scope(FORWARD_SCOPE):
            plan = prompt_logprobs.plan_rows(entries)
            num_entries = len(entries)
            rows = list(range(num_entries)) if sample_rows is None else sample_rows
            extra, select = self._logit_rows(entries, rows, plan, drafts or {})
            fb = self.build_batch(entries, extra)
            targets = None if plan is None else fb.upload.add(plan.targets)
            # travels in the batch's upload
            staged = None if select is None else fb.upload.add(select)
            if self.graphs is not None and self.graphs.can_run(fb):
                fb.send()  # the graph's plan is static: only the batch's arrays are needed
                logits = self.graphs.replay(fb)
            else:
                self.backend.prepare(fb)
                logits = self.model.forward(fb)
            if plan is not None:
                # Rows [0, B): last new tokens; [B, B + E): the plan's rows, in plan order.
                prompt_logprobs.record(
                    plan, logits[num_entries : num_entries + plan.num_rows], resolve(targets)
                )
            if staged is not None:
                return logits.index_select(0, resolve(staged))
            return logits[:num_entries]

    @staticmethod
    def _logit_rows(
        entries: list[tuple[ReqView, int]],
        rows: list[int],
        plan: prompt_logprobs.PromptLogprobPlan | None,
        drafts: dict[int, int],
    ) -> tuple[np.ndarray | None, np.ndarray | None]:
        """The batch's extra LM-head rows (token indices: prompt-logprob rows, then the rows
        before each draft) and the logits rows to return (None: the first B, as they are)."""
        extra = [] if plan is None else [plan.rows]
        num_extra = 0 if plan is None else plan.num_rows
        if not drafts:
            select = None if len(rows) == len(entries) else np.asarray(rows, dtype=np.int64)
            return (extra[0] if extra else None), select
        ends = np.cumsum([n for _, n in entries])  # one past each entry's last token
        select: list[int] = []
        for i in rows:
            k = drafts.get(i, 0)
            if k:
                # Entry tokens [n - 1 - k, n - 1): the last pending token and all drafts but the
                # last.
                extra.append(np.arange(ends[i] - 1 - k, ends[i] - 1, dtype=np.int64))
                select += range(len(entries) + num_extra, len(entries) + num_extra + k)
                num_extra += k
            select.append(i)
        return np.concatenate(extra), np.asarray(select, dtype=np.int64)

    @torch.inference_mode()
    def sample(
        self, logits: torch.Tensor, reqs: list[ReqView], drafts: list[list[int]] | None = None
    ) -> SampleOutput:
        """One token per row of ``logits``: a request with ``drafts[i]`` (k tokens) owns ``k + 1``
        consecutive rows, row ``j`` sampled as if ``drafts[i][:j]`` followed its output."""
        with scope(SAMPLING_SCOPE):
            params, seeds, outputs, prompts, steps, logprob, top_n = [], [], [], [], [], [], []
            for i, r in enumerate(reqs):
                draft = drafts[i] if drafts is not None else []
                penalised = r.params.has_penalties
                for j in range(len(draft) + 1):
                    params.append(r.params)
                    seeds.append(r.seed)
                    prompts.append(r.prompt_ids)
                    steps.append(r.output_len + j)
                    outputs.append(r.output_ids + draft[:j] if penalised and j else r.output_ids)
                    logprob.append(r.return_logprob)
                    top_n.append(r.top_logprobs_num)
            batch = SamplingBatch.build(
                params=params,
                seeds=seeds,
                output_ids=outputs,
                prompt_ids=prompts,
                vocab_size=self.vocab_size,
                device=logits.device,
                steps=steps,
            )
            return sample(logits, batch, return_logprob=logprob, top_logprobs_num=top_n)
