"""The fused RoPE + KV-cache write kernel against the torch reference (run on a GPU with `pytest -m gpu`)."""

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


# The fused small-batch GEMVs (models/gemv.py), compiled, with programmatic dependent launch on Hopper.
# 1B qkv and down; 8B qkv, o, gate_up and down (its tuned tiles); Qwen2.5-7B's qkv (the rule); SmolLM2 qkv
GEMV_SHAPES = [(3072, 2048), (2048, 8192), (6144, 4096), (4096, 4096), (14336, 4096), (4096, 14336), (4608, 3584),
               (960, 576)]


def _rel(ours: torch.Tensor, ref: torch.Tensor) -> float:
    return float((ours.double() - ref).norm() / ref.norm())


@pytest.mark.parametrize(("n", "k"), GEMV_SHAPES)
def test_fused_gemv_kernels_match_float64(n, k):
    """bf16 in and out, float32 inside: one rounding of the output (~2e-3 relative) is all that may differ."""
    from models import gemv

    torch.manual_seed(n)
    rows = 1
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    h = torch.randn(rows, k, device=dev, dtype=bf16)
    norm_w = (torch.rand(k, device=dev) + 0.5).to(bf16)
    w = (torch.randn(2 * n, k, device=dev) * 0.02).to(bf16)
    bias = (torch.randn(2 * n, device=dev) * 0.1).to(bf16)
    hd = h.double()
    normed = hd * torch.rsqrt(hd.pow(2).mean(-1, keepdim=True) + 1e-5) * norm_w.double()
    assert _rel(gemv.norm_linear(h, norm_w, 1e-5, w[:n], bias[:n]), normed @ w[:n].double().T + bias[:n].double()) < 4e-3
    gate_up = normed @ w.double().T + bias.double()
    silu_ref = torch.nn.functional.silu(gate_up[:, :n]) * gate_up[:, n:]
    assert _rel(gemv.norm_linear_silu(h, norm_w, 1e-5, w, bias), silu_ref) < 4e-3
    x, resid = torch.randn(rows, k, device=dev, dtype=bf16), torch.randn(rows, n, device=dev, dtype=bf16)
    ref = resid.double() + x.double() @ w[:n].double().T
    gemv.linear_add_(x, w[:n], None, resid)
    assert _rel(resid, ref) < 4e-3


