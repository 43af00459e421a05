"""Profile a short benchmark run with the torch profiler: where does GPU time go?

    python scripts/profile_decode.py --config configs/bench/llama-3.2-1b.yaml [--phase prefill] [key=value ...]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime import LLM, SamplingParams  # noqa: E402
from scripts.bench_config import load_bench_config  # noqa: E402
from scripts.bench_runs import workload  # noqa: E402


def gpu_kernels(prof: torch.profiler.profile) -> list[tuple[float, float, str]]:
    return sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    )


def gpu_timeline(prof: torch.profiler.profile, steps: int) -> str:
    """GPU busy time against the span of the window (idle = the GPU waiting for the host), per step."""
    kernels = gpu_kernels(prof)
    if not kernels:
        return "no GPU kernels recorded"
    busy, cur_start, cur_end = 0.0, *kernels[0][:2]
    for start, end, _ in kernels[1:]:
        if start > cur_end:
            busy, cur_start = busy + cur_end - cur_start, start
        cur_end = max(cur_end, end)
    busy += cur_end - cur_start
    span = kernels[-1][1] - kernels[0][0]
    return (f"GPU timeline: {len(kernels)} kernels ({len(kernels) / steps:.0f} a step), busy {busy / 1e3:.2f} of "
            f"{span / 1e3:.2f} ms ({busy / 1e3 / steps:.3f} ms a step busy, {(span - busy) / 1e3 / steps:.3f} ms idle)")


def critical_path(prof: torch.profiler.profile, steps: int, layers: int) -> str:
    """Per kernel, the time its end adds after the previous kernel's: what counts under dependent launch."""
    kernels = gpu_kernels(prof)
    counts = Counter(name for _, _, name in kernels)
    seen: dict[str, int] = {}
    added: dict[str, list[float]] = {}
    prev_end = None
    for _, end, name in kernels:
        per_layer = max(1, round(counts[name] / (steps * layers)))
        index = seen.get(name, 0)
        seen[name] = index + 1
        label = name[:48] + (f" [{index % per_layer}]" if per_layer > 1 else "")
        if prev_end is not None:
            added.setdefault(label, []).append(end - prev_end)
        prev_end = end
    rows = sorted(added.items(), key=lambda kv: -sum(kv[1]))
    lines = ["critical path (us added per launch: median, and total a step):"]
    for label, deltas in rows[:24]:
        deltas.sort()
        lines.append(f"  {label:54} {deltas[len(deltas) // 2]:8.2f} {sum(deltas) / steps:9.1f}  x{len(deltas) / steps:.0f}")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--trace", default=None, help="write a chrome trace here")
    parser.add_argument("--rows", type=int, default=30, help="kernels in the table")
    parser.add_argument("--phase", choices=("decode", "prefill"), default="decode",
                        help="profile decode steps, or the prefill steps of the requests' prompts")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    cfg = load_bench_config(args.config, args.overrides)
    llm = LLM(config=cfg)
    prompts, _ = workload(cfg, fixed=True, n=args.requests)
    params = SamplingParams(temperature=cfg.bench.temperature, max_new_tokens=args.new_tokens, ignore_eos=True)
    one_token = SamplingParams(temperature=cfg.bench.temperature, max_new_tokens=1, ignore_eos=True)
    llm.generate(prompts[:8], params)
    if args.phase == "prefill":
        # Warm the prefill shapes on other token ids, so the profiled prompts find nothing in the prefix cache.
        llm.generate([[(t + 1) % cfg.bench.token_id_limit for t in p] for p in prompts], one_token)
        steps = -(-sum(map(len, prompts)) // cfg.scheduler.max_prefill_tokens)
    else:
        # Prefill first, outside the profile, so the window holds decode steps.
        llm.generate(prompts, one_token)
        steps = args.new_tokens
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        llm.generate(prompts, one_token if args.phase == "prefill" else params)
        torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=args.rows))
    print(gpu_timeline(prof, steps))
    print(critical_path(prof, steps, llm.model_config.num_layers))
    if args.trace:
        prof.export_chrome_trace(args.trace)
    return 0


if __name__ == "__main__":
    sys.exit(main())
