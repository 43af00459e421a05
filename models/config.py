"""The model architecture, parsed by hand from ``config.json`` so an unsupported model fails at start naming the field."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FAMILIES: dict[str, dict[str, bool]] = {
    "LlamaForCausalLM": {},
    "MistralForCausalLM": {},
    "Qwen2ForCausalLM": {"qkv_bias": True},
    "Qwen3ForCausalLM": {"qk_norm": True},
    "Qwen3MoeForCausalLM": {"qk_norm": True, "moe": True},
    "MixtralForCausalLM": {"moe": True},
}
SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
# The config.json bias switches each family's transformers class reads; the others fix their biases in code
# (Qwen2: on q, k and v; Mistral, Mixtral: none), so a stray "attention_bias": true must not ask for tensors.
_BIAS_KEYS: dict[str, tuple[str, ...]] = {
    "LlamaForCausalLM": ("attention_bias", "mlp_bias"),
    "Qwen3ForCausalLM": ("attention_bias",),
    "Qwen3MoeForCausalLM": ("attention_bias",),
}
# transformers' values for keys a config.json may leave out, where a family's differ from Llama's.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "LlamaForCausalLM": {"max_position_embeddings": 2048},
    "MistralForCausalLM": {"max_position_embeddings": 131072, "sliding_window": 4096, "num_key_value_heads": 8},
    "MixtralForCausalLM": {"max_position_embeddings": 131072, "rope_theta": 1e6, "rms_norm_eps": 1e-5,
                           "num_key_value_heads": 8, "num_experts": 8, "num_experts_per_tok": 2},
    "Qwen2ForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 32},
    "Qwen3ForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 32,
                         "head_dim": 128},
    "Qwen3MoeForCausalLM": {"max_position_embeddings": 32768, "sliding_window": 4096, "num_key_value_heads": 4,
                            "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768},
}
# None: derived (num_key_value_heads: num_attention_heads, head_dim: hidden_size / num_attention_heads).
_LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "sliding_window": None, "num_key_value_heads": None,
                   "head_dim": None}
# Older config.json files name only the model_type; anything unknown must not load as Llama.
_ARCH_OF_MODEL_TYPE = {"llama": ["LlamaForCausalLM"], "mistral": ["MistralForCausalLM"],
                       "qwen2": ["Qwen2ForCausalLM"], "qwen3": ["Qwen3ForCausalLM"],
                       "qwen3_moe": ["Qwen3MoeForCausalLM"], "mixtral": ["MixtralForCausalLM"]}


@dataclass(frozen=True)
class Fp8Checkpoint:
    """A pre-quantised FP8 checkpoint (config.json's ``quantization_config``): e4m3 weights, each with a float
    scale tensor ``<module>.<scale_name>`` per output row ("channel"), per tensor, or per block of ``block``
    (rows, columns) elements; a weight is its values times their scale. The tensors' dtypes say which weights
    are FP8; the loader matches each scale's shape to one of ``strategies``."""

    method: str  # "compressed-tensors" or "fp8" (transformers' fine-grained FP8, or AutoFP8)
    scale_name: str  # "weight_scale" or "weight_scale_inv"
    strategies: tuple[str, ...]  # of "channel", "tensor", "block"
    block: tuple[int, int] | None = None
    # Calibrated FP8 KV-cache scales, one float32 per tensor: ``model.layers.N.self_attn.k_scale`` and ``v_scale``.
    kv_scales: bool = False


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    mlp_bias: bool
    torch_dtype: str
    architecture: str = "LlamaForCausalLM"
    qkv_bias: bool = False  # bias on q, k, v only (Qwen2)
    qk_norm: bool = False  # RMSNorm over each head of q and k before RoPE (Qwen3)
    moe: bool = False  # sparse mixture-of-experts MLPs (models/moe.py)
    num_experts: int = 0
    experts_per_token: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True  # renormalise the top-k routing weights to sum to 1
    sparse_layers: tuple[int, ...] = ()  # layers whose MLP is the mixture of experts; the others are dense
    # How the attention and dense MLP projections are stored: "none" (the model dtype), "fp8" (models/fp8.py) or
    # "auto" (fp8 when the checkpoint is pre-quantised FP8, else none). A run-time choice (model.quantization).
    quantization: str = "auto"
    checkpoint_fp8: Fp8Checkpoint | None = None  # how a pre-quantised FP8 checkpoint stores its weights
    # Our projections (model.layers.0.mlp.down_proj) that an FP8 checkpoint stores unquantised, as its ignore list
    # says: under "auto" they keep the model dtype, as published. Filled by the loader from the tensors' dtypes.
    dense_projections: frozenset[str] = frozenset()
    sliding_window: int | None = None  # the window transformers slides on some layers; None: dense attention
    sliding_window_rule: str = ""  # the config file, key and layers that slide it, for errors

    @property
    def fp8(self) -> bool:
        """Some projections run in FP8 (a checkpoint that calibrates only the KV cache has none)."""
        published = self.checkpoint_fp8 is not None and bool(self.checkpoint_fp8.strategies)
        return self.quantization == "fp8" or (self.quantization == "auto" and published)

    def fp8_projection(self, name: str) -> bool:
        """Whether our projection ``name`` (model.layers.0.self_attn.qkv_proj) stores e4m3 weights."""
        return self.fp8 and (self.quantization == "fp8" or name not in self.dense_projections)

    @property
    def kv_scales(self) -> bool:
        """The checkpoint holds each layer's calibrated K and V scales for an FP8 KV cache."""
        return self.checkpoint_fp8 is not None and self.checkpoint_fp8.kv_scales

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def max_seq_len(self, requested: int) -> int:
        """The longest sequence served under ``model.max_seq_len=requested``: at most max_position_embeddings. Attention
        is dense only, which equals a sliding window's wherever no sequence outgrows the window; past it, refused."""
        length = min(requested, self.max_position_embeddings)
        if self.sliding_window is not None and length > self.sliding_window:
            raise ValueError(f"{self.sliding_window_rule} is not supported for sequences longer than the window "
                             f"(dense attention only; model.max_seq_len={requested} allows {length} tokens): set "
                             f"model.max_seq_len <= {self.sliding_window}")
        return length

    @classmethod
    def from_dict(cls, cfg: dict[str, Any], source: str = "config.json") -> ModelConfig:
        """``source`` names the file in errors."""
        archs = cfg.get("architectures") or _ARCH_OF_MODEL_TYPE.get(cfg.get("model_type"))
        if not archs:
            raise ValueError(
                f"config.json has no 'architectures' and its model_type {cfg.get('model_type')!r} is not one of "
                f"{sorted(_ARCH_OF_MODEL_TYPE)}; supported architectures: {SUPPORTED_ARCHITECTURES}"
            )
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            raise ValueError(f"model architecture {archs} is not supported; expected one of {SUPPORTED_ARCHITECTURES}")
        # compression_config: the name older compressed-tensors checkpoints give the same section.
        quant_key = "quantization_config" if cfg.get("quantization_config") else "compression_config"
        checkpoint_fp8 = fp8_checkpoint(cfg.get(quant_key), source if quant_key == "quantization_config"
                                        else f"{source} ({quant_key}, read as quantization_config)")
        defaults = {**_LLAMA_DEFAULTS, **_FAMILY_DEFAULTS[arch]}

        def get(key: str) -> Any:
            return cfg.get(key, defaults[key])

        act = cfg.get("hidden_act", "silu")
        if act not in ("silu", "swish"):  # transformers' two names for x * sigmoid(x)
            raise ValueError(f"{source}: hidden_act={act!r} is not supported (only 'silu')")
        max_positions = int(get("max_position_embeddings"))
        window = get("sliding_window")
        sliding, why = _sliding_layers(cfg, arch)
        if window in (0, None) or not sliding:
            window, window_rule = None, ""
        else:
            said = "" if "sliding_window" in cfg else f" (transformers' default for {arch})"
            window_rule = f"{source}: sliding_window={window}{said} on layers {_ranges(sliding)} ({why})"
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta, scaling = _rope(cfg, get, max_positions, source)
        family = dict(FAMILIES[arch])
        if family.get("moe"):
            family.update(_moe_fields(cfg, arch, get))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(get("num_key_value_heads") or num_heads),
            head_dim=int(get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(get("rms_norm_eps")),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=max_positions,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias="attention_bias" in _BIAS_KEYS.get(arch, ()) and bool(cfg.get("attention_bias", False)),
            mlp_bias="mlp_bias" in _BIAS_KEYS.get(arch, ()) and bool(cfg.get("mlp_bias", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            architecture=arch,
            sliding_window=window,
            sliding_window_rule=window_rule,
            checkpoint_fp8=checkpoint_fp8,
            **family,
        )

    @property
    def is_moe(self) -> bool:
        return bool(self.sparse_layers)

    @property
    def expert_width_key(self) -> str:
        """The config.json key of an expert's MLP width, for errors."""
        return "intermediate_size" if self.architecture == "MixtralForCausalLM" else "moe_intermediate_size"

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            return cls.from_dict(json.loads(file.read_text()), str(file))
        except (KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: cannot read the model config ({exc!r})") from exc


def not_divisible(key: str, size: int, tp: int) -> str:
    return (f"{key}={size} is not divisible by tensor-parallel size {tp}; choose a parallel.tp_size that divides it "
            "(parallel.tp_size=1 makes every rank a data-parallel replica)")


def tp_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why a tensor-parallel group of ``tp`` ranks cannot split this model, naming the config.json key; None if it
    can. Checked before anything is built, so a sweep or a Slurm array is refused at submission."""
    if cfg.num_heads % tp:
        return not_divisible("num_attention_heads", cfg.num_heads, tp)
    if cfg.num_kv_heads >= tp and cfg.num_kv_heads % tp:
        return not_divisible("num_key_value_heads", cfg.num_kv_heads, tp)
    if cfg.num_kv_heads < tp and tp % cfg.num_kv_heads:  # fewer KV heads than ranks: each is on tp / kv ranks
        return (f"num_key_value_heads={cfg.num_kv_heads} is neither a multiple nor a divisor of tensor-parallel "
                f"size {tp}; choose a parallel.tp_size that it divides or that divides it")
    widths = [("intermediate_size", cfg.intermediate_size)] if len(cfg.sparse_layers) < cfg.num_layers else []
    widths += [(cfg.expert_width_key, cfg.moe_intermediate_size)] if cfg.sparse_layers else []
    return next((not_divisible(key, size, tp) for key, size in widths if size % tp), None)


def _moe_fields(cfg: dict[str, Any], arch: str, get: Callable[[str], Any]) -> dict[str, Any]:
    """Mixtral: every layer sparse, experts as wide as intermediate_size, top-k renormalised. Qwen3-MoE: layers
    sparse every ``decoder_sparse_step`` but ``mlp_only_layers``, experts of ``moe_intermediate_size``."""
    layers = int(cfg["num_hidden_layers"])
    top_k = int(get("num_experts_per_tok"))
    # Either name, for either family, as transformers reads them.
    named = [cfg[key] for key in ("num_experts", "num_local_experts") if cfg.get(key) is not None]
    if len(set(named)) > 1:  # transformers' two families would each read a different one of these
        raise ValueError(f"num_experts={named[0]} and num_local_experts={named[1]} name the same count (the experts "
                         "of a layer) but differ; keep one")
    experts = int(named[0] if named else get("num_experts") or 0)
    if arch == "MixtralForCausalLM":
        inter, renormalize, sparse = int(cfg["intermediate_size"]), True, tuple(range(layers))
    else:
        inter = int(get("moe_intermediate_size"))
        renormalize = bool(cfg.get("norm_topk_prob", False))
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {experts}] (the number of experts)")
    return {"num_experts": experts, "experts_per_token": top_k, "moe_intermediate_size": inter,
            "norm_topk_prob": renormalize, "sparse_layers": sparse}


_SUPPORTED = ("tpinfer loads FP8 checkpoints (compressed-tensors float8 weights per channel, tensor or block, and "
              "static float8 KV-cache scales per tensor; quant_method 'fp8', block-wise as transformers writes it or "
              "per tensor as AutoFP8 does) and bf16, fp16 or fp32 ones, which model.quantization=fp8 quantises at load")
_CT_FP8_FORMATS = ("float-quantized", "naive-quantized")
_CT_STRATEGIES = ("channel", "tensor", "block")


def _unsupported(source: str, field: str, value: Any, why: str = "") -> ValueError:
    return ValueError(f"{source}: {field}={value!r} is not supported{why}; {_SUPPORTED}")


_LLAMA3_FACTORS = ("factor", "low_freq_factor", "high_freq_factor")


def _rope(cfg: dict[str, Any], get: Callable[[str], Any], max_positions: int,
          source: str) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, llama3 scaling or None), read as transformers 5 reads them: one dict, ``rope_scaling`` (older
    files) before ``rope_parameters``, whose rope_theta wins over the top-level key (only its default). llama3
    needs its three factors; its pre-training length is a top-level original_max_position_embeddings, else the
    dict's, else max_position_embeddings."""
    key = "rope_scaling" if cfg.get("rope_scaling") else "rope_parameters"
    rope = cfg.get(key) or {}
    theta = float(rope.get("rope_theta") or get("rope_theta"))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"{source}: {key} rope_type {kind!r} is not supported (only 'default' and 'llama3')")
    missing = [name for name in _LLAMA3_FACTORS if rope.get(name) is None]
    if missing:
        raise ValueError(f"{source}: {key} of rope_type 'llama3' lacks {', '.join(missing)}; add them (Llama 3.1: "
                         "factor 8.0, low_freq_factor 1.0, high_freq_factor 4.0)")
    original = next((v for v in (cfg.get("original_max_position_embeddings"),
                                 rope.get("original_max_position_embeddings")) if v is not None), max_positions)
    return theta, {**rope, "original_max_position_embeddings": int(original)}


def _sliding_layers(cfg: dict[str, Any], arch: str) -> tuple[list[int], str]:
    """The layers transformers runs with a sliding window (if the config has one), and why."""
    layers = int(cfg["num_hidden_layers"])
    if arch == "LlamaForCausalLM":
        return [], "Llama has none"
    if arch in ("MistralForCausalLM", "MixtralForCausalLM"):
        return list(range(layers)), "every layer"
    if not cfg.get("use_sliding_window", False):
        return [], "use_sliding_window is false"
    if arch == "Qwen3MoeForCausalLM":
        return list(range(layers)), "use_sliding_window: every layer"
    if cfg.get("layer_types"):
        return [i for i, kind in enumerate(cfg["layer_types"]) if kind == "sliding_attention"], "layer_types"
    first = int(cfg.get("max_window_layers", 28))
    return list(range(first, layers)), f"use_sliding_window from max_window_layers={first}"


def _ranges(layers: list[int]) -> str:
    if len(layers) > 1 and layers == list(range(layers[0], layers[-1] + 1)):
        return f"{layers[0]}-{layers[-1]}"
    return ", ".join(map(str, layers))


def fp8_checkpoint(quant: Any, source: str = "config.json") -> Fp8Checkpoint | None:
    """The FP8 layout that config.json's ``quantization_config`` describes (None without one); any other
    quantisation is refused naming the field that says so."""
    if not quant:
        return None
    if not isinstance(quant, dict):
        raise _unsupported(source, "quantization_config", quant)
    method = quant.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(quant, source)
    if method == "fp8":
        return _fine_grained_fp8(quant, source)
    raise _unsupported(source, "quantization_config.quant_method", method)


def _block_size(value: Any, source: str, field: str) -> tuple[int, int]:
    if isinstance(value, (list, tuple)) and len(value) == 2 and \
            all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in value):
        return value[0], value[1]
    raise _unsupported(source, field, value, " (a block is [rows, columns], two positive integers)")


def _fine_grained_fp8(quant: dict[str, Any], source: str) -> Fp8Checkpoint:
    """transformers' FineGrainedFP8Config (DeepSeek-V3, Qwen3-FP8), which always writes ``weight_block_size``:
    ``weight_scale_inv`` per block of that size, or per tensor when it is null. Without the field, AutoFP8's
    layout: ``weight_scale`` per tensor, and with ``kv_cache_scheme: static`` the K and V scales as the output
    scales of k_proj and v_proj."""
    scheme = quant.get("activation_scheme", "dynamic")
    # Static activation scales are not needed: activations are quantised per token at run time.
    if str(scheme).lower() not in ("dynamic", "static"):
        raise _unsupported(source, "quantization_config.activation_scheme", scheme, " (dynamic or static)")
    for field, supported in (("scale_fmt", "float"), ("expert_dtype", "fp8"), ("fmt", "e4m3")):
        if quant.get(field) not in (None, supported):
            raise _unsupported(source, f"quantization_config.{field}", quant[field], f" (only {supported!r})")
    kv_scheme = quant.get("kv_cache_scheme")
    if kv_scheme not in (None, "static"):
        raise _unsupported(source, "quantization_config.kv_cache_scheme", kv_scheme, " (AutoFP8 writes 'static')")
    kv_scales = kv_scheme == "static"
    if "weight_block_size" not in quant:
        return Fp8Checkpoint("fp8", "weight_scale", ("tensor",), kv_scales=kv_scales)
    block = quant["weight_block_size"]
    if block is None:
        return Fp8Checkpoint("fp8", "weight_scale_inv", ("tensor",), kv_scales=kv_scales)
    return Fp8Checkpoint("fp8", "weight_scale_inv", ("block",),
                         _block_size(block, source, "quantization_config.weight_block_size"), kv_scales=kv_scales)


def _compressed_tensors(quant: dict[str, Any], source: str) -> Fp8Checkpoint:
    """llm-compressor's float8 checkpoints (FP8, FP8_DYNAMIC, FP8_BLOCK): ``weight_scale`` per channel,
    tensor or block, and optionally a static FP8 KV-cache scale per tensor; or the KV-cache scales alone, beside
    unquantised weights (no config group). Activation schemes are not needed: activations are quantised per
    token at run time."""
    fmt = quant.get("format")
    if not quant.get("config_groups") and quant.get("kv_cache_scheme") and fmt in (None, "dense", *_CT_FP8_FORMATS):
        _kv_cache_scheme(quant["kv_cache_scheme"], source)
        return Fp8Checkpoint("compressed-tensors", "weight_scale", (), kv_scales=True)
    if fmt not in _CT_FP8_FORMATS:
        raise _unsupported(source, "quantization_config.format", fmt, f" (FP8 weights are {list(_CT_FP8_FORMATS)})")
    if quant.get("transform_config"):
        raise _unsupported(source, "quantization_config.transform_config", quant["transform_config"])
    kv_scheme = quant.get("kv_cache_scheme")
    if kv_scheme:
        _kv_cache_scheme(kv_scheme, source)
    sparsity = quant.get("sparsity_config")
    if sparsity and (not isinstance(sparsity, dict) or sparsity.get("format", "dense") != "dense"):
        raise _unsupported(source, "quantization_config.sparsity_config", sparsity, " (dense weights only)")
    groups = quant.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise _unsupported(source, "quantization_config.config_groups", groups, " (no weight scheme)")
    schemes = [_compressed_tensors_weights(f"quantization_config.config_groups.{name}", group, source)
               for name, group in groups.items()]
    blocks = {block for _, block in schemes if block is not None}
    if len(blocks) > 1:
        raise _unsupported(source, "quantization_config.config_groups block_structure", sorted(blocks),
                           " (one block size a checkpoint)")
    strategies = tuple(dict.fromkeys(strategy for strategy, _ in schemes))
    return Fp8Checkpoint("compressed-tensors", "weight_scale", strategies, next(iter(blocks), None), bool(kv_scheme))


def _kv_cache_scheme(scheme: Any, source: str) -> None:
    """Refuse any KV-cache scheme but static symmetric float8 with one scale per tensor: the cache keeps one K
    and one V scale a layer (runtime/engine/kv_cache.py)."""
    where = "quantization_config.kv_cache_scheme"
    if not isinstance(scheme, dict):
        raise _unsupported(source, where, scheme, " (static float8 per tensor expected)")
    if scheme.get("group_size") is not None:
        raise _unsupported(source, f"{where}.group_size", scheme["group_size"], " (one scale per tensor)")
    # compressed-tensors' defaults for absent fields: int8, symmetric, static, per tensor (without a group size).
    for field, default, supported in (("type", "int", "float"), ("num_bits", 8, 8), ("symmetric", True, True),
                                      ("dynamic", False, False), ("strategy", "tensor", "tensor")):
        value = scheme.get(field)
        value = default if value is None else value
        if (value.lower() if isinstance(value, str) else value) != supported:
            raise _unsupported(source, f"{where}.{field}", value, f" (FP8 KV-cache scales are {field}={supported!r})")


def _compressed_tensors_weights(where: str, group: Any, source: str) -> tuple[str, tuple[int, int] | None]:
    """One config group's weight strategy and block size; anything but symmetric static float8 refused."""
    if not isinstance(group, dict):
        raise _unsupported(source, where, group, " (a preset scheme name: spell the scheme out)")
    if group.get("format") not in (None, *_CT_FP8_FORMATS):
        raise _unsupported(source, f"{where}.format", group["format"], f" (FP8 weights are {list(_CT_FP8_FORMATS)})")
    if group.get("output_activations"):
        raise _unsupported(source, f"{where}.output_activations", group["output_activations"])
    weights = group.get("weights")
    if not isinstance(weights, dict):
        raise _unsupported(source, f"{where}.weights", weights, " (float8 weights expected)")
    where = f"{where}.weights"
    # compressed-tensors' defaults for absent fields: int8, symmetric, static.
    for field, default, supported in (("type", "int", "float"), ("num_bits", 8, 8), ("symmetric", True, True),
                                      ("dynamic", False, False)):
        value = weights.get(field, default)
        if (value.lower() if isinstance(value, str) else value) != supported:
            raise _unsupported(source, f"{where}.{field}", value, f" (float8 weights are {field}={supported!r})")
    group_size = weights.get("group_size")
    strategy = weights.get("strategy") or {None: "tensor", -1: "channel"}.get(group_size, "group")
    if str(strategy).lower() not in _CT_STRATEGIES:
        raise _unsupported(source, f"{where}.strategy", strategy, f" (one of {list(_CT_STRATEGIES)})")
    strategy = str(strategy).lower()
    if group_size not in (None, -1):
        raise _unsupported(source, f"{where}.group_size", group_size, f" with strategy {strategy!r}")
    if strategy != "block":
        return strategy, None
    return strategy, _block_size(weights.get("block_structure"), source, f"{where}.block_structure")
