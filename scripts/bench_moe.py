"""The fused experts (models/fused_moe.py) alone, in a CUDA graph: time per call and the bandwidth it reaches on the
bytes it must read (the experts the router chose, once each), against a copy's bandwidth measured in the run.

    python scripts/bench_moe.py [--sweep] [--fp8]   # --sweep also times every tile of SWEEP at each shape;
                                                    # --fp8 also e4m3 experts, alternated with bf16 at each batch
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import fp8, fused_moe  # noqa: E402
from scripts.bench_runs import measure_limits  # noqa: E402

# name: (experts, top_k, hidden, intermediate)
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = (1, 16, 64, 256, 512, 2048)
SWEEP = [(16, 32, 4, 4), (16, 64, 4, 4), (16, 128, 4, 3), (32, 64, 4, 4), (32, 128, 4, 3), (64, 64, 4, 4),
         (64, 128, 4, 3), (64, 128, 8, 3), (128, 128, 8, 3)]


def time_graph(fn, reps: int = 50) -> float:  # noqa: ANN001
    """Seconds per call of ``fn`` replayed from a CUDA graph."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    torch.cuda.synchronize()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def measure(shape: tuple[int, int, int, int], tokens: int, tile: tuple[int, int, int, int] | None,
            e4m3: bool = False) -> dict:
    experts, top_k, hidden, inter = shape
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16, generator=gen)
    logits = torch.randn(tokens, experts, device="cuda", dtype=torch.bfloat16, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16, generator=gen) / inter**0.5
    scales: tuple[torch.Tensor | None, ...] = (None, None)
    if e4m3:  # as models/moe.py stores them: e4m3 values, a float32 scale per row
        (w13, s13), (w2, s2) = fp8.quantize_experts(w13), fp8.quantize_experts(w2)
        scales = (s13, s2)
    touched = int(torch.topk(logits.float(), top_k, dim=-1).indices.unique().numel())
    default = fused_moe.tile
    if tile is not None:
        fused_moe.tile = lambda pairs, experts: tile
    try:
        seconds = time_graph(lambda: fused_moe.fused_moe(x, logits, w13, w2, top_k, True, None, *scales))
    finally:
        fused_moe.tile = default
    weight_bytes = 3 * hidden * inter * w13.element_size() + (4 * (2 * inter + hidden) if e4m3 else 0)
    moved = touched * weight_bytes + tokens * hidden * 2 * 2
    return {"tokens": tokens, "experts_touched": touched, "us": seconds * 1e6, "gbps": moved / seconds / 1e9,
            "tile": list(tile or default(tokens * top_k, experts))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--fp8", action="store_true", help="also e4m3 experts, each batch alternated with bf16")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    limits = measure_limits(torch.device("cuda"))
    results: dict = {"limits": limits, "shapes": {}}
    for name, shape in SHAPES.items():
        rows = []
        for tokens in TOKENS:
            row = measure(shape, tokens, None)
            if args.sweep:
                row["sweep"] = {str(t): round(measure(shape, tokens, t)["us"], 1) for t in SWEEP}
            row["share_of_copy_bandwidth"] = row["gbps"] / limits["hbm_gbps"]
            if args.fp8:  # bf16, e4m3, bf16, e4m3: the node drifts between runs
                runs = [(measure(shape, tokens, None), measure(shape, tokens, None, e4m3=True)) for _ in range(2)]
                row["fp8"] = {"us": [r[1]["us"] for r in runs], "bf16_us_alternated": [r[0]["us"] for r in runs],
                              "gbps": [r[1]["gbps"] for r in runs],
                              "fp8_over_bf16": sum(r[1]["us"] for r in runs) / sum(r[0]["us"] for r in runs)}
            print(name, json.dumps(row), flush=True)
            rows.append(row)
        results["shapes"][name] = rows
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
