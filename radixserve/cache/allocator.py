"""Page allocator: hands out whole pages of KV slots."""

from __future__ import annotations

import numpy as np


class PageAllocator:
    """Pages ``1 .. num_pages`` are allocatable; page 0 is the padding page, never handed out.

    Slot ``s`` lives in page ``s // page_size``.  Allocation returns slot indices (page by
    page, in order) so callers deal in slots; freeing takes slot runs that cover whole pages.
    """

    def __init__(self, num_pages: int, page_size: int) -> None:
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.num_pages = num_pages
        self.page_size = page_size
        self._offsets = np.arange(page_size, dtype=np.int64)
        self.reset()

    def reset(self) -> None:
        # A stack of free pages; popping from the end hands out low pages first.
        self._free: list[int] = list(range(self.num_pages, 0, -1))
        self._is_free = np.ones(self.num_pages + 1, dtype=bool)
        self._is_free[0] = False

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    @property
    def num_slots(self) -> int:
        """Size of the KV pool this allocator addresses (padding page included)."""
        return (self.num_pages + 1) * self.page_size

    def alloc_pages(self, n: int) -> np.ndarray | None:
        """Slots of ``n`` fresh pages (``n * page_size`` slots), or None if not enough are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return np.empty(0, dtype=np.int64)
        pages = np.array(self._free[-n:][::-1], dtype=np.int64)
        del self._free[-n:]
        self._is_free[pages] = False
        return (pages[:, None] * self.page_size + self._offsets).reshape(-1)

    def free_slots(self, slots: np.ndarray) -> None:
        """Free the pages that ``slots`` cover (page-aligned runs of whole pages)."""
        if len(slots) == 0:
            return
        slots = np.asarray(slots, dtype=np.int64)
        if len(slots) % self.page_size or slots[0] % self.page_size:
            raise RuntimeError(
                f"free of {len(slots)} slots starting at {slots[0]} is not page aligned"
            )
        pages = slots[:: self.page_size] // self.page_size
        if (pages <= 0).any() or self._is_free[pages].any() or len(np.unique(pages)) != len(pages):
            raise RuntimeError(f"double free or invalid page among {pages.tolist()[:16]}")
        self._is_free[pages] = True
        self._free.extend(pages[::-1].tolist())

    def used_pages(self) -> np.ndarray:
        return np.nonzero(~self._is_free[1:])[0] + 1
