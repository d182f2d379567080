"""Logit penalties on tensors: repetition (HF), frequency and presence (OpenAI).

All functions are row-wise and out-of-place.  A row whose penalty is neutral (repetition 1,
frequency 0, presence 0) comes out bit-identical, so a request's logits never depend on
whether another request in its batch uses a penalty.
"""

from __future__ import annotations

import numpy as np
import torch


def padded_token_ids(ids: list[list[int]], vocab_size: int) -> np.ndarray:
    """``[B, L]`` int64 of the rows of ``ids``, padded with ``vocab_size`` (one past the last
    token), on the host.  Ids outside ``[0, vocab_size)`` cannot receive a logit penalty and are
    turned into padding too (a device-side out-of-range scatter would kill the process)."""
    width = max((len(row) for row in ids), default=0)
    out = np.full((len(ids), width), vocab_size, dtype=np.int64)
    for i, row in enumerate(ids):
        out[i, : len(row)] = row
    out[(out < 0) | (out > vocab_size)] = vocab_size
    return out


def pad_token_ids(
    ids: list[list[int]], vocab_size: int, device: torch.device | str
) -> torch.Tensor:
    """:func:`padded_token_ids` as a tensor on ``device``."""
    return torch.from_numpy(padded_token_ids(ids, vocab_size)).to(device)


def count_tokens(padded_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """``[B, V]`` float32 count of each token in each row; padding (``== vocab_size``) lands in
    an extra column that is dropped."""
    batch = padded_ids.shape[0]
    counts = torch.zeros(batch, vocab_size + 1, dtype=torch.float32, device=padded_ids.device)
    counts.scatter_add_(1, padded_ids, torch.ones_like(padded_ids, dtype=torch.float32))
    return counts[:, :vocab_size]


def apply_repetition_penalty(
    logits: torch.Tensor, seen: torch.Tensor, penalties: torch.Tensor
) -> torch.Tensor:
    """HF semantics: for tokens already seen (prompt or output), positive logits are divided
    by the penalty and negative ones multiplied by it.

    logits: [B, V] float; seen: [B, V] bool; penalties: [B] float (1 = off).
    """
    p = penalties.to(logits.dtype)[:, None]
    penalised = torch.where(logits > 0, logits / p, logits * p)
    return torch.where(seen, penalised, logits)


def apply_frequency_presence_penalties(
    logits: torch.Tensor,
    output_counts: torch.Tensor,
    frequency: torch.Tensor,
    presence: torch.Tensor,
) -> torch.Tensor:
    """OpenAI semantics over the generated tokens only:
    ``logit -= frequency * count + presence * (count > 0)``.

    logits: [B, V] float; output_counts: [B, V] float; frequency, presence: [B] float.
    """
    f = frequency.to(logits.dtype)[:, None]
    p = presence.to(logits.dtype)[:, None]
    counts = output_counts.to(logits.dtype)
    return logits - (f * counts + p * (counts > 0).to(logits.dtype))
