"""Offline throughput benchmark: tpinfer against HF transformers and the roofline, in one run.

    python scripts/bench_offline.py --config configs/bench/llama-3.2-1b.yaml [key=value ...] [--out DIR]

Workload (config section `bench`): N requests of random token ids, uniform input
and output lengths, sampling at the configured temperature, ignore_eos. Runs:
tpinfer on the variable workload (+ ablations), tpinfer and the HF peers on the
fixed-output variant. The roofline is measured in the same run: HBM bandwidth
from a large device copy, bf16 matmul peak from a large GEMM; for the steps the
engine actually executed, roofline time = sum over steps of
max(bytes / bandwidth, flops / peak), bytes = weights + KV read + KV written.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.state import get_tp  # noqa: E402
from runtime.config import RuntimeConfig, load_config, to_yaml  # noqa: E402


@dataclass
class StepLog:
    """What each executed step moved and computed, for the roofline."""

    tokens: list[int] = field(default_factory=list)
    kv_read: list[int] = field(default_factory=list)  # sum of kv lengths (tokens) attended
    attn_pairs: list[int] = field(default_factory=list)  # sum of q_len * kv_len
    decode: list[bool] = field(default_factory=list)

    def __call__(self, batch) -> None:  # noqa: ANN001
        if batch is None:
            return
        ext, kv = batch.ext_lens.astype(np.int64), batch.kv_lens.astype(np.int64)
        self.tokens.append(int(ext.sum()))
        self.kv_read.append(int(kv.sum()))
        self.attn_pairs.append(int((ext * (kv - (ext - 1) / 2)).sum()))
        self.decode.append(batch.is_decode)


def shared_prefix_workload(cfg: RuntimeConfig) -> tuple[list[list[int]], list[int]]:
    """Every request: one shared prefix, then its own distinct tokens."""
    b = cfg.bench
    rng = np.random.default_rng(b.seed + 1)
    prefix = rng.integers(0, b.token_id_limit, b.shared_prefix_len).tolist()
    tails = rng.integers(b.distinct_len[0], b.distinct_len[1] + 1, b.num_requests)
    prompts = [prefix + rng.integers(0, b.token_id_limit, int(k)).tolist() for k in tails]
    return prompts, [b.shared_output_len] * b.num_requests


def workload(cfg: RuntimeConfig, fixed: bool | str, n: int | None = None) -> tuple[list[list[int]], list[int]]:
    if fixed == "shared":
        return shared_prefix_workload(cfg)
    b = cfg.bench
    rng = np.random.default_rng(b.seed)
    count = b.num_requests
    in_lens = rng.integers(b.input_len[0], b.input_len[1] + 1, count)
    out_lens = rng.integers(b.output_len[0], b.output_len[1] + 1, count)
    prompts = [rng.integers(0, b.token_id_limit, int(k)).tolist() for k in in_lens]
    outs = [b.fixed_output_len] * count if fixed else out_lens.tolist()
    n = n or count
    return prompts[:n], outs[:n]


def measure_limits(device: torch.device) -> dict[str, float]:
    """HBM bandwidth (GB/s, read+write of a 4 GiB copy) and bf16 matmul peak (TFLOP/s)."""
    src = torch.empty(1 << 31, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 20
    for _ in range(reps):
        dst.copy_(src)
    torch.cuda.synchronize()
    bandwidth = 2 * src.numel() * 2 * reps / (time.perf_counter() - start)
    del src, dst
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    bm = torch.randn(8192, 8192, dtype=torch.bfloat16, device=device)
    for _ in range(3):
        a @ bm
    torch.cuda.synchronize()
    start, reps = time.perf_counter(), 50
    for _ in range(reps):
        a @ bm
    torch.cuda.synchronize()
    peak = 2 * 8192**3 * reps / (time.perf_counter() - start)
    return {"hbm_gbps": bandwidth / 1e9, "bf16_tflops": peak / 1e12}


def roofline_seconds(llm, log: StepLog, limits: dict[str, float]) -> float:  # noqa: ANN001
    mc = llm.model_config
    model = llm.engine.model
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    matmul_params = sum(p.numel() for n, p in model.named_parameters() if "norm" not in n and "embed" not in n)
    if mc.tie_word_embeddings:
        matmul_params += model.lm_head.weight.numel()
    kv_token_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * llm.engine.dtype.itemsize
    bw, peak = limits["hbm_gbps"] * 1e9, limits["bf16_tflops"] * 1e12
    total = 0.0
    for tokens, kv_read, pairs in zip(log.tokens, log.kv_read, log.attn_pairs):
        bytes_moved = weight_bytes + kv_read * kv_token_bytes + tokens * kv_token_bytes
        flops = 2 * matmul_params * tokens + 4 * mc.num_layers * mc.num_heads * mc.head_dim * pairs
        total += max(bytes_moved / bw, flops / peak)
    return total


class StepTimer:
    """CUDA events around each forward on the engine stream: GPU busy time and idle gaps between decode steps."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine = engine
        self.events: list[tuple[torch.cuda.Event, torch.cuda.Event, bool]] = []
        self._inner = engine.forward_batch
        engine.forward_batch = self._timed

    def _timed(self, batch):  # noqa: ANN001, ANN202
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(self.engine.stream)
        out = self._inner(batch)
        end.record(self.engine.stream)
        self.events.append((start, end, batch.is_decode))
        return out

    def summary(self) -> dict[str, float]:
        torch.cuda.synchronize()
        busy = idle = 0.0
        for (s0, e0, d0), (s1, _, d1) in zip(self.events, self.events[1:]):
            if d0 and d1:
                busy += s0.elapsed_time(e0)
                idle += max(e0.elapsed_time(s1), 0.0)
        return {"decode_idle_share": idle / max(busy + idle, 1e-9), "decode_busy_ms": busy, "decode_idle_ms": idle}


