"""Llama-style decoder shared by every supported family (models/config.py FAMILIES)."""

from __future__ import annotations

import torch
from torch import nn

from models import gemv, ops
from models.config import ModelConfig, tp_problem
from models.context import get_ctx
from models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_per_tensor_scale,
    new_param,
)
from models.moe import SparseMoE
from models.ops import TORCH_KERNELS, Kernels
from parallel import get_tp


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kernels: Kernels) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.attention_bias or cfg.qkv_bias,
            kernels.linear, cfg.fp8_projection(f"model.layers.{layer_id}.self_attn.qkv_proj"),
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = cfg.head_dim
        self.o_proj = RowParallelLinear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, cfg.attention_bias,
                                        kernels.linear, cfg.fp8_projection(f"model.layers.{layer_id}.self_attn.o_proj"))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, kernels)
        self.qk_norm = cfg.qk_norm
        if cfg.kv_scales:
            # The checkpoint's calibrated FP8 KV-cache scales, which the engine copies into the cache; per
            # tensor, so every rank holds them whole.
            self.k_scale = new_param(1, loader=load_per_tensor_scale, dtype=torch.float32)
            self.v_scale = new_param(1, loader=load_per_tensor_scale, dtype=torch.float32)

    def forward(self, x: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend(self.qkv_proj(x), cos_sin))

    def attend(self, qkv: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        """Attention over the fused q/k/v projection ``qkv``: ``[tokens, heads * head_dim]``, before o_proj."""
        ctx = get_ctx()
        d = self.head_dim
        # Views into qkv, no copies: K and V stay side by side ([tokens, 2, kv_heads, d]) so the cache
        # stores both in one kernel, and the attention kernels read q through its strides.
        q = qkv[:, : self.num_heads * d].view(-1, self.num_heads, d)
        kv = qkv[:, self.num_heads * d :].view(-1, 2, self.num_kv_heads, d)
        if self.qk_norm:
            q = self.q_norm(q.reshape(-1, d))[0].view(-1, self.num_heads, d)
            kv[:, 0] = self.k_norm(kv[:, 0].reshape(-1, d))[0].view(-1, self.num_kv_heads, d)
        out = ctx.attn_backend.forward(q, kv, self.layer_id, cos_sin)
        return out.reshape(-1, self.num_heads * d)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kernels: Kernels) -> None:
        super().__init__()
        prefix = f"model.layers.{layer_id}.mlp."
        down_fp8 = cfg.fp8_projection(prefix + "down_proj")
        self.silu_and_mul = kernels.silu_and_mul
        # At TP > 1 down_proj's token scales come from whole rows over the ranks, so it quantises its own input.
        if down_fp8 and kernels.silu_and_mul_quantize is not None and get_tp().size == 1:
            self.silu_and_mul = kernels.silu_and_mul_quantize
        size = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [size, size], cfg.mlp_bias, kernels.linear,
                                                       cfg.fp8_projection(prefix + "gate_up_proj"))
        self.down_proj = RowParallelLinear(size, cfg.hidden_size, cfg.mlp_bias, kernels.linear, down_fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.silu_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_id: int, kernels: Kernels) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg, layer_id, kernels)
        sparse = cfg.is_sparse(layer_id)
        self.mlp = SparseMoE(cfg, layer_id, kernels) if sparse else LlamaMLP(cfg, layer_id, kernels)
        # A norm quantises its output where the projection it feeds stores e4m3 weights.
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels, quantize=self.self_attn.qkv_proj.fp8)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels,
                                                quantize=not sparse and self.mlp.gate_up_proj.fp8)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual

    def forward_fused(self, h: torch.Tensor, cos_sin: torch.Tensor) -> None:
        """The same layer for one token in four fused GEMVs; ``h`` is the residual stream, updated in place."""
        attn, mlp = self.self_attn, self.mlp
        norm1, norm2 = self.input_layernorm, self.post_attention_layernorm
        qkv_proj, o_proj, up, down = attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj
        qkv = gemv.norm_linear(h, norm1.weight, norm1.eps, qkv_proj.weight, qkv_proj.bias, qkv_proj.weight_scale)
        gemv.linear_add_(attn.attend(qkv, cos_sin), o_proj.weight, o_proj.bias, h, o_proj.weight_scale)
        act = gemv.norm_linear_silu(h, norm2.weight, norm2.eps, up.weight, up.bias, up.weight_scale)
        gemv.linear_add_(act, down.weight, down.bias, h, down.weight_scale)


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, kernels: Kernels) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, kernels) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, kernels)
        self.fused_gemv = kernels.fused_gemv and not cfg.is_moe  # the fused layers are dense MLPs

    def forward(self, input_ids: torch.Tensor, cos_sin: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(input_ids)
        if self.fused_gemv and input_ids.shape[0] == 1:  # decided by shape, so once per captured graph
            for layer in self.layers:
                layer.forward_fused(x, cos_sin)
            return self.norm(x)[0]
        residual: torch.Tensor | None = None
        for layer in self.layers:
            x, residual = layer(x, residual, cos_sin)
        return self.norm(x, residual)[0]


class LlamaForCausalLM(nn.Module):
    # Checkpoint projections that land in one fused parameter: name -> (fused name, shard id).
    packed_modules = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: ModelConfig, kernels: Kernels = TORCH_KERNELS) -> None:
        super().__init__()
        problem = tp_problem(cfg, get_tp().size)  # one error naming the config key, before any layer is built
        if problem:
            raise ValueError(problem)
        self.config = cfg
        self.model = LlamaModel(cfg, kernels)
        self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, kernels.linear)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        # Not a parameter: rebuilt by `init_rope` after the model leaves the meta device.
        self.cos_sin: torch.Tensor | None = None

    def init_rope(self, max_positions: int, device: torch.device) -> None:
        cfg = self.config
        inv_freq = ops.rope_inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.cos_sin = ops.rope_cos_sin_cache(max_positions, inv_freq).to(device)

    def forward(self) -> torch.Tensor:
        """Logits (model dtype) for the last token of each request; consumers upcast where they need to."""
        batch = get_ctx().batch
        hidden = self.model(batch.input_ids, self.cos_sin)
        if batch.logits_indices is not None:
            hidden = hidden[batch.logits_indices]
        return self.lm_head(hidden)
