"""The model architecture, parsed by hand from ``config.json`` so an unsupported model fails at start naming the field."""

from __future__ import annotations

import json
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
# Older config.json files name only the model_type; anything unknown must not load as Llama.
_ARCH_OF_MODEL_TYPE = {"llama": ["LlamaForCausalLM"], "mistral": ["MistralForCausalLM"],
                       "qwen2": ["Qwen2ForCausalLM"], "qwen3": ["Qwen3ForCausalLM"],
                       "qwen3_moe": ["Qwen3MoeForCausalLM"], "mixtral": ["MixtralForCausalLM"]}


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
    # How the attention and dense MLP projections are stored: "none" (the model dtype) or "fp8" (models/fp8.py).
    # A run-time choice (model.quantization), not read from config.json.
    quantization: str = "none"

    @property
    def fp8(self) -> bool:
        return self.quantization == "fp8"

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        archs = cfg.get("architectures") or _ARCH_OF_MODEL_TYPE.get(cfg.get("model_type"))
        if not archs:
            raise ValueError(
                f"config.json has no 'architectures' and its model_type {cfg.get('model_type')!r} is not one of "
                f"{sorted(_ARCH_OF_MODEL_TYPE)}; supported architectures: {SUPPORTED_ARCHITECTURES}"
            )
        arch = next((a for a in archs if a in FAMILIES), None)
        if arch is None:
            raise ValueError(f"model architecture {archs} is not supported; expected one of {SUPPORTED_ARCHITECTURES}")
        quant = cfg.get("quantization_config")
        if quant:
            method = quant.get("quant_method", "unnamed") if isinstance(quant, dict) else quant
            raise ValueError(f"config.json's quantization_config (quant_method {method!r}) is not supported: load a "
                             f"bf16, fp16 or fp32 checkpoint, and model.quantization=fp8 quantises it at load")
        window = cfg.get("sliding_window")
        if window not in (None, 0) and cfg.get("use_sliding_window", True) and \
                window < int(cfg.get("max_position_embeddings", 4096)):
            # A window no shorter than the context changes nothing; a real one needs masking we lack.
            raise ValueError(f"sliding_window={window} is not supported (dense attention only)")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        # transformers 5 folds rope_theta/rope_scaling into rope_parameters; older files have both at top level.
        rope_params = cfg.get("rope_parameters") or {}
        rope_theta = float(cfg.get("rope_theta", rope_params.get("rope_theta", 10000.0)))
        scaling = cfg.get("rope_scaling") or (rope_params if rope_params.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            kind = scaling.get("rope_type", scaling.get("type"))
            if kind not in ("llama3", "default"):
                raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'llama3')")
            if kind == "default":
                scaling = None
        family = dict(FAMILIES[arch])
        if family.get("moe"):
            family.update(_moe_fields(cfg, arch))
        return cls(
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=dict(scaling) if scaling else None,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", False)),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            torch_dtype=str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16"),
            architecture=arch,
            **family,
        )

    @property
    def is_moe(self) -> bool:
        return bool(self.sparse_layers)

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        file = Path(path) / "config.json"
        try:
            return cls.from_dict(json.loads(file.read_text()))
        except (KeyError, json.JSONDecodeError) as exc:
            raise ValueError(f"{file}: cannot read the model config ({exc!r})") from exc


def _moe_fields(cfg: dict[str, Any], arch: str) -> dict[str, Any]:
    """Mixtral: every layer sparse, experts as wide as intermediate_size, top-k renormalised. Qwen3-MoE: layers
    sparse every ``decoder_sparse_step`` but ``mlp_only_layers``, experts of ``moe_intermediate_size``."""
    layers = int(cfg["num_hidden_layers"])
    top_k = int(cfg["num_experts_per_tok"])
    experts = int(cfg.get("num_experts") or cfg.get("num_local_experts") or 0)  # transformers writes either name
    if arch == "MixtralForCausalLM":
        inter, renormalize, sparse = int(cfg["intermediate_size"]), True, tuple(range(layers))
    else:
        inter = int(cfg["moe_intermediate_size"])
        renormalize = bool(cfg.get("norm_topk_prob", False))
        step, dense = int(cfg.get("decoder_sparse_step", 1)), set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(layers) if i not in dense and experts > 0 and (i + 1) % step == 0)
    if not 0 < top_k <= experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, {experts}] (the number of experts)")
    return {"num_experts": experts, "experts_per_token": top_k, "moe_intermediate_size": inter,
            "norm_topk_prob": renormalize, "sparse_layers": sparse}
