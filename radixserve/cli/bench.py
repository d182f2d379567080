"""``radixserve bench serving|compare``: the benchmarks of the source checkout's ``bench/``.

The benchmark code lives beside the package (``bench/serving.py``, ``bench/compare.py`` and
their workloads in ``bench/workloads.py``), not inside it, and the package imports none of it.
This entry point finds that folder next to the package (an editable install or a checkout, as
the README installs it) and runs the benchmark's script with the arguments given, in a process
of its own; the script names itself ``radixserve bench NAME`` in its help and errors.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = {
    "serving": "load an OpenAI-compatible server with a workload; latency, throughput, hit rate",
    "compare": "start radixserve servers (radix on/off, policies) and compare them",
}
USAGE = "usage: radixserve bench {serving,compare} [options]   (each takes --help)"
PROG_ENV = "RADIXSERVE_BENCH_PROG"  # the name a benchmark script shows for itself


def source_root() -> Path | None:
    """The checkout holding ``bench/serving.py`` beside this package, if there is one."""
    root = Path(__file__).resolve().parents[2]
    return root if (root / "bench" / "serving.py").is_file() else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\nbenchmarks:")
        for name, text in BENCHMARKS.items():
            print(f"  {name:<9}{text}")
        return 0 if argv else 2
    name, rest = argv[0], argv[1:]
    if name not in BENCHMARKS:
        print(f"radixserve bench: unknown benchmark {name!r}\n{USAGE}", file=sys.stderr)
        return 2
    root = source_root()
    if root is None:
        print("radixserve bench: the benchmarks live in the source checkout's bench/ folder, which "
              "this installation lacks; install radixserve from a checkout with 'pip install -e .'",
              file=sys.stderr)
        return 2
    sys.stdout.flush()
    env = {**os.environ, PROG_ENV: f"radixserve bench {name}"}
    return subprocess.call([sys.executable, str(root / "bench" / f"{name}.py"), *rest], env=env)
