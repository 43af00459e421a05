"""Sampler tests on CPU (the torch reference, and the Triton kernels under Triton's interpreter).

Every "allowed set" (top-k, nucleus, greedy) is computed here independently in
float64 with numpy; the code under test is only ever asked for draws.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from runtime.batch import Batch
from runtime.engine.sampler import Sampler, SamplingArgs, counter_uniform, kept_tokens, sample_torch, top_k_thresholds

CPU = torch.device("cpu")
MARGIN = 1e-3  # how far (in logit / probability-mass units) a row must be from any set boundary


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def make_batch(temperature, top_k, top_p, seeds, positions) -> Batch:
    """A decode batch whose i-th row samples the token at ``positions[i]`` (= kv_len = start + 1)."""
    positions = np.asarray(positions, np.int64)
    n = len(positions)

    def full(x, dtype):
        arr = np.asarray(x, dtype)
        return np.full(n, arr, dtype) if arr.ndim == 0 else arr

    return Batch(
        phase="decode",
        rows=np.arange(n, dtype=np.int32),
        starts=(positions - 1).astype(np.int32),
        ext_lens=np.ones(n, np.int32),
        sample_rows=np.arange(n, dtype=np.int32),
        temperature=full(temperature, np.float32),
        top_k=full(top_k, np.int32),
        top_p=full(top_p, np.float32),
        seeds=full(seeds, np.int64),
    )


def draw(sampler: Sampler, logits: np.ndarray, batch: Batch) -> np.ndarray:
    out = sampler.sample(torch.from_numpy(np.ascontiguousarray(logits, np.float32)), sampler.prepare(batch))
    assert out.shape == (batch.size,)
    return out.numpy()


def softmax64(logits: np.ndarray, temperature: float) -> np.ndarray:
    z = np.asarray(logits, np.float64) / float(np.float32(temperature))
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


def reference_keep(probs: np.ndarray, top_k: int, top_p: float) -> tuple[np.ndarray, bool]:
    """Tokens allowed by top-k, then top-p over the renormalised top-k mass; float64.

    Returns (mask, clear): ``clear`` is False when the row sits within MARGIN of a
    boundary (a near-tie at the k-th / nucleus edge, or a cumulative mass close to
    p), where float32 rounding could legitimately pick a different set.
    """
    probs = np.asarray(probs, np.float64)
    vocab = probs.shape[-1]
    k = vocab if top_k <= 0 or top_k > vocab else int(top_k)
    order = np.argsort(-probs, kind="stable")
    sp = probs[order]
    clear = True
    if k < vocab and sp[k - 1] - sp[k] < MARGIN * sp[k - 1]:
        clear = False
    kept = sp[:k] / sp[:k].sum()
    m = k
    p = float(np.float32(top_p))
    if p < 1.0:
        cum = np.cumsum(kept)
        reached = np.flatnonzero(cum >= p)
        m = int(reached[0]) + 1 if len(reached) else k
        if k > 1 and np.min(np.abs(cum[:-1] - p)) < MARGIN:
            clear = False
        if m < k and sp[m - 1] - sp[m] < MARGIN * sp[m - 1]:
            clear = False
    mask = np.zeros(vocab, bool)
    mask[order[:m]] = True
    return mask, clear


def clear_logits(rng: np.random.Generator, vocab: int, temperature: float, top_k: int, top_p: float, scale=2.0):
    """Random logits whose allowed set under (T, k, p) is unambiguous (clear gaps at every edge)."""
    for _ in range(1000):
        logits = (rng.standard_normal(vocab) * scale).astype(np.float32)
        mask, clear = reference_keep(softmax64(logits, temperature), top_k, top_p)
        if clear:
            return logits, mask
    raise AssertionError("could not build a clear-gap row")


def chi2_critical(df: int, z: float = 4.75) -> float:
    """Upper chi-square quantile (Wilson-Hilferty); z = 4.75 is about p = 1e-6."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


@pytest.fixture
def rng() -> np.random.Generator:
    return np.random.default_rng(1234)


