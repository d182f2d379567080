"""Starts the scheduler and detokenizer processes on private IPC sockets and waits for ready."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import shutil
import sys
import tempfile
import threading
import time
import types
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from radixserve.config import ServerArgs
from radixserve.ipc import messages as m
from radixserve.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class IpcPaths:
    """One private temp folder per server, so two servers on a host never collide."""

    folder: str

    @property
    def scheduler(self) -> str:
        return f"ipc://{self.folder}/scheduler"

    @property
    def detokenizer(self) -> str:
        return f"ipc://{self.folder}/detokenizer"

    @property
    def frontend(self) -> str:
        return f"ipc://{self.folder}/frontend"


@contextlib.contextmanager
def _user_main_hidden() -> Iterator[None]:
    """Start children without re-importing the user's main module.

    The spawn start method re-runs the parent's ``__main__`` file in each child (as
    ``__mp_main__``) so that functions defined there can be unpickled.  Our targets and
    arguments all live in the radixserve package, so the child needs none of it, and
    re-running a script that builds an ``Engine`` at top level would start another engine
    in the child.  ``Process.start`` reads ``sys.modules["__main__"]`` while it builds the
    child's preparation data; an empty stand-in there gives the child nothing to import.
    """
    main = sys.modules.get("__main__")
    sys.modules["__main__"] = types.ModuleType("__main__")
    try:
        yield
    finally:
        if main is not None:
            sys.modules["__main__"] = main


def _check_can_start_children() -> None:
    if mp.current_process().daemon:
        raise RuntimeError(
            "radixserve cannot start its processes from a daemonic multiprocessing process "
            f"({mp.current_process().name}); start the Engine or server in the main process "
            "or in a non-daemonic child"
        )


def _keep_config_record(folder: str) -> None:
    """Resolve the model's config here, where transformers is imported for the tokenizer
    anyway, so the scheduler reads it from the cache folder's record and never imports
    transformers (seconds of its start, and memory it would hold while serving).  A config that
    does not resolve is left to the scheduler, which reports it as a failed start."""
    from radixserve.checkpoint.records import read_config

    if os.path.isfile(os.path.join(folder, "config.json")):
        try:
            read_config(folder)
        except Exception as e:  # noqa: BLE001 - the scheduler's load reports it
            logger.debug("config of %s not resolved in the launcher: %s", folder, e)


class ProcessGroup:
    """The scheduler and detokenizer processes of one server or engine."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args.resolve()
        from radixserve.model.default_model import resolve_model_path

        # Converts the default model / a .gguf once into the cache folder, here in the
        # launcher, so the progress bar shows and every process loads the same folder.
        self.model_path = resolve_model_path(self.args.model)
        _keep_config_record(self.model_path)
        self.paths = IpcPaths(tempfile.mkdtemp(prefix="radixserve-"))
        self.procs: dict[str, mp.Process] = {}
        self.info: m.ModelInfo | None = None
        self.tokenizer: Any = None  # the front end's, loaded by start()
        self._shutdown_lock = threading.Lock()  # a watchdog thread and the owner may both stop us

    def start(self) -> m.ModelInfo:
        """Start the processes (with ``tp_size > 1``, one more per extra tensor-parallel rank);
        return the scheduler's model info once all are ready."""
        from radixserve.detokenizer import run_detokenizer_process
        from radixserve.runtime.scheduler_main import run_scheduler_process

        _check_can_start_children()
        ctx = mp.get_context("spawn")
        tokenizer_path = self.args.tokenizer or self.model_path
        sched_r, sched_w = ctx.Pipe(duplex=False)
        detok_r, detok_w = ctx.Pipe(duplex=False)
        # The key is the HTTP front end's business only: the scheduler never holds it.
        model_args = dataclasses.replace(self.args, api_key=None)
        self.procs["scheduler"] = ctx.Process(
            target=run_scheduler_process,
            args=(
                model_args,
                self.model_path,
                self.paths.scheduler,
                self.paths.detokenizer,
                sched_w,
                self.paths.folder,
            ),
            name="radixserve-scheduler",
            daemon=True,
        )
        rank_pipes = {}
        if self.args.tp_size > 1:  # the module imports torch: the front end waits for it only then
            from radixserve.executor.tp_worker import run_tp_worker_process
        for rank in range(1, self.args.tp_size):
            name = f"tensor-parallel rank {rank}"
            rank_pipes[name], rank_w = ctx.Pipe(duplex=False)
            self.procs[name] = ctx.Process(
                target=run_tp_worker_process,
                args=(model_args, self.model_path, rank, self.paths.folder, rank_w),
                name=f"radixserve-tp-rank-{rank}",
                daemon=True,
            )
        self.procs["detokenizer"] = ctx.Process(
            target=run_detokenizer_process,
            args=(
                tokenizer_path,
                self.paths.detokenizer,
                self.paths.frontend,
                detok_w,
                self.args.log_level,
            ),
            name="radixserve-detokenizer",
            daemon=True,
        )
        try:
            with _user_main_hidden():
                for proc in self.procs.values():
                    proc.start()
            # The front end's tokenizer loads while the processes start (transformers' import
            # alone takes seconds): a thread, since the waiting below only polls pipes.
            with ThreadPoolExecutor(1, thread_name_prefix="radixserve-tokenizer") as pool:
                loading = pool.submit(load_tokenizer, tokenizer_path)
                info = self._wait_ready({"scheduler": sched_r, "detokenizer": detok_r,
                                         **rank_pipes})["scheduler"]
                self.tokenizer = loading.result()
        except BaseException:
            self.shutdown()
            raise
        if not isinstance(info, m.ModelInfo):
            raise RuntimeError(f"the scheduler reported {type(info).__name__}, not its model info")
        # The front end's tokenizer (the scheduler's may be the model's own).
        self.info = dataclasses.replace(info, tokenizer_path=tokenizer_path)
        return self.info

    def _wait_ready(self, pipes: dict[str, Any]) -> dict[str, m.ModelInfo | None]:
        """Each process's ready payload (the scheduler's model info; None from the others);
        the first start-up error (or death) of any fails it."""
        deadline = time.monotonic() + self.args.startup_timeout
        ready: dict[str, m.ModelInfo | None] = {}
        while len(ready) < len(pipes):
            if time.monotonic() > deadline:
                late = [name for name in pipes if name not in ready]
                raise RuntimeError(
                    f"{', '.join(late)} not ready after {self.args.startup_timeout} s"
                )
            for name, pipe in pipes.items():
                if name in ready:
                    continue
                if pipe.poll(0.05):
                    status, payload = pipe.recv()
                    if status != "ready":
                        raise RuntimeError(payload)
                    ready[name] = payload
                elif not self.procs[name].is_alive():
                    raise RuntimeError(
                        f"{name} process exited with code {self.procs[name].exitcode} "
                        "during start-up"
                    )
        return ready

    def dead_process(self) -> str | None:
        """Name and exit code of a process that died, if any."""
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"{name} process exited with code {proc.exitcode}"
        return None

    def shutdown(self) -> None:
        with self._shutdown_lock:
            started = [p for p in self.procs.values() if p.pid is not None]
            for proc in started:
                if proc.is_alive():
                    proc.terminate()
            for proc in started:
                proc.join(5)
                if proc.is_alive():
                    proc.kill()
                    proc.join(2)
            self.procs.clear()
            shutil.rmtree(self.paths.folder, ignore_errors=True)
