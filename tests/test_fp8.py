"""FP8 weights (models/fp8.py, ``model.quantization=fp8``) on CPU: the quantiser's error bound, the emulated
GEMM against float64, quantise-at-load against the checkpoint, TP=2 and TP=3 against TP=1, the default model
against its own float32 weights, and the refusals."""

from __future__ import annotations

import gc
import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from models import fp8
from models.config import ModelConfig
from runtime.config import ConfigError, load_config
from tests.helpers import assert_same_quantization, make_engine, prefill_logits, relative_error
from tests.tp_utils import run_ranks


def test_quantize_rows_error_is_within_half_an_e4m3_step():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 200, generator=gen) * torch.logspace(-3, 3, 64)[:, None]
    x[5] = 0.0
    values, scale = fp8.quantize_rows(x)
    assert values.dtype == fp8.FP8 and scale.dtype == torch.float32
    err = (fp8.dequantize_rows(values, scale) - x).abs()
    # 3 mantissa bits: half a step is 2^-4 of a normal value; subnormals step by 2^-9 of the scale.
    bound = 2**-4 * x.abs() + 2**-10 * scale[:, None]
    assert (err <= bound * (1 + 1e-6)).all()
    assert (fp8.dequantize_rows(values, scale)[5] == 0).all()
    nonzero = [i for i in range(64) if i != 5]
    assert (values[nonzero].float().abs().amax(dim=1) == fp8.FP8_MAX).all()  # each row uses the whole range


def test_fp8_linear_on_cpu_is_the_product_of_the_quantised_operands():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 3, 64, generator=gen)
    w = torch.randn(48, 64, generator=gen) / 8
    bias = torch.randn(48, generator=gen)
    wq, ws = fp8.quantize_rows(w)
    out = fp8.linear(x, wq, ws, bias)
    xq, xs = fp8.quantize_rows(x.reshape(-1, 64))
    expected = fp8.dequantize_rows(xq, xs).double() @ fp8.dequantize_rows(wq, ws).double().T + bias.double()
    assert out.shape == (5, 3, 48) and out.dtype == torch.float32
    torch.testing.assert_close(out.reshape(-1, 48).double(), expected, rtol=1e-5, atol=1e-5)
    assert relative_error(out, x @ w.T + bias) < 0.1  # and near the unquantised product


def _checkpoint_rows(model_dir) -> dict[str, torch.Tensor]:  # noqa: ANN001
    tensors = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(file))
    return tensors


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])  # the interpreter rounds bf16 its own way
def test_silu_mul_quantize_kernel_equals_silu_mul_then_the_quantizer(dtype):
    """The fused kernel (Triton's interpreter here, compiled in test_gpu_fp8.py) against torch's SiLU x mul, then
    ``quantize_rows``: the same scales, and the same values but where an exp rounded apart moves a tie."""
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 2 * 200, generator=gen) * 2).to(dtype)
    gate, up = x.float().chunk(2, dim=-1)
    values, scale = fp8.quantize_rows((gate / (1 + torch.exp(-gate)) * up).to(dtype))
    got = fp8.silu_mul_quantize(x)
    assert got.dtype == dtype
    assert_same_quantization(got, values, scale, exact_share=0.99, scale_rtol=2**-10)


def test_quantize_at_load_stores_each_checkpoint_row_quantised(tiny_llama_dir):
    engine = make_engine(tiny_llama_dir, "model.quantization=fp8")
    ckpt = _checkpoint_rows(tiny_llama_dir)
    layer = engine.model.model.layers[1]
    prefix = "model.layers.1."
    expected = {
        "qkv_proj": torch.cat([ckpt[f"{prefix}self_attn.{p}_proj.weight"] for p in "qkv"]),
        "o_proj": ckpt[f"{prefix}self_attn.o_proj.weight"],
        "gate_up_proj": torch.cat([ckpt[f"{prefix}mlp.{p}_proj.weight"] for p in ("gate", "up")]),
        "down_proj": ckpt[f"{prefix}mlp.down_proj.weight"],
    }
    modules = {"qkv_proj": layer.self_attn.qkv_proj, "o_proj": layer.self_attn.o_proj,
               "gate_up_proj": layer.mlp.gate_up_proj, "down_proj": layer.mlp.down_proj}
    for name, module in modules.items():
        values, scale = fp8.quantize_rows(expected[name])
        assert module.weight.dtype == fp8.FP8, name
        assert torch.equal(module.weight.view(torch.uint8), values.view(torch.uint8)), name
        assert torch.equal(module.weight_scale, scale), name
    # Embeddings, norms and the LM head stay in the model dtype; the weights take a quarter of float32's bytes.
    assert engine.model.lm_head.weight.dtype == torch.float32
    dense = make_engine(tiny_llama_dir)
    quantized_params = sum(m.weight.numel() for m in modules.values())
    assert dense.weight_bytes - engine.weight_bytes >= len(engine.model.model.layers) * quantized_params * 3 * 0.99
    del engine, dense
    gc.collect()  # engines hold reference cycles and a CPU KV pool each


