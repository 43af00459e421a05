"""Prefix reuse: a page-aligned radix tree over token ids; locked paths are pinned, leaves evicted LRU."""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from runtime.scheduler.pages import PageAllocator

_clock = itertools.count()


@dataclass(eq=False)
class Node:
    tokens: tuple[int, ...] = ()
    pages: list[int] = field(default_factory=list)
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)
    ref: int = 0
    last_used: int = 0


class RadixCache:
    def __init__(self, allocator: PageAllocator, page_size: int) -> None:
        self.allocator = allocator
        self.page_size = page_size
        self.root = Node()
        self.root.ref = 1  # never evicted
        self.evictable_pages = 0
        self.tree_pages = 0
        self.leaves: set[Node] = set()  # kept up to date so eviction never walks the whole tree

    def _chunk(self, tokens: tuple[int, ...] | list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.page_size : (i + 1) * self.page_size])

    def _walk(self, tokens: list[int] | tuple[int, ...], n_chunks: int) -> tuple[Node, int, list[tuple[Node, int]]]:
        """Follow the longest cached prefix, splitting a partly matching node; returns (last node, pages, path)."""
        node, i, path = self.root, 0, []
        stamp = next(_clock)
        while i < n_chunks:
            child = node.children.get(self._chunk(tokens, i))
            if child is None:
                break
            k = 0
            while k < len(child.pages) and i + k < n_chunks and self._chunk(child.tokens, k) == self._chunk(tokens, i + k):
                k += 1
            if k < len(child.pages):
                child = self._split(child, k)
            child.last_used = stamp
            path.append((child, i))
            node, i = child, i + k
        return node, i, path

    def match(self, tokens: list[int]) -> tuple[list[int], Node]:
        """Pages of the longest cached page-aligned prefix of ``tokens``, and the node where it ends."""
        node, _, path = self._walk(tokens, len(tokens) // self.page_size)
        return [p for n, _ in path for p in n.pages], node

    def _split(self, node: Node, k: int) -> Node:
        """Cut ``node`` after its first ``k`` pages; returns the new upper part."""
        p = self.page_size
        upper = Node(node.tokens[: k * p], node.pages[:k], node.parent, {}, node.ref, node.last_used)
        node.parent.children[self._chunk(node.tokens, 0)] = upper
        node.tokens, node.pages, node.parent = node.tokens[k * p :], node.pages[k:], upper
        upper.children[self._chunk(node.tokens, 0)] = node
        return upper

    def lock(self, node: Node) -> None:
        while node is not None:
            if node.ref == 0:
                self.evictable_pages -= len(node.pages)
            node.ref += 1
            node = node.parent

    def unlock(self, node: Node) -> None:
        while node is not None:
            node.ref -= 1
            if node.ref == 0:
                self.evictable_pages += len(node.pages)
            node = node.parent

    def insert(self, tokens: list[int], pages: list[int]) -> list[int]:
        """Add a page-aligned sequence; returns the caller's pages that duplicate cached ones."""
        assert len(tokens) == len(pages) * self.page_size
        node, i, path = self._walk(tokens, len(pages))
        duplicates = [p for n, start in path for p, q in zip(pages[start : start + len(n.pages)], n.pages) if p != q]
        if i < len(pages):
            new = Node(tuple(tokens[i * self.page_size :]), list(pages[i:]), node, {}, 0, next(_clock))
            node.children[self._chunk(tokens, i)] = new
            self.leaves.discard(node)
            self.leaves.add(new)
            self.tree_pages += len(new.pages)
            self.evictable_pages += len(new.pages)
        return duplicates

    def evict(self, n_pages: int) -> int:
        """Free at least ``n_pages`` pages from unreferenced leaves, least recently used first."""
        heap = [(n.last_used, id(n), n) for n in self.leaves if n.ref == 0]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < n_pages:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            del parent.children[self._chunk(leaf.tokens, 0)]
            self.leaves.discard(leaf)
            if parent is not self.root and not parent.children:
                self.leaves.add(parent)
            self.allocator.free(leaf.pages)
            freed += len(leaf.pages)
            self.tree_pages -= len(leaf.pages)
            self.evictable_pages -= len(leaf.pages)
            if parent is not self.root and not parent.children and parent.ref == 0:
                heapq.heappush(heap, (parent.last_used, id(parent), parent))
        return freed

    def nodes(self) -> list[Node]:
        stack, out = [self.root], []
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def held_pages(self) -> tuple[list[int], set[int]]:
        """(every page the tree holds, the pinned ones); also checks the counters."""
        nodes = self.nodes()
        evictable = sum(len(n.pages) for n in nodes if n.ref == 0)
        assert evictable == self.evictable_pages, (evictable, self.evictable_pages)
        assert self.leaves == {n for n in nodes if not n.children and n is not self.root}, "leaf set out of date"
        return [p for n in nodes for p in n.pages], {p for n in nodes if n.ref > 0 for p in n.pages}
