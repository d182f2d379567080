"""``select``: score each choice after the prompt with prompt logprobs, the prompt computed once.

Requests, all through the native API:
1. the prompt alone with ``max_new_tokens = 0``: it is computed (and enters the radix cache)
   once, and its last position comes back (``input_token_logprobs`` covers the last prompt
   position by default), which tells the token boundary below;
2. every ``prompt + choice`` in one batch with ``logprob_start_len = prompt_len - 1``: each is
   served the prompt from the cache and computes only its choice's tokens;
3. for the unconditional method, each choice's tokens alone (``logprob_start_len = 0``).

Token boundary: positions ``[0, prompt_len - 1)`` of ``prompt + choice`` tokenize as the
prompt does; position ``prompt_len - 1`` is the prompt's last token when the choice starts a
new token there, and the choice's scored tokens are the positions after it; otherwise the
choice merged with the prompt's last token (``"Answer:" + " yes"`` may tokenize across), and
that merged token is scored as the choice's first (SGLang's "token healing" does the same).
"""

from __future__ import annotations

from typing import Any

from radixserve.program.backends import Backend
from radixserve.program.choices import ChoiceScores, ChoicesMethod, Entry

_SCORE = {"max_new_tokens": 0, "temperature": 0}


def _choice_tokens(entries: list[Entry], prompt_last_id: int) -> list[Entry]:
    """``entries`` cover positions ``[prompt_len - 1, len)`` of ``prompt + choice``."""
    if len(entries) > 1 and entries[0][1] == prompt_last_id:
        return entries[1:]
    return entries


def score_choices(
    backend: Backend, prompt: str, choices: list[str], method: ChoicesMethod
) -> ChoiceScores:
    if not prompt:
        raise ValueError("select needs some text before it to score the choices after")
    head = backend.generate(prompt, dict(_SCORE), return_logprob=True)
    prompt_len = head["meta_info"]["prompt_tokens"]
    prompt_last_id = head["meta_info"]["input_token_logprobs"][-1][1]
    outs = backend.generate_many(
        [prompt + c for c in choices], dict(_SCORE), return_logprob=True,
        logprob_start_len=max(prompt_len - 1, 0), return_text_in_logprobs=True,
    )
    token_logprobs = [_choice_tokens(o["meta_info"]["input_token_logprobs"], prompt_last_id)
                      for o in outs]
    unconditional: list[list[Entry]] | None = None
    if method.needs_unconditional:
        ids = [[e[1] for e in t] for t in token_logprobs]
        alone = backend.generate_many(ids, dict(_SCORE), return_logprob=True, logprob_start_len=0,
                                      return_text_in_logprobs=True)
        unconditional = [o["meta_info"]["input_token_logprobs"] for o in alone]
    result = method.decide(choices, token_logprobs, unconditional)
    result.meta_info["prompt_tokens"] = prompt_len
    result.meta_info["cached_tokens"] = [o["meta_info"].get("cached_tokens", 0) for o in outs]
    return result


def choice_meta(result: ChoiceScores) -> dict[str, Any]:
    return {**result.meta_info, "decision": result.decision, "index": result.index}
