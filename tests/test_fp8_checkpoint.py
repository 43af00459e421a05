"""Pre-quantised FP8 checkpoints on CPU: compressed-tensors float8 (per channel, per tensor, per block),
transformers' fine-grained FP8 (128x128 blocks) and AutoFP8 (per tensor) load as published; per-row and
per-tensor scales unchanged, blocks re-quantised per row; model.quantization=none dequantises; TP=2 and TP=3
store TP=1's weights; every other quantisation is refused naming the field."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import re
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from models import fp8
from models.config import ModelConfig
from models.llama import LlamaForCausalLM
from models.weights.loader import load_model
from runtime.config import ConfigError, load_config
from scripts.make_random_checkpoint import write_random_checkpoint
from tests.helpers import make_engine, prefill_logits, relative_error
from tests.test_fp8 import fp8_weights_and_logits
from tests.tp_utils import run_ranks

# Dimensions off multiples of 128 (q 192 x 192, k/v 96 x 192, gate/up 300 x 192, down 192 x 300), so 128 x 128
# blocks are ragged in both directions and rank slices cut through blocks; 12 heads, 6 KV heads and an
# intermediate size of 300 split over 2 and 3 ranks.
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 192, "intermediate_size": 300, "num_hidden_layers": 2,
         "num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 16, "vocab_size": 300, "rms_norm_eps": 1e-5,
         "rope_theta": 10000.0, "max_position_embeddings": 512, "tie_word_embeddings": False, "eos_token_id": 2,
         "torch_dtype": "bfloat16"}
PROJECTION = re.compile(r"\.(q|k|v|o|gate|up|down)_proj\.weight$")
# Our fused modules and the checkpoint tensors that fill them, in order.
MODULES = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "o_proj": ("self_attn.o_proj",),
           "gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"), "down_proj": ("mlp.down_proj",)}
BLOCK = 128
CPU = torch.device("cpu")


def _random_checkpoint(tmp: Path, config: dict, name: str) -> Path:
    config_dir = tmp / f"{name}-config"
    config_dir.mkdir()
    (config_dir / "config.json").write_text(json.dumps(config))
    return write_random_checkpoint(config_dir, tmp / name, seed=3, dtype=torch.float32, device=CPU)


@pytest.fixture(scope="module")
def base_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _random_checkpoint(tmp_path_factory.mktemp("fp8ckpt"), LLAMA, "base")


# --- writing FP8 checkpoints as llm-compressor and transformers publish them --------------------------------


def _blocks(rows: int, cols: int) -> list[tuple[int, int, slice, slice]]:
    return [(i, j, slice(i * BLOCK, (i + 1) * BLOCK), slice(j * BLOCK, (j + 1) * BLOCK))
            for i in range(-(-rows // BLOCK)) for j in range(-(-cols // BLOCK))]


def _quantize(strategy: str, name: str, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, scale) of one checkpoint weight; the weight is values x scale."""
    if strategy == "channel":
        values, scale = fp8.quantize_rows(w)
        return values, scale[:, None]
    if strategy == "tensor":
        scale = w.abs().amax().float() / fp8.FP8_MAX
        values = (w.float() / scale).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
        return values, scale.reshape(() if "self_attn" in name else (1,))  # both shapes are published
    values = torch.empty(w.shape, dtype=fp8.FP8)
    scales = torch.empty(-(-w.shape[0] // BLOCK), -(-w.shape[1] // BLOCK))
    for i, j, rows, cols in _blocks(*w.shape):
        block = w[rows, cols] * (0.5 + (3 * i + j) % 4 / 2)  # blocks of different magnitudes
        scales[i, j] = block.abs().amax() / fp8.FP8_MAX
        values[rows, cols] = (block / scales[i, j]).clamp(-fp8.FP8_MAX, fp8.FP8_MAX).to(fp8.FP8)
    return values, scales


def _dequantize(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """values x scale, block by block for block scales."""
    if scale.dim() < 2 or (scale.shape[1] == 1 and scale.shape[0] == values.shape[0]):
        return values.float() * scale.float().reshape(-1, 1)
    out = torch.empty(values.shape)
    for i, j, rows, cols in _blocks(*values.shape):
        out[rows, cols] = values[rows, cols].float() * scale[i, j]
    return out


def _write_fp8(src: Path, dst: Path, quantization_config: dict, strategy_of: Callable[[str], str | None],
               scale_name: str = "weight_scale", input_scales: bool = False) -> Path:
    """``src`` with each weight that ``strategy_of`` names quantised that way, beside its scale."""
    tensors = {n: t for f in sorted(src.glob("*.safetensors")) for n, t in load_file(f).items()}
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        strategy = strategy_of(name)
        if strategy is None:
            out[name] = tensor
            continue
        module = name[: -len("weight")]
        out[name], out[module + scale_name] = _quantize(strategy, name, tensor)
        if input_scales:
            out[module + "input_scale"] = torch.tensor([0.05])
    dst.mkdir()
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps({**config, "quantization_config": quantization_config}))
    return dst


def _write_dequantized(src: Path, dst: Path) -> Path:
    """``src``'s FP8 weights dequantised to float32, without scales or quantization_config."""
    config = json.loads((src / "config.json").read_text())
    quant = config.pop("quantization_config")
    scale_name = "weight_scale_inv" if "weight_block_size" in quant else "weight_scale"
    ckpt = load_file(src / "model.safetensors")
    dst.mkdir()
    save_file({n: _checkpoint_weight(ckpt, n[: -len(".weight")], scale_name) if n.endswith(".weight") else t
               for n, t in ckpt.items() if not n.endswith(scale_name)}, str(dst / "model.safetensors"))
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def _ct_weights(strategy: str, block: list[int] | None = None) -> dict:
    return {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False,
            "group_size": None, "block_structure": block, "actorder": None, "observer": "minmax", "observer_kwargs": {}}


def _compressed_tensors(groups: dict[str, tuple[list[str], dict]], ignore: list[str], static_inputs: bool = False,
                        fmt: str = "float-quantized") -> dict:
    """A quantization_config as llm-compressor writes it (FP8 with static input scales, or FP8_DYNAMIC)."""
    inputs = {"num_bits": 8, "type": "float", "strategy": "tensor" if static_inputs else "token", "symmetric": True,
              "dynamic": not static_inputs, "group_size": None, "block_structure": None, "actorder": None}
    return {"quant_method": "compressed-tensors", "format": fmt, "quantization_status": "compressed",
            "global_compression_ratio": None, "kv_cache_scheme": None, "ignore": ignore,
            "config_groups": {name: {"targets": targets, "weights": weights, "input_activations": inputs,
                                     "output_activations": None} for name, (targets, weights) in groups.items()}}


def _fine_grained(block: tuple[int, int] | None = (BLOCK, BLOCK)) -> dict:
    """transformers' FineGrainedFP8Config as saved (DeepSeek-V3, Qwen3-FP8)."""
    return {"quant_method": "fp8", "activation_scheme": "dynamic", "modules_to_not_convert": None,
            "weight_block_size": None if block is None else list(block)}


def _autofp8(kv_cache: bool = False) -> dict:
    """AutoFP8's quantization_config (per-tensor ``weight_scale``, static input scales; no weight_block_size)."""
    return {"quant_method": "fp8", "activation_scheme": "static", "ignored_layers": ["lm_head"],
            **({"kv_cache_scheme": "static"} if kv_cache else {})}


def _projections(strategy: str, skip: tuple[str, ...] = ()) -> Callable[[str], str | None]:
    return lambda name: strategy if PROJECTION.search(name) and not any(s in name for s in skip) else None


def _projections_and_head(strategy: str) -> Callable[[str], str | None]:
    return lambda name: strategy if PROJECTION.search(name) or name == "lm_head.weight" else None


# --- reading what a model stores --------------------------------------------------------------------------


def _load(path: Path, quantization: str) -> LlamaForCausalLM:
    cfg = dataclasses.replace(ModelConfig.from_dir(path), quantization=quantization)
    return load_model(path, cfg, CPU, torch.float32, 64)


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    return load_file(path / "model.safetensors")


def _stored(model: LlamaForCausalLM) -> dict[str, tuple[torch.Tensor, torch.Tensor | None]]:
    """Every layer's projections as stored: (weight, scale per row or None)."""
    out = {}
    for i, layer in enumerate(model.model.layers):
        for name in MODULES:
            module = getattr(layer.self_attn if name in ("qkv_proj", "o_proj") else layer.mlp, name)
            out[f"{i}.{name}"] = (module.weight.data, module.weight_scale)
    return out


def _checkpoint_weight(ckpt: dict[str, torch.Tensor], name: str, scale_name: str) -> torch.Tensor:
    """A checkpoint weight's value: dequantised if FP8."""
    w = ckpt[f"{name}.weight"]
    return _dequantize(w, ckpt[f"{name}.{scale_name}"]) if w.dtype == fp8.FP8 else w


def _expected(ckpt: dict[str, torch.Tensor], key: str, scale_name: str) -> torch.Tensor:
    """The module ``key`` ("layer.module") of the checkpoint, its parts dequantised and concatenated."""
    layer, module = key.split(".")
    return torch.cat([_checkpoint_weight(ckpt, f"model.layers.{layer}.{part}", scale_name) for part in MODULES[module]])


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.uint8)


def _prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in (7, 40)]


