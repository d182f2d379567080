"""bench/gpu_e2e.py's engines: ``Run`` starts them (the two used last stay alive, found again by
their settings), keeps the current part's deadline, and tallies the requests that failed (a
host-device sync under sync debug, or anything else); and the settings and sampling parameters
the parts build their requests from."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time
from collections import OrderedDict
from typing import Any


class PartTimeout(Exception):
    """A part ran past its time budget (its requests in flight were aborted)."""


# ---- engines, deadlines, sync-debug failures ---------------------------------------------------
class Run:
    """What the parts share: the engines (the two used last stay alive, found again by their
    settings), the current part's deadline, and the tally of failed requests."""

    def __init__(self, args: argparse.Namespace, folder: str, tokenizer: Any) -> None:
        self.args, self.folder, self.tokenizer = args, folder, tokenizer
        self.live: OrderedDict[tuple, tuple[dict[str, Any], Any]] = OrderedDict()
        self.engines: list[dict[str, Any]] = []  # every engine started: settings, start s, memory check
        self.sync_mode = args.sync_debug
        self.sync: dict[str, Any] = {"mode": args.sync_debug, "acts": args.device == "cuda",
                                     "sync_errors": 0, "other_failures": 0, "failures": [], "turned_off_at": None}
        self.part, self.deadline = "", float("inf")

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def check_time(self) -> None:
        if self.left() <= 0:
            raise PartTimeout(f"{self.part} ran out of its time budget")

    def _engine(self, label: str, settings: dict[str, Any]) -> tuple[tuple, Any]:
        from radixserve.config import ServerArgs

        # Settings at their default are left out, so that equal engines have equal keys.
        defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
        settings = {k: v for k, v in settings.items() if defaults.get(k, object()) != v}
        if self.args.device == "cpu":  # CUDA graphs exist only on CUDA: these settings change nothing
            settings.pop("disable_cuda_graph", None)
            settings.pop("cuda_graph_max_bs", None)
        key = (tuple(sorted(settings.items())), self.sync_mode)
        if key in self.live:
            self.live.move_to_end(key)
            return key, self.live[key][1]
        while len(self.live) >= 2:
            self.close(next(iter(self.live)))
        self.check_time()
        from radixserve import Engine

        if self.sync_mode == "off":
            os.environ.pop("RADIXSERVE_SYNC_DEBUG", None)
        else:  # read by the scheduler process, which inherits the environment
            os.environ["RADIXSERVE_SYNC_DEBUG"] = self.sync_mode
        model = settings.pop("model", None)
        t0 = time.perf_counter()
        engine = Engine(model, device=self.args.device, log_level="warning",
                        startup_timeout=max(10.0, self.left()), **settings)
        info = {"label": label, "part": self.part, "model": model or "default", **settings,
                "sync_debug": self.sync_mode, "start_s": time.perf_counter() - t0}
        self.engines.append(info)
        self.live[key] = (info, engine)
        print(f"[{self.part}] engine {label} started in {info['start_s']:.1f} s", flush=True)
        return key, engine

    def close(self, key: tuple) -> None:
        """Shut an engine down after checking its KV memory invariant."""
        info, engine = self.live.pop(key)
        try:
            report = engine.check_memory()
            info["memory_ok"] = bool(report.get("ok"))
            if not info["memory_ok"]:
                info["memory_error"] = str(report.get("error"))
        except Exception as e:  # a dead engine: recorded, and shut down all the same
            info["memory_ok"], info["memory_error"] = False, repr(e)
        finally:
            engine.shutdown()

    def close_all(self) -> None:
        for key in list(self.live):
            self.close(key)

    def batch(self, label: str, settings: dict[str, Any], requests: list[dict[str, Any]],
              flush: bool = False) -> tuple[list[dict[str, Any]], float, dict[str, Any]]:
        """Submit ``requests`` (keyword arguments of ``Engine.async_generate``) at once to the
        engine of ``settings``: (results, wall seconds, scheduler counters over the batch)."""
        for attempt in range(2):
            key, engine = self._engine(label, settings)
            if flush:
                flush_cache(engine, label)
            before = engine.get_stats()
            t0 = time.perf_counter()
            results = self._submit(engine, requests)
            wall = time.perf_counter() - t0
            failed = [r for r in results if isinstance(r, BaseException)]
            if not failed:
                return results, wall, counters(before, engine.get_stats())
            self.close(key)  # it may be broken; the next use starts a fresh one
            sync = self._tally(label, failed)
            if attempt == 0 and sync and self.sync_mode != "off":
                print(f"[{self.part}] {label}: {len(failed)} requests failed on a host-device sync; "
                      "sync debug is off from here on, rerunning the batch", flush=True)
                self.sync_mode, self.sync["turned_off_at"] = "off", f"{self.part}/{label}"
                continue
            raise RuntimeError(f"{label}: {len(failed)} of {len(requests)} requests failed: {failed[0]}")
        raise AssertionError("unreachable")

    def _submit(self, engine: Any, requests: list[dict[str, Any]]) -> list[Any]:
        self.check_time()

        async def submit_all() -> list[Any]:
            jobs = [engine.async_generate(**r) for r in requests]
            return await asyncio.wait_for(asyncio.gather(*jobs, return_exceptions=True), self.left())

        try:
            return asyncio.run(submit_all())
        except asyncio.TimeoutError:  # wait_for cancelled the requests: the engine aborts them
            raise PartTimeout(f"{self.part}: requests still running when its budget ran out") from None

    def _tally(self, label: str, failed: list[BaseException]) -> bool:
        sync = sum("synchroniz" in str(e) for e in failed)  # torch: "called a synchronizing CUDA operation"
        self.sync["sync_errors"] += sync
        self.sync["other_failures"] += len(failed) - sync
        self.sync["failures"] += [{"part": self.part, "engine": label, "error": str(e)[:400]} for e in failed[:2]]
        return sync > 0


def flush_cache(engine: Any, label: str) -> None:
    """Empty the cache; refused while requests are in flight (aborted ones may still be ending)."""
    for _ in range(50):
        if engine.flush_cache():
            return
        time.sleep(0.1)
    raise RuntimeError(f"{label}: flush_cache refused for 5 s")


def counters(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the scheduler counted between two ``get_stats`` snapshots."""
    keys = ("prompt_tokens", "cached_tokens", "prefill_tokens_computed", "generation_tokens",
            "decode_only_seconds", "decode_only_tokens")
    d: dict[str, Any] = {k: after[k] - before[k] for k in keys}
    steps = [sum(n for n, _ in s["overhead_by_batch"].values()) for s in (before, after)]
    d["decode_only_steps"] = steps[1] - steps[0]  # overhead_by_batch counts decode-only steps
    return d


def greedy(n: int) -> dict[str, Any]:
    return {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}


def engine_settings(args: argparse.Namespace, dtype: str, backend: str) -> dict[str, Any]:
    """One engine of the default model, sized for every part that may reuse it."""
    return {"dtype": dtype, "attention_backend": backend, "max_total_tokens": args.pool_tokens,
            "max_running_requests": args.max_running}


def default_settings(args: argparse.Namespace) -> dict[str, Any]:
    return engine_settings(args, args.dtypes[-1], args.backends[0])
