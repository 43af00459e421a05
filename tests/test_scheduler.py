"""The scheduler and the step loop's bookkeeping on CPU, driven by a scripted fake engine (no model).

``FakeEngine`` keeps ``Engine.forward_batch``'s contract: it advances every request's
host bookkeeping (``req.complete_one``) before returning, and returns a
``ForwardOutput`` whose tokens are a scripted function of (uid, position of the
sampled token). It also plays the device: a page table, a token pool and a KV
cache written in launch order, so a page or row handed over too early, or a
decode step launched before its input token exists, shows up as a wrong read.
Every batch is recorded with the rows and pages the requests held at launch.
"""

from __future__ import annotations

import functools
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from runtime.batch import Batch, Req
from runtime.config import SchedulerSection, load_config
from runtime.engine import ForwardOutput
from runtime.loop import run_until_idle
from runtime.output import OutputProcessor
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from runtime.utils import DUMMY_PAGE

EOS_IDS = {2, 3}  # even uids stop on 2, odd ones on 3
MAX_SEQ_LEN = 4096


@functools.cache
def scheduler_cfg(max_running: int, max_prefill: int, admit_free_share: float | None = None) -> SchedulerSection:
    overrides = [f"scheduler.max_running_requests={max_running}", f"scheduler.max_prefill_tokens={max_prefill}"]
    if admit_free_share is not None:
        overrides.append(f"scheduler.admit_free_share={admit_free_share}")
    return load_config(overrides=overrides).scheduler


# ---------------------------------------------------------------------------------------------------------
# the script: which token a request samples at which position
# ---------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    uid: int
    prompt_len: int
    max_new: int
    eos_at: int | None = None  # output index at which the request samples EOS; None: never

    @property
    def eos(self) -> int:
        return 2 + self.uid % 2

    def regular(self, j: int) -> int:
        return 10 + (37 * self.uid + 11 * j) % 500  # never an EOS id

    def expected(self) -> tuple[list[int], str]:
        stops = self.eos_at is not None and self.eos_at < self.max_new
        n = self.eos_at + 1 if stops else self.max_new
        return [self.eos if j == self.eos_at else self.regular(j) for j in range(n)], "stop" if stops else "length"

    def prompt(self) -> list[int]:
        return [600 + (self.uid * 13 + i) % 97 for i in range(self.prompt_len)]


class Script:
    """token(uid, position): position is the sampled token's (``batch.kv_lens[i]``)."""

    def __init__(self, specs: list[Spec]) -> None:
        self.specs = {s.uid: s for s in specs}

    def __call__(self, uid: int, position: int) -> int:
        s = self.specs[uid]
        j = position - s.prompt_len
        if j < 0:
            return s.eos  # a mid-prompt chunk's sample: it must be discarded, or the request would stop
        return s.eos if j == s.eos_at else s.regular(j)

    def input_token(self, uid: int, position: int) -> int:
        s = self.specs[uid]
        return s.prompt()[position] if position < s.prompt_len else self(uid, position)


# ---------------------------------------------------------------------------------------------------------
# the fake engine and its recorder
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Step:
    index: int
    phase: str
    uids: list[int]
    rows: list[int]
    starts: list[int]
    ext_lens: list[int]
    sample_rows: list[int]
    kv_lens: list[int]
    pages: dict[int, tuple[int, ...]]  # uid -> pages of each request in the batch, at launch
    held: dict[int, tuple[int, tuple[int, ...]]]  # uid -> (row, pages) of every admitted, unreleased request
    admitted: list[int]
    tokens: list[int]


