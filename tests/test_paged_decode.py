"""The decode attention kernel (runtime/engine/attention/paged_decode.py) against float64: RoPE, the cache
write and chunked attention over a paged cache, on CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 where there is no GPU; tests/test_gpu_kernels.py runs it compiled)."""

from __future__ import annotations

import math

import pytest
import torch

from models.ops import rope_cos_sin_cache, rope_inv_freq, rope_torch
from runtime.engine.attention import paged_decode as pd
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


def check_fp8_case(case: dict, attend) -> None:  # noqa: ANN001 - the kernel call on ``case``
    """An FP8-cache decode kernel on ``case``: its output against float64 over the dequantised cache, the new
    K within one e4m3 step (the rotation's rounding) and the new V bit for bit as ``quantize_kv`` encodes them."""
    ref, k_ref, v_ref = reference(case)
    out = attend()
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    flat = case["cache"].buffer[0].reshape(2, -1, *case["cache"].buffer.shape[-2:])
    torch.testing.assert_close(flat[0, case["out_loc"]].float(), k_ref.float(), rtol=0.07, atol=0)
    assert torch.equal(flat[1, case["out_loc"]].view(torch.uint8), v_ref.view(torch.uint8))


def run(case: dict, chunk: int, chunks: int | None = None, workspace: torch.Tensor | None = None,
        counters: torch.Tensor | None = None) -> torch.Tensor:
    q, kv, cache = case["q"], case["kv"], case["cache"]
    batch, heads, dim = q.shape
    kv_heads = kv.shape[2]
    chunks = chunks or pd.num_chunks(case["table"].shape[1] * cache.page_size, chunk)
    if workspace is None:
        size = pd.workspace_size(batch, kv_heads, heads // kv_heads, dim, chunks)
        workspace = torch.empty(max(size, 1), dtype=torch.float32, device=q.device)
    counters = pd.new_counters(batch, kv_heads, q.device) if counters is None else counters
    return pd.paged_decode(q, kv, case["pos"], case["rows"], case["out_loc"], case["cos_sin"], case["table"],
                           cache.buffer[0], workspace, counters, chunk, chunks, cache.scales[0])


def poison_new_slots(case: dict) -> None:
    """NaN in the slots the step writes (the reference never reads them): reading one before the kernel's
    own write, or another program's half-written one, makes the output NaN."""
    flat = case["cache"].buffer[0].view(2, -1, *case["cache"].buffer.shape[-2:])
    flat.index_fill_(1, case["out_loc"], float("nan"))  # (an index_fill: capturable in a CUDA graph)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "chunk", "positions"),
    [
        (9, 3, 32, 64, [0, 5, 63, 64, 65, 200]),  # SmolLM2's group of 3; chunk edges, empty chunks
        (4, 1, 32, 128, [0, 1, 15, 16, 17, 40, 127, 128, 300]),
        (8, 2, 64, 64, [70, 3]),
        (14, 2, 16, 64, [130]),  # 7 q heads per KV head (Qwen2.5-7B) in a 16-row tile
        (8, 2, 32, 1024, [3, 500]),  # one chunk covers every sequence: the output is written directly
    ],
)
def test_matches_float64_and_writes_the_cache(heads, kv_heads, dim, chunk, positions):
    case = make_case(heads, kv_heads, dim, positions, 16, torch.float32)
    ref, k_ref, v_ref = reference(case)
    qkv = case["qkv"].clone()
    poison_new_slots(case)
    out = run(case, chunk)
    assert out.shape == (len(positions), heads * dim)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    flat = case["cache"].buffer[0].reshape(2, -1, kv_heads, dim)
    torch.testing.assert_close(flat[0, case["out_loc"]], k_ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(flat[1, case["out_loc"]], v_ref)  # V is copied, never rounded
    assert torch.equal(case["qkv"], qkv)  # q and k are rotated in registers, not in place


@pytest.mark.parametrize(("heads", "kv_heads", "chunk", "positions"), [(8, 2, 64, [0, 63, 64, 200]), (9, 3, 1024, [5, 40])])
def test_fp8_cache_matches_float64_of_the_cached_values(heads, kv_heads, chunk, positions):
    """An e4m3 cache with a K and a V scale (the scales fold into the softmax scale and the output): against
    float64 over the dequantised cache; the new V written bit for bit as ``quantize_kv`` encodes it."""
    case = make_case(heads, kv_heads, 32, positions, 16, torch.float32, seed=4, kv_fp8=True)
    torch.testing.assert_close(case["cache"].scales[0], torch.tensor(FP8_SCALES))
    check_fp8_case(case, lambda: run(case, chunk))


def test_chunk_size_does_not_change_the_result():
    outs = []
    for chunk in (64, 128, 512):
        case = make_case(8, 2, 32, [3, 47, 130, 260], 16, torch.float32, seed=5)
        outs.append(run(case, chunk))
    for out in outs[1:]:
        torch.testing.assert_close(out, outs[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_sequences_longer_than_their_chunks_split_over_them(chunks):
    """Fewer chunks than the shortest chunk length needs (a long limit under the program caps): each sequence's
    chunks grow to its share of its own length, the last one merging, and the result stays float64's."""
    case = make_case(8, 2, 32, [3, 300, 700, 64], 16, torch.float32, seed=12)
    ref = reference(case)[0]
    torch.testing.assert_close(run(case, 64, chunks).double(), ref, rtol=1e-5, atol=1e-5)


def test_the_last_chunk_merges_and_leaves_its_counter_at_zero():
    """Two calls over one workspace and counter tensor larger than this batch needs (the engine shares them
    between graph sizes): the counters are back at zero after each call, and the results equal float64."""
    case = make_case(8, 2, 32, [3, 47, 130], 16, torch.float32, seed=6)
    ref = reference(case)[0]
    workspace = torch.full((10_000,), float("nan"))
    counters = pd.new_counters(7, 2, case["q"].device)
    first = run(case, 64, workspace=workspace, counters=counters)
    assert torch.equal(counters, torch.zeros_like(counters))
    torch.testing.assert_close(first.double(), ref, rtol=1e-5, atol=1e-5)
    again = make_case(8, 2, 32, [3, 47, 130], 16, torch.float32, seed=6)
    torch.testing.assert_close(run(again, 64, workspace=workspace, counters=counters), first, rtol=0, atol=0)


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_the_merge_reads_only_the_rows_its_chunks_wrote():
    """Seven q heads a KV head fill 7 of the merge's 8 rows; the eighth is never written. A workspace of huge
    values (what unwritten memory may hold) must stay out of the merge's arithmetic, where the interpreter raises
    on the overflow it would cause; the result equals float64."""
    case = make_case(14, 2, 16, [130, 40], 16, torch.float32, seed=3)
    ref = reference(case)[0]
    workspace = torch.full((10_000,), 3e38)
    torch.testing.assert_close(run(case, 64, workspace=workspace).double(), ref, rtol=1e-5, atol=1e-5)


def test_a_separate_q_tensor_is_read_through_its_strides():
    case = make_case(4, 2, 32, [9, 90], 16, torch.float32, fused_q=False, seed=2)
    torch.testing.assert_close(run(case, 64).double(), reference(case)[0], rtol=1e-5, atol=1e-5)


def test_chunk_rule():
    """The shortest chunk: (request, KV head) pairs rounded up to a power of two, within 128-1024 tokens; the
    chunk count: enough for the limit at that length, within the program and merge caps."""
    assert pd.chunk_tokens(16, 3) == 128
    assert pd.chunk_tokens(64, 3) == 256
    assert pd.chunk_tokens(128, 3) == 512
    assert pd.chunk_tokens(256, 3) == 1024
    assert pd.chunk_tokens(256, 8) == 1024
    assert pd.num_chunks(2304, 128) == 32  # the benchmarks' limit at one request (18 chunks launched)
    assert pd.num_chunks(2304, 1024, 768) == 4  # 3, rounded up to a power of two for the merge
    assert pd.num_chunks(1000, 1024) == 1
    assert pd.num_chunks(8192, 1024, 256 * 8) == 4  # 2,048 pairs x 4 chunks: at MAX_PROGRAMS
    assert pd.num_chunks(32768, 512, 64 * 8) == 16  # 512 pairs x 16 chunks: at MAX_PROGRAMS
    assert pd.num_chunks(131072, 128, 8) == 32  # one request under a 128k limit: at MAX_CHUNKS
    assert pd.num_chunks(131072, 1024, 5000) == 1  # more pairs than half of MAX_PROGRAMS: one chunk each
    assert pd.num_chunks(2304, 1024, 2048 * 8) == 1  # more pairs than MAX_PROGRAMS: still one chunk each
    assert pd.supports(9, 3, 64, torch.bfloat16) and pd.supports(28, 4, 128, torch.float16)
    assert not pd.supports(9, 3, 80, torch.bfloat16)  # not a power of two
    assert not pd.supports(9, 3, 64, torch.float32)  # tl.dot would round to TF32


def test_graph_sizes_share_a_buffer_until_one_needs_more():
    """The backend's workspace and counters: reused while large enough, replaced (zeroed) when not."""
    from runtime.engine.attention.flashinfer_backend import grown

    first = grown(None, 0, torch.int32, torch.device("cpu"))
    assert first.numel() == 1 and first.dtype == torch.int32
    big = grown(first, 768, torch.int32, torch.device("cpu"))
    assert big.numel() == 768 and torch.equal(big, torch.zeros_like(big))
    assert grown(big, 48, torch.int32, torch.device("cpu")) is big
