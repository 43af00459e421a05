"""Admission in groups (``scheduler.admit_free_share``): while requests decode, new ones wait until a group's
worth of rows and pages is free, because their prefill step stops every decode. Driven by the scripted fake
engine of ``tests/test_scheduler.py``; every run is also checked by its ``check_run`` (outputs, resources).
"""

from __future__ import annotations

import types

from runtime.batch import Req
from runtime.frontend.llm import LLM
from runtime.loop import run_until_idle
from runtime.output import OutputProcessor
from runtime.sampling_params import SamplingParams
from runtime.scheduler import Scheduler
from tests.test_scheduler import EOS_IDS, MAX_SEQ_LEN, OVERLAP, FakeEngine, Script, Spec, run_workload, scheduler_cfg


@OVERLAP
def test_while_others_decode_new_requests_are_admitted_in_groups(overlap):
    """A prefill step stops every decode. With 8 rows and admit_free_share=0.5, requests that finish one by
    one free their rows, and the waiting ones are admitted 4 or more at a time (the last ones as soon as
    they all fit): fewer prefill steps than one admission per finished request, and the same outputs."""
    specs = [Spec(uid, 3, 2 + (5 * uid) % 11) for uid in range(24)]
    grouped = run_workload(specs, overlap=overlap, max_running=8, admit_free_share=0.5)
    one_by_one = run_workload(specs, overlap=overlap, max_running=8, admit_free_share=0.0)
    groups = [len(st.admitted) for st in grouped.steps if st.admitted]
    assert groups[0] == 8
    assert all(g >= 4 for g in groups[1:-1]), groups
    assert sum(groups) == len(specs)
    singles = [len(st.admitted) for st in one_by_one.steps if st.admitted]
    assert min(singles[1:]) == 1 and len(groups) < len(singles), (groups, singles)
    assert grouped.scheduler.stats.prefill_steps < one_by_one.scheduler.stats.prefill_steps


@OVERLAP
def test_when_pages_bind_new_requests_are_admitted_in_groups_of_pages(overlap):
    """Rows to spare, pages short: each request reserves 3 of 24 pages, so 8 run at once. With
    admit_free_share=0.25 a group is 6 free pages: admissions after the first come 2 or more at a time."""
    specs = [Spec(uid, 6, 7, eos_at=2 + (3 * uid) % 5) for uid in range(20)]
    pool = dict(overlap=overlap, max_running=16, num_pages=1 + 3 * 8, page_size=4)
    grouped = run_workload(specs, admit_free_share=0.25, **pool)
    one_by_one = run_workload(specs, admit_free_share=0.0, **pool)
    groups = [len(st.admitted) for st in grouped.steps if st.admitted]
    assert groups[0] == 8 and sum(groups) == len(specs)
    assert all(g >= 2 for g in groups[1:-1]), groups
    assert grouped.scheduler.stats.prefill_steps < one_by_one.scheduler.stats.prefill_steps


@OVERLAP
def test_short_requests_do_not_wait_behind_a_long_one_that_holds_the_pages(overlap):
    """One request reserves 96 of 100 pages for 380 tokens; 2-page requests fit beside it two at a time. A
    group's pages are capped at what the next requests need, so they run alongside it, not after it."""
    specs = [Spec(0, 4, 380)] + [Spec(uid, 4, 4) for uid in range(1, 21)]
    run = run_workload(specs, overlap=overlap, max_running=16, num_pages=101, page_size=4)
    firsts = [next(st.index for st in run.steps if uid in st.uids) for uid in range(1, 21)]
    assert max(firsts) < run.final_step(0) // 4, firsts


def test_a_page_bound_scheduler_asks_its_source_for_few_rows():
    """LLM.run tops the queue up to the free rows + 4, or to 4 while pages are short (a page wait counted since
    the last refill). Pages bind here (8 of 64 rows' worth): the queue must stay short, or a replica of a
    data-parallel job hoards rows the other replicas could serve."""
    max_running = 64
    specs = [Spec(uid, 6, 7, eos_at=2 + (3 * uid) % 5) for uid in range(300)]  # 3 pages each
    sched = Scheduler(scheduler_cfg(max_running, 64), 1 + 3 * 8, 4, MAX_SEQ_LEN, max_running)
    source = types.SimpleNamespace(scheduler=sched, _page_waits=0)
    todo, queued = list(specs), []

    def refill() -> bool:
        room = LLM._room(source)
        for sp in todo[:room]:
            sched.add(Req(sp.uid, sp.prompt(), SamplingParams(max_new_tokens=sp.max_new), sp.max_new))
        del todo[:room]
        queued.append(len(sched.waiting))
        return bool(todo)

    engine = FakeEngine(sched, Script(specs), max_steps=100_000)
    done: list[int] = []
    run_until_idle(sched, engine, OutputProcessor(EOS_IDS, max_running), True, lambda r: done.append(r.uid),
                   engine.on_batch, refill=refill)
    assert sorted(done) == [sp.uid for sp in specs]
    assert sum(queued[1:]) / len(queued[1:]) < 16, queued
