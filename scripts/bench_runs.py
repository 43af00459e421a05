"""The offline benchmark's measurements; scripts/bench_offline.py runs each in a process of its own."""

from __future__ import annotations

import gc
import re
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from scripts.bench_config import BenchConfig


@dataclass
class StepLog:
    """What each executed step moved and computed, for the roofline."""

    tokens: list[int] = field(default_factory=list)
    kv_read: list[int] = field(default_factory=list)  # sum of kv lengths (tokens) attended
    attn_pairs: list[int] = field(default_factory=list)  # sum of q_len * kv_len
    decode: list[bool] = field(default_factory=list)
    scheduled_at: list[float] = field(default_factory=list)

    def __call__(self, batch) -> None:  # noqa: ANN001
        if batch is None:
            return
        self.scheduled_at.append(time.perf_counter())
        ext, kv = batch.ext_lens.astype(np.int64), batch.kv_lens.astype(np.int64)
        self.tokens.append(int(ext.sum()))
        self.kv_read.append(int(kv.sum()))
        self.attn_pairs.append(int((ext * (kv - (ext - 1) / 2)).sum()))
        self.decode.append(batch.is_decode)


def shared_prefix_workload(cfg: BenchConfig) -> tuple[list[list[int]], list[int]]:
    """Every request: one shared prefix, then its own distinct tokens."""
    b = cfg.bench
    rng = np.random.default_rng(b.seed + 1)
    prefix = rng.integers(0, b.token_id_limit, b.shared_prefix_len).tolist()
    tails = rng.integers(b.distinct_len[0], b.distinct_len[1] + 1, b.num_requests)
    prompts = [prefix + rng.integers(0, b.token_id_limit, int(k)).tolist() for k in tails]
    return prompts, [b.shared_output_len] * b.num_requests


def workload(cfg: BenchConfig, fixed: bool | str, n: int | None = None) -> tuple[list[list[int]], list[int]]:
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
    """HBM bandwidth (GB/s) from a large copy; bf16 and, where the GPU has it, FP8 matmul peaks (TFLOP/s)."""
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
    limits = {"hbm_gbps": bandwidth / 1e9, "bf16_tflops": _matmul_tflops(lambda: a @ bm)}
    if torch.cuda.get_device_capability(device) >= (8, 9):
        from models import fp8

        (qa, sa), (qb, sb) = fp8.quantize_rows(a), fp8.quantize_rows(bm)
        limits["fp8_tflops"] = _matmul_tflops(lambda: torch._scaled_mm(
            qa, qb.t(), scale_a=sa[:, None], scale_b=sb[None, :], out_dtype=torch.bfloat16))
    return limits


def _matmul_tflops(matmul, n: int = 8192, reps: int = 50) -> float:  # noqa: ANN001 - an n x n x n product
    for _ in range(3):
        matmul()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        matmul()
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


