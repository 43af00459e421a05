"""Build a model on the meta device and fill it one tensor slice at a time: no rank holds the whole checkpoint."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import re
import zlib
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import torch
from safetensors import SafetensorError, safe_open
from torch import nn

from models import moe
from models.config import Fp8Checkpoint, ModelConfig
from models.layers import Fp8Weight, FullTensor, SliceSource, load_replicated, vocab_shard
from models.llama import LlamaForCausalLM
from models.ops import TORCH_KERNELS, Kernels
from parallel import any_rank, get_tp

log = logging.getLogger(__name__)

FP8_DTYPE = "F8_E4M3"  # safetensors' name of torch.float8_e4m3fn
FLOAT_DTYPES = ("F32", "F16", "BF16")
# Static activation scales beside FP8 weights: not used, activations are quantised per token at run time.
ACTIVATION_SCALES = ("input_scale", "activation_scale")
# Calibrated FP8 KV-cache scales (compressed-tensors kv_cache_scheme): one per tensor, stored as [] or [1].
KV_SCALES = ("self_attn.k_scale", "self_attn.v_scale")
# The same scales as AutoFP8 and older llm-compressor releases name them: the output scales of k_proj and v_proj.
KV_SCALE_ALIASES = {"self_attn.k_proj.output_scale": KV_SCALES[0], "self_attn.v_proj.output_scale": KV_SCALES[1]}
PER_TENSOR_SHAPES = ((), (1,))
COMPARED_ROWS = 4096  # rows of the LM head and the embedding held at once while comparing them


class TensorInfo(NamedTuple):
    file: str
    shape: tuple[int, ...]
    dtype: str  # safetensors' dtype name: "BF16", "F8_E4M3", ...
    stored_as: str  # the name in the file, where the index holds it under another (KV_SCALE_ALIASES)


@dataclass(frozen=True)
class Fp8Layout:
    """A checkpoint's FP8 weights, each with its scale tensor and strategy, and its unused activation scales."""

    scales: dict[str, tuple[str, str]]  # FP8 weight -> (its scale tensor, "channel" | "tensor" | "block")
    activation_scales: frozenset[str]
    skipped: frozenset[str]  # no parameter of ours: the weight scales (read with their weights), activation scales


