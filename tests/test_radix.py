"""Radix prefix cache: a property test of the tree against a page-content reference, and
end-to-end equality of radix and naive caches on the default model."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime import LLM, SamplingParams
from runtime.scheduler.pages import PageAllocator
from runtime.scheduler.radix_cache import RadixCache

BASES = [[7] * 40, [1, 2, 3] * 14, [9, 8] * 20]  # prefixes that requests share


class Harness:
    """Requests that match, lock, take private pages, insert and unlock, as the scheduler does.
    ``content`` records which tokens each page holds: the reference a match is checked against."""

    def __init__(self, num_pages: int, page: int) -> None:
        self.alloc = PageAllocator(num_pages)
        self.cache = RadixCache(self.alloc, page)
        self.page = page
        self.content: dict[int, tuple[int, ...]] = {}
        self.active: list[tuple[list[int], list[int], int, object]] = []  # tokens, pages, shared, node

    def chunk(self, tokens: list[int], i: int) -> tuple[int, ...]:
        return tuple(tokens[i * self.page : (i + 1) * self.page])

    def start(self, tokens: list[int]) -> None:
        pages, node = self.cache.match(tokens)
        for i, p in enumerate(pages):
            assert self.content[p] == self.chunk(tokens, i), "match returned a page holding other tokens"
        assert len(pages) * self.page <= len(tokens)
        self.cache.lock(node)
        need = len(tokens) // self.page - len(pages)
        if need > self.alloc.num_free:
            self.evict(need - self.alloc.num_free)
        if need > self.alloc.num_free:
            self.cache.unlock(node)
            return
        private = self.alloc.alloc(need)
        for j, p in enumerate(private):
            assert p not in self.content, "a page in use was handed out again"
            self.content[p] = self.chunk(tokens, len(pages) + j)
        self.active.append((tokens, pages + private, len(pages), node))

    def finish(self, index: int) -> None:
        tokens, pages, _, node = self.active.pop(index % len(self.active))
        full = len(tokens) // self.page
        duplicates = self.cache.insert(tokens[: full * self.page], pages[:full])
        for p in duplicates:
            del self.content[p]
        self.alloc.free(duplicates)
        self.cache.unlock(node)

    def evict(self, n: int) -> None:
        before = set(self.alloc._free)
        self.cache.evict(n)
        for p in set(self.alloc._free) - before:
            del self.content[p]

    def check(self) -> None:
        self.cache.held_pages()  # the cache's own bookkeeping: evictable count and leaf set
        nodes = self.cache.nodes()
        tree = [p for n in nodes for p in n.pages]
        private = [p for _, pages, shared, _ in self.active for p in pages[shared:]]
        owners = list(self.alloc._free) + tree + private
        assert len(owners) == len(set(owners)) and set(owners) == set(range(1, self.alloc.num_pages))
        assert self.cache.evictable_pages == sum(len(n.pages) for n in nodes if n.ref == 0)
        locked = {p for n in nodes if n.ref > 0 for p in n.pages}
        for tokens, pages, shared, _ in self.active:
            assert set(pages[:shared]) <= locked  # what a running request reads cannot be evicted
            for i, p in enumerate(pages):
                assert self.content[p] == self.chunk(tokens, i)


ops = st.lists(
    st.one_of(
        st.tuples(st.just("start"), st.integers(0, 2), st.integers(0, 40), st.lists(st.integers(0, 5), max_size=12)),
        st.tuples(st.just("finish"), st.integers(0, 50)),
        st.tuples(st.just("evict"), st.integers(1, 12)),
    ),
    max_size=60,
)


@settings(max_examples=150, deadline=None)
@given(ops=ops, page=st.sampled_from([1, 4, 16]), pool=st.integers(4, 40))
def test_radix_tree_against_page_content_reference(ops, page, pool):
    h = Harness(pool, page)
    for op in ops:
        if op[0] == "start":
            h.start(BASES[op[1]][: op[2]] + op[3])
        elif op[0] == "finish" and h.active:
            h.finish(op[1])
        elif op[0] == "evict":
            h.evict(op[1])
        h.check()
    while h.active:
        h.finish(0)
    h.check()
    h.cache.evict(pool)
    assert h.alloc.num_free == pool - 1  # everything comes back


SYSTEM = "You are a meticulous assistant. Answer briefly and precisely. " * 6


def _prompts() -> list[list[dict[str, str]]]:
    questions = ["What is the capital of France?", "Name three colors.", "What is 2 + 2?", "Say hello.",
                 "Name a planet.", "What do cows drink?"]
    few_shot = "Example: Q: Name a fruit. A: Apple. " * 4
    out = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}] for q in questions]
    out += [[{"role": "user", "content": few_shot + q}] for q in questions[:3]]
    out += [[{"role": "user", "content": q}] for q in questions[3:]]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("page_size", [1, 16])
def test_radix_equals_naive_on_shared_prefixes(default_model_dir, page_size):
    params = SamplingParams(temperature=0, max_new_tokens=12)
    common = ["engine.device=cpu", f"cache.page_size={page_size}", "scheduler.max_running_requests=4"]
    naive = LLM(str(default_model_dir), overrides=[*common, "cache.type=naive"])
    radix = LLM(str(default_model_dir), overrides=[*common, "cache.type=radix", "cache.debug_checks=true"])
    prompts = _prompts()
    expected = [o.token_ids for o in naive.generate(prompts, params)]
    # Twice through the radix engine: the second pass reuses the first pass's prompts and outputs too.
    for _ in range(2):
        assert [o.token_ids for o in radix.generate(prompts, params)] == expected
    assert radix.scheduler.stats.cached_tokens > 0
    assert radix.scheduler.stats.prefill_tokens < naive.scheduler.stats.prefill_tokens * 2 * 0.7
    assert naive.scheduler.stats.cached_tokens == 0


@pytest.mark.slow
def test_eviction_under_a_tiny_pool_completes_every_request(default_model_dir):
    params = SamplingParams(temperature=0, max_new_tokens=10)
    radix = LLM(str(default_model_dir), overrides=["engine.device=cpu", "cache.num_pages=30",
                                                   "cache.debug_checks=true"])
    naive = LLM(str(default_model_dir), overrides=["engine.device=cpu", "cache.type=naive"])
    prompts = _prompts()
    cache, evicted = radix.scheduler.cache, []
    original_evict = cache.evict
    cache.evict = lambda n: evicted.append(original_evict(n)) or evicted[-1]
    outs = radix.generate(prompts, params)
    assert all(o.error is None for o in outs)
    assert [o.token_ids for o in outs] == [o.token_ids for o in naive.generate(prompts, params)]
    assert sum(evicted) > 0  # 29 usable pages are too few to keep everything: the tree really was evicted from
    radix.scheduler.cache.evict(30)
    assert radix.scheduler.allocator.num_free == 29


class KVCheckingEngine:
    """Stands in for the engine: writes a (token, position) 'KV' per slot through the batch
    descriptor's page tables, and checks that everything attention would read holds exactly the
    request's own tokens: a page shared by mistake, evicted or reused while read shows up here."""

    def __init__(self, page_size: int, dummy_row: int) -> None:
        self.page_size, self.dummy_row = page_size, dummy_row
        self.tables: dict[int, list[int]] = {}
        self.slots: dict[tuple[int, int], tuple[int, int]] = {}
        self.reads = 0

    @staticmethod
    def next_token(seq: list[int], position: int) -> int:
        # A function of the previous token and the position only: equal prefixes continue equally.
        return (seq[position - 1] * 31 + position) % 50 + 10

    def forward_batch(self, batch):  # noqa: ANN001, ANN201
        import torch

        from runtime.engine import ForwardOutput

        offset = 0
        for row, n_pages in zip(batch.admit_rows.tolist(), batch.admit_page_lens.tolist()):
            self.tables[row] = batch.admit_pages[offset : offset + n_pages].tolist()
            offset += n_pages
        tokens = []
        for i, req in enumerate(batch.reqs):
            row, start, ext = int(batch.rows[i]), int(batch.starts[i]), int(batch.ext_lens[i])
            seq = req.prompt_ids + req.output_ids
            while len(seq) < start + ext:  # decode inputs the host has not read back yet (overlap)
                seq.append(self.next_token(seq, len(seq)))
            pages = self.tables[row]
            for p in range(start, start + ext):
                self.slots[(pages[p // self.page_size], p % self.page_size)] = (seq[p], p)
            for p in range(start + ext):
                assert self.slots.get((pages[p // self.page_size], p % self.page_size)) == (seq[p], p)
                self.reads += 1
            req.complete_one(ext)
            tokens.append(self.next_token(seq, start + ext))
        t = torch.tensor(tokens, dtype=torch.int32)
        return ForwardOutput(t, t, None)


@settings(max_examples=120, deadline=None)
@given(
    prompts=st.lists(st.tuples(st.integers(0, 2), st.integers(0, 40), st.lists(st.integers(60, 70), max_size=6),
                               st.integers(1, 12)), min_size=1, max_size=10),
    page=st.sampled_from([1, 4, 16]), extra_pages=st.integers(0, 30), max_running=st.integers(1, 4),
    max_prefill=st.integers(1, 64), overlap=st.booleans(), eos=st.sampled_from([2, 17, 33]),
)
def test_scheduler_with_radix_serves_the_right_kv(prompts, page, extra_pages, max_running, max_prefill, overlap, eos):
    """Token 2 never occurs; 17 and 33 do, so requests also finish early (EOS) while others run on."""
    from runtime.batch import Req
    from runtime.config import load_config
    from runtime.loop import run_until_idle
    from runtime.output import OutputProcessor
    from runtime.scheduler import Scheduler

    reqs = [Req(uid, BASES[b][:n] + tail or [5], SamplingParams(temperature=0, max_new_tokens=new), new)
            for uid, (b, n, tail, new) in enumerate(prompts)]
    need = max(-(-(r.prompt_len + r.max_new_tokens - 1) // page) for r in reqs)
    cfg = load_config(overrides=[f"scheduler.max_running_requests={max_running}",
                                 f"scheduler.max_prefill_tokens={max_prefill}"]).scheduler
    sched = Scheduler(cfg, need + 1 + extra_pages, page, 4096, max_running, "radix", debug_checks=True)
    for r in reqs:
        sched.add(r)
    engine = KVCheckingEngine(page, max_running)
    done = []
    run_until_idle(sched, engine, OutputProcessor({eos}, max_running), overlap, done.append)
    assert sorted(r.uid for r in done) == list(range(len(reqs)))
    for r in reqs:
        seq = list(r.prompt_ids)
        while len(seq) - r.prompt_len < r.max_new_tokens and (len(seq) == r.prompt_len or seq[-1] != eos):
            seq.append(KVCheckingEngine.next_token(seq, len(seq)))
        assert r.output_ids == seq[r.prompt_len :]
        assert r.finish_reason == ("stop" if seq[-1] == eos and len(seq) > r.prompt_len else "length")
    sched.check_integrity()
    sched.cache.evict(sched.allocator.num_pages)
    assert sched.allocator.num_free == sched.allocator.num_pages - 1


@pytest.mark.parametrize("overlap", [True, False])
def test_later_requests_reuse_a_running_requests_prompt(overlap):
    from runtime.batch import Req
    from runtime.config import load_config
    from runtime.loop import run_until_idle
    from runtime.output import OutputProcessor
    from runtime.scheduler import Scheduler

    cfg = load_config(overrides=["scheduler.max_running_requests=4", "scheduler.max_prefill_tokens=41"]).scheduler
    sched = Scheduler(cfg, 64, 4, 4096, 4, "radix", debug_checks=True)
    reqs = [Req(uid, BASES[1][:40] + [60 + uid], SamplingParams(temperature=0, max_new_tokens=20), 20)
            for uid in range(4)]
    for r in reqs:
        sched.add(r)
    engine = KVCheckingEngine(4, 4)
    run_until_idle(sched, engine, OutputProcessor({2}, 4), overlap, lambda r: None)
    # The first prompt fills step 1's 41-token budget; in step 2 the other three find its 40 shared
    # tokens cached (it is still running) and compute only their last token.
    assert sched.stats.cached_tokens == 3 * 40
    assert sched.stats.prefill_tokens == 41 + 3 * 1
    assert all(r.finish_reason == "length" for r in reqs)


def test_admission_that_cannot_fit_leaves_the_cache_alone():
    """7 pages needed, 2 free + 4 evictable: not admitted, and nothing is evicted for nothing."""
    from runtime.batch import Req
    from runtime.scheduler.cache_manager import CacheManager

    pages = CacheManager(num_pages=1 + 6, page_size=4, cache_type="radix")
    cached = pages.allocator.alloc(4)
    pages.cache.insert(list(range(100, 116)), cached)  # 4 evictable pages of an unrelated prompt
    assert (pages.allocator.num_free, pages.cache.evictable_pages) == (2, 4)
    big = Req(0, list(range(20)), SamplingParams(max_new_tokens=9), 9)  # (20 + 9 - 1) / 4 = 7 pages
    assert pages.pages_for(big) == 7
    assert not pages.admit(big)
    assert (pages.allocator.num_free, pages.cache.evictable_pages) == (2, 4)
    small = Req(1, list(range(20)), SamplingParams(max_new_tokens=1), 1)  # 5 pages: evicts the cached leaf
    assert pages.admit(small) and pages.allocator.num_free == 1 and pages.cache.evictable_pages == 0
    pages.check_integrity([small])


@pytest.mark.parametrize("overlap", [True, False])
def test_a_request_finishing_in_its_prefill_step_does_not_pin_the_cache(overlap):
    from runtime.batch import Req
    from runtime.config import load_config
    from runtime.loop import run_until_idle
    from runtime.output import OutputProcessor
    from runtime.scheduler import Scheduler

    cfg = load_config(overrides=["scheduler.max_running_requests=4"]).scheduler
    sched = Scheduler(cfg, 64, 4, 4096, 4, "radix", debug_checks=True)
    reqs = [Req(uid, BASES[0][:12] + [60 + uid], SamplingParams(temperature=0, max_new_tokens=1), 1) for uid in range(4)]
    for r in reqs:
        sched.add(r)
    run_until_idle(sched, KVCheckingEngine(4, 4), OutputProcessor({2}, 4), overlap, lambda r: None)
    assert all(r.finish_reason == "length" for r in reqs)
    assert sched.cache.root.ref == 1  # only the root's own permanent reference
    assert sched.cache.evictable_pages == sched.cache.tree_pages > 0