def check_resources(s: Scheduler) -> None:
    """Every page and row is either free (exactly once) or held by exactly one live request."""
    free = list(s.allocator._free)
    assert len(free) == len(set(free)), f"duplicate page ids in the free list: {sorted(free)}"
    assert all(DUMMY_PAGE < p < s.allocator.num_pages for p in free), free
    rows = list(s.free_rows)
    assert len(rows) == len(set(rows)), f"duplicate rows in free_rows: {rows}"
    assert all(0 <= r < s.cfg.max_running_requests for r in rows), rows
    holders = [r for r in s.prefilling + s.running if r.pages or r.table_idx >= 0]
    assert len({id(r) for r in holders}) == len(holders), "a request is both prefilling and running"
    held_pages = [p for r in holders for p in r.pages]
    held_rows = [r.table_idx for r in holders]
    assert len(held_pages) == len(set(held_pages)), "two live requests share a page"
    assert len(held_rows) == len(set(held_rows)), "two live requests share a row"
    assert not set(held_pages) & set(free), "a held page is also on the free list"
    assert not set(held_rows) & set(rows), "a held row is also in free_rows"
    assert sorted(held_pages + free) == list(range(1, s.allocator.num_pages))
    assert sorted(held_rows + rows) == list(range(s.cfg.max_running_requests))


