"""``select`` by Hugging Face transformers: each choice's token logprobs after the prompt in
float32, and the three decision rules stated independently of radixserve.program.choices."""

from __future__ import annotations

import functools

import torch

from helpers.oracle import hf_model


@functools.lru_cache(maxsize=4)
def _tokenizer(folder: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(folder)


@torch.inference_mode()
def _logprobs(folder: str, ids: list[int]) -> list[float | None]:
    """Logprob of each token given the ones before it (None for the first)."""
    logits = hf_model(folder)(input_ids=torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return [None] + [float(lp[j - 1, ids[j]]) for j in range(1, len(ids))]


def choice_logprobs(folder: str, prompt: str, choices: list[str]) -> tuple[list[list[float]], list[list[int]]]:
    """Per choice, the logprobs and ids of its tokens after ``prompt`` (the prompt's last token
    counts as the choice's first when the choice merged with it)."""
    tok = _tokenizer(folder)
    p = tok.encode(prompt, add_special_tokens=False)
    out, ids_out = [], []
    for c in choices:
        ids = tok.encode(prompt + c, add_special_tokens=False)
        assert ids[: len(p) - 1] == p[: len(p) - 1], "the prompt tokenizes differently before its last token"
        start = len(p) if ids[len(p) - 1] == p[-1] and len(ids) > len(p) else len(p) - 1
        out.append(_logprobs(folder, ids)[start:])
        ids_out.append(ids[start:])
    return out, ids_out


def decide(folder: str, prompt: str, choices: list[str], method: str) -> tuple[str, list[float]]:
    """The oracle's decision and the scores it compared (the greedy rule returns rows)."""
    cond, ids = choice_logprobs(folder, prompt, choices)
    means = [sum(row) / len(row) for row in cond]
    if method == "token_length_normalized":
        best = max(range(len(choices)), key=lambda i: (means[i], -i))
        return choices[best], means
    if method == "greedy_token_selection":
        # Keeping the best at each position in turn is a lexicographic maximum of the rows,
        # each padded with its own mean to the longest length.
        width = max(len(r) for r in cond)
        rows = [row + [means[i]] * (width - len(row)) for i, row in enumerate(cond)]
        best = max(range(len(choices)), key=lambda i: (rows[i], -i))
        return choices[best], means
    if method == "unconditional_likelihood_normalized":
        scores = []
        for row, tokens in zip(cond, ids, strict=True):
            alone = [0.0 if x is None else x for x in _logprobs(folder, tokens)]
            scores.append(sum(a - b for a, b in zip(row, alone, strict=True)) / len(row))
        best = max(range(len(choices)), key=lambda i: (scores[i], -i))
        return choices[best], scores
    raise ValueError(method)
