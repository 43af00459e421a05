"""models/fused_moe.py's Triton kernels against a float64 reference, with weights in the model dtype and in e4m3
with a scale per row, on CPU through Triton's interpreter (conftest sets TRITON_INTERPRET=1 where there is no GPU;
tests/test_gpu_moe.py runs them compiled in bf16 at real widths)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from models import fp8, fused_moe
from models.config import ModelConfig
from models.moe import SparseMoE
from models.ops import TORCH_KERNELS
from tests.helpers import relative_error

pytestmark = pytest.mark.skipif(fused_moe.triton is None or (not torch.cuda.is_available()
                                                             and os.environ.get("TRITON_INTERPRET") != "1"),
                                reason="needs Triton (its interpreter on CPU)")


def e4m3_round_trip(rows: torch.Tensor) -> torch.Tensor:
    """``rows`` as they are after quantisation to e4m3 with a scale per row (in float64)."""
    return dequantized(*fp8.quantize_rows(rows.float()))


def reference_moe(x, logits, w13, w2, top_k: int, renormalize: bool, dtype: torch.dtype = torch.float64,
                  e4m3_activations: bool = False) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: ANN001
    """Each expert on its tokens in ``dtype`` (float64: the reference; bf16: torch's own rounding, a budget);
    also the expert ids chosen. ``e4m3_activations``: the tokens, and the SiLU x up rows once rounded to x's
    dtype (as the kernel stores them), go through e4m3 first."""
    act_dtype = x.dtype
    if e4m3_activations:
        x = e4m3_round_trip(x)
    x, w13, w2 = x.to(dtype), w13.to(dtype), w2.to(dtype)
    weights, ids = torch.topk(torch.softmax(logits.double(), dim=-1), top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    weights = weights.to(dtype)
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for expert in ids.unique().tolist():
        tokens, slot = torch.nonzero(ids == expert, as_tuple=True)
        gate_up = x[tokens] @ w13[expert].T
        act = F.silu(gate_up[:, :inter]) * gate_up[:, inter:]
        if e4m3_activations:
            act = e4m3_round_trip(act.to(act_dtype)).to(dtype)
        out.index_add_(0, tokens, (act @ w2[expert].T) * weights[tokens, slot, None])
    return out, ids


def random_layer(tokens: int, experts: int, hidden: int, inter: int, empty: int | None, device: str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Tokens, router logits (expert ``empty`` never chosen) and weights scaled to unit-size outputs."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    logits = torch.randn(tokens, experts, generator=gen)
    if empty is not None:
        logits[:, empty] = -30.0
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden**0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter**0.5
    return tuple(t.to(device=device, dtype=dtype) for t in (x, logits, w13, w2))


def quantized_experts(w13: torch.Tensor, w2: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The experts in e4m3 with a float32 scale per row, as models/moe.py stores them: (w13, w13_scale, w2,
    w2_scale)."""
    return (*fp8.quantize_experts(w13), *fp8.quantize_experts(w2))


def dequantized(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return values.double() * scale.double()[..., None]


# (tokens, experts, top_k, hidden, intermediate, renormalise, expert that gets no token): K and N not multiples
# of the tiles, a single token, more pairs per expert than one row block holds, experts not a power of two.
SHAPES = [(1, 8, 2, 64, 96, True, None), (5, 8, 2, 80, 40, True, 3), (40, 6, 4, 72, 64, False, 0),
          (70, 4, 1, 64, 32, False, None), (9, 12, 8, 48, 24, True, 11)]


@pytest.mark.parametrize("shape", SHAPES)
def test_fused_moe_matches_float64(shape):
    tokens, experts, top_k, hidden, inter, renormalize, empty = shape
    x, logits, w13, w2 = random_layer(tokens, experts, hidden, inter, empty)
    touched = torch.zeros((), dtype=torch.int64)
    out = fused_moe.fused_moe(x, logits, w13, w2, top_k, renormalize, touched)
    ref, ids = reference_moe(x, logits, w13, w2, top_k, renormalize)
    assert out.shape == (tokens, hidden) and out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    assert touched.item() == len(set(ids.flatten().tolist()))
    if empty is not None:
        assert empty not in ids


# The first three, and one at the wide tile, whose FP8 K step is twice BLOCK_K (hidden and intermediate not
# multiples of it).
FP8_SHAPES = [*SHAPES[:3], (200, 4, 2, 160, 72, True, None)]


@pytest.mark.parametrize("shape", FP8_SHAPES)
def test_fused_moe_with_fp8_weights_matches_float64_of_their_values(shape):
    """e4m3 experts multiply e4m3 activations (a scale per row): the reference is float64 over the dequantised
    weights and the activations as quantised, so only the float32 accumulation differs."""
    tokens, experts, top_k, hidden, inter, renormalize, empty = shape
    x, logits, w13, w2 = random_layer(tokens, experts, hidden, inter, empty)
    q13, s13, q2, s2 = quantized_experts(w13, w2)
    assert (fused_moe.block_k(fused_moe.tile(tokens * top_k, experts)[0], True) > fused_moe.BLOCK_K) == (
        shape is FP8_SHAPES[-1])
    out = fused_moe.fused_moe(x, logits, q13, q2, top_k, renormalize, None, s13, s2)
    d13, d2 = dequantized(q13, s13), dequantized(q2, s2)
    ref, _ = reference_moe(x, logits, d13, d2, top_k, renormalize, e4m3_activations=True)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    # The activations did go through e4m3: against exact ones on the same weights, about one more e4m3
    # rounding per GEMM input (3.2-3.7% measured at these shapes).
    weight_only, _ = reference_moe(x, logits, d13, d2, top_k, renormalize)
    assert 1e-2 < relative_error(out, weight_only) < 0.08
    # Against the unquantised layer: one e4m3 GEMM errs about 3.7% on Gaussian weights and inputs, so two with
    # both quantised about 5-7%.
    unquantized, _ = reference_moe(x, logits, w13, w2, top_k, renormalize)
    err = relative_error(out, unquantized)
    print(f"{shape}: e4m3 experts {err:.3e} from the unquantised layer")
    assert 1e-2 < err < 0.12
    with pytest.raises(ValueError, match="both w13 and w2"):
        fused_moe.fused_moe(x, logits, q13, q2, top_k, renormalize, None, s13, None)


def test_route_layout_is_each_experts_pairs_padded_to_blocks():
    tokens, experts, top_k, block_m = 37, 6, 3, 16
    _, logits, _, _ = random_layer(tokens, experts, 8, 8, empty=2)
    weights, sorted_pairs, block_expert, total = fused_moe.route(logits, top_k, True, block_m)
    ref_w, ref_ids = torch.topk(torch.softmax(logits.double(), -1), top_k, dim=-1)
    torch.testing.assert_close(weights.double(), (ref_w / ref_w.sum(-1, keepdim=True)).flatten(), rtol=1e-6, atol=0)
    counts = torch.bincount(ref_ids.flatten(), minlength=experts)
    padded = (counts + block_m - 1) // block_m * block_m
    assert total.item() == padded.sum().item()
    rows = sorted_pairs[: total.item()]
    real = rows[rows < tokens * top_k]
    assert sorted(real.tolist()) == list(range(tokens * top_k))  # every pair exactly once; the rest is padding
    for block in range(total.item() // block_m):
        pairs = rows[block * block_m : (block + 1) * block_m]
        pairs = pairs[pairs < tokens * top_k]
        assert (ref_ids.flatten()[pairs] == block_expert[block]).all()
    assert (block_expert[total.item() // block_m :] == experts).all()  # past the end: no expert


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # the interpreter computes with the NaN row
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_token_with_a_nan_router_logit_spoils_only_its_own_output(bad):
    """A NaN (or +inf: inf - inf) logit makes its token's probabilities NaN; the token must still be routed to
    experts that exist (an id past the last would be written out of bounds), its output is NaN as on the torch
    path, and every other token's output is what it is without that token's logits spoiled."""
    tokens, experts, top_k, hidden, inter = 9, 6, 2, 48, 32
    x, logits, w13, w2 = random_layer(tokens, experts, hidden, inter, None)
    spoiled = logits.clone()
    spoiled[4, 2] = bad
    _, sorted_pairs, block_expert, total = fused_moe.route(spoiled, top_k, True, 16)
    rows = sorted_pairs[: total.item()]
    assert sorted(rows[rows < tokens * top_k].tolist()) == list(range(tokens * top_k))
    assert (block_expert[: total.item() // 16] < experts).all()
    out = fused_moe.fused_moe(x, spoiled, w13, w2, top_k, True)
    clean = fused_moe.fused_moe(x, logits, w13, w2, top_k, True)
    assert out[4].isnan().all()
    others = torch.arange(tokens) != 4
    torch.testing.assert_close(out[others], clean[others], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("quantization", ["none", "fp8"])
def test_sparse_moe_fused_equals_its_torch_path(quantization):
    cfg = ModelConfig(vocab_size=32, hidden_size=64, intermediate_size=128, num_layers=1, num_heads=4,
                      num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e4, rope_scaling=None,
                      max_position_embeddings=64, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      torch_dtype="float32", architecture="Qwen3MoeForCausalLM", moe=True, num_experts=8,
                      experts_per_token=2, moe_intermediate_size=48, sparse_layers=(0,), quantization=quantization)
    layer = SparseMoE(cfg, 0, TORCH_KERNELS)
    gen = torch.Generator().manual_seed(1)
    experts = layer.experts
    assert (experts.w13.dtype == fp8.FP8) == (quantization == "fp8")
    for param in (layer.gate.weight, experts.w13, experts.w2):
        param.data = torch.randn(param.shape, generator=gen) / param.shape[-1] ** 0.5
    if quantization == "fp8":
        experts.w13.data, experts.w13_scale.data, experts.w2.data, experts.w2_scale.data = quantized_experts(
            experts.w13.data, experts.w2.data)
    x = torch.randn(13, cfg.hidden_size, generator=gen)
    expected = layer(x)
    layer.fused = True
    torch.testing.assert_close(layer(x), expected, rtol=1e-5, atol=1e-5)
