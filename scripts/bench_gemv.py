"""Micro-benchmark: a decoder layer's weight passes for one token, unfused against fused, in CUDA graphs.

    python scripts/bench_gemv.py [--shapes 1B,8B,SmolLM2] [--sweep]

Unfused is what the engine ran before models/gemv.py: flashinfer's fused add + RMSNorm, cuBLAS for
qkv, o, gate_up and down, flashinfer's SiLU x mul. Fused is models/gemv.py's four kernels, with
programmatic dependent launch and without. A layer's attention is left out (its input is a fixed
tensor), so the numbers are the weight passes and what sits between them. Each shape is stacked into
enough layers that the weights pass 1 GB, so L2 (50 MB) never serves them; one graph replays the whole
stack. Reported: microseconds per layer and the weight bytes over that time. ``--sweep`` times each
fused kernel alone over a grid of tiles (the default tile of ``models.gemv.tile`` is marked).
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import gemv  # noqa: E402

SHAPES = {  # hidden, q + k + v features, intermediate
    "1B": (2048, 3072, 8192), "8B": (4096, 6144, 14336), "SmolLM2": (576, 960, 1536),
}


def replay_us(fn: Callable[[], None], repeats: int = 20) -> float:
    """Microseconds per call of ``fn`` (one whole stack) captured in a CUDA graph."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        graph.replay()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats * 1e6


def make_layers(hidden: int, qkv: int, inter: int) -> list[dict[str, torch.Tensor]]:
    dev, dt = torch.device("cuda"), torch.bfloat16
    per_layer = 2 * hidden * (qkv + hidden + 3 * inter)
    count = max(4, min(64, int(1e9 // per_layer) + 1))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt) * 0.02

    return [{"qkv": rand(qkv, hidden), "o": rand(hidden, hidden), "gate_up": rand(2 * inter, hidden),
             "down": rand(hidden, inter), "n1": torch.rand(hidden, device=dev, dtype=dt) + 0.5,
             "n2": torch.rand(hidden, device=dev, dtype=dt) + 0.5} for _ in range(count)]


def unfused_stack(layers: list[dict], h: torch.Tensor, attn: torch.Tensor) -> Callable[[], None]:
    import flashinfer

    def run() -> None:
        x, resid = h.clone(), torch.zeros_like(h)
        for w in layers:
            flashinfer.norm.fused_add_rmsnorm(x, resid, w["n1"], 1e-5)
            torch.mm(x, w["qkv"].t())
            x = torch.mm(attn, w["o"].t())
            flashinfer.norm.fused_add_rmsnorm(x, resid, w["n2"], 1e-5)
            x = torch.mm(flashinfer.activation.silu_and_mul(torch.mm(x, w["gate_up"].t())), w["down"].t())

    return run


def fused_stack(layers: list[dict], h: torch.Tensor, attn: torch.Tensor) -> Callable[[], None]:
    def run() -> None:
        x = h.clone()
        for w in layers:
            gemv.norm_linear(x, w["n1"], 1e-5, w["qkv"], None)
            gemv.linear_add_(attn, w["o"], None, x)
            gemv.linear_add_(gemv.norm_linear_silu(x, w["n2"], 1e-5, w["gate_up"], None), w["down"], None, x)

    return run


def sweep(layers: list[dict], hidden: int, qkv: int, inter: int) -> None:
    """Each fused kernel alone over the stack, per tile, against the default tile."""
    h = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(1, inter, device="cuda", dtype=torch.bfloat16)
    kernels = {
        "qkv": (qkv, hidden, lambda w: gemv.norm_linear(h, w["n1"], 1e-5, w["qkv"], None)),
        "o": (hidden, hidden, lambda w: gemv.linear_add_(h[:, :hidden], w["o"], None, h)),
        "gate_up": (inter, hidden, lambda w: gemv.norm_linear_silu(h, w["n2"], 1e-5, w["gate_up"], None)),
        "down": (hidden, inter, lambda w: gemv.linear_add_(act, w["down"], None, h)),
    }
    default_tile = gemv.tile
    for name, (n, k, call) in kernels.items():
        mb = 2 * n * k * (2 if name == "gate_up" else 1) / 1e3
        results = []
        default = default_tile(n, k, name == "gate_up")
        for config in [default, *itertools.product([4, 8, 16], [256, 512], [4, 8], [2, 4])]:
            gemv.tile = lambda n_, k_, silu_, t=config: t
            us = replay_us(lambda call=call: [call(w) for w in layers]) / len(layers)
            results.append((us, config))
        gemv.tile = default_tile
        best = min(results)
        top = ", ".join(f"{t} {us:.2f}" for us, t in sorted(results)[1:4])
        print(f"  sweep {name:8}: best {best[0]:6.2f} us {mb / best[0]:5.0f} GB/s {best[1]} | default {default} "
              f"{results[0][0]:.2f} us | next: {top}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1B,8B,SmolLM2")
    parser.add_argument("--sweep", action="store_true")
    args = parser.parse_args()
    for shape in args.shapes.split(","):
        hidden, qkv, inter = SHAPES[shape]
        layers = make_layers(hidden, qkv, inter)
        layer_kb = 2 * hidden * (qkv + hidden + 3 * inter) / 1e3
        h = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
        attn = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
        if args.sweep:
            sweep(layers, hidden, qkv, inter)
        unfused = replay_us(unfused_stack(layers, h, attn)) / len(layers)
        fused = replay_us(fused_stack(layers, h, attn)) / len(layers)
        use_pdl = gemv.use_pdl
        gemv.use_pdl = lambda index: False
        no_pdl = replay_us(fused_stack(layers, h, attn)) / len(layers)
        gemv.use_pdl = use_pdl
        print(f"{shape:8}: unfused {unfused:7.2f} us/layer {layer_kb / unfused:5.0f} GB/s | fused "
              f"{fused:7.2f} us {layer_kb / fused:5.0f} GB/s ({unfused / fused:.2f}x) | fused, no PDL "
              f"{no_pdl:7.2f} us ({unfused / no_pdl:.2f}x)  [{len(layers)} layers]", flush=True)
        del layers
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
