"""A job's exit code after a signal (in-process, on a tiny model): 143 ("requeue me") only while rows are left
to serve or read; a complete output exits 0."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import launch
from runtime import LLM
from runtime.frontend import job as job_module
from runtime.frontend.signals import EXIT_PREEMPTED, Drain

ROWS = 12


def _job(model_dir: Path, tmp_path: Path) -> tuple[LLM, Drain]:
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": [5 + i, 6, 7], "sampling": {"max_new_tokens": 3}}) + "\n"
                            for i in range(ROWS)))
    llm = LLM(str(model_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64",
                                         "scheduler.max_running_requests=2", f"job.input={rows}",
                                         f"job.output={tmp_path / 'out.jsonl'}", "job.progress=false"])
    llm.drain = Drain()
    return llm, llm.drain


def _done(tmp_path: Path) -> int:
    return len((tmp_path / "out.jsonl").read_text().splitlines())


def test_a_signal_after_the_last_row_exits_0(tiny_llama_dir, tmp_path, monkeypatch, capsys):
    llm, drain = _job(tiny_llama_dir, tmp_path)
    merge, merges = job_module.merge_output, []

    def merge_during_a_signal(*args: object) -> None:  # the first merge recovers; SIGTERM lands in the last one
        merges.append(args)
        if len(merges) == 2:
            drain.request(signal.SIGTERM)
        merge(*args)

    monkeypatch.setattr(job_module, "merge_output", merge_during_a_signal)
    assert launch.serve(llm.cfg, llm, drain) == 0
    assert drain.signum == signal.SIGTERM and _done(tmp_path) == ROWS
    assert "rerun to complete" not in capsys.readouterr().err


def test_a_signal_on_a_rerun_of_a_complete_output_exits_0(tiny_llama_dir, tmp_path, capsys):
    """Nothing left to serve: a drain before the first refill stops no row, so no requeue is asked for."""
    llm, drain = _job(tiny_llama_dir, tmp_path)
    assert launch.serve(llm.cfg, llm, drain) == 0 and _done(tmp_path) == ROWS
    again, fresh = _job(tiny_llama_dir, tmp_path)
    fresh.request(signal.SIGTERM)
    assert launch.serve(again.cfg, again, fresh) == 0 and _done(tmp_path) == ROWS
    assert "rerun to complete" not in capsys.readouterr().err


def test_a_signal_that_stops_the_refills_exits_143_and_a_rerun_completes(tiny_llama_dir, tmp_path, capsys):
    llm, drain = _job(tiny_llama_dir, tmp_path)
    checks = 0

    def signal_on_the_third_check(d: Drain) -> None:  # the refill asks first: admitted rows finish, others wait
        nonlocal checks
        checks += 1
        if checks == 3:
            d.request(signal.SIGTERM)

    drain.sync = signal_on_the_third_check
    assert launch.serve(llm.cfg, llm, drain) == EXIT_PREEMPTED
    assert 0 < _done(tmp_path) < ROWS
    assert f"rerun to complete (exit {EXIT_PREEMPTED})" in capsys.readouterr().err
    again, fresh = _job(tiny_llama_dir, tmp_path)
    assert launch.serve(again.cfg, again, fresh) == 0 and _done(tmp_path) == ROWS


def test_a_drain_that_leaves_the_source_unread_is_an_interruption(tiny_llama_dir, tmp_path):
    """A source handing out one row at a time leaves no request waiting: after the drain the running one
    finishes and the loop runs dry, yet rows were never read."""
    llm, drain = _job(tiny_llama_dir, tmp_path)
    sched, handed = llm.scheduler, []
    params = llm.default_sampling()
    params.max_new_tokens = 3

    def one_at_a_time(room: int) -> list | None:
        if len(handed) == ROWS:
            return None
        handed.append(len(handed))
        return [(handed[-1], [5, 6, 7], params)]

    drain.sync = lambda d: d.request(signal.SIGTERM) if sched.running and len(handed) == 2 else None
    done = llm.run(one_at_a_time)
    assert drain.signum == signal.SIGTERM and len(done) == 2 and len(handed) < ROWS
    assert llm.interrupted


def test_a_job_that_serves_no_row_fails(tiny_llama_dir, tmp_path, capsys):
    """Every row an error row (here too long for the context): exit 1 naming the errors file, not 0."""
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({"id": i, "prompt": list(range(5, 100))}) + "\n" for i in range(3)))
    llm = LLM(str(tiny_llama_dir), overrides=["engine.device=cpu", "model.dtype=float32", "model.max_seq_len=64",
                                             f"job.input={rows}", f"job.output={tmp_path / 'out.jsonl'}",
                                             "job.progress=false"])
    assert launch.serve(llm.cfg, llm, Drain()) == 1
    assert f"no row could be served; why is in {tmp_path / 'out.errors.jsonl'}" in capsys.readouterr().err
    assert len((tmp_path / "out.errors.jsonl").read_text().splitlines()) == 3
