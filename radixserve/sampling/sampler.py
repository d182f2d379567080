"""Batched sampling: penalties, logprobs, temperature, top-k / top-p / min-p, seeded draws.

Order of operations inside ``sample`` (per row, all rows at once):
  0. ``logit_bias`` (OpenAI) is added to the raw logits;
  1. penalties on the biased logits: repetition (HF, tokens of prompt + output), then
     frequency and presence (OpenAI, output tokens only);
  2. logprobs: ``log_softmax`` of the *penalised* logits, taken BEFORE temperature and the
     top-k / top-p / min-p filters, so a reported logprob is the model's own (penalised)
     distribution and does not change with the sampling knobs;
  3. greedy rows (temperature 0 or top_k 1) take the argmax of the penalised logits;
  4. the other rows: divide by temperature, filter top-k, then top-p (on what top-k left,
     renormalised), then min-p (relative to the most likely token), and draw.

Filtering without sorting the vocabulary.  A filtered row keeps a prefix of its tokens in
descending order of probability (each of the three filters keeps a prefix), so only its
``CANDIDATES`` most likely tokens (or its ``top_k``, if larger) are taken, by ``topk``; the
filters run on those.  When the kept prefix reaches the last candidate (a top-p or min-p row
whose distribution is flat), the candidates may not hold it all: ``sample`` then runs the batch
again with ``RERUN_CANDIDATES`` candidates, and if one is still short, with every token a
candidate -- the same arithmetic, so the answer is what a full sort gives.  Rows without
filters draw over the whole vocabulary in token-id order.  That is the path of logits on a GPU.
On a CPU one C++ call draws every sampled row (cpu_ext/sampler.cpp): the same filters, order
and uniforms, its candidates found by thresholds on the probabilities instead of ``topk``, so
it never reruns and spends no time in torch's small ops.

Seeded draws.  Each row draws one uniform ``U`` and takes the first token whose running sum of
kept probabilities exceeds ``U`` times their total (inverse CDF).  ``U`` comes from a
counter-based hash (splitmix64) of ``(seed, step)`` computed on tensors, so a request's random
numbers depend only on its own seed and how many tokens it has generated -- not on its position
in the batch, on the other requests beside it, or on what ran before.  A retracted and
recomputed request draws the same tokens again.  How a row is drawn depends only on its own
knobs, so the result is the same across batch compositions.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from radixserve import cpu_ext
from radixserve.sampling.params import SamplingParams, to_int64
from radixserve.sampling.penalties import (
    apply_frequency_presence_penalties,
    apply_repetition_penalty,
    count_tokens,
    padded_token_ids,
)
from radixserve.sampling.uniform import counter_uniform
from radixserve.transfer import Upload, read_back, resolve

# Tokens a filtered row takes from its distribution before filtering (see the module docstring):
# at a temperature of 1 the default model's 256 most likely tokens hold the top-p 0.95 set of
# nearly every decode step.
CANDIDATES = 256
# The rerun's candidates, before every token: a flat row's top-p 0.9 set at temperature 0.7 fits
# in them, and topk(4096) of a wide batch costs a fraction of running every token as a
# candidate (the last resort, for a row that 4096 still do not cover).
RERUN_CANDIDATES = 4096
_NO_ROWS = torch.empty(0, dtype=torch.int64)


def _native_ops(logits: torch.Tensor) -> Any:
    """The CPU kernels, whose ``sample_rows`` draws the sampled rows where the logits are on a
    CPU (cpu_ext/sampler.cpp: the same filters and uniforms in a few passes over a row); None
    elsewhere, or without the kernels (then the torch path below)."""
    return cpu_ext.load() if logits.device.type == "cpu" else None


@dataclass
class SamplingBatch:
    """Per-row sampling tensors for one forward, built once by ``build``."""

    temperatures: torch.Tensor  # [B] float32 (0 on greedy rows)
    top_ps: torch.Tensor  # [B] float32
    top_ks: torch.Tensor  # [B] int64, "off" stored as vocab_size
    min_ps: torch.Tensor  # [B] float32
    rep_penalties: torch.Tensor  # [B] float32
    freq_penalties: torch.Tensor  # [B] float32
    pres_penalties: torch.Tensor  # [B] float32
    seeds: torch.Tensor  # [B] int64
    steps: torch.Tensor  # [B] int64, tokens generated so far
    vocab_size: int
    # Host-side facts, so ``sample`` can skip work without a device sync.
    sampled_rows: torch.Tensor | None  # [S] int64 non-greedy rows; None when all rows sample
    num_sampled: int
    # Positions among the sampled rows of those with a filter (top-k, top-p or min-p) and of
    # those without; None where that set is empty.  max_top_k: the largest top-k of a row, or 0.
    filtered_rows: torch.Tensor | None
    plain_rows: torch.Tensor | None
    max_top_k: int
    # Penalty state; None when no row of the batch uses that penalty.
    seen_mask: torch.Tensor | None = None  # [B, V] bool, token in prompt + output
    output_counts: torch.Tensor | None = None  # [B, V] float32, count in output
    # Sparse logit bias: (rows, token ids, values); None when no row has one.
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @property
    def batch_size(self) -> int:
        return int(self.seeds.shape[0])

    @classmethod
    def build(
        cls,
        params: list[SamplingParams],
        seeds: list[int],
        output_ids: list[list[int]],
        prompt_ids: list[list[int]] | None,
        vocab_size: int,
        device: torch.device | str,
        steps: list[int] | None = None,
    ) -> SamplingBatch:
        """``seeds[i]``: request i's seed (its own, or one drawn when it was created).
        ``output_ids`` / ``prompt_ids`` are read only for rows whose penalties are active;
        ``steps[i]``, the tokens row i's request has generated before it, defaults to
        ``len(output_ids[i])``."""
        n = len(params)
        if (len(seeds) != n or len(output_ids) != n
                or (prompt_ids is not None and len(prompt_ids) != n)
                or (steps is not None and len(steps) != n)):
            raise ValueError(
                "params, seeds, output_ids, prompt_ids and steps must have one entry per request"
            )
        if steps is None:
            steps = [len(out) for out in output_ids]

        # Everything the batch indexes with goes to the device in one copy.
        upload = Upload(device)
        floats = upload.add(np.array(
            [
                [p.temperature, p.top_p, p.min_p, p.repetition_penalty, p.frequency_penalty,
                 p.presence_penalty]
                for p in params
            ],
            dtype=np.float32,
        ).reshape(n, 6).T, np.float32)
        ints = upload.add(np.array(
            [
                [to_int64(s), step, p.top_k if 0 < p.top_k < vocab_size else vocab_size]
                for p, s, step in zip(params, seeds, steps, strict=True)
            ],
            dtype=np.int64,
        ).reshape(n, 3).T)

        sampled = [i for i, p in enumerate(params) if not p.is_greedy]
        sampled_rows = None if len(sampled) == n else upload.add(sampled)
        has_filter = [_has_filter(params[i], vocab_size) for i in sampled]
        filtered_rows = (upload.add([j for j, f in enumerate(has_filter) if f])
                         if any(has_filter) else None)
        plain_rows = (upload.add([j for j, f in enumerate(has_filter) if not f])
                      if not all(has_filter) else None)
        logit_bias = _stage_logit_bias(upload, params)
        seen_ids, out_ids = _stage_penalty_ids(upload, params, output_ids, prompt_ids, vocab_size)
        upload.send()
        (floats, ints, sampled_rows, filtered_rows, plain_rows, logit_bias, seen_ids,
         out_ids) = resolve((floats, ints, sampled_rows, filtered_rows, plain_rows, logit_bias,
                             seen_ids, out_ids))
        temps, top_ps, min_ps, reps, freqs, pres = floats.unbind(0)
        seed_t, steps, top_ks = ints.unbind(0)
        return cls(
            temperatures=temps,
            top_ps=top_ps,
            top_ks=top_ks,
            min_ps=min_ps,
            rep_penalties=reps,
            freq_penalties=freqs,
            pres_penalties=pres,
            seeds=seed_t,
            steps=steps,
            vocab_size=vocab_size,
            sampled_rows=sampled_rows,
            num_sampled=len(sampled),
            filtered_rows=filtered_rows,
            plain_rows=plain_rows,
            max_top_k=max((params[i].top_k for i in sampled if 0 < params[i].top_k < vocab_size),
                          default=0),
            logit_bias=logit_bias,
            seen_mask=None if seen_ids is None else count_tokens(seen_ids, vocab_size) > 0,
            output_counts=None if out_ids is None else count_tokens(out_ids, vocab_size),
        )


def _stage_logit_bias(upload: Upload, params: list[SamplingParams]) -> tuple[Any, Any, Any] | None:
    """The batch's logit biases as (rows, token ids, values), staged; None without any."""
    if not any(p.logit_bias for p in params):
        return None
    rows = [i for i, p in enumerate(params) for _ in p.logit_bias]
    cols = [t for p in params for t in p.logit_bias]
    vals = [b for p in params for b in p.logit_bias.values()]
    return upload.add(rows), upload.add(cols), upload.add(vals, np.float32)


