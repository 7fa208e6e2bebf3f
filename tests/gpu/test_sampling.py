"""min-p sampling and the penalties it applies first (cuda_src/sampling.cu) against tileinfer.runner.sampler.

Conventions as in test_kernels.py: every case draws fresh random inputs from
np.random.default_rng(<seed fixed per case>) at awkward vocabulary sizes, outputs are poisoned
first (0xFF bytes: int32 -1), and each tolerance is stated next to its assertion.

What is exact and what is not:
  * The min-p cut, z_max + float32(log(min_p)), is bit-identical in the kernel and the mirror, so a
    token at the cut is kept and the next float below it is not (test_min_p_cut_is_exact puts the
    token with the largest Gumbel noise right there, so a wrong cut changes the sample).
  * The sample is the mirror's exactly, with two excuses that rounding alone explains: the two best
    perturbed scores z_i + g_i within 1e-5 (logf and numpy's log differ by an ulp or so), or top-p's
    boundary moved by one value where float32 mass sums cannot tell (margin <= 2e-5 of the mass: a
    thread's serial float32 sum of <= 149 terms errs by <= 149 * 2^-24 ~ 9e-6, the tree adds ~6e-7).
  * sample(penalties=) rounds each penalty operation on its own, as numpy does: every element bit-exact.
"""
from __future__ import annotations


import numpy as np
import pytest

from tileinfer.cuda import DeviceArray
from tileinfer.runner import sampler
from tileinfer.kernels import sample

from gpu_helpers import Buffers, seed_of  # noqa: E402

pytestmark = pytest.mark.gpu

F32 = np.dtype(np.float32)
I32 = np.dtype(np.int32)


# ============================================================================= helpers


def launch_sample(buf: Buffers, stream, logits: np.ndarray, params: list[tuple], seeds, counters) -> np.ndarray:
    """Sample every row; params[r] = (temperature, top_k, top_p, min_p). # [rows] int32"""
    rows, vocab = logits.shape
    out = buf.poisoned((rows,), I32)

    def column(j: int, dtype) -> DeviceArray:
        return buf.upload(np.array([p[j] for p in params], dtype))

    sample(buf.upload(logits), column(0, np.float32), column(1, np.int32), column(2, np.float32),
           column(3, np.float32), buf.upload(np.asarray(seeds, np.uint64)), buf.upload(np.asarray(counters, np.int32)),
           out, stream)
    got = out.to_host(stream)
    bad = (got < 0) | (got >= vocab)
    assert not bad.any(), (f"sample: {int(bad.sum())} of {rows} rows out of [0, {vocab}) (-1 = never written); "
                           f"first row {int(np.argmax(bad))}: {got[bad][0]}")
    return got


def perturbed(z: np.ndarray, i: int, seed: int, counter: int) -> float:
    """z_i + g_i in float64, from the very uniform the kernel draws."""
    u = float(sampler.uniform01(seed, counter, np.array([i], np.uint64))[0])
    return float(z[i]) - np.log(-np.log(u))


def top_p_alternatives(logits, temperature, top_k, top_p, min_p) -> list[tuple[np.ndarray, float]]:
    """Kept sets with top-p's threshold one distinct value lower or higher than the mirror's, where the
    float64 mass margin at the boundary is <= 2e-5 of the kept mass (float32 sums may decide either way)."""
    if top_p >= 1.0:
        return []
    z = sampler.scaled(logits, temperature)
    base = sampler.kept_mask(logits, temperature, top_k, 1.0, min_p=min_p)  # min-p and top-k only
    values, counts = np.unique(z[base], return_counts=True)
    values, counts = values[::-1], counts[::-1]  # distinct kept values, descending
    mass = np.cumsum(counts * np.exp(values.astype(np.float64) - float(values[0])))  # mass of z >= values[j]
    target = top_p * mass[-1]
    j = int(np.searchsorted(mass, target))
    out = []
    if j + 1 < values.size and mass[j] - target <= 2e-5 * mass[-1]:
        out.append((base & (z >= values[j + 1]), float((mass[j] - target) / mass[-1])))
    if j > 0 and target - mass[j - 1] <= 2e-5 * mass[-1]:
        out.append((base & (z >= values[j - 1]), float((target - mass[j - 1]) / mass[-1])))
    return out