def run_tpinfer(cfg: RuntimeConfig, fixed: bool | str, limits: dict[str, float] | None) -> dict:
    from runtime import LLM, SamplingParams

    llm = LLM(config=cfg)
    prompts, outs = workload(cfg, fixed)
    params = [SamplingParams(temperature=cfg.bench.temperature, max_new_tokens=n, ignore_eos=True) for n in outs]
    # Warm-up on a few requests: kernel loads and allocator growth are not part of the measurement.
    # Shifted ids: the warm-up must not seed the prefix cache with the measured prompts.
    warm = [[(t + 1) % cfg.bench.token_id_limit for t in p] for p in prompts[:8]]
    llm.generate(warm, [SamplingParams(temperature=cfg.bench.temperature, max_new_tokens=16, ignore_eos=True)] * 8)
    log = StepLog()
    timer = StepTimer(llm.engine) if llm.engine.stream is not None else None
    warm_prefill, warm_cached = llm.scheduler.stats.prefill_tokens, llm.scheduler.stats.cached_tokens
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.run([(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))], on_batch=log)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert all(r.error is None and r.completion_tokens == n for r, n in zip(results, outs)), "benchmark requests failed"
    generated = sum(outs)
    stats = llm.scheduler.stats
    row = {
        "prefill_tokens_computed": stats.prefill_tokens - warm_prefill, "cached_tokens": stats.cached_tokens - warm_cached,
        "cache": cfg.cache.type,
        "seconds": seconds, "output_tokens": generated, "output_tok_s": generated / seconds,
        "total_tok_s": (generated + sum(map(len, prompts))) / seconds,
        "steps": len(log.tokens), "decode_steps": int(sum(log.decode)), "kv_pages": llm.engine.num_pages,
        "graphs": llm.engine.graph_runner is not None, "overlap": cfg.scheduler.overlap,
    }
    if limits:
        roof = roofline_seconds(llm, log, limits)
        row.update(roofline_s=roof, roofline_share=roof / seconds)
    if timer:
        row.update(timer.summary())
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return row


def batch1_step_time(cfg: RuntimeConfig, graphs: bool) -> float:
    """Seconds per decode step of a single request (graph replay versus eager)."""
    from runtime import LLM, SamplingParams

    cfg.engine.cuda_graph_max_bs = 8 if graphs else 0
    llm = LLM(config=cfg)
    params = SamplingParams(temperature=0, max_new_tokens=256, ignore_eos=True)
    llm.generate([[1, 2, 3, 4]], params)
    log = StepLog()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.run([(0, [5, 6, 7, 8], params)], on_batch=log)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / max(sum(log.decode), 1)
    llm.shutdown()
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return seconds


