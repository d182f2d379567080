"""Stand-ins for the C++ kernels' module (``radixserve.cpu_ext.load()``) in tests of what a
build without a CPU feature, or without the kernels, does."""

from __future__ import annotations


class WithoutVnni:
    """The kernels ``ops`` as a build without AVX-512 VNNI reports them: ``q8_supported()`` is
    False, every other name is ops' own."""

    def __init__(self, ops: object) -> None:
        self._ops = ops

    def __getattr__(self, name: str) -> object:
        return getattr(self._ops, name)

    def q8_supported(self) -> bool:
        return False
