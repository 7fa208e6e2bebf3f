"""Pearson chi-square helpers for the tests that compare sampled outputs with an exact distribution
(tests/test_speculative.py on the CPU, tests/gpu/test_speculative_gpu.py on the GPU)."""
from __future__ import annotations

import math


def chi2_critical(dof: int, z: float = 3.719) -> float:
    """The chi-square quantile at 1 - 1e-4 (z = that normal quantile), by Wilson-Hilferty."""
    a = 2.0 / (9.0 * dof)
    return dof * (1.0 - a + z * math.sqrt(a)) ** 3


def chi2_statistic(counts: dict, probs: dict, n: int) -> tuple[float, int]:
    """Pearson's statistic over the cells, cells expected below 5 pooled into one; (statistic, dof)."""
    big = [c for c in probs if probs[c] * n >= 5]
    small = [c for c in probs if probs[c] * n < 5]
    stat = sum((counts.get(c, 0) - probs[c] * n) ** 2 / (probs[c] * n) for c in big)
    cells = len(big)
    if small:
        e = sum(probs[c] for c in small) * n
        o = sum(counts.get(c, 0) for c in small)
        stat += (o - e) ** 2 / e
        cells += 1
    stray = sum(v for c, v in counts.items() if c not in probs)  # a sequence the target can never produce
    assert stray == 0, f"{stray} outputs the target gives probability 0"
    return stat, cells - 1


def assert_split_fits(joint: dict, cut: int, head_counts: dict, tail_counts: dict, n: int,
                      names: tuple[str, str]) -> None:
    """Split every sequence of the exact joint distribution at `cut` and check the sampled counts of
    both parts (tuples of token ids) with the chi-square test at the 1 - 1e-4 quantile."""
    head, tail = {}, {}
    for seq, p in joint.items():
        head[seq[:cut]] = head.get(seq[:cut], 0.0) + p
        tail[seq[cut:]] = tail.get(seq[cut:], 0.0) + p
    for name, counts, probs in ((names[0], head_counts, head), (names[1], tail_counts, tail)):
        stat, dof = chi2_statistic(counts, probs, n)
        print(f"{name}: chi2 {stat:.1f} on {dof} dof (critical {chi2_critical(dof):.1f})")
        assert stat < chi2_critical(dof), f"{name}: chi2 {stat:.1f} > {chi2_critical(dof):.1f} on {dof} dof"
