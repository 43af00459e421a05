"""Qwen2, Qwen3 and Mistral against HF transformers' own classes on tiny random checkpoints (float32, CPU):
logits, greedy generation, and TP=2 equal to TP=1 over gloo."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.helpers import make_engine, prefill_logits, relative_error
from tests.tp_utils import run_ranks

VOCAB = 320
COMMON = dict(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=VOCAB - 1)


def _families() -> dict[str, tuple]:
    from transformers import (
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    return {
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**COMMON, rope_theta=1e6, tie_word_embeddings=True,
                                                use_sliding_window=False, sliding_window=4096)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON, head_dim=48, rope_theta=1e6, tie_word_embeddings=False)),
        "mistral": (MistralForCausalLM, MistralConfig(**COMMON, rope_theta=1e4, sliding_window=None)),
    }


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral"])
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    cls, cfg = _families()[request.param]
    torch.manual_seed(7)
    model = cls(cfg).to(torch.float32)
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: perturb them so errors show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("bias"):
                p.normal_(0, 0.05)
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": VOCAB - 1}))
    return request.param, path


def _hf(path: Path):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _prompts(seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in (5, 23, 70)]


def test_logits_match_hf(family_dir):
    name, path = family_dir
    prompts = _prompts(1)
    model = _hf(path)
    with torch.no_grad():
        ref = [model(torch.tensor([p])).logits[0] for p in prompts]
    ours = prefill_logits(make_engine(path), prompts, chunk=9, decode_tail=3)
    for o, r in zip(ours, ref):
        assert relative_error(o, r) <= 1e-5, name
    if name == "qwen2":
        assert any("q_proj.bias" in n for n, _ in model.named_parameters())
        assert not any("o_proj.bias" in n for n, _ in model.named_parameters())


def test_greedy_generation_matches_hf(family_dir):
    name, path = family_dir
    prompts = _prompts(2)
    model = _hf(path)
    llm = LLM(str(path), overrides=["engine.device=cpu", "model.dtype=float32"])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=12, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=12, do_sample=False, min_new_tokens=12)
        assert o.token_ids == ref[0, len(p):].tolist(), name


def _tp_logits(rank: int, path: str, prompts: list[list[int]]) -> list[torch.Tensor]:
    return prefill_logits(make_engine(path, "cache.page_size=4"), prompts, chunk=11, decode_tail=2)


@pytest.mark.slow
def test_tp2_equals_tp1(family_dir):
    name, path = family_dir
    prompts = _prompts(3)
    single = _tp_logits(0, str(path), prompts)
    ranks = run_ranks(2, _tp_logits, str(path), prompts)
    for i in range(len(prompts)):
        assert relative_error(ranks[0][i], single[i]) <= 1e-5 and torch.equal(ranks[0][i], ranks[1][i]), name


def test_random_weights_have_the_checkpoint_layout_of_the_family(family_dir):
    """Benchmark weights are drawn per checkpoint tensor: the names and shapes must be the family's own."""
    from safetensors import safe_open

    from models.config import ModelConfig
    from models.weights.loader import checkpoint_shapes

    name, path = family_dir
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert checkpoint_shapes(ModelConfig.from_dir(path)) == saved, name


def test_family_config_rules():
    from models.config import ModelConfig

    base = {**COMMON, "num_hidden_layers": 1}
    with pytest.raises(ValueError, match="GemmaForCausalLM.*Qwen3ForCausalLM"):
        ModelConfig.from_dict({**base, "architectures": ["GemmaForCausalLM"]})
    with pytest.raises(ValueError, match="sliding_window=512"):
        ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 512})
    qwen2 = ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 512, "use_sliding_window": False})
    assert (qwen2.architecture, qwen2.qkv_bias, qwen2.qk_norm) == ("Qwen2ForCausalLM", True, False)
    big_window = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert big_window.architecture == "MistralForCausalLM"  # no shorter than the context: plain attention


@pytest.mark.parametrize("name,arch,flags,params_b", [
    ("qwen2.5-7b", "Qwen2ForCausalLM", (True, False), 7.6), ("qwen3-8b", "Qwen3ForCausalLM", (False, True), 8.2),
    ("mistral-7b-v0.3", "MistralForCausalLM", (False, False), 7.2),
])
def test_real_shape_configs_load_as_their_family(name, arch, flags, params_b):
    """configs/models/ keeps the real shapes (for GPU numerics and benchmarks on random weights)."""
    from models.config import ModelConfig
    from models.weights.loader import checkpoint_shapes

    cfg = ModelConfig.from_dir(Path(__file__).resolve().parents[1] / "configs" / "models" / name)
    assert (cfg.architecture, cfg.qkv_bias, cfg.qk_norm) == (arch, *flags)
    total = sum(torch.Size(s).numel() for s in checkpoint_shapes(cfg).values())
    assert abs(total / 1e9 - params_b) < 0.1, total  # the published parameter counts
    assert cfg.num_heads % 2 == 0 and cfg.num_kv_heads % 2 == 0  # TP=2 splits them