class FakeEngine:
    def __init__(self, scheduler: Scheduler, script: Script, max_steps: int) -> None:
        self.s = scheduler
        self.script = script
        self.max_steps = max_steps  # every step computes a token; more steps than tokens means a livelock
        self.steps: list[Step] = []
        self.drained_after: set[int] = set()  # steps after which the loop scheduled nothing (and drained)
        self.page_table: dict[int, list[int]] = {}  # row -> pages, as admissions wrote them
        self.token_pool: dict[int, dict[int, int]] = defaultdict(dict)  # row -> position -> token
        self.kv: dict[int, tuple[int, int]] = {}  # flat slot -> (uid, position) whose K/V it holds

    def on_batch(self, batch: Batch | None) -> None:
        if batch is None:
            self.drained_after.add(len(self.steps) - 1)

    def forward_batch(self, batch: Batch) -> ForwardOutput:
        s, ps = self.s, self.s.page_size
        assert len(self.steps) < self.max_steps, "the loop keeps launching steps"
        check_resources(s)
        reqs = batch.reqs
        n = batch.size
        assert len(reqs) == n and len(batch.starts) == len(batch.ext_lens) == len(batch.sample_rows) == n
        assert n > 0 and len({id(r) for r in reqs}) == n
        for i, r in enumerate(reqs):
            # The host never schedules a request it already knows is finished (its pages may be reused).
            assert r.finish_reason is None and r.table_idx >= 0 and r.pages, f"uid {r.uid} scheduled after release"
            assert batch.rows[i] == r.table_idx and batch.starts[i] == r.cached_len
            assert batch.ext_lens[i] >= 1
            if batch.is_decode:
                assert batch.ext_lens[i] == 1 and r.prefill_done and batch.sample_rows[i] == r.table_idx
                assert r.launched_new < r.max_new_tokens
            else:
                assert batch.kv_lens[i] <= r.prompt_len
                completes = batch.kv_lens[i] == r.prompt_len
                assert batch.sample_rows[i] == (r.table_idx if completes else s.dummy_row)
            # KV written this step fits the request's reservation.
            assert batch.kv_lens[i] <= len(r.pages) * ps
        admitted = [r for r in reqs if r.cached_len == 0]
        assert batch.admit_rows.tolist() == [r.table_idx for r in admitted]
        assert batch.admit_token_lens.tolist() == [r.prompt_len for r in admitted]
        assert batch.admit_tokens.tolist() == [t for r in admitted for t in r.prompt_ids]
        assert batch.admit_page_lens.tolist() == [len(r.pages) for r in admitted]
        assert batch.admit_pages.tolist() == [p for r in admitted for p in r.pages]

        holders = [r for r in s.prefilling + s.running if r.pages]
        tokens = [self.script(r.uid, int(kv)) for r, kv in zip(reqs, batch.kv_lens)]
        self.steps.append(Step(
            index=len(self.steps), phase=batch.phase, uids=[r.uid for r in reqs], rows=batch.rows.tolist(),
            starts=batch.starts.tolist(), ext_lens=batch.ext_lens.tolist(), sample_rows=batch.sample_rows.tolist(),
            kv_lens=batch.kv_lens.tolist(), pages={r.uid: tuple(r.pages) for r in reqs},
            held={r.uid: (r.table_idx, tuple(r.pages)) for r in holders}, admitted=[r.uid for r in admitted],
            tokens=tokens,
        ))
        self._play_device(batch, tokens)
        for req, ext_len in zip(reqs, batch.ext_lens.tolist()):
            req.complete_one(ext_len)
        t = torch.tensor(tokens, dtype=torch.int32)
        return ForwardOutput(t, t.clone(), None)

    def _play_device(self, batch: Batch, tokens: list[int]) -> None:
        """What the device would do, in launch order: admissions, inputs, KV writes, attention reads, samples."""
        ps = self.s.page_size
        for i, row in enumerate(batch.admit_rows.tolist()):
            lo = int(batch.admit_page_lens[:i].sum())
            self.page_table[row] = batch.admit_pages[lo : lo + int(batch.admit_page_lens[i])].tolist()
            lo = int(batch.admit_token_lens[:i].sum())
            self.token_pool[row] = dict(enumerate(batch.admit_tokens[lo : lo + int(batch.admit_token_lens[i])].tolist()))

        def slot(row: int, pos: int) -> int:
            table = self.page_table[row]
            assert pos // ps < len(table), f"position {pos} beyond the {len(table)} pages of row {row}"
            return table[pos // ps] * ps + pos % ps

        for r, row, start, ext in zip(batch.reqs, batch.rows.tolist(), batch.starts.tolist(), batch.ext_lens.tolist()):
            for pos in range(start, start + ext):
                got = self.token_pool[row].get(pos)
                assert got == self.script.input_token(r.uid, pos), (
                    f"uid {r.uid} reads input {got} at position {pos} of row {row}"
                )
                self.kv[slot(row, pos)] = (r.uid, pos)
        for r, row, start, ext in zip(batch.reqs, batch.rows.tolist(), batch.starts.tolist(), batch.ext_lens.tolist()):
            for pos in range(start + ext):  # attention reads the whole context
                assert self.kv.get(slot(row, pos)) == (r.uid, pos), f"uid {r.uid}: KV of position {pos} overwritten"
        for tok, row, kv in zip(tokens, batch.sample_rows.tolist(), batch.kv_lens.tolist()):
            self.token_pool[row][kv] = tok


# ---------------------------------------------------------------------------------------------------------
# running a workload and checking what every run must satisfy
# ---------------------------------------------------------------------------------------------------------
@dataclass
class Run:
    scheduler: Scheduler
    engine: FakeEngine
    reqs: list[Req]
    specs: list[Spec]
    finished: list[int]
    overlap: bool

    @property
    def steps(self) -> list[Step]:
        return self.engine.steps

    def final_step(self, uid: int) -> int:
        """The step that sampled the request's last kept token."""
        spec = next(s for s in self.specs if s.uid == uid)
        last = spec.prompt_len + len(spec.expected()[0]) - 1
        hits = [
            st.index for st in self.steps for u, kv, row in zip(st.uids, st.kv_lens, st.sample_rows)
            if u == uid and kv == last and row != self.scheduler.dummy_row
        ]
        assert len(hits) == 1, (uid, hits)
        return hits[0]

    def zombie_steps(self) -> list[tuple[int, int]]:
        """(uid, step) where a request ran after the step that sampled its last kept token."""
        return [
            (uid, st.index) for uid in (s.uid for s in self.specs) for st in self.steps
            if uid in st.uids and st.index > self.final_step(uid)
        ]

    def handovers(self, kind: str) -> list[tuple[int, int, int, int, int]]:
        """(resource, old uid, new uid, old uid's final sampling step, new uid's first step) per reuse."""
        users: dict[int, list[tuple[int, int]]] = defaultdict(list)  # resource -> [(step, uid)]
        for st in self.steps:
            for uid, row in zip(st.uids, st.rows):
                for res in (st.pages[uid] if kind == "page" else (row,)):
                    users[res].append((st.index, uid))
        out = []
        for res, seq in users.items():
            owners = [u for i, (_, u) in enumerate(seq) if i == 0 or seq[i - 1][1] != u]
            assert len(owners) == len(set(owners)), f"{kind} {res} went back to an earlier owner: {seq}"
            for old, new in zip(owners, owners[1:]):
                first_new = min(i for i, u in seq if u == new)
                last_old = max(i for i, u in seq if u == old)
                assert last_old < first_new, f"{kind} {res} used by uids {old} and {new} in one step"
                out.append((res, old, new, self.final_step(old), first_new))
        return out


def run_workload(
    specs: list[Spec], *, overlap: bool, max_running: int = 4, max_prefill: int = 64, num_pages: int = 256,
    page_size: int = 4, admit_free_share: float | None = None,
) -> Run:
    cfg = scheduler_cfg(max_running, max_prefill, admit_free_share)
    s = Scheduler(cfg, num_pages, page_size, MAX_SEQ_LEN, max_running)
    reqs = [Req(sp.uid, sp.prompt(), SamplingParams(temperature=0.0, max_new_tokens=sp.max_new), sp.max_new)
            for sp in specs]
    for r in reqs:
        s.add(r)
    # Each request computes its prompt and at most max_new tokens, plus one discarded step with overlap.
    engine = FakeEngine(s, Script(specs), max_steps=sum(sp.prompt_len + sp.max_new + 1 for sp in specs))
    finished: list[int] = []

    def on_finish(req: Req) -> None:
        assert req.finish_reason in ("stop", "length")
        assert req.pages == [] and req.table_idx == -1
        check_resources(s)
        finished.append(req.uid)

    run_until_idle(s, engine, OutputProcessor(EOS_IDS, max_running), overlap, on_finish, engine.on_batch)
    run = Run(s, engine, reqs, specs, finished, overlap)
    check_run(run)
    return run


def check_run(run: Run) -> None:
    s, steps = run.scheduler, run.steps
    assert s.idle
    assert Counter(run.finished) == Counter(sp.uid for sp in run.specs), "on_finish not called once per request"
    for req, spec in zip(run.reqs, run.specs):
        tokens, reason = spec.expected()
        assert req.output_ids == tokens, f"uid {req.uid}: {req.output_ids} != {tokens}"
        assert req.finish_reason == reason, (req.uid, req.finish_reason, reason)
        assert not EOS_IDS & set(req.output_ids[:-1]), f"uid {req.uid}: a token after EOS"
    # Everything came back, exactly once.
    check_resources(s)
    assert s.allocator.num_free == s.allocator.num_pages - 1
    assert sorted(s.free_rows) == list(range(s.cfg.max_running_requests))
    # Within one step no two requests share a row or a page; nor do any two live requests at launch.
    for st in steps:
        assert len(set(st.rows)) == len(st.rows)
        batch_pages = [p for u in st.uids for p in st.pages[u]]
        assert len(batch_pages) == len(set(batch_pages))
        held_pages = [p for _, pages in st.held.values() for p in pages]
        assert len(held_pages) == len(set(held_pages)), f"step {st.index}: live requests share a page"
        held_rows = [row for row, _ in st.held.values()]
        assert len(held_rows) == len(set(held_rows)), f"step {st.index}: live requests share a row"
        assert set(st.uids) <= set(st.held)
        assert len(st.uids) <= s.cfg.max_running_requests
    # A newly admitted request's pages and row were held by no live request when it was admitted.
    for st in steps:
        for uid in st.admitted:
            row, pages = st.held[uid]
            for other, (orow, opages) in st.held.items():
                if other != uid:
                    assert orow != row and not set(pages) & set(opages), (st.index, uid, other)
    # Resources change hands only between steps (handovers() checks the old owner's last use comes first).
    # The old owner's last token is sampled in step N. Without overlap its resources are free for step N+1.
    # With overlap, step N+1 is launched before step N's tokens are read, so the earliest reuse is N+2 --
    # unless the loop had nothing to launch after N and drained it first.
    for kind in ("page", "row"):
        for res, old, new, old_final, new_first in run.handovers(kind):
            earliest = old_final + (2 if run.overlap and old_final not in run.engine.drained_after else 1)
            assert new_first >= earliest, (
                f"{kind} {res} of uid {old} (last token sampled in step {old_final}) went to uid {new} in step "
                f"{new_first}"
            )
    # The stats agree with what ran.
    assert s.stats.prefill_steps == sum(st.phase == "prefill" for st in steps)
    assert s.stats.decode_steps == sum(st.phase == "decode" for st in steps)
    assert s.stats.prefill_tokens == sum(sp.prompt_len for sp in run.specs)
    assert s.stats.decode_tokens == sum(len(st.uids) for st in steps if st.phase == "decode")


OVERLAP = pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "no_overlap"])