def _stage_penalty_ids(upload: Upload, params: list[SamplingParams], output_ids: list[list[int]],
                       prompt_ids: list[list[int]] | None, vocab_size: int) -> tuple[Any, Any]:
    """The token ids the penalties count, staged: prompt + output for the repetition penalty,
    output for the frequency / presence ones (None when no row has the penalty).  Rows without
    a given penalty contribute no ids: their counts stay 0 (neutral anyway)."""
    seen_ids = out_ids = None
    if any(p.repetition_penalty != 1.0 for p in params):
        seen_ids = upload.add(padded_token_ids([
            ((prompt_ids[i] if prompt_ids is not None else []) + output_ids[i])
            if p.repetition_penalty != 1.0
            else []
            for i, p in enumerate(params)
        ], vocab_size))
    if any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params):
        out_ids = upload.add(padded_token_ids([
            output_ids[i] if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) else []
            for i, p in enumerate(params)
        ], vocab_size))
    return seen_ids, out_ids


def _has_filter(p: SamplingParams, vocab_size: int) -> bool:
    return 0 < p.top_k < vocab_size or p.top_p < 1.0 or p.min_p > 0.0


@dataclass
class SampleOutput:
    next_token_ids: list[int]  # len B
    logprobs: list[float] | None  # logprob of the chosen token (every row, when any asks)
    top_logprobs: list[list[tuple[int, float]]] | None  # per row, top_logprobs_num[i] pairs


