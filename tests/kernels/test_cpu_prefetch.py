"""The built CPU kernels still hold their prefetch instructions.

GCC 12 at -O3 once deleted the ``__builtin_prefetch`` loops of the 4-bit kernels: the library
built and every result was right, but the weights streamed on the hardware's prefetch alone and
a one-row step's 4-bit matmuls took 4.9 ms instead of 3.1.  No result shows that, so this reads
the machine code of the library the kernels were built into.
"""

from __future__ import annotations

import platform
import re
import shutil
import subprocess
from collections import Counter

import pytest

from radixserve import cpu_ext

pytestmark = pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64 prefetch instructions")


def prefetches_by_function() -> Counter[str]:
    """Prefetch instructions per function (demangled name) of the loaded kernels' library."""
    ops = cpu_ext.load()
    assert ops is not None, "the kernels build on this machine (test_the_kernels_build_here)"
    objdump = shutil.which("objdump")
    assert objdump is not None, "binutils come with the C++ compiler that built the kernels"
    text = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", ops.__file__], check=True,
                          capture_output=True, text=True).stdout
    counts: Counter[str] = Counter()
    name = ""
    for line in text.splitlines():
        if m := re.match(r"^[0-9a-f]+ <(.*)>:$", line):
            name = m.group(1)
        elif "\tprefetch" in line:
            counts[name] += 1
    return counts


def test_the_4bit_and_int8_kernels_ask_for_their_weights_ahead() -> None:
    counts = prefetches_by_function()

    def total(*needles: str) -> int:
        return sum(n for name, n in counts.items() if any(needle in name for needle in needles))

    # Wherever the compiler put them (their own functions, or inlined in the ops' lambdas).
    assert total("int4_rows", "int4_linear(") > 0, counts
    assert total("int8_rows", "int8_linear(") > 0, counts
    assert total("dot_linear", "float_linear") > 0, counts
    if cpu_ext.load().q8_supported():  # the VNNI kernels: 4-bit weights (8- and 16-bit x), int8 weights
        assert total("NibbleRows, true", "int4_linear_q16") > 0, counts
        assert total("NibbleRows, false", "int4_linear_q8") > 0, counts
        assert total("ByteRows", "int8_linear_q8") > 0, counts
    assert total("paged_attention", "run_task", "run_jobs") > 0, counts
