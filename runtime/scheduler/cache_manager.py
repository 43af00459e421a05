"""Rank 0's KV page ownership: admission, hand-over to the prefix cache, release, integrity check."""

from __future__ import annotations

from runtime.batch import Req
from runtime.scheduler.pages import PageAllocator
from runtime.scheduler.prefix_cache import NaivePrefixCache, PrefixCache
from runtime.scheduler.radix_cache import RadixCache


class CacheManager:
    def __init__(self, num_pages: int, page_size: int, cache_type: str = "naive") -> None:
        self.page_size = page_size
        self.allocator = PageAllocator(num_pages)
        self.cache: PrefixCache = RadixCache(self.allocator, page_size) if cache_type == "radix" else NaivePrefixCache()
        self.shares_prefixes = cache_type == "radix"

    def pages_for(self, req: Req) -> int:
        # KV is written for every token but the last sampled one.
        return -(-(req.prompt_len + req.max_new_tokens - 1) // self.page_size)

    def admit(self, req: Req) -> bool:
        """Give ``req`` pages for its whole reservation, reusing a cached prefix; False if they are not there."""
        need = self.pages_for(req)
        # The last prompt token is always computed (its logits give the first new token); prompt logprobs
        # need every position.
        matched, node = self.cache.match([] if req.wants_prompt_logprobs else req.prompt_ids[:-1])
        self.cache.lock(node)  # before evicting, so the match itself survives
        short = need - len(matched) - self.allocator.num_free
        if short > self.cache.evictable_pages:  # cannot fit even after eviction: keep the cache as it is
            self.cache.unlock(node)
            return False
        if short > 0:
            self.cache.evict(short)
        own = self.allocator.alloc(need - len(matched))
        req.pages, req.own_pages, req.cache_node = matched + own, own, node
        req.cached_len = len(matched) * self.page_size
        return True

    def cache_prompt(self, req: Req) -> None:
        """Share the prompt's KV once its last chunk is launched."""
        self._give_to_cache(req, req.prompt_ids)
        req.prompt_cached = True

    def release(self, req: Req) -> None:
        """Hand the KV to the prefix cache and free private pages at once: a step in flight that reads them
        runs before the next admission's writes, since all device work is ordered on one stream."""
        valid = min(req.cached_len, req.prompt_len + max(len(req.output_ids) - 1, 0))
        self._give_to_cache(req, (req.prompt_ids + req.output_ids)[:valid])
        req.prompt_cached = req.prompt_cached or valid >= req.prompt_len
        self.allocator.free(req.own_pages)
        self.cache.unlock(req.cache_node)
        req.pages, req.own_pages, req.cache_node = [], [], None

    def _give_to_cache(self, req: Req, tokens: list[int]) -> None:
        """Offer the whole pages of ``tokens`` and pin where they end; duplicates of pages another request
        cached first stay this request's own (its page table still points at them) until it finishes."""
        full = min(len(tokens) // self.page_size, len(req.pages))
        tokens = tokens[: full * self.page_size]
        kept_by_caller = set(self.cache.insert(tokens, req.pages[:full]))
        handed = set(req.pages[:full]) - kept_by_caller
        req.own_pages = [p for p in req.own_pages if p not in handed]
        _, node = self.cache.match(tokens)
        self.cache.lock(node)  # pin the longer path before releasing the shorter one
        self.cache.unlock(req.cache_node)
        req.cache_node = node

    def check_integrity(self, live: list[Req]) -> None:
        """Every page has exactly one owner and admitted requests only point at pages they may read."""
        cached, pinned = self.cache.held_pages()
        owners = self.allocator.free_pages + cached
        for req in live:
            assert set(req.pages) - set(req.own_pages) <= pinned, f"request {req.uid} reads unpinned or evicted pages"
            owners += req.own_pages
        assert len(owners) == len(set(owners)), "a page has two owners"
        assert set(owners) == set(range(1, self.allocator.num_pages)), "pages leaked or invented"
