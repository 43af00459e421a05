"""Temperature sampling in one pass over the logits (GPU): Gumbel-max in a small Triton kernel.

argmax_j(logit_j / T + G_j), G_j = -log(-log(U_j)), draws token j with probability softmax(logits / T)_j.
The kernel reads the logits in the model's dtype once (bf16: half the bytes of float32) and writes one
token per row; flashinfer's samplers take float32 logits, so their path is a conversion pass (with the
temperature) and a draw: 143 + 94 us against one pass here for 256 rows of 128k logits on the H200.
The logarithms use the hardware's approximate log2: 48 against 105 us with the precise ones (the same
256 rows, the seed draw and the final argmax included).

The noise is an integer hash of the flat (row, token) index and a per-step seed drawn on the device from
the sampler's generator (so every TP rank, with the same generator state, draws the same tokens). Each
program takes a block of one row's logits; the block maxima are reduced by torch.
Without Triton the same draw goes through flashinfer.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the GPU sampler falls back to flashinfer
    triton = None

BLOCK = 4096  # logits per program: a row is split over vocab / BLOCK programs, reduced afterwards
SEED_RANGE = 2**31 - 1

if triton is not None:
    from triton.language.extra.cuda import libdevice

    @triton.jit
    def _uniform(offsets, seed):
        """(0, 1) from a 32-bit integer hash (lowbias32) of offset and seed: a few integer ops per value
        where Philox (tl.rand) made the kernel compute-bound. 23 bits keep the top value below 1."""
        x = offsets.to(tl.uint32) ^ (seed * 0x9E3779B9)
        x ^= x >> 16
        x *= 0x7FEB352D
        x ^= x >> 15
        x *= 0x846CA68B
        x ^= x >> 16
        return ((x >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)

    @triton.jit
    def _gumbel_block_max(
        logits_ptr, row_stride, temp_ptr, seed_ptr, best_ptr, best_idx_ptr, vocab, blocks, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        block = tl.program_id(1)
        cols = block * BLOCK + tl.arange(0, BLOCK)
        inside = cols < vocab
        x = tl.load(logits_ptr + row.to(tl.int64) * row_stride + cols, mask=inside, other=0.0).to(tl.float32)
        seed = tl.load(seed_ptr).to(tl.uint32)
        u = _uniform(row * vocab + cols, seed)
        # G = -ln(-ln u) through the hardware's approximate log2 (lg2.approx: ~2 ulp), and one reciprocal of
        # T a program: the precise log and division made the pass compute-bound (256 rows of 49k logits read
        # at ~0.6 TB/s). The noise's error is far below any probability sampling resolves.
        neg_ln_u = -0.6931471805599453 * libdevice.fast_log2f(u)  # ln 2
        gumbel = -0.6931471805599453 * libdevice.fast_log2f(neg_ln_u)
        score = tl.where(inside, x * (1.0 / tl.load(temp_ptr + row)) + gumbel, float("-inf"))
        top = tl.max(score, axis=0)
        tl.store(best_ptr + row * blocks + block, top)
        tl.store(best_idx_ptr + row * blocks + block, tl.min(tl.where(score == top, cols, vocab), axis=0))


def sample_with_temperature(
    logits: torch.Tensor, temperatures: torch.Tensor, generator: torch.Generator
) -> torch.Tensor:
    """int32 tokens ``[rows]`` drawn from softmax(logits / T) per row (``logits``: rows of any float dtype)."""
    if triton is None:
        from flashinfer import sampling

        return sampling.sampling_from_logits(logits / temperatures[:, None], generator=generator)
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    seed = torch.randint(0, SEED_RANGE, (1,), device=logits.device, generator=generator, dtype=torch.int64)
    blocks = triton.cdiv(vocab, BLOCK)
    best = torch.empty(rows, blocks, dtype=torch.float32, device=logits.device)
    best_idx = torch.empty(rows, blocks, dtype=torch.int32, device=logits.device)
    _gumbel_block_max[(rows, blocks)](
        logits, logits.stride(0), temperatures, seed, best, best_idx, vocab, blocks, BLOCK=BLOCK, num_warps=4
    )
    return best_idx.gather(1, best.argmax(dim=1, keepdim=True))[:, 0]