class TouchedExperts:
    """The distinct experts each forward used, summed over the sparse layers: models/moe.py counts them on the
    device, and a snapshot after each forward (on the engine stream, no host wait) turns totals into steps."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.engine = engine
        self.counters = [m.touched for m in engine.model.modules() if getattr(m, "touched", None) is not None]
        self.snapshots = [self._total()]
        self._inner = engine.forward_batch
        engine.forward_batch = self._counted

    def _total(self) -> torch.Tensor:
        with torch.cuda.stream(self.engine.stream):
            return torch.stack(self.counters).sum()

    def _counted(self, batch):  # noqa: ANN001, ANN202
        out = self._inner(batch)
        self.snapshots.append(self._total())
        return out

    def per_step(self) -> list[int]:
        totals = torch.stack(self.snapshots).tolist()
        return [b - a for a, b in zip(totals, totals[1:])]


def expert_bytes(model) -> tuple[int, int]:  # noqa: ANN001
    """(bytes of every expert of every layer, bytes of one expert summed over the sparse layers), as stored."""
    stacks = [p for n, p in model.named_parameters() if ".experts." in n]
    return sum(p.numel() * p.element_size() for p in stacks), sum(p[0].numel() * p.element_size() for p in stacks)


def roofline_seconds(llm, log: StepLog, limits: dict[str, float], touched: list[int] | None = None) -> float:  # noqa: ANN001
    """With ``touched`` (distinct experts per step, summed over layers), a step reads only those experts' weights.
    Bytes come from the tensors as stored (FP8 weights: one byte, and their scales); FP8 weights' matmuls run
    at the FP8 peak (their inputs are quantised too)."""
    mc = llm.model_config
    model = llm.engine.model
    all_experts, one_expert = expert_bytes(model)
    dense_bytes = llm.engine.weight_bytes - all_experts
    one_expert_one_layer = one_expert // max(len(mc.sparse_layers), 1)
    bf16_peak = limits["bf16_tflops"] * 1e12

    def flop_seconds(p: torch.Tensor, params: int) -> float:  # a matmul reading p's weights
        return 2 * params / (limits["fp8_tflops"] * 1e12 if p.element_size() == 1 else bf16_peak)

    matmul_s_per_token = 0.0
    for n, p in model.named_parameters():
        if not any(skip in n for skip in ("norm", "embed", "scale")):
            if ".experts." in n:  # a token runs its top-k experts only
                matmul_s_per_token += flop_seconds(p, mc.experts_per_token * p[0].numel())
            else:
                matmul_s_per_token += flop_seconds(p, p.numel())
    if mc.tie_word_embeddings:
        matmul_s_per_token += flop_seconds(model.lm_head.weight, model.lm_head.weight.numel())
    kv_token_bytes = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * llm.engine.kv_cache.buffer.element_size()
    bw = limits["hbm_gbps"] * 1e9
    touched = touched or [mc.num_experts * len(mc.sparse_layers)] * len(log.tokens)
    total = 0.0
    for tokens, kv_read, pairs, experts in zip(log.tokens, log.kv_read, log.attn_pairs, touched):
        bytes_moved = dense_bytes + experts * one_expert_one_layer + kv_read * kv_token_bytes + tokens * kv_token_bytes
        compute_s = matmul_s_per_token * tokens + 4 * mc.num_layers * mc.num_heads * mc.head_dim * pairs / bf16_peak
        total += max(bytes_moved / bw, compute_s)
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
        if not self.events:
            return decode_idle([])
        origin = self.events[0][0]
        return decode_idle([(origin.elapsed_time(s), origin.elapsed_time(e), d) for s, e, d in self.events])


def decode_idle(steps: list[tuple[float, float, bool]]) -> dict[str, float]:
    """Busy time and idle gaps between consecutive decode steps, clamped so steps timed out of order still fit."""
    busy = idle = 0.0
    for (s0, e0, d0), (s1, _, d1) in zip(steps, steps[1:]):
        if d0 and d1:
            busy += max(e0 - s0, 0.0)
            idle += max(s1 - e0, 0.0)
    share = idle / (busy + idle) if busy + idle > 0 else 0.0
    return {"decode_idle_share": share, "decode_busy_ms": busy, "decode_idle_ms": idle}


# What the penalties run sets on every request: each logit adjustment the sampler has, at typical values.
PENALTIES = {"min_p": 0.05, "presence_penalty": 0.5, "frequency_penalty": 0.5, "repetition_penalty": 1.1}


def run_tpinfer(cfg: BenchConfig, fixed: bool | str, limits: dict[str, float] | None) -> dict:
    from models import moe
    from runtime import LLM, SamplingParams

    moe.COUNT_TOUCHED_EXPERTS = True  # read only by sparse models
    llm = LLM(config=cfg)
    prompts, outs = workload(cfg, fixed)
    b = cfg.bench
    adjust = PENALTIES if b.penalties else {}
    params = [SamplingParams(temperature=b.temperature, max_new_tokens=n, ignore_eos=True, n=b.n, logprobs=b.logprobs,
                             seed=i if b.seeded else None, **adjust) for i, n in enumerate(outs)]
    # Warm-up (kernel loads, allocator growth); shifted ids, so it does not seed the prefix cache.
    warm = [[(t + 1) % cfg.bench.token_id_limit for t in p] for p in prompts[:8]]
    llm.generate(warm, [SamplingParams(temperature=cfg.bench.temperature, max_new_tokens=16, ignore_eos=True)] * 8)
    log = StepLog()
    timer = StepTimer(llm.engine) if llm.engine.stream is not None else None
    experts = TouchedExperts(llm.engine) if llm.model_config.is_moe else None
    warm_prefill, warm_cached = llm.scheduler.stats.prefill_tokens, llm.scheduler.stats.cached_tokens
    torch.cuda.synchronize()
    start = time.perf_counter()
    results = llm.run([(i, p, sp) for i, (p, sp) in enumerate(zip(prompts, params))], on_batch=log)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    assert all(r.error is None and [(s.completion_tokens, len(s.logprobs or [0] * n)) for s in r.outputs] == [(n, n)]
               * b.n for r, n in zip(results, outs)), "benchmark requests failed"
    generated = sum(outs) * b.n
    stats = llm.scheduler.stats
    row = {
        "prefill_tokens_computed": stats.prefill_tokens - warm_prefill,
        "prompt_tokens_times_n": sum(map(len, prompts)) * b.n, "n": b.n, "logprobs": b.logprobs,
        "cached_tokens": stats.cached_tokens - warm_cached,
        "cache": cfg.cache.type,
        "seconds": seconds, "output_tokens": generated, "output_tok_s": generated / seconds,
        "total_tok_s": (generated + sum(map(len, prompts))) / seconds,
        "steps": len(log.tokens), "decode_steps": int(sum(log.decode)), "kv_pages": llm.engine.num_pages,
        "graphs": llm.engine.graph_runner is not None, "overlap": cfg.scheduler.overlap,
    }
    touched = experts.per_step() if experts else None
    if touched:
        layers = len(llm.model_config.sparse_layers)
        decode = [t / layers for t, d in zip(touched, log.decode) if d]
        row.update(experts_touched_per_layer_step=sum(touched) / layers / len(touched),
                   experts_touched_per_layer_decode_step=sum(decode) / max(len(decode), 1))
    if limits:
        roof = roofline_seconds(llm, log, limits, touched)
        row.update(roofline_s=roof, roofline_share=roof / seconds)
    if timer:
        row.update(timer.summary())
    release(llm)
    return row


def release(llm) -> None:  # noqa: ANN001 - runtime.LLM
    """Give the GPU back before the next measurement, though the caller still holds ``llm``."""
    llm.shutdown()
    llm.__dict__.clear()
    gc.collect()
    torch.cuda.empty_cache()


def batch1_step_time(cfg: BenchConfig, graphs: bool) -> tuple[float, float, int]:
    """Seconds per decode step of one request (whole run, steady state) and the weight bytes a step reads."""
    from runtime import LLM, SamplingParams

    cfg.engine.cuda_graph_max_bs = 8 if graphs else 0
    llm = LLM(config=cfg)
    params = SamplingParams(temperature=0, max_new_tokens=256, ignore_eos=True)
    context, limit = cfg.bench.batch1_context, cfg.bench.token_id_limit
    llm.generate([[(1 + i) % limit for i in range(context)]], params)
    log = StepLog()
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.run([(0, [(5 + i) % limit for i in range(context)], params)], on_batch=log)
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / max(sum(log.decode), 1)
    decode_at = [t for t, decode in zip(log.scheduled_at, log.decode) if decode]
    steady = float(np.median(np.diff(decode_at))) if len(decode_at) > 1 else seconds
    weight_bytes = llm.engine.weight_bytes
    release(llm)
    return seconds, steady, weight_bytes


def run_hf(cfg: BenchConfig, mode: str) -> dict:
    """HF transformers on the same random weights (built by our loader, shared by reference)."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    from models.weights.default_model import resolve_model_path
    from models.weights.loader import to_hf_state_dict
    from runtime import LLM

    owner = LLM(config=cfg)
    model_dir = resolve_model_path(cfg.model.path)
    hf_cfg = AutoConfig.from_pretrained(str(model_dir))
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_cfg)
    keys = model.load_state_dict(to_hf_state_dict(owner.engine.model, stacked_experts=True), strict=False,
                                 assign=True)
    missing = [k for k in keys.missing_keys if not (hf_cfg.tie_word_embeddings and k == "lm_head.weight")]
    if missing or keys.unexpected_keys:  # the peer must be the same model, not a silently partial one
        raise RuntimeError(f"HF peer does not match our weights: missing {missing}, unexpected {keys.unexpected_keys}")
    if hf_cfg.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    model.model.rotary_emb = type(model.model.rotary_emb)(hf_cfg).to("cuda")
    del owner.engine.kv_cache, owner.engine.graph_runner
    torch.cuda.empty_cache()
    model.eval()
    prompts, outs = workload(cfg, fixed=True, n=cfg.bench.peer_requests)
    def generation(new: int) -> GenerationConfig:
        return GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=True,
                                temperature=cfg.bench.temperature, top_k=0, top_p=1.0, eos_token_id=None,
                                pad_token_id=0)

    gen_cfg, warm_cfg = generation(cfg.bench.fixed_output_len), generation(4)  # warm-up: kernels, not length
    with torch.no_grad():
        if mode == "hf_continuous":
            model.set_attn_implementation("paged|sdpa")
            model.generate_batch(inputs=prompts[:4], generation_config=warm_cfg, progress_bar=False)
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
            for i, p in enumerate(prompts):
                ids[i, width - len(p) :] = torch.tensor(p)
                mask[i, width - len(p) :] = 1
            ids, mask = ids.cuda(), mask.cuda()
            model.generate(ids[:2], attention_mask=mask[:2], generation_config=warm_cfg)
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


COMM_KERNELS = re.compile(r"allreduce|all_reduce|allgather|all_gather|nccl", re.IGNORECASE)
ALL_REDUCE_KERNELS = re.compile(r"allreduce|all_reduce", re.IGNORECASE)


def profile_decode(cfg: BenchConfig) -> dict:
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
