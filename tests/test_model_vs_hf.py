"""Our Llama against HF transformers' LlamaForCausalLM on the same safetensors, float32."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaForCausalLM

from tests.helpers import make_engine, prefill_logits, relative_error

TOL = 1e-5


def hf_logits(model_dir, prompts: list[list[int]]) -> list[torch.Tensor]:
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        return [model(torch.tensor([p])).logits[0] for p in prompts]


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("chunk", [None, 7])
def test_tiny_llama_gqa_llama3_rope_matches_hf(tiny_llama_dir, page_size, chunk):
    gen = torch.Generator().manual_seed(1)
    # Lengths past original_max_position_embeddings (256) exercise the llama3 frequency scaling.
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 37, 300)]
    ref = hf_logits(tiny_llama_dir, prompts)
    engine = make_engine(tiny_llama_dir, f"cache.page_size={page_size}")
    ours = prefill_logits(engine, prompts, chunk=chunk)
    for o, r in zip(ours, ref):
        assert o.shape == r.shape
        assert relative_error(o, r) <= TOL


def test_tiny_llama_with_bias_and_tied_embeddings(tmp_path):
    from tests.conftest import make_tiny_llama

    model_dir = make_tiny_llama(tmp_path, tie=True, bias=True, kv_heads=4, rope_scaling=False, seed=3)
    prompts = [[3, 1, 4, 1, 5, 9, 2, 6], list(range(40))]
    ref = hf_logits(model_dir, prompts)
    ours = prefill_logits(make_engine(model_dir), prompts)
    for o, r in zip(ours, ref):
        assert relative_error(o, r) <= TOL


@pytest.mark.slow
def test_default_model_matches_hf(default_model_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(default_model_dir)
    texts = ["What is the capital of France?", "The quick brown fox jumps over the lazy dog. " * 12]
    prompts = [tok.encode(t) for t in texts]
    ref = hf_logits(default_model_dir, prompts)
    ours = prefill_logits(make_engine(default_model_dir), prompts)
    for o, r in zip(ours, ref):
        assert relative_error(o, r) <= TOL


def test_decode_steps_match_hf(tiny_llama_dir):
    gen = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 20, 33)]
    ref = hf_logits(tiny_llama_dir, prompts)
    ours = prefill_logits(make_engine(tiny_llama_dir), prompts, chunk=5, decode_tail=6)
    for o, r in zip(ours, ref):
        assert relative_error(o, r) <= TOL