def run_hf(cfg: RuntimeConfig, mode: str) -> dict:
    """HF transformers on the same random weights (built by our loader, shared by reference)."""
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from models.default_model import resolve_model_path
    from models.loader import to_hf_state_dict
    from runtime import LLM

    owner = LLM(config=cfg)  # creates the weights exactly as the tpinfer runs do
    model_dir = resolve_model_path(cfg.model.path)
    hf_cfg = LlamaConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = LlamaForCausalLM(hf_cfg)
    model.load_state_dict(to_hf_state_dict(owner.engine.model), strict=False, assign=True)
    if hf_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg).to("cuda")
    del owner.engine.kv_cache, owner.engine.graph_runner
    torch.cuda.empty_cache()
    model.eval()
    prompts, outs = workload(cfg, fixed=True, n=cfg.bench.peer_requests)
    new = cfg.bench.fixed_output_len
    gen_cfg = GenerationConfig(
        max_new_tokens=new, min_new_tokens=new, do_sample=True, temperature=cfg.bench.temperature, top_k=0, top_p=1.0,
        eos_token_id=None, pad_token_id=0,
    )
    with torch.no_grad():
        if mode == "hf_continuous":
            model.set_attn_implementation("paged|sdpa")
            model.generate_batch(inputs=prompts[:4], generation_config=gen_cfg, progress_bar=False)
            torch.cuda.synchronize()
            start = time.perf_counter()
            results = model.generate_batch(inputs=prompts, generation_config=gen_cfg, progress_bar=False)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            generated = sum(len(r.generated_tokens) for r in results.values())
        else:
            model.set_attn_implementation("sdpa")
            width = max(map(len, prompts))
            ids = torch.zeros(len(prompts), width, dtype=torch.long)
            mask = torch.zeros_like(ids)
            for i, p in enumerate(prompts):  # left padding
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            ids, mask = ids.cuda(), mask.cuda()
            model.generate(ids[:2], attention_mask=mask[:2], generation_config=gen_cfg)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, generation_config=gen_cfg)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            generated = (out.shape[1] - width) * len(prompts)
    del model, owner
    gc.collect()
    torch.cuda.empty_cache()
    return {"seconds": seconds, "output_tokens": generated, "output_tok_s": generated / seconds,
            "requests": len(prompts)}


RUNS = {
    # name: (config changes, fixed-output workload)
    "tpinfer": ({}, False),
    "tpinfer_no_graphs": ({"engine__cuda_graph_max_bs": 0}, False),
    "tpinfer_no_overlap": ({"scheduler__overlap": False}, False),
    "tpinfer_nccl": ({"parallel__all_reduce": "nccl"}, False),  # TP > 1: every all-reduce through NCCL
    "tpinfer_fixed": ({}, True),
    "shared_prefix_radix": ({"cache__type": "radix"}, "shared"),
    "shared_prefix_naive": ({"cache__type": "naive"}, "shared"),
}


TP_RUNS = ("tpinfer", "tpinfer_nccl", "tpinfer_no_graphs", "tpinfer_no_overlap", "tpinfer_fixed", "decode_profile")


def run_one(name: str, args: argparse.Namespace) -> dict | None:
    """One measurement, in this process (rank 0 of a torchrun job when TP > 1; other ranks return None)."""

    def variant(**changes: object) -> RuntimeConfig:
        cfg = load_config(args.config, args.overrides)
        for key, value in changes.items():
            section, attr = key.split("__")
            setattr(getattr(cfg, section), attr, value)
        return cfg

    if name == "limits":
        return measure_limits(torch.device("cuda"))
    if name == "batch1_decode":
        graph_s, eager_s = batch1_step_time(variant(), True), batch1_step_time(variant(), False)
        return {"graph_step_ms": graph_s * 1e3, "eager_step_ms": eager_s * 1e3, "speedup": eager_s / graph_s}
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


COMM_KERNELS = re.compile(r"allreduce|all_reduce|allgather|all_gather|nccl", re.IGNORECASE)
ALL_REDUCE_KERNELS = re.compile(r"allreduce|all_reduce", re.IGNORECASE)