# ---------------------------------------------------------------------------------------------------------
# finishing while the next step is in flight
# ---------------------------------------------------------------------------------------------------------
@OVERLAP
def test_requests_finish_exactly_at_eos_or_length(overlap):
    specs = [
        Spec(0, 5, 8, eos_at=0),  # EOS is the very first token (sampled by the prefill)
        Spec(1, 3, 8, eos_at=1),
        Spec(2, 7, 8, eos_at=3),
        Spec(3, 4, 6),  # length
        Spec(4, 6, 5, eos_at=4),  # EOS on the last allowed token: "stop", 5 tokens
        Spec(5, 2, 4, eos_at=9),  # EOS would come after max_new_tokens: "length"
        Spec(6, 9, 1),  # a single token, from the prefill
        Spec(7, 1, 1, eos_at=0),
        Spec(8, 3, 10, eos_at=6),
    ]
    run = run_workload(specs, overlap=overlap, max_running=16)
    assert [r.finish_reason for r in run.reqs] == ["stop", "stop", "stop", "length", "stop", "length", "length",
                                                   "stop", "stop"]
    assert [len(r.output_ids) for r in run.reqs] == [1, 2, 4, 6, 5, 4, 1, 1, 7]
    # All admitted by the first step, so every later step is a decode of the running ones. With overlap, a
    # request that samples EOS before its last allowed token is decoded once more (step N+1 was scheduled
    # before step N's tokens were read); that token is dropped. Without overlap, never.
    assert run.steps[0].phase == "prefill" and len(run.steps[0].uids) == len(specs)
    assert all(st.phase == "decode" for st in run.steps[1:])
    zombies = run.zombie_steps()
    if overlap:
        assert sorted(zombies) == [(uid, run.final_step(uid) + 1) for uid in (0, 1, 2, 8)]
    else:
        assert zombies == []


