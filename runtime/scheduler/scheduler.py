"""Rank 0's scheduler: continuous batching with chunked prefill over a paged KV cache.

Prefill first, else decode. A request is admitted only when pages for its whole reservation are free, so
nothing is ever preempted; while requests decode, new ones are admitted in groups since a prefill stalls decode.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from itertools import islice

import numpy as np

from runtime.batch import Batch, Req
from runtime.config import SchedulerSection
from runtime.scheduler.cache_manager import CacheManager

# Bounds how long new prompts wait for a group behind a long request that holds the pages.
ADMIT_MAX_HOLD = 64


@dataclass
class SchedulerStats:
    page_waits: int = 0
    cached_tokens: int = 0
    prefill_steps: int = 0
    decode_steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0


class Scheduler:
    def __init__(
        self, cfg: SchedulerSection, num_pages: int, page_size: int, max_seq_len: int, dummy_row: int,
        cache_type: str = "naive", debug_checks: bool = False,
    ) -> None:
        self.cfg = cfg
        self.page_size = page_size
        self.max_seq_len = max_seq_len
        self.dummy_row = dummy_row
        self.pages = CacheManager(num_pages, page_size, cache_type)
        self.debug_checks = debug_checks
        self.free_rows = list(range(cfg.max_running_requests - 1, -1, -1))
        self.admit_group = max(1, math.ceil(cfg.admit_free_share * cfg.max_running_requests))
        self.admit_pages = math.ceil(cfg.admit_free_share * (num_pages - 1))
        self.held_steps = 0
        self.waiting: deque[Req] = deque()
        self.prefilling: list[Req] = []
        self.running: list[Req] = []
        self.stats = SchedulerStats()
        self.logprob_reqs = 0  # while 0, batches carry no logprob rows
        self.adjusting_reqs = 0  # while 0, batches carry no min_p or penalty rows
        self.draining = False

    @property
    def allocator(self):  # noqa: ANN201 - PageAllocator
        return self.pages.allocator

    @property
    def cache(self):  # noqa: ANN201 - PrefixCache
        return self.pages.cache

    def check(self, req: Req) -> None:
        """Raise ValueError if ``req`` can never be served; reads nothing mutable, so any thread may call it."""
        need = self.pages.pages_for(req)
        if need > self.allocator.num_pages - 1:
            raise ValueError(
                f"request needs {need} KV pages for {req.prompt_len} prompt + {req.max_new_tokens} new tokens,"
                f" but the whole cache has {self.allocator.num_pages - 1}"
            )

    def add(self, req: Req) -> None:
        """Queue a request; raises ValueError (for that request only) if it can never be served."""
        self.check(req)
        if req.leader is not None and not self._leader_known(req.leader):
            req.leader = None  # sample 0 failed: compute the prompt itself
        self.waiting.append(req)

    def _leader_known(self, leader: Req) -> bool:
        if leader.table_idx >= 0 or leader.prompt_cached or leader.finish_reason is not None:
            return True
        return any(r is leader for r in reversed(self.waiting))

    def _waits_for_leader(self, req: Req) -> bool:
        lead = req.leader
        return (lead is not None and self.pages.shares_prefixes and not lead.prompt_cached
                and lead.finish_reason is None)

    @property
    def idle(self) -> bool:
        return not (self.waiting or self.prefilling or self.running)

    def schedule(self) -> Batch | None:
        for req in self.prefilling:
            if req.prefill_done and req.finish_reason is None:
                self.running.append(req)
                self.pages.cache_prompt(req)
        self.prefilling = [r for r in self.prefilling if not r.prefill_done]
        self.running = [r for r in self.running if r.finish_reason is None]
        batch = self._schedule_prefill() or self._schedule_decode()
        if self.debug_checks:
            self.check_integrity()
        return batch

    def _admit(self, req: Req) -> bool:
        if not self.pages.admit(req):
            return False
        req.table_idx = self.free_rows.pop()
        self.stats.cached_tokens += req.cached_len
        self.logprob_reqs += req.wants_logprobs
        self.adjusting_reqs += req.adjusts_logits
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
        admitted = self._admit_waiting(budget, chunks)
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

    def _admit_waiting(self, budget: int, chunks: list[tuple[Req, int]]) -> list[Req]:
        """Admit in arrival order; siblings whose sample 0 has not cached its prompt keep their place."""
        admitted: list[Req] = []
        passed: list[Req] = []
        if not self.waiting or self.draining or not (chunks or self._group_ready()):
            return admitted
        while self.waiting and budget > 0 and self.free_rows and not self.draining:
            req = self.waiting[0]
            if self._waits_for_leader(req):
                passed.append(self.waiting.popleft())
                continue
            if not self._admit(req):
                self.stats.page_waits += 1
                break
            self.waiting.popleft()
            self.prefilling.append(req)
            admitted.append(req)
            n = min(req.prompt_len - req.cached_len, budget)
            chunks.append((req, n))
            budget -= n
        self.waiting.extendleft(reversed(passed))
        return admitted

    def _group_ready(self) -> bool:
        """Whether new prompts may get a prefill step now (nothing decodes, a group or all waiting fit, or
        ``ADMIT_MAX_HOLD`` steps passed)."""
        free = len(self.free_rows)
        pages = self.allocator.num_free + self.cache.evictable_pages
        # Small reservations must not wait for pages a long request holds.
        group_pages = min(self.admit_pages, sum(map(self.pages.pages_for, islice(self.waiting, self.admit_group))))
        ready = (
            not self.running
            or (free >= len(self.waiting) and pages >= sum(map(self.pages.pages_for, self.waiting)))
            or (free >= self.admit_group and pages >= group_pages)
            or self.held_steps >= ADMIT_MAX_HOLD
        )
        if not ready and pages < group_pages:
            self.stats.page_waits += 1  # LLM.run stops topping up the queue on page waits
        self.held_steps = 0 if ready else self.held_steps + 1
        return ready

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
        temp, top_k, top_p, seeds = zip(*(r.sampling_row for r in reqs))
        batch = Batch(
            phase=phase, rows=rows, starts=starts, ext_lens=ext, sample_rows=sample_rows.astype(np.int32),
            temperature=np.array(temp, np.float32), top_k=np.array(top_k, np.int32),
            top_p=np.array(top_p, np.float32), seeds=np.array(seeds, np.int64), reqs=reqs,
        )
        if self.logprob_reqs:
            ks = np.array([r.logprob_ks for r in reqs], np.int32)
            if (ks[:, 0] >= 0).any():
                batch.logprobs = ks[:, 0].copy()
            if phase == "prefill" and (ks[:, 1] >= 0).any():
                batch.prompt_logprobs = ks[:, 1].copy()
        if self.adjusting_reqs and any(r.adjusts_logits for r in reqs):
            columns = np.array([r.logit_row for r in reqs], np.float32).T
            batch.min_p, batch.presence_penalty, batch.frequency_penalty, batch.repetition_penalty = columns.copy()
            batch.prompt_lens = np.array([r.prompt_len for r in reqs], np.int32)
            biased = [r.logit_bias for r in reqs if r.logit_bias is not None]
            if biased:
                batch.bias_counts = np.array([0 if r.logit_bias is None else len(r.logit_bias[0]) for r in reqs],
                                             np.int32)
                batch.bias_tokens = np.concatenate([tokens for tokens, _ in biased])
                batch.bias_values = np.concatenate([values for _, values in biased])
        return batch

    def finish(self, req: Req) -> None:
        self._release(req)
        if self.debug_checks:
            self.check_integrity()

    def abort(self, req: Req) -> None:
        """Drop one request; its pages come back at once (in-flight writes precede later ones on the stream)."""
        if req.finish_reason is not None:
            return
        req.finish_reason = "abort"
        if req.table_idx >= 0:
            self._release(req)
            if req in self.prefilling:
                self.prefilling.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    def abort_all(self) -> list[Req]:
        """Drop every unfinished request, and release any finished one whose release an exception cut short."""
        admitted = self.prefilling + self.running
        dropped = list(self.waiting) + [r for r in admitted if r.finish_reason is None]
        for req in dropped:
            req.finish_reason = "abort"
        for req in admitted:
            if req.table_idx >= 0:
                self._release(req)
        self.waiting.clear()
        self.prefilling, self.running = [], []
        self.draining = False
        return dropped

    def _release(self, req: Req) -> None:
        self.pages.release(req)
        self.logprob_reqs -= req.wants_logprobs
        self.adjusting_reqs -= req.adjusts_logits
        self.free_rows.append(req.table_idx)
        req.table_idx = -1

    def check_integrity(self) -> None:
        live = [r for r in self.prefilling + self.running if r.table_idx >= 0]
        self.pages.check_integrity(live)
