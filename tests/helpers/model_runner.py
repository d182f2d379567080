"""A tiny driver that runs a model through ForwardBatch with a KVPool and a req_to_token table.

It stands in for the scheduler in model and kernel tests: prefill, chunked extend and decode,
several requests in one batch (mixed extend + decode rows), slots scattered over the pool.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import torch

from radixserve.attention import create_backend
from radixserve.batch import ForwardBatch
from radixserve.cache.kv_pool import KVPool


@dataclass
class _Request:
    tokens: list[int]  # prompt + generated so far
    row: int  # row of req_to_token
    join_step: int
    computed: int = 0  # tokens whose K/V are in the pool: slots [0, computed) of the row
    output: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)


class ModelRunner:
    """Greedy decoding of a ``CausalLM`` without the scheduler.

    ``scatter=True`` hands out KV slots in random order, so every request's slots are spread
    over the pool; slot 0 is never used (as with the real allocator).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        num_slots: int = 4096,
        max_requests: int = 16,
        max_context: int = 2048,
        scatter: bool = True,
        seed: int = 0,
        backend: str = "torch",
    ) -> None:
        cfg = model.config
        self.model = model
        self.pool = KVPool(num_slots, cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.dtype)
        self.req_to_token = torch.zeros((max_requests, max_context), dtype=torch.int32)
        self.backend = create_backend(backend)
        self.free_slots = list(range(1, num_slots))
        if scatter:
            random.Random(seed).shuffle(self.free_slots)
        self.free_rows = list(range(max_requests))

    def forward(self, reqs: list[_Request], extend_lens: list[int]) -> torch.Tensor:
        """One forward over ``reqs``, computing ``extend_lens[b]`` new tokens of request b."""
        input_ids, out_loc = [], []
        for r, e in zip(reqs, extend_lens, strict=True):
            # Row layout: [0, computed) cached, [computed, computed + e) written this step.
            new = [self.free_slots.pop() for _ in range(e)]
            r.slots += new
            self.req_to_token[r.row, r.computed : r.computed + e] = torch.tensor(new)
            input_ids += r.tokens[r.computed : r.computed + e]
            out_loc += new
        fb = ForwardBatch.build(
            input_ids=input_ids,
            prefix_lens=[r.computed for r in reqs],
            extend_lens=extend_lens,
            req_pool_indices=[r.row for r in reqs],
            out_cache_loc=torch.tensor(out_loc),
            req_to_token=self.req_to_token,
            kv_pool=self.pool,
            attn_backend=self.backend,
        )
        self.backend.prepare(fb)
        logits = self.model.forward(fb)
        for r, e in zip(reqs, extend_lens, strict=True):
            r.computed += e
        return logits

    def greedy(
        self,
        prompts: list[list[int]],
        max_new_tokens: int,
        *,
        chunk_size: int | None = None,
        stagger: int = 0,
    ) -> list[list[int]]:
        """Greedy continuation of every prompt, all requests batched together.

        ``chunk_size`` cuts prompts into chunks of that many tokens (prefix_lens > 0);
        ``stagger`` delays request i by ``i * stagger`` steps, so prefills of late requests
        share batches with decodes of early ones.
        """
        reqs = [
            _Request(tokens=list(p), row=self.free_rows.pop(), join_step=i * stagger)
            for i, p in enumerate(prompts)
        ]
        step = 0
        while any(len(r.output) < max_new_tokens for r in reqs):
            batch = [r for r in reqs if r.join_step <= step and len(r.output) < max_new_tokens]
            step += 1
            if not batch:
                continue
            pending = [len(r.tokens) - r.computed for r in batch]
            extend = [min(p, chunk_size) if chunk_size else p for p in pending]
            logits = self.forward(batch, extend)
            for i, r in enumerate(batch):
                if r.computed == len(r.tokens):  # last chunk or a decode: sample
                    tok = int(torch.argmax(logits[i]))
                    r.tokens.append(tok)
                    r.output.append(tok)
        for r in reqs:
            self.free_slots += r.slots
            self.free_rows.append(r.row)
        return [r.output for r in reqs]

    def last_token_logits(self, prompts: list[list[int]]) -> torch.Tensor:
        """Logits of each prompt's last token from one batched prefill (pool not released)."""
        reqs = [_Request(tokens=list(p), row=self.free_rows.pop(), join_step=0) for p in prompts]
        return self.forward(reqs, [len(p) for p in prompts])
