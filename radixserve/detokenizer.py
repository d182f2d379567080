"""Detokenizer process: token ids in, text deltas out, incrementally.

For each request it keeps two offsets into the ids (``prefix_offset <= read_offset``) and
decodes only the window ``ids[prefix_offset:]``: text is emitted once it no longer ends in
U+FFFD, so a character split across tokens is never sent half-done.  Text that could be the
start of a stop string is held back until it is known not to be one; at the end the text is
cut before the stop string (unless ``no_stop_trim``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from radixserve.ipc import messages as m

logger = logging.getLogger(__name__)


@dataclass
class DecodeState:
    stop: list[str] = field(default_factory=list)
    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    ids: list[int] = field(default_factory=list)
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""  # decoded so far (complete characters only)
    sent_len: int = 0  # characters of ``text`` already sent


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def _decode(self, ids: list[int], skip: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip)

    def _advance(self, st: DecodeState, final: bool) -> None:
        prefix = self._decode(st.ids[st.prefix_offset : st.read_offset], st.skip_special_tokens)
        window = self._decode(st.ids[st.prefix_offset :], st.skip_special_tokens)
        if len(window) > len(prefix) and (final or not window.endswith("\ufffd")):
            st.text += window[len(prefix) :]
            st.prefix_offset = st.read_offset
            st.read_offset = len(st.ids)

    @staticmethod
    def _held_back(text: str, stops: list[str]) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        best = 0
        for s in stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def process(self, out: m.TokenOut) -> m.StrOut:
        deltas: list[str] = []
        for i, rid in enumerate(out.rids):
            init = out.init[i]
            st = self.states.get(rid)
            if st is None:
                st = DecodeState()
                if init is not None:
                    st.stop = list(init.stop)
                    st.skip_special_tokens = init.skip_special_tokens
                    st.no_stop_trim = init.no_stop_trim
                self.states[rid] = st
            finished = out.finished[i]
            new_ids = out.new_ids[i]
            if finished is not None and not st.no_stop_trim and isinstance(finished.matched, int):
                # A stop token (not a stop string) is not part of the text.
                if new_ids and new_ids[-1] == finished.matched:
                    new_ids = new_ids[:-1]
            st.ids.extend(new_ids)
            self._advance(st, final=finished is not None)
            if finished is None:
                safe = len(st.text) - self._held_back(st.text, st.stop)
                deltas.append(st.text[st.sent_len : safe] if safe > st.sent_len else "")
                st.sent_len = max(st.sent_len, safe)
                continue
            text = st.text
            matched = finished.matched
            if isinstance(matched, str) and not st.no_stop_trim:
                cut = text.find(matched)
                if cut >= 0:
                    text = text[:cut]
            deltas.append(text[st.sent_len :] if len(text) > st.sent_len else "")
            del self.states[rid]
        return m.StrOut(
            rids=out.rids,
            text_deltas=deltas,
            new_ids=out.new_ids,
            finished=out.finished,
            meta=out.meta,
            logprobs=out.logprobs,
            top_logprobs=out.top_logprobs,
            input_logprobs=out.input_logprobs,
            input_top_logprobs=out.input_top_logprobs,
        )


def _rows_without(out: m.TokenOut, skip: set[str]) -> m.TokenOut:
    """``out`` without the rows of the rids in ``skip`` (parallel lists filtered alike)."""
    keep = [i for i, rid in enumerate(out.rids) if rid not in skip]
    rows = {}
    for f in dataclasses.fields(out):
        value = getattr(out, f.name)
        # Optional row lists (logprobs...) may be empty instead of one entry per row.
        rows[f.name] = [value[i] for i in keep] if len(value) == len(out.rids) else value
    return m.TokenOut(**rows)


class DetokenizerLoop:
    """What the process does with each incoming frame; returns the frames to send on.

    The boundary of the process: a malformed frame is logged and dropped; a TokenOut whose
    processing raises is logged with its traceback and every request in it is answered with
    an ErrorOut (500) instead, its state dropped, and its later rows (the scheduler keeps
    generating until the front end's abort arrives) skipped until the request ends.
    """

    def __init__(self, detok: IncrementalDetokenizer) -> None:
        self.detok = detok
        self.failed: set[str] = set()  # rids answered with an error whose end has not come

    def handle(self, data: bytes) -> list[bytes]:
        try:
            msg = m.decode(data)
        except Exception as e:  # ValueError: not JSON, or not a well-typed message
            logger.error("detokenizer dropped a malformed message: %s", e)
            return []
        if isinstance(msg, m.TokenOut):
            return self._token_out(msg)
        if isinstance(msg, m.ErrorOut):
            answered = msg.rid in self.failed
            self._forget(msg.rid)  # the request ended in the scheduler
            if answered:  # its client has had its one terminal message already
                return []
        return [data]  # errors, control replies: pass through unchanged

    def _token_out(self, msg: m.TokenOut) -> list[bytes]:
        try:
            skip = {rid for rid in msg.rids if rid in self.failed}
            if skip:
                for rid, finished in zip(msg.rids, msg.finished, strict=True):
                    if rid in skip and finished is not None:
                        self.failed.discard(rid)  # its last row: nothing more will come
                msg = _rows_without(msg, skip)
                if not msg.rids:
                    return []
            return [m.encode(self.detok.process(msg))]
        except Exception as e:
            frames = self._fail(msg, f"internal error in the detokenizer: {e!r}")
            logger.exception(
                "detokenizer failed on a message; %d request(s) answered with an error", len(frames)
            )
            return frames

    def _fail(self, msg: m.TokenOut, reason: str) -> list[bytes]:
        frames = []
        for rid, finished in zip(msg.rids, msg.finished, strict=True):  # decode lined them up
            self._forget(rid)
            if finished is None:
                self.failed.add(rid)
            frames.append(m.encode(m.ErrorOut(rid=rid, message=reason, status=500)))
        return frames

    def _forget(self, rid: str) -> None:
        self.detok.states.pop(rid, None)
        self.failed.discard(rid)


def run_detokenizer_process(tokenizer_path: str, in_addr: str, out_addr: str, ready_pipe: Any,
                            log_level: str | None = None) -> None:
    """Process entry: PULL TokenOut from the scheduler, PUSH StrOut to the front end."""
    from radixserve.logging_utils import (
        configure_logging,
        exit_on_sigterm,
        ignore_interrupts,
        open_pipeline_sockets,
        parent_alive,
        wait_for_input,
    )
    from radixserve.threads import use_one_thread

    use_one_thread()  # before the tokenizer loads torch: the scheduler owns the cores
    ignore_interrupts()
    configure_logging("detokenizer", log_level)
    exit_on_sigterm("detokenizer")
    try:
        from radixserve.tokenizer import load_decoder

        loop = DetokenizerLoop(IncrementalDetokenizer(load_decoder(tokenizer_path)))
        recv, send = open_pipeline_sockets(in_addr, out_addr)
    except Exception as e:  # reported to the launcher, which fails the start with it
        logger.exception("detokenizer failed to start")
        ready_pipe.send(("error", f"detokenizer failed to start: {e!r}"))
        return
    ready_pipe.send(("ready", None))
    parent = os.getppid()
    while True:
        if not parent_alive(parent):
            logger.info("launcher is gone; detokenizer exits")
            return
        if not wait_for_input(recv, 1000):
            continue
        for frame in loop.handle(recv.recv()):
            send.send(frame)