# ---------------------------------------------------------------------------------------------------------
# (a) top-k
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [1, 2, 5, 17, 63])
def test_top_k_never_draws_outside_the_k_largest(rng, k):
    vocab, n = 64, 3000
    sampler = Sampler(vocab, CPU, use_kernels=False)
    temps = rng.uniform(0.3, 2.5, n).astype(np.float32)
    rows = [clear_logits(rng, vocab, t, k, 1.0) for t in temps]
    logits = np.stack([r[0] for r in rows])
    allowed = np.stack([r[1] for r in rows])
    assert (allowed.sum(1) == k).all()
    seeds = rng.integers(0, 2**40, n)
    positions = rng.integers(1, 100_000, n)
    tokens = draw(sampler, logits, make_batch(temps, k, 1.0, seeds, positions))
    outside = ~allowed[np.arange(n), tokens]
    assert not outside.any(), f"{outside.sum()} draws outside the top-{k}, e.g. row {np.flatnonzero(outside)[0]}"
    not_argmax = (tokens != logits.argmax(1)).mean()
    if k == 1:
        assert not_argmax == 0
    else:  # the filter must not degenerate into greedy: other allowed tokens do get drawn
        assert not_argmax > 0.05
        ranks = (-logits).argsort(1).argsort(1)[np.arange(n), tokens]
        assert len(np.unique(ranks)) >= min(k, 12)  # many ranks of the allowed set get drawn


def test_top_k_disabled_values_keep_the_whole_vocabulary(rng):
    """top_k of -1, 0 or larger than the vocabulary restricts nothing: every token gets drawn on flat logits."""
    vocab, n = 16, 1500
    sampler = Sampler(vocab, CPU, use_kernels=False)
    for k in (-1, 0, vocab, vocab + 7):
        batch = make_batch(1.0, k, 1.0, rng.integers(0, 2**40, n), rng.integers(1, 10**6, n))
        tokens = draw(sampler, np.zeros((n, vocab), np.float32), batch)
        assert set(tokens.tolist()) == set(range(vocab)), k


# ---------------------------------------------------------------------------------------------------------
# (b) top-p
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [0.2, 0.5, 0.75, 0.9, 0.97])
def test_top_p_never_draws_outside_the_nucleus(rng, p):
    vocab, n = 48, 2000
    sampler = Sampler(vocab, CPU, use_kernels=False)
    temps = rng.uniform(0.5, 2.0, n).astype(np.float32)
    rows = [clear_logits(rng, vocab, t, -1, p) for t in temps]
    logits = np.stack([r[0] for r in rows])
    allowed = np.stack([r[1] for r in rows])
    tokens = draw(sampler, logits, make_batch(temps, -1, p, rng.integers(0, 2**40, n), rng.integers(1, 10**5, n)))
    outside = ~allowed[np.arange(n), tokens]
    assert not outside.any(), f"{outside.sum()} draws outside the p={p} nucleus"
    multi = allowed.sum(1) > 1
    assert multi.sum() > 100
    # rows with a nucleus of several tokens do draw non-argmax members of it
    assert (tokens[multi] != logits[multi].argmax(1)).mean() > 0.05


def test_top_p_nucleus_is_the_smallest_prefix_reaching_p():
    """A hand-made distribution: probs 0.5, 0.3, 0.15, 0.05 (logits = log probs)."""
    probs = np.array([0.05, 0.5, 0.15, 0.3])
    logits = np.log(probs).astype(np.float32)
    sampler = Sampler(4, CPU, use_kernels=False)
    n = 4000
    cases = {0.4: {1}, 0.6: {1, 3}, 0.79: {1, 3}, 0.81: {1, 3, 2}, 0.9: {1, 3, 2}, 0.99: {0, 1, 2, 3}}
    for p, nucleus in cases.items():
        batch = make_batch(1.0, -1, p, np.arange(n), np.arange(1, n + 1))
        seen = set(draw(sampler, np.tile(logits, (n, 1)), batch).tolist())
        assert seen == nucleus, (p, seen)


