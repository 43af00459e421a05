"""One interface for prefix reuse, with two implementations: naive (no reuse) and radix.

Pages move between three disjoint owners: the allocator (free), the prefix cache,
and admitted requests (their private pages). ``match`` finds the cached pages of a
prompt's longest page-aligned prefix, ``lock``/``unlock`` pin a match while a request
reads it, ``insert`` offers a finished sequence's pages (the cache returns the ones
it did not take), ``evict`` frees unpinned pages.
"""

from __future__ import annotations

from typing import Any, Protocol


class PrefixCache(Protocol):
    evictable_pages: int  # pages held by the cache that no request pins

    def match(self, tokens: list[int]) -> tuple[list[int], Any]: ...
    def lock(self, handle: Any) -> None: ...
    def unlock(self, handle: Any) -> None: ...
    def insert(self, tokens: list[int], pages: list[int]) -> list[int]: ...
    def evict(self, n_pages: int) -> int: ...
    def held_pages(self) -> tuple[list[int], set[int]]: ...


class NaivePrefixCache:
    """No reuse: nothing matches, nothing is kept, every page stays with its request until it finishes."""

    evictable_pages = 0

    def match(self, tokens: list[int]) -> tuple[list[int], None]:
        return [], None

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        return list(pages)  # not taken: the request frees them itself

    def evict(self, n_pages: int) -> int:
        return 0

    def held_pages(self) -> tuple[list[int], set[int]]:
        return [], set()
