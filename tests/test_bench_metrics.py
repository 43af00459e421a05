"""The benchmark's derived metrics stay what their names say (scripts/bench_runs.py)."""

from __future__ import annotations

import random

from scripts.bench_runs import decode_idle


def test_decode_idle_counts_gaps_between_decode_steps_only() -> None:
    # decode 0-2, gap 1, decode 3-5, prefill 5-105 (not a decode gap), decode 106-108, gap 2, decode 110-112
    steps = [(0.0, 2.0, True), (3.0, 5.0, True), (5.0, 105.0, False), (106.0, 108.0, True), (110.0, 112.0, True)]
    m = decode_idle(steps)
    assert (m["decode_busy_ms"], m["decode_idle_ms"]) == (4.0, 3.0)
    assert abs(m["decode_idle_share"] - 3 / 7) < 1e-12


def test_decode_idle_share_is_a_share_even_for_steps_out_of_order() -> None:
    rng = random.Random(0)
    for _ in range(200):
        steps = [(rng.uniform(0, 100), rng.uniform(0, 100), rng.random() < 0.7) for _ in range(rng.randrange(0, 12))]
        m = decode_idle(steps)
        assert 0.0 <= m["decode_idle_share"] <= 1.0, steps
        assert m["decode_busy_ms"] >= 0 and m["decode_idle_ms"] >= 0
    assert decode_idle([])["decode_idle_share"] == 0.0