def profile_decode(cfg: RuntimeConfig) -> dict:
    """Share of GPU kernel time in collectives during steady decode (graphs on), from the torch profiler."""
    from runtime import LLM, SamplingParams

    llm = LLM(config=cfg)
    n, new = min(cfg.scheduler.max_running_requests, cfg.bench.num_requests), 64
    prompts, _ = workload(cfg, fixed=True, n=n)
    prompts = [p[:512] for p in prompts]
    temp = cfg.bench.temperature
    llm.generate(prompts[:8], SamplingParams(temperature=temp, max_new_tokens=16, ignore_eos=True))
    # Prefill outside the window: the radix cache keeps the prompts, so the profiled run is almost all decode.
    llm.generate(prompts, SamplingParams(temperature=temp, max_new_tokens=1, ignore_eos=True))
    log = StepLog()
    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    torch.cuda.synchronize()
    start = time.perf_counter()
    with torch.profiler.profile(activities=activities) as prof:
        llm.run([(i, p, SamplingParams(temperature=temp, max_new_tokens=new, ignore_eos=True))
                 for i, p in enumerate(prompts)], on_batch=log)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time for e in kernels)
    comm = sum(e.device_time for e in kernels if COMM_KERNELS.search(e.name))
    reduce = sum(e.device_time for e in kernels if ALL_REDUCE_KERNELS.search(e.name))
    top = {}
    for e in kernels:
        top[e.name[:80]] = top.get(e.name[:80], 0.0) + e.device_time
    llm.shutdown()
    steps = max(sum(log.decode), 1)
    return {
        "requests": n, "decode_steps": int(sum(log.decode)), "seconds": seconds, "step_ms": seconds * 1e3 / steps,
        "kernel_ms_per_step": total / 1e3 / steps, "all_reduce_share": reduce / max(total, 1e-9),
        "comm_share": comm / max(total, 1e-9), "all_reduce_ms_per_step": reduce / 1e3 / steps,
        "top_kernels_ms": {k: round(v / 1e3, 2) for k, v in sorted(top.items(), key=lambda kv: -kv[1])[:12]},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--out", default="benchmarks")
    parser.add_argument("--name", default=None, help="results file stem (default: the config's stem)")
    parser.add_argument("--runs", default=None, help="comma-separated subset of runs (default: from bench config)")
    parser.add_argument("--tp", default="1", help="comma-separated TP sizes; TP > 1 runs each measurement under torchrun")
    parser.add_argument("--tp-runs", default="tpinfer,tpinfer_nccl,decode_profile",
                        help="runs repeated at each TP size > 1")
    parser.add_argument("--measure", default=None, help=argparse.SUPPRESS)  # internal: one measurement
    parser.add_argument("--limits", default="{}", help=argparse.SUPPRESS)
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()
    if args.measure:
        return run_in_this_process(args)
    base = load_config(args.config, args.overrides)
    name = args.name or Path(args.config[-1]).stem
    results: dict = {"name": name, "command": " ".join(sys.argv), "config": to_yaml(base), "runs": {}}

    def measure(run: str, limits: dict | None = None, tp: int = 1) -> dict:
        # Each measurement in a fresh process (a torchrun job at TP > 1): no allocator state or
        # CUDA graphs carried between runs.
        launcher = [sys.executable]
        if tp > 1:
            launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(tp)]
        cmd = [*launcher, __file__, "--measure", run, "--limits", json.dumps(limits or {})]
        cmd += [x for c in args.config for x in ("--config", c)] + args.overrides
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            tail = [ln for ln in (proc.stderr or proc.stdout).strip().splitlines() if ln.strip()][-3:]
            return {"error": tail, "returncode": proc.returncode}
        return json.loads(lines[-1][len("RESULT "):])

    limits = measure("limits")
    results["limits"] = limits
    print(f"limits: {limits}", flush=True)
    plan = ["tpinfer"]
    plan += [f"tpinfer_{a}" for a in base.bench.ablations if f"tpinfer_{a}" in RUNS]
    plan += ["batch1_decode"] if "batch1" in base.bench.ablations else []
    plan += ["shared_prefix_radix", "shared_prefix_naive"] if "shared_prefix" in base.bench.ablations else []
    plan += ["tpinfer_fixed", *base.bench.peers] if base.bench.peers else []
    if args.runs:
        plan = args.runs.split(",")
    for run in plan:
        results["runs"][run] = measure(run, limits)
        print(run, json.dumps(results["runs"][run]), flush=True)
    for tp in [int(t) for t in args.tp.split(",") if int(t) > 1]:
        for run in args.tp_runs.split(","):
            key = f"{run}@tp{tp}"
            results["runs"][key] = measure(run, limits, tp)
            print(key, json.dumps(results["runs"][key]), flush=True)
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
    """``--measure NAME``: one measurement (not ``--run``: torchrun would take that for its ``--run-path``); under torchrun every rank joins, rank 0 prints the result."""
    distributed = "TORCHELASTIC_RUN_ID" in os.environ
    if distributed:
        from parallel.distributed import init_distributed

        init_distributed(use_cuda=True, timeout_s=600)
    result = run_one(args.measure, args)
    if result is not None:
        print("RESULT " + json.dumps(result), flush=True)
    if distributed:
        from parallel.distributed import shutdown_distributed

        shutdown_distributed()
    return 0


def add_scaling(results: dict) -> None:
    """Speed-up and efficiency of each TP size over TP=1, per run."""
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