# --- loading ----------------------------------------------------------------------------------------------


def test_channel_checkpoint_stores_what_quantising_at_load_stores(base_dir, tmp_path):
    ckpt_dir = _write_fp8(base_dir, tmp_path / "channel", _compressed_tensors(
        {"group_0": (["Linear"], _ct_weights("channel"))}, ignore=["lm_head", "model.layers.0.mlp.down_proj"]),
        _projections("channel", skip=("layers.0.mlp.down_proj",)))
    assert _checkpoint(ckpt_dir)["model.layers.1.mlp.down_proj.weight"].dtype == fp8.FP8
    ignored = _checkpoint(ckpt_dir)["model.layers.0.mlp.down_proj.weight"]
    assert ignored.dtype == torch.float32  # in `ignore`
    at_load = make_engine(base_dir, "model.quantization=fp8")
    everything = make_engine(ckpt_dir, "model.quantization=fp8")  # the ignored layer quantised at load too
    published = make_engine(ckpt_dir)  # model.quantization=auto: FP8 where the checkpoint is, as published
    ours, theirs, all_fp8 = _stored(published.model), _stored(at_load.model), _stored(everything.model)
    for key, (weight, scale) in ours.items():
        assert torch.equal(_bits(all_fp8[key][0]), _bits(theirs[key][0])), key
        assert torch.equal(all_fp8[key][1], theirs[key][1]), key
        if key == "0.down_proj":  # the ignored layer keeps the model dtype, its values as stored
            assert scale is None and torch.equal(weight, ignored)
            continue
        assert weight.dtype == fp8.FP8, key
        assert torch.equal(_bits(weight), _bits(theirs[key][0])), key
        assert torch.equal(scale, theirs[key][1]), key
    assert torch.equal(published.model.lm_head.weight, at_load.model.lm_head.weight)
    prompts = _prompts(LLAMA["vocab_size"], 0)
    for a, b in zip(prefill_logits(everything, prompts), prefill_logits(at_load, prompts)):
        assert torch.equal(a, b)
    # The reference for auto: quantised at load, with the ignored layer put back as stored.
    down = at_load.model.model.layers[0].mlp.down_proj
    down.weight, down.weight_scale = torch.nn.Parameter(ignored.clone(), requires_grad=False), None
    for a, b in zip(prefill_logits(published, prompts), prefill_logits(at_load, prompts)):
        assert torch.equal(a, b)
    del at_load, published, everything
    gc.collect()