def rounding_excuse(logits, params, seed, counter, got: int, want: int) -> str | None:
    """Why a kernel choice other than the mirror's is still right, or None (see the module docstring)."""
    temperature, top_k, top_p, min_p = params
    z = sampler.scaled(logits, temperature)
    keep = sampler.kept_mask(logits, temperature, top_k, top_p, min_p=min_p)
    if keep[got]:
        s_got, s_want = perturbed(z, got, seed, counter), perturbed(z, want, seed, counter)
        if abs(s_got - s_want) <= 1e-5 + 1e-6 * abs(s_want):
            return f"near tie of perturbed scores {s_got:.9g} vs {s_want:.9g}"
    for alt, margin in top_p_alternatives(logits, temperature, top_k, top_p, min_p):
        if sampler.gumbel_choice(z, alt, seed, counter) == got:
            return f"top-p boundary moved by one value (mass margin {margin:.2e} of the kept mass)"
    return None


# ============================================================================= min-p sampling

# (temperature, top_k, top_p, min_p) per row, cycled.
COMBOS = [
    (0.0, 0, 1.0, 0.5),     # greedy: min-p ignored
    (1.0, 0, 1.0, 0.0),     # min-p off
    (0.7, 0, 1.0, 0.05),
    (1.0, 0, 1.0, 0.1),
    (1.3, 0, 1.0, 0.3),
    (2.0, 0, 1.0, 1.0),     # only the maximum (and its ties) survive
    (1.0, 50, 1.0, 0.02),   # top-k within the min-p set
    (0.8, 5, 1.0, 0.2),
    (1.0, 0, 0.9, 0.05),    # top-p over the min-p survivors
    (1.2, 40, 0.8, 0.01),   # all three
    (0.9, 0, 0.5, 0.001),
]


@pytest.mark.parametrize("vocab, reps", [(1000, 30), (4097, 12), (151936, 4)],
                         ids=["vocab1000", "vocab4097", "vocab151936"])