@OVERLAP
def test_finished_requests_pages_go_to_new_requests_only_after_the_in_flight_step(overlap):
    # One row at a time is not enough to see it; a tight pool makes each admission reuse freed pages.
    specs = [Spec(uid, 3 + uid % 3, 6, eos_at=(uid * 2) % 7) for uid in range(8)]
    run = run_workload(specs, overlap=overlap, max_running=3, num_pages=1 + 3 * 2, page_size=4)
    pages = run.handovers("page")
    rows = run.handovers("row")
    assert pages and rows
    drained = run.engine.drained_after  # a reuse right after a drained step is fine: nothing was in flight
    gap = min(new_first - old_final for *_, old_final, new_first in pages if old_final not in drained)
    # The step that sampled the finishing token is N; with overlap N+1 is already launched (and may still
    # touch the pages), so the earliest reuse is N+2; without overlap it is N+1.
    assert gap == (2 if overlap else 1)
    if overlap:
        assert run.zombie_steps(), "expected a finished request to ride along in the in-flight step"
        for uid, idx in run.zombie_steps():
            st = run.steps[idx]
            mine = set(st.pages[uid])
            for new in st.admitted:
                assert not mine & set(st.pages[new]), f"step {idx}: uid {new} admitted onto pages of finished {uid}"


