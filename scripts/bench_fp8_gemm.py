"""Micro-benchmark: the FP8 GEMM of a linear layer against bf16 at the batch sizes of decode and prefill.

    python scripts/bench_fp8_gemm.py [--rows 16,64,128,256,384,512,16384] [--shapes 8B,70B]

Per (rows, layer): us of ``F.linear`` in bf16, of ``torch._scaled_mm`` with row-wise scales (the engine's from
``fp8.SCALES_AFTER_MAX_OUTPUTS`` outputs), with fast accumulation, with one scale per tensor (cuBLASLt), and of the
engine's path for fewer rows (per-tensor GEMM with unit scales, then the row-wise scales applied); the relative
error of each FP8 variant against a float64 product of the same e4m3 values; and the cost of quantising the
activations.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models import fp8  # noqa: E402

LAYERS = {  # (out, in) of qkv, o, gate_up, down, and the LM head
    "8B": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
           "lm_head": (128256, 4096)},
    "70B": {"qkv": (10240, 8192), "o": (8192, 8192), "gate_up": (57344, 8192), "down": (8192, 28672)},
}


def time_us(fn, repeats: int = 30) -> float:  # noqa: ANN001 - a zero-argument callable
    fn()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(repeats):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / repeats


def relative(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref).norm() / ref.norm())


def bench(rows: int, n: int, k: int) -> dict[str, float]:
    dev = torch.device("cuda")
    x = torch.randn(rows, k, device=dev, dtype=torch.bfloat16)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02
    xq, xs = fp8.quantize_rows(x)
    wq, ws = fp8.quantize_rows(w)
    xt, wt = xs.amax() * torch.ones((), device=dev), ws.amax() * torch.ones((), device=dev)
    xq_t = (x.float() / xt).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    wq_t = (w.float() / wt).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)

    def rowwise(fast: bool) -> torch.Tensor:
        return torch._scaled_mm(xq, wq.t(), scale_a=xs[:, None], scale_b=ws[None, :], out_dtype=torch.bfloat16,
                                use_fast_accum=fast)

    def tensorwise() -> torch.Tensor:
        return torch._scaled_mm(xq_t, wq_t.t(), scale_a=xt, scale_b=wt, out_dtype=torch.bfloat16,
                                use_fast_accum=True)

    def scales_after() -> torch.Tensor:
        return fp8._scales_after(xq, xs, wq, ws, None, torch.bfloat16)

    repeats = 30 if rows <= 2048 else 5
    row = {
        "bf16_us": time_us(lambda: F.linear(x, w), repeats),
        "rowwise_us": time_us(lambda: rowwise(False), repeats),
        "rowwise_fast_us": time_us(lambda: rowwise(True), repeats),
        "tensorwise_fast_us": time_us(tensorwise, repeats),
        "scales_after_us": time_us(scales_after, repeats),
        "quantize_us": time_us(lambda: fp8.quantize_rows(x), repeats),
    }
    if rows <= 512:  # the float64 reference of larger products costs more than it tells
        ref = (xq.double() * xs.double()[:, None]) @ (wq.double() * ws.double()[:, None]).t()
        ref_t = (xq_t.double() * xt.double()) @ (wq_t.double() * wt.double()).t()
        row.update(rowwise_error=relative(rowwise(False), ref), rowwise_fast_error=relative(rowwise(True), ref),
                   tensorwise_fast_error=relative(tensorwise(), ref_t), scales_after_error=relative(scales_after(), ref))
    return row


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rows", default="16,64,128,256,384,512,16384")
    parser.add_argument("--shapes", default="8B")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    results: dict[str, dict] = {}
    for shape in args.shapes.split(","):
        for rows in map(int, args.rows.split(",")):
            for layer, (n, k) in LAYERS[shape].items():
                row = bench(rows, n, k)
                results[f"{shape} {layer} rows={rows}"] = row
                print(f"{shape:4} {layer:8} rows={rows:6d} " + " ".join(
                    f"{key}={val:.4g}" for key, val in row.items()), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": torch.cuda.get_device_name(), "results": results},
                                              indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
