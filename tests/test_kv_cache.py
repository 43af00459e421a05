"""KV-cache sizing, the page allocator, and JSONL job-row parsing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from runtime.engine.kv_cache import KVCache, compute_num_pages, page_bytes
from runtime.frontend.job_files import read_rows
from runtime.sampling_params import SamplingParams
from runtime.scheduler.pages import PageAllocator
from runtime.utils import DUMMY_PAGE

GiB = 1 << 30
MiB = 1 << 20


# ---------------------------------------------------------------------------------------------------------
# sizing
# ---------------------------------------------------------------------------------------------------------
def test_page_bytes_smollm2_shape():
    # SmolLM2-135M: 30 layers, 3 KV heads, head_dim 64; page of 16 tokens, float32.
    # Per layer and token: K and V, 3 heads x 64 dims x 4 bytes = 2 * 768 = 1536 bytes;
    # x 16 tokens = 24576 bytes per layer; x 30 layers = 737280 bytes.
    assert page_bytes(30, 3, 64, 16, torch.float32) == 737_280
    assert page_bytes(30, 3, 64, 16, torch.bfloat16) == 368_640
    # one KV head per rank (TP=3) is a third
    assert page_bytes(30, 1, 64, 16, torch.float32) == 245_760


def test_page_bytes_matches_the_kv_cache_tensor():
    for layers, heads, dim, size, dtype in [(30, 3, 64, 16, torch.float32), (2, 4, 8, 1, torch.float16)]:
        cache = KVCache(layers, 5, size, heads, dim, dtype, torch.device("cpu"))
        buf = cache.buffer
        assert buf.numel() * buf.element_size() == 5 * page_bytes(layers, heads, dim, size, dtype)


@pytest.mark.parametrize(
    ("free", "model", "ratio", "per_page", "expected"),
    [
        # 0.5 * 10 GiB = 5 GiB; less 1 GiB of weights = 4 GiB; / 1 MiB pages = 4096
        (10 * GiB, 1 * GiB, 0.5, MiB, 4096),
        # 0.9 * 1000 = 900; - 100 = 800; / 300 = 2.67 -> 2
        (1000, 100, 0.9, 300, 2),
        # 0.75 * 4 GiB = 3 GiB; - 3 GiB + 1 byte -> -1 byte: the model does not leave a page -> 0
        (4 * GiB, 3 * GiB + 1, 0.75, 1, 0),
        # the model alone is more than the budget -> 0, never negative
        (8 * GiB, 10 * GiB, 0.9, MiB, 0),
        # exactly one page left
        (2 * GiB, GiB, 0.5, 1, 0),
        (2 * GiB, GiB - 737_280, 0.5, 737_280, 1),
        (2 * GiB, GiB - 737_281, 0.5, 737_280, 1),
        (2 * GiB, GiB - 2 * 737_280 + 1, 0.5, 737_280, 1),
        # ratio 1: all of it; 80 GiB H100-like numbers with SmolLM2's float32 page
        (80 * GiB, 540 * MiB, 1.0, 737_280, (80 * GiB - 540 * MiB) // 737_280),
    ],
)
def test_compute_num_pages_formula(free, model, ratio, per_page, expected):
    assert compute_num_pages(free, model, ratio, per_page) == expected


def test_compute_num_pages_smollm2_on_a_2_gib_cpu_budget():
    # the CPU default budget (2 GiB) at ratio 0.9, a ~540 MB float32 model: worked out by hand
    free, model, per_page = 2 * GiB, 538_000_000, 737_280
    budget = 1_932_735_283  # floor(0.9 * 2147483648) = floor(1932735283.2)
    assert compute_num_pages(free, model, 0.9, per_page) == (budget - model) // per_page == 1891


# ---------------------------------------------------------------------------------------------------------
# PageAllocator
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("n", [0, 1, -3])
def test_allocator_needs_two_pages(n):
    with pytest.raises(ValueError, match="2"):
        PageAllocator(n)


def test_allocator_never_hands_out_the_dummy_page():
    alloc = PageAllocator(10)
    assert alloc.num_free == 9
    pages = alloc.alloc(9)
    assert sorted(pages) == list(range(1, 10))
    assert DUMMY_PAGE not in pages
    assert alloc.num_free == 0


def test_allocator_round_trip_and_over_ask():
    alloc = PageAllocator(8)
    a = alloc.alloc(3)
    b = alloc.alloc(2)
    assert len(a) == 3 and len(b) == 2 and not set(a) & set(b)
    assert alloc.num_free == 2
    with pytest.raises(RuntimeError):
        alloc.alloc(3)
    assert alloc.num_free == 2  # a refused request changes nothing
    alloc.free(a)
    assert alloc.num_free == 5
    c = alloc.alloc(5)
    assert set(c) == set(range(1, 8)) - set(b)
    alloc.free(b)
    alloc.free(c)
    assert alloc.num_free == 7
    assert alloc.alloc(0) == []
    with pytest.raises(RuntimeError):
        alloc.alloc(8)


@settings(max_examples=150, deadline=None)
@given(
    num_pages=st.integers(2, 40),
    ops=st.lists(st.tuples(st.booleans(), st.integers(0, 45), st.randoms(use_true_random=False)), max_size=60),
)
def test_allocator_against_a_reference_set_model(num_pages, ops):
    alloc = PageAllocator(num_pages)
    free_ref = set(range(1, num_pages))
    held: list[list[int]] = []
    for is_alloc, n, rnd in ops:
        if is_alloc:
            if n > len(free_ref):
                with pytest.raises(RuntimeError):
                    alloc.alloc(n)
            else:
                pages = alloc.alloc(n)
                assert len(pages) == n
                assert len(set(pages)) == n  # no page twice in one allocation
                assert set(pages) <= free_ref  # only free pages (never the dummy, never a held one)
                free_ref -= set(pages)
                held.append(pages)
        elif held:
            block = held.pop(rnd.randrange(len(held)))
            subset = rnd.sample(block, rnd.randint(0, len(block)))  # free part of a block
            rest = [p for p in block if p not in subset]
            if rest:
                held.append(rest)
            alloc.free(subset)
            free_ref |= set(subset)
        assert alloc.num_free == len(free_ref)
        in_use = [p for block in held for p in block]
        assert len(in_use) == len(set(in_use))
        assert len(in_use) + len(free_ref) == num_pages - 1
    # everything can be handed out again, exactly once
    for block in held:
        alloc.free(block)
    everything = alloc.alloc(num_pages - 1)
    assert sorted(everything) == list(range(1, num_pages))


# ---------------------------------------------------------------------------------------------------------
# runtime.frontend.job_files.read_rows
# ---------------------------------------------------------------------------------------------------------
def write_jsonl(tmp_path: Path, lines: list[str]) -> Path:
    path = tmp_path / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_read_rows_good_and_bad(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    lines = [
        json.dumps({"id": "a", "prompt": "What is 2+2?", "sampling": {"temperature": 0.5, "seed": 3}}),  # 1 ok
        json.dumps({"id": 7, "messages": messages}),  # 2 ok
        '{"id": "broken", "prompt": "x"',  # 3 not JSON
        "",  # 4 blank: skipped
        json.dumps({"id": "c", "prompt": "x", "sampling": {"top_p": 2}}),  # 5 bad sampling value
        json.dumps({"prompt": "no id here"}),  # 6 missing id
        json.dumps({"id": "a", "prompt": "again"}),  # 7 duplicate id
        json.dumps({"id": "d", "prompt": "x", "sampling": {"temprature": 1}}),  # 8 unknown sampling name
        json.dumps({"id": "e", "prompt": "x", "messages": messages}),  # 9 both prompt and messages
        json.dumps({"id": "f"}),  # 10 neither
        json.dumps(["id", "g"]),  # 11 not an object
        json.dumps({"id": "h", "prompt": "fine"}),  # 12 ok
    ]
    defaults = SamplingParams(temperature=0.0, max_new_tokens=11)
    rows = list(read_rows(write_jsonl(tmp_path, lines), defaults, chat_template=True))
    by_line = {r.line: r for r in rows}
    assert sorted(by_line) == [1, 2, 3, 5, 6, 7, 8, 9, 10, 11, 12]

    ok = by_line[1]
    assert ok.error is None and ok.id == "a"
    assert ok.prompt == [{"role": "user", "content": "What is 2+2?"}]  # chat template on: wrapped as a message
    assert ok.sampling.temperature == 0.5 and ok.sampling.seed == 3
    assert ok.sampling.max_new_tokens == 11  # the rest comes from the defaults

    msg = by_line[2]
    assert msg.error is None and msg.id == 7 and msg.prompt == messages
    assert msg.sampling.max_new_tokens == 11 and msg.sampling.temperature == 0.0

    assert by_line[12].error is None and by_line[12].id == "h"

    def err(line: int) -> str:
        row = by_line[line]
        assert row.error, f"line {line} should be an error row"
        assert row.prompt is None and row.sampling is None
        return row.error

    assert "line 3" in err(3) and "JSON" in err(3)
    assert "top_p" in err(5) and by_line[5].id == "c"
    assert "id" in err(6) and "line 6" in err(6) and by_line[6].id is None
    assert "duplicate" in err(7) and "'a'" in err(7) and by_line[7].id == "a"
    assert "temprature" in err(8)
    assert "prompt" in err(9) and "messages" in err(9)
    assert "prompt" in err(10) and "messages" in err(10)
    assert "line 11" in err(11) and "object" in err(11)


def test_read_rows_without_chat_template_keeps_plain_prompts(tmp_path):
    path = write_jsonl(tmp_path, [json.dumps({"id": 1, "prompt": "plain"})])
    (row,) = read_rows(path, SamplingParams(), chat_template=False)
    assert row.error is None and row.prompt == "plain"


def test_read_rows_ids_of_different_types_are_not_duplicates(tmp_path):
    path = write_jsonl(tmp_path, [json.dumps({"id": 1, "prompt": "a"}), json.dumps({"id": "1", "prompt": "b"})])
    rows = list(read_rows(path, SamplingParams(), chat_template=True))
    assert [r.error for r in rows] == [None, None]


def test_store_writes_k_and_v_of_a_fused_qkv_view_at_their_slots():
    # K and V arrive as one strided view into the fused qkv projection; one store writes both.
    torch.manual_seed(0)
    layers, pages, size, heads, dim, q_width = 2, 6, 4, 3, 8, 5 * 8
    cache = KVCache(layers, pages, size, heads, dim, torch.float32, torch.device("cpu"))
    tokens = 7
    qkv = torch.randn(tokens, q_width + 2 * heads * dim)
    kv = qkv[:, q_width:].view(tokens, 2, heads, dim)
    slots = torch.tensor([5, 9, 10, 11, 12, 22, 23])
    cache.store(1, slots, kv)
    k_flat = cache.k(1).reshape(-1, heads, dim)
    v_flat = cache.v(1).reshape(-1, heads, dim)
    assert torch.equal(k_flat[slots], kv[:, 0]) and torch.equal(v_flat[slots], kv[:, 1])
    untouched = torch.ones(pages * size, dtype=torch.bool)
    untouched[slots] = False
    assert k_flat[untouched].abs().sum() == 0 and v_flat[untouched].abs().sum() == 0
    assert cache.buffer[0].abs().sum() == 0  # the other layer
