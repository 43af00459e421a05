"""The batched decode attention kernel (runtime/engine/attention/paged_decode.py) against float64: RoPE, the
cache write and chunked attention over a paged cache, on CPU through Triton's interpreter (conftest sets
TRITON_INTERPRET=1 where there is no GPU; tests/test_gpu_kernels.py runs it compiled)."""

from __future__ import annotations

import pytest
import torch

from runtime.engine.attention import paged_decode as pd
from tests.test_split_decode import make_case, reference


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
    from tests.test_split_decode import FP8_SCALES, check_fp8_case

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


def test_a_separate_q_tensor_is_read_through_its_strides():
    case = make_case(4, 2, 32, [9, 90], 16, torch.float32, fused_q=False, seed=2)
    torch.testing.assert_close(run(case, 64).double(), reference(case)[0], rtol=1e-5, atol=1e-5)


def test_chunk_rule():
    """(request, KV head) pairs rounded up to a power of two, within 128-1024 tokens a chunk."""
    assert pd.chunk_tokens(16, 3) == 128
    assert pd.chunk_tokens(64, 3) == 256
    assert pd.chunk_tokens(128, 3) == 512
    assert pd.chunk_tokens(256, 3) == 1024
    assert pd.chunk_tokens(256, 8) == 1024
    assert pd.chunk_tokens(256, 3, 2304) == 1024  # the benchmarks' limit: the rule alone (2,304 programs)
    assert pd.chunk_tokens(16, 8, 2304) == 128
    assert pd.chunk_tokens(256, 8, 8192) == 2048  # 2,048 pairs x 4 chunks: at MAX_PROGRAMS
    assert pd.chunk_tokens(64, 8, 32768) == 2048  # 512 pairs x 16 chunks: at MAX_PROGRAMS
    assert pd.chunk_tokens(4, 8, 32768) == 1024  # 32 chunks a sequence: at MAX_CHUNKS
    assert pd.chunk_tokens(2, 8, 131072) == 4096  # 32 chunks of a 128k-token limit
    assert pd.num_chunks(2304, 128) == 32  # the benchmarks' longest workspace axis (18 chunks launched)
    assert pd.num_chunks(2304, 1024) == 4  # 3, rounded up to a power of two for the merge
    assert pd.num_chunks(1000, 1024) == 1
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
