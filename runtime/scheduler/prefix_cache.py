"""The prefix-reuse interface; ``insert`` returns the pages the cache did not take."""

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
    """No reuse: every page stays with its request until it finishes."""

    evictable_pages = 0

    def match(self, tokens: list[int]) -> tuple[list[int], None]:
        return [], None

    def lock(self, handle: Any) -> None:
        pass

    def unlock(self, handle: Any) -> None:
        pass

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        return list(pages)

    def evict(self, n_pages: int) -> int:
        return 0

    def held_pages(self) -> tuple[list[int], set[int]]:
        return [], set()
