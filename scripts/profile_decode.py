"""Profile a short benchmark run with the torch profiler: where does GPU time go?

    python scripts/profile_decode.py --config configs/bench/llama-3.2-1b.yaml [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import LLM, SamplingParams  # noqa: E402
from scripts.bench_config import load_bench_config  # noqa: E402
from scripts.bench_runs import workload  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--trace", default=None, help="write a chrome trace here")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_bench_config(args.config, args.overrides)
    llm = LLM(config=cfg)
    prompts, _ = workload(cfg, fixed=True, n=args.requests)
    params = SamplingParams(temperature=cfg.bench.temperature, max_new_tokens=args.new_tokens, ignore_eos=True)
    llm.generate(prompts[:8], params)
    # Prefill first, outside the profile, so the window holds decode steps.
    llm.generate(prompts, SamplingParams(temperature=cfg.bench.temperature, max_new_tokens=1, ignore_eos=True))
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, params)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=30))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