def test_a_fused_projection_with_parts_of_two_precisions_is_refused_under_auto(base_dir, tmp_path):
    ckpt_dir = _write_fp8(base_dir, tmp_path / "mixed", _compressed_tensors(
        {"group_0": (["Linear"], _ct_weights("channel"))}, ignore=["lm_head", "model.layers.1.self_attn.k_proj"]),
        _projections("channel", skip=("layers.1.self_attn.k_proj",)))
    with pytest.raises(ValueError, match=r"layer 1 stores q_proj F8_E4M3, k_proj F32, v_proj F8_E4M3: .*qkv_proj"):
        _load(ckpt_dir, "auto")
    quantized = _stored(_load(ckpt_dir, "fp8"))
    assert quantized["1.qkv_proj"][0].dtype == fp8.FP8
    dense = _stored(_load(ckpt_dir, "none"))
    assert dense["1.qkv_proj"][0].dtype == torch.float32 and dense["1.qkv_proj"][1] is None


def test_a_pre_quantised_config_over_unquantised_tensors_is_quantised_at_load(base_dir, tmp_path):
    """What scripts/make_random_checkpoint.py writes for an FP8 model's config: the tensors are the model dtype's.
    It runs as model.random_weights=true runs that config, every projection in FP8, and as quantised at load."""
    config = _compressed_tensors({"group_0": (["Linear"], _ct_weights("channel"))}, ignore=["lm_head"])
    ckpt_dir = _write_fp8(base_dir, tmp_path / "unquantised", config, lambda name: None)
    assert not any(t.dtype == fp8.FP8 for t in _checkpoint(ckpt_dir).values())
    ours, at_load = _stored(_load(ckpt_dir, "auto")), _stored(_load(base_dir, "fp8"))
    for key, (weight, scale) in ours.items():
        assert weight.dtype == fp8.FP8 and torch.equal(_bits(weight), _bits(at_load[key][0])), key
        assert torch.equal(scale, at_load[key][1]), key


