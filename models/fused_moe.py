"""The mixture-of-experts MLP on the GPU in five Triton kernels and no host synchronisation, so decode steps
capture it in CUDA graphs: route (softmax, top-k, renormalise, and each (token, expert) pair's rank among its
expert's pairs), scan (each expert's padded start, the expert of every row block), scatter (pairs sorted by expert),
then two grouped GEMMs over those row blocks: gate/up with SiLU x up, and down with the router weight applied.

A pair's rank comes from an atomic counter, so pairs sit in their expert's blocks in any order; every output row is
computed alone (its own row of A, the expert's weights, K in fixed BLOCK_K steps), so results do not depend on it.
The top-k sum is a plain reduction over each token's pairs rather than atomic adds, so it is reproducible too.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from models import fp8

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs use models/moe.py's torch path
    triton = None

# K steps are the same at every batch size, so a token's output does not depend on what it is batched with (FP8
# experts: see block_k).
BLOCK_K = 64

if triton is not None:

    @triton.jit
    def _route(logits_ptr, weights_ptr, ids_ptr, ranks_ptr, counts_ptr, tokens,
               E: tl.constexpr, E_P2: tl.constexpr, TOP_K: tl.constexpr, K_P2: tl.constexpr,
               RENORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr):
        """Softmax over the experts in float32, the TOP_K largest (first index on ties), renormalised if asked."""
        rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        row_ok = rows < tokens
        cols = tl.arange(0, E_P2)
        logits = tl.load(logits_ptr + rows[:, None] * E + cols[None, :],
                         mask=row_ok[:, None] & (cols < E)[None, :], other=-float("inf")).to(tl.float32)
        logits = tl.where(row_ok[:, None], logits, 0.0)  # no NaN in the rows past the end
        probs = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        probs = probs / tl.sum(probs, axis=1)[:, None]
        slots = tl.arange(0, K_P2)
        chosen_w = tl.zeros((BLOCK_T, K_P2), dtype=tl.float32)
        chosen_id = tl.zeros((BLOCK_T, K_P2), dtype=tl.int32)
        for j in tl.static_range(TOP_K):
            best = tl.max(probs, axis=1)
            expert = tl.min(tl.where(probs == best[:, None], cols[None, :], E_P2), axis=1)
            # A NaN row (a NaN or +inf logit) equals no maximum: keep its ids in range; its weights are NaN, so its
            # output is NaN, as on the torch path, and no other token's is touched.
            expert = tl.minimum(expert, E - 1)
            chosen_w = tl.where(slots[None, :] == j, best[:, None], chosen_w)
            chosen_id = tl.where(slots[None, :] == j, expert[:, None], chosen_id)
            probs = tl.where(cols[None, :] == expert[:, None], -1.0, probs)
        if RENORMALIZE:
            chosen_w = chosen_w / tl.sum(chosen_w, axis=1)[:, None]
        pair = rows[:, None] * TOP_K + slots[None, :]
        pair_ok = row_ok[:, None] & (slots < TOP_K)[None, :]
        rank = tl.atomic_add(counts_ptr + chosen_id, 1, mask=pair_ok)
        tl.store(weights_ptr + pair, chosen_w, mask=pair_ok)
        tl.store(ids_ptr + pair, chosen_id, mask=pair_ok)
        tl.store(ranks_ptr + pair, rank, mask=pair_ok)

    @triton.jit
    def _scan(counts_ptr, starts_ptr, block_expert_ptr, total_ptr, sorted_ptr, touched_ptr, num_pairs, max_blocks,
              E: tl.constexpr, E_P2: tl.constexpr, BLOCK_M: tl.constexpr, CHUNK: tl.constexpr,
              COUNT_TOUCHED: tl.constexpr):
        """Each expert's rows padded to BLOCK_M: their start, the padding rows marked empty, each block's expert."""
        experts = tl.arange(0, E_P2)
        ok = experts < E
        counts = tl.load(counts_ptr + experts, mask=ok, other=0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        ends = tl.cumsum(padded, axis=0)
        starts = ends - padded
        tl.store(starts_ptr + experts, starts, mask=ok)
        tl.store(total_ptr, tl.sum(padded, axis=0))
        if COUNT_TOUCHED:
            tl.store(touched_ptr, tl.load(touched_ptr) + tl.sum((counts > 0).to(tl.int64), axis=0))
        pad = starts[:, None] + counts[:, None] + tl.arange(0, BLOCK_M)[None, :]
        tl.store(sorted_ptr + pad, num_pairs, mask=ok[:, None] & (pad < ends[:, None]))
        for first in range(0, max_blocks, CHUNK):
            blocks = first + tl.arange(0, CHUNK)
            # Ends are non-decreasing: a block belongs to the first expert whose rows end after it starts.
            before = (ends[None, :] <= (blocks * BLOCK_M)[:, None]) & ok[None, :]
            tl.store(block_expert_ptr + blocks, tl.sum(before.to(tl.int32), axis=1), mask=blocks < max_blocks)

    @triton.jit
    def _scatter(ids_ptr, ranks_ptr, starts_ptr, sorted_ptr, num_pairs, BLOCK: tl.constexpr):
        pairs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = pairs < num_pairs
        expert = tl.load(ids_ptr + pairs, mask=ok, other=0)
        dest = tl.load(starts_ptr + expert, mask=ok, other=0) + tl.load(ranks_ptr + pairs, mask=ok, other=0)
        tl.store(sorted_ptr + dest, pairs, mask=ok)

    @triton.jit
    def _expert_matmul(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, out_ptr, sorted_ptr, block_expert_ptr, total_ptr,
                       route_w_ptr, num_pairs, N, K, expert_stride, TOP_K: tl.constexpr, GATE_UP: tl.constexpr,
                       PRECISION: tl.constexpr, SCALED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
        """One BLOCK_M x BLOCK_N tile of one expert's rows: ``out[pair] = f(A[row] @ W[expert].T)``.

        GATE_UP: A is the tokens (a pair's row is its token), W holds N gate rows then N up rows, f is SiLU(gate) x up.
        Otherwise A is the pairs' activations and f scales by the pair's router weight. SCALED: A and W are e4m3,
        multiplied as they are by the tensor cores, and each product is scaled by its row's ``a_scale`` ([rows of
        A], float32) and its column's row of ``w_scale`` ([experts, rows of W], float32) before f."""
        pid = tl.program_id(0)
        tiles_n = tl.cdiv(N, BLOCK_N)
        block, tile = pid // tiles_n, pid % tiles_n
        if block * BLOCK_M >= tl.load(total_ptr):
            return
        expert = tl.load(block_expert_ptr + block).to(tl.int64)
        pairs = tl.load(sorted_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
        valid = pairs < num_pairs
        if GATE_UP:
            rows = pairs // TOP_K
        else:
            rows = pairs
        n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + rows[:, None].to(tl.int64) * K + kk[None, :]
        w_ptrs = w_ptr + expert * expert_stride + n[None, :].to(tl.int64) * K + kk[:, None]
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + kk) < K
            a = tl.load(a_ptrs, mask=valid[:, None] & k_ok[None, :], other=0.0)
            w_ok = k_ok[:, None] & n_ok[None, :]
            w = tl.load(w_ptrs, mask=w_ok, other=0.0)
            acc = tl.dot(a, w, acc, input_precision=PRECISION)
            if GATE_UP:
                w_up = tl.load(w_ptrs + N * K, mask=w_ok, other=0.0)
                up = tl.dot(a, w_up, up, input_precision=PRECISION)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        if SCALED:
            rows_of_w = (2 if GATE_UP else 1) * N
            scale_ptrs = w_scale_ptr + expert * rows_of_w + n
            acc = acc * tl.load(scale_ptrs, mask=n_ok, other=0.0)[None, :]
            a_scale = tl.load(a_scale_ptr + rows, mask=valid, other=0.0)[:, None]
            acc = acc * a_scale
            if GATE_UP:
                up = up * tl.load(scale_ptrs + N, mask=n_ok, other=0.0)[None, :] * a_scale
        if GATE_UP:
            acc = acc * tl.sigmoid(acc) * up
        else:
            acc = acc * tl.load(route_w_ptr + pairs, mask=valid, other=0.0)[:, None]
        out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * N + n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=valid[:, None] & n_ok[None, :])