def _inverse_cdf(weights: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """[R] index drawn from each row of ``weights`` [R, N] (>= 0, not all 0) with probability
    proportional to its weight: the first index whose running sum exceeds ``u`` times the total.
    ``u`` lies strictly inside (0, 1), so a zero weight is never drawn."""
    cumulative = weights.cumsum(dim=-1)
    target = uniform[:, None] * cumulative[:, -1:]
    return torch.searchsorted(cumulative, target, right=True).clamp_(
        max=weights.shape[-1] - 1
    )[:, 0]


def _filtered_candidates(
    logp: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, min_ps: torch.Tensor, k: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``k`` most likely tokens of each row of ``logp`` [R, V] with the filters applied:
    (weights [R, k], zero where filtered; token ids [R, k]; [R] bool, True where the kept prefix
    may run past the candidates).  ``top_ks`` holds V where top-k is off."""
    values, ids = logp.topk(k, dim=-1)  # descending
    probs = values.exp()
    positions = torch.arange(k, device=logp.device)
    remove = positions[None, :] >= top_ks[:, None]
    kept = probs.masked_fill(remove, 0.0)
    cumulative = kept.cumsum(dim=-1)
    # Keep the smallest prefix whose mass reaches top_p of what top-k kept (the whole row's
    # mass, 1, where top-k is off: the candidates hold all of a top-k row, not all of the others).
    total = torch.where(top_ks < logp.shape[-1], cumulative[:, -1], 1.0)
    over = (cumulative - kept) > top_ps[:, None] * total[:, None]
    remove |= over & (top_ps < 1.0)[:, None]
    # p < min_p * p_max  <=>  log p < log p_max + log min_p   (min_p = 0: threshold -inf)
    remove |= values < values[:, :1] + min_ps.log()[:, None]
    weights = probs.masked_fill(remove, 0.0)
    uncovered = (weights[:, -1] > 0) & (top_ks > k) if k < logp.shape[-1] else None
    return weights, ids, uncovered


def _sample_rows(
    logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor | None, candidates: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Draw one token per row of ``logits`` [S, V] (the non-greedy rows ``rows`` of the batch),
    and [S] bool of rows whose candidates may have been too few (None: none can be)."""

    def pick(t: torch.Tensor) -> torch.Tensor:
        return t if rows is None else t.index_select(0, rows)

    scaled = logits / pick(batch.temperatures)[:, None]
    uniform = counter_uniform(pick(batch.seeds), pick(batch.steps), 1)[:, 0]
    filtered, plain = batch.filtered_rows, batch.plain_rows
    if filtered is None:  # no row filters: every row over the whole vocabulary
        return _inverse_cdf(torch.softmax(scaled, dim=-1), uniform), None
    vocab = logits.shape[-1]
    k = min(vocab, max(candidates, batch.max_top_k))
    weights, ids, uncovered = _filtered_candidates(
        torch.log_softmax(scaled.index_select(0, filtered), dim=-1),
        pick(batch.top_ks).index_select(0, filtered), pick(batch.top_ps).index_select(0, filtered),
        pick(batch.min_ps).index_select(0, filtered), k)
    drawn = ids.gather(1, _inverse_cdf(weights, uniform.index_select(0, filtered))[:, None])[:, 0]
    if plain is None:
        return drawn, uncovered
    out = torch.empty(scaled.shape[0], dtype=torch.int64, device=logits.device)
    out.index_copy_(0, filtered, drawn)
    out.index_copy_(0, plain, _inverse_cdf(torch.softmax(scaled.index_select(0, plain), dim=-1),
                                           uniform.index_select(0, plain)))
    if uncovered is not None:
        uncovered = torch.zeros(scaled.shape[0], dtype=torch.bool,
                                device=logits.device).index_copy_(0, filtered, uncovered)
    return out, uncovered


def _argmax(logits: torch.Tensor, ops: Any) -> torch.Tensor:
    """[B] index of each row's first largest logit: the C++ kernel where ``ops`` is there
    (torch's CPU argmax is a scalar loop, the whole cost of a greedy row's sampling)."""
    return ops.argmax_rows(logits.contiguous()) if ops is not None else logits.argmax(dim=-1)


def _next_ids(
    logits: torch.Tensor, batch: SamplingBatch, candidates: int
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """[B] next token ids (argmax on greedy rows), and [B] bool of rows whose candidates may
    have been too few (None: none can be)."""
    num_rows = logits.shape[0]
    uncovered = None
    ops = _native_ops(logits)
    # every sampled row in one C++ call, never short of candidates
    if ops is not None and batch.num_sampled:
        rows = batch.sampled_rows
        drawn = ops.sample_rows(logits.contiguous(), _NO_ROWS if rows is None else rows,
                                batch.temperatures, batch.top_ks, batch.top_ps, batch.min_ps,
                                batch.seeds, batch.steps)
        next_ids = drawn if rows is None else _argmax(logits, ops).index_copy(0, rows, drawn)
    elif batch.num_sampled == num_rows:
        next_ids, uncovered = _sample_rows(logits, batch, None, candidates)
    else:
        next_ids = _argmax(logits, ops)
        if batch.num_sampled > 0:
            rows = batch.sampled_rows
            drawn, uncovered = _sample_rows(logits.index_select(0, rows), batch, rows, candidates)
            next_ids = next_ids.index_copy(0, rows, drawn)
            if uncovered is not None:
                uncovered = torch.zeros(num_rows, dtype=torch.bool,
                                        device=logits.device).index_copy_(0, rows, uncovered)
    return next_ids, uncovered


def sample(
    logits: torch.Tensor,
    batch: SamplingBatch,
    return_logprob: list[bool] | None = None,
    top_logprobs_num: list[int] | None = None,
    candidates: int = CANDIDATES,
) -> SampleOutput:
    """Pick the next token of every row of ``logits`` [B, V] (see the module docstring for the
    order of operations).  ``logits`` is not modified.  ``candidates``: tokens a filtered row
    takes before filtering; the reruns, when they may have been too few, take more."""
    num_rows = logits.shape[0]
    if num_rows != batch.batch_size:
        raise ValueError(f"logits have {num_rows} rows, the sampling batch {batch.batch_size}")
    for name, per_row in (
        ("return_logprob", return_logprob),
        ("top_logprobs_num", top_logprobs_num),
    ):
        if per_row is not None and len(per_row) != num_rows:
            raise ValueError(f"{name} has {len(per_row)} entries for {num_rows} rows")
    if num_rows == 0:
        return SampleOutput([], None, None)

    raw_logits = logits
    logits = logits.float()
    if batch.logit_bias is not None:
        rows, cols, vals = batch.logit_bias
        logits = logits.index_put((rows, cols), vals, accumulate=True)
    if batch.seen_mask is not None:
        logits = apply_repetition_penalty(logits, batch.seen_mask, batch.rep_penalties)
    if batch.output_counts is not None:
        logits = apply_frequency_presence_penalties(
            logits, batch.output_counts, batch.freq_penalties, batch.pres_penalties
        )

    next_ids, uncovered = _next_ids(logits, batch, candidates)
    want_logprob = bool(return_logprob) and any(return_logprob)
    top_k_max = max(top_logprobs_num, default=0) if top_logprobs_num else 0
    # One read-back for everything the host needs (ids travel as float64, exact below 2**53).
    parts = [next_ids.double()[:, None]]
    if uncovered is not None:  # read back with the rest; the rare rerun costs a second one
        parts.append(uncovered.double()[:, None])
    k = 0
    if want_logprob or top_k_max > 0:
        logp_all = torch.log_softmax(logits, dim=-1)
        if want_logprob:
            parts.append(logp_all.gather(1, next_ids[:, None]).double())
        if top_k_max > 0:
            k = min(top_k_max, logits.shape[-1])
            values, ids = logp_all.topk(k, dim=-1)
            parts += [values.double(), ids.double()]
    host = read_back(torch.cat(parts, dim=1) if len(parts) > 1 else parts[0]).numpy()
    if uncovered is not None and host[:, 1].any():
        more = RERUN_CANDIDATES if candidates < RERUN_CANDIDATES else logits.shape[-1]
        return sample(raw_logits, batch, return_logprob, top_logprobs_num, candidates=more)
    next_token_ids = host[:, 0].astype(np.int64).tolist()
    logprobs = top_logprobs = None
    col = 1 if uncovered is None else 2
    if want_logprob:
        logprobs = host[:, col].tolist()
        col += 1
    if top_k_max > 0:
        values_l, ids_l = (host[:, col : col + k].tolist(),
                           host[:, col + k : col + 2 * k].astype(np.int64).tolist())
        top_logprobs = [
            list(zip(ids_l[i][: max(n, 0)], values_l[i][: max(n, 0)], strict=True))
            for i, n in enumerate(top_logprobs_num)
        ]
    return SampleOutput(next_token_ids, logprobs, top_logprobs)
