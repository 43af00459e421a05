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
        ``PRODUCT_SCALE``), rstd from the squares ``sq``, FP8 scales, bias, SiLU x up, the residual add, the store.
        Each sum is reduced only where used."""
        y = tl.sum(acc, axis=1) / PRODUCT_SCALE
        if NORM:
            rstd = tl.rsqrt(tl.sum(sq, axis=0) / K + eps)
            y = y * rstd
        y *= tl.load(scale_ptr + n, mask=n_ok, other=0.0)
        if HAS_BIAS:
            y += tl.load(bias_ptr + n, mask=n_ok, other=0.0).to(tl.float32)
        if SILU:
            u = tl.sum(acc_up, axis=1) / PRODUCT_SCALE
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
    def _e4m3_pair_bits(w, i: tl.constexpr):
        """The f16 whose bits are e4m3 bytes 2i and 2i + 1 of ``w`` moved by integer ops (``_dot4``'s PTX): each
        byte sign-extended to 16 bits, shifted left by 7 and masked, which puts the sign in bit 15 and the
        exponent and mantissa in bits 7-13, reading as the e4m3 value times 2^-8 (subnormals included)."""
        halves = ((w >> (16 * i)) & 0xFF) | (((w >> (16 * i + 8)) & 0xFF) << 16)
        signs = ((halves & 0x00800080) >> 7) * 0xFF00  # prmt's sign-extension: 0xFF00 in each negative half
        return ((halves | signs) << 7) & 0xBF80BF80

    @triton.jit
    def _e4m3_pair(w, i: tl.constexpr, BITS: tl.constexpr):
        """The f16 values (as float32) that ``_dot4``'s PTX makes of e4m3 bytes 2i and 2i + 1 of ``w`` (uint32):
        the e4m3 values by conversion, or with BITS 2^-8 of them by integer ops."""
        if BITS:
            pair = _e4m3_pair_bits(w, i)
            return _f16_half(pair, 0), _f16_half(pair, 1)
        return _e4m3_byte(w, 2 * i), _e4m3_byte(w, 2 * i + 1)

    @triton.jit
    def _dot4(w, x01, x23, WIDEN: tl.constexpr, INTERPRET: tl.constexpr):
        """The four e4m3 weights of int32 ``w`` times x packed in f16 pairs (x0 x1, x2 x3): products in f16x2 (two
        summed per half), the halves added in f16 and widened once. Each pair of weights becomes an f16x2 by one
        conversion instruction (WIDEN "cvt"), by three integer ops ("bits": the pair then holds 2^-8 of its values,
        which x's scale makes up), or the first pair one way and the second the other ("mixed"): Hopper converts
        at a quarter of its integer-op rate, so the mix keeps both units busy."""
        if INTERPRET:  # the interpreter runs no PTX: the same sums by integer ops
            wu = w.to(tl.uint32, bitcast=True)
            first = _e4m3_pair(wu, 0, WIDEN == "bits")
            second = _e4m3_pair(wu, 1, WIDEN != "cvt")
            return _f16x2_dot_emulated(first[0], first[1], second[0], second[1], x01, x23)
        if WIDEN == "cvt":
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
        if WIDEN == "bits":
            return tl.inline_asm_elementwise(
                """{
                .reg .b16 s0, s1;
                .reg .b32 h01, h23, p;
                prmt.b32 h01, $1, 0, 0x9180;
                prmt.b32 h23, $1, 0, 0xB3A2;
                shl.b32 h01, h01, 7;
                shl.b32 h23, h23, 7;
                and.b32 h01, h01, 0xBF80BF80;
                and.b32 h23, h23, 0xBF80BF80;
                mul.rn.f16x2 p, h01, $2;
                fma.rn.f16x2 p, h23, $3, p;
                mov.b32 {s0, s1}, p;
                add.rn.f16 s0, s0, s1;
                cvt.f32.f16 $0, s0;
                }""",
                "=f,r,r,r", [w, x01, x23], dtype=tl.float32, is_pure=True, pack=1)
        return tl.inline_asm_elementwise(
            """{
            .reg .b16 w01, w23, s0, s1;
            .reg .b32 h01, h23, p;
            mov.b32 {w01, w23}, $1;
            cvt.rn.f16x2.e4m3x2 h01, w01;
            prmt.b32 h23, $1, 0, 0xB3A2;
            shl.b32 h23, h23, 7;
            and.b32 h23, h23, 0xBF80BF80;
            mul.rn.f16x2 p, h01, $2;
            fma.rn.f16x2 p, h23, $3, p;
            mov.b32 {s0, s1}, p;
            add.rn.f16 s0, s0, s1;
            cvt.f32.f16 $0, s0;
            }""",
            "=f,r,r,r", [w, x01, x23], dtype=tl.float32, is_pure=True, pack=1)

    @triton.jit
    def _x_quads(x_ptr, norm_ptr, q, KQ: tl.constexpr, NORM: tl.constexpr, X01_SCALE: tl.constexpr,
                 X23_SCALE: tl.constexpr, INTERPRET: tl.constexpr):
        """x[4q .. 4q+3] (times the norm weight) packed as two f16 pairs, x0 x1 scaled by X01_SCALE and x2 x3 by
        X23_SCALE, and with NORM the sum of their squares. Each quad is one vector load, split in registers."""
        ok = (q < KQ)[:, None]
        at = 4 * q[:, None] + tl.arange(0, 4)[None, :]
        x = tl.load(x_ptr + at, mask=ok, other=0.0).to(tl.float32)
        sq = x  # unused without NORM
        if NORM:
            sq = tl.sum(x * x, axis=1)
            x = x * tl.load(norm_ptr + at, mask=ok, other=0.0).to(tl.float32)
        even, odd = tl.split(tl.reshape(x, (x.shape[0], 2, 2)))  # [q, i]: x[4q + 2i], x[4q + 2i + 1]
        x0, x2 = tl.split(even)
        x1, x3 = tl.split(odd)
        return (_pack_f16x2(x0 * X01_SCALE, x1 * X01_SCALE, INTERPRET),
                _pack_f16x2(x2 * X23_SCALE, x3 * X23_SCALE, INTERPRET), sq)

    @triton.jit
    def _row_gemv_e4m3(
        x_ptr, w_ptr, scale_ptr, bias_ptr, norm_ptr, out_ptr, eps, N: tl.constexpr, K: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, NORM: tl.constexpr, SILU: tl.constexpr, ADD: tl.constexpr,
        HAS_BIAS: tl.constexpr, PDL: tl.constexpr, PRODUCT_SCALE: tl.constexpr,
        X01_SCALE: tl.constexpr, X23_SCALE: tl.constexpr, WIDEN: tl.constexpr, INTERPRET: tl.constexpr,
    ):
        """``_row_gemv`` for e4m3 weights read as int32 (``w_ptr``: four weights each, K % 4 == 0), widened as
        WIDEN says (``_dot4``)."""
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
        xa, xb, sq = _x_quads(x_ptr, norm_ptr, q, KQ, NORM, X01_SCALE, X23_SCALE, INTERPRET)
        acc = _dot4(w, xa[None, :], xb[None, :], WIDEN, INTERPRET)
        acc_up = _dot4(up, xa[None, :], xb[None, :], WIDEN, INTERPRET) if SILU else acc
        for q0 in range(BQ, KQ, BQ):
            qk = q0 + q
            xa, xb, part = _x_quads(x_ptr, norm_ptr, qk, KQ, NORM, X01_SCALE, X23_SCALE, INTERPRET)
            if NORM:
                sq += part
            w_ok = n_ok[:, None] & (qk < KQ)[None, :]
            w = tl.load(w_rows + qk[None, :], mask=w_ok, other=0, eviction_policy="evict_first")
            acc += _dot4(w, xa[None, :], xb[None, :], WIDEN, INTERPRET)
            if SILU:
                up = tl.load(w_rows + N * KQ + qk[None, :], mask=w_ok, other=0, eviction_policy="evict_first")
                acc_up += _dot4(up, xa[None, :], xb[None, :], WIDEN, INTERPRET)
        _finish_rows(acc, acc_up, sq, n, n_ok, scale_ptr, bias_ptr, out_ptr, eps, N, K, NORM, SILU, ADD, HAS_BIAS,
                     PRODUCT_SCALE)


def supported(device: torch.device) -> bool:
    return triton is not None and device.type == "cuda"


@functools.cache
def use_pdl(device_index: int) -> bool:
    """Programmatic dependent launch: Hopper and later, compiled (Triton's interpreter has none)."""
    if INTERPRET:
        return False
    return torch.cuda.get_device_capability(device_index)[0] >= 9


# Products enter f16 scaled by 2^-9 (x by 2^-9 where a conversion widens the weights, by 1/2 where integer ops
# widen them to 2^-8 of their values): four are summed in f16, finite while |x * norm weight| < 65504 * 512 / 448
# / 4, about 18,700 (a bf16 residual that large is already broken); x scaled by 2^-9 in f16 loses bits below
# 2^-5, the products below ~2^-15, not the sum.
E4M3_X_SCALE = 1.0 / 512
E4M3_BITS_X_SCALE = 0.5
# How the one-request layers widen e4m3 pairs to f16 (``_dot4``): "cvt" (conversion instructions), "bits" (integer
# ops) or "mixed" (one pair each way). Measure with scripts/bench_gemv.py --fp8 --widening all.
E4M3_WIDENINGS = ("cvt", "bits", "mixed")
E4M3_WIDENING = "cvt"


def _x_scales(widening: str) -> tuple[float, float]:
    """x's scale for the first and the second pair of each quad of weights."""
    if widening not in E4M3_WIDENINGS:
        raise ValueError(f"models.gemv.E4M3_WIDENING must be one of {E4M3_WIDENINGS}, got {widening!r}")
    first = E4M3_BITS_X_SCALE if widening == "bits" else E4M3_X_SCALE
    second = E4M3_X_SCALE if widening == "cvt" else E4M3_BITS_X_SCALE
    return first, second


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


def _launch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None, bias: torch.Tensor | None,
    norm: torch.Tensor | None, eps: float, out: torch.Tensor, n: int, silu: bool, add: bool,
) -> None:
    rows, k = x.shape
    if rows != 1:
        raise ValueError(f"the fused GEMV takes one row, got {rows}")
    block_n, block_k, warps, stages = tile(n, k, silu, scale is not None)
    pdl = use_pdl(x.device.index or 0)
    if scale is not None:
        if k % 4:
            raise ValueError(f"FP8 weights in the fused GEMV are read four to an int32: {k} input features")
        x01_scale, x23_scale = _x_scales(E4M3_WIDENING)
        _row_gemv_e4m3[(triton.cdiv(n, block_n),)](
            x, weight.view(torch.int32), scale, bias if bias is not None else scale,
            norm if norm is not None else scale, out, eps, N=n, K=k, BLOCK_N=block_n, BLOCK_K=block_k,
            NORM=norm is not None, SILU=silu, ADD=add, HAS_BIAS=bias is not None, PDL=pdl,
            PRODUCT_SCALE=E4M3_X_SCALE, X01_SCALE=x01_scale, X23_SCALE=x23_scale, WIDEN=E4M3_WIDENING,
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
