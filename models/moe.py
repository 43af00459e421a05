"""Sparse mixture-of-experts MLP (Qwen3-MoE, Mixtral), experts sharded over TP like a dense MLP.

Every rank holds every expert's slice of the intermediate dimension (gate/up by rows, down by columns) and a
replicated router, so a layer costs one all-reduce, as a dense MLP does. Expert parallelism would instead give
each rank whole experts and exchange tokens (all-to-all); the weights would then be stacked by expert ranges.
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn

from models import fp8, fused_moe
from models.config import ModelConfig
from models.layers import SliceSource, as_fp8_rows, copy_into, divide, load_replicated, new_param, whole_row_amax
from models.ops import Kernels
from parallel import all_reduce, get_tp

# Checkpoint names of one expert's projections -> (gate_up shard 0 | 1, or down): Qwen3-MoE and Mixtral spellings.
_EXPERT = re.compile(r"^(?P<layer>model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.experts\.(?P<e>\d+)\."
                     r"(?P<proj>gate_proj|up_proj|down_proj|w1|w3|w2)\.weight$")
_PART = {"gate_proj": 0, "w1": 0, "up_proj": 1, "w3": 1, "down_proj": 2, "w2": 2}
# Benchmarks set this before building a model: each sparse layer then counts the distinct experts its steps use
# (``SparseMoE.touched``), the bytes a step really reads.
COUNT_TOUCHED_EXPERTS = False

_ROUTER = re.compile(r"^(?P<layer>model\.layers\.\d+\.)(?:mlp|block_sparse_moe)\.gate\.weight$")


def expert_names(cfg: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """Checkpoint name and shape of a sparse layer's router and experts, in the family's spelling."""
    h, inter = cfg.hidden_size, cfg.moe_intermediate_size
    prefix = f"model.layers.{layer}."
    if cfg.architecture == "MixtralForCausalLM":
        block, names = f"{prefix}block_sparse_moe.", ("w1", "w3", "w2")
    else:
        block, names = f"{prefix}mlp.", ("gate_proj", "up_proj", "down_proj")
    shapes = {f"{block}gate.weight": (cfg.num_experts, h)}
    for e in range(cfg.num_experts):
        shapes[f"{block}experts.{e}.{names[0]}.weight"] = (inter, h)
        shapes[f"{block}experts.{e}.{names[1]}.weight"] = (inter, h)
        shapes[f"{block}experts.{e}.{names[2]}.weight"] = (h, inter)
    return shapes


def target_param(ckpt_name: str) -> tuple[str, Any] | None:
    """Our parameter and shard id for a router or expert tensor; None for any other name."""
    found = _EXPERT.match(ckpt_name)
    if found:
        part = _PART[found["proj"]]
        param = "w2" if part == 2 else "w13"
        return f"{found['layer']}mlp.experts.{param}", (int(found["e"]), part)
    found = _ROUTER.match(ckpt_name)
    if found:
        return f"{found['layer']}mlp.gate.weight", None
    return None


def hf_expert_tensors(cfg: ModelConfig, layer: int, experts: Experts) -> dict[str, torch.Tensor]:
    """A TP=1 layer's stacked experts as the checkpoint's per-expert tensors (views); FP8 ones with their
    ``weight_scale`` per row, as compressed-tensors names it."""
    names = [n for n in expert_names(cfg, layer) if ".experts." in n]
    out = {}
    for e in range(cfg.num_experts):
        gate, up, down = names[3 * e : 3 * e + 3]
        out[gate], out[up] = experts.w13.data[e].chunk(2)
        out[down] = experts.w2.data[e]
        if experts.w13_scale is not None and experts.w2_scale is not None:
            out[f"{gate}_scale"], out[f"{up}_scale"] = experts.w13_scale.data[e].chunk(2)
            out[f"{down}_scale"] = experts.w2_scale.data[e]
    return out


class Experts(nn.Module):
    """Every expert's gate/up (``w13``: [experts, 2 * local intermediate, hidden]) and down (``w2``: [experts,
    hidden, local intermediate]) for this rank's slice of the intermediate dimension; ``quantized``: in e4m3 with
    a float32 scale per output row (``w13_scale``, ``w2_scale``), as the dense FP8 layers store theirs, and like
    theirs the inputs quantised to e4m3 per row: e4m3 x e4m3 on the tensor cores, whose weight tiles go to them
    as loaded (weights widened to bf16 instead measured slower at 10 of 12 batches, up to 1.4x bf16's time)."""

    def __init__(self, num_experts: int, hidden: int, intermediate: int, key: str, quantized: bool = False) -> None:
        super().__init__()
        self.local = divide(intermediate, get_tp().size, key)  # ``key``: the config.json field errors name
        dtype = fp8.FP8 if quantized else None
        self.w13 = new_param(num_experts, 2 * self.local, hidden, loader=self._load, dtype=dtype)
        self.w2 = new_param(num_experts, hidden, self.local, loader=self._load, dtype=dtype)
        self.w13_scale = new_param(num_experts, 2 * self.local, loader=None, dtype=torch.float32) if quantized else None
        self.w2_scale = new_param(num_experts, hidden, loader=None, dtype=torch.float32) if quantized else None

    def _load(self, param: torch.Tensor, source: SliceSource, shard_id: Any) -> None:
        expert, part = shard_id
        start = get_tp().rank * self.local
        if part == 2:  # down: this rank's columns of every row
            rows, index = slice(None), (slice(None), slice(start, start + self.local))
        else:
            rows, index = slice(part * self.local, (part + 1) * self.local), (slice(start, start + self.local),)
        scale = self.w2_scale if part == 2 else self.w13_scale
        if scale is None:
            copy_into(param.data[expert, rows], source[index])
            return
        # A down row's scale comes from the whole checkpoint row, so every TP size stores the same weights.
        values, row_scale = as_fp8_rows(source, index, param.device)
        copy_into(param.data[expert, rows], values)
        copy_into(scale.data[expert, rows], row_scale)

    def linear(self, x: torch.Tensor, linear: Any, expert: int, down: bool) -> torch.Tensor:
        """One expert's gate/up (or down) on rows ``x`` through ``linear``: the torch path's matmul. With FP8
        weights, ``x`` is quantised per row and both dequantised in float32, as the fused kernel's arithmetic."""
        weight, scale = (self.w2, self.w2_scale) if down else (self.w13, self.w13_scale)
        if scale is None:
            return linear(x, weight[expert])
        return fp8.linear(x, weight[expert], scale[expert], None, whole_row_amax(x) if down else None)


class Router(nn.Module):
    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = new_param(num_experts, hidden, loader=load_replicated)


class SparseMoE(nn.Module):
    """Top-k routing (softmax over every expert, the k largest kept, renormalised where the family does)."""

    def __init__(self, cfg: ModelConfig, layer_id: int, kernels: Kernels) -> None:
        super().__init__()
        self.top_k = cfg.experts_per_token
        self.renormalize = cfg.norm_topk_prob
        self.gate = Router(cfg.num_experts, cfg.hidden_size)
        self.experts = Experts(cfg.num_experts, cfg.hidden_size, cfg.moe_intermediate_size, cfg.expert_width_key,
                               cfg.fp8_projection(f"model.layers.{layer_id}.mlp.experts"))
        self.silu_and_mul = kernels.silu_and_mul
        self.linear = kernels.linear  # batch-invariant under engine.deterministic
        self.fused = kernels.fused_moe
        # As transformers: Qwen3-MoE rounds the routing weights to the model dtype, Mixtral scales each expert's
        # output by the float32 weights and rounds only the product.
        self.float32_weights = cfg.architecture == "MixtralForCausalLM"
        if COUNT_TOUCHED_EXPERTS:
            self.register_buffer("touched", torch.zeros((), dtype=torch.int64), persistent=False)
        else:
            self.touched = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [tokens, k], in float32 or x's dtype as the family rounds them; expert ids [tokens, k])."""
        probs = torch.softmax(self.linear(x, self.gate.weight).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return (weights if self.float32_weights else weights.to(x.dtype)), ids

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            experts = self.experts
            out = fused_moe.fused_moe(x, self.linear(x, self.gate.weight), experts.w13, experts.w2, self.top_k,
                                      self.renormalize, self.touched, experts.w13_scale, experts.w2_scale,
                                      whole_row_amax)
        else:
            out = self.forward_torch(x)
        return all_reduce(out) if get_tp().size > 1 else out

    def forward_torch(self, x: torch.Tensor) -> torch.Tensor:
        """The CPU path: tokens grouped by expert on the host, each expert that got tokens run on its rows."""
        weights, ids = self.route(x)
        out = torch.zeros_like(x)
        flat = ids.flatten()
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=self.experts.w13.shape[0]).tolist()
        tokens = order // self.top_k
        start = 0
        for expert, count in enumerate(counts):
            if count == 0:
                continue
            rows = tokens[start : start + count]
            picked = order[start : start + count]
            start += count
            # self.linear: an expert's rows depend on the batch, so under engine.deterministic so may F.linear's bits.
            hidden = self.silu_and_mul(self.experts.linear(x[rows], self.linear, expert, down=False))
            y = self.experts.linear(hidden, self.linear, expert, down=True) * weights.flatten()[picked, None]
            out.index_add_(0, rows, y.to(out.dtype))
        return out
