"""FP8 on the GPU (`pytest -m gpu`): the activation quantiser against torch's, the scaled GEMM and the FP8
GEMV against float64 on the dequantised operands at the 8B shape's widths, the FP8 KV cache's write and
decode kernels (ours and XQA) against float64, and a random Llama-3.2-1B-shaped model with FP8 weights and/or
an FP8 KV cache: CUDA-graph decode against eager decode, and prefill, chunked prefill and decode reading one
cache."""

from __future__ import annotations

import functools

import pytest
import torch

from models import add_norm, fp8
from models.ops import FLASHINFER_KERNELS
from runtime import LLM, SamplingParams
from tests.helpers import assert_same_quantization, prefill_logits, relative_error

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("width", [100, 4096, 14336, 28672 + 3])
def test_quantize_rows_kernel_equals_the_torch_path(width):
    """The Triton quantiser and the torch one (CPU) store the same bits, with a per-row amax given or not."""
    gen = torch.Generator(device="cuda").manual_seed(width)
    x = (torch.randn(37, width, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    x[3] = 0  # an all-zero row keeps a finite scale
    amax = x.abs().amax(dim=-1).float() * 1.5  # a rank's slice of longer rows
    for given in (None, amax):
        values, scale = fp8.quantize_rows(x, given)
        ref_values, ref_scale = fp8.quantize_rows(x.cpu(), None if given is None else given.cpu())
        assert torch.equal(scale.cpu(), ref_scale)
        assert torch.equal(values.cpu().view(torch.uint8), ref_values.view(torch.uint8))


@pytest.mark.parametrize(("rows", "hidden"), [(1, 4096), (37, 4096), (1030, 8192), (5, 576)])
def test_add_rms_norm_quantize_equals_the_unfused_kernels(rows, hidden):
    """Residual add, RMSNorm and per-token quantisation in one pass against the norm kernel, then the quantiser."""
    gen = torch.Generator(device="cuda").manual_seed(rows + hidden)
    x = (torch.randn(rows, hidden, device="cuda", generator=gen) * 3).to(torch.bfloat16)
    residual = torch.randn(rows, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    weight = (torch.rand(hidden, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    ref_x, ref_residual = add_norm.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    ref_values, ref_scale = fp8.quantize_rows(ref_x)
    before = x.clone()
    got, got_residual = add_norm.add_rms_norm_quantize(x, residual, weight, 1e-5)
    assert torch.equal(x, before) and got_residual.data_ptr() == residual.data_ptr()
    assert torch.equal(got_residual, ref_residual)
    assert_same_quantization(got, ref_values, ref_scale, exact_share=1.0, scale_rtol=2**-7)


@pytest.mark.parametrize(("rows", "n"), [(1, 14336), (300, 14336), (16, 28672), (9, 1536)])
def test_silu_mul_quantize_equals_the_unfused_kernels(rows, n):
    """SiLU x mul and per-token quantisation in one pass against flashinfer's SiLU x mul, then the quantiser."""
    gen = torch.Generator(device="cuda").manual_seed(rows + n)
    x = (torch.randn(rows, 2 * n, device="cuda", generator=gen) * 2).to(torch.bfloat16)
    ref_values, ref_scale = fp8.quantize_rows(FLASHINFER_KERNELS.silu_and_mul(x))
    got = fp8.silu_mul_quantize(x)
    assert got.dtype == torch.bfloat16
    assert_same_quantization(got, ref_values, ref_scale, exact_share=0.999, scale_rtol=2**-7)


@pytest.mark.parametrize(("page_size", "heads", "dim"), [(16, 8, 128), (16, 5, 64), (1, 2, 64)])
def test_widen_pages_equals_gather_then_convert(page_size, heads, dim):
    """Prefill's widened copy of an FP8 layer's pages: the gathered e4m3 values, exactly, in the model dtype."""
    from runtime.engine.attention.kv_fp8 import widen_pages

    gen = torch.Generator(device="cuda").manual_seed(page_size * heads)
    cache = torch.randn(2, 300, page_size, heads, dim, device="cuda", generator=gen).mul(40).to(fp8.FP8)
    pages = torch.randperm(300, device="cuda", generator=gen)[:77].to(torch.int32)
    assert torch.equal(widen_pages(cache, pages, torch.bfloat16), cache[:, pages.long()].to(torch.bfloat16))
    assert widen_pages(cache, pages[:0], torch.bfloat16).shape == (2, 0, page_size, heads, dim)


@pytest.mark.parametrize("rows", [1, 7, 256, 2048])
@pytest.mark.parametrize("out_features,in_features", [(6144, 4096), (4096, 14336)])
def test_fp8_gemm_against_float64(rows, out_features, in_features):
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, in_features, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(out_features, in_features, device="cuda", generator=gen) / in_features**0.5)
    values, scale = fp8.quantize_rows(w)
    out = fp8.linear(x, values, scale)
    xq, xs = fp8.quantize_rows(x)
    ref = fp8.dequantize_rows(xq, xs).double() @ fp8.dequantize_rows(values, scale).double().T
    assert out.dtype == torch.bfloat16
    assert relative_error(out, ref) <= 1e-2  # bf16 output rounding, fast accumulation; float64 operands exact


@pytest.mark.parametrize("rows", [3, 64, 256])
def test_fp8_gemm_scales_after_equals_the_row_wise_kernel(rows, monkeypatch):
    """Decode batches run a unit-scaled GEMM, then the scales; the row-wise kernel scales in its epilogue."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    x = torch.randn(rows, 4096, device="cuda", generator=gen).to(torch.bfloat16)
    values, scale = fp8.quantize_rows(torch.randn(1536, 4096, device="cuda", generator=gen) / 64)
    bias = torch.randn(1536, device="cuda", generator=gen).to(torch.bfloat16)
    assert rows * 1536 < fp8.SCALES_AFTER_MAX_OUTPUTS
    ours = fp8.linear(x, values, scale, bias)
    monkeypatch.setattr(fp8, "SCALES_AFTER_MAX_OUTPUTS", 0)
    row_wise = fp8.linear(x, values, scale, bias)
    assert ours.dtype == row_wise.dtype == torch.bfloat16
    assert relative_error(ours, row_wise.double()) <= 4e-3  # bf16 rounding of either, accumulation order


@pytest.mark.parametrize("widening", ["cvt", "bits", "mixed"])
def test_fp8_gemv_widens_every_e4m3_value_exactly(widening, monkeypatch):
    """Every e4m3 byte but NaN (signs, subnormals, 448), a row each, times x = 1, compiled (the PTX that widens
    the weights): exact in f16, float32 and bf16, so each output is exactly 8 x its row's value."""
    from models import gemv

    monkeypatch.setattr(gemv, "E4M3_WIDENING", widening)
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8, device="cuda")
    values = codes[:, None].expand(-1, 8).contiguous().view(fp8.FP8)
    out = torch.zeros(1, len(codes), device="cuda", dtype=torch.bfloat16)
    x = torch.ones(1, 8, device="cuda", dtype=torch.bfloat16)
    gemv.linear_add_(x, values, None, out, torch.ones(len(codes), device="cuda"))
    assert torch.equal(out[0].float(), 8 * values[:, 0].float())


@pytest.mark.parametrize("widening", ["cvt", "bits", "mixed"])
@pytest.mark.parametrize(("n", "k", "outlier"), [(6144, 4096, 0), (4096, 4096, 0), (14336, 4096, 0), (4096, 14336, 0),
                                                (3072, 2048, 0), (14336, 4096, 5000), (4096, 14336, 5000)])
def test_fp8_gemv_against_float64(n, k, outlier, widening, monkeypatch):
    """The fused single-token layers with FP8 weights (x x norm in f16 pairs; the weights widened by conversions,
    by integer ops or one pair each way): float64 on the dequantised weights; inputs with outliers of 5,000 (a
    residual stream's largest) do not overflow the f16 products."""
    from models import gemv

    monkeypatch.setattr(gemv, "E4M3_WIDENING", widening)

    gen = torch.Generator(device="cuda").manual_seed(n + k)
    h = torch.randn(1, k, device="cuda", generator=gen)
    if outlier:
        h[0, ::97] = outlier
    h = h.to(torch.bfloat16)
    norm_w = (torch.rand(k, device="cuda", generator=gen) + 0.5).to(torch.bfloat16)
    values, scale = fp8.quantize_rows(torch.randn(2 * n, k, device="cuda", generator=gen) / k**0.5)
    w = fp8.dequantize_rows(values, scale).double()
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()

    def rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
        return float((ours.double() - ref).norm() / ref.norm())

    assert rel(gemv.norm_linear(h, norm_w, 1e-5, values[:n], None, scale[:n]), normed @ w[:n].T) < 5e-3
    gate_up = normed @ w.T
    ref = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    assert rel(gemv.norm_linear_silu(h, norm_w, 1e-5, values, None, scale), ref) < 5e-3
    resid = torch.randn(1, n, device="cuda", generator=gen).to(torch.bfloat16)
    ref = resid.double() + hd @ w[:n].T
    gemv.linear_add_(h, values[:n], None, resid, scale[:n])
    assert rel(resid, ref) < 5e-3


def test_rope_and_store_writes_the_fp8_encoding():
    """The prefill write into an e4m3 cache: V bit for bit as kv_cache.quantize_kv encodes it, K as the
    float32 rotation encoded (up to one e4m3 step where FMA contraction moves a value across a boundary)."""
    from models.ops import rope_cos_sin_cache, rope_inv_freq, rope_torch
    from runtime.engine.attention.rope_store import rope_and_store
    from runtime.engine.kv_cache import KVCache, quantize_kv

    torch.manual_seed(0)
    dev, tokens, heads, kv_heads, dim = torch.device("cuda"), 37, 32, 8, 128
    cos_sin = rope_cos_sin_cache(4096, rope_inv_freq(dim, 500000.0, None)).to(dev)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device=dev) * 4
    q, kv = qkv[:, : heads * dim].view(tokens, heads, dim), qkv[:, heads * dim :].view(tokens, 2, kv_heads, dim)
    positions = torch.randint(0, 4096, (tokens,), device=dev)
    slots = torch.randperm(20 * 16, device=dev)[:tokens]
    q_ref, k_ref = q.float().clone(), kv[:, 0].float().clone()
    rope_torch(positions, q_ref, k_ref, cos_sin)
    v = kv[:, 1].clone()
    cache = KVCache(2, 20, 16, kv_heads, dim, fp8.FP8, dev)
    cache.scales[1] = torch.tensor([0.03, 0.02])
    rope_and_store(positions, q, kv, cos_sin, cache, 1, slots)
    stored_v = cache.v(1).reshape(-1, kv_heads, dim)[slots]
    assert torch.equal(stored_v.view(torch.uint8), quantize_kv(v, torch.tensor(0.02)).view(torch.uint8))
    stored_k = cache.k(1).reshape(-1, kv_heads, dim)[slots].float()
    torch.testing.assert_close(stored_k, quantize_kv(k_ref, torch.tensor(0.03)).float(), rtol=0.07, atol=2**-9)


@pytest.mark.parametrize(("heads", "kv_heads", "dim", "positions"),
                         [(32, 8, 128, [0, 15, 16, 700, 1999]), (9, 3, 64, [257, 40]), (28, 4, 128, [1500])])
def test_fp8_kv_decode_kernels_against_float64(heads, kv_heads, dim, positions):
    """paged_decode compiled, one request and several, bf16 queries over an e4m3 cache with a K and a V scale,
    against float64 over the dequantised cache; the new V written bit for bit."""
    from runtime.engine.attention import paged_decode as pd
    from tests.test_paged_decode import make_case, reference, run

    case = make_case(heads, kv_heads, dim, positions, 16, torch.bfloat16, device="cuda", seed=7, kv_fp8=True)
    ref, _, v_ref = reference(case)
    out = run(case, pd.chunk_tokens(len(positions), kv_heads))
    rel = float((out.double().cpu() - ref).norm() / ref.norm())
    assert rel < 5e-3, rel  # bf16 rounding of q, P and the output; e4m3 is in the reference
    flat = case["cache"].buffer[0].reshape(2, -1, kv_heads, dim)
    assert torch.equal(flat[1, case["out_loc"]].cpu().view(torch.uint8), v_ref.view(torch.uint8))


def on_hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


@pytest.mark.skipif(not on_hopper(), reason="XQA's FP8 kernel runs on Hopper")
@pytest.mark.parametrize(("heads", "kv_heads", "dim", "positions"),
                         [(32, 8, 128, [0, 15, 16, 700, 1999]), (32, 8, 64, [257, 40]), (64, 8, 128, [1500, 3])])
def test_xqa_fp8_decode_against_float64(heads, kv_heads, dim, positions):
    """XQA over an e4m3 cache with distinct K and V scales, after our RoPE + KV write into a dense q, against
    float64 over the dequantised cache: within e4m3's unit roundoff (2^-4), the rounding XQA applies to q and
    the probabilities; the new V written bit for bit."""
    from runtime.engine.attention.rope_store import rope_and_store
    from runtime.engine.attention.xqa_decode import XqaDecode
    from tests.test_paged_decode import make_case, reference

    case = make_case(heads, kv_heads, dim, positions, 16, torch.bfloat16, device="cuda", seed=7, kv_fp8=True)
    ref, _, v_ref = reference(case)
    cache = case["cache"]
    xqa = XqaDecode(case["table"], case["table"].shape[0], kv_heads, heads // kv_heads, dim)
    rotated = torch.empty_like(case["q"])
    rope_and_store(case["pos"], case["q"], case["kv"], case["cos_sin"], cache, 0, case["out_loc"], q_out=rotated)
    xqa.prepare(case["pos"], case["rows"])
    out = xqa.attend(rotated, cache.k(0), cache.v(0), *cache.scales[0].tolist()).reshape(len(positions), -1)
    rel = float((out.double().cpu() - ref).norm() / ref.norm())
    print(f"XQA against float64: {rel:.3e}")
    assert rel < 2**-4, rel
    flat = cache.buffer[0].reshape(2, -1, kv_heads, dim)
    assert torch.equal(flat[1, case["out_loc"]].cpu().view(torch.uint8), v_ref.view(torch.uint8))


@functools.cache  # the bf16 reference serves several tests
def _engine_logits(overrides: tuple[str, ...], use_graph: bool, chunk: int | None = None,
                   decode_tail: int = 0, xqa: bool = True) -> list[torch.Tensor]:
    """An FP8 cache decodes these few requests on XQA (on Hopper), or with ``xqa=False`` on the exact kernels
    (paged_decode): the batch-size rule between them is for speed, and would pick the latter here."""
    from runtime.engine.attention import flashinfer_backend

    saved = flashinfer_backend.XQA_MIN_BATCH
    flashinfer_backend.XQA_MIN_BATCH = 2 if xqa else 1 << 30
    try:
        return _run_engine(overrides, use_graph, chunk, decode_tail, xqa)
    finally:
        flashinfer_backend.XQA_MIN_BATCH = saved


def _run_engine(overrides: tuple[str, ...], use_graph: bool, chunk: int | None, decode_tail: int,
                xqa: bool) -> list[torch.Tensor]:
    cfg = ["engine.device=cuda", "model.path=configs/models/llama-3.2-1b", "model.random_weights=true",
           "model.max_seq_len=512", "scheduler.max_running_requests=8", *overrides]
    llm = LLM(overrides=cfg)
    engine = llm.engine
    assert engine.graph_runner is not None
    quantized = "model.quantization=fp8" in overrides
    kv_fp8 = "cache.dtype=fp8_e4m3" in overrides
    assert (engine.model.model.layers[0].mlp.down_proj.weight.dtype == fp8.FP8) == quantized
    assert (engine.kv_cache.buffer.dtype == fp8.FP8) == kv_fp8
    # On Hopper an FP8 cache must really decode on XQA (a build failure falls back, and would hide here).
    assert (engine.attn_backend.xqa is not None) == (kv_fp8 and on_hopper())
    assert bool(engine.attn_backend.xqa_graphs) == (kv_fp8 and on_hopper() and xqa)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (5, 60, 130)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs)
    seqs = [p + [(t * 7 + 3) % 10000 for t in range(16)] for p in prompts]  # the same tokens for every model
    logits = [x[-8:] for x in prefill_logits(engine, seqs, chunk, decode_tail, use_graph)]
    llm.shutdown()
    del llm, engine
    torch.cuda.empty_cache()
    return logits


_KV = ("cache.dtype=fp8_e4m3",)
_BOTH = ("model.quantization=fp8", "cache.dtype=fp8_e4m3")
_KV_BF16_WEIGHTS = ("model.quantization=none", "cache.dtype=fp8_e4m3")
_BF16 = ("model.quantization=none",)


@pytest.mark.parametrize(("fp8_overrides", "xqa"), [(("model.quantization=fp8",), True), (_KV, True), (_KV, False),
                                                    (_BOTH, True), (_BOTH, False)],
                         ids=["weights", "kv", "kv-exact", "both", "both-exact"])
def test_fp8_model_graph_decode_equals_eager(fp8_overrides, xqa):
    """CUDA-graph decode against eager decode (different kernels: FP8 rounding of the activations turns their
    last-bit differences into visible ones), within FP8's own distance from the bf16 model; an FP8 cache's
    batches on XQA, or (``-exact``) on paged_decode, eagerly and in graphs alike."""
    bf16 = _engine_logits(_BF16, False, decode_tail=8)
    eager = _engine_logits(fp8_overrides, False, decode_tail=8, xqa=xqa)
    graph = _engine_logits(fp8_overrides, True, decode_tail=8, xqa=xqa)
    for g, e, b in zip(graph, eager, bf16):
        graph_err, fp8_err = relative_error(g, e), relative_error(e, b)
        print(f"graph vs eager {graph_err:.3e}; FP8 vs bf16 {fp8_err:.3e}")
        assert graph_err <= fp8_err and fp8_err > 1e-3


def test_fp8_kv_prefill_chunked_prefill_and_decode_read_one_cache():
    """Prefill (flashinfer over the widened pages), 16-token chunks and graph decode with the exact kernels (the
    Triton kernels over e4m3) attend over the same cached values: they agree to bf16 noise, far inside FP8's
    distance from bf16."""
    whole = _engine_logits(_KV_BF16_WEIGHTS, False)
    chunked = _engine_logits(_KV_BF16_WEIGHTS, False, chunk=16)
    decoded = _engine_logits(_KV_BF16_WEIGHTS, True, decode_tail=8, xqa=False)
    bf16 = _engine_logits(_BF16, False)
    for w, c, d, b in zip(whole, chunked, decoded, bf16):
        errors = relative_error(c, w), relative_error(d, w), relative_error(w, b)
        print("chunked, decoded vs prefill; FP8 KV vs bf16:", [f"{e:.3e}" for e in errors])
        assert max(errors[:2]) < 0.5 * errors[2] and errors[2] > 1e-3


@pytest.mark.skipif(not on_hopper(), reason="XQA's FP8 kernel runs on Hopper")
def test_fp8_kv_xqa_decode_costs_less_than_the_cache():
    """Graph decode on XQA reads the same cache as prefill; its own rounding of q and the probabilities to e4m3
    moves the logits less than storing the cache in e4m3 moved them from bf16."""
    whole = _engine_logits(_KV_BF16_WEIGHTS, False)
    decoded = _engine_logits(_KV_BF16_WEIGHTS, True, decode_tail=8)
    exact = _engine_logits(_KV_BF16_WEIGHTS, True, decode_tail=8, xqa=False)
    bf16 = _engine_logits(_BF16, False)
    for w, d, e, b in zip(whole, decoded, exact, bf16):
        errors = relative_error(d, w), relative_error(e, w), relative_error(w, b)
        print("XQA decode, exact decode vs prefill; FP8 KV vs bf16:", [f"{x:.3e}" for x in errors])
        assert errors[1] < errors[0] < errors[2]


_MIXED = {"architectures": ["LlamaForCausalLM"], "vocab_size": 4096, "hidden_size": 512, "intermediate_size": 1536,
          "num_hidden_layers": 3, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 64,
          "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False}


def test_an_fp8_checkpoints_unquantised_layers_run_in_bf16_beside_fp8_ones(tmp_path):
    """A checkpoint whose ignore list keeps layer 0's down_proj and layer 1's q/k/v unquantised: those stay bf16,
    and the kernels before them (fused SiLU and norm quantisers, the one-token GEMVs) hand them bf16 inputs.
    Batched CUDA-graph decode equals eager within FP8's distance from the dequantised model, and that distance
    is FP8 noise, not a misread input (which gives errors near 1). The one-token layers, which leave the
    activations unquantised (another rounding than eager's), are within FP8 noise of the dequantised model."""
    import json

    from scripts.make_random_checkpoint import write_random_checkpoint
    from tests.test_fp8_checkpoint import _compressed_tensors, _ct_weights, _projections, _write_fp8

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.json").write_text(json.dumps(_MIXED))
    base = write_random_checkpoint(tmp_path / "config", tmp_path / "base", seed=5, dtype=torch.bfloat16)
    ignored = ("model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.k_proj",
               "model.layers.1.self_attn.v_proj")
    ckpt = _write_fp8(base, tmp_path / "fp8", _compressed_tensors({"group_0": (["Linear"], _ct_weights("channel"))},
                                                                 ignore=["lm_head", *ignored]),
                      _projections("channel", skip=tuple(name.removeprefix("model.") for name in ignored)))
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 4096, (n,), generator=gen).tolist() for n in (9, 70, 140)]
    runs = {}
    for quantization in ("auto", "none"):
        llm = LLM(overrides=["engine.device=cuda", f"model.path={ckpt}", f"model.quantization={quantization}",
                             "model.max_seq_len=512", "scheduler.max_running_requests=8"])
        engine = llm.engine
        assert engine.graph_runner is not None
        layers = engine.model.model.layers
        if quantization == "auto":
            stored = {(i, name): getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)
                      .weight.dtype for i, layer in enumerate(layers)
                      for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")}
            dense = {(0, "down_proj"), (1, "qkv_proj")}
            assert all((dtype == torch.bfloat16) == (key in dense) for key, dtype in stored.items()), stored
            assert layers[0].mlp.silu_and_mul is not fp8.silu_mul_quantize  # its down_proj reads bf16
            assert layers[1].input_layernorm.add_norm is not add_norm.add_rms_norm_quantize  # so does its qkv
            assert layers[2].input_layernorm.add_norm is add_norm.add_rms_norm_quantize
        runs[quantization, "eager"] = prefill_logits(engine, seqs, None, 8, False)
        runs[quantization, "graph"] = prefill_logits(engine, seqs, None, 8, True)
        runs[quantization, "alone"] = [prefill_logits(engine, [s], None, 8, True)[0] for s in seqs]
        llm.shutdown()
        del llm, engine, layers
        torch.cuda.empty_cache()
    for i in range(len(seqs)):
        eager, reference = runs["auto", "eager"][i][-8:], runs["none", "eager"][i][-8:]
        fp8_err = relative_error(eager, reference)
        graph_err = relative_error(runs["auto", "graph"][i][-8:], eager)
        alone_err = relative_error(runs["auto", "alone"][i][-8:], reference)
        print(f"FP8 vs dequantised: eager {fp8_err:.3e}, one-token graph {alone_err:.3e}; graph vs eager {graph_err:.3e}")
        assert 1e-3 < fp8_err < 0.15 and graph_err <= fp8_err and alone_err < 0.15