# ---------------------------------------------------------------------------------------------------------
# (c) temperature
# ---------------------------------------------------------------------------------------------------------
def test_near_zero_temperature_is_greedy(rng):
    vocab, n = 100, 4000
    sampler = Sampler(vocab, CPU, use_kernels=False)
    logits = (rng.standard_normal((n, vocab)) * 3).astype(np.float32)
    top2 = np.sort(logits, 1)[:, -2:]
    keep = (top2[:, 1] - top2[:, 0]) > 0.01  # a clear winner: 0.01 / 1e-5 = 1000 nats
    logits = logits[keep]
    n = len(logits)
    batch = make_batch(1e-5, -1, 1.0, rng.integers(0, 2**40, n), rng.integers(1, 10**6, n))
    tokens = draw(sampler, logits, batch)
    np.testing.assert_array_equal(tokens, np.argmax(logits.astype(np.float64), 1))


def test_zero_temperature_is_exact_argmax_including_ties(rng):
    vocab, n = 50, 2000
    sampler = Sampler(vocab, CPU, use_kernels=False)
    logits = rng.integers(-3, 4, (n, vocab)).astype(np.float32)  # many exact ties: argmax = first maximum
    logits[: n // 2] += rng.standard_normal((n // 2, vocab)).astype(np.float32) * 1e-6
    expected = np.argmax(logits, 1)
    seeds, positions = rng.integers(0, 2**40, n), rng.integers(1, 10**6, n)
    # all-greedy batch (the pure argmax path)
    assert draw(sampler, logits, make_batch(0.0, 5, 0.5, seeds, positions)).tolist() == expected.tolist()
    # greedy rows mixed with sampling rows (the torch.where path); top-k / top-p of greedy rows are ignored
    temps = np.where(np.arange(n) % 2 == 0, 0.0, 1.0)
    tokens = draw(sampler, logits, make_batch(temps, 3, 0.5, seeds, positions))
    greedy = temps == 0
    assert tokens[greedy].tolist() == expected[greedy].tolist()
    assert (tokens[~greedy] != expected[~greedy]).any()  # the others really sample


# ---------------------------------------------------------------------------------------------------------
# (d) seeds
# ---------------------------------------------------------------------------------------------------------
def test_seed_and_position_fix_the_token_whatever_the_batch(rng):
    vocab = 40
    sampler = Sampler(vocab, CPU, use_kernels=False)
    n_target = 200
    t_logits = rng.standard_normal((n_target, vocab)).astype(np.float32)
    t_temp = rng.choice([0.7, 1.0, 1.6], n_target)
    t_k = rng.choice([-1, 8, 30], n_target)
    t_p = rng.choice([1.0, 0.9], n_target)
    t_seed = rng.integers(0, 2**40, n_target)
    t_pos = rng.integers(1, 10**5, n_target)
    alone = np.array([
        draw(sampler, t_logits[i : i + 1], make_batch(t_temp[i : i + 1], t_k[i : i + 1], t_p[i : i + 1],
                                                       t_seed[i : i + 1], t_pos[i : i + 1]))[0]
        for i in range(n_target)
    ])
    assert len(set(alone.tolist())) > 5  # not a constant

    # the same rows among other rows with other parameters, shuffled; a fresh sampler
    n_other = 300
    logits = np.concatenate([t_logits, rng.standard_normal((n_other, vocab)).astype(np.float32) * 4])
    temp = np.concatenate([t_temp, rng.choice([0.0, 0.3, 1.0, 2.0], n_other)])
    k = np.concatenate([t_k, rng.choice([-1, 1, 3, 20], n_other)])
    p = np.concatenate([t_p, rng.choice([1.0, 0.3, 0.8], n_other)])
    seed = np.concatenate([t_seed, rng.integers(0, 2**40, n_other)])
    pos = np.concatenate([t_pos, rng.integers(1, 10**5, n_other)])
    perm = rng.permutation(len(logits))
    other_sampler = Sampler(vocab, CPU, use_kernels=False)
    tokens = draw(other_sampler, logits[perm], make_batch(temp[perm], k[perm], p[perm], seed[perm], pos[perm]))
    back = np.empty_like(tokens)
    back[perm] = tokens
    np.testing.assert_array_equal(back[:n_target], alone)
    # and repeating the identical batch repeats every token
    again = draw(other_sampler, logits[perm], make_batch(temp[perm], k[perm], p[perm], seed[perm], pos[perm]))
    np.testing.assert_array_equal(again, tokens)


def test_a_top_p_1_row_keeps_its_float32_tail_beside_a_top_p_row():
    """Next to a row with top_p < 1 the batch carries top_p for every row; a row at 1.0 must still keep a token
    whose mass float32 sums round away (it did so alone, and on the GPU)."""
    logits = torch.tensor([[0.0, -16.646]])  # token 1: probability 5.9e-8
    alone = kept_tokens(logits, torch.ones(1), None, None)
    beside = kept_tokens(logits, torch.ones(1), None, torch.ones(1))
    assert alone.tolist() == beside.tolist() == [[True, True]]
    sampler = Sampler(2, CPU, use_kernels=False)
    seeds = np.arange(20_000, dtype=np.int64)
    rows = len(seeds)
    pair = np.tile([[0.0, -16.646]], (rows, 1)).astype(np.float32)
    alone = draw(sampler, pair, make_batch(1.0, -1, 1.0, seeds, np.full(rows, 17)))
    mixed = draw(sampler, np.concatenate([pair, pair]),
                 make_batch(1.0, -1, np.r_[np.ones(rows), np.full(rows, 0.5)], np.r_[seeds, seeds],
                            np.full(2 * rows, 17)))
    np.testing.assert_array_equal(mixed[:rows], alone)


def test_a_temperature_whose_reciprocal_underflows_float32_is_refused():
    from runtime.sampling_params import MAX_TEMPERATURE, SamplingParams

    assert SamplingParams(temperature=MAX_TEMPERATURE).temperature == MAX_TEMPERATURE
    with pytest.raises(ValueError, match=r"temperature=1e\+39 must be a number in \[0, 1e\+30\]"):
        SamplingParams(temperature=1e39)
    # At the bound a -inf logit still never wins, and the finite ones are about equally likely.
    sampler = Sampler(4, CPU, use_kernels=False)
    rows = 4000
    logits = np.tile([[0.0, -np.inf, 1.0, -np.inf]], (rows, 1)).astype(np.float32)
    counts = np.bincount(draw(sampler, logits, make_batch(MAX_TEMPERATURE, -1, 1.0, np.arange(rows), np.full(rows, 3))),
                         minlength=4)
    assert counts[1] == counts[3] == 0 and abs(counts[0] - counts[2]) < 300, counts


def test_different_seeds_give_different_sequences_on_a_flat_distribution():
    vocab, steps, n_seeds = 1000, 32, 20
    sampler = Sampler(vocab, CPU, use_kernels=False)
    seeds = np.repeat(np.arange(n_seeds), steps)
    positions = np.tile(np.arange(1, steps + 1), n_seeds)
    tokens = draw(sampler, np.zeros((len(seeds), vocab), np.float32), make_batch(1.0, -1, 1.0, seeds, positions))
    seqs = tokens.reshape(n_seeds, steps)
    assert len({tuple(s) for s in seqs.tolist()}) == n_seeds
    # two seeds agree on a position only by chance (1/vocab)
    agree = np.mean([(seqs[i] == seqs[j]).mean() for i in range(n_seeds) for j in range(i + 1, n_seeds)])
    assert agree < 0.01
    # within one sequence the positions give varied tokens
    assert all(len(set(s)) > steps // 2 for s in seqs.tolist())


# ---------------------------------------------------------------------------------------------------------
# (e) mixed per-request parameters in one batch
# ---------------------------------------------------------------------------------------------------------
def test_mixed_parameters_in_one_batch_are_each_honoured(rng):
    vocab = 64
    sampler = Sampler(vocab, CPU, use_kernels=False)
    kinds = [  # (name, temperature, top_k, top_p)
        ("greedy", 0.0, 7, 0.3),
        ("top_k_1", 1.5, 1, 1.0),
        ("top_k_5", 1.0, 5, 1.0),
        ("top_p_0.6", 0.8, -1, 0.6),
        ("top_k_10_top_p_0.7", 1.2, 10, 0.7),
        ("free", 1.0, -1, 1.0),
    ]
    reps = 400
    names, temps, ks, ps, logits, allowed = [], [], [], [], [], []
    for _ in range(reps):
        for name, t, k, p in kinds:
            if name == "greedy":
                row = (rng.standard_normal(vocab) * 2).astype(np.float32)
                mask = np.zeros(vocab, bool)
                mask[np.argmax(row)] = True
            else:
                row, mask = clear_logits(rng, vocab, t, k, p)
            names.append(name)
            temps.append(t)
            ks.append(k)
            ps.append(p)
            logits.append(row)
            allowed.append(mask)
    names, logits, allowed = np.array(names), np.stack(logits), np.stack(allowed)
    n = len(names)
    perm = rng.permutation(n)  # interleave the kinds arbitrarily
    names, logits, allowed = names[perm], logits[perm], allowed[perm]
    batch = make_batch(np.array(temps)[perm], np.array(ks)[perm], np.array(ps)[perm],
                       rng.integers(0, 2**40, n), rng.integers(1, 10**5, n))
    tokens = draw(sampler, logits, batch)
    ok = allowed[np.arange(n), tokens]
    for name, *_ in kinds:
        rows = names == name
        assert ok[rows].all(), f"{name}: {(~ok[rows]).sum()} of {rows.sum()} draws outside the allowed set"
    argmax = logits.argmax(1)
    for name in ("greedy", "top_k_1"):
        assert (tokens[names == name] == argmax[names == name]).all()
    for name in ("top_k_5", "top_p_0.6", "top_k_10_top_p_0.7", "free"):
        assert (tokens[names == name] != argmax[names == name]).mean() > 0.05, name


# ---------------------------------------------------------------------------------------------------------
# (f) the empirical distribution matches softmax
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("temperature", "top_k"),
    [(1.0, -1), (0.5, 4), (2.0, -1)],
)
def test_empirical_distribution_matches_softmax(temperature, top_k):
    logits = np.array([1.0, 0.2, -0.5, 2.0, 0.0, -1.5, 1.3, -0.2, 0.7, -3.0], np.float32)
    vocab, n = len(logits), 20_000
    expected = softmax64(logits, temperature)
    if top_k > 0:  # renormalised over the top-k, zero elsewhere
        cut = np.sort(expected)[-top_k]
        expected = np.where(expected >= cut, expected, 0.0)
        expected /= expected.sum()
    sampler = Sampler(vocab, CPU, use_kernels=False)
    # one request seed, 20k consecutive positions: what a long generation sees
    batch = make_batch(temperature, top_k, 1.0, 42, np.arange(1, n + 1))
    counts = np.bincount(draw(sampler, np.tile(logits, (n, 1)), batch), minlength=vocab)
    assert counts[expected == 0].sum() == 0
    live = expected > 0
    exp_counts = expected[live] * n
    chi2 = float(((counts[live] - exp_counts) ** 2 / exp_counts).sum())
    assert chi2 < chi2_critical(int(live.sum()) - 1), (chi2, counts, exp_counts.round())
    sigma = np.sqrt(n * expected[live] * (1 - expected[live]))
    assert (np.abs(counts[live] - exp_counts) < 5 * sigma + 1).all()


# ---------------------------------------------------------------------------------------------------------
# (g) counter_uniform
# ---------------------------------------------------------------------------------------------------------
def test_counter_uniform_is_inside_0_1_and_uniform(rng):
    rows, vocab = 512, 2048
    seeds = torch.from_numpy(rng.integers(0, 2**62, rows))
    positions = torch.from_numpy(rng.integers(0, 10**7, rows))
    u = counter_uniform(seeds, positions, vocab)
    assert u.shape == (rows, vocab)
    u64 = u.double().numpy()
    assert (u64 > 0).all() and (u64 < 1).all()
    assert abs(u64.mean() - 0.5) < 0.005
    assert abs(u64.var() - 1 / 12) < 0.002
    bins = 32
    counts = np.bincount(np.minimum((u64 * bins).astype(int), bins - 1).ravel(), minlength=bins)
    exp = u64.size / bins
    assert ((counts - exp) ** 2 / exp).sum() < chi2_critical(bins - 1)
    # neighbouring tokens / positions / seeds are not correlated
    assert abs(np.corrcoef(u64[:, :-1].ravel(), u64[:, 1:].ravel())[0, 1]) < 0.01


def test_counter_uniform_is_a_pure_function_of_seed_position_token(rng):
    seeds = torch.tensor([0, 1, 0, 7, 2**50], dtype=torch.int64)
    positions = torch.tensor([5, 5, 6, 5, 5], dtype=torch.int64)
    a = counter_uniform(seeds, positions, 300)
    np.testing.assert_array_equal(a.numpy(), counter_uniform(seeds, positions, 300).numpy())
    # a token's value does not depend on the vocabulary size nor on the other rows
    np.testing.assert_array_equal(a[:, :100].numpy(), counter_uniform(seeds, positions, 100).numpy())
    np.testing.assert_array_equal(a[3:4].numpy(), counter_uniform(seeds[3:4], positions[3:4], 300).numpy())
    # changing the seed or the position changes the stream
    for i in range(1, 5):
        assert (a[0] != a[i]).float().mean() > 0.99


def test_counter_uniform_strictly_below_one_at_the_largest_value():
    """(seed 1, position 7, token 288228) is where the 23-bit integer is 2**23 - 1 (found by brute-force
    search): (2**23 - 1 + 0.5) / 2**23 is exact in float32 and below 1, so -log(u) stays positive."""
    u = counter_uniform(torch.tensor([1]), torch.tensor([7]), 288229)
    assert u[0, 288228].item() == (2**23 - 0.5) / 2**23 < 1.0


def test_zero_probability_token_is_never_drawn_even_under_extreme_noise():
    """At (seed 1, position 7) token 4 of a vocabulary laid over token 288228 gets the largest noise draw; it
    must still not be chosen when top-k, top-p or a near-zero temperature give it probability 0."""
    vocab = 288229
    logits = np.full(vocab, -80.0, np.float32)
    logits[:8] = [5.0, 4.0, 3.0, 2.0, -50.0, 1.0, 0.0, -1.0]
    logits[[4, 288228]] = logits[[288228, 4]]  # the weak token sits where the noise is largest
    sampler = Sampler(vocab, CPU, use_kernels=False)
    cases = [(1.0, 2, 1.0), (1e-5, -1, 1.0), (1.0, -1, 0.5), (1.0, 3, 0.9)]
    temps, ks, ps = zip(*cases)
    n = len(cases)
    batch = make_batch(np.array(temps), np.array(ks), np.array(ps), np.full(n, 1), np.full(n, 7))
    tokens = draw(sampler, np.tile(logits, (n, 1)), batch)
    bad = []
    for (t, k, p), tok in zip(cases, tokens):
        mask, _ = reference_keep(softmax64(logits, t), k, p)
        if not mask[tok]:
            bad.append(f"T={t} top_k={k} top_p={p} drew token {tok}, outside {np.flatnonzero(mask).tolist()}")
    assert not bad, "; ".join(bad)


# ---------------------------------------------------------------------------------------------------------
# kept_tokens against a float64 reference; the Triton kernels against the torch reference
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["top_k", "top_p", "both"])
def test_kept_tokens_match_float64_reference(rng, mode):
    vocab, n = 32, 1500
    logits_list, ks, ps, masks = [], [], [], []
    while len(logits_list) < n:
        logits = (rng.standard_normal(vocab) * rng.uniform(0.5, 3.0)).astype(np.float32)
        k = int(rng.integers(1, vocab + 1)) if mode != "top_p" else vocab
        p = float(np.float32(rng.uniform(0.05, 1.0))) if mode != "top_k" else 1.0
        mask, clear = reference_keep(softmax64(logits, 1.0), k, p)
        if clear:
            logits_list.append(logits)
            ks.append(k if k < vocab else 0)
            ps.append(p)
            masks.append(mask)
    x = torch.from_numpy(np.stack(logits_list))
    top_k = torch.tensor(ks, dtype=torch.int64)
    thresholds = top_k_thresholds(x, top_k, int(top_k.max())) if mode != "top_p" else None
    top_p = torch.tensor(ps, dtype=torch.float32) if mode != "top_k" else None
    kept = kept_tokens(x, torch.ones(n), thresholds, top_p).numpy()
    masks = np.stack(masks)
    np.testing.assert_array_equal(kept, masks)
    assert masks.sum(1).min() >= 1 and (masks.sum(1) > 1).mean() > 0.5