def fp8_weights_and_logits(rank: int, model_dir: str, prompts: list[list[int]], quantization: str = "fp8") -> dict:
    engine = make_engine(model_dir, f"model.quantization={quantization}", "cache.page_size=4")
    if quantization == "none":
        logits = prefill_logits(engine, prompts, chunk=16, decode_tail=4)
        del engine
        gc.collect()
        return {"logits": logits}
    layer = engine.model.model.layers[0]
    weights = {name: (m.weight.view(torch.uint8).clone(), m.weight_scale.clone()) for name, m in
               (("o_proj", layer.self_attn.o_proj), ("gate_up_proj", layer.mlp.gate_up_proj),
                ("down_proj", layer.mlp.down_proj))}
    logits = prefill_logits(engine, prompts, chunk=16, decode_tail=4)
    del engine, layer
    gc.collect()
    return {"weights": weights, "logits": logits}


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 3])
def test_fp8_tp_stores_tp1_weights_and_gives_its_logits(tmp_path, default_model_dir, world):
    from tests.conftest import make_tiny_llama

    # TP=3: the default model (9 heads, 3 KV heads); TP=2: a tiny Llama with 8 and 4.
    model_dir = str(default_model_dir if world == 3 else
                    make_tiny_llama(tmp_path / "tiny", vocab=500, heads=8, kv_heads=4, seed=5))
    vocab = ModelConfig.from_dir(model_dir).vocab_size
    gen = torch.Generator().manual_seed(world)
    prompts = [torch.randint(0, vocab - 1, (n,), generator=gen).tolist() for n in (7, 40)]
    ref = fp8_weights_and_logits(0, model_dir, prompts)
    unquantized = fp8_weights_and_logits(0, model_dir, prompts, "none")["logits"]
    ranks = run_ranks(world, fp8_weights_and_logits, model_dir, prompts)
    inter = ref["weights"]["gate_up_proj"][0].shape[0] // 2 // world
    for rank, got in enumerate(ranks):
        cols = slice(rank * (ref["weights"]["o_proj"][0].shape[1] // world),
                     (rank + 1) * (ref["weights"]["o_proj"][0].shape[1] // world))
        # Row-parallel: this rank's columns of TP=1's values, and TP=1's scales (taken over whole rows).
        assert torch.equal(got["weights"]["o_proj"][0], ref["weights"]["o_proj"][0][:, cols])
        assert torch.equal(got["weights"]["o_proj"][1], ref["weights"]["o_proj"][1])
        down_cols = slice(rank * inter, (rank + 1) * inter)
        assert torch.equal(got["weights"]["down_proj"][0], ref["weights"]["down_proj"][0][:, down_cols])
        assert torch.equal(got["weights"]["down_proj"][1], ref["weights"]["down_proj"][1])
        # Column-parallel: this rank's gate rows and up rows.
        full = ref["weights"]["gate_up_proj"]
        rows = torch.cat([torch.arange(rank * inter, (rank + 1) * inter),
                          torch.arange(world * inter + rank * inter, world * inter + (rank + 1) * inter)])
        assert torch.equal(got["weights"]["gate_up_proj"][0], full[0][rows])
        assert torch.equal(got["weights"]["gate_up_proj"][1], full[1][rows])
        # A row-parallel input is quantised per token with the amax of its whole row, as at TP=1, so only the
        # all-reduce's summation order differs. FP8 rounding of the next activations turns even that into a
        # visible difference (a 1e-7 relative nudge of every activation moves the default model's TP=1 logits
        # by 8-13%); it stays below FP8's own distance from the unquantised model (measured 0.4-0.6 of it).
        for ours, theirs, exact in zip(got["logits"], ref["logits"], unquantized):
            tp_err, fp8_err = relative_error(ours, theirs), relative_error(theirs, exact)
            print(f"TP={world}: {tp_err:.3f} from TP=1's FP8 logits; FP8 {fp8_err:.3f} from the model dtype")
            assert tp_err <= fp8_err
        for ours, first in zip(got["logits"], ranks[0]["logits"]):
            assert torch.equal(ours, first)


TEXTS = [
    "The capital of France is Paris. It is known for the Eiffel Tower, which was built in 1889 for the World's Fair.",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and water.",
    "In 1969, Neil Armstrong became the first person to walk on the Moon during the Apollo 11 mission.",
]


@pytest.mark.slow
def test_default_model_fp8_stays_close_to_float32(default_model_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(default_model_dir))
    prompts = [tokenizer(t)["input_ids"] for t in TEXTS]
    full = prefill_logits(make_engine(default_model_dir), prompts)
    quant = prefill_logits(make_engine(default_model_dir, "model.quantization=fp8"), prompts)
    gc.collect()
    agree = torch.cat([(a.argmax(-1) == b.argmax(-1)) for a, b in zip(full, quant)]).float().mean().item()
    nll_change = []
    for a, b, p in zip(full, quant, prompts):
        target = torch.tensor(p[1:])[:, None]
        logp_a = torch.log_softmax(a[:-1].double(), -1).gather(1, target)
        logp_b = torch.log_softmax(b[:-1].double(), -1).gather(1, target)
        nll_change.append((logp_a - logp_b).mean().item())
    errors = [relative_error(b, a) for a, b in zip(full, quant)]
    print(f"top-1 agreement {agree:.3f}, logit error {max(errors):.3f}, mean NLL change per text {nll_change}")
    # Stated tolerance for this 135M model (measured 0.93-0.96 agreement, errors 0.13-0.34, +0.001-0.12 nats).
    assert agree >= 0.9
    assert max(errors) <= 0.5
    assert max(nll_change) <= 0.2


def test_a_quantized_checkpoint_is_refused_naming_its_method(tiny_llama_dir, tmp_path):
    model_dir = tmp_path / "gptq"
    shutil.copytree(tiny_llama_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="quantization_config.*'gptq'.*model.quantization=fp8"):
        ModelConfig.from_dir(model_dir)


def test_fp8_config_checks():
    assert load_config(overrides=["model.quantization=fp8"]).model.quantization == "fp8"
    with pytest.raises(ConfigError, match="model.quantization.*'int4'.*\\['auto', 'none', 'fp8'\\]"):
        load_config(overrides=["model.quantization=int4"])
    with pytest.raises(ConfigError, match="deterministic.*fp8"):
        load_config(overrides=["model.quantization=fp8", "engine.deterministic=true"])
