"""Qwen2, Qwen3 and Mistral against HF transformers' own classes on tiny random checkpoints (float32, CPU):
logits, greedy generation, TP=2 and TP=3 (every family, Llama too) equal to TP=1 over gloo; checkpoints that
do not fit their config fail at load naming every tensor that is wrong."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.conftest import perturb_norms_and_biases
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


def _save_random(cls: type, cfg: object, path: Path, seed: int = 7) -> Path:
    torch.manual_seed(seed)
    model = perturb_norms_and_biases(cls(cfg).to(torch.float32))
    model.save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": VOCAB - 1}))
    return path


@pytest.fixture(scope="module", params=["qwen2", "qwen3", "mistral"])
def family_dir(request, tmp_path_factory) -> tuple[str, Path]:
    cls, cfg = _families()[request.param]
    return request.param, _save_random(cls, cfg, tmp_path_factory.mktemp(request.param))


def _hf(path: Path):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _prompts(seed: int, lengths: tuple[int, ...] = (5, 23, 70)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in lengths]


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
        ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 512}).max_seq_len(1024)
    qwen2 = ModelConfig.from_dict({**base, "model_type": "qwen2", "sliding_window": 512, "use_sliding_window": False})
    assert (qwen2.architecture, qwen2.qkv_bias, qwen2.qk_norm) == ("Qwen2ForCausalLM", True, False)
    big_window = ModelConfig.from_dict({**base, "architectures": ["MistralForCausalLM"], "sliding_window": 4096})
    assert big_window.max_seq_len(8192) == 1024  # no shorter than the context: plain attention
    no_layer_slides = {**base, "model_type": "qwen2", "sliding_window": 512, "use_sliding_window": True,
                       "max_window_layers": 1}
    assert ModelConfig.from_dict(no_layer_slides).max_seq_len(1024) == 1024
    with pytest.raises(ValueError, match=r"sliding_window=512 on layers 0 \(use_sliding_window from max_window"):
        ModelConfig.from_dict({**no_layer_slides, "max_window_layers": 0}).max_seq_len(1024)
    with pytest.raises(ValueError, match="hidden_act='gelu' is not supported"):
        ModelConfig.from_dict({**base, "architectures": ["LlamaForCausalLM"], "hidden_act": "gelu"})


@pytest.mark.parametrize("arch,model_type,keys", [
    ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3,
                                   "layer_types": ["full_attention", "sliding_attention", "full_attention"]}),
    ("Qwen3ForCausalLM", "qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0,
                                   "layer_types": ["full_attention"] * 3}),
    ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": True, "num_hidden_layers": 30}),  # defaults: 4096 from 28
    ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": True, "num_hidden_layers": 28}),
    ("Qwen2ForCausalLM", "qwen2", {"use_sliding_window": False, "sliding_window": 8, "max_window_layers": 0}),
    ("Qwen3ForCausalLM", "qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1}),
    ("Qwen3ForCausalLM", "qwen3", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}),
    ("Qwen3MoeForCausalLM", "qwen3_moe", {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 3}),
    ("Qwen3MoeForCausalLM", "qwen3_moe", {"use_sliding_window": False, "sliding_window": 8}),
    ("MixtralForCausalLM", "mixtral", {"sliding_window": 8}),
    ("MixtralForCausalLM", "mixtral", {"sliding_window": None}),
    ("LlamaForCausalLM", "llama", {"sliding_window": 8}),  # Llama has no window: transformers ignores the key
])
def test_a_config_is_refused_exactly_when_transformers_would_slide_a_window(arch, model_type, keys):
    from transformers import AutoConfig

    from models.config import ModelConfig

    cfg = {**COMMON, "num_hidden_layers": 3, "max_position_embeddings": 8192, "architectures": [arch],
           "model_type": model_type, **keys}
    if model_type in ("qwen3_moe", "mixtral"):
        cfg |= {"num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}
    theirs = AutoConfig.for_model(**{k: v for k, v in cfg.items() if k != "architectures"})
    window = getattr(theirs, "sliding_window", None)
    kinds = getattr(theirs, "layer_types", None) or ["sliding_attention"] * cfg["num_hidden_layers"]
    slides = model_type != "llama" and window is not None and "sliding_attention" in kinds
    ours = ModelConfig.from_dict(cfg)
    assert ours.sliding_window == (window if slides else None)
    if slides:
        with pytest.raises(ValueError, match=f"sliding_window={window}.*set model.max_seq_len <= {window}"):
            ours.max_seq_len(8192)
        assert ours.max_seq_len(window) == window
    else:
        assert ours.max_seq_len(8192) == 8192


def test_keys_a_config_leaves_out_take_transformers_defaults_for_its_family():
    from transformers import AutoConfig

    from models.config import ModelConfig

    left_out = ("max_position_embeddings", "rms_norm_eps", "rope_theta", "num_key_value_heads")
    bare = {k: v for k, v in COMMON.items() if k not in left_out}
    for arch, model_type in (("LlamaForCausalLM", "llama"), ("MixtralForCausalLM", "mixtral"),
                             ("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3"),
                             ("Qwen3MoeForCausalLM", "qwen3_moe"), ("MistralForCausalLM", "mistral")):
        extra = {"sliding_window": None} if arch == "MistralForCausalLM" else {}
        cfg = {**bare, "num_hidden_layers": 2, "architectures": [arch], "model_type": model_type, **extra}
        ours = ModelConfig.from_dict(cfg)
        theirs = AutoConfig.for_model(**cfg)
        theta = getattr(theirs, "rope_theta", None) or theirs.rope_parameters["rope_theta"]
        # What HF's attention layers build: a head_dim attribute, else hidden_size / heads.
        head_dim = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
        assert (ours.rope_theta, ours.rms_norm_eps, ours.max_position_embeddings, ours.head_dim, ours.num_kv_heads) == (
            theta, theirs.rms_norm_eps, theirs.max_position_embeddings, head_dim, theirs.num_key_value_heads), arch
        if ours.is_moe:
            assert (ours.num_experts, ours.experts_per_token) == (theirs.num_experts, theirs.num_experts_per_tok), arch
            if arch == "Qwen3MoeForCausalLM":
                assert ours.moe_intermediate_size == theirs.moe_intermediate_size
    with pytest.raises(ValueError, match=r"sliding_window=4096 \(transformers' default for MistralForCausalLM\)"):
        ModelConfig.from_dict({**bare, "num_hidden_layers": 2, "architectures": ["MistralForCausalLM"]}).max_seq_len(8192)


@pytest.mark.parametrize("arch,model_type", [
    ("LlamaForCausalLM", "llama"), ("MistralForCausalLM", "mistral"), ("MixtralForCausalLM", "mixtral"),
    ("Qwen2ForCausalLM", "qwen2"), ("Qwen3ForCausalLM", "qwen3"), ("Qwen3MoeForCausalLM", "qwen3_moe")])
def test_biases_are_the_ones_transformers_builds_whatever_the_config_switches_say(arch, model_type):
    """Some families read attention_bias / mlp_bias, others fix their biases in code and ignore the keys: a
    config.json that sets both must ask for exactly the bias tensors transformers' class has."""
    import transformers
    from transformers import AutoConfig

    from models.config import ModelConfig
    from models.llama import LlamaForCausalLM

    cfg = {**COMMON, "architectures": [arch], "model_type": model_type, "attention_bias": True, "mlp_bias": True,
           "sliding_window": None}
    if model_type == "qwen3_moe":
        cfg["mlp_only_layers"] = [0]  # one dense MLP layer, whose projections could carry biases
    with torch.device("meta"):
        theirs = getattr(transformers, arch)(AutoConfig.for_model(**cfg))
        ours = LlamaForCausalLM(ModelConfig.from_dict(cfg))
    # Our fused projections stand for theirs: qkv_proj for q/k/v, gate_up_proj for gate/up.
    fused = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj", "gate_proj": "gate_up_proj",
             "up_proj": "gate_up_proj"}

    def biases(names: list[str]) -> set[str]:
        out = set()
        for name in names:
            if name.endswith(".bias") and ".experts." not in name:
                module = name.split(".")[-2]
                out.add(name.replace(f".{module}.", f".{fused.get(module, module)}."))
        return out
    expected = biases([n for n, _ in theirs.named_parameters()])
    assert biases([n for n, _ in ours.named_parameters()]) == expected
    assert any("self_attn" in n for n in expected) == (model_type in ("llama", "qwen2", "qwen3", "qwen3_moe"))


