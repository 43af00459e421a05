"""Fused GEMVs for single-token steps (TP=1): at one row a layer is bound by reading its weights, so the norms,
SiLU x mul and residual add are folded in. Programmatic dependent launch pays only inside CUDA graphs."""

from __future__ import annotations

import functools
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs never build the fused path
    triton = None

from models import fp8

if triton is not None:
    from models.fp8 import to_e4m3

    FP8_MAX: tl.constexpr = tl.constexpr(fp8.FP8_MAX)
    TINY: tl.constexpr = tl.constexpr(fp8.TINY)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # read once: the kernels take it as a constant

if triton is not None:

    @triton.jit
    def _row_gemv(
        x_ptr, w_ptr, scale_ptr, bias_ptr, norm_ptr, out_ptr, eps, N: tl.constexpr, K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr,
        HAS_BIAS: tl.constexpr, HAS_SCALE: tl.constexpr, PDL: tl.constexpr,
    ):
        """``out[n] (+)= act(sum_k W[n, k] * x'[k] + b[n])``; with SILU the weight is gate rows, then up rows.
        FP8 weights take ``_row_gemv_e4m3``, so HAS_SCALE is always False (left in: this source is the one
        benchmarked). The epilogue stays inline: through ``_finish_rows``, which reduces every sum, used or not,
        the bf16 one-request step lost 7%."""
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        kk = tl.arange(0, BLOCK_K)
        w_rows = w_ptr + n[:, None].to(tl.int64) * K
        # Weights are no kernel's output: read the first block before gdc_wait, overlapping the previous kernel.
        w_ok = n_ok[:, None] & (kk < K)[None, :]
        w = tl.load(w_rows + kk[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
        if SILU:
            up = tl.load(w_rows + N * K + kk[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
        else:
            up = w
        if PDL:
            tl.extra.cuda.gdc_wait()  # the previous kernel's writes (x, out) are visible from here on
            tl.extra.cuda.gdc_launch_dependents()
        x = tl.load(x_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        sq = x * x
        if NORM:
            x = x * tl.load(norm_ptr + kk, mask=kk < K, other=0.0).to(tl.float32)
        acc = w.to(tl.float32) * x[None, :]
        acc_up = up.to(tl.float32) * x[None, :]
        for k0 in range(BLOCK_K, K, BLOCK_K):
            k = k0 + kk
            k_ok = k < K
            x = tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            if NORM:
                sq += x * x
                x = x * tl.load(norm_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
            w_ok = n_ok[:, None] & k_ok[None, :]
            # Weights are read once per step: keep them from pushing x and the activations out of L2.
            w = tl.load(w_rows + k[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
            acc += w.to(tl.float32) * x[None, :]
            if SILU:
                up = tl.load(w_rows + N * K + k[None, :], mask=w_ok, other=0.0, eviction_policy="evict_first")
                acc_up += up.to(tl.float32) * x[None, :]
        y = tl.sum(acc, axis=1)
        if NORM:
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
            y = y * rstd
        if HAS_SCALE:
            y *= tl.load(scale_ptr + n, mask=n_ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if SILU:
            u = tl.sum(acc_up, axis=1)
            if NORM:
                u = u * rstd
            if HAS_SCALE:
                u *= tl.load(scale_ptr + N + n, mask=n_ok, other=0.0)
            if HAS_BIAS:
                u += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)
            y = y / (1.0 + tl.exp(-y)) * u
        if ADD:
            y += tl.load(out_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _finish_rows(
        acc, acc_up, sq, n, n_ok, scale_ptr, bias_ptr, out_ptr, eps, N: tl.constexpr, K: tl.constexpr,
        NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr,
        PRODUCT_SCALE: tl.constexpr,
    ):
        """Row products to outputs: the row sums (``acc_up``: the up rows, with SILU; each product carries
        ``PRODUCT_SCALE``) and the squares ``sq``, each reduced only where used, then ``_finish_sums``."""
        y = tl.sum(acc, axis=1) / PRODUCT_SCALE
        u = y
        if SILU:
            u = tl.sum(acc_up, axis=1) / PRODUCT_SCALE
        squares = 0.0
        if NORM:
            squares = tl.sum(sq, axis=0)
        _finish_sums(y, u, squares, n, n_ok, scale_ptr, bias_ptr, out_ptr, eps, N, K, NORM, SILU, ADD, HAS_BIAS)

    @triton.jit
    def _finish_sums(
        y, u, squares, n, n_ok, scale_ptr, bias_ptr, out_ptr, eps, N: tl.constexpr, K: tl.constexpr,
        NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr,
    ):
        """Row sums ``y`` (and ``u``, the up rows) and x's sum of squares to outputs: rstd, FP8 scales, bias,
        SiLU x up, the residual add, the store."""
        if NORM:
            rstd = tl.rsqrt(squares / K + eps)
            y = y * rstd
        y *= tl.load(scale_ptr + n, mask=n_ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if SILU:
            if NORM:
                u = u * rstd
            u *= tl.load(scale_ptr + N + n, mask=n_ok, other=0.0)
            if HAS_BIAS:
                u += tl.load(bias_ptr + N + n, mask=n_ok, other=0.0).to(tl.float32)
            y = y / (1.0 + tl.exp(-y)) * u
        if ADD:
            y += tl.load(out_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + n, y.to(out_ptr.dtype.element_ty), mask=n_ok)

    @triton.jit
    def _pack_f16x2(lo, hi, INTERPRET: tl.constexpr):
        """Two float32 as one int32 of f16 halves, ``lo`` in the low half (the lower address)."""
        if INTERPRET:  # the interpreter runs no PTX: the same bits by integer ops
            lo16 = lo.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
            hi16 = hi.to(tl.float16).to(tl.uint16, bitcast=True).to(tl.uint32)
            return (lo16 | (hi16 << 16)).to(tl.int32, bitcast=True)
        return tl.inline_asm_elementwise("cvt.rn.f16x2.f32 $0, $2, $1;", "=r,f,f", [lo, hi], dtype=tl.int32,
                                         is_pure=True, pack=1)

    @triton.jit
    def _e4m3_byte(w, i: tl.constexpr):
        return ((w >> (8 * i)) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)

    @triton.jit
    def _f16_half(x, i: tl.constexpr):
        return ((x >> (16 * i)) & 0xFFFF).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)

    @triton.jit
    def _f16x2_dot_emulated(mul_lo, mul_hi, fma_lo, fma_hi, xa, xb):
        """What ``mul.rn.f16x2 p, m, xa; fma.rn.f16x2 p, f, xb, p`` and the halves' f16 sum give, for the
        weights' f16 lanes given as float32 values (m = mul_lo | mul_hi, f = fma_lo | fma_hi) and x as int32 f16
        pairs: each product and sum rounded to f16 where the PTX rounds (an FMA's once)."""
        a = xa.to(tl.uint32, bitcast=True)
        b = xb.to(tl.uint32, bitcast=True)
        low = (mul_lo * _f16_half(a, 0)).to(tl.float16).to(tl.float32)
        high = (mul_hi * _f16_half(a, 1)).to(tl.float16).to(tl.float32)
        low = (fma_lo * _f16_half(b, 0) + low).to(tl.float16).to(tl.float32)
        high = (fma_hi * _f16_half(b, 1) + high).to(tl.float16).to(tl.float32)
        return (low + high).to(tl.float16).to(tl.float32)

    @triton.jit
    def _dot4_e4m3(w, x01, x23, INTERPRET: tl.constexpr):
        """The four e4m3 weights of int32 ``w`` times x packed in f16 pairs: products in f16x2 (two summed per half),
        the halves added in f16 and widened once. Three conversions for four weights, where converting each weight
        to float32 costs four, and Hopper converts at a quarter of its FMA rate."""
        if INTERPRET:  # the interpreter runs no PTX: the same sums by integer ops
            wu = w.to(tl.uint32, bitcast=True)
            return _f16x2_dot_emulated(_e4m3_byte(wu, 0), _e4m3_byte(wu, 1), _e4m3_byte(wu, 2), _e4m3_byte(wu, 3),
                                       x01, x23)
        return tl.inline_asm_elementwise(
            """{
            .reg .b16 w01, w23, s0, s1;
            .reg .b32 h01, h23, p;
            mov.b32 {w01, w23}, $1;
            cvt.rn.f16x2.e4m3x2 h01, w01;
            cvt.rn.f16x2.e4m3x2 h23, w23;
            mul.rn.f16x2 p, h01, $2;
            fma.rn.f16x2 p, h23, $3, p;
            mov.b32 {s0, s1}, p;
            add.rn.f16 s0, s0, s1;
            cvt.f32.f16 $0, s0;
            }""",
            "=f,r,r,r", [w, x01, x23], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _dot4_e4m3_bits(w, x02, x13, INTERPRET: tl.constexpr):
        """``_dot4_e4m3`` with no conversion instruction for the weights: integer ops move each e4m3's sign to bit
        15 of an f16 and its exponent and mantissa to bits 7-13, which reads as the e4m3 value times 2^-8
        (subnormals included). Hopper issues those ops at several times its conversion rate. The pairs are bytes
        0 and 2, then 1 and 3, so x comes packed the same way (``x02``, ``x13``)."""
        if INTERPRET:  # the same bit moves by integer ops
            wu = w.to(tl.uint32, bitcast=True)
            even = ((wu << 8) & 0x80008000) | ((wu << 7) & 0x3F803F80)
            odd = (wu & 0x80008000) | ((wu >> 1) & 0x3F803F80)
            return _f16x2_dot_emulated(_f16_half(even, 0), _f16_half(even, 1), _f16_half(odd, 0), _f16_half(odd, 1),
                                       x02, x13)
        return tl.inline_asm_elementwise(
            """{
            .reg .b32 t, e, o, p;
            .reg .b16 s0, s1;
            shl.b32 t, $1, 8;
            and.b32 t, t, 0x80008000;
            shl.b32 e, $1, 7;
            and.b32 e, e, 0x3F803F80;
            or.b32 e, e, t;
            shr.b32 o, $1, 1;
            and.b32 o, o, 0x3F803F80;
            and.b32 t, $1, 0x80008000;
            or.b32 o, o, t;
            mul.rn.f16x2 p, e, $2;
            fma.rn.f16x2 p, o, $3, p;
            mov.b32 {s0, s1}, p;
            add.rn.f16 s0, s0, s1;
            cvt.f32.f16 $0, s0;
            }""",
            "=f,r,r,r", [w, x02, x13], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _dot4(w, xa, xb, BITS: tl.constexpr, INTERPRET: tl.constexpr):
        if BITS:
            return _dot4_e4m3_bits(w, xa, xb, INTERPRET)
        return _dot4_e4m3(w, xa, xb, INTERPRET)

    @triton.jit
    def _x_quads(x_ptr, norm_ptr, q, KQ: tl.constexpr, NORM: tl.constexpr, X_SCALE: tl.constexpr,
                 BITS: tl.constexpr, INTERPRET: tl.constexpr):
        """x[4q .. 4q+3] (times the norm weight) scaled by X_SCALE and packed as two f16 pairs (x0 x1, x2 x3; with
        BITS x0 x2, x1 x3), and with NORM the sum of their squares. Each quad is one vector load, split in
        registers."""
        ok = (q < KQ)[:, None]
        at = 4 * q[:, None] + tl.arange(0, 4)[None, :]
        x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        sq = x  # unused without NORM
        if NORM:
            sq = tl.sum(x * x, axis=1)
            x = x * tl.load(norm_ptr + at, mask=ok, other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(x * X_SCALE, (x.shape[0], 2, 2)))  # [q, i]: x[4q + 2i], x[4q + 2i + 1]
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        if BITS:
            return _pack_f16x2(x0, x2, INTERPRET), _pack_f16x2(x1, x3, INTERPRET), sq
        return _pack_f16x2(x0, x1, INTERPRET), _pack_f16x2(x2, x3, INTERPRET), sq

    @triton.jit
    def _row_gemv_e4m3(
        x_ptr, w_ptr, scale_ptr, bias_ptr, norm_ptr, out_ptr, eps, N: tl.constexpr, K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr,
        HAS_BIAS: tl.constexpr, PDL: tl.constexpr, X_SCALE: tl.constexpr, PRODUCT_SCALE: tl.constexpr,
        BITS: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        """``_row_gemv`` for e4m3 weights read as int32 (``w_ptr``: four weights each, K % 4 == 0); BITS: widened
        by ``_dot4_e4m3_bits``, else ``_dot4_e4m3``."""
        KQ: tl.constexpr = K // 4
        BQ: tl.constexpr = BLOCK_K // 4
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        q = tl.arange(0, BQ)
        w_rows = w_ptr + n[:, None].to(tl.int64) * KQ
        w_ok = n_ok[:, None] & (q < KQ)[None, :]
        w = tl.load(w_rows + q[None, :], mask=w_ok, other=0, eviction_policy="evict_first")
        if SILU:
            up = tl.load(w_rows + N * KQ + q[None, :], mask=w_ok, other=0, eviction_policy="evict_first")
        else:
            up = w
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        xa, xb, sq = _x_quads(x_ptr, norm_ptr, q, KQ, NORM, X_SCALE, BITS, INTERPRET)
        acc = _dot4(w, xa[None, :], xb[None, :], BITS, INTERPRET)
        acc_up = _dot4(up, xa[None, :], xb[None, :], BITS, INTERPRET) if SILU else acc
        for q0 in range(BQ, KQ, BQ):
            qk = q0 + q
            xa, xb, part = _x_quads(x_ptr, norm_ptr, qk, KQ, NORM, X_SCALE, BITS, INTERPRET)
            if NORM:
                sq += part
            w_ok = n_ok[:, None] & (qk < KQ)[None, :]
            w = tl.load(w_rows + qk[None, :], mask=w_ok, other=0, eviction_policy="evict_first")
            acc += _dot4(w, xa[None, :], xb[None, :], BITS, INTERPRET)
            if SILU:
                up = tl.load(w_rows + N * KQ + qk[None, :], mask=w_ok, other=0, eviction_policy="evict_first")
                acc_up += _dot4(up, xa[None, :], xb[None, :], BITS, INTERPRET)
        _finish_rows(acc, acc_up, sq, n, n_ok, scale_ptr, bias_ptr, out_ptr, eps, N, K, NORM, SILU, ADD, HAS_BIAS,
                     PRODUCT_SCALE)


    @triton.jit
    def _x_group_e4m3(x_ptr, norm_ptr, k, NORM: tl.constexpr):
        """x[k] (times the norm weight) quantised to e4m3 with a scale of its own, as the B operand of a dot
        ([16, group]: row 0 is x, the rest zeros, as an MMA is at least 16 wide), the scale, and with NORM the
        sum of x's squares."""
        x = tl.load(x_ptr + k).to(tl.float32)
        squares = 0.0
        if NORM:
            squares = tl.sum(x * x, axis=0)
            x = x * tl.load(norm_ptr + k).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), axis=0), TINY) / FP8_MAX
        q = to_e4m3(x * (1.0 / scale), FP8_MAX).to(tl.float8e4nv)
        row = tl.arange(0, 16)[:, None]
        b = tl.where(row == 0, q[None, :], tl.zeros((16, q.shape[0]), tl.float8e4nv))
        return b, scale, squares

    @triton.jit
    def _row_gemv_e4m3_mma(
        x_ptr, w_ptr, scale_ptr, bias_ptr, norm_ptr, out_ptr, part_ptr, count_ptr, eps, N: tl.constexpr,
        K: tl.constexpr, BLOCK_N: tl.constexpr, GROUP: tl.constexpr, SPLIT: tl.constexpr, NORM: tl.constexpr,
        SILU: tl.constexpr, ADD: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr,
    ):
        """``_row_gemv`` for e4m3 weights on FP8 tensor cores: x quantised to e4m3 per GROUP inputs, each group's
        [BLOCK_N, GROUP] x [GROUP, 16] product scaled into a float32 sum. The weights reach the MMA unconverted,
        which is what the CUDA-core kernels spend their time on. Program (i, s) takes rows i * BLOCK_N.. and the
        s-th of SPLIT slices of K: with SPLIT > 1 each writes its row sums to ``part_ptr`` and the last of a
        row block to arrive adds them in slice order (the same sum every run) and finishes the rows."""
        block = tl.program_id(0)
        piece = tl.program_id(1)
        SLICE: tl.constexpr = K // SPLIT
        n = block * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = n < N
        k = piece * SLICE + tl.arange(0, GROUP)
        w_rows = w_ptr + n[:, None].to(tl.int64) * K + k[None, :]
        w = tl.load(w_rows, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        if SILU:
            up = tl.load(w_rows + N * K, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
        else:
            up = w
        if PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
        b, x_scale, squares = _x_group_e4m3(x_ptr, norm_ptr, k, NORM)
        acc = tl.dot(w, tl.trans(b)) * x_scale
        acc_up = acc
        if SILU:
            acc_up = tl.dot(up, tl.trans(b)) * x_scale
        for k0 in range(GROUP, SLICE, GROUP):
            b, x_scale, part = _x_group_e4m3(x_ptr, norm_ptr, k + k0, NORM)
            squares += part
            w = tl.load(w_rows + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
            acc += tl.dot(w, tl.trans(b)) * x_scale
            if SILU:
                up = tl.load(w_rows + N * K + k0, mask=n_ok[:, None], other=0.0, eviction_policy="evict_first")
                acc_up += tl.dot(up, tl.trans(b)) * x_scale
        y = tl.sum(acc, axis=1)  # columns 1.. are zero
        u = y
        if SILU:
            u = tl.sum(acc_up, axis=1)
        if SPLIT == 1:
            _finish_sums(y, u, squares, n, n_ok, scale_ptr, bias_ptr, out_ptr, eps, N, K, NORM, SILU, ADD, HAS_BIAS)
        else:
            ROWS: tl.constexpr = 2 * N if SILU else N
            BLOCKS: tl.constexpr = (N + BLOCK_N - 1) // BLOCK_N
            STRIDE: tl.constexpr = ROWS + BLOCKS  # a slice's row sums, then one sum of squares a row block
            mine = part_ptr + piece * STRIDE
            tl.store(mine + n, y, mask=n_ok)
            if SILU:
                tl.store(mine + N + n, u, mask=n_ok)
            if NORM:
                tl.store(mine + ROWS + block, squares)
            tl.debug_barrier()  # every thread's stores precede the release below
            arrived = tl.atomic_add(count_ptr + block, 1, sem="acq_rel", scope="gpu")
            if arrived == SPLIT - 1:
                y = tl.zeros((BLOCK_N,), tl.float32)
                u = y
                squares = 0.0
                for s in tl.static_range(SPLIT):
                    theirs = part_ptr + s * STRIDE
                    y += tl.load(theirs + n, mask=n_ok, other=0.0, cache_modifier=".cg")
                    if SILU:
                        u += tl.load(theirs + N + n, mask=n_ok, other=0.0, cache_modifier=".cg")
                    if NORM:
                        squares += tl.load(theirs + ROWS + block, cache_modifier=".cg")
                _finish_sums(y, u, squares, n, n_ok, scale_ptr, bias_ptr, out_ptr, eps, N, K, NORM, SILU, ADD,
                             HAS_BIAS)
                tl.store(count_ptr + block, 0)  # ready for the next launch


def supported(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


@functools.cache
def use_pdl(device_index: int) -> bool:
    """Programmatic dependent launch: Hopper and later, compiled (Triton's interpreter has none)."""
    if INTERPRET:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# Products enter f16 scaled by 2^-9 (x by 2^-9, or with E4M3_BY_BITS by 1/2 times the widened weights' 2^-8): four
# are summed in f16, finite while |x * norm weight| < 65504 * 512 / 448 / 4, about 18,700 (a bf16 residual that
# large is already broken); x scaled in f16 loses bits below 2^-5, the products below ~2^-15, not the sum.
E4M3_X_SCALE = 1.0 / 512
E4M3_BITS_X_SCALE = 0.5
# Widen e4m3 to f16 by integer ops (``_dot4_e4m3_bits``) instead of conversion instructions: the same products
# wherever |x| >= 2^-5. Off: 5% slower on an H100's one-request step, where the layers are DRAM-bound; for the
# H200, whose FP8 layers are bound by conversions, measure it (scripts/bench_gemv.py --fp8 --widening both).
E4M3_BY_BITS = False


# Swept shapes whose best tile beats ``tile``'s rule in the engine (scripts/bench_gemv.py --sweep).
TUNED_TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (6144, 4096, False): (16, 512, 8, 4), (4096, 4096, False): (8, 2048, 8, 2),  # qkv, o
    (14336, 4096, True): (1, 1024, 2, 3), (4096, 14336, False): (4, 1024, 2, 4),  # gate_up, down
}


# The same for FP8 weights (scripts/bench_gemv.py --fp8 --sweep): a block of e4m3 holds half the bytes.
TUNED_FP8_TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {
    (6144, 4096, False): (16, 1024, 8, 3), (4096, 4096, False): (8, 2048, 8, 3),  # qkv, o
    (14336, 4096, True): (8, 512, 4, 3), (4096, 14336, False): (8, 2048, 8, 3),  # gate_up, down
}


def tile(n: int, k: int, silu: bool, fp8: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages); short reductions fit one block, read before ``gdc_wait``."""
    tuned = (TUNED_FP8_TILES if fp8 else TUNED_TILES).get((n, k, silu))
    if tuned:
        return tuned
    if silu:
        return 1, min(512, triton.next_power_of_2(k)), 4, 3
    if k <= 2048:
        return 4, triton.next_power_of_2(k), 8, 2
    return 4, 1024, 8, 6


# FP8 weights on tensor cores (``_row_gemv_e4m3_mma``) where the input features are whole activation groups:
# the weights reach the MMA unconverted, x is quantised to e4m3 as the batched FP8 GEMMs quantise it. Off: a
# pipelined loop over 128-input groups read 1.8 TB/s on an H100 where the f16 path reads 2.8; compare with
# scripts/bench_gemv.py --fp8 --kernels mma,cvt.
E4M3_TENSOR_CORES = False
MMA_BLOCK_N = 64  # the rows of one Hopper warpgroup MMA
TUNED_MMA_TILES: dict[tuple[int, int, bool], tuple[int, int, int, int]] = {}


def mma_tile(n: int, k: int, silu: bool) -> tuple[int, int, int, int]:
    """(GROUP, SPLIT, num_warps, num_stages): inputs sharing an activation scale, and K slices a row block.
    By default each program reads one group of 512 inputs (fewer where K is no multiple of 512), its weights
    loaded at once before ``gdc_wait``: many small programs keep more bytes in flight than a pipelined loop."""
    tuned = TUNED_MMA_TILES.get((n, k, silu))
    if tuned:
        return tuned
    group = next(g for g in (512, 256, 128) if k % g == 0)
    return group, k // group, 4, 2


def mma_supported(k: int) -> bool:
    return k % 128 == 0


_workspaces: dict[tuple[torch.device, int, int, bool, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _split_workspace(device: torch.device, n: int, k: int, silu: bool, split: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Row sums of each K slice and the arrival counters of one GEMV shape. Launches of a shape share them,
    which is safe in stream order: a kernel touches them only after ``gdc_wait``, when the one before is done.
    The counters start at zero and the last program of each row block puts its counter back. One first made
    during a CUDA graph capture lives in that graph's pool, so it is not kept."""
    key = (device, n, k, silu, split)
    if key in _workspaces:
        return _workspaces[key]
    blocks = triton.cdiv(n, MMA_BLOCK_N)
    parts = torch.empty(split * ((2 if silu else 1) * n + blocks), dtype=torch.float32, device=device)
    made = parts, torch.zeros(blocks, dtype=torch.int32, device=device)
    if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        _workspaces[key] = made
    return made


def _launch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
    norm: torch.Tensor | None, eps: float, out: torch.Tensor, n: int, silu: bool, add: bool,
) -> None:
    rows, k = x.shape
    if rows != 1:
        raise ValueError(f"the fused GEMV takes one row, got {rows}")
    block_n, block_k, warps, stages = tile(n, k, silu, scale is not None)
    pdl = use_pdl(x.device.index or 0)
    if scale is not None and E4M3_TENSOR_CORES and mma_supported(k):
        group, split, warps, stages = mma_tile(n, k, silu)
        if k % (group * split):
            raise ValueError(f"FP8 GEMV tile: {split} slices of {group}-input groups do not divide {k} inputs")
        blocks = triton.cdiv(n, MMA_BLOCK_N)
        parts, counts = _split_workspace(x.device, n, k, silu, split)
        _row_gemv_e4m3_mma[(blocks, split)](
            x, weight, scale, bias if bias is not None else scale, norm if norm is not None else scale, out, parts,
            counts, eps, N=n, K=k, BLOCK_N=MMA_BLOCK_N, GROUP=group, SPLIT=split, NORM=norm is not None,
            SILU=silu, ADD=add, HAS_BIAS=bias is not None, PDL=pdl, launch_pdl=pdl, num_warps=warps,
            num_stages=stages,
        )
        return
    if scale is not None:
        if k % 4:
            raise ValueError(f"FP8 weights in the fused GEMV are read four to an int32: {k} input features")
        _row_gemv_e4m3[(triton.cdiv(n, block_n),)](
            x, weight.view(torch.int32), scale, bias if bias is not None else scale,
            norm if norm is not None else scale, out, eps, N=n, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
            NORM=norm is not None, SILU=silu, ADD=add, HAS_BIAS=bias is not None, PDL=pdl,
            X_SCALE=E4M3_BITS_X_SCALE if E4M3_BY_BITS else E4M3_X_SCALE, PRODUCT_SCALE=E4M3_X_SCALE, BITS=E4M3_BY_BITS,
            INTERPRET=INTERPRET, launch_pdl=pdl, num_warps=warps, num_stages=stages,
        )
        return
    _row_gemv[(triton.cdiv(n, block_n),)](
        x, weight, scale if scale is not None else weight, bias if bias is not None else weight,
        norm if norm is not None else weight, out, eps, N=n, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
        NORM=norm is not None, SILU=silu, ADD=add, HAS_BIAS=bias is not None, HAS_SCALE=scale is not None, PDL=pdl,
        launch_pdl=pdl, num_warps=warps, num_stages=stages,
    )


def norm_linear(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                bias: torch.Tensor | None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``rmsnorm(h) * norm_weight @ (weight * scale).T + bias`` for one row ``h`` ([1, k]); ``scale``: an FP8
    weight's per-row scale."""
    out = torch.empty(h.shape[0], weight.shape[0], dtype=h.dtype, device=h.device)
    _launch(h, weight, scale, bias, norm_weight, eps, out, weight.shape[0], silu=False, add=False)
    return out


def norm_linear_silu(h: torch.Tensor, norm_weight: torch.Tensor, eps: float, weight: torch.Tensor,
                     bias: torch.Tensor | None, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(g) * u`` where ``[g, u] = rmsnorm(h) * norm_weight @ weight.T + bias`` (weight: gate rows, then up)."""
    n = weight.shape[0] // 2
    out = torch.empty(h.shape[0], n, dtype=h.dtype, device=h.device)
    _launch(h, weight, scale, bias, norm_weight, eps, out, n, silu=True, add=False)
    return out


def linear_add_(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, h: torch.Tensor,
                scale: torch.Tensor | None = None) -> None:
    """``h += x @ (weight * scale).T + bias``, in place."""
    _launch(x, weight, scale, bias, None, 0.0, h, weight.shape[0], silu=False, add=True)
