"""The small-batch decode attention kernel (runtime/engine/attention/split_decode.py) against float64: RoPE,
the cache write and split-KV attention over a paged cache, on CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 where there is no GPU; tests/test_gpu_kernels.py runs it compiled)."""

from __future__ import annotations

import math

import pytest
import torch

from models.ops import rope_cos_sin_cache, rope_inv_freq, rope_torch
from runtime.engine.attention import split_decode as sd
from runtime.engine.kv_cache import KVCache, quantize_kv

FP8_SCALES = (0.02, 0.015)  # k, v: random normal values stay inside e4m3's range (448) at these scales


def make_case(heads: int, kv_heads: int, dim: int, positions: list[int], page_size: int, dtype: torch.dtype,
              device: str = "cpu", fused_q: bool = True, seed: int = 0, kv_fp8: bool = False) -> dict:
    """A paged cache whose requests hold ``positions[b]`` cached tokens on scattered pages, and their new tokens;
    ``kv_fp8``: the cache in e4m3 with FP8_SCALES."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(positions)
    max_pages = max(p // page_size + 1 for p in positions)
    num_pages = batch * max_pages + 3
    cache = KVCache(1, num_pages, page_size, kv_heads, dim, torch.float8_e4m3fn if kv_fp8 else dtype,
                    torch.device(device))
    values = torch.randn(cache.buffer.shape, generator=gen)
    if kv_fp8:
        cache.scales.copy_(torch.tensor([FP8_SCALES]))
        values = quantize_kv(values, torch.tensor(FP8_SCALES).view(1, 2, 1, 1, 1, 1))
    cache.buffer.copy_(values.to(cache.buffer.dtype))
    # Rows 1..batch of a larger page table (row 0 unused), pages in a random order, page 0 never used.
    order = (torch.randperm(num_pages - 1, generator=gen) + 1)[: batch * max_pages].view(batch, max_pages)
    table = torch.zeros(batch + 2, max_pages + 2, dtype=torch.int32)
    rows = torch.arange(1, batch + 1)
    table[rows, :max_pages] = order.int()
    pos = torch.tensor(positions)
    out_loc = order[torch.arange(batch), pos // page_size] * page_size + pos % page_size
    qkv = torch.randn(batch, (heads + 2 * kv_heads) * dim, generator=gen).to(dtype)
    cos_sin = rope_cos_sin_cache(4096, rope_inv_freq(dim, 10000.0, None))
    case = dict(qkv=qkv, cache=cache, table=table, rows=rows, pos=pos, out_loc=out_loc, cos_sin=cos_sin)
    case = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in case.items()}
    case["q"] = case["qkv"][:, : heads * dim].view(batch, heads, dim)
    if not fused_q:
        case["q"] = case["q"].clone()
    case["kv"] = case["qkv"][:, heads * dim :].view(batch, 2, kv_heads, dim)
    return case


def reference(case: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float64 attention with q and the new k rotated in float32 and rounded to the model dtype, or to e4m3 in an
    FP8 cache (as cached); returns the output and the new K and V as the cache holds them."""
    q, kv, cache, dtype = case["q"].cpu(), case["kv"].cpu(), case["cache"], case["q"].dtype
    pos, table, rows = case["pos"].cpu(), case["table"].cpu(), case["rows"].cpu()
    batch, heads, dim = q.shape
    kv_heads = kv.shape[2]
    q_rot, k_rot = q.float().clone(), kv[:, 0].float().clone()
    rope_torch(pos, q_rot, k_rot, case["cos_sin"].cpu())
    q_rot = q_rot.to(dtype).double()
    k_scale, v_scale = cache.scales[0].cpu().double().tolist()
    if cache.fp8:
        k_rot, v_new = quantize_kv(k_rot, torch.tensor(k_scale)), quantize_kv(kv[:, 1], torch.tensor(v_scale))
    else:
        k_rot, v_new = k_rot.to(dtype), kv[:, 1]
    k_all = cache.k(0).cpu().double() * k_scale
    v_all = cache.v(0).cpu().double() * v_scale
    page = cache.page_size
    outs = []
    for b in range(batch):
        p = int(pos[b])
        t = torch.arange(p)
        slots = table[rows[b], t // page].long() * page + t % page
        keys = torch.cat((k_all.reshape(-1, kv_heads, dim)[slots], k_rot[b : b + 1].double() * k_scale))
        values = torch.cat((v_all.reshape(-1, kv_heads, dim)[slots], v_new[b : b + 1].double() * v_scale))
        group = heads // kv_heads
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [t, heads, d]
        scores = torch.einsum("hd,thd->ht", q_rot[b], keys) / math.sqrt(dim)
        outs.append(torch.einsum("ht,thd->hd", scores.softmax(-1), values).reshape(-1))
    return torch.stack(outs), k_rot, v_new


def run(case: dict, splits: int, workspace: torch.Tensor | None = None) -> torch.Tensor:
    q, kv = case["q"], case["kv"]
    heads, dim = q.shape[1:]
    if workspace is None:
        workspace = sd.new_workspace(q.shape[0], kv.shape[2], heads // kv.shape[2], dim, splits, q.device)
    return sd.split_decode(q, kv, case["pos"], case["rows"], case["out_loc"], case["cos_sin"], case["table"],
                           case["cache"].buffer[0], workspace, splits, case["cache"].scales[0])


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "splits", "positions"),
    [
        (4, 1, 32, 1, [0, 1, 15, 16, 17, 40, 200]),  # one split: the first kernel writes the output; 4 blocks
        (9, 3, 32, 4, [0, 5, 31, 32, 33, 100]),  # SmolLM2's 3 q heads per KV head; splits left empty
        (8, 2, 64, 2, [70, 3]),
        (14, 2, 16, 8, [200]),  # 7 q heads per KV head (Qwen2.5-7B): the group is padded to 8
    ],
)
def test_matches_float64_and_writes_the_cache(heads, kv_heads, dim, splits, positions):
    case = make_case(heads, kv_heads, dim, positions, 16, torch.float32)
    ref, k_ref, v_ref = reference(case)
    out = run(case, splits)
    assert out.shape == (len(positions), heads * dim)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    flat = case["cache"].buffer[0].reshape(2, -1, kv_heads, dim)
    torch.testing.assert_close(flat[0, case["out_loc"]], k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(flat[1, case["out_loc"]], v_ref)  # V is copied, never rounded


@pytest.mark.parametrize(("heads", "kv_heads", "splits", "positions"), [(8, 2, 1, [0, 17, 70]), (9, 3, 4, [5, 100])])
def test_fp8_cache_matches_float64_of_the_cached_values(heads, kv_heads, splits, positions):
    """An e4m3 cache with a K and a V scale: the output against float64 over the dequantised cache, the new
    token's K and V written as ``quantize_kv`` encodes them (V bit for bit; K up to the rotation's rounding)."""
    case = make_case(heads, kv_heads, 32, positions, 16, torch.float32, seed=3, kv_fp8=True)
    check_fp8_case(case, lambda: run(case, splits))


def check_fp8_case(case: dict, attend) -> None:  # noqa: ANN001 - the kernel call on ``case``
    """An FP8-cache decode kernel on ``case``: its output against float64 over the dequantised cache, the new
    K within one e4m3 step (the rotation's rounding) and the new V bit for bit as ``quantize_kv`` encodes them."""
    ref, k_ref, v_ref = reference(case)
    out = attend()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    flat = case["cache"].buffer[0].reshape(2, -1, *case["cache"].buffer.shape[-2:])
    torch.testing.assert_close(flat[0, case["out_loc"]].float(), k_ref.float(), rtol=0.07, atol=0)
    assert torch.equal(flat[1, case["out_loc"]].view(torch.uint8), v_ref.view(torch.uint8))


def test_split_count_does_not_change_the_result():
    """The same requests with 1, 2, 4 and 16 splits (most of them empty at these lengths)."""
    outs = []
    for splits in (1, 2, 4, 16):
        case = make_case(8, 2, 32, [3, 47, 130], 16, torch.float32, seed=5)
        outs.append(run(case, splits))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


def test_the_last_split_merges_and_leaves_its_counter_at_zero():
    """Called twice on one workspace (as every layer and replay does): each call merges (the counters went
    back to zero in between), and both match float64."""
    case = make_case(8, 2, 32, [3, 47, 130], 16, torch.float32, seed=6)
    ref = reference(case)[0]
    workspace = sd.new_workspace(3, 2, 4, 32, 8, case["q"].device)
    first = run(case, 8, workspace)
    counters = workspace[-3 * 2:].view(torch.int32)
    assert torch.equal(counters, torch.zeros_like(counters))
    torch.testing.assert_close(run(case, 8, workspace), first, rtol=0, atol=0)
    torch.testing.assert_close(first.double(), ref, rtol=1e-5, atol=1e-5)


def test_a_separate_q_tensor_is_read_through_its_strides():
    """Qwen3 normalises q per head into a new dense tensor: q and kv are then not views of one row."""
    case = make_case(4, 2, 32, [9, 20], 16, torch.float32, fused_q=False, seed=2)
    ref, _, _ = reference(case)
    torch.testing.assert_close(run(case, 2).double(), ref, rtol=1e-5, atol=1e-5)


def test_split_rule():
    """One block per program up to 64 splits, fewer where the batch already fills 4096 programs."""
    assert sd.block_tokens(4, 64) == 32
    assert sd.num_splits(1, 8, 4, 64, 2048) == 64
    assert sd.num_splits(1, 8, 4, 64, 300) == 16  # 10 blocks, rounded up to a power of two
    assert sd.num_splits(8, 8, 4, 64, 2048) == 64
    assert sd.num_splits(64, 8, 4, 64, 2048) == 8
    assert sd.num_splits(1, 8, 4, 64, 20) == 1
