"""Logprobs of given tokens (prompt logprobs): the model's own distribution, no sampling knobs."""

from __future__ import annotations

import torch

from radixserve.transfer import read_back

# Rows are turned into log-softmax in slices of this many, so a long prompt chunk does not
# hold a second [rows, vocab] float32 tensor beside its logits.
LOGPROB_SLICE_ROWS = 1024


def token_logprobs(
    logits: torch.Tensor, targets: torch.Tensor, top_ns: list[int]
) -> tuple[list[float], list[list[list[float]]]]:
    """``log_softmax(logits[i])[targets[i]]`` and the ``top_ns[i]`` most likely
    ``[token, logprob]``.

    logits: ``[R, V]``; targets: ``[R]`` int64 on the same device; ``top_ns``: R ints >= 0.
    One host read-back for the whole call (ids travel as float64, exact below 2**53).
    """
    rows = logits.shape[0]
    if targets.shape != (rows,) or len(top_ns) != rows:
        raise ValueError(f"{rows} logit rows, {tuple(targets.shape)} targets, {len(top_ns)} top_ns")
    if rows == 0:
        return [], []
    k = min(max(top_ns), logits.shape[-1])
    packed = []
    for lo in range(0, rows, LOGPROB_SLICE_ROWS):
        logp = torch.log_softmax(logits[lo : lo + LOGPROB_SLICE_ROWS].float(), dim=-1)
        chosen = logp.gather(1, targets[lo : lo + LOGPROB_SLICE_ROWS, None])
        parts = [chosen.double()]
        if k > 0:
            top_vals, top_ids = logp.topk(k, dim=-1)
            parts += [top_vals.double(), top_ids.double()]
        packed.append(torch.cat(parts, dim=1))
    host = read_back(torch.cat(packed)).tolist()
    values = [row[0] for row in host]
    tops = [
        [[int(t), v] for v, t in zip(row[1 : 1 + n], row[1 + k : 1 + k + n], strict=True)]
        for row, n in zip(host, top_ns, strict=True)
    ]
    return values, tops
