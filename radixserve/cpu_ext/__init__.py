"""The C++ kernels for CPUs (paged attention, fused elementwise ops), compiled once per machine
and cached.

Why a C++ kernel: reading K/V in place from a paged pool needs an indirection per key (the
request-to-token table), which no eager torch op does without first gathering a copy, and over
long shared prefixes the gathered copies cost more than the attention itself
(``bench/offline.py --breakdown`` shows the split).  FlexAttention (a block mask over the
pages, compiled by inductor for CPU) and ``torch.compile`` of the gather path do not fit: both
recompile per shape bucket, the mask must be rebuilt every step, and neither reads the pool
through a per-token table.  The kernels (``paged_attention.cpp``, ``fused_ops.cpp``) are
built with the system C++ compiler through ``torch.utils.cpp_extension`` the first time a CPU
server starts (tens of seconds, shown on stderr as it happens; ``radixserve build-kernels`` builds
them ahead of time), then loaded from the cache folder in milliseconds.  Where no
compiler exists, :func:`load` returns None and the backend keeps its pure-torch path.

The build is keyed by the source, the torch version and the CPU's flags: ``-march=native``
code never runs on a machine whose CPU lacks the instructions it was compiled for.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import platform
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

from radixserve.checkpoint.cache_dir import cache_root

log = logging.getLogger("radixserve")

SOURCES = [Path(__file__).with_name(name)
           for name in ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp", "linear_ops.cpp",
                         "kv_store.cpp", "decode_layers.cpp", "sampler.cpp", "kquant_ops.cpp",
                         "kquant_wide.cpp", "lora_ops.cpp")]
HEADERS = [Path(__file__).with_name(name) for name in ("vec.h", "decode_layers.h", "kquant.h",
                                                        "kquant_wide.h", "row_shares.h")]
# -fopenmp: ``at::parallel_for`` is an OpenMP pragma in ATen's headers; without the flag it
# compiles to a serial loop (torch's own libgomp is the runtime it links against at load time).
# ``RADIXSERVE_CPU_MARCH`` builds for another ``-march`` target than this CPU (``haswell``: the
# AVX2 code path, ``skylake-avx512``: AVX-512 without BF16), to test a path on a CPU that can run
# it; the build folder is keyed by it.
_FLAGS = [
    "-O3",
    f"-march={os.environ.get('RADIXSERVE_CPU_MARCH') or 'native'}",
    "-fno-math-errno",
    "-std=c++17",
    "-fopenmp",
]
# What the first build is announced to take on a small machine (the files compile in parallel;
# each includes only the ATen headers it needs).
BUILD_SECONDS = 25
HEARTBEAT_S = 15
_lock = threading.Lock()
_loaded: dict[str, ModuleType | None] = {}


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return platform.processor()


def build_dir() -> Path:
    root = cache_root()  # the same folder as the converted models
    # The sources' folder is part of the key: torch rebuilds a folder whose build file names
    # other source paths, so two checkouts sharing one cache would rebuild each other's.
    key = hashlib.sha256(
        str(SOURCES[0].parent).encode()
        + b"".join(p.read_bytes() for p in SOURCES + HEADERS)
        + torch.__version__.encode()
        + _cpu_flags().encode()
        + " ".join(_FLAGS).encode()
    ).hexdigest()[:16]
    return Path(root) / "cpu_ext" / key


def load() -> ModuleType | None:
    """The compiled kernel module, building it on first use; None where it cannot be built
    (or ``RADIXSERVE_CPU_KERNELS=0``).  Called by every fused op of every layer: once the
    build is settled the answer comes from a dict read, without the lock."""
    if "mod" in _loaded:
        return _loaded["mod"]
    with _lock:
        if "mod" in _loaded:
            return _loaded["mod"]
        mod = None
        if os.environ.get("RADIXSERVE_CPU_KERNELS", "1") != "0":
            mod = _build()
        _loaded["mod"] = mod
        return mod


def _build() -> ModuleType | None:
    from torch.utils import cpp_extension

    where = build_dir()
    where.mkdir(parents=True, exist_ok=True)
    try:
        # torch's own build lock is a plain file that a killed build leaves behind, and every
        # later start would wait on it forever.  An flock is released by the OS however its
        # holder ends: whoever holds it is the only builder, so a torch lock found then is stale.
        with open(where / "build.flock", "w") as guard:
            fcntl.flock(guard, fcntl.LOCK_EX)
            stale = where / "lock"
            if stale.exists():
                log.warning("removing the lock of an interrupted build in %s", where)
                stale.unlink()
            with _shown_if_compiling(where), _our_ninja_first():
                return cpp_extension.load(
                    name="radixserve_paged_attention",
                    sources=[str(p) for p in SOURCES],
                    extra_cflags=_FLAGS,
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(where),
                    verbose=False,
                )
    except Exception as exc:  # no compiler, missing headers: serve on the torch path
        log.warning("CPU attention kernel unavailable (%s); using the torch gather path",
                    str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        return None


@contextlib.contextmanager
def _our_ninja_first() -> Iterator[None]:
    """torch runs whichever ``ninja`` comes first on PATH.  Two ninja versions write build logs
    the other cannot read (1.13's hashes its commands differently), so processes that find
    different ones (the pip package's in the virtual environment, a system one outside it)
    rebuild the same folder in turn; the build always runs the ``ninja`` package's own."""
    try:
        import ninja
    except ImportError:  # torch then finds one on PATH or reports that none exists
        yield
        return
    before = os.environ.get("PATH", "")
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + before
    try:
        yield
    finally:
        os.environ["PATH"] = before


@contextlib.contextmanager
def _shown_if_compiling(where: Path) -> Iterator[None]:
    """On stderr, whatever the log level (a build looks like a hang otherwise): a line when a
    build starts, one every ``HEARTBEAT_S`` while it runs, and its duration at the end."""
    if any(where.glob("*.so")):
        yield
        return
    started = time.monotonic()
    done = threading.Event()
    _say(f"compiling the CPU kernels once for this machine into {where} (about {BUILD_SECONDS} s; "
         "`radixserve build-kernels` does it ahead of time)")

    def heartbeat() -> None:
        while not done.wait(HEARTBEAT_S):
            _say(f"still compiling the CPU kernels ({time.monotonic() - started:.0f} s)")

    beat = threading.Thread(target=heartbeat, name="radixserve-kernel-build", daemon=True)
    beat.start()
    try:
        yield
    finally:
        done.set()
        beat.join()
    _say(f"CPU kernels compiled in {time.monotonic() - started:.0f} s")


def _say(text: str) -> None:
    sys.stderr.write(f"radixserve: {text}\n")
    sys.stderr.flush()