def test_fused_gemv_chain_replays_bit_identically_in_a_cuda_graph():
    """Each kernel reads what the one before it wrote (h in place, the activation, the qkv output): under
    programmatic dependent launch a kernel that read before its predecessor finished would see stale data,
    and the replayed chain would differ from the same chain run eagerly with a sync between launches."""
    from models import gemv

    torch.manual_seed(0)
    dev, bf16 = torch.device("cuda"), torch.bfloat16
    hidden, inter, rows = 2048, 8192, 1
    layers = [[(torch.randn(*s, device=dev) * 0.02).to(bf16) for s in ((hidden, hidden), (2 * inter, hidden),
                                                                       (hidden, inter))] for _ in range(6)]
    norm_w = torch.ones(hidden, device=dev, dtype=bf16)
    h_in = torch.randn(rows, hidden, device=dev, dtype=bf16)

    def chain(h: torch.Tensor, sync: bool) -> torch.Tensor:
        for wq, wgu, wd in layers:
            q = gemv.norm_linear(h, norm_w, 1e-5, wq, None)
            gemv.linear_add_(q, wq, None, h)  # reads q just written, writes h just read
            gemv.linear_add_(gemv.norm_linear_silu(h, norm_w, 1e-5, wgu, None), wd, None, h)
            if sync:
                torch.cuda.synchronize()
        return h

    eager = chain(h_in.clone(), sync=True)
    h_static = h_in.clone()
    chain(h_static.clone(), sync=False)  # warm-up: compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain(h_static, sync=False)
    for _ in range(3):
        h_static.copy_(h_in)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h_static, eager)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "dim", "positions", "chunk"),
    [
        (9, 3, 64, [0, 15, 16, 700, 1999, 257, 40, 1023, 1024], 256),  # SmolLM2
        (32, 8, 64, [3, 900, 2047, 64], 128),
        (28, 4, 128, [1500, 7, 300], 512),  # Qwen2.5-7B's 7 q heads per KV head
        (32, 8, 128, list(range(0, 2000, 97)), 1024),
        (32, 8, 128, [1999], 128),  # one request, at the engine's rule for one (16 chunks, PDL on Hopper)
        (32, 8, 64, [3], 128),
    ],
)
def test_paged_decode_matches_float64(heads, kv_heads, dim, positions, chunk):
    """The compiled kernel in bf16 against the float64 reference, and the cache it leaves against the unfused
    RoPE + KV-write kernel's (V bit for bit; K the same float32 rotation rounded once, up to FMA contraction)."""
    from runtime.engine.attention.rope_store import rope_and_store
    from tests.test_paged_decode import make_case, poison_new_slots, reference, run

    case = make_case(heads, kv_heads, dim, positions, 16, torch.bfloat16, device="cuda", seed=len(positions))
    unfused = make_case(heads, kv_heads, dim, positions, 16, torch.bfloat16, device="cuda", seed=len(positions))
    ref = reference(case)[0]
    poison_new_slots(case)  # a read of a new slot before its write (a missing barrier) turns the output NaN
    out = run(case, chunk)
    assert not out.isnan().any()
    rel = float((out.double().cpu() - ref).norm() / ref.norm())
    assert rel < 5e-3, rel  # bf16 output rounding is ~2e-3, P rounded to bf16 as in flashinfer
    rope_and_store(unfused["pos"], unfused["q"], unfused["kv"], unfused["cos_sin"], unfused["cache"], 0,
                   unfused["out_loc"])
    fused_k, unfused_k = case["cache"].buffer[0, 0], unfused["cache"].buffer[0, 0]
    assert torch.equal(case["cache"].buffer[0, 1], unfused["cache"].buffer[0, 1])
    torch.testing.assert_close(fused_k, unfused_k, rtol=8e-3, atol=8e-3)
    assert (fused_k != unfused_k).sum() <= fused_k[0, 0].numel() * len(positions)  # only the new slots may differ


def test_paged_decode_long_sequences_keep_their_bits_in_any_batch():
    """Deterministic mode's chunks under a 65,536-token limit (1,024 tokens at least, 32 a sequence): a 40,000-token
    sequence (chunks of 1,280) and shorter ones against float64, and each decoded alone gives the batch's bits."""
    from runtime.engine.attention import paged_decode as pd
    from runtime.engine.attention.flashinfer_backend import DETERMINISTIC_CHUNK_TOKENS
    from tests.test_paged_decode import make_case, reference, run

    positions = [40000, 2000, 5]
    case = make_case(32, 8, 128, positions, 16, torch.bfloat16, device="cuda", seed=13)
    case["cos_sin"] = rope_cos_sin_cache(40960, rope_inv_freq(128, 500000.0, None)).to("cuda")
    chunk, chunks = DETERMINISTIC_CHUNK_TOKENS, pd.num_chunks(65536, DETERMINISTIC_CHUNK_TOKENS)
    assert chunks == 32
    ref = reference(case)[0]
    together = run(case, chunk, chunks)
    rel = float((together.double().cpu() - ref).norm() / ref.norm())
    assert rel < 5e-3, rel
    for b in range(len(positions)):
        one = dict(case, q=case["q"][b : b + 1], kv=case["kv"][b : b + 1],
                   **{k: case[k][b : b + 1] for k in ("pos", "rows", "out_loc")})
        assert torch.equal(run(one, chunk, chunks), together[b : b + 1]), b


