"""Our Llama against HF transformers' LlamaForCausalLM on the same safetensors, float32."""

from __future__ import annotations

import json
import shutil

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


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


@pytest.mark.parametrize("rope", [
    {"rope_scaling": {"rope_type": "default", "rope_theta": 1e6}},  # a legacy key, theta inside it
    {"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6}},  # the dict's theta wins
    {"rope_parameters": {**LLAMA3, "rope_theta": 5e5}},  # pre-training length: max_position_embeddings
    # transformers puts a top-level original_max_position_embeddings before the dict's
    {"original_max_position_embeddings": 512,
     "rope_parameters": {**LLAMA3, "rope_theta": 5e5, "original_max_position_embeddings": 256}},
])
def test_rope_keys_are_read_as_hf_reads_them(tiny_llama_dir, tmp_path, rope):
    model_dir = shutil.copytree(tiny_llama_dir, tmp_path / "model")
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("rope_theta", "rope_scaling", "rope_parameters"):
        config.pop(key, None)
    (model_dir / "config.json").write_text(json.dumps(config | rope))
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (6, 400)]
    ref = hf_logits(model_dir, prompts)
    for o, r in zip(prefill_logits(make_engine(model_dir), prompts), ref):
        assert relative_error(o, r) <= TOL


def test_llama3_rope_without_its_factors_is_refused_naming_them():
    from transformers import LlamaConfig

    from models.config import ModelConfig

    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 64, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 4, "rope_parameters": {"rope_type": "llama3", "factor": 8.0}}
    with pytest.raises(KeyError, match="low_freq_factor"):  # transformers refuses it too
        LlamaConfig.from_dict(config)
    with pytest.raises(ValueError, match=r"config.json: rope_parameters of rope_type 'llama3' lacks "
                                         r"low_freq_factor, high_freq_factor; add them"):
        ModelConfig.from_dict(config)


@pytest.mark.parametrize("key", ["engine.kernels", "engine.attention_backend"])
def test_flashinfer_on_cpu_is_refused_before_the_weights_load(tiny_llama_dir, monkeypatch, key):
    import runtime.engine.engine as engine_module

    def no_load(*args, **kwargs):
        raise AssertionError("the weights loaded before the setting was checked")

    monkeypatch.setattr(engine_module, "load_model", no_load)
    with pytest.raises(ValueError, match=f"^{key}=flashinfer needs a CUDA device$"):
        make_engine(tiny_llama_dir, f"{key}=flashinfer")
