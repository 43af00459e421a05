"""The GPU sampler: counter-keyed Gumbel-max in two Triton kernels (``runtime.engine.sampler`` is the reference).
Top-p needs no sort: the nucleus is closed upwards, so the floor rises until the best token above it is inside."""

from __future__ import annotations

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs sample with the torch reference (runtime.engine.sampler)
    triton = None

BLOCK = 4096
FAST_LOG = os.environ.get("TRITON_INTERPRET") != "1"  # the interpreter has no approximate log2

if triton is not None:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def _lowbias32(x):
        """A 32-bit integer hash (a bijection: distinct tokens get distinct noise)."""
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        x ^= x >> 16
        return x

    @triton.jit
    def _row_key(seed_ptr, pos_ptr, row):
        seed = tl.load(seed_ptr + row)
        lo = (seed & 0xFFFFFFFF).to(tl.uint32)
        hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
        pos = tl.load(pos_ptr + row).to(tl.uint32)
        return _lowbias32(lo ^ _lowbias32(hi ^ _lowbias32(pos ^ 0x9E3779B9)))

    @triton.jit
    def _gumbel(cols, key, FAST_LOG: tl.constexpr):
        """Gumbel noise of tokens ``cols``; 23 bits keep ``u`` strictly inside (0, 1)."""
        h = _lowbias32(cols.to(tl.uint32) ^ key)
        u = ((h >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)
        if FAST_LOG:  # the precise logarithm makes the pass compute-bound
            return -0.6931471805599453 * libdevice.fast_log2f(-0.6931471805599453 * libdevice.fast_log2f(u))
        return -0.6931471805599453 * tl.log2(-0.6931471805599453 * tl.log2(u))

    @triton.jit
    def _block_pass(
        logits_ptr, row_stride, temp_ptr, thr_ptr, seed_ptr, pos_ptr, best_ptr, idx_ptr, max_ptr, sum_ptr,
        vocab, blocks, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
    ):
        row = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=cols < vocab, other=float("-inf"))
        x = x.to(tl.float32)
        t = tl.load(temp_ptr + row)
        greedy = t <= 0.0
        inv_t = 1.0 / tl.where(greedy, 1.0, t)
        kept = (cols < vocab) & (x >= tl.load(thr_ptr + row))
        noise = _gumbel(cols, _row_key(seed_ptr, pos_ptr, row), FAST_LOG)
        score = tl.where(kept, x * inv_t + tl.where(greedy, 0.0, noise), float("-inf"))
        top = tl.max(score, axis=0)
        out = row * blocks + block
        tl.store(best_ptr + out, top)
        tl.store(idx_ptr + out, tl.min(tl.where(score == top, cols, vocab), axis=0))
        m = tl.max(tl.where(kept, x, float("-inf")), axis=0)
        tl.store(max_ptr + out, m)
        tl.store(sum_ptr + out, tl.sum(tl.where(kept, tl.exp2((x - m) * (inv_t * 1.4426950408889634)), 0.0), axis=0))

    @triton.jit
    def _finish(
        logits_ptr, row_stride, temp_ptr, thr_ptr, top_p_ptr, seed_ptr, pos_ptr, best_ptr, idx_ptr, max_ptr,
        sum_ptr, out_ptr, vocab, blocks, BLOCKS_P2: tl.constexpr, BLOCK: tl.constexpr, FAST_LOG: tl.constexpr,
    ):
        row = tl.program_id(0)
        b = tl.arange(0, BLOCKS_P2)
        part = row * blocks + b
        ok = b < blocks
        best = tl.load(best_ptr + part, mask=ok, other=float("-inf"))
        top = tl.max(best, axis=0)
        cand = tl.min(tl.where(ok & (best == top), tl.load(idx_ptr + part, mask=ok, other=vocab), vocab), axis=0)
        cand = tl.where(cand < vocab, cand, 0)  # a row of NaN logits scores nothing: token 0, as argmax would
        t = tl.load(temp_ptr + row)
        top_p = tl.load(top_p_ptr + row)
        if (t > 0.0) & (top_p < 1.0):
            scale = 1.4426950408889634 / t
            inv_t = 1.0 / t
            block_max = tl.load(max_ptr + part, mask=ok, other=float("-inf"))
            m = tl.max(block_max, axis=0)
            block_sum = tl.load(sum_ptr + part, mask=ok, other=0.0)
            limit = top_p * tl.sum(tl.where(ok, block_sum * tl.exp2((block_max - m) * scale), 0.0), axis=0)
            key = _row_key(seed_ptr, pos_ptr, row)
            logits = logits_ptr + row.to(tl.int64) * row_stride
            searching = True
            while searching:
                floor = tl.load(logits + cand).to(tl.float32)
                above = 0.0
                next_best = float("-inf")
                next_idx = vocab
                for start in range(0, vocab, BLOCK):
                    cols = start + tl.arange(0, BLOCK)
                    x = tl.load(logits + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                    higher = x > floor  # above the candidate: kept by top-k too (the candidate is)
                    above += tl.sum(tl.where(higher, tl.exp2((x - m) * scale), 0.0), axis=0)
                    score = tl.where(higher, x * inv_t + _gumbel(cols, key, FAST_LOG), float("-inf"))
                    block_best = tl.max(score, axis=0)
                    block_idx = tl.min(tl.where(score == block_best, cols, vocab), axis=0)
                    next_idx = tl.where(block_best > next_best, block_idx, next_idx)  # earlier blocks win ties
                    next_best = tl.maximum(next_best, block_best)
                # Nothing above the floor ends the walk too: NaN logits make limit 0 and above never below it.
                if (above < limit) | (next_idx >= vocab):
                    searching = False
                else:
                    cand = next_idx
        tl.store(out_ptr + row, cand)


def sample(
    logits: torch.Tensor, temperatures: torch.Tensor, thresholds: torch.Tensor, top_p: torch.Tensor,
    seeds: torch.Tensor, positions: torch.Tensor,
) -> torch.Tensor:
    """int32 tokens from ``logits`` with per-row temperatures (<= 0: greedy), top-k thresholds, top-p, seeds, positions."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    blocks = triton.cdiv(vocab, BLOCK)
    dev = logits.device
    best = torch.empty(rows, blocks, dtype=torch.float32, device=dev)
    best_idx = torch.empty(rows, blocks, dtype=torch.int32, device=dev)
    block_max = torch.empty(rows, blocks, dtype=torch.float32, device=dev)
    block_sum = torch.empty(rows, blocks, dtype=torch.float32, device=dev)
    out = torch.empty(rows, dtype=torch.int32, device=dev)
    _block_pass[(rows, blocks)](
        logits, logits.stride(0), temperatures, thresholds, seeds, positions, best, best_idx, block_max, block_sum,
        vocab, blocks, BLOCK=BLOCK, FAST_LOG=FAST_LOG, num_warps=4,
    )
    _finish[(rows,)](
        logits, logits.stride(0), temperatures, thresholds, top_p, seeds, positions, best, best_idx, block_max,
        block_sum, out, vocab, blocks, BLOCKS_P2=triton.next_power_of_2(blocks), BLOCK=BLOCK, FAST_LOG=FAST_LOG,
        num_warps=8,
    )
    return out
