"""Which CUDA graph a step replays (pure functions of runtime/engine/graph.py; the graphs run on GPUs only)."""

from __future__ import annotations

import pytest

from runtime.engine.graph import graph_batch_sizes, prefill_graph_size, prefill_graph_sizes


def test_decode_sizes_cover_every_batch_up_to_the_maximum():
    sizes = graph_batch_sizes(64)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 64
    assert all(b - a <= 8 for a, b in zip(sizes, sizes[1:]))


@pytest.mark.parametrize(
    ("max_tokens", "expected"),
    [
        (0, []),
        (128, [128]),
        (512, [256, 512]),
        (1000, [256, 512, 768, 1000]),
        (2048, [256, 512, 768, 1024, 1280, 1536, 1792, 2048]),
        (5000, [256, 512, 768, 1024, 1280, 1536, 1792, 2048, 3072, 4096, 5000]),
    ],
)
def test_prefill_sizes_end_at_the_full_step(max_tokens, expected):
    assert prefill_graph_sizes(max_tokens) == expected


def test_a_prefill_step_replays_the_smallest_graph_that_holds_it_unless_the_padding_is_large():
    sizes = prefill_graph_sizes(16384)
    assert prefill_graph_size(sizes, 16384) == 16384  # a full chunked-prefill step, unpadded
    assert prefill_graph_size(sizes, 16000) == 16384  # 384 dummy tokens <= 16384 / 16
    assert prefill_graph_size(sizes, 15300) == 15360
    assert prefill_graph_size(sizes, 8200) is None  # 1016 dummy tokens > 9216 / 16: GPU work wasted
    assert prefill_graph_size(sizes, 1) == 256  # small steps: up to 256 dummy tokens
    assert prefill_graph_size(sizes, 257) == 512
    assert prefill_graph_size(sizes, 1438) == 1536  # every 256 tokens up to 2048: at most 255 dummy tokens
    assert prefill_graph_size(sizes, 2049) is None  # 1023 dummy tokens above 2048, where sizes are 1024 apart
    assert prefill_graph_size(sizes, 3000) == 3072
    assert prefill_graph_size(sizes, 16385) is None  # beyond the largest graph: eager
    assert prefill_graph_size([], 10) is None
