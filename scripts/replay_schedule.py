"""Replay a benchmark workload through the scheduler on CPU, without a model: how many steps of each kind.

    python scripts/replay_schedule.py --config configs/bench/llama-3.2-1b.yaml [key=value ...]

Scheduling ignores token values here, so the step counts equal the GPU run's.
"""

from __future__ import annotations

import argparse
import sys
import types
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.batch import Batch, Req  # noqa: E402
from runtime.engine import ForwardOutput  # noqa: E402
from runtime.frontend.llm import LLM  # noqa: E402
from runtime.loop import run_until_idle  # noqa: E402
from runtime.output import OutputProcessor  # noqa: E402
from runtime.sampling_params import SamplingParams  # noqa: E402
from runtime.scheduler import Scheduler  # noqa: E402
from scripts.bench_config import load_bench_config  # noqa: E402
from scripts.bench_runs import workload  # noqa: E402


class BookkeepingEngine:
    """Engine.forward_batch's contract without a model: bookkeeping before returning, one token per row."""

    def forward_batch(self, batch: Batch) -> ForwardOutput:
        for req, ext in zip(batch.reqs, batch.ext_lens.tolist()):
            req.complete_one(ext)
        tokens = torch.full((batch.size,), 10, dtype=torch.int32)
        return ForwardOutput(tokens, tokens.clone(), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_bench_config(args.config, args.overrides)
    prompts, outs = workload(cfg, False)
    rows, page = cfg.scheduler.max_running_requests, cfg.cache.page_size
    num_pages = cfg.cache.num_pages or rows * -(-cfg.model.max_seq_len // page) + 1  # the engine's cap
    sched = Scheduler(cfg.scheduler, num_pages, page, cfg.model.max_seq_len, rows, cfg.cache.type)
    todo = [Req(i, p, SamplingParams(max_new_tokens=n, ignore_eos=True), n) for i, (p, n) in enumerate(zip(prompts, outs))]
    source = types.SimpleNamespace(scheduler=sched, _page_waits=0)

    def refill() -> bool:
        room = LLM._room(source)
        for req in todo[:room]:
            sched.add(req)
        del todo[:room]
        return bool(todo)

    done: list[int] = []
    run_until_idle(sched, BookkeepingEngine(), OutputProcessor(set(), rows), True, lambda r: done.append(r.uid), None,
                   refill=refill)
    st = sched.stats
    print(f"{len(done)} requests: {st.prefill_steps + st.decode_steps} steps, {st.prefill_steps} prefill "
          f"({st.prefill_tokens} tokens), {st.decode_steps} decode ({st.decode_tokens} tokens), "
          f"{st.page_waits} page waits")


if __name__ == "__main__":
    main()
