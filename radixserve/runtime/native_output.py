"""SGLang's native result shape, built in one place for ``/generate`` and ``Engine.generate``.

The tokenizer manager yields pieces (``pieces.py``) in radixserve's internal shape
(``logprobs``: floats, ``top_logprobs``: ``[token_id, logprob]`` pairs, ``input_logprobs`` from
the scheduler's start).  A native result is ``{"text", "output_ids", "meta_info"}``; with
``return_logprob`` its ``meta_info`` always holds, as SGLang's does:

- ``output_token_logprobs``: one ``[logprob, token_id, text]`` per output token (``[]`` for
  ``max_new_tokens = 0``);
- ``output_top_logprobs``: per output position the ``top_logprobs_num`` best
  ``[logprob, token_id, text]``, or None when ``top_logprobs_num`` is 0;
- ``input_token_logprobs``: one ``[logprob, token_id, text]`` per prompt position from
  ``logprob_start_len`` on; position 0 has logprob None (nothing predicts it);
- ``input_top_logprobs``: as ``output_top_logprobs``, None at position 0.

``text`` is the token decoded on its own when ``return_text_in_logprobs`` is set, else None.
A logprob of -inf (a token masked out, among the top ones) is None, as JSON has no infinity.

``logprob_start_len = -1`` (the default) with ``return_logprob`` covers the last prompt
position only (SGLang's rule: a request for a prefix returns its own last token), so the
scheduler is asked from ``prompt_len - 1`` (:meth:`LogprobRequest.scheduler_start`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from radixserve.runtime.pieces import Piece, RequestMeta

Triple = list[Any]  # [logprob | None, token_id, text | None]


@dataclass(frozen=True)
class LogprobRequest:
    """What a native request asked for about logprobs, as the client gave it."""

    return_logprob: bool = False
    top_logprobs_num: int = 0
    logprob_start_len: int = -1
    return_text_in_logprobs: bool = False

    def scheduler_start(self, prompt_len: int) -> int:
        """The scheduler's ``logprob_start_len`` (-1 there: no prompt logprobs)."""
        if self.return_logprob and self.logprob_start_len == -1:
            return prompt_len - 1
        return self.logprob_start_len


class NativeOutput:
    """One request's native result, fed piece by piece.

    :meth:`add` returns the piece alone in the native shape (the Engine's stream: text, ids
    and logprob lists of that piece; concatenating every piece's lists gives the whole), and
    :meth:`result` the whole result so far (``/generate``, streamed or not).
    """

    def __init__(self, prompt_ids: list[int], lp: LogprobRequest, tokenizer: Any) -> None:
        self.prompt_ids = prompt_ids
        self.lp = lp
        self.start = lp.scheduler_start(len(prompt_ids))
        self.tokenizer = tokenizer
        self._text: list[str] = []
        self._ids: list[int] = []
        self._meta: RequestMeta | None = None
        self._lists: dict[str, list[Any]] = {
            "output_token_logprobs": [], "output_top_logprobs": [],
            "input_token_logprobs": [], "input_top_logprobs": [],
        }

    def add(self, piece: Piece) -> dict[str, Any]:
        self._text.append(piece.text)
        self._ids.extend(piece.output_ids)
        self._meta = piece.meta
        meta = piece.meta.info()
        if self.lp.return_logprob:
            lists = self._format_logprobs(piece)
            for key, values in lists.items():
                self._lists[key].extend(values)
            meta.update(lists)
        return {"text": piece.text, "output_ids": list(piece.output_ids), "meta_info": meta}

    def result(self) -> dict[str, Any]:
        meta = self._meta.info() if self._meta is not None else {}
        if self.lp.return_logprob:
            meta.update({key: list(values) for key, values in self._lists.items()})
        return {"text": "".join(self._text), "output_ids": list(self._ids), "meta_info": meta}

    # ---- formatting ----------------------------------------------------------------------
    def _format_logprobs(self, piece: Piece) -> dict[str, list[Any]]:
        out_ids = piece.output_ids
        values = piece.logprobs
        tops = piece.top_logprobs
        in_values = piece.input_logprobs or []
        in_tops = piece.input_top_logprobs or []
        in_ids = self.prompt_ids[self.start : self.start + len(in_values)]
        texts = self._texts(out_ids, tops, in_ids, in_tops)
        want_top = self.lp.top_logprobs_num > 0

        def triple(lp: float | None, tok: int) -> Triple:
            return [lp, tok, texts.get(tok)]

        def top_list(pairs: list[list[Any]] | None) -> list[Triple] | None:
            return (
                None if pairs is None or not want_top else [triple(lp, int(t)) for t, lp in pairs]
            )

        return {
            "output_token_logprobs": [triple(lp, t) for lp, t in zip(values, out_ids, strict=True)],
            "output_top_logprobs": [
                top_list(tops[j] if j < len(tops) else None) for j in range(len(values))
            ],
            "input_token_logprobs": [
                triple(lp, t) for lp, t in zip(in_values, in_ids, strict=True)
            ],
            "input_top_logprobs": [
                top_list(in_tops[j] if j < len(in_tops) else None) for j in range(len(in_values))
            ],
        }

    def _texts(
        self, out_ids: list[int], tops: list[Any], in_ids: list[int], in_tops: list[Any]
    ) -> dict[int, str]:
        """Each token's own text (one batched decode), when the request asked for text."""
        if not self.lp.return_text_in_logprobs:
            return {}
        ids = set(out_ids) | set(in_ids)
        for pairs in (*tops, *in_tops):
            ids.update(int(t) for t, _ in pairs or [])
        order = sorted(ids)
        return dict(zip(order, self.tokenizer.batch_decode([[t] for t in order]), strict=True))
