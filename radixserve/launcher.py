"""Starts the scheduler and detokenizer processes on private IPC sockets and waits for ready."""

from __future__ import annotations

import logging
import multiprocessing as mp
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from radixserve.config import ServerArgs

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


class ProcessGroup:
    """The scheduler and detokenizer processes of one server or engine."""

    def __init__(self, args: ServerArgs) -> None:
        self.args = args.resolve()
        from radixserve.model.loader import resolve_model_path

        # Converts the default model / a .gguf once into the cache folder, here in the
        # launcher, so the progress bar shows and every process loads the same folder.
        self.model_path = resolve_model_path(self.args.model)
        self.paths = IpcPaths(tempfile.mkdtemp(prefix="radixserve-"))
        self.procs: dict[str, mp.Process] = {}
        self.info: dict[str, Any] = {}

    def start(self) -> dict[str, Any]:
        """Start both processes; return the scheduler's model info once both are ready."""
        from radixserve.detokenizer import run_detokenizer_process
        from radixserve.scheduler.process import run_scheduler_process

        ctx = mp.get_context("spawn")
        tokenizer_path = self.args.tokenizer or self.model_path
        sched_r, sched_w = ctx.Pipe(duplex=False)
        detok_r, detok_w = ctx.Pipe(duplex=False)
        self.procs["scheduler"] = ctx.Process(
            target=run_scheduler_process,
            args=(self.args, self.model_path, self.paths.scheduler, self.paths.detokenizer, sched_w),
            name="radixserve-scheduler",
            daemon=True,
        )
        self.procs["detokenizer"] = ctx.Process(
            target=run_detokenizer_process,
            args=(tokenizer_path, self.paths.detokenizer, self.paths.frontend, detok_w),
            name="radixserve-detokenizer",
            daemon=True,
        )
        try:
            for proc in self.procs.values():
                proc.start()
            self.info = self._wait_ready("scheduler", sched_r)
            self._wait_ready("detokenizer", detok_r)
        except BaseException:
            self.shutdown()
            raise
        self.info["tokenizer_path"] = tokenizer_path
        return self.info

    def _wait_ready(self, name: str, pipe: Any) -> dict[str, Any]:
        deadline = time.monotonic() + self.args.startup_timeout
        proc = self.procs[name]
        while time.monotonic() < deadline:
            if pipe.poll(0.2):
                status, payload = pipe.recv()
                if status == "ready":
                    return payload
                raise RuntimeError(payload)
            if not proc.is_alive():
                raise RuntimeError(f"{name} process exited with code {proc.exitcode} during start-up")
        raise RuntimeError(f"{name} process not ready after {self.args.startup_timeout} s")

    def dead_process(self) -> str | None:
        """Name and exit code of a process that died, if any."""
        for name, proc in self.procs.items():
            if not proc.is_alive():
                return f"{name} process exited with code {proc.exitcode}"
        return None

    def shutdown(self) -> None:
        for proc in self.procs.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.procs.values():
            proc.join(5)
            if proc.is_alive():
                proc.kill()
                proc.join(2)
        self.procs.clear()
        shutil.rmtree(self.paths.folder, ignore_errors=True)