# ---------------------------------------------------------------------------------------------------------
# continuous batching and admission
# ---------------------------------------------------------------------------------------------------------
@OVERLAP
def test_new_requests_are_admitted_as_others_finish(overlap):
    specs = [Spec(uid, 2 + 3 * uid % 7, 3 + uid % 4, eos_at=2 if uid % 3 == 0 else None) for uid in range(7)]
    run = run_workload(specs, overlap=overlap, max_running=2)
    phases = [st.phase for st in run.steps]
    first_decode = phases.index("decode")
    assert "prefill" in phases[first_decode:], "no admission after decoding started"
    assert max(len(st.held) for st in run.steps) <= 2
    assert len(run.handovers("row")) >= len(specs) - 2
    # Requests are admitted in arrival order.
    order = [uid for st in run.steps for uid in st.admitted]
    assert order == sorted(order) == [sp.uid for sp in specs]


@OVERLAP
@pytest.mark.parametrize("num_pages", [4, 7])
def test_requests_wait_for_pages_in_a_tiny_pool(overlap, num_pages):
    # 6 prompt + 7 new = 12 KV tokens = 3 pages of 4: the pool holds one (num_pages=4) or two at a time.
    specs = [Spec(uid, 6, 7, eos_at=(None if uid % 2 else uid)) for uid in range(5)]
    run = run_workload(specs, overlap=overlap, max_running=4, num_pages=num_pages, page_size=4)
    assert run.scheduler.stats.page_waits > 0
    fits = (num_pages - 1) // 3
    assert max(len(st.held) for st in run.steps) == fits
    assert len(run.handovers("page")) > 0


def test_add_rejects_a_request_that_can_never_fit():
    s = Scheduler(scheduler_cfg(4, 64), 4, 4, MAX_SEQ_LEN, 4)  # 3 usable pages = 12 KV tokens
    fits = Req(0, list(range(10, 20)), SamplingParams(max_new_tokens=3), 3)  # 10 + 3 - 1 = 12 tokens
    too_big = Req(1, list(range(10, 20)), SamplingParams(max_new_tokens=4), 4)  # 13 tokens: 4 pages
    with pytest.raises(ValueError, match="4 KV pages"):
        s.add(too_big)
    assert not s.waiting and s.idle
    s.add(fits)
    assert list(s.waiting) == [fits]


def test_a_rejected_request_does_not_disturb_the_others():
    specs = [Spec(0, 10, 3, eos_at=1), Spec(1, 10, 3)]
    s = Scheduler(scheduler_cfg(4, 64), 4, 4, MAX_SEQ_LEN, 4)
    with pytest.raises(ValueError):
        s.add(Req(9, list(range(10, 30)), SamplingParams(max_new_tokens=1), 1))
    reqs = [Req(sp.uid, sp.prompt(), SamplingParams(max_new_tokens=sp.max_new), sp.max_new) for sp in specs]
    for r in reqs:
        s.add(r)
    engine = FakeEngine(s, Script(specs), max_steps=100)
    done: list[int] = []
    run_until_idle(s, engine, OutputProcessor(EOS_IDS, 4), True, lambda r: done.append(r.uid), engine.on_batch)
    run = Run(s, engine, reqs, specs, done, True)
    check_run(run)


