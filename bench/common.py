"""What the benchmarks in ``bench/`` share: the machine description, target checks and their
printed lines, plain-text tables, writing the JSON report, and the servers they start."""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Container, Sequence
from pathlib import Path
from typing import Any


def machine_info() -> dict[str, Any]:
    import torch
    import transformers

    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "transformers": transformers.__version__,
        "cuda": torch.cuda.is_available(),
    }
    if info["cuda"]:
        info["gpu"] = torch.cuda.get_device_name(0)
    info.update(cpu_kind())
    return info


# The instruction sets the CPU kernels choose between (radixserve/cpu_ext/vec.h).
CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16")


def cpu_kind() -> dict[str, Any]:
    """The CPU's model name (as lscpu shows it) and which of :data:`CPU_FLAGS` it has."""
    model, flags = platform.processor(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name" and model in ("", platform.machine()):
                model = value.strip()
            elif key.strip() == "flags":
                flags = set(value.split())
                break
    except OSError:
        pass
    kind = "AVX-512 BF16" if "avx512_bf16" in flags else "AVX-512" if "avx512f" in flags else (
        "AVX2" if "avx2" in flags else "other")
    return {"cpu_model": model, "cpu_kind": kind, "cpu_flags": {f: f in flags for f in CPU_FLAGS}}


def args_params(args: argparse.Namespace) -> dict[str, Any]:
    """The command-line arguments as JSON values (paths as strings)."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}


def target(dtype: str, name: str, value: float | None, limit: float, at_least: bool) -> dict[str, Any]:
    """One target check of a dtype's run; ``ok`` is None when the value was not measured."""
    ok = None if value is None else (value >= limit if at_least else value <= limit)
    return {"dtype": dtype, "target": name, "value": value, "limit": limit, "ok": ok}


def target_lines(checks: list[dict[str, Any]], scope: str = "dtype", value_format: str = ".3g") -> list[str]:
    """``target PASS [<check[scope]>] <name> <limit>: <value>`` per check (printed, never asserted)."""
    lines = []
    for c in checks:
        verdict = {True: "PASS", False: "FAIL", None: "n/a "}[c["ok"]]
        value = "-" if c["value"] is None else format(c["value"], value_format)
        lines.append(f"target {verdict} [{c[scope]}] {c['target']} {c['limit']:g}: {value}")
    return lines


def align_columns(lines: Sequence[Sequence[str]], left: Container[int] = ()) -> str:
    """Rows of cells as text columns two spaces apart: the columns in ``left`` flush left, the
    others flush right (the first row is the header)."""
    widths = [max(len(line[i]) for line in lines) for i in range(len(lines[0]))]
    return "\n".join(
        "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(line, widths, strict=True)))
        for line in lines
    )


def weight_settings(spec: str) -> dict[str, Any]:
    """Engine settings of a weight format named in a benchmark's ``--quantizations``: a
    ``--quantization`` value, with ``+a8`` for int8 activations (``gguf+a8``: the GGUF's 4-bit
    blocks times activations quantized to int8, ``--int8-activations``)."""
    quant, plus, extra = spec.partition("+")
    if plus and extra != "a8":
        raise ValueError(f"weight format {spec!r}: the only suffix is +a8 (int8 activations)")
    return {"quantization": quant, "int8_activations": bool(plus)}


def write_json(data: dict[str, Any], out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=2) + "\n")


def write_report(report: dict[str, Any], out: Path) -> None:
    """Write the report as indented JSON (creating its folder) and say where."""
    write_json(report, out)
    print(f"wrote {out}")


_GIVEN_PORTS: set[int] = set()


def free_port() -> int:
    """A free loopback port that this process has not handed out before: the OS may give a
    port back as soon as it is closed, and a server told two equal ports fails to start."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _GIVEN_PORTS:
            _GIVEN_PORTS.add(port)
            return port


class Launched:
    """A server process started here on loopback port ``port``; its output goes to a temp
    log.  It is ready when :meth:`is_ready` says so (``GET /health`` answers 200 by default);
    a process that exits or is not ready in time is stopped and reported with its log."""

    def __init__(self, name: str, cmd: list[str], port: int, startup_timeout: float,
                 env: dict[str, str] | None = None) -> None:
        self.name, self.cmd, self.port = name, cmd, port
        self.base_url = f"http://127.0.0.1:{port}"
        fd, self.log_path = tempfile.mkstemp(prefix=f"{name}-", suffix=".log")
        with os.fdopen(fd, "w") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                         env={**os.environ, **(env or {})})
        try:
            self._wait_ready(startup_timeout)
        except BaseException:  # Ctrl-C or not ready: never leave the process behind
            self.stop()
            raise

    def is_ready(self) -> bool:
        with urllib.request.urlopen(self.base_url + "/health", timeout=2) as r:
            return r.status == 200

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                if self.is_ready():
                    return
            except OSError:
                pass  # not listening yet
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} was not ready after {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 30) -> str:
        with open(self.log_path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])

    def stop(self, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