def test_auto_leaves_an_unquantised_checkpoint_in_the_model_dtype(base_dir):
    assert ModelConfig.from_dir(base_dir).quantization == "auto"
    weight, scale = _stored(_load(base_dir, "auto"))["0.qkv_proj"]
    assert weight.dtype == torch.float32 and scale is None


@pytest.mark.parametrize("method", ["compressed-tensors", "fp8", "autofp8"])
def test_per_tensor_scales_are_broadcast_to_every_row(base_dir, tmp_path, method, caplog):
    config = {"compressed-tensors": _compressed_tensors({"group_0": (["Linear"], _ct_weights("tensor"))}, ignore=[],
                                                        static_inputs=True),
              "fp8": _fine_grained(block=None), "autofp8": _autofp8()}[method]
    scale_name = "weight_scale_inv" if method == "fp8" else "weight_scale"
    input_scales = method != "fp8"
    ckpt_dir = _write_fp8(base_dir, tmp_path / method, config, _projections_and_head("tensor"), scale_name,
                          input_scales=input_scales)
    ckpt = _checkpoint(ckpt_dir)
    with caplog.at_level(logging.INFO, logger="models.weights.loader"):
        model = _load(ckpt_dir, "fp8")
    for key, (weight, scale) in _stored(model).items():
        layer, module = key.split(".")
        parts = [f"model.layers.{layer}.{p}" for p in MODULES[module]]
        assert torch.equal(_bits(weight), _bits(torch.cat([ckpt[f"{p}.weight"] for p in parts]))), key
        rows = [ckpt[f"{p}.weight"].shape[0] for p in parts]
        expected = torch.cat([ckpt[f"{p}.{scale_name}"].reshape(1).expand(n) for p, n in zip(parts, rows)])
        assert torch.equal(scale, expected), key
        assert len(set(scale.tolist())) == len(parts)  # one scale a checkpoint tensor
    # The LM head stays in the model dtype: the checkpoint's FP8 head dequantised.
    assert torch.equal(model.lm_head.weight, _checkpoint_weight(ckpt, "lm_head", scale_name))
    said = [r.getMessage() for r in caplog.records if "activation scales" in r.getMessage()]
    assert len(said) == (1 if input_scales else 0), said