def test_min_p_sample_matches_numpy_sampler(vocab, reps, buf, stream):
    rng = np.random.default_rng(seed_of("min_p sample", vocab))
    rows = len(COMBOS) * reps
    params = [COMBOS[r % len(COMBOS)] for r in range(rows)]
    # Per-row scales from 0.5 (flat: min-p keeps many) to 4 (peaked: it keeps few).
    scales = rng.uniform(0.5, 4.0, (rows, 1)).astype(np.float32)
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * scales
    for r in range(rows):
        if params[r][3] == 1.0 and r % 2:
            logits[r, rng.integers(0, vocab)] = logits[r].max()  # a tie at the maximum: both kept
    seeds = rng.integers(0, 2**64, rows, dtype=np.uint64)
    counters = rng.integers(0, 2**31 - 1, rows).astype(np.int32)
    got = launch_sample(buf, stream, logits, params, seeds, counters)

    exact, excused, wrong, kept_sizes = 0, [], [], []
    for r, p in enumerate(params):
        temperature, top_k, top_p, min_p = p
        want = sampler.sample(logits[r], temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p,
                              seed=int(seeds[r]), counter=int(counters[r]))
        if temperature > 0:
            kept_sizes.append(int(sampler.kept_mask(logits[r], temperature, top_k, top_p, min_p=min_p).sum()))
        if int(got[r]) == want:
            exact += 1
            continue
        why = None if temperature <= 0 else rounding_excuse(logits[r], p, int(seeds[r]), int(counters[r]),
                                                             int(got[r]), want)
        (excused if why else wrong).append((r, p, int(got[r]), want, why))
    summary = (f"min-p sample vocab={vocab}: {exact}/{rows} rows exactly the mirror's; kept-set sizes "
               f"{min(kept_sizes)}..{max(kept_sizes)}; excused by rounding {excused}; wrong {wrong}")
    print(summary)
    # Every row is the mirror's choice or excused by rounding alone (greedy rows never), and excuses are rare
    # (<= 2% of rows: they need a near tie or the boundary token of top-p).
    assert not wrong, summary
    assert len(excused) <= max(1, rows // 50), summary


@pytest.mark.parametrize("vocab", [1000, 4097, 151936], ids=lambda v: f"vocab{v}")
def test_min_p_cut_is_exact(vocab, buf, stream):
    # Per row, the token b with the largest Gumbel noise (for that row's seed and counter) is moved exactly
    # onto the cut z_max + log(min_p) ("at": kept), or one float below it ("below": dropped), or, with
    # z_max = -log(min_p), onto -0.0 while the cut is +0.0 ("negzero": kept, as -0.0 >= +0.0). b then
    # usually decides the sample, so a cut off by one ulp (or -0 vs +0 keys) shows as a wrong token.
    # Temperatures are powers of two so that logits[b] = z_b * T lands on z_b exactly.
    rng = np.random.default_rng(seed_of("min_p cut", vocab))
    cases = [(t, mp, mode) for t in (0.5, 1.0, 2.0) for mp in (0.02, 0.1, 0.37, 0.9, 1.0) for mode in ("at", "below")]
    cases += [(1.0, 0.5, "negzero"), (2.0, 0.25, "negzero")]
    rows = len(cases)
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(2)
    seeds = rng.integers(0, 2**64, rows, dtype=np.uint64)
    counters = rng.integers(0, 2**31 - 1, rows).astype(np.int32)
    boundary = []
    for r, (temperature, min_p, mode) in enumerate(cases):
        u = sampler.uniform01(int(seeds[r]), int(counters[r]), np.arange(vocab, dtype=np.uint64))
        noise = -np.log(-np.log(u))
        T = np.float32(temperature)
        if mode == "negzero":
            logits[r] *= np.float32(0.01)  # everything well below z_max
            top = int(np.argmax(logits[r]))
            logits[r, top] = -sampler.min_p_cut(np.float32(0), min_p) * T  # z_max = -log(min_p): the cut is +0.0
            noise[top] = -np.inf
            b = int(np.argmax(noise))
            logits[r, b] = np.float32(-0.0)
            assert sampler.min_p_cut(sampler.scaled(logits[r], temperature).max(), min_p) == 0, "test setup"
        else:
            noise[np.argmax(logits[r])] = -np.inf
            b = int(np.argmax(noise))
            cut = sampler.min_p_cut(sampler.scaled(logits[r], temperature).max(), min_p)
            z_b = cut if mode == "at" else np.nextafter(cut, np.float32(-np.inf))
            logits[r, b] = z_b * T
            assert sampler.scaled(logits[r], temperature)[b] == z_b, "test setup: z_b must be exact"
        boundary.append(b)
    params = [(t, 0, 1.0, mp) for t, mp, _ in cases]
    got = launch_sample(buf, stream, logits, params, seeds, counters)

    decisive, wrong = 0, []
    for r, (temperature, min_p, mode) in enumerate(cases):
        b, seed, counter = boundary[r], int(seeds[r]), int(counters[r])
        z = sampler.scaled(logits[r], temperature)
        keep = sampler.kept_mask(logits[r], temperature, 0, 1.0, min_p=min_p)
        assert keep[b] == (mode != "below"), f"row {r} {cases[r]}: the mirror's cut is off (test bug)"
        want = sampler.gumbel_choice(z, keep, seed, counter)
        flipped = keep.copy()
        flipped[b] = not keep[b]
        decisive += sampler.gumbel_choice(z, flipped, seed, counter) != want  # b's membership changes the sample
        if int(got[r]) == want:
            continue
        # Only the near-tie excuse, and never for a dropped token (membership must be exact).
        why = rounding_excuse(logits[r], params[r], seed, counter, int(got[r]), want) if keep[got[r]] else None
        if why is None:
            wrong.append((r, cases[r], int(got[r]), want, b, why))
    summary = (f"min-p cut vocab={vocab}: {rows - len(wrong)}/{rows} rows right; b's membership decides the "
               f"sample in {decisive}/{rows} rows; wrong {wrong}")
    print(summary)
    assert not wrong, summary
    assert decisive >= rows // 2, f"{summary} (test design: too few rows where the cut matters)"


def test_min_p_sample_distribution_small_vocab(buf, stream):
    # 20,000 draws from one row of 8 logits (T = 1, min_p = 0.3), each with its own seed and counter: only
    # {p >= 0.3 p_max} = tokens 0, 6, 1 may appear, with counts fitting their renormalised softmax
    # (chi-square, 2 dof, p > 1e-3: a correct sampler fails one time in a thousand, and the seeds are fixed).
    n, min_p = 20000, 0.3
    rng = np.random.default_rng(seed_of("min_p distribution"))
    logits = np.array([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, 1.5, 0.2], np.float32)
    seeds = rng.integers(0, 2**64, n, dtype=np.uint64)
    counters = rng.integers(0, 2**31 - 1, n).astype(np.int32)
    got = launch_sample(buf, stream, np.tile(logits, (n, 1)), [(1.0, 0, 1.0, min_p)] * n, seeds, counters)
    counts = np.bincount(got, minlength=logits.size)
    probs = np.exp(logits.astype(np.float64) - logits.max())
    support = probs >= min_p
    assert np.nonzero(support)[0].tolist() == [0, 1, 6], "test setup"
    assert counts[~support].sum() == 0, f"tokens outside the min-p set drawn: {counts.tolist()}"
    expected = n * probs[support] / probs[support].sum()
    chi2 = float(np.sum((counts[support] - expected) ** 2 / expected))
    p_value = float(np.exp(-chi2 / 2))  # chi-square survival function, 2 dof
    print(f"min-p distribution: counts {counts[support].tolist()} expected {np.round(expected, 1).tolist()} "
          f"chi2 {chi2:.2f} p {p_value:.3g}")
    assert p_value > 1e-3, f"counts {counts.tolist()} do not fit the renormalised softmax: chi2 {chi2:.2f}"


# ============================================================================= penalties


def penalty_rows(rng: np.random.Generator, vocab: int) -> list[dict]:
    """Rows of (repetition, presence, frequency, tokens, counts, biases); some without entries. Half the entries
    carry a logit bias (the rest 0: none), and some rows have tokens that are only biased (count -2)."""
    def entries(n, forced=()):
        tokens = np.array(list(forced), np.int64)
        rest = np.setdiff1d(rng.choice(vocab, min(n, vocab), replace=False), tokens)[:max(n - len(forced), 0)]
        tokens = rng.permutation(np.concatenate([tokens, rest])).astype(np.int32)
        counts = np.where(rng.random(tokens.size) < 0.35, 0, rng.integers(1, 9, tokens.size)).astype(np.int32)
        return tokens, counts

    def row(rep, pres, freq, tc):
        tokens = tc[0]
        biases = np.where(rng.random(tokens.size) < 0.5, rng.uniform(-100, 100, tokens.size), 0).astype(np.float32)
        return dict(repetition=rep, presence=pres, frequency=freq, tokens=tokens, counts=tc[1], biases=biases)

    empty = (np.zeros(0, np.int32), np.zeros(0, np.int32))
    return [
        row(1.3, 0.5, 0.2, empty),                                    # no entries
        row(1.3, 0.5, 0.2, entries(40, forced=(0, vocab - 1))),       # the first and last token
        row(1.5, 1.0, 1.0, empty),                                    # no entries between rows with some
        row(1.0, 0.7, 0.3, entries(25)),                              # repetition off
        row(0.8, -0.4, 0.1, entries(3000)),                           # repetition < 1; > 256 entries (stride)
        row(1.2, 0.5, 0.5, (entries(60)[0], np.zeros(60, np.int32))),  # prompt-only tokens: repetition alone
        row(1.1, 0.25, 0.05, entries(1)),                             # one entry
        row(2.0, 0.0, 0.0, (np.array([5, 6, 7], np.int32), np.array([0, 1, 2], np.int32))),  # zero logits
        row(1.25, 0.3, 0.6, (np.array([-1, vocab, 9], np.int32), np.array([1, 1, 1], np.int32))),  # ids outside
        row(1.2, 0.4, 0.3, (np.array([3, 11, 40, vocab - 2], np.int32), np.array([-1, -1, 2, -1], np.int32))),
                                                                      # bans (min_tokens): -inf, 11 the largest
        row(1.4, 0.5, 0.5, (entries(50)[0], np.full(50, -2, np.int32))),  # tokens only biased: no repetition
        row(1.2, 0.3, 0.2, (np.array([1, 2, 3, 4], np.int32), np.array([-2, 0, -1, 3], np.int32))),  # every kind
        row(1.3, 0.5, 0.2, empty),                                    # the last row without entries
    ]


def assert_bits_equal(got: np.ndarray, want: np.ndarray, label: str) -> None:
    """float32 bit patterns equal; on failure report the count, the first index and the ulp distance."""
    assert got.shape == want.shape, f"{label}: shape {got.shape} != {want.shape}"
    diff = got.view(np.uint32) != want.view(np.uint32)
    if diff.any():
        where = np.argwhere(diff)
        first = tuple(int(i) for i in where[0])
        ulps = np.abs(got.view(np.int32)[diff].astype(np.int64) - want.view(np.int32)[diff].astype(np.int64))
        raise AssertionError(f"{label}: {int(diff.sum())} of {diff.size} elements differ (max {int(ulps.max())} "
                             f"ulp); first at {first}: got {got[first]!r}, expected {want[first]!r}")


def greedy(buf, stream, logits: DeviceArray, penalties) -> np.ndarray:
    """sample() of every row at temperature 0 with `penalties`: the tokens."""
    rows = logits.shape[0]
    out = buf.poisoned((rows,), np.int32)
    sample(logits, buf.upload(np.zeros(rows, np.float32)), buf.upload(np.zeros(rows, np.int32)),
           buf.upload(np.ones(rows, np.float32)), buf.upload(np.zeros(rows, np.float32)),
           buf.upload(np.arange(rows, dtype=np.uint64)), buf.upload(np.zeros(rows, np.int32)), out, stream,
           penalties=penalties)
    return out.to_host(stream)


@pytest.mark.parametrize("vocab", [1000, 4097, 151936], ids=lambda v: f"vocab{v}")
def test_sample_applies_penalties_as_numpy(vocab, buf, stream):
    # sample(penalties=...) applies them in place in the sampling launch itself, then samples (greedy
    # here) from the penalized rows.
    rng = np.random.default_rng(seed_of("penalties", vocab))
    spec = penalty_rows(rng, vocab)
    rows = len(spec)
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(3)  # both signs
    logits[7, [5, 6, 7]] = [0.0, -0.0, 0.0]
    logits[9, 11] = 50.0  # the row's most likely token is banned: greedy must pick another
    offsets = np.concatenate([[0], np.cumsum([s["tokens"].size for s in spec])]).astype(np.int32)
    # Five more valid entries after offsets[rows]: no row owns them, so they must never be applied.
    tokens = np.concatenate([s["tokens"] for s in spec] + [np.arange(5, dtype=np.int32)])
    counts = np.concatenate([s["counts"] for s in spec] + [np.full(5, 3, np.int32)])
    biases = np.concatenate([s["biases"] for s in spec] + [np.full(5, 7, np.float32)])

    def per_row(key: str) -> DeviceArray:
        return buf.upload(np.array([s[key] for s in spec], np.float32))

    dev_logits = buf.upload(logits)
    penalties = (buf.upload(offsets), buf.upload(tokens), buf.upload(counts), buf.upload(biases),
                 per_row("repetition"), per_row("presence"), per_row("frequency"))
    tokens_out = greedy(buf, stream, dev_logits, penalties)
    got = dev_logits.to_host(stream)

    want = np.stack([sampler.apply_penalties(logits[r], s["tokens"], s["counts"], s["repetition"], s["presence"],
                                             s["frequency"], s["biases"]) for r, s in enumerate(spec)])
    changed = int((want.view(np.uint32) != logits.view(np.uint32)).sum())
    print(f"penalties vocab={vocab}: rows {rows}, entries per row {np.diff(offsets).tolist()}, "
          f"{changed} logits changed by the mirror")
    assert changed > int(offsets[-1]) // 2, "test setup: the penalties should change most entries' logits"
    # Exact (0 ulp) everywhere: touched entries round each operation as numpy does, the rest are untouched.
    assert_bits_equal(got, want, f"penalties vocab={vocab}")
    # Greedy from the penalized rows (np.argmax: the lowest index on ties, as the kernel).
    np.testing.assert_array_equal(tokens_out, want.argmax(axis=1))
    assert np.isneginf(got[9, [3, 11, vocab - 2]]).all() and tokens_out[9] != 11


def test_penalties_without_entries_are_a_no_op(buf, stream):
    # offsets all 0 (as a captured graph sees a batch without penalties), with valid ids in the token buffer.
    rng = np.random.default_rng(seed_of("penalties empty"))
    rows, vocab = 7, 4097
    logits = rng.standard_normal((rows, vocab), dtype=np.float32)
    dev_logits = buf.upload(logits)
    tokens = greedy(buf, stream, dev_logits, (
        buf.upload(np.zeros(rows + 1, np.int32)), buf.upload(np.arange(16, dtype=np.int32)),
        buf.upload(np.ones(16, np.int32)), buf.upload(np.full(16, 3.0, np.float32)), buf.upload(np.full(rows, 1.5, np.float32)),
        buf.upload(np.full(rows, 0.5, np.float32)), buf.upload(np.full(rows, 0.5, np.float32))))
    assert_bits_equal(dev_logits.to_host(stream), logits, "penalties with no entries")
    np.testing.assert_array_equal(tokens, logits.argmax(axis=1))


# ============================================================================= argument checks


def sample_args(B):
    """A valid sample() call's arrays for two rows of ten logits (B: the poisoned-buffer factory)."""
    return (B((2, 10), F32), B((2,), F32), B((2,), I32), B((2,), F32), B((2,), F32), B((2,), np.uint64),
            B((2,), I32), B((2,), I32))


def penalty_args(B, *, offsets=3, counts=4, tokens=I32, presence=F32):
    """Penalty arrays for two rows, valid unless an argument says otherwise."""
    return (B((offsets,), I32), B((4,), tokens), B((counts,), I32), B((4,), F32), B((2,), F32), B((2,), presence),
            B((2,), F32))


LAUNCHER_ERRORS = {
    "sample min_p int32": lambda B, s: sample(B((2, 10), F32), B((2,), F32), B((2,), I32), B((2,), F32),
                                              B((2,), I32), B((2,), np.uint64), B((2,), I32), B((2,), I32), s),
    "sample min_p rows": lambda B, s: sample(B((2, 10), F32), B((2,), F32), B((2,), I32), B((2,), F32),
                                             B((3,), F32), B((2,), np.uint64), B((2,), I32), B((2,), I32), s),
    "penalties offsets of rows entries": lambda B, s: sample(*sample_args(B), s, penalties=penalty_args(B, offsets=2)),
    "penalties counts length": lambda B, s: sample(*sample_args(B), s, penalties=penalty_args(B, counts=5)),
    "penalties tokens int64": lambda B, s: sample(*sample_args(B), s, penalties=penalty_args(B, tokens=np.int64)),
    "penalties presence float64": lambda B, s: sample(*sample_args(B), s, penalties=penalty_args(B, presence=np.float64)),
    "penalties six arrays": lambda B, s: sample(*sample_args(B), s, penalties=penalty_args(B)[:6]),
}


@pytest.mark.parametrize("case", list(LAUNCHER_ERRORS))
def test_launcher_rejects_bad_arguments(case, buf, stream):
    # Every case must raise ValueError in the launcher, before anything is launched.
    with pytest.raises(ValueError) as info:
        LAUNCHER_ERRORS[case](buf.poisoned, stream)
    print(f"{case}: {info.value}")


# ============================================================================= structured-output masks


@pytest.mark.parametrize("vocab", [1000, 1028, 4097, 151936], ids=lambda v: f"vocab{v}")
def test_sample_applies_bitmasks_as_numpy(vocab, buf, stream):
    # Rows with a mask keep only its tokens (after any penalties); rows with mask_rows -1 are untouched;
    # greedy and sampled draws both come from the masked rows.
    rng = np.random.default_rng(seed_of("masks", vocab))
    rows, words = 6, (vocab + 31) // 32
    logits = rng.standard_normal((rows, vocab), dtype=np.float32) * np.float32(3)
    bitmasks = rng.integers(-2**31, 2**31, (3, words), dtype=np.int64).astype(np.int32)
    bitmasks[1] = 0
    bitmasks[1, 7 // 32] = 1 << (7 % 32)  # one token allowed: 7
    mask_rows = np.array([0, -1, 1, 2, -1, 0], np.int32)
    want = np.stack([sampler.apply_mask(logits[r], bitmasks[m]) if m >= 0 else logits[r]
                     for r, m in enumerate(mask_rows)])
    dev_logits = buf.upload(logits)
    out = buf.poisoned((rows,), np.int32)
    temperature = np.array([0, 0, 0, 0.8, 1.0, 1.2], np.float32)
    seeds, counters = np.arange(rows, dtype=np.uint64) + 5, np.full(rows, 9, np.int32)
    sample(dev_logits, buf.upload(temperature), buf.upload(np.zeros(rows, np.int32)),
           buf.upload(np.ones(rows, np.float32)), buf.upload(np.zeros(rows, np.float32)), buf.upload(seeds),
           buf.upload(counters), out, stream, masks=(buf.upload(mask_rows), buf.upload(bitmasks)))
    assert_bits_equal(dev_logits.to_host(stream), want, f"masks vocab={vocab}")
    got = out.to_host(stream)
    expected = [sampler.sample(want[r], temperature=float(temperature[r]), top_k=0, top_p=1.0, seed=int(seeds[r]),
                               counter=9) for r in range(rows)]
    np.testing.assert_array_equal(got, expected)
    assert got[2] == 7