def materialize(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """Replace meta parameters by uninitialised ones on ``device``, keeping ties and loaders; buffers start at zero."""
    done: dict[int, nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in done:
                fixed = getattr(param, "fixed_dtype", None)
                new = nn.Parameter(torch.empty(param.shape, device=device, dtype=fixed or dtype), requires_grad=False)
                new.weight_loader = getattr(param, "weight_loader", load_replicated)  # type: ignore[attr-defined]
                done[id(param)] = new
            module._parameters[name] = done[id(param)]
        for name, buffer in list(module._buffers.items()):
            if buffer is not None:
                module._buffers[name] = torch.zeros(buffer.shape, dtype=buffer.dtype, device=device)


@contextlib.contextmanager
def open_checkpoint(file: Path) -> Iterator[Any]:
    """``safe_open`` on the CPU; a damaged file (a cut download, a full disk) fails with one error naming it."""
    try:
        handle = safe_open(str(file), framework="pt", device="cpu")
    except SafetensorError as exc:
        raise ValueError(f"checkpoint file {file} is damaged or incomplete ({exc}); "
                         "download or write it again") from None
    with handle as f:
        yield f


INDEX = "model.safetensors.index.json"


def checkpoint_files(path: Path) -> list[Path]:
    """The files the index names (other safetensors beside them, such as Mistral's consolidated.safetensors in
    its own names, are not this checkpoint), or every *.safetensors without an index."""
    index = path / INDEX
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"{index} is not a safetensors index with a weight_map ({exc!r})") from None
        missing = [name for name in names if not (path / name).is_file()]
        if missing:
            raise FileNotFoundError(f"{index} names {missing}, missing from {path}: download them, or remove the index")
        return [path / name for name in names]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors files in model directory {path}")
    return files


def load_model(
    path: str | Path, cfg: ModelConfig, device: torch.device, dtype: torch.dtype, max_positions: int,
    random_seed: int | None = None, kernels: Kernels = TORCH_KERNELS,
) -> LlamaForCausalLM:
    """The model with weights from ``path``'s safetensors, or random ones when ``random_seed`` is given."""
    path = Path(path)
    if random_seed is None:
        files = checkpoint_files(path)
        # Checked from the headers, so a mismatched checkpoint fails before any allocation, in one message.
        index = checkpoint_index(files)
        tied_head_as_embedding(index, cfg)
        cfg = untie_distinct_lm_head(path, index, cfg)
        cfg = dataclasses.replace(cfg, dense_projections=dense_projections(path, index, cfg))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, kernels)
    if random_seed is None:
        layout = fp8_layout(path, index, cfg.checkpoint_fp8)
        check_checkpoint(path, {n: t for n, t in index.items() if n not in layout.skipped}, model)
    materialize(model, device, dtype)
    if random_seed is not None:
        randomize(model, random_seed)
        model.init_rope(max_positions, device)
        return model
    _log_fp8_loading(path, cfg, layout, dtype)
    params = dict(model.named_parameters())
    filled: set[str] = set()
    with torch.no_grad(), contextlib.ExitStack() as stack:
        handles = {file.name: stack.enter_context(open_checkpoint(file)) for file in files}
        for ckpt_name, info in index.items():
            target = None if ckpt_name in layout.skipped else _target_param(ckpt_name, model)
            if target is None:
                continue
            param_name, shard_id = target
            source: SliceSource = handles[info.file].get_slice(info.stored_as)
            if ckpt_name in layout.scales:
                scale, strategy = layout.scales[ckpt_name]
                assert cfg.checkpoint_fp8 is not None  # fp8_layout found no FP8 tensor without it
                scales = handles[index[scale].file].get_slice(index[scale].stored_as)
                _check_scale_values(scales, scale, path / index[scale].file)
                source = Fp8Weight(source, scales, strategy, cfg.checkpoint_fp8.block, device)
            params[param_name].weight_loader(params[param_name], source, shard_id)
            filled.add(param_name)
    # Guards checkpoint_shapes itself: an unfilled parameter would keep uninitialised memory.
    # An FP8 weight's scale is written with the weight.
    filled |= {n + "_scale" for n in filled}  # weight_scale, w13_scale, w2_scale
    unfilled = sorted(set(params) - filled)
    if unfilled:
        raise RuntimeError(f"internal error: no checkpoint tensor of {path} was loaded into {unfilled}")
    model.init_rope(max_positions, device)
    return model


def checkpoint_index(files: list[Path]) -> dict[str, TensorInfo]:
    """Every tensor in the checkpoint files, in file order, read from the headers only; older names of the
    KV-cache scales under the current ones."""
    index: dict[str, TensorInfo] = {}
    for file in files:
        with open_checkpoint(file) as f:
            for stored in f.keys():
                name = _current_name(stored)
                if name in index and index[name].stored_as != stored:
                    raise ValueError(f"checkpoint tensors {index[name].stored_as} in {index[name].file} and {stored} "
                                     f"in {file.name} are both {name}: keep one")
                tensor = f.get_slice(stored)
                index[name] = TensorInfo(file.name, tuple(tensor.get_shape()), tensor.get_dtype(), stored)
    return index


def tied_head_as_embedding(index: dict[str, TensorInfo], cfg: ModelConfig) -> None:
    """A tied checkpoint that stores the shared matrix as lm_head.weight alone: transformers ties the embedding
    to it, and so do we (the embedding reads that tensor)."""
    if cfg.tie_word_embeddings and "lm_head.weight" in index and "model.embed_tokens.weight" not in index:
        index["model.embed_tokens.weight"] = index.pop("lm_head.weight")


def untie_distinct_lm_head(path: Path, index: dict[str, TensorInfo], cfg: ModelConfig) -> ModelConfig:
    """``cfg`` untied where config.json ties the LM head to the embedding but the checkpoint holds an lm_head.weight
    of other values: transformers then warns and uses the checkpoint's head, and so do we. Each rank compares only
    its vocab shard (what it loads), a block of rows at a time; one flag over the TP group decides for all."""
    head, embed = index.get("lm_head.weight"), index.get("model.embed_tokens.weight")
    if not (cfg.tie_word_embeddings and head and embed):
        return cfg
    differs = (head.shape, head.dtype) != (embed.shape, embed.dtype)
    if not differs:
        _, start, end = vocab_shard(cfg.vocab_size)
        with open_checkpoint(path / head.file) as h, open_checkpoint(path / embed.file) as e:
            heads, embeds = h.get_slice(head.stored_as), e.get_slice(embed.stored_as)
            blocks = (slice(lo, min(lo + COMPARED_ROWS, end)) for lo in range(start, end, COMPARED_ROWS))
            differs = any(not torch.equal(heads[rows], embeds[rows]) for rows in blocks)
    if not any_rank(differs):
        return cfg
    if get_tp().rank == 0:
        log.warning("%s: config.json ties the LM head to the embedding (tie_word_embeddings), but the checkpoint's "
                    "lm_head.weight differs from model.embed_tokens.weight: using the checkpoint's lm_head, as "
                    "transformers does; set tie_word_embeddings to false in config.json to silence this", path)
    return dataclasses.replace(cfg, tie_word_embeddings=False)


