"""Mixture-of-experts families (Qwen3-MoE, Mixtral) against HF transformers' own classes on tiny random
checkpoints (float32, CPU): logits, greedy generation, TP=2 and TP=3 equal to TP=1 on every rank, and a
checkpoint missing an expert tensor fails at load naming it."""

from __future__ import annotations

import gc
import json
from pathlib import Path

import pytest
import torch

from runtime import LLM, SamplingParams
from tests.conftest import perturb_norms_and_biases
from tests.helpers import make_engine, prefill_logits, relative_error
from tests.tp_utils import run_ranks

VOCAB = 320
# 12 query heads over 6 KV heads, intermediate sizes divisible by 2 and 3: TP=2 and TP=3 both split them.
COMMON = dict(vocab_size=VOCAB, hidden_size=96, num_hidden_layers=3, num_attention_heads=12, num_key_value_heads=6,
              max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=None)


def _families() -> dict[str, tuple]:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    return {
        # top-4 of 8, renormalised, a dense layer (1) among sparse ones, GQA, q/k norms
        "qwen3_moe": (Qwen3MoeForCausalLM, Qwen3MoeConfig(
            **COMMON, head_dim=16, intermediate_size=192, moe_intermediate_size=48, num_experts=8,
            num_experts_per_tok=4, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
            rope_theta=1e6, tie_word_embeddings=False)),
        # top-2 of 4, every layer sparse
        "mixtral": (MixtralForCausalLM, MixtralConfig(
            **COMMON, intermediate_size=96, num_local_experts=4, num_experts_per_tok=2, rope_theta=1e6,
            sliding_window=None)),
    }


def _save_random(name: str, path: Path, seed: int = 11) -> Path:
    cls, cfg = _families()[name]
    torch.manual_seed(seed)
    model = cls(cfg).to(torch.float32)
    with torch.no_grad():  # HF leaves the router at zero (every expert equally likely): make routing matter
        for n, p in model.named_parameters():
            if n.endswith(".gate.weight") or ".experts." in n:
                p.normal_(0, 0.2 if n.endswith(".gate.weight") else 0.05)
    perturb_norms_and_biases(model).save_pretrained(path, safe_serialization=True)
    (path / "generation_config.json").write_text(json.dumps({}))  # no EOS: both sides generate every token
    return path


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def moe_dir(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, _save_random(request.param, tmp_path_factory.mktemp(request.param))


def _hf(path: Path):  # noqa: ANN202
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def _prompts(seed: int, lengths: tuple[int, ...] = (5, 23, 70)) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB - 1, (n,), generator=gen).tolist() for n in lengths]


def test_config_reads_the_sparse_layers():
    from models.config import ModelConfig

    qwen = ModelConfig.from_dict(_families()["qwen3_moe"][1].to_dict())
    assert qwen.is_moe and qwen.sparse_layers == (0, 2) and (qwen.num_experts, qwen.experts_per_token) == (8, 4)
    assert qwen.moe_intermediate_size == 48 and qwen.norm_topk_prob and qwen.qk_norm
    mixtral = ModelConfig.from_dict(_families()["mixtral"][1].to_dict())
    assert mixtral.sparse_layers == (0, 1, 2) and mixtral.moe_intermediate_size == 96 and mixtral.norm_topk_prob
    with pytest.raises(ValueError, match="num_experts_per_tok=9"):
        ModelConfig.from_dict({**_families()["mixtral"][1].to_dict(), "num_experts_per_tok": 9})
    # Both names of the expert count, differing: transformers' Mixtral and Qwen3-MoE would each read another.
    for family in ("mixtral", "qwen3_moe"):
        both = {**_families()[family][1].to_dict(), "num_experts": 8, "num_local_experts": 6}
        with pytest.raises(ValueError, match="num_experts=8 and num_local_experts=6"):
            ModelConfig.from_dict(both)
        assert ModelConfig.from_dict({**both, "num_local_experts": 8}).num_experts == 8


def test_logits_match_hf(moe_dir):
    name, path = moe_dir
    prompts = _prompts(1)
    model = _hf(path)
    with torch.no_grad():
        ref = [model(torch.tensor([p])).logits[0] for p in prompts]
        # the routing is not degenerate: the prompts' tokens spread over several experts
        layer = model.model.layers[0].mlp
        router = layer.gate.weight
        picked = torch.topk(model.model.embed_tokens(torch.tensor(prompts[2])) @ router.T, 2).indices.unique()
    assert len(picked) > 2
    ours = prefill_logits(make_engine(path), prompts, chunk=9, decode_tail=3)
    for o, r in zip(ours, ref):
        assert relative_error(o, r) <= 1e-5, name


