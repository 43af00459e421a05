"""Micro-benchmark: a decoder layer's weight passes for one token, unfused against fused, in CUDA graphs.

    python scripts/bench_gemv.py [--shapes 1B,8B,SmolLM2] [--sweep] [--fp8 [--widening cvt|bits|mixed|all]]

The stack is deep enough that L2 never serves the weights; ``--sweep`` varies one kernel's tile at a time;
``--fp8`` times e4m3 weights with a scale per row (the fused kernels only), widened to f16 by conversion
instructions (cvt), integer ops (bits) or one pair each way (mixed: ``models.gemv.E4M3_WIDENING``); ``all``
alternates the three, three times.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import fp8 as fp8_ops  # noqa: E402
from models import gemv  # noqa: E402

SHAPES = {  # hidden, q + k + v features, intermediate
    "1B": (2048, 3072, 8192), "8B": (4096, 6144, 14336), "SmolLM2": (576, 960, 1536),
}


def replay_us(fn: Callable[[], None], repeats: int = 20) -> float:
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


LINEARS = ("qkv", "o", "gate_up", "down")


def make_layers(hidden: int, qkv: int, inter: int, count: int = 0, fp8: bool = False) -> list[dict[str, torch.Tensor]]:
    """``count`` layers of random weights; by default enough that the stack outgrows L2. With ``fp8`` each
    linear's weight is e4m3 with its per-row scale under ``<name>_scale``."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    per_layer = layer_bytes(hidden, qkv, inter, fp8)
    count = count or max(4, min(64, int(1e9 // per_layer) + 1))

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=dev, dtype=dt) * 0.02

    def layer() -> dict[str, torch.Tensor]:
        weights = {"qkv": rand(qkv, hidden), "o": rand(hidden, hidden), "gate_up": rand(2 * inter, hidden),
                   "down": rand(hidden, inter), "n1": torch.rand(hidden, device=dev, dtype=dt) + 0.5,
                   "n2": torch.rand(hidden, device=dev, dtype=dt) + 0.5}
        if fp8:
            for name in LINEARS:
                weights[name], weights[f"{name}_scale"] = fp8_ops.quantize_rows(weights[name])
        return weights

    return [layer() for _ in range(count)]


def layer_bytes(hidden: int, qkv: int, inter: int, fp8: bool) -> int:
    return (1 if fp8 else 2) * hidden * (qkv + hidden + 3 * inter)


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
            gemv.norm_linear(x, w["n1"], 1e-5, w["qkv"], None, w.get("qkv_scale"))
            gemv.linear_add_(attn, w["o"], None, x, w.get("o_scale"))
            act = gemv.norm_linear_silu(x, w["n2"], 1e-5, w["gate_up"], None, w.get("gate_up_scale"))
            gemv.linear_add_(act, w["down"], None, x, w.get("down_scale"))

    return run


KernelKey = tuple[int, int, bool]  # (n, k, silu): the arguments models.gemv.tile sees
Tile = tuple[int, int, int, int]  # (BLOCK_N, BLOCK_K, num_warps, num_stages)


def kernel_keys(hidden: int, qkv: int, inter: int) -> dict[str, KernelKey]:
    return {"qkv": (qkv, hidden, False), "o": (hidden, hidden, False), "gate_up": (inter, hidden, True),
            "down": (hidden, inter, False)}


def candidate_tiles(n: int, k: int, silu: bool) -> list[Tile]:
    tiles = []
    for bn, bk, warps, stages in itertools.product([1, 2, 4, 8, 16], [256, 512, 1024, 2048, 4096], [2, 4, 8],
                                                   [2, 3, 4, 6]):
        per_thread = bn * (2 if silu else 1) * bk / (32 * warps)
        if bk <= k and (k > bk or stages == 2) and 8 <= per_thread <= 64 and n // bn >= 128:
            tiles.append((bn, bk, warps, stages))
    return tiles


def patched_tile(overrides: dict[KernelKey, Tile]) -> Callable[[int, int, bool, bool], Tile]:
    default = gemv.tile

    def tile(n: int, k: int, silu: bool, fp8: bool = False) -> Tile:
        return overrides.get((n, k, silu)) or default(n, k, silu, fp8)

    return tile


def _precompile(shape: tuple[int, int, int], work: list[tuple[str, Tile]], fp8: bool, widening: str) -> None:
    """Worker: run each (kernel, tile) once so that Triton's on-disk cache holds it for the parent. A spawned
    worker imports models.gemv afresh, so it is told the parent's widening."""
    gemv.E4M3_WIDENING = widening
    hidden, qkv, inter = shape
    keys = kernel_keys(hidden, qkv, inter)
    layer = make_layers(hidden, qkv, inter, count=1, fp8=fp8)[0]
    h = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    act = torch.randn(1, inter, device="cuda", dtype=torch.bfloat16)
    calls = kernel_calls(h, act, hidden)
    default = gemv.tile
    for name, tile in work:
        gemv.tile = patched_tile({keys[name]: tile})
        calls[name](layer)
    gemv.tile = default
    torch.cuda.synchronize()


def kernel_calls(h: torch.Tensor, act: torch.Tensor, hidden: int) -> dict[str, Callable[[dict], object]]:
    return {
        "qkv": lambda w: gemv.norm_linear(h, w["n1"], 1e-5, w["qkv"], None, w.get("qkv_scale")),
        "o": lambda w: gemv.linear_add_(h[:, :hidden], w["o"], None, h, w.get("o_scale")),
        "gate_up": lambda w: gemv.norm_linear_silu(h, w["n2"], 1e-5, w["gate_up"], None, w.get("gate_up_scale")),
        "down": lambda w: gemv.linear_add_(act, w["down"], None, h, w.get("down_scale")),
    }


def sweep(layers: list[dict], hidden: int, qkv: int, inter: int, workers: int,
          record: dict | None = None, fp8: bool = False) -> dict[str, Tile]:
    """The best tile per kernel, swept inside the whole stack so the dependent-launch overlap is what a step sees."""
    import multiprocessing

    keys = kernel_keys(hidden, qkv, inter)
    work = [(name, t) for name, key in keys.items() for t in candidate_tiles(*key)]
    started = time.perf_counter()
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        pool.starmap(_precompile, [((hidden, qkv, inter), work[i::workers], fp8, gemv.E4M3_WIDENING)
                                   for i in range(workers)])
    print(f"  compiled {len(work)} tiles in {time.perf_counter() - started:.0f} s", flush=True)
    h = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    attn = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
    stack = fused_stack(layers, h, attn)
    default_tile = gemv.tile

    def stack_us(overrides: dict[KernelKey, Tile], repeats: int = 50) -> float:
        gemv.tile = patched_tile(overrides)
        try:
            return replay_us(stack, repeats) / len(layers)
        finally:
            gemv.tile = default_tile

    base = min(stack_us({}) for _ in range(3))
    best: dict[str, Tile] = {}
    for name, key in keys.items():
        results = sorted((stack_us({key: t}), t) for t in candidate_tiles(*key))
        if record is not None:
            record[name] = {"default": default_tile(*key, fp8), "stack_us": base, "tiles": results}
        # Re-time the leaders: one replay loop can catch a slow moment.
        leaders = sorted((min(stack_us({key: t}) for _ in range(3)), t) for _, t in results[:6])
        best[name] = leaders[0][1]
        top = ", ".join(f"{t} {us:.2f}" for us, t in leaders[:4])
        print(f"  sweep {name:8}: default {default_tile(*key, fp8)} stack {base:.2f} us/layer | best {top}", flush=True)
    overrides = {keys[name]: t for name, t in best.items()}
    print(f"  all four best tiles: {min(stack_us(overrides) for _ in range(3)):.2f} against {base:.2f} us/layer "
          f"(defaults) | {best}", flush=True)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="1B,8B,SmolLM2")
    parser.add_argument("--sweep", action="store_true")
    parser.add_argument("--workers", type=int, default=12, help="processes compiling the swept tiles")
    parser.add_argument("--sweep-json", default=None, help="write every swept tile's time here")
    parser.add_argument("--fp8", action="store_true", help="e4m3 weights, fused kernels only")
    parser.add_argument("--widening", choices=[*gemv.E4M3_WIDENINGS, "all"], default=None,
                        help="with --fp8: how e4m3 becomes f16 (default: the engine's); all: each, alternated")
    args = parser.parse_args()
    if args.widening == "all" and args.sweep:
        parser.error("--sweep takes one --widening")
    if args.widening in gemv.E4M3_WIDENINGS:
        gemv.E4M3_WIDENING = args.widening
    record: dict[str, dict] = {}
    for shape in args.shapes.split(","):
        hidden, qkv, inter = SHAPES[shape]
        layers = make_layers(hidden, qkv, inter, fp8=args.fp8)
        layer_kb = layer_bytes(hidden, qkv, inter, args.fp8) / 1e3
        h = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
        attn = torch.randn(1, hidden, device="cuda", dtype=torch.bfloat16)
        if args.sweep:
            sweep(layers, hidden, qkv, inter, args.workers, record.setdefault(shape, {}), args.fp8)
        if args.fp8:
            widenings = list(gemv.E4M3_WIDENINGS) * 3 if args.widening == "all" else [gemv.E4M3_WIDENING]
            for widening in widenings:
                gemv.E4M3_WIDENING = widening
                fused = replay_us(fused_stack(layers, h, attn)) / len(layers)
                print(f"{shape:8}: fused FP8 ({widening}) {fused:7.2f} us/layer "
                      f"{layer_kb / fused:5.0f} GB/s  [{len(layers)} layers]", flush=True)
            del layers
            continue
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
    if args.sweep_json:
        Path(args.sweep_json).write_text(json.dumps(record, indent=1))


if __name__ == "__main__":
    main()