# Our fused projections and the checkpoint modules (under model.layers.N.) that fill them.
_PROJECTION_PARTS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                     "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                     "mlp.down_proj": ("mlp.down_proj",)}


def _projection_parts(cfg: ModelConfig, layer: int) -> dict[str, list[str]]:
    """Our projections of ``layer`` that may run in FP8 (a sparse layer's experts as one), each with the
    checkpoint weights it is made of."""
    prefix = f"model.layers.{layer}."
    parts = {ours: [f"{prefix}{part}.weight" for part in theirs] for ours, theirs in _PROJECTION_PARTS.items()
             if not (ours.startswith("mlp.") and cfg.is_sparse(layer))}
    if cfg.is_sparse(layer):
        parts["mlp.experts"] = [name for name in moe.expert_names(cfg, layer) if ".experts." in name]
    return parts


def dense_projections(path: Path, index: dict[str, TensorInfo], cfg: ModelConfig) -> frozenset[str]:
    """Under model.quantization=auto, the projections an FP8 checkpoint stores unquantised (in its ``ignore`` or
    ``modules_to_not_convert`` list): they keep the model dtype, as published. Read from the tensors' dtypes,
    which are what the lists describe. Parts of one fused projection must agree: it has one weight dtype."""
    if cfg.quantization != "auto" or not cfg.fp8:
        return frozenset()
    if not any(info.dtype == FP8_DTYPE for info in index.values()):
        # A pre-quantised config over unquantised tensors (scripts/make_random_checkpoint.py writes such): quantised
        # at load, as model.random_weights=true runs that config.
        return frozenset()
    dense = set()
    for layer in range(cfg.num_layers):
        for ours, parts in _projection_parts(cfg, layer).items():
            dtypes = {part: index[part].dtype for part in parts if part in index}  # a missing one: check_checkpoint
            stored_fp8 = [part for part, dtype in dtypes.items() if dtype == FP8_DTYPE]
            if not stored_fp8:
                dense.add(f"model.layers.{layer}.{ours}")
            elif len(stored_fp8) < len(dtypes):
                if len(dtypes) <= 3:
                    shown = ", ".join(f"{part.split('.')[-2]} {dtype}" for part, dtype in dtypes.items())
                else:  # a sparse layer's experts: hundreds of tensors
                    counts = Counter(dtypes.values())
                    shown = " and ".join(f"{n} expert weights in {dtype}" for dtype, n in counts.items())
                raise ValueError(f"{path}: layer {layer} stores {shown}: they run as one fused "
                                 f"{'kernel' if ours == 'mlp.experts' else 'projection'} ({ours.split('.')[-1]}), so "
                                 "they need one precision; set model.quantization=fp8 (quantise the others at load) "
                                 "or none (dequantise all)")
    return frozenset(dense)


def _current_name(stored: str) -> str:
    for old, new in KV_SCALE_ALIASES.items():
        if stored.endswith("." + old):
            return stored[: -len(old)] + new
    return stored


def fp8_layout(path: Path, index: dict[str, TensorInfo], quant: Fp8Checkpoint | None) -> Fp8Layout:
    """Pair every e4m3 tensor with its scale, checking the scale's shape against ``quant``; the first tensor
    that does not fit fails with a ValueError naming it."""
    scales: dict[str, tuple[str, str]] = {}
    for name, info in index.items():
        if info.dtype == FP8_DTYPE:
            scales[name] = _fp8_scale(path, index, name, quant)
    used = frozenset(scale for scale, _ in scales.values())
    if quant is None:
        return Fp8Layout(scales, frozenset(), used)
    for name, info in index.items():
        if name.endswith(f".{quant.scale_name}") and name not in used:
            weight = name[: -len(quant.scale_name)] + "weight"
            what = f"stored in {index[weight].dtype}" if weight in index else "not in the checkpoint"
            raise ValueError(f"checkpoint tensor {name} in {path / info.file} scales {weight}, which is {what}; "
                             f"only {FP8_DTYPE} weights have scales")
    activation_scales = frozenset(n for n in index if n.rsplit(".", 1)[-1] in ACTIVATION_SCALES)
    return Fp8Layout(scales, activation_scales, used | activation_scales)


