"""Offline throughput benchmark: tpinfer against HF transformers and the roofline, in one run.

    python scripts/bench_offline.py --config configs/bench/llama-3.2-1b.yaml [key=value ...] [--out DIR]

The roofline sums max(bytes / bandwidth, flops / peak) over the executed steps, with limits measured in the run.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.state import get_tp  # noqa: E402
from runtime.config import to_yaml  # noqa: E402
from scripts.bench_config import BenchConfig, load_bench_config  # noqa: E402
from scripts.bench_runs import batch1_step_time, measure_limits, profile_decode, run_hf, run_tpinfer  # noqa: E402

RUNS = {
    # name: (config changes, fixed-output workload)
    "tpinfer": ({}, False),
    "tpinfer_no_graphs": ({"engine__cuda_graph_max_bs": 0}, False),
    "tpinfer_eager_prefill": ({"engine__cuda_graph_prefill_tokens": 0}, False),
    "tpinfer_no_overlap": ({"scheduler__overlap": False}, False),
    "tpinfer_nccl": ({"parallel__all_reduce": "nccl"}, False),  # TP > 1: every all-reduce through NCCL
    "tpinfer_fixed": ({}, True),
    "tpinfer_deterministic": ({"engine__deterministic": True}, False),
    "tpinfer_seeded": ({"bench__seeded": True}, False),
    "tpinfer_penalties": ({"bench__penalties": True}, False),
    "tpinfer_n8": ({"bench__n": 8, "bench__num_requests": 32, "bench__temperature": 1.0}, False),
    "tpinfer_logprobs5": ({"bench__logprobs": 5}, False),
    "shared_prefix_radix": ({"cache__type": "radix"}, "shared"),
    "shared_prefix_naive": ({"cache__type": "naive"}, "shared"),
}


TP_RUNS = ("tpinfer", "tpinfer_nccl", "tpinfer_no_graphs", "tpinfer_no_overlap", "tpinfer_fixed", "decode_profile")


def run_one(name: str, args: argparse.Namespace) -> dict | None:
    """One measurement, in this process (rank 0 of a torchrun job when TP > 1; other ranks return None)."""

    def variant(**changes: object) -> BenchConfig:
        cfg = load_bench_config(args.config, args.overrides)
        for key, value in changes.items():
            section, attr = key.split("__")
            setattr(getattr(cfg, section), attr, value)
        return cfg

    if name == "limits":
        return measure_limits(torch.device("cuda"))
    if name in ("batch1_decode", "batch1_decode_unfused", "batch1_decode_flashinfer", "batch1_decode_deterministic"):
        fused = {"engine__fused_gemv": "never"} if name == "batch1_decode_unfused" else {}
        if name == "batch1_decode_deterministic":
            fused = {"engine__deterministic": True}
        if name == "batch1_decode_flashinfer":
            from runtime.engine.attention import flashinfer_backend

            flashinfer_backend.PAGED_DECODE_MIN_BATCH = 2
        graph_s, steady_s, weight_bytes = batch1_step_time(variant(**fused), True)
        eager_s, _, _ = batch1_step_time(variant(**fused), False)
        row = {"graph_step_ms": graph_s * 1e3, "graph_steady_step_ms": steady_s * 1e3, "eager_step_ms": eager_s * 1e3,
               "speedup": eager_s / graph_s}
        limits = json.loads(args.limits)
        if limits:  # the floor: reading every weight once
            floor_s = weight_bytes / (limits["hbm_gbps"] * 1e9)
            row.update(weight_read_floor_ms=floor_s * 1e3, graph_step_over_floor=graph_s / floor_s,
                       graph_steady_step_over_floor=steady_s / floor_s)
        return row
    if name in ("hf_continuous", "hf_static"):
        return run_hf(variant(), name)
    changes, fixed = RUNS.get(name, ({}, False))
    cfg = variant(**changes)
    if get_tp().rank != 0:
        from runtime.worker import run_worker

        run_worker(cfg)
        return None
    if name == "decode_profile":
        return profile_decode(cfg)
    return run_tpinfer(cfg, fixed, json.loads(args.limits))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--name", default=None, help="results file stem (default: the config's stem)")
    parser.add_argument("--runs", default=None, help="comma-separated subset of runs (default: from bench config)")
    parser.add_argument("--tp", default="1",
                        help="comma-separated TP sizes; TP > 1 runs each measurement under torchrun")
    parser.add_argument("--tp-runs", default="tpinfer,tpinfer_nccl,decode_profile",
                        help="runs repeated at each TP size > 1")
    parser.add_argument("--patch", action="append", default=[], metavar="MODULE.NAME=VALUE",
                        help="set a module constant (a Python literal) in every measured process, e.g. "
                             "models.gemv.TUNED_TILES={}")
    parser.add_argument("--warm-up", action=argparse.BooleanOptionalAction, default=True,
                        help="one untimed pass of the first engine run, so a fresh machine's one-time costs stay out")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--limits", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    return parser.parse_args(argv)


def plan_runs(base: BenchConfig, args: argparse.Namespace) -> list[str]:
    """The TP=1 runs: tpinfer, the configured ablations and peers, or ``--runs`` verbatim."""
    plan = ["tpinfer"]
    plan += [f"tpinfer_{a}" for a in base.bench.ablations if f"tpinfer_{a}" in RUNS]
    plan += ["batch1_decode"] if "batch1" in base.bench.ablations else []
    plan += ["shared_prefix_radix", "shared_prefix_naive"] if "shared_prefix" in base.bench.ablations else []
    plan += ["tpinfer_fixed", *base.bench.peers] if base.bench.peers else []
    if args.runs:
        plan = args.runs.split(",")
    return plan


def measure(args: argparse.Namespace, run: str, limits: dict | None = None, tp: int = 1) -> dict:
    # A fresh process per measurement: no allocator state or CUDA graphs carried between runs.
    launcher = [sys.executable]
    if tp > 1:
        # Our option is --measure, not --run: torchrun's parser would take "--run" for its "--run-path".
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)]
    cmd = [*launcher, __file__, "--measure", run, "--limits", json.dumps(limits or {})]
    cmd += [x for patch in args.patch for x in ("--patch", patch)]
    cmd += [x for c in args.config for x in ("--config", c)] + args.overrides
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-3:]
        return {"error": tail, "returncode": proc.returncode}
    return json.loads(lines[-1][len("RESULT "):])


def warm_up(args: argparse.Namespace, runs: list[str], limits: dict, tp: int = 1) -> dict | None:
    """One untimed pass of the first engine run among ``runs``: a fresh machine's first engine process at a TP size
    pays one-time costs inside its timed region (most likely Triton kernels compiled into the disk cache for shapes
    the in-process warm-up does not reach), which later processes skip. Its result is kept apart, so that cost
    stays visible."""
    first = next((run for run in runs if not run.startswith("hf_")), None)
    if first is None or not args.warm_up:
        return None
    result = measure(args, first, limits, tp)
    key = first if tp == 1 else f"{first}@tp{tp}"
    print(f"warm-up ({key}, not counted) {json.dumps(result)}", flush=True)
    return {"run": key, **{k: result[k] for k in ("output_tok_s", "seconds", "error") if k in result}}


def measure_all(args: argparse.Namespace, plan: list[str], limits: dict, results: dict) -> None:
    """The plan at TP=1, then ``--tp-runs`` at each TP size > 1 (keys ``RUN@tpN``), each after its warm-up pass;
    each printed as it lands."""
    runs, warm = results["runs"], results["warm_up"]
    if passed := warm_up(args, plan, limits):
        warm.append(passed)
    for run in plan:
        runs[run] = measure(args, run, limits)
        print(run, json.dumps(runs[run]), flush=True)
    for tp in [int(t) for t in args.tp.split(",") if int(t) > 1]:
        if passed := warm_up(args, args.tp_runs.split(","), limits, tp):
            warm.append(passed)
        for run in args.tp_runs.split(","):
            key = f"{run}@tp{tp}"
            runs[key] = measure(args, run, limits, tp)
            print(key, json.dumps(runs[key]), flush=True)


def main() -> int:
    args = parse_args()
    if args.measure:
        return run_in_this_process(args)
    base = load_bench_config(args.config, args.overrides)
    name = args.name or Path(args.config[-1]).stem
    results: dict = {"name": name, "command": " ".join(sys.argv), "config": to_yaml(base), "warm_up": [], "runs": {}}
    limits = measure(args, "limits")
    results["limits"] = limits
    print(f"limits: {limits}", flush=True)
    measure_all(args, plan_runs(base, args), limits, results)
    add_scaling(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{name}.json").write_text(json.dumps(results, indent=2))
    print_table(results)
    failed = [k for k, v in results["runs"].items() if "error" in v]
    if failed:
        print(f"failed runs: {failed}", file=sys.stderr)
        return 1
    return 0


def run_in_this_process(args: argparse.Namespace) -> int:
    """``--measure NAME``: one measurement; under torchrun every rank joins, rank 0 prints the result."""
    distributed = "TORCHELASTIC_RUN_ID" in os.environ
    if distributed:
        from parallel.distributed import init_distributed

        init_distributed(use_cuda=True, timeout_s=600)
    for patch in args.patch:
        apply_patch(patch)
    result = run_one(args.measure, args)
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)
    if distributed:
        from parallel.distributed import shutdown_distributed

        shutdown_distributed()
    return 0


def apply_patch(patch: str) -> None:
    """``MODULE.NAME=VALUE``: set an existing module constant to a Python literal."""
    target, _, value = patch.partition("=")
    module_name, _, attr = target.rpartition(".")
    module = importlib.import_module(module_name)
    if not value or not hasattr(module, attr):
        raise SystemExit(f"--patch {patch!r}: expected MODULE.NAME=VALUE naming an existing constant")
    setattr(module, attr, ast.literal_eval(value))


def add_scaling(results: dict) -> None:
    runs = results["runs"]
    scaling = {}
    for key, row in runs.items():
        if "@tp" not in key or "output_tok_s" not in row:
            continue
        run, tp = key.split("@tp")
        base = runs.get(run if run != "tpinfer_nccl" else "tpinfer", {}).get("output_tok_s")
        if base:
            speedup = row["output_tok_s"] / base
            scaling[key] = {"speedup": speedup, "efficiency": speedup / int(tp)}
    results["scaling"] = scaling


def print_table(results: dict) -> None:
    runs = results["runs"]
    ref = runs.get("tpinfer", {}).get("output_tok_s") or next(
        (r["output_tok_s"] for r in runs.values() if "output_tok_s" in r), 1.0)
    print(f"\n{results['name']}: output tokens/s")
    print(f"{'run':<22}{'tok/s':>10}{'relative':>12}{'roofline':>10}{'idle':>8}")
    for key, row in runs.items():
        if "output_tok_s" not in row:
            continue
        share = row.get("roofline_share")
        idle = row.get("decode_idle_share")
        print(f"{key:<22}{row['output_tok_s']:>10.0f}{row['output_tok_s'] / ref:>12.2f}"
              f"{'' if share is None else f'{share:.0%}':>10}{'' if idle is None else f'{idle:.1%}':>8}")
    for key, row in results.get("scaling", {}).items():
        print(f"{key}: {row['speedup']:.2f}x over TP=1 ({row['efficiency']:.0%} efficiency)")
    for key, row in runs.items():
        if "all_reduce_share" in row:
            print(f"{key}: all-reduce {row['all_reduce_share']:.1%} of GPU kernel time in decode "
                  f"({row['all_reduce_ms_per_step']:.2f} ms of {row['kernel_ms_per_step']:.2f} ms per step)")
    fixed, static, cb = runs.get("tpinfer_fixed"), runs.get("hf_static"), runs.get("hf_continuous")
    for peer_name, peer in (("HF static generate", static), ("HF generate_batch", cb)):
        if fixed and peer and "output_tok_s" in peer:
            print(f"fixed-512 variant: tpinfer / {peer_name} = {fixed['output_tok_s'] / peer['output_tok_s']:.1f}x")


if __name__ == "__main__":
    sys.exit(main())