def tile(num_pairs: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) from the mean pairs per expert (scripts/bench_moe.py --sweep): row blocks
    about twice the mean, as the router fills experts unevenly; wide tiles once the tensor cores bind."""
    per_expert = num_pairs / num_experts
    if per_expert <= 8:
        return 16, 32 if per_expert < 1 else 64, 4, 4
    if per_expert <= 24:
        return 32, 64, 4, 4
    if per_expert <= 48:
        return 64, 64, 4, 4
    return 128, 128, 8, 3


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def route(logits: torch.Tensor, top_k: int, renormalize: bool, block_m: int, touched: torch.Tensor | None = None,
          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Router weights [tokens * k] (float32), and the row layout for the grouped GEMMs: pair ids sorted by expert
    (each expert's rows padded to ``block_m`` with ``num_pairs``), each block's expert, the padded row count."""
    tokens, experts = logits.shape
    num_pairs = tokens * top_k
    device = logits.device
    weights = torch.empty(num_pairs, dtype=torch.float32, device=device)
    ids = torch.empty(num_pairs, dtype=torch.int32, device=device)
    ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
    counts = torch.zeros(experts, dtype=torch.int32, device=device)
    block_t = 16
    _route[(triton.cdiv(tokens, block_t),)](
        logits.contiguous(), weights, ids, ranks, counts, tokens, experts, _next_pow2(experts), top_k,
        _next_pow2(top_k), renormalize, block_t)
    max_rows = num_pairs + experts * (block_m - 1)
    max_blocks = triton.cdiv(max_rows, block_m)
    sorted_pairs = torch.empty(max_blocks * block_m, dtype=torch.int32, device=device)
    starts = torch.empty(experts, dtype=torch.int32, device=device)
    block_expert = torch.empty(max_blocks, dtype=torch.int32, device=device)
    total = torch.empty(1, dtype=torch.int32, device=device)
    _scan[(1,)](counts, starts, block_expert, total, sorted_pairs, touched if touched is not None else total,
                num_pairs, max_blocks, experts, _next_pow2(experts), block_m, 64, touched is not None)
    scatter_block = 256
    _scatter[(triton.cdiv(num_pairs, scatter_block),)](ids, ranks, starts, sorted_pairs, num_pairs, scatter_block)
    return weights, sorted_pairs, block_expert, total