def _check_scale_values(scales: SliceSource, name: str, file: Path) -> None:
    """A NaN, infinite or negative scale is corrupt data: refused at load, not found in the logits later. (Zero is
    kept: it is what a quantiser writes for an all-zero row.) Scales are small, so every rank reads them whole."""
    values = scales[...].float()
    bad = ~(torch.isfinite(values) & (values >= 0))
    if bad.any():
        raise ValueError(f"checkpoint tensor {name} in {file} holds {values[bad].reshape(-1)[0].item()} at "
                         f"{[int(i) for i in bad.nonzero()[0]]} ({int(bad.sum())} bad of {values.numel()}); "
                         "a weight scale must be finite and not negative")


def _fp8_scale(path: Path, index: dict[str, TensorInfo], name: str,
               quant: Fp8Checkpoint | None) -> tuple[str, str]:
    """(the scale tensor of the e4m3 weight ``name``, its strategy)."""
    info = index[name]
    where = f"checkpoint tensor {name} {info.shape} in {path / info.file} is {FP8_DTYPE}"
    if quant is None:
        raise ValueError(f"{where}, but {path / 'config.json'} has no quantization_config saying how it is scaled")
    if not name.endswith(".weight") or len(info.shape) != 2:
        raise ValueError(f"{where}: only 2-D weights can be FP8")
    scale = name[: -len("weight")] + quant.scale_name
    if scale not in index:
        block_scale = name[: -len("weight")] + "weight_scale_inv"
        hint = ("; it has weight_scale_inv: an 'fp8' quantization_config without weight_block_size is AutoFP8's "
                "per-tensor weight_scale, so a block-wise checkpoint must state weight_block_size (transformers "
                "writes [128, 128])") if quant.method == "fp8" and block_scale in index else ""
        raise ValueError(f"{where}, but its scale {scale} is missing from the checkpoint{hint}")
    scale_info = index[scale]
    if scale_info.dtype not in FLOAT_DTYPES:
        raise ValueError(f"checkpoint tensor {scale} in {path / scale_info.file} is {scale_info.dtype}; "
                         f"scales are one of {list(FLOAT_DTYPES)}")
    shapes = _scale_shapes(quant, info.shape)
    strategy = next((s for s, allowed in shapes.items() if scale_info.shape in allowed), None)
    if strategy is None:
        expected = " or ".join(f"{shape} ({s})" for s, allowed in shapes.items() for shape in allowed)
        raise ValueError(f"checkpoint tensor {scale} in {path / scale_info.file} has shape {scale_info.shape}; "
                         f"{path / 'config.json'} ({quant.method}) makes the scale of {name} {info.shape} {expected}")
    return scale, strategy