def test_a_sliding_window_no_shorter_than_max_seq_len_serves_hfs_logits(tmp_path):
    """Within its window a sliding window masks nothing: served as dense attention, refused only past it."""
    from transformers import MistralConfig, MistralForCausalLM

    path = _save_random(MistralForCausalLM, MistralConfig(**COMMON, sliding_window=32), tmp_path)
    prompts = _prompts(7, (5, 32))
    with torch.no_grad():
        ref = [_hf(path)(torch.tensor([p])).logits[0] for p in prompts]
    for ours, theirs in zip(prefill_logits(make_engine(path, "model.max_seq_len=32"), prompts), ref):
        assert relative_error(ours, theirs) <= 1e-5
    with pytest.raises(ValueError, match=r"config.json: sliding_window=32 on layers 0-1 \(every layer\) is not "
                                         r"supported .*: set model.max_seq_len <= 32$"):
        make_engine(path, "model.max_seq_len=33")


def test_qwen3_without_head_dim_matches_hf(tmp_path):
    """Qwen3Config's head_dim defaults to 128, not hidden_size / heads (32 here)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    path = _save_random(Qwen3ForCausalLM, Qwen3Config(**COMMON, head_dim=128), tmp_path)
    config = json.loads((path / "config.json").read_text())
    del config["head_dim"]
    (path / "config.json").write_text(json.dumps(config))
    prompts = _prompts(6)
    with torch.no_grad():
        ref = [_hf(path)(torch.tensor([p])).logits[0] for p in prompts]
    for ours, theirs in zip(prefill_logits(make_engine(path), prompts), ref):
        assert relative_error(ours, theirs) <= 1e-5


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


@pytest.mark.parametrize("name", sorted(p.name for p in (Path(__file__).resolve().parents[1] / "configs" / "models").iterdir()))
def test_every_shape_config_builds_in_hf_transformers(name):
    """The HF peers of scripts/bench_offline.py build each shape from its config.json, which needs the model_type
    that published configs carry, and must agree with our reading of it."""
    from transformers import AutoConfig

    from models.config import ModelConfig

    folder = Path(__file__).resolve().parents[1] / "configs" / "models" / name
    hf = AutoConfig.from_pretrained(str(folder))
    ours = ModelConfig.from_dir(folder)
    assert hf.architectures == [ours.architecture]
    assert (hf.hidden_size, hf.num_hidden_layers, hf.num_attention_heads, hf.vocab_size) == (
        ours.hidden_size, ours.num_layers, ours.num_heads, ours.vocab_size)


# Shapes TP=3 splits: 6 query heads, an intermediate size and head_dim*heads divisible by 3, a vocabulary that is
# not (the last shard is padded).
TP3 = dict(vocab_size=VOCAB, hidden_size=96, intermediate_size=192, num_hidden_layers=2, num_attention_heads=6,
           max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=VOCAB - 1)


def _tp3_families(layers: int = 2) -> dict[str, tuple]:
    """KV heads split over the ranks (llama: 3, one per rank; mistral: 6, two per rank) or fewer than the ranks
    (qwen2, qwen3: 1, replicated on all three, which QKVParallelLinear does when TP is a multiple of them)."""
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    c = {**TP3, "num_hidden_layers": layers}
    llama3_rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                   "original_max_position_embeddings": 256}
    return {
        "llama": (LlamaForCausalLM, LlamaConfig(**c, num_key_value_heads=3, rope_theta=5e5, rope_scaling=llama3_rope)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(**c, num_key_value_heads=1, rope_theta=1e6, tie_word_embeddings=True,
                                                use_sliding_window=False)),
        "qwen3": (Qwen3ForCausalLM, Qwen3Config(**c, num_key_value_heads=1, head_dim=32, rope_theta=1e6,
                                                tie_word_embeddings=False)),
        "mistral": (MistralForCausalLM, MistralConfig(**c, num_key_value_heads=6, rope_theta=1e4, sliding_window=None)),
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3", "mistral"])
def test_tp3_equals_tp1_and_hf(name, tmp_path):
    """TP=3 over gloo: teacher-forced logits (chunked prefill, decode) and generation (greedy and sampled) equal
    TP=1, the same bits on every rank; TP=1 equals HF's logits, and TP=3's greedy tokens equal HF's generate."""
    from tests.test_tp import PARAMS, _check, logits_and_generation, reference

    cls, cfg = _tp3_families()[name]
    path = _save_random(cls, cfg, tmp_path, seed=13)
    prompts, gen_prompts = _prompts(4), _prompts(5, (3, 17, 45, 8, 30))
    ref = reference(str(path), prompts, gen_prompts, PARAMS)
    hf = _hf(path)
    with torch.no_grad():
        for p, ours in zip(prompts, ref["logits"]):
            assert relative_error(ours, hf(torch.tensor([p])).logits[0]) <= 1e-5, name
        greedy = hf.generate(torch.tensor([gen_prompts[0]]), max_new_tokens=12, min_new_tokens=12, do_sample=False)
    ranks = run_ranks(3, logits_and_generation, str(path), prompts, gen_prompts, PARAMS)
    _check(ranks, ref)
    assert PARAMS[0]["temperature"] == 0 and ranks[0]["outputs"][0] == greedy[0, len(gen_prompts[0]):].tolist(), name


