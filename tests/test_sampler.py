"""The numpy sampling rule (tileinfer.runner.sampler), on the CPU: min-p and the penalties.

sampler is the specification the GPU kernels are tested against (tests/gpu/test_sampling.py),
so its own semantics are pinned here: min_p = 0 is the rule as it was before min-p existed,
min-p keeps exactly the tokens whose probability is >= min_p * the largest (boundary included),
it applies after temperature and before top-k and top-p, and the penalties follow vLLM's
arithmetic on hand-computed rows.
"""
from __future__ import annotations

import zlib

import numpy as np
import pytest

from tileinfer.runner import sampler

F32 = np.float32


def seed_of(*parts) -> int:
    return zlib.crc32(repr(parts).encode())


def old_kept_mask(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The rule before min-p (verbatim): top-k, then top-p within the top-k set."""
    z = sampler.scaled(logits, temperature)
    keep = np.ones(z.shape, bool)
    if 0 < top_k < z.size:
        keep &= z >= np.sort(z)[::-1][top_k - 1]
    if top_p < 1.0:
        candidates = z[keep]
        order = np.argsort(-candidates, kind="stable")
        sorted_z = candidates[order]
        cum = np.cumsum(np.exp((sorted_z - sorted_z[0]).astype(np.float64)))
        idx = int(np.searchsorted(cum, top_p * cum[-1]))
        keep &= z >= sorted_z[min(idx, sorted_z.size - 1)]
    return keep


def log_probs(z: np.ndarray) -> np.ndarray:
    """log softmax(z) - its maximum, in float64: log(p_i / p_max)."""
    z64 = z.astype(np.float64)
    return z64 - z64.max()


# ============================================================================= min-p


@pytest.mark.parametrize("min_p", [0.0, -0.5], ids=["zero", "negative"])
def test_min_p_off_is_the_old_rule(min_p):
    rng = np.random.default_rng(seed_of("min_p off", min_p))
    combos = [(0.7, 0, 1.0), (1.0, 50, 1.0), (1.0, 0, 0.9), (1.3, 20, 0.8), (0.5, 1, 0.5), (2.0, 999, 0.99)]
    for r in range(60):
        temperature, top_k, top_p = combos[r % len(combos)]
        logits = rng.standard_normal(1000, dtype=F32) * F32(rng.uniform(0.5, 4))
        want = old_kept_mask(logits, temperature, top_k, top_p)
        got = sampler.kept_mask(logits, temperature, top_k, top_p, min_p=min_p)
        assert np.array_equal(got, want), (r, temperature, top_k, top_p, np.nonzero(got != want)[0][:10])
        seed, counter = int(rng.integers(0, 2**63)), int(rng.integers(0, 2**31))
        idx = np.nonzero(want)[0]
        g = -np.log(-np.log(sampler.uniform01(seed, counter, idx.astype(np.uint64))))
        old_choice = int(idx[np.argmax(sampler.scaled(logits, temperature)[idx] + g)])
        assert sampler.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              seed=seed, counter=counter) == old_choice, r
        # and the default is "off"
        assert sampler.sample(logits, temperature=temperature, top_k=top_k, top_p=top_p,
                              seed=seed, counter=counter) == old_choice, r


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
@pytest.mark.parametrize("min_p", [0.01, 0.1, 0.5, 0.9])
def test_min_p_keeps_probabilities_above_min_p_times_the_largest(min_p, temperature):
    # Against the definition p_i >= min_p * p_max in float64, away from the boundary (|margin| > 1e-5,
    # where float32 z and the float32 log(min_p) may round either way).
    rng = np.random.default_rng(seed_of("min_p ratio", min_p, temperature))
    for _ in range(20):
        logits = rng.standard_normal(4097, dtype=F32) * F32(2)
        keep = sampler.kept_mask(logits, temperature, 0, 1.0, min_p=min_p)
        margin = log_probs(sampler.scaled(logits, temperature)) - np.log(min_p)
        clear = np.abs(margin) > 1e-5
        assert np.array_equal(keep[clear], margin[clear] >= 0), (min_p, temperature)
        assert keep[np.argmax(logits)], "the most likely token is always kept"


def test_min_p_hand_example():
    # Probabilities proportional to 1, 0.5, 0.25, 0.125, 0.0625 (z = log of them, T = 1).
    logits = np.log(np.array([0.25, 1.0, 0.0625, 0.5, 0.125])).astype(F32)
    expect = {0.1: [0, 1, 3, 4], 0.2: [0, 1, 3], 0.3: [1, 3], 0.6: [1], 1.0: [1]}
    for min_p, kept in expect.items():
        assert np.nonzero(sampler.kept_mask(logits, 1.0, 0, 1.0, min_p=min_p))[0].tolist() == kept, min_p
    # Temperature first: at T = 2 the ratios are square roots (1, 0.71, 0.5, 0.35, 0.25).
    assert np.nonzero(sampler.kept_mask(logits, 2.0, 0, 1.0, min_p=0.3))[0].tolist() == [0, 1, 3, 4]
    assert np.nonzero(sampler.kept_mask(logits, 2.0, 0, 1.0, min_p=0.6))[0].tolist() == [1, 3]


def test_min_p_boundary_is_inclusive_and_exact():
    # A token exactly at the cut zmax + float32(log(min_p)) is kept; the next float below is not.
    rng = np.random.default_rng(seed_of("min_p boundary"))
    for min_p in (0.05, 0.3, 0.77):
        logits = rng.standard_normal(1000, dtype=F32)
        cut = sampler.min_p_cut(logits.max(), min_p)
        assert cut.dtype == F32 and cut == F32(logits.max()) + F32(np.log(min_p))
        logits[10], logits[11] = cut, np.nextafter(cut, F32(-np.inf))
        keep = sampler.kept_mask(logits, 1.0, 0, 1.0, min_p=min_p)
        assert keep[10] and not keep[11], min_p
        assert np.array_equal(keep, logits >= cut), min_p


def test_min_p_one_keeps_only_the_maximum_and_its_ties():
    rng = np.random.default_rng(seed_of("min_p one"))
    logits = rng.standard_normal(1000, dtype=F32)
    for min_p in (1.0, 3.0):  # above 1 acts as 1
        assert np.nonzero(sampler.kept_mask(logits, 0.8, 0, 1.0, min_p=min_p))[0].tolist() == [int(np.argmax(logits))]
    logits[[3, 700]] = logits.max() + 1
    assert np.nonzero(sampler.kept_mask(logits, 0.8, 0, 1.0, min_p=1.0))[0].tolist() == [3, 700]
    choices = {sampler.sample(logits, temperature=0.8, min_p=1.0, seed=s, counter=1) for s in range(64)}
    assert choices == {3, 700}, choices


def test_top_k_and_top_p_apply_within_the_min_p_set():
    # Probabilities proportional to 8, 4, 2, 1, 1, 1, 1, 1, 1 (log z, T = 1).
    logits = np.log(np.array([8, 4, 2, 1, 1, 1, 1, 1, 1], np.float64)).astype(F32)
    # min_p 0.2 keeps {8, 4, 2} (ratios 1, 0.5, 0.25); top_k = 5 then changes nothing.
    assert np.nonzero(sampler.kept_mask(logits, 1.0, 5, 1.0, min_p=0.2))[0].tolist() == [0, 1, 2]
    assert np.nonzero(sampler.kept_mask(logits, 1.0, 2, 1.0, min_p=0.2))[0].tolist() == [0, 1]
    # top_p = 0.8: over the min-p set (mass 14) {8, 4} holds 12/14 = 0.86 >= 0.8. Over everything
    # (mass 20) {8, 4} holds only 0.6 and {8, 4, 2} 0.7, so without min-p it keeps all nine.
    assert np.nonzero(sampler.kept_mask(logits, 1.0, 0, 0.8, min_p=0.2))[0].tolist() == [0, 1]
    assert sampler.kept_mask(logits, 1.0, 0, 0.8).all()
    # top_p = 0.5 over {8, 4, 2}: {8} holds 8/14 = 0.57 >= 0.5.
    assert np.nonzero(sampler.kept_mask(logits, 1.0, 0, 0.5, min_p=0.2))[0].tolist() == [0]


def test_greedy_ignores_min_p():
    rng = np.random.default_rng(seed_of("greedy min_p"))
    logits = rng.standard_normal(1000, dtype=F32)
    for min_p in (0.0, 0.5, 1.0):
        assert sampler.sample(logits, temperature=0.0, min_p=min_p, top_k=3, seed=7) == int(np.argmax(logits))


def test_min_p_samples_follow_the_renormalised_softmax():
    # 20,000 draws (distinct counters): frequencies of the min-p set {p >= 0.3 p_max} match the renormalised
    # softmax within 4.5 standard deviations (binomial), and nothing outside the set is ever drawn.
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], F32)
    n, min_p = 20000, 0.3
    draws = np.array([sampler.sample(logits, temperature=1.0, min_p=min_p, seed=12345, counter=c) for c in range(n)])
    p = np.exp(logits.astype(np.float64) - logits.max())
    support = p >= min_p
    assert np.nonzero(support)[0].tolist() == [0, 1, 6]
    counts = np.bincount(draws, minlength=logits.size)
    assert counts[~support].sum() == 0, counts
    q = p[support] / p[support].sum()
    sd = np.sqrt(n * q * (1 - q))
    assert np.all(np.abs(counts[support] - n * q) <= 4.5 * sd), (counts[support], n * q, sd)


# ============================================================================= penalties


def test_penalties_hand_example():
    row = np.array([2.0, -1.0, 0.5, 3.0, -2.0, 0.0], F32)
    # token: 0 prompt only, 1 output twice, 3 output once, 4 prompt only, 5 (logit 0) output once; 2 untouched.
    got = sampler.apply_penalties(row, [0, 1, 3, 4, 5], [0, 2, 1, 0, 1], repetition=2.0, presence=0.5, frequency=0.25)
    # rep: 2 -> 1, -1 -> -2, 3 -> 1.5, -2 -> -4, 0 -> 0 * 2 = 0; then - (0.25 * count + 0.5 if count > 0)
    want = np.array([1.0, -2.0 - 1.0, 0.5, 1.5 - 0.75, -4.0, 0.0 - 0.75], F32)
    assert got.dtype == F32 and np.array_equal(got, want), got
    assert np.array_equal(row, [2.0, -1.0, 0.5, 3.0, -2.0, 0.0]), "the input row must not change"


def test_logit_bias_comes_first_and_only_biased_tokens_skip_the_penalties():
    row = np.array([2.0, -1.0, 0.5, -0.0, 1.0, 4.0], F32)
    # 0 output once, biased +2: (2 + 2) / 2 - (0.25 + 0.5); 1 only biased (count -2): -1 - 3, no repetition;
    # 2 prompt only, bias 0: 0.5 / 2; 3 only biased by 0 (-0 stays -0); 4 banned though biased; 5 untouched.
    got = sampler.apply_penalties(row, [0, 1, 2, 3, 4], [1, -2, 0, -2, -1], repetition=2.0, presence=0.5,
                                  frequency=0.25, biases=[2.0, -3.0, 0.0, 0.0, 50.0])
    want = np.array([2.0 - 0.75, -4.0, 0.25, -0.0, -np.inf, 4.0], F32)
    assert np.array_equal(got, want) and np.signbit(got[3]), got
    with pytest.raises(ValueError, match="equal-length"):
        sampler.apply_penalties(row, [0, 1], [0, 0], 1.0, 0.0, 0.0, biases=[1.0])


def test_penalties_repetition_below_one_and_off():
    row = np.array([4.0, -4.0, 1.0], F32)
    got = sampler.apply_penalties(row, [0, 1], [0, 0], repetition=0.5, presence=9.0, frequency=9.0)
    assert np.array_equal(got, np.array([8.0, -2.0, 1.0], F32)), got  # prompt only: no presence/frequency
    got = sampler.apply_penalties(row, [0, 1, 2], [3, 0, 1], repetition=1.0, presence=-0.5, frequency=0.5)
    assert np.array_equal(got, np.array([3.0, -4.0, 1.0], F32)), got  # 4 - (1.5 - 0.5); -4; 1 - (0.5 - 0.5)
    assert np.array_equal(sampler.apply_penalties(row, [], [], 1.3, 0.2, 0.1), row)


def test_penalties_round_in_float32():
    # 1 / 1.1 is not representable: the result is float32 division, then float32 subtraction.
    row = np.array([1.0, -3.0], F32)
    got = sampler.apply_penalties(row, [0, 1], [1, 7], repetition=1.1, presence=0.1, frequency=0.3)
    pen0 = F32(0.3) * F32(1) + F32(0.1)
    pen1 = F32(0.3) * F32(7) + F32(0.1)
    want = np.array([F32(1.0) / F32(1.1) - pen0, F32(-3.0) * F32(1.1) - pen1], F32)
    assert np.array_equal(got, want), (got, want)


def test_penalties_skip_ids_outside_the_vocabulary_and_reject_duplicates():
    row = np.arange(4, dtype=F32)
    got = sampler.apply_penalties(row, [-1, 3, 4], [1, 1, 1], repetition=1.0, presence=1.0, frequency=0.0)
    assert np.array_equal(got, [0.0, 1.0, 2.0, 2.0]), got
    with pytest.raises(ValueError, match="distinct"):
        sampler.apply_penalties(row, [1, 1], [0, 0], 1.2, 0.0, 0.0)
    with pytest.raises(ValueError):
        sampler.apply_penalties(row, [1, 2], [0], 1.2, 0.0, 0.0)


def test_a_negative_count_bans_its_token():
    row = np.array([2.0, -1.0, 5.0, 0.5], np.float32)
    got = sampler.apply_penalties(row, [2, 1], [-1, 1], repetition=2.0, presence=0.5, frequency=0.25)
    assert np.isneginf(got[2]) and got[1] == np.float32(-1.0 * 2.0 - 0.75) and int(np.argmax(got)) == 0