def test_paged_decode_replays_in_a_cuda_graph_with_new_positions():
    """Captured once, replayed three times after the positions, rows and slots changed: equal to an eager call
    each time (the last chunk merges, so every replay must find its counters back at zero)."""
    from runtime.engine.attention import paged_decode as pd
    from tests.test_paged_decode import make_case, run

    positions, fresh_positions = [100, 5, 1999, 31, 900, 0], [640, 1700, 2, 47, 1999, 1024]  # same table shape
    case = make_case(9, 3, 64, positions, 16, torch.bfloat16, device="cuda", seed=9)
    fresh = make_case(9, 3, 64, fresh_positions, 16, torch.bfloat16, device="cuda", seed=9)
    static = {k: case[k] for k in ("pos", "rows", "out_loc")}
    chunks = pd.num_chunks(case["table"].shape[1] * 16, 256)
    workspace = torch.empty(pd.workspace_size(6, 3, 3, 64, chunks), device="cuda")
    counters = pd.new_counters(6, 3, torch.device("cuda"))
    run(case, 256, chunks, workspace, counters)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run(case, 256, chunks, workspace, counters)
    for k in static:
        static[k].copy_(fresh[k])
    case["table"].copy_(fresh["table"])
    fresh_cache, fresh_qkv = fresh["cache"].buffer.clone(), fresh["qkv"].clone()  # before run() writes the cache
    expected = run(fresh, 256, chunks)
    for _ in range(3):
        case["cache"].buffer.copy_(fresh_cache)
        case["qkv"].copy_(fresh_qkv)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, expected)


@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (32, 8)])  # SmolLM2, Llama-3.2-1B
def test_paged_decode_gives_the_same_bits_on_every_call(heads, kv_heads):
    """200 calls on the same inputs inside a CUDA graph, the step's slots poisoned with NaN before each, every
    call writing the new K and V and merging its chunks through the counters: every output equals the first
    call's bit for bit (a read of a slot before its write, or a race in the merge, changes bits)."""
    from runtime.engine.attention import paged_decode as pd
    from tests.test_paged_decode import make_case, poison_new_slots, run

    gen = torch.Generator().manual_seed(11)
    positions = torch.randint(4, 1400, (64,), generator=gen).tolist()
    case = make_case(heads, kv_heads, 64, positions, 16, torch.bfloat16, device="cuda", seed=11)
    chunk = pd.chunk_tokens(len(positions), kv_heads)
    chunks = pd.num_chunks(case["table"].shape[1] * 16, chunk)
    workspace = torch.empty(max(pd.workspace_size(64, kv_heads, heads // kv_heads, 64, chunks), 1), device="cuda")
    counters = pd.new_counters(64, kv_heads, torch.device("cuda"))
    poison_new_slots(case)
    first = run(case, chunk, chunks, workspace, counters).clone()
    torch.cuda.synchronize()
    assert not first.isnan().any()
    outs = torch.empty((20, *first.shape), dtype=first.dtype, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(20):
            poison_new_slots(case)
            outs[i].copy_(run(case, chunk, chunks, workspace, counters))
    differing = 0
    for _ in range(10):
        graph.replay()
        torch.cuda.synchronize()
        differing += int((outs != first).flatten(1).any(1).sum())
    assert differing == 0, f"{differing} of 200 calls differ from the first"


@pytest.mark.parametrize(("rows", "hidden"), [(256, 576), (7, 2048), (64, 4096), (16384, 576), (1500, 3584)])
def test_add_rms_norm_matches_the_torch_path_and_flashinfer(rows, hidden):
    """The compiled kernel in bf16: the new residual equal to the torch path's bits and flashinfer's, the normed
    rows within two bf16 roundings of both (flashinfer rounds the product once, HF and this kernel twice)."""
    from models import add_norm
    from models.ops import FLASHINFER_KERNELS
    from tests.test_add_norm import check_against_torch

    check_against_torch(rows, hidden, torch.bfloat16, device="cuda")
    x = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda") * 3
    residual = torch.randn(rows, hidden, dtype=torch.bfloat16, device="cuda")
    weight = torch.rand(hidden, dtype=torch.bfloat16, device="cuda") + 0.5
    fi_out, fi_res = FLASHINFER_KERNELS.add_rms_norm(x.clone(), residual.clone(), weight, 1e-6)
    out, res = add_norm.add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(res, fi_res)
    assert torch.all((out.float() - fi_out.float()).abs() <= fi_out.float().abs() * 2**-6 + 1e-6)