def block_k(block_m: int, scaled: bool) -> int:
    """K step: BLOCK_K, and twice that for e4m3 at the wide tile, where it measured 1.2-1.28x faster (its loads
    are half bf16's bytes; scripts/bench_moe.py). A token's FP8 output may then differ in its last bits between a
    prefill and a decode batch."""
    return 2 * BLOCK_K if scaled and block_m >= 128 else BLOCK_K


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, top_k: int,
              renormalize: bool, touched: torch.Tensor | None = None, w13_scale: torch.Tensor | None = None,
              w2_scale: torch.Tensor | None = None,
              act_amax: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """``sum_k weight_k * down_k(SiLU(gate_k(x)) * up_k(x))`` over each token's top-k experts; ``w13`` is
    [experts, 2 * intermediate, hidden] (gate rows, then up rows), ``w2`` [experts, hidden, intermediate].
    ``touched`` (int64, one element), if given, gains the number of distinct experts this call used. With
    ``w13_scale`` [experts, 2 * intermediate] and ``w2_scale`` [experts, hidden] (float32), the weights are e4m3
    and each expert's weight is ``w * scale[:, None]``; the tokens and the SiLU x up rows are then quantised to
    e4m3 per row (fp8.quantize_rows), as the dense FP8 layers' inputs are; ``act_amax``, if given, is each SiLU x
    up row's largest magnitude over the whole row, where a rank holds a slice of the intermediate (TP)."""
    tokens, hidden = x.shape
    experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    num_pairs = tokens * top_k
    block_m, block_n, warps, stages = tile(num_pairs, experts)
    weights, sorted_pairs, block_expert, total = route(router_logits, top_k, renormalize, block_m, touched)
    max_blocks = block_expert.shape[0]
    precision = "ieee" if x.dtype == torch.float32 else None
    x = x.contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    scaled = w13_scale is not None
    if scaled != (w2_scale is not None):
        raise ValueError("fused_moe takes scales for both w13 and w2 (e4m3 weights) or for neither")
    step = block_k(block_m, scaled)
    # Unscaled, the scale pointers are not read: the router weights stand in for them (float32 like scales).
    a, a_scale = fp8.quantize_rows(x) if scaled else (x, weights)
    _expert_matmul[(max_blocks * triton.cdiv(inter, block_n),)](
        a, a_scale, w13, w13_scale if scaled else weights, act, sorted_pairs, block_expert, total, weights,
        num_pairs, inter, hidden, w13.stride(0), top_k, True, precision, scaled, block_m, block_n, step,
        num_warps=warps, num_stages=stages)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    if scaled:
        a, a_scale = fp8.quantize_rows(act, act_amax(act) if act_amax is not None else None)
    else:
        a, a_scale = act, weights
    _expert_matmul[(max_blocks * triton.cdiv(hidden, block_n),)](
        a, a_scale, w2, w2_scale if scaled else weights, out, sorted_pairs, block_expert, total, weights,
        num_pairs, hidden, inter, w2.stride(0), top_k, False, precision, scaled, block_m, block_n, step,
        num_warps=warps, num_stages=stages)
    return out.view(tokens, top_k, hidden).sum(dim=1)
