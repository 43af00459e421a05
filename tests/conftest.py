"""Shared fixtures: the default model, a tiny random Llama, and the `gpu` marker."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    # Triton kernels (models/gemv.py) run on CPU tensors through Triton's interpreter; read when a kernel is
    # decorated, so before any test module imports one.
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run `pytest -m gpu tests` on a machine with one)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    from models.weights.default_model import ensure_default_model

    return ensure_default_model(quiet=True)


def perturb_norms_and_biases(model: torch.nn.Module) -> torch.nn.Module:
    """HF's init leaves norms at 1 and biases at 0: perturb them so a misused one cannot pass unnoticed."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    return model


def make_tiny_llama(path: Path, *, vocab: int = 512, heads: int = 8, kv_heads: int = 2, layers: int = 3,
                    tie: bool = False, rope_scaling: bool = True, seed: int = 0, bias: bool = False) -> Path:
    """A random HF Llama checkpoint (safetensors + config.json + generation_config.json)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=2048,
        rms_norm_eps=1e-5, tie_word_embeddings=tie, attention_bias=bias,
        rope_theta=50000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 256} if rope_scaling else None,
        eos_token_id=vocab - 1, bos_token_id=1,
    )
    model = perturb_norms_and_biases(LlamaForCausalLM(cfg).to(torch.float32))
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": vocab - 1}))
    return path


def make_tiny_text_llama(path: Path, default_model_dir: Path, seed: int) -> Path:
    """A tiny random Llama (4 heads: TP=2 divides them) with the default model's tokenizer and chat template,
    so rows are text and chats."""
    make_tiny_llama(path, vocab=49152, heads=4, kv_heads=2, layers=2, seed=seed)
    for f in default_model_dir.iterdir():
        if f.name.startswith("tokenizer") or f.name == "chat_template.jinja":
            shutil.copy(f, path / f.name)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))