def test_block_checkpoint_is_requantised_per_row_and_gives_the_dequantised_models_logits(base_dir, tmp_path):
    ckpt_dir = _write_fp8(base_dir, tmp_path / "block", _fine_grained(), _projections("block"), "weight_scale_inv")
    ckpt = _checkpoint(ckpt_dir)
    assert ckpt["model.layers.0.self_attn.k_proj.weight_scale_inv"].shape == (1, 2)  # 96 x 192: ragged blocks
    assert ckpt["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (2, 3)  # 192 x 300
    fp8_engine = make_engine(ckpt_dir)
    for key, (weight, scale) in _stored(fp8_engine.model).items():
        values, expected_scale = fp8.quantize_rows(_expected(ckpt, key, "weight_scale_inv"))
        assert torch.equal(_bits(weight), _bits(values)), key
        assert torch.equal(scale, expected_scale), key
    # The same weights as quantising a float32 checkpoint of the dequantised blocks at load: the same logits.
    at_load = make_engine(_write_dequantized(ckpt_dir, tmp_path / "dequantized"), "model.quantization=fp8")
    dense = make_engine(ckpt_dir, "model.quantization=none")
    prompts = _prompts(LLAMA["vocab_size"], 1)
    for ours, theirs, exact in zip(*(prefill_logits(e, prompts) for e in (fp8_engine, at_load, dense))):
        assert torch.equal(ours, theirs)
        # Stated tolerance: FP8 weights (blocks of magnitudes 0.5-2 x in a row) and per-token FP8 activations
        # against the float32 model of the dequantised checkpoint; measured 0.06-0.11 over 8 prompts.
        assert relative_error(ours, exact) < 0.2
    del fp8_engine, at_load, dense
    gc.collect()


@pytest.mark.parametrize("strategy", ["channel", "tensor", "block"])
def test_quantization_none_dequantises_an_fp8_checkpoint(base_dir, tmp_path, strategy, caplog):
    block = [BLOCK, BLOCK] if strategy == "block" else None
    config = _compressed_tensors({"group_0": (["Linear"], _ct_weights(strategy, block))}, ignore=[],
                                 fmt="naive-quantized")
    ckpt_dir = _write_fp8(base_dir, tmp_path / strategy, config, _projections_and_head(strategy))
    ckpt = _checkpoint(ckpt_dir)
    with caplog.at_level(logging.INFO, logger="models.weights.loader"):
        model = _load(ckpt_dir, "none")
    said = [r.getMessage() for r in caplog.records]
    assert any("FP8 weights dequantised to torch.float32" in m for m in said), said
    assert not any("re-quantised" in m for m in said), said  # the log says what was done, only that
    for key, (weight, scale) in _stored(model).items():
        assert scale is None and weight.dtype == torch.float32, key
        assert torch.equal(weight, _expected(ckpt, key, "weight_scale")), key
    assert torch.equal(model.lm_head.weight, _checkpoint_weight(ckpt, "lm_head", "weight_scale"))


MOE = {"architectures": ["Qwen3MoeForCausalLM"], "hidden_size": 96, "intermediate_size": 192,
       "moe_intermediate_size": 48, "num_experts": 4, "num_experts_per_tok": 2, "norm_topk_prob": True,
       "num_hidden_layers": 1, "num_attention_heads": 12, "num_key_value_heads": 6, "head_dim": 16,
       "vocab_size": 64, "max_position_embeddings": 256, "tie_word_embeddings": False}


def _expert_weights(ckpt: dict[str, torch.Tensor], e: int, scale_name: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Expert ``e`` of layer 0 as the checkpoint holds it, dequantised: (gate rows then up rows, down)."""
    gate, up, down = (_checkpoint_weight(ckpt, f"model.layers.0.mlp.experts.{e}.{p}_proj", scale_name)
                      for p in ("gate", "up", "down"))
    return torch.cat([gate, up]), down


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_moe_experts_load_in_fp8_and_routers_in_the_model_dtype(tmp_path, layout):
    """Per-row expert scales as published; 128 x 128 blocks re-quantised per row, as dense projections are; the
    router (mlp.gate, unquantised in the checkpoint) stays float32. Under none, every expert is dequantised."""
    base = _random_checkpoint(tmp_path, MOE, "moe")
    if layout == "channel":
        config, scale_name = _compressed_tensors({"group_0": (["Linear"], _ct_weights("channel"))}, []), "weight_scale"
    else:
        config, scale_name = _fine_grained(), "weight_scale_inv"
    ckpt_dir = _write_fp8(base, tmp_path / "moe-fp8", config, _projections(layout), scale_name)
    ckpt = _checkpoint(ckpt_dir)
    model = _load(ckpt_dir, "auto")
    mlp = model.model.layers[0].mlp
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == fp8.FP8
    assert torch.equal(mlp.gate.weight, ckpt["model.layers.0.mlp.gate.weight"])
    experts = mlp.experts
    assert experts.w13.dtype == experts.w2.dtype == fp8.FP8
    for e in range(MOE["num_experts"]):
        assert ckpt[f"model.layers.0.mlp.experts.{e}.down_proj.weight"].dtype == fp8.FP8
        w13, w2 = _expert_weights(ckpt, e, scale_name)
        if layout == "channel":  # stored as published, bit for bit
            parts = [f"model.layers.0.mlp.experts.{e}.{p}_proj" for p in ("gate", "up")]
            assert torch.equal(_bits(experts.w13[e]), _bits(torch.cat([ckpt[f"{p}.weight"] for p in parts])))
            assert torch.equal(experts.w13_scale[e], torch.cat([ckpt[f"{p}.weight_scale"] for p in parts]).flatten())
            down = f"model.layers.0.mlp.experts.{e}.down_proj"
            assert torch.equal(_bits(experts.w2[e]), _bits(ckpt[f"{down}.weight"]))
            assert torch.equal(experts.w2_scale[e], ckpt[f"{down}.weight_scale"].flatten())
        for (values, scale), weight in (((experts.w13[e], experts.w13_scale[e]), w13),
                                        ((experts.w2[e], experts.w2_scale[e]), w2)):
            requantized = fp8.quantize_rows(weight)  # the checkpoint's values, per row
            assert torch.equal(_bits(values), _bits(requantized[0])) and torch.equal(scale, requantized[1])
    dense = _load(ckpt_dir, "none").model.layers[0].mlp.experts
    assert dense.w13_scale is None and dense.w13.dtype == torch.float32
    for e in range(MOE["num_experts"]):
        w13, w2 = _expert_weights(ckpt, e, scale_name)
        assert torch.equal(dense.w13[e], w13) and torch.equal(dense.w2[e], w2)


def test_moe_experts_an_fp8_checkpoint_leaves_unquantised_keep_the_model_dtype(tmp_path):
    """Experts in the checkpoint's ignore list run as published under auto; experts of one layer in two
    precisions are refused (they run as one kernel), naming the layer and what it stores."""
    base = _random_checkpoint(tmp_path, MOE, "moe")
    config = _compressed_tensors({"group_0": (["Linear"], _ct_weights("channel"))}, ["re:.*experts.*"])
    model = _load(_write_fp8(base, tmp_path / "dense-experts", config, _projections("channel", ("experts",))), "auto")
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == fp8.FP8
    assert model.model.layers[0].mlp.experts.w13.dtype == torch.float32
    assert model.model.layers[0].mlp.experts.w13_scale is None
    mixed = _write_fp8(base, tmp_path / "mixed", config, _projections("channel", ("experts.1.",)))
    with pytest.raises(ValueError, match=r"layer 0 stores 9 expert weights in F8_E4M3 and 3 expert weights in F32: "
                                         r"they run as one fused kernel \(experts\)"):
        _load(mixed, "auto")
    assert _load(mixed, "fp8").model.layers[0].mlp.experts.w13.dtype == fp8.FP8  # the others quantised at load


@pytest.mark.parametrize("world", [2, 3])
def test_tp_stores_tp1_weights_and_gives_its_logits(base_dir, tmp_path, world):
    # Attention per channel, the MLP in 128 x 128 blocks: rank slices of both kinds of scale.
    config = _compressed_tensors({"attention": (["re:.*self_attn.*"], _ct_weights("channel")),
                                  "mlp": (["re:.*mlp.*"], _ct_weights("block", [BLOCK, BLOCK]))}, ignore=["lm_head"])

    def strategy(name: str) -> str | None:
        return None if not PROJECTION.search(name) else "channel" if "self_attn" in name else "block"

    ckpt_dir = str(_write_fp8(base_dir, tmp_path / "mixed", config, strategy))
    prompts = _prompts(LLAMA["vocab_size"], world)
    ref = fp8_weights_and_logits(0, ckpt_dir, prompts)
    exact = fp8_weights_and_logits(0, ckpt_dir, prompts, "none")["logits"]
    ranks = run_ranks(world, fp8_weights_and_logits, ckpt_dir, prompts)
    inter = LLAMA["intermediate_size"] // world
    attn = LLAMA["num_attention_heads"] * LLAMA["head_dim"] // world
    for rank, got in enumerate(ranks):
        # Row-parallel: this rank's columns of TP=1's values, TP=1's whole-row scales.
        for name, cols in (("o_proj", slice(rank * attn, (rank + 1) * attn)),
                           ("down_proj", slice(rank * inter, (rank + 1) * inter))):
            assert torch.equal(got["weights"][name][0], ref["weights"][name][0][:, cols]), (rank, name)
            assert torch.equal(got["weights"][name][1], ref["weights"][name][1]), (rank, name)
        # Column-parallel: this rank's gate rows and up rows, with their scales.
        rows = torch.cat([torch.arange(rank * inter, (rank + 1) * inter) + part * LLAMA["intermediate_size"]
                          for part in (0, 1)])
        for i in (0, 1):
            assert torch.equal(got["weights"]["gate_up_proj"][i], ref["weights"]["gate_up_proj"][i][rows]), rank
        # As tests/test_fp8.py states: the all-reduce's order, magnified by FP8 rounding of the next activations,
        # stays within FP8's own distance from the dequantised model.
        for ours, theirs, dense in zip(got["logits"], ref["logits"], exact):
            assert relative_error(ours, theirs) <= relative_error(theirs, dense)
        for ours, first in zip(got["logits"], ranks[0]["logits"]):
            assert torch.equal(ours, first)


# --- refusals ---------------------------------------------------------------------------------------------


REFUSED = {
    "gptq": ({"quant_method": "gptq", "bits": 4, "group_size": 128}, r"quant_method='gptq'"),
    "awq": ({"quant_method": "awq", "bits": 4, "version": "gemm"}, r"quant_method='awq'"),
    "bitsandbytes": ({"quant_method": "bitsandbytes", "load_in_4bit": True}, r"quant_method='bitsandbytes'"),
    "ct_int8": (_compressed_tensors({"group_0": (["Linear"], {**_ct_weights("channel"), "type": "int"})}, ["lm_head"],
                                    fmt="int-quantized"), r"format='int-quantized'"),
    "ct_int8_naive": (_compressed_tensors({"group_0": (["Linear"], {**_ct_weights("channel"), "type": "int"})},
                                          ["lm_head"], fmt="naive-quantized"),
                      r"config_groups\.group_0\.weights\.type='int'"),
    "ct_int4": (_compressed_tensors({"group_0": (["Linear"], {**_ct_weights("group"), "type": "int", "num_bits": 4,
                                                              "group_size": 128})}, ["lm_head"], fmt="pack-quantized"),
                r"format='pack-quantized'"),
    "ct_fp4": (_compressed_tensors({"group_0": (["Linear"], {**_ct_weights("tensor"), "num_bits": 4})}, ["lm_head"]),
               r"config_groups\.group_0\.weights\.num_bits=4"),
    "ct_group": (_compressed_tensors({"group_0": (["Linear"], {**_ct_weights("group"), "group_size": 128})}, []),
                 r"config_groups\.group_0\.weights\.strategy='group'"),
    "ct_block_size": (_compressed_tensors({"group_0": (["Linear"], _ct_weights("block", [128]))}, []),
                      r"config_groups\.group_0\.weights\.block_structure=\[128\]"),
    "ct_kv_cache_per_head": ({**_compressed_tensors({"group_0": (["Linear"], _ct_weights("channel"))}, []),
                              "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "attn_head"}},
                             r"kv_cache_scheme\.strategy='attn_head'"),
    "fp8_block_size": ({**_fine_grained(), "weight_block_size": [128]}, r"weight_block_size=\[128\]"),
    "fp8_activations": ({**_fine_grained(), "activation_scheme": "per_group"}, r"activation_scheme='per_group'"),
    "fp8_ue8m0": ({**_fine_grained(), "scale_fmt": "ue8m0"}, r"scale_fmt='ue8m0'"),
    "autofp8_kv_dynamic": ({**_autofp8(), "kv_cache_scheme": "dynamic"}, r"kv_cache_scheme='dynamic'"),
    "fp8_block_kv_dynamic": ({**_fine_grained(), "kv_cache_scheme": "dynamic"}, r"kv_cache_scheme='dynamic'"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_other_quantisations_are_refused_naming_the_field(base_dir, tmp_path, name):
    quantization_config, field = REFUSED[name]
    config = {**json.loads((base_dir / "config.json").read_text()), "quantization_config": quantization_config}
    (tmp_path / "config.json").write_text(json.dumps(config))
    where = re.escape(f"{tmp_path / 'config.json'}: quantization_config.")
    with pytest.raises(ValueError, match=where + field) as info:
        ModelConfig.from_dir(tmp_path)
    assert "model.quantization=fp8 quantises at load" in str(info.value)


def test_a_block_checkpoint_whose_config_omits_the_block_size_says_so(base_dir, tmp_path):
    """Without weight_block_size an 'fp8' config is AutoFP8's per-tensor layout (as vLLM reads it); block scales
    (weight_scale_inv) then fail naming the missing field."""
    config = {k: v for k, v in _fine_grained().items() if k != "weight_block_size"}
    ckpt_dir = _write_fp8(base_dir, tmp_path / "ckpt", config, _projections("block"), "weight_scale_inv")
    with pytest.raises(ValueError, match=r"weight_scale is missing .* it has weight_scale_inv: .* must state "
                                         r"weight_block_size"):
        _load(ckpt_dir, "fp8")


@pytest.mark.parametrize("damage", ["missing", "wrong_shape", "unquantised_weight", "no_config", "nan", "inf",
                                    "negative"])
def test_a_bad_scale_fails_at_load_naming_the_tensor(base_dir, tmp_path, damage):
    config = _compressed_tensors({"group_0": (["Linear"], _ct_weights("channel"))}, ["lm_head"])
    ckpt_dir = _write_fp8(base_dir, tmp_path / "ckpt", config, _projections("channel"))
    tensors = _checkpoint(ckpt_dir)
    scale = "model.layers.1.self_attn.k_proj.weight_scale"
    if damage == "missing":
        del tensors[scale]
        expected = "model.layers.1.self_attn.k_proj.weight .* its scale model.layers.1.self_attn.k_proj.weight_scale"
    elif damage == "wrong_shape":
        tensors[scale] = torch.ones(1, 2)
        expected = rf"{scale} .* has shape \(1, 2\); .* \(96, 1\) \(channel\)"
    elif damage == "unquantised_weight":
        weight = scale[: -len("_scale")]
        tensors[weight] = tensors[weight].float()
        expected = rf"{scale} .* scales {weight}, which is stored in F32"
    elif damage in ("nan", "inf", "negative"):
        value = {"nan": float("nan"), "inf": float("inf"), "negative": -0.5}[damage]
        tensors[scale] = tensors[scale].clone()
        tensors[scale][7] = value
        expected = rf"{scale} in .* holds {value} at \[7, 0\] \(1 bad of 96\); .* finite and not negative"
    else:
        config_file = ckpt_dir / "config.json"
        config_file.write_text(json.dumps({k: v for k, v in json.loads(config_file.read_text()).items()
                                           if k != "quantization_config"}))
        expected = r"model\.layers\.\d\.\S+_proj\.weight .* is F8_E4M3, but .*config\.json has no quantization_config"
    save_file(tensors, str(ckpt_dir / "model.safetensors"))
    with pytest.raises(ValueError, match=expected):
        _load(ckpt_dir, "fp8")


def test_quantization_setting():
    assert load_config().model.quantization == "auto"
    assert load_config(overrides=["engine.deterministic=true"]).model.quantization == "none"  # dequantise
    assert load_config(overrides=["model.quantization=none"]).model.quantization == "none"
    with pytest.raises(ConfigError, match="deterministic.*fp8"):
        load_config(overrides=["model.quantization=fp8", "engine.deterministic=true"])
    with pytest.raises(ConfigError, match="model.quantization.*'int8'.*\\['auto', 'none', 'fp8'\\]"):
        load_config(overrides=["model.quantization=int8"])
