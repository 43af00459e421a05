"""The fused small-batch GEMV path (models/gemv.py): the Triton kernels against float64, and the decoder
layers that use them against HF transformers, on CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 where there is no GPU; tests/test_gpu_kernels.py runs the same kernels compiled)."""

from __future__ import annotations

import pytest
import torch

from models import gemv
from tests.helpers import make_engine, prefill_logits, relative_error
from tests.test_model_families import _families, _hf, _save_random


def _rms(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = h.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize("n,k", [(96, 64), (40, 200), (300, 136), pytest.param(1000, 1100, marks=pytest.mark.slow),
                                 (40, 2500)])
def test_kernels_match_float64(n, k):
    """Odd sizes (masked tails in N and K; K over one block: 2500 for every kernel, 1100 for SiLU), with and
    without bias."""
    rows = 1
    gen = torch.Generator().manual_seed(n + k)
    h = torch.randn(rows, k, generator=gen)
    norm_w = torch.rand(k, generator=gen) + 0.5
    w = torch.randn(2 * n, k, generator=gen) * 0.1
    bias = torch.randn(2 * n, generator=gen)
    normed = _rms(h, norm_w, 1e-5)

    ref = normed @ w[:n].double().T + bias[:n].double()
    assert _rel(gemv.norm_linear(h, norm_w, 1e-5, w[:n], bias[:n]), ref) < 1e-6
    assert _rel(gemv.norm_linear(h, norm_w, 1e-5, w[:n], None), normed @ w[:n].double().T) < 1e-6

    gate_up = normed @ w.double().T + bias.double()
    ref = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    assert _rel(gemv.norm_linear_silu(h, norm_w, 1e-5, w, bias), ref) < 1e-6

    x, resid = torch.randn(rows, k, generator=gen), torch.randn(rows, n, generator=gen)
    ref = resid.double() + x.double() @ w[:n].double().T + bias[:n].double()
    gemv.linear_add_(x, w[:n], bias[:n], resid)
    assert _rel(resid, ref) < 1e-6


@pytest.mark.parametrize("widening", ["cvt", "bits", "mixed"])
@pytest.mark.parametrize("n,k,outlier", [(40, 200, 0.0), (40, 2500, 0.0), (40, 2500, 5000.0)])
def test_fp8_weights_match_float64_of_the_dequantised_weights(n, k, outlier, widening, monkeypatch):
    """FP8 weights with a scale per row (models/fp8.py), four e4m3 to an int32 times x (x norm) in f16 pairs,
    the weights widened by conversions, by integer ops or one pair each way: every kernel against float64 of the
    dequantised weights. Rounding x to f16 (11 bits) costs ~1e-4; inputs with outliers of 5,000 (a residual
    stream's largest) must not overflow the f16 products."""
    from models import fp8

    monkeypatch.setattr(gemv, "E4M3_WIDENING", widening)

    gen = torch.Generator().manual_seed(n * k)
    h, x = torch.randn(1, k, generator=gen), torch.randn(1, k, generator=gen)
    if outlier:
        h[0, ::97] = outlier
        x[0, 1::97] = -outlier
    norm_w = torch.rand(k, generator=gen) + 0.5
    values, scale = fp8.quantize_rows(torch.randn(2 * n, k, generator=gen) * 0.1)
    w = fp8.dequantize_rows(values, scale).double()
    bias = torch.randn(2 * n, generator=gen)
    normed = _rms(h, norm_w, 1e-5)

    ref = normed @ w[:n].T + bias[:n].double()
    assert _rel(gemv.norm_linear(h, norm_w, 1e-5, values[:n], bias[:n], scale[:n]), ref) < 1e-3
    gate_up = normed @ w.T
    ref = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    assert _rel(gemv.norm_linear_silu(h, norm_w, 1e-5, values, None, scale), ref) < 1e-3
    resid = torch.randn(1, n, generator=gen)
    ref = resid.double() + x.double() @ w[:n].T
    gemv.linear_add_(x, values[:n], None, resid, scale[:n])
    assert _rel(resid, ref) < 1e-3


@pytest.mark.parametrize("widening", ["cvt", "bits", "mixed"])
def test_fp8_gemv_widens_every_e4m3_value_exactly(widening, monkeypatch):
    """Every e4m3 byte but NaN (signs, subnormals, 448), a row each, times x = 1: each product and sum is exact
    in f16 and float32, so the row's output is exactly 8 x its value, whichever way the weights are widened."""
    from models import fp8

    monkeypatch.setattr(gemv, "E4M3_WIDENING", widening)
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    values = codes[:, None].expand(-1, 8).contiguous().view(fp8.FP8)
    out = torch.zeros(1, len(codes))
    gemv.linear_add_(torch.ones(1, 8), values, None, out, torch.ones(len(codes)))
    assert torch.equal(out[0], 8 * values[:, 0].float())


def test_an_unknown_e4m3_widening_is_named(monkeypatch):
    from models import fp8

    monkeypatch.setattr(gemv, "E4M3_WIDENING", "f32")
    values, scale = fp8.quantize_rows(torch.randn(8, 8))
    with pytest.raises(ValueError, match="E4M3_WIDENING.*'f32'"):
        gemv.linear_add_(torch.ones(1, 8), values, None, torch.zeros(1, 8), scale)


def test_fp8_weights_need_four_input_features_an_int32():
    from models import fp8

    values, scale = fp8.quantize_rows(torch.randn(32, 66))
    with pytest.raises(ValueError, match="four to an int32: 66 input features"):
        gemv.linear_add_(torch.randn(1, 66), values, None, torch.zeros(1, 32), scale)


def test_more_than_one_row_is_refused():
    with pytest.raises(ValueError, match="one row, got 2"):
        gemv.norm_linear(torch.randn(2, 64), torch.ones(64), 1e-5, torch.randn(32, 64), None)


def _fused_engine(model_dir, monkeypatch):  # noqa: ANN001, ANN202
    """A CPU engine whose model takes the fused path for single-token steps (the GPU engine's rule),
    counting the fused layer calls so the test knows the path ran."""
    engine = make_engine(model_dir)
    engine.model.model.fused_gemv = True
    calls = {"n": 0}
    inner = gemv.norm_linear_silu

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls["n"] += 1
        return inner(*args, **kwargs)

    monkeypatch.setattr(gemv, "norm_linear_silu", counted)
    return engine, calls


@pytest.mark.slow  # the Triton interpreter runs every fused layer
def test_fused_layers_match_hf_llama_with_bias(tmp_path, monkeypatch):
    """attention_bias puts a bias on q/k/v and on o_proj; a prompt fed one token per step (all fused, the
    last two as decode steps) and, in the same engine, two prompts together (2-token steps, unfused);
    every position's logits against HF float32."""
    from tests.conftest import make_tiny_llama
    from tests.test_model_vs_hf import hf_logits

    model_dir = make_tiny_llama(tmp_path, bias=True, seed=5)
    prompts = [[3, 1, 4, 1, 5, 9, 2], [2, 7, 1, 8, 2, 8], [1, 6, 1, 8, 0, 3]]
    ref = hf_logits(model_dir, prompts)
    engine, calls = _fused_engine(model_dir, monkeypatch)
    ours = prefill_logits(engine, prompts[:1], chunk=1, decode_tail=2)
    assert calls["n"] == 7 * 3  # 7 single-token steps, 3 layers each
    ours += prefill_logits(engine, prompts[1:], chunk=1, decode_tail=2)
    assert calls["n"] == 7 * 3
    for o, r in zip(ours, ref):
        assert relative_error(o, r) <= 1e-5


@pytest.mark.slow  # the Triton interpreter runs every fused layer
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_fused_layers_match_hf_qwen(family, tmp_path, monkeypatch):
    """Qwen2's q/k/v bias and Qwen3's per-head q/k norm on the fused path; a 9-token chunk takes the
    ordinary path in the same run."""
    cls, cfg = _families()[family]
    path = _save_random(cls, cfg, tmp_path)
    prompts = [[5, 8, 13, 21, 34, 55, 89, 144, 233, 17, 6]]
    model = _hf(path)
    with torch.no_grad():
        ref = [model(torch.tensor([p])).logits[0] for p in prompts]
    engine, calls = _fused_engine(path, monkeypatch)
    ours = prefill_logits(engine, prompts, chunk=9, decode_tail=2)
    assert calls["n"] == 2 * 2  # the two decode steps, 2 layers each; the 9-token chunk is unfused
    for o, r in zip(ours, ref):
        assert relative_error(o, r) <= 1e-5