# ---------------------------------------------------------------------------------------------------------
# chunked prefill
# ---------------------------------------------------------------------------------------------------------
def check_chunks(run: Run, max_prefill: int) -> None:
    dummy = run.scheduler.dummy_row
    for st in run.steps:
        if st.phase == "prefill":
            assert sum(st.ext_lens) <= max_prefill
    for sp in run.specs:
        chunks = [
            (st.index, start, ext, srow) for st in run.steps if st.phase == "prefill"
            for u, start, ext, srow in zip(st.uids, st.starts, st.ext_lens, st.sample_rows) if u == sp.uid
        ]
        assert sum(ext for _, _, ext, _ in chunks) == sp.prompt_len
        assert [start for _, start, _, _ in chunks] == list(np.cumsum([0] + [e for _, _, e, _ in chunks])[:-1])
        assert all(srow == dummy for *_, srow in chunks[:-1]), "a mid-prompt chunk's sample was kept"
        assert chunks[-1][3] != dummy
        decodes = [st.index for st in run.steps if st.phase == "decode" and sp.uid in st.uids]
        assert all(d > chunks[-1][0] for d in decodes)
        assert len(decodes) >= len(sp.expected()[0]) - 1


@OVERLAP
def test_chunked_prefill_splits_a_long_prompt(overlap):
    specs = [Spec(0, 13, 4, eos_at=2)]
    run = run_workload(specs, overlap=overlap, max_prefill=5)
    prefills = [st for st in run.steps if st.phase == "prefill"]
    assert [st.ext_lens for st in prefills] == [[5], [5], [3]]
    assert [st.starts for st in prefills] == [[0], [5], [10]]
    dummy = run.scheduler.dummy_row
    assert [st.sample_rows for st in prefills] == [[dummy], [dummy], [prefills[0].rows[0]]]
    assert [st.phase for st in run.steps[3:]] == ["decode"] * (len(run.steps) - 3)
    check_chunks(run, 5)


@OVERLAP
def test_chunked_prefill_shares_steps_with_a_new_admission(overlap):
    specs = [Spec(0, 13, 4), Spec(1, 6, 3, eos_at=0), Spec(2, 2, 5, eos_at=3)]
    run = run_workload(specs, overlap=overlap, max_prefill=5)
    prefills = [(st.uids, st.ext_lens) for st in run.steps if st.phase == "prefill"]
    # A chunked prompt continues first; the step's leftover budget admits the next request, also chunked.
    assert prefills == [([0], [5]), ([0], [5]), ([0, 1], [3, 2]), ([1, 2], [4, 1]), ([2], [1])]
    assert [st.phase for st in run.steps[:5]] == ["prefill"] * 5  # prefill first, then decode
    check_chunks(run, 5)


# ---------------------------------------------------------------------------------------------------------
# random workloads
# ---------------------------------------------------------------------------------------------------------
@hs.composite
def workloads(draw: Callable) -> tuple[list[Spec], dict]:
    page_size = draw(hs.sampled_from([1, 4, 16]))
    n = draw(hs.integers(1, 8))
    specs = [
        Spec(uid, draw(hs.integers(1, 40)), draw(hs.integers(1, 20)), draw(hs.none() | hs.integers(0, 22)))
        for uid in range(n)
    ]
    need = max(-(-(sp.prompt_len + sp.max_new - 1) // page_size) for sp in specs)
    kwargs = dict(
        overlap=draw(hs.booleans()), page_size=page_size, num_pages=need + 1 + draw(hs.integers(0, 3 * need)),
        max_running=draw(hs.integers(1, 5)), max_prefill=draw(hs.integers(1, 64)),
    )
    return specs, kwargs


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(workloads())
def test_random_workloads_finish_with_the_scripted_output(workload):
    specs, kwargs = workload
    run = run_workload(specs, **kwargs)
    check_chunks(run, kwargs["max_prefill"])
