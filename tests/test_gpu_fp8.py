"""FP8 weights on the GPU (`pytest -m gpu`): the scaled GEMM against float64 on the dequantised operands at
the 8B shape's widths, and a random Llama-3.2-1B-shaped model in FP8 decoding alike eagerly and in CUDA graphs."""

from __future__ import annotations

import pytest
import torch

from models import fp8
from runtime import LLM, SamplingParams
from tests.helpers import prefill_logits, relative_error

pytestmark = pytest.mark.gpu


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
    assert relative_error(out, ref) <= 1e-2  # bf16 output rounding; the operands are exact in float64


def _decode_logits(quantization: str, use_graph: bool) -> list[torch.Tensor]:
    overrides = ["engine.device=cuda", "model.path=configs/models/llama-3.2-1b", "model.random_weights=true",
                 f"model.quantization={quantization}", "model.max_seq_len=512", "scheduler.max_running_requests=8"]
    llm = LLM(overrides=overrides)
    engine = llm.engine
    assert engine.graph_runner is not None
    assert (engine.model.model.layers[0].mlp.down_proj.weight.dtype == fp8.FP8) == (quantization == "fp8")
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 10000, (n,), generator=gen).tolist() for n in (5, 60, 130)]
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=16, ignore_eos=True))
    assert all(len(o.token_ids) == 16 for o in outs)
    seqs = [p + [(t * 7 + 3) % 10000 for t in range(16)] for p in prompts]  # the same tokens for every model
    logits = [x[-8:] for x in prefill_logits(engine, seqs, decode_tail=8, use_graph=use_graph)]
    llm.shutdown()
    del llm, engine
    torch.cuda.empty_cache()
    return logits


def test_fp8_model_graph_decode_equals_eager():
    """CUDA-graph decode against eager decode (different attention kernels: FP8 rounding of the activations
    turns their last-bit differences into visible ones), within FP8's own distance from the bf16 model."""
    bf16 = _decode_logits("none", False)
    eager = _decode_logits("fp8", False)
    graph = _decode_logits("fp8", True)
    for g, e, b in zip(graph, eager, bf16):
        graph_err, fp8_err = relative_error(g, e), relative_error(e, b)
        print(f"graph vs eager {graph_err:.3e}; FP8 vs bf16 {fp8_err:.3e}")
        assert graph_err <= fp8_err and fp8_err > 1e-3
