"""The fused RoPE + KV-cache write kernel against the torch reference (run on the device with `pytest -m gpu`)."""

from __future__ import annotations

import pytest
import torch

from models.ops import rope_cos_sin_cache, rope_inv_freq, rope_torch
from runtime.engine.attention.rope_store import rope_and_store
from runtime.engine.kv_cache import KVCache

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "fused_q"),
    [(32, 8, 64, True), (9, 3, 64, True), (28, 4, 128, True), (32, 8, 128, False)],  # False: Qwen3's normed q
)
def test_rope_and_store_matches_torch_reference(heads, kv_heads, dim, fused_q):
    torch.manual_seed(0)
    dev, tokens, pages, page_size = torch.device("cuda"), 37, 20, 16
    cos_sin = rope_cos_sin_cache(4096, rope_inv_freq(dim, 500000.0, None)).to(dev)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, dtype=torch.bfloat16, device=dev)
    q = qkv[:, : heads * dim].view(tokens, heads, dim)
    if not fused_q:
        q = q.clone()  # a separate dense tensor, as after a per-head q norm
    kv = qkv[:, heads * dim :].view(tokens, 2, kv_heads, dim)
    positions = torch.randint(0, 4096, (tokens,), device=dev)
    slots = torch.randperm(pages * page_size, device=dev)[:tokens]
    # Reference: float32 RoPE rounded once to bf16, stored by indexed copy.
    q_ref, k_ref = q.float().clone(), kv[:, 0].float().clone()
    rope_torch(positions, q_ref, k_ref, cos_sin)
    v_ref = kv[:, 1].clone()
    cache = KVCache(2, pages, page_size, kv_heads, dim, torch.bfloat16, dev)
    rope_and_store(positions, q, kv, cos_sin, cache, 1, slots)
    torch.testing.assert_close(q.float(), q_ref.to(torch.bfloat16).float(), rtol=8e-3, atol=8e-3)
    k_flat = cache.k(1).reshape(-1, kv_heads, dim)
    v_flat = cache.v(1).reshape(-1, kv_heads, dim)
    torch.testing.assert_close(k_flat[slots].float(), k_ref.to(torch.bfloat16).float(), rtol=8e-3, atol=8e-3)
    assert torch.equal(v_flat[slots], v_ref)  # V is copied, never rounded
    untouched = torch.ones(pages * page_size, dtype=torch.bool, device=dev)
    untouched[slots] = False
    assert k_flat[untouched].abs().sum() == 0 and v_flat[untouched].abs().sum() == 0
    assert cache.buffer[0].abs().sum() == 0  # the other layer
