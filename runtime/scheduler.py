"""Rank 0's scheduler: continuous batching with chunked prefill over a paged KV cache.

Policy: prefill first (continue chunked prompts, then admit waiting requests
in arrival order while the step's token budget, free rows and free pages
allow), otherwise decode every running request. A request is admitted only
when pages for its whole reservation (prompt + max_new_tokens) are free, so
the cache is never over-committed and nothing is ever preempted.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np

from runtime.batch import Batch, Req
from runtime.config import SchedulerSection
from runtime.kv_cache import PageAllocator
from runtime.radix_cache import RadixCache
from runtime.tokenizer import find_stop


@dataclass
class SchedulerStats:
    page_waits: int = 0  # steps in which the next waiting request had to wait for free pages
    cached_tokens: int = 0  # prompt tokens served from the radix cache instead of computed
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    def __init__(
        self, cfg: SchedulerSection, num_pages: int, page_size: int, max_seq_len: int, dummy_row: int,
        eos_ids: set[int], cache_type: str = "naive", debug_checks: bool = False,
    ) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.dummy_row = dummy_row
        self.eos_ids = frozenset(eos_ids)
        self.allocator = PageAllocator(num_pages)
        self.cache = RadixCache(self.allocator, page_size) if cache_type == "radix" else None
        self.debug_checks = debug_checks
        self.free_rows = list(range(cfg.max_running_requests - 1, -1, -1))
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self.draining = False  # set on SIGTERM/SIGUSR1: admit nothing new

    # ---- admission --------------------------------------------------------------------------------------
    def pages_for(self, req: Req) -> int:
        # KV is written for every token but the last sampled one.
        return -(-(req.prompt_len + req.max_new_tokens - 1) // self.page_size)

    def add(self, req: Req) -> None:
        """Queue a request; raises ValueError (for that request only) if it can never be served."""
        need = self.pages_for(req)
        if need > self.allocator.num_pages - 1:
            raise ValueError(
                f"request needs {need} KV pages for {req.prompt_len} prompt + {req.max_new_tokens} new tokens,"
                f" but the whole cache has {self.allocator.num_pages - 1}"
            )
        self.waiting.append(req)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.running)

    # ---- one decision -----------------------------------------------------------------------------------
    def schedule(self) -> Batch | None:
        for req in self.prefilling:
            if req.prefill_done:
                self.running.append(req)
                if self.cache is not None:
                    self._cache_prompt(req)
        self.prefilling = [r for r in self.prefilling if not r.prefill_done]
        self.running = [r for r in self.running if r.finish_reason is None]
        batch = self._schedule_prefill() or self._schedule_decode()
        if self.debug_checks:
            self.check_integrity()
        return batch

    def _admit(self, req: Req) -> bool:
        """Give ``req`` a row and pages for its whole reservation, reusing a cached prefix if any."""
        need = self.pages_for(req)
        matched, node = [], None
        if self.cache is not None:
            # Always compute at least the last prompt token: its logits give the first new token.
            matched, node = self.cache.match(req.prompt_ids[:-1])
            self.cache.lock(node)  # before evicting, so the match itself survives
        short = need - len(matched) - self.allocator.num_free
        if short > 0 and self.cache is not None:
            self.cache.evict(short)
            short = need - len(matched) - self.allocator.num_free
        if short > 0:
            if node is not None:
                self.cache.unlock(node)
            return False
        own = self.allocator.alloc(need - len(matched))
        req.pages, req.own_pages, req.cache_node = matched + own, own, node
        req.cached_len = len(matched) * self.page_size
        req.table_idx = self.free_rows.pop()
        self.stats.cached_tokens += req.cached_len
        return True

    def _schedule_prefill(self) -> Batch | None:
        budget = self.cfg.max_prefill_tokens
        chunks: list[tuple[Req, int]] = []
        for req in self.prefilling:
            if budget == 0:
                break
            n = min(req.prompt_len - req.cached_len, budget)
            if n == 0:
                continue
            chunks.append((req, n))
            budget -= n
        admitted: list[Req] = []
        while self.waiting and budget > 0 and self.free_rows and not self.draining:
            req = self.waiting[0]
            if not self._admit(req):
                self.stats.page_waits += 1
                break
            self.waiting.popleft()
            self.prefilling.append(req)
            admitted.append(req)
            n = min(req.prompt_len - req.cached_len, budget)
            chunks.append((req, n))
            budget -= n
        if not chunks:
            return None
        reqs = [r for r, _ in chunks]
        ext = np.array([n for _, n in chunks], np.int32)
        starts = np.array([r.cached_len for r in reqs], np.int32)
        rows = np.array([r.table_idx for r in reqs], np.int32)
        completes = starts + ext >= np.array([r.prompt_len for r in reqs], np.int32)
        batch = self._batch("prefill", reqs, rows, starts, ext, np.where(completes, rows, self.dummy_row))
        if admitted:
            batch.admit_rows = np.array([r.table_idx for r in admitted], np.int32)
            batch.admit_token_lens = np.array([r.prompt_len for r in admitted], np.int32)
            batch.admit_tokens = np.concatenate([np.asarray(r.prompt_ids, np.int32) for r in admitted])
            batch.admit_page_lens = np.array([len(r.pages) for r in admitted], np.int32)
            batch.admit_pages = np.concatenate([np.asarray(r.pages, np.int32) for r in admitted])
        self.stats.prefill_steps += 1
        self.stats.prefill_tokens += int(ext.sum())
        return batch

    def _schedule_decode(self) -> Batch | None:
        reqs = [r for r in self.running if r.wants_decode]
        if not reqs:
            return None
        rows = np.array([r.table_idx for r in reqs], np.int32)
        starts = np.array([r.cached_len for r in reqs], np.int32)
        self.stats.decode_steps += 1
        self.stats.decode_tokens += len(reqs)
        return self._batch("decode", reqs, rows, starts, np.ones(len(reqs), np.int32), rows)

    def _batch(
        self, phase: str, reqs: list[Req], rows: np.ndarray, starts: np.ndarray, ext: np.ndarray,
        sample_rows: np.ndarray,
    ) -> Batch:
        temp, top_k, top_p, seeds, seeded = zip(*(r.sampling_row for r in reqs))
        return Batch(
            phase=phase, rows=rows, starts=starts, ext_lens=ext, sample_rows=sample_rows.astype(np.int32),
            temperature=np.array(temp, np.float32), top_k=np.array(top_k, np.int32),
            top_p=np.array(top_p, np.float32), seeds=np.array(seeds, np.int64), seeded=np.array(seeded, bool),
            reqs=reqs,
        )

    # ---- results ----------------------------------------------------------------------------------------
    def process(self, batch: Batch, output: Any) -> list[Req]:
        """Take a finished step's tokens: append them, detect finished requests, free their resources."""
        if output.copy_done_event is not None:
            output.copy_done_event.synchronize()
        tokens = output.next_tokens_cpu.tolist()
        finished = []
        for req, token, row in zip(batch.reqs, tokens, batch.sample_rows.tolist()):
            if row == self.dummy_row or req.finish_reason is not None:
                continue  # a mid-prompt chunk, or a request that finished while this step was in flight
            req.output_ids.append(token)
            reason = self._finish_reason(req, token)
            if reason is not None:
                req.finish_reason = reason
                self._release(req)
                finished.append(req)
        if self.debug_checks:
            self.check_integrity()
        return finished

    def _finish_reason(self, req: Req, token: int) -> str | None:
        params = req.sampling
        if (token in self.eos_ids and not params.ignore_eos) or token in params.stop_token_ids:
            return "stop"
        if req.detok is not None:
            new = req.detok.push(token)
            at = find_stop(req.detok.text, len(new), params.stop) if new else -1
            if at >= 0:
                req.text = req.detok.text[:at]
                return "stop"
        if len(req.output_ids) >= req.max_new_tokens:
            return "length"
        return None

    def abort_all(self) -> list[Req]:
        """Drop every unfinished request (an interrupted run); their resources come back."""
        dropped = list(self.waiting) + [r for r in self.prefilling + self.running if r.finish_reason is None]
        for req in dropped:
            req.finish_reason = "abort"
            if req.table_idx >= 0:
                self._release(req)
        self.waiting.clear()
        self.prefilling, self.running = [], []
        self.draining = False
        return dropped

    def _give_to_tree(self, req: Req, tokens: list[int]) -> None:
        """Insert the whole pages of ``tokens`` (KV complete, in stream order) and lock where they end.

        Pages the tree already held under the same tokens are left alone. When another request cached
        the same tokens first, in other pages, this request's copies stay its own: its page table still
        points at them, so they are freed only when it finishes, never while it runs.
        """
        full = min(len(tokens) // self.page_size, len(req.pages))
        tokens = tokens[: full * self.page_size]
        duplicates = set(self.cache.insert(tokens, req.pages[:full]))
        handed = set(req.pages[:full]) - duplicates
        req.own_pages = [p for p in req.own_pages if p not in handed]
        _, node = self.cache.match(tokens)
        self.cache.lock(node)  # lock the longer path before releasing the shorter one
        self.cache.unlock(req.cache_node)
        req.cache_node = node

    def _cache_prompt(self, req: Req) -> None:
        # Prompt KV is written once its last chunk has been launched: later requests can share it now.
        self._give_to_tree(req, req.prompt_ids)

    def _release(self, req: Req) -> None:
        # Pages and the row go back at once: any step still in flight that reads them runs before
        # whatever the next admission writes, because all device work is ordered on one stream.
        if self.cache is None:
            self.allocator.free(req.pages)
        else:
            # KV is complete for every token but the last sampled one (or up to the launched prefill).
            valid = min(req.cached_len, req.prompt_len + max(len(req.output_ids) - 1, 0))
            self._give_to_tree(req, (req.prompt_ids + req.output_ids)[:valid])
            self.allocator.free(req.own_pages)
            self.cache.unlock(req.cache_node)
        self.free_rows.append(req.table_idx)
        req.pages, req.own_pages, req.cache_node = [], [], None
        req.table_idx = -1

    def check_integrity(self) -> None:
        """Every page has exactly one owner (free list, tree, or one admitted request's private pages),
        the evictable count matches, and admitted requests only point at pages they may read."""
        owners = self.allocator.free_pages
        held_tree: set[int] = set()
        tree_pages: list[int] = []
        if self.cache is not None:
            nodes = self.cache.nodes()
            tree_pages = [p for n in nodes for p in n.pages]
            evictable = sum(len(n.pages) for n in nodes if n.ref == 0)
            assert evictable == self.cache.evictable_pages, (evictable, self.cache.evictable_pages)
            held_tree = {p for n in nodes if n.ref > 0 for p in n.pages}
        owners += tree_pages
        live = [r for r in self.prefilling + self.running if r.finish_reason is None and r.table_idx >= 0]
        for req in live:
            shared = set(req.pages) - set(req.own_pages) if self.cache is not None else set()
            assert shared <= held_tree, f"request {req.uid} reads unlocked or evicted pages"
            owners += req.own_pages if self.cache is not None else req.pages
        assert len(owners) == len(set(owners)), "a page has two owners"
        assert set(owners) == set(range(1, self.allocator.num_pages)), "pages leaked or invented"