def _scale_shapes(quant: Fp8Checkpoint, weight: tuple[int, ...]) -> dict[str, list[tuple[int, ...]]]:
    """The shapes a scale of ``weight`` may have, for each strategy the checkpoint uses."""
    rows, cols = weight
    shapes = {"channel": [(rows, 1), (rows,)], "tensor": [(), (1,)]}
    if quant.block is not None:
        shapes["block"] = [(-(-rows // quant.block[0]), -(-cols // quant.block[1]))]
    return {strategy: shapes[strategy] for strategy in quant.strategies}


def _log_fp8_loading(path: Path, cfg: ModelConfig, layout: Fp8Layout, dtype: torch.dtype) -> None:
    if get_tp().rank != 0 or not layout.scales:
        return
    if cfg.dense_projections:
        log.info("%s: %d projections stored unquantised keep %s, as published (model.quantization=fp8 quantises "
                 "them too)", path, len(cfg.dense_projections), dtype)
    if not cfg.fp8:
        log.info("%s: FP8 weights dequantised to %s (model.quantization=%s)", path, dtype, cfg.quantization)
    elif any(strategy == "block" for _, strategy in layout.scales.values()):
        log.info("%s: FP8 weights scaled per block re-quantised with a scale per row", path)
    if layout.activation_scales:
        kinds = sorted({name.rsplit(".", 1)[-1] for name in layout.activation_scales})
        log.info("%s: %d static activation scales (%s) not used: activations are quantised per token at run time, "
                 "which is at least as accurate", path, len(layout.activation_scales), ", ".join(kinds))


def _natural(name: str) -> list[str | int]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


def check_checkpoint(path: Path, index: dict[str, TensorInfo], model: LlamaForCausalLM) -> None:
    """Raise one ValueError naming every missing, unexpected, wrongly shaped and wrongly typed tensor, one per
    line."""
    cfg = model.config
    expected = checkpoint_shapes(cfg)
    missing = sorted(expected.keys() - index.keys(), key=_natural)
    unexpected = sorted((n for n in index if n not in expected and _target_param(n, model) is not None), key=_natural)
    wrong = sorted((n for n in expected.keys() & index.keys() if not _shape_fits(n, index[n].shape, expected[n])),
                   key=_natural)
    wrong_dtype = sorted((n for n in expected.keys() & index.keys() if index[n].dtype not in _loadable(n)),
                         key=_natural)
    if not (missing or unexpected or wrong or wrong_dtype):
        return
    counts = [f"{len(names)} {what}" for names, what in
              ((missing, "missing"), (unexpected, "unexpected"), (wrong, "with the wrong shape"),
               (wrong_dtype, "of an unsupported dtype")) if names]
    lines = [f"model directory {path} does not fit its config.json ({cfg.architecture}, {cfg.num_layers} layers, "
             f"{cfg.num_heads} heads, {cfg.num_kv_heads} KV heads, head_dim {cfg.head_dim}): "
             f"{', '.join(counts)}; it holds {len(index)} tensors, the config needs {len(expected)}:"]
    lines += [f"  missing: {n} {expected[n]}" + (" (config.json's quantization_config.kv_cache_scheme needs it)"
                                                  if _is_kv_scale(n) else "") for n in missing]
    stored = {n: n if info.stored_as == n else f"{info.stored_as} (read as {n})" for n, info in index.items()}
    lines += [f"  unexpected: {stored[n]} {index[n].shape} in {index[n].file}" for n in unexpected]
    lines += [f"  wrong shape: {stored[n]} is {index[n].shape} in {index[n].file}, expected "
              f"{' or '.join(map(str, PER_TENSOR_SHAPES)) if _is_kv_scale(n) else expected[n]}" for n in wrong]
    lines += [f"  unsupported dtype: {stored[n]} is {index[n].dtype} in {index[n].file}, expected one of "
              f"{list(_loadable(n))}"
              for n in wrong_dtype]
    raise ValueError("\n".join(lines))


def _is_kv_scale(name: str) -> bool:
    return name.endswith(KV_SCALES)


def _shape_fits(name: str, shape: tuple[int, ...], expected: tuple[int, ...]) -> bool:
    return shape in PER_TENSOR_SHAPES if _is_kv_scale(name) else shape == expected


def _loadable(name: str) -> tuple[str, ...]:
    return FLOAT_DTYPES if _is_kv_scale(name) else (*FLOAT_DTYPES, FP8_DTYPE)


def _target_param(ckpt_name: str, model: LlamaForCausalLM) -> tuple[str, object] | None:
    """Map a checkpoint tensor name to (our parameter name, shard id), or None to skip it."""
    if "rotary_emb.inv_freq" in ckpt_name:
        return None
    if ckpt_name == "lm_head.weight" and model.config.tie_word_embeddings:
        return None  # the LM head shares the embedding
    if model.config.is_moe and (".experts." in ckpt_name or ".gate.weight" in ckpt_name):
        target = moe.target_param(ckpt_name)
        if target is not None:
            return target
    for ckpt_part, (fused, shard_id) in model.packed_modules.items():
        if f".{ckpt_part}." in ckpt_name:
            return ckpt_name.replace(ckpt_part, fused), shard_id
    return ckpt_name, None


def checkpoint_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name and full shape of every tensor of an HF-format Llama checkpoint of this config."""
    h, d, inter = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for i in range(cfg.num_layers):
        layer = f"model.layers.{i}."
        qkv_bias = cfg.attention_bias or cfg.qkv_bias
        projections = {
            "self_attn.q_proj": (cfg.num_heads * d, h, qkv_bias),
            "self_attn.k_proj": (cfg.num_kv_heads * d, h, qkv_bias),
            "self_attn.v_proj": (cfg.num_kv_heads * d, h, qkv_bias),
            "self_attn.o_proj": (h, cfg.num_heads * d, cfg.attention_bias),
        }
        if cfg.is_sparse(i):
            shapes.update(moe.expert_names(cfg, i))
        else:
            projections["mlp.gate_proj"] = (inter, h, cfg.mlp_bias)
            projections["mlp.up_proj"] = (inter, h, cfg.mlp_bias)
            projections["mlp.down_proj"] = (h, inter, cfg.mlp_bias)
        for name, (rows, cols, bias) in projections.items():
            shapes[f"{layer}{name}.weight"] = (rows, cols)
            if bias:
                shapes[f"{layer}{name}.bias"] = (rows,)
        if cfg.qk_norm:
            shapes[f"{layer}self_attn.q_norm.weight"] = (d,)
            shapes[f"{layer}self_attn.k_norm.weight"] = (d,)
        shapes[f"{layer}input_layernorm.weight"] = (h,)
        shapes[f"{layer}post_attention_layernorm.weight"] = (h,)
        if cfg.kv_scales:
            shapes.update({f"{layer}{name}": (1,) for name in KV_SCALES})
    return shapes


def random_checkpoint_tensor(name: str, shape: tuple[int, ...], seed: int, device: torch.device,
                             dtype: torch.dtype) -> torch.Tensor:
    """One benchmark weight, drawn in full on every rank so that any TP size builds the same model."""
    if _is_kv_scale(name):  # a random scale would saturate or starve an FP8 cache: 1.0, the uncalibrated default
        return torch.ones(shape, device=device, dtype=torch.float32)
    if "norm" in name:
        return torch.ones(shape, device=device, dtype=dtype)
    if name.endswith("bias"):
        return torch.zeros(shape, device=device, dtype=dtype)
    gen = torch.Generator(device=device)
    gen.manual_seed((seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63)
    return torch.empty(shape, device=device, dtype=dtype).normal_(0.0, 0.02, generator=gen)


def randomize(model: LlamaForCausalLM, seed: int) -> None:
    param = next(model.parameters())
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, shape in checkpoint_shapes(model.config).items():
            target = _target_param(name, model)
            if target is None:
                continue
            param_name, shard_id = target
            full = random_checkpoint_tensor(name, shape, seed, param.device, param.dtype)
            params[param_name].weight_loader(params[param_name], FullTensor(full), shard_id)
            del full


def to_hf_state_dict(model: LlamaForCausalLM, stacked_experts: bool = False) -> dict[str, torch.Tensor]:
    """HF-named views of a TP=1 model's weights (fused projections split back), sharing memory. Experts as the
    checkpoints name them, or with ``stacked_experts`` as HF's modules hold them (``mlp.experts.gate_up_proj``
    [experts, 2 * intermediate, hidden], ``down_proj``: our layout)."""
    cfg = model.config
    d = cfg.head_dim
    q, kv = cfg.num_heads * d, cfg.num_kv_heads * d
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), param.data.split([q, kv, kv])):
                out[name.replace("qkv_proj", part)] = piece
        elif stacked_experts and ".mlp.experts." in name:
            out[name.replace(".w13", ".gate_up_proj").replace(".w2", ".down_proj")] = param.data
        elif stacked_experts and ".mlp.gate.weight" in name:
            out[name] = param.data
        elif name.endswith(".mlp.experts.w13"):
            out.update(moe.hf_expert_tensors(cfg, int(name.split(".")[2]), model.get_submodule(name[: -len(".w13")])))
        elif ".mlp.experts." in name:  # w2 and the scales: with w13
            continue
        elif ".mlp.gate.weight" in name and cfg.is_moe:
            out[name.replace(".mlp.", ".block_sparse_moe.") if cfg.architecture == "MixtralForCausalLM" else name] = \
                param.data
        elif ".gate_up_proj." in name:
            for part, piece in zip(("gate_proj", "up_proj"), param.data.chunk(2)):
                out[name.replace("gate_up_proj", part)] = piece
        else:
            out[name] = param.data
    if cfg.tie_word_embeddings:
        out.pop("lm_head.weight", None)
    return out
