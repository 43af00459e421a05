"""Rank 0's KV page allocator."""

from __future__ import annotations

from runtime.utils import DUMMY_PAGE


class PageAllocator:
    """Free list of page ids; the dummy page is never handed out."""

    def __init__(self, num_pages: int) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV cache has {num_pages} pages; at least 2 are needed (one is the dummy page)")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, DUMMY_PAGE, -1))

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def free_pages(self) -> list[int]:
        return list(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise RuntimeError(f"page allocator asked for {n} pages with {len(self._free)} free")
        pages = self._free[len(self._free) - n :]
        del self._free[len(self._free) - n :]
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(pages)
