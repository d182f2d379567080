"""``radixserve bench serving|compare``: the benchmarks of the source checkout's ``bench/``.

The benchmark code lives beside the package (``bench/serving.py``, ``bench/compare.py`` and
their workloads in ``bench/workloads.py``), not inside it. This entry point finds that folder
next to the package (an editable install or a checkout, as the README installs it) and hands
the benchmark its arguments.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

BENCHMARKS = {
    "serving": ("bench.serving", "load an OpenAI-compatible server with a workload; latency, throughput, hit rate"),
    "compare": ("bench.compare", "start radixserve servers (radix on/off, policies) and compare them"),
}
USAGE = "usage: radixserve bench {serving,compare} [options]   (each takes --help)"


def source_root() -> Path | None:
    """The checkout holding ``bench/serving.py`` beside this package, if there is one."""
    root = Path(__file__).resolve().parent.parent
    return root if (root / "bench" / "serving.py").is_file() else None


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE + "\n\nbenchmarks:")
        for name, (_, text) in BENCHMARKS.items():
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
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    module = importlib.import_module(BENCHMARKS[name][0])
    try:
        report = module.main(rest, prog=f"radixserve bench {name}")
    except (RuntimeError, ValueError) as e:  # server unreachable, corpus too small, bad trace
        print(f"radixserve bench {name}: error: {e}", file=sys.stderr)
        return 1
    runs = report["runs"] if name == "compare" else [{"report": report}]
    return 0 if all(r["report"]["summary"]["completed"] for r in runs) else 1