def test_deterministic_logits_are_the_same_alone_and_batched(moe_dir):
    """engine.deterministic: each expert's rows depend on the batch's routing, so its GEMMs must be invariant."""
    name, path = moe_dir
    engine = make_engine(path, "engine.deterministic=true")
    prompts = _prompts(1, (5, 23, 70, 40))
    together = prefill_logits(engine, prompts)
    for prompt, batched in zip(prompts, together):
        assert torch.equal(prefill_logits(engine, [prompt])[0], batched), name


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral"])
def test_the_block_rounds_routing_weights_as_hf_does_in_bf16(name):
    """Qwen3-MoE rounds its routing weights to bf16 before scaling the experts' outputs, Mixtral scales in
    float32 and rounds the product: each family's block equals HF's bit for bit."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    from models.config import ModelConfig
    from models.moe import SparseMoE
    from models.ops import TORCH_KERNELS

    cfg = _families()[name][1]
    torch.manual_seed(0)
    # Built alone, the block runs its experts one by one ("eager"), as ours do on CPU.
    hf = (MixtralSparseMoeBlock if name == "mixtral" else Qwen3MoeSparseMoeBlock)(cfg)
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
        hf.gate.weight.normal_(0, 0.2)
    hf = hf.to(torch.bfloat16)
    ours = SparseMoE(ModelConfig.from_dict(cfg.to_dict()), 0, TORCH_KERNELS).to(torch.bfloat16)
    with torch.no_grad():
        ours.gate.weight.copy_(hf.gate.weight)
        ours.experts.w13.copy_(hf.experts.gate_up_proj)
        ours.experts.w2.copy_(hf.experts.down_proj)
        x = torch.randn(512, cfg.hidden_size).to(torch.bfloat16)
        assert torch.equal(ours(x), hf(x[None])[0])


def test_greedy_generation_matches_hf(moe_dir):
    name, path = moe_dir
    prompts = _prompts(2, (3, 17, 45, 8, 30, 11, 5, 60))
    model = _hf(path)
    llm = LLM(str(path), overrides=["engine.device=cpu", "model.dtype=float32"])
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            ref = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)
        assert o.token_ids == ref[0, len(p):].tolist(), name
    llm.shutdown()


def test_random_weights_have_the_checkpoint_layout_of_the_family(moe_dir):
    from safetensors import safe_open

    from models.config import ModelConfig
    from models.weights.loader import checkpoint_shapes

    name, path = moe_dir
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        saved = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    assert checkpoint_shapes(ModelConfig.from_dir(path)) == saved, name


def test_to_hf_state_dict_round_trips(moe_dir):
    from safetensors.torch import load_file

    from models.weights.loader import to_hf_state_dict

    name, path = moe_dir
    saved = load_file(str(path / "model.safetensors"))
    ours = to_hf_state_dict(make_engine(path).model)
    assert ours.keys() == saved.keys(), name
    assert all(torch.equal(ours[k], saved[k]) for k in saved), name


def test_a_missing_expert_tensor_fails_at_load_naming_it(moe_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    name, path = moe_dir
    tensors = load_file(str(path / "model.safetensors"))
    gone = next(k for k in sorted(tensors) if ".experts.3." in k)
    del tensors[gone]
    broken = tmp_path / "broken"
    broken.mkdir()
    save_file(tensors, str(broken / "model.safetensors"), metadata={"format": "pt"})
    (broken / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ValueError, match=f"missing: {gone.replace('.', '[.]')}"):
        make_engine(broken)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_tp_equals_tp1_on_every_rank(moe_dir, world):
    """Logits (chunked prefill, decode) and generation (greedy, seeded, unseeded, top-k/top-p) at TP=2 and 3:
    TP=1's, the same bits and tokens on every rank."""
    from tests.test_tp import PARAMS, _check, logits_and_generation, reference

    name, path = moe_dir
    prompts, gen_prompts = _prompts(3), _prompts(4, (3, 17, 45, 8, 30))
    ref = reference(str(path), prompts, gen_prompts, PARAMS)
    _check(run_ranks(world, logits_and_generation, str(path), prompts, gen_prompts, PARAMS), ref)