def test_kept_tokens_without_filters_keep_everything_and_ties_stay_together():
    x = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0]])
    assert kept_tokens(x, torch.ones(2), None, None).all()
    # the two tied leaders hold most of the mass: a top_p below one of them still keeps both
    kept = kept_tokens(x, torch.ones(2), None, torch.tensor([0.1, 0.1]))
    assert kept.tolist() == [[False, True, True, False], [True, True, True, True]]


def test_triton_kernels_draw_what_the_torch_reference_draws(monkeypatch):
    """The GPU kernels, run by Triton's interpreter on CPU, against ``sample_torch`` on the same float32
    logits: greedy, temperature, top-k, top-p and both, over several vocab blocks (the top-p walk included)."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from runtime.engine import gumbel

    gen = torch.Generator().manual_seed(0)
    rows, vocab = 12, 9000  # three blocks of 4096
    x = torch.randn(rows, vocab, generator=gen) * 2
    temps = torch.tensor([0, 0.5, 1, 1, 1.3, 0.7, 1, 1, 1, 2, 0.9, 1.0])
    top_k = torch.tensor([0, 0, 5, 0, 50, 0, 0, 3, 0, 100, 0, 1])
    top_p = torch.tensor([1, 1, 1, 0.9, 1, 0.5, 0.99, 0.8, 0.3, 0.95, 1, 1.0])
    seeds = torch.arange(rows, dtype=torch.int64) * 1234567891011
    positions = torch.arange(rows, dtype=torch.int64) + 77
    max_k = int(top_k.max())
    reference = sample_torch(x, SamplingArgs(temps, top_p, top_k, max_k, seeds, positions))
    tokens = gumbel.sample(x, temps, top_k_thresholds(x, top_k, max_k), top_p, seeds, positions)
    assert tokens.tolist() == reference.tolist()
    assert len(set(tokens.tolist())) > 8  # really different draws, not one token


def test_triton_top_p_walk_ends_on_rows_of_nan_or_infinite_logits(monkeypatch):
    """A row of NaN logits (an overflowing model) once kept the top-p walk looping forever, hanging the server.
    Every row must come back with a token inside the vocabulary; NaN logits are never drawn."""
    pytest.importorskip("triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    import threading

    from runtime.engine import gumbel

    gen = torch.Generator().manual_seed(1)
    rows, vocab = 4, 5000
    x = torch.randn(rows, vocab, generator=gen)
    x[0] = float("nan")
    x[1, 7] = float("nan")
    x[2, 11] = float("inf")
    x[3] = float("-inf")
    temps = torch.ones(rows)
    top_p = torch.full((rows,), 0.9)
    seeds, positions = torch.arange(rows, dtype=torch.int64), torch.arange(rows, dtype=torch.int64)
    no_top_k = torch.full((rows,), float("-inf"))
    result: list[torch.Tensor] = []
    worker = threading.Thread(
        target=lambda: result.append(gumbel.sample(x, temps, no_top_k, top_p, seeds, positions)), daemon=True)
    worker.start()
    worker.join(timeout=120)
    assert result, "the top-p walk did not end"
    tokens = result[0].tolist()
    assert all(0 <= t < vocab for t in tokens)
    assert tokens[2] == 11  # the infinite logit holds all the mass
    finite = x[1:2].nan_to_num(nan=float("-inf"))
    reference = sample_torch(finite, SamplingArgs(temps[1:2], top_p[1:2], None, 0, seeds[1:2], positions[1:2]))
    assert tokens[1] == reference.item() != 7