def _edit_checkpoint(path: Path, drop: list[str], add: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(str(file))
    assert set(drop) <= set(tensors)  # the test removes tensors that really were there
    tensors = {k: v for k, v in tensors.items() if k not in drop} | add
    save_file(tensors, str(file), metadata={"format": "pt"})


def _load_error(path: Path) -> str:
    from models.config import ModelConfig
    from models.weights.loader import load_model

    with pytest.raises(ValueError) as err:
        load_model(path, ModelConfig.from_dir(path), torch.device("cpu"), torch.float32, 64)
    return str(err.value)


def test_checkpoint_with_a_missing_and_an_unexpected_tensor_fails_naming_both(tmp_path):
    """k_proj is one shard of the fused qkv_proj: before, the q and v shards counted it as loaded."""
    cls, cfg = _tp3_families()["qwen3"]
    path = _save_random(cls, cfg, tmp_path)
    _edit_checkpoint(path, ["model.layers.1.self_attn.k_proj.weight"],
                     {"model.layers.0.mlp.extra_proj.weight": torch.zeros(3, 4)})
    msg = _load_error(path)
    assert "1 missing, 1 unexpected" in msg
    assert "missing: model.layers.1.self_attn.k_proj.weight (32, 96)" in msg.splitlines()[1]
    assert "unexpected: model.layers.0.mlp.extra_proj.weight (3, 4) in model.safetensors" in msg.splitlines()[2]


def test_checkpoint_missing_many_tensors_names_every_one_in_layer_order(tmp_path):
    from safetensors import safe_open

    cls, cfg = _tp3_families(layers=12)["qwen2"]  # layer 10 must be listed after layer 2
    path = _save_random(cls, cfg, tmp_path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    drop = sorted(n for n in names if n.endswith("v_proj.bias") or "layers.10." in n)
    wrong = {"model.layers.3.mlp.down_proj.weight": torch.zeros(96, 190), "model.norm.weight": torch.ones(95)}
    _edit_checkpoint(path, drop + list(wrong), wrong)
    msg = _load_error(path)
    missing = [line.split()[1] for line in msg.splitlines() if line.startswith("  missing: ")]
    assert len(drop) == 12 + 12 - 1 and sorted(missing) == drop  # every v_proj.bias and all 12 of layer 10
    assert missing.index("model.layers.2.self_attn.v_proj.bias") < missing.index("model.layers.10.mlp.up_proj.weight")
    assert "wrong shape: model.layers.3.mlp.down_proj.weight is (96, 190) in model.safetensors, expected (96, 192)" in msg
    assert "wrong shape: model.norm.weight is (95,)" in msg
    assert f"{len(drop)} missing, 2 with the wrong shape" in msg.splitlines()[0]


def _tied_config_with_its_own_head(path: Path, rows_equal: int) -> Path:
    """A Qwen2 checkpoint holding an lm_head.weight equal to the embedding in its first ``rows_equal`` rows only,
    under a config.json that ties the two."""
    from safetensors import safe_open
    from transformers import Qwen2Config, Qwen2ForCausalLM

    _save_random(Qwen2ForCausalLM, Qwen2Config(**COMMON, tie_word_embeddings=False), path)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        head, embed = f.get_tensor("lm_head.weight"), f.get_tensor("model.embed_tokens.weight")
    head[:rows_equal] = embed[:rows_equal]
    _edit_checkpoint(path, ["lm_head.weight"], {"lm_head.weight": head})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    return path


def _hf_logits(path: Path, prompts: list[list[int]]) -> tuple[bool, list[torch.Tensor]]:
    """(whether HF tied the LM head to the embedding, its logits)."""
    model = _hf(path)
    with torch.no_grad():
        return (model.lm_head.weight is model.model.embed_tokens.weight,
                [model(torch.tensor([p])).logits[0] for p in prompts])


@pytest.mark.parametrize("rows_equal", [VOCAB // 2, VOCAB])
def test_a_tied_config_takes_the_checkpoints_own_lm_head_where_hf_does(tmp_path, caplog, rows_equal):
    path = _tied_config_with_its_own_head(tmp_path, rows_equal)
    prompts = _prompts(8)
    hf_tied, ref = _hf_logits(path, prompts)
    with caplog.at_level(logging.WARNING, logger="models.weights.loader"):
        engine = make_engine(path)
    tied = engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert tied == hf_tied == (rows_equal == VOCAB)
    assert ("lm_head.weight differs from model.embed_tokens.weight: using the checkpoint's lm_head" in caplog.text) \
        == (not tied)
    for ours, theirs in zip(prefill_logits(engine, prompts), ref):
        assert relative_error(ours, theirs) <= 1e-5


def test_a_tied_checkpoint_holding_only_its_lm_head_loads_as_hf_loads_it(tmp_path):
    from safetensors import safe_open

    path = _tied_config_with_its_own_head(tmp_path, VOCAB)
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        shared = f.get_tensor("lm_head.weight")
    _edit_checkpoint(path, ["model.embed_tokens.weight"], {})
    prompts = _prompts(10)
    hf_tied, ref = _hf_logits(path, prompts)
    engine = make_engine(path)
    assert hf_tied and engine.model.lm_head.weight is engine.model.model.embed_tokens.weight
    assert torch.equal(engine.model.model.embed_tokens.weight, shared)
    for ours, theirs in zip(prefill_logits(engine, prompts), ref):
        assert relative_error(ours, theirs) <= 1e-5


def _tie_and_logits(rank: int, path: str, prompts: list[list[int]]) -> tuple[bool, list[torch.Tensor]]:
    engine = make_engine(path, "cache.page_size=4")
    return engine.model.config.tie_word_embeddings, prefill_logits(engine, prompts)


@pytest.mark.slow
def test_tp2_unties_the_lm_head_on_every_rank_when_one_shard_differs(tmp_path):
    """Each rank compares its own vocab shard: rank 0's rows are equal, rank 1's are not; both must untie."""
    path = _tied_config_with_its_own_head(tmp_path, VOCAB // 2)
    prompts = _prompts(9)
    _, ref = _hf_logits(path, prompts)
    for tied, logits in run_ranks(2, _tie_and_logits, str(path), prompts):
        assert not tied
        for ours, theirs in zip(logits, ref):
            assert relative_error(ours, theirs) <= 1e-5