@pytest.mark.parametrize("name,arch,params_b,sparse", [
    ("qwen3-30b-a3b", "Qwen3MoeForCausalLM", 30.5, 48), ("mixtral-8x7b", "MixtralForCausalLM", 46.7, 32),
])
def test_real_shape_configs_load_as_their_family(name, arch, params_b, sparse):
    """configs/models/ keeps the real MoE shapes (GPU numerics, benchmarks on random weights)."""
    from models.config import ModelConfig
    from models.weights.loader import checkpoint_shapes

    cfg = ModelConfig.from_dir(Path(__file__).resolve().parents[1] / "configs" / "models" / name)
    assert cfg.architecture == arch and len(cfg.sparse_layers) == sparse
    total = sum(torch.Size(s).numel() for s in checkpoint_shapes(cfg).values())
    assert abs(total / 1e9 - params_b) < 0.1, total  # the published parameter counts


def fp8_experts_and_logits(rank: int, model_dir: str, prompts: list[list[int]], quantization: str = "fp8") -> dict:
    """Layer 0's experts as stored (e4m3 bits, scales) under ``quantization``, its output on seeded rows, and the
    logits of ``prompts``."""
    engine = make_engine(model_dir, f"model.quantization={quantization}", "cache.page_size=4")
    mlp = engine.model.model.layers[0].mlp
    experts = mlp.experts
    x = torch.randn(40, mlp.gate.weight.shape[1], generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        layer = mlp(x)
    stored = {"w13": experts.w13.data.view(torch.uint8).clone(), "w2": experts.w2.data.view(torch.uint8).clone(),
              "w13_scale": experts.w13_scale.clone(), "w2_scale": experts.w2_scale.clone()} \
        if quantization == "fp8" else {"w13": experts.w13.data.clone(), "w2": experts.w2.data.clone()}
    logits = prefill_logits(engine, prompts, chunk=16, decode_tail=4)
    del engine, experts, mlp
    gc.collect()
    return {"experts": stored, "layer": layer, "logits": logits}


def test_fp8_experts_store_each_checkpoint_row_quantised(moe_dir):
    """model.quantization=fp8 quantises every expert's rows at load: e4m3 values and a scale per row."""
    from models import fp8

    name, path = moe_dir
    prompts = _prompts(5, (9,))
    exact = fp8_experts_and_logits(0, str(path), prompts, "none")
    got = fp8_experts_and_logits(0, str(path), prompts)
    for w in ("w13", "w2"):
        full = exact["experts"][w]
        values, scale = fp8.quantize_rows(full.reshape(-1, full.shape[-1]))
        assert torch.equal(got["experts"][w], values.view(torch.uint8).view(full.shape)), (name, w)
        assert torch.equal(got["experts"][f"{w}_scale"], scale.view(full.shape[:2])), (name, w)


def test_an_fp8_experts_checkpoint_runs_its_dequantised_weights(moe_dir, tmp_path):
    """A checkpoint with only its experts in FP8 (per channel): run in e4m3 (auto), a sparse layer is float64 over
    the weights the same checkpoint dequantises to (none), with its inputs quantised to e4m3 per row, up to
    float32 rounding. (How far that moves these tiny random models' logits says little: their routers flip on any
    nudge; tests/test_fused_moe.py measures a layer's error against the unquantised one.)"""
    import torch.nn.functional as F

    from tests.test_fp8_checkpoint import _compressed_tensors, _ct_weights, _write_fp8
    from tests.test_fused_moe import reference_moe

    name, path = moe_dir
    config = _compressed_tensors({"experts": (["re:.*experts.*"], _ct_weights("channel"))}, [])
    ckpt = _write_fp8(path, tmp_path / "experts-fp8", config, lambda n: "channel" if ".experts." in n else None)
    prompts = _prompts(7, (9, 40, 70))
    fp8_run = make_engine(ckpt, "model.quantization=auto")
    layer0 = fp8_run.model.model.layers[0]
    assert layer0.mlp.experts.w13_scale is not None and not layer0.self_attn.qkv_proj.fp8
    dequantized_run = make_engine(ckpt, "model.quantization=none")
    ours, theirs = fp8_run.model.model.layers[0].mlp, dequantized_run.model.model.layers[0].mlp
    x = torch.randn(70, theirs.gate.weight.shape[1], generator=torch.Generator().manual_seed(3))
    ref, _ = reference_moe(x, F.linear(x, theirs.gate.weight), theirs.experts.w13, theirs.experts.w2, ours.top_k,
                           ours.renormalize, e4m3_activations=True)
    with torch.no_grad():
        assert relative_error(ours(x), ref) <= 1e-5, name
    dequantized = prefill_logits(dequantized_run, prompts, chunk=16, decode_tail=4)
    original = prefill_logits(make_engine(path), prompts, chunk=16, decode_tail=4)
    for fp8_logits, d, orig in zip(prefill_logits(fp8_run, prompts, chunk=16, decode_tail=4), dequantized, original):
        assert relative_error(d, orig) > 1e-3, name  # the experts were quantised
        print(f"{name}: e4m3 experts' logits {relative_error(fp8_logits, d):.3e} from the dequantised run's")
    # Written back in the checkpoint's names: the e4m3 values and their scales, as stored.
    from safetensors.torch import load_file

    from models.weights.loader import to_hf_state_dict

    saved = load_file(str(ckpt / "model.safetensors"))
    state = to_hf_state_dict(fp8_run.model)
    assert state.keys() == saved.keys(), name
    for key in (k for k in saved if ".experts." in k):
        ours_t, theirs = state[key], saved[key]
        if theirs.dtype == torch.float8_e4m3fn:
            assert torch.equal(ours_t.view(torch.uint8), theirs.view(torch.uint8)), key
        else:
            assert torch.equal(ours_t, theirs.flatten()), key


@pytest.mark.slow
def test_fp8_experts_at_tp2_store_tp1_weights_and_give_its_logits(moe_dir):
    """Gate/up rows and down columns of TP=1's e4m3 values on each rank; down's scales are TP=1's, taken over
    whole rows, and so are the SiLU x up rows' e4m3 scales: the layer gives TP=1's output up to the all-reduce's
    order. The logits differ from TP=1's only by that, magnified by FP8 rounding of the activations: less than
    FP8's own distance from the unquantised model."""
    name, path = moe_dir
    prompts = _prompts(6, (7, 40))
    ref = fp8_experts_and_logits(0, str(path), prompts)
    exact = fp8_experts_and_logits(0, str(path), prompts, "none")["logits"]
    ranks = run_ranks(2, fp8_experts_and_logits, str(path), prompts)
    full = ref["experts"]
    inter = full["w2"].shape[2] // 2
    for rank, got in enumerate(ranks):
        mine = slice(rank * inter, (rank + 1) * inter)
        rows = torch.cat([torch.arange(2 * inter)[mine], 2 * inter + torch.arange(2 * inter)[mine]])
        assert torch.equal(got["experts"]["w13"], full["w13"][:, rows]), name
        assert torch.equal(got["experts"]["w13_scale"], full["w13_scale"][:, rows]), name
        assert torch.equal(got["experts"]["w2"], full["w2"][:, :, mine]), name
        assert torch.equal(got["experts"]["w2_scale"], full["w2_scale"]), name
        assert relative_error(got["layer"], ref["layer"]) <= 1e-5, name
        for ours, theirs, unquantized in zip(got["logits"], ref["logits"], exact):
            assert relative_error(ours, theirs) <= relative_error(theirs, unquantized), name
    for ours, first in zip(ranks[1]["logits"], ranks[0]["logits"]):
        assert torch.equal(ours, first)


def test_fp8_experts_torch_path_stays_finite_in_float16():
    """Unscaled e4m3 products are up to 448 / (a row's largest weight) times the true ones: the torch path scales
    them in float32, so a float16 model's experts do not overflow where their outputs are moderate."""
    import torch.nn.functional as F

    from models import fp8
    from models.moe import Experts
    from tests.test_fused_moe import e4m3_round_trip

    experts = Experts(2, 64, 32, "moe_intermediate_size", quantized=True)
    gen = torch.Generator().manual_seed(0)
    for w, scale in ((experts.w13, experts.w13_scale), (experts.w2, experts.w2_scale)):
        values, row_scale = fp8.quantize_rows(0.02 * torch.randn(w.numel() // w.shape[-1], w.shape[-1], generator=gen))
        w.data, scale.data = values.view(w.shape), row_scale.view(scale.shape)
    x = (20 * torch.randn(5, 64, generator=gen)).half()
    out = experts.linear(x, F.linear, 1, down=False)
    ref = e4m3_round_trip(x) @ (experts.w13[1].double() * experts.w13_scale[1].double()[:, None]).T
    assert out.dtype == torch.float16 and torch.isfinite(out).all()
    assert relative_error(out, ref) < 1e-3
