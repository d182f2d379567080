"""What SGLang's ``RuntimeEndpoint.select`` decides, computed from Hugging Face transformers'
float32 logprobs instead of a server's (no sglang import).

It follows the client's steps (sglang/lang/backend/runtime_endpoint.py and choices.py) as
written there: the prompt's length ``n`` is measured alone; each ``prompt + choice`` is scored
from position ``max(n - 2, 0)`` (room for "token healing"); an entry whose token text ends the
prompt is dropped (its logprob taken out of the mean); the mean skips falsy logprobs (None).
``unconditional_likelihood_normalized`` scores each choice's kept tokens alone with the
server's default ``logprob_start_len`` (-1: the last position only), None counting as 0.
"""

from __future__ import annotations

from typing import Any

import torch

from helpers.oracle import hf_model

Entry = tuple[float | None, int, str]  # (logprob, token id, token text), as the server sends


@torch.inference_mode()
def hf_logprobs(folder: str, ids: list[int]) -> list[float | None]:
    """Logprob of each token given the ones before it (None for the first)."""
    logits = hf_model(folder)(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [None] + [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]


def _mean_truthy(entries: list[Entry]) -> float:
    values = [lp for lp, _, _ in entries if lp]
    return sum(values) / len(values)


def scored_choices(folder: str, tokenizer: Any, prompt: str, choices: list[str]) -> tuple[list[list[Entry]], list[float]]:
    """Per choice, its scored entries (after the healing step) and its normalized logprob."""
    n = len(tokenizer.encode(prompt, add_special_tokens=False))
    start = max(n - 2, 0)
    kept, normalized = [], []
    # A token after the same prefix has the same logprob in every choice: taken from the
    # first computation, so that float noise between sequence lengths cannot break the tie
    # greedy_token_selection sees on the shared positions.
    by_prefix: dict[tuple[int, ...], float | None] = {}
    for c in choices:
        ids = tokenizer.encode(prompt + c, add_special_tokens=False)
        lps = hf_logprobs(folder, ids)
        lps = [by_prefix.setdefault(tuple(ids[: p + 1]), lp) for p, lp in enumerate(lps)]
        entries = [(lps[p], ids[p], tokenizer.decode([ids[p]])) for p in range(start, len(ids))]
        norm = _mean_truthy(entries)
        if prompt.endswith(entries[0][2]):
            norm = (norm * len(entries) - entries[0][0]) / (len(entries) - 1)
            entries = entries[1:]
        kept.append(entries)
        normalized.append(norm)
    return kept, normalized


def _argmax(values: list[float]) -> int:
    return max(range(len(values)), key=lambda i: (values[i], -i))  # the first best, as numpy


def select_decision(folder: str, tokenizer: Any, prompt: str, choices: list[str], method: str) -> tuple[str, list[float]]:
    """The choice SGLang's ``method`` picks from HF's logprobs, and the scores it compared."""
    kept, normalized = scored_choices(folder, tokenizer, prompt, choices)
    rows = [[lp for lp, _, _ in entries] for entries in kept]
    if method == "token_length_normalized":
        return choices[_argmax(normalized)], normalized
    if method == "greedy_token_selection":
        # Keep the best at each position in turn; a shorter row is padded with its own mean.
        width = max(len(r) for r in rows)
        padded = [r + [sum(r) / len(r)] * (width - len(r)) for r in rows]
        remaining = list(range(len(choices)))
        for j in range(width):
            best = max(padded[i][j] for i in remaining)
            remaining = [i for i in remaining if padded[i][j] == best]
            if len(remaining) == 1:
                break
        return choices[remaining[0]], normalized
    if method == "unconditional_likelihood_normalized":
        scores = []
        for row, entries in zip(rows, kept, strict=True):
            alone = hf_logprobs(folder, [t for _, t, _ in entries])[-1] or 0.0
            scores.append(sum(x - alone for x in row) / len(row))
        return choices[_argmax(scores)], scores
    raise ValueError(f"unknown method {method!r}")
