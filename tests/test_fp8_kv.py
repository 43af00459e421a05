"""The FP8 KV cache (``cache.dtype=fp8_e4m3``) on CPU: the cache's encoding, the page budget, every attention
path reading the same e4m3 values (prefill, chunked prefill and decode agree), and its distance from the
model-dtype cache. The Triton decode kernel's FP8 path is in test_paged_decode.py."""

from __future__ import annotations

import pytest
import torch

from models import fp8
from runtime.config import ConfigError, load_config
from runtime.engine.kv_cache import KVCache, quantize_kv
from tests.helpers import make_engine, prefill_logits, relative_error

FP8_KV = "cache.dtype=fp8_e4m3"


def test_store_and_read_give_the_saturated_e4m3_encoding_times_the_scale():
    cache = KVCache(2, 4, 8, 2, 16, fp8.FP8, torch.device("cpu"))
    cache.scales[1] = torch.tensor([0.5, 0.25])
    kv = torch.randn(5, 2, 2, 16) * 40  # some values past 448 * 0.5: they saturate
    kv[0, 0, 0, 0] = 1000.0
    slots = torch.tensor([0, 9, 10, 17, 31])
    cache.store(1, slots, kv)
    assert cache.buffer.dtype == fp8.FP8 and torch.equal(cache.buffer[0].float(), torch.zeros_like(cache.buffer[0].float()))
    keys, values = cache.read(1, 0, slots, torch.float32), cache.read(1, 1, slots, torch.float32)
    torch.testing.assert_close(keys, quantize_kv(kv[:, 0], torch.tensor(0.5)).float() * 0.5, rtol=0, atol=0)
    torch.testing.assert_close(values, quantize_kv(kv[:, 1], torch.tensor(0.25)).float() * 0.25, rtol=0, atol=0)
    assert keys[0, 0, 0] == 448 * 0.5
    assert ((keys - kv[:, 0]).abs() <= kv[:, 0].abs() / 16 + 2**-9 * 0.5).logical_or(kv[:, 0].abs() > 224).all()


def test_pages_hold_four_times_the_float32_tokens(tiny_llama_dir):
    """The page budget counts e4m3 bytes: a float32 model's cache holds four times the pages."""
    probe = make_engine(tiny_llama_dir)
    float32_page = probe.kv_cache.buffer[:, :, 0].numel() * 4
    budget = [f"cache.cpu_memory_bytes={int((probe.weight_bytes + 100.5 * float32_page) / 0.9)}",
              "cache.memory_ratio=0.9"]
    full, small = make_engine(tiny_llama_dir, *budget), make_engine(tiny_llama_dir, *budget, FP8_KV)
    assert full.num_pages == 100
    assert small.kv_cache.buffer.dtype == fp8.FP8 and full.kv_cache.buffer.dtype == torch.float32
    assert 50 < full.num_pages < small.num_pages < full.max_running * full.max_pages_per_req
    assert abs(small.num_pages / full.num_pages - 4) < 0.1


def test_prefill_chunked_prefill_and_decode_read_the_same_cache(tiny_llama_dir):
    """With an FP8 cache every path attends over the e4m3 values (a prompt's own tokens too), so one prefill,
    7-token chunks and 5 decode steps give the same logits; and these stay close to the float32 cache's."""
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (9, 40, 23)]
    engine = make_engine(tiny_llama_dir, FP8_KV)
    whole = prefill_logits(engine, prompts)
    chunked = prefill_logits(engine, prompts, chunk=7)
    decoded = prefill_logits(engine, prompts, decode_tail=5)
    reference = prefill_logits(make_engine(tiny_llama_dir), prompts)
    for w, c, d, r in zip(whole, chunked, decoded, reference):
        torch.testing.assert_close(c, w, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(d, w, rtol=1e-4, atol=1e-4)
        error = relative_error(w, r)
        print(f"FP8 KV vs float32 KV: {error:.3e}")
        assert 1e-4 < error < 0.1  # e4m3 rounds K and V: visible, small


def test_deterministic_mode_runs_with_an_fp8_cache(tiny_llama_dir):
    """engine.deterministic reads the cache token by token: the same e4m3 values, the same logits."""
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (6, 17)]
    plain = prefill_logits(make_engine(tiny_llama_dir, FP8_KV), prompts)
    deterministic = prefill_logits(make_engine(tiny_llama_dir, FP8_KV, "engine.deterministic=true"), prompts)
    for a, b in zip(plain, deterministic):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_cache_dtype_is_checked():
    assert load_config(overrides=[FP8_KV]).cache.dtype == "fp8_e4m3"
    with pytest.raises(ConfigError, match=r"cache\.dtype.*'int8'.*\['auto', 'fp8_e4m3'\]"):
        load_config(overrides=["cache.dtype=int8"])
