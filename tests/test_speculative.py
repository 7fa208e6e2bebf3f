"""Speculative decoding's verdict (tileinfer.engine.speculative.accept) on the CPU.

Rounds are played as the engine plays them (engine/engine.py `_verify`): the draft proposes k tokens
greedily, the target's k + 1 next-token rows come from a random table indexed by (last token, position
mod 7) over a small vocabulary, and `accept` keeps a prefix plus one token. Its greedy continuations
vary and its distributions are known exactly, so greedy equality and the sampled distribution can be
checked precisely. The engine's own rounds (proposals, rollback, stops, preemption) are tested in
test_llm_speculation.py, and on the reference model in test_cpu_runner.py.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tileinfer.engine.params import SamplingParams
from tileinfer.engine.speculative import accept, distribution

from stats_helpers import assert_split_fits  # noqa: E402  (tests/ is on sys.path)

PERIOD = 7


def tables(vocab: int, noise: float, seed: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(target, draft) tables; the draft is the target plus `noise` x fresh noise (inf: independent)."""
    rng = np.random.default_rng(seed)
    target = (rng.standard_normal((vocab, PERIOD, vocab)) * scale).astype(np.float32)
    fresh = (rng.standard_normal(target.shape) * scale).astype(np.float32)
    draft = fresh if noise == math.inf else target + np.float32(noise) * fresh
    return target, draft


def row(table: np.ndarray, tokens: list[int]) -> np.ndarray:
    return table[tokens[-1], (len(tokens) - 1) % PERIOD]


def play(target: np.ndarray, draft: np.ndarray, prompt: list[int], n: int, k: int, params: SamplingParams,
         seed: int = 0) -> tuple[list[int], int, int]:
    """n tokens by speculative rounds: (tokens, proposals drafted, proposals accepted)."""
    rng = np.random.default_rng(seed)
    committed, out, drafted, accepted = list(prompt), [], 0, 0
    while len(out) < n:
        props, tokens = [], list(committed)
        for _ in range(min(k, n - len(out) - 1)):  # proposals past the budget would be wasted
            props.append(int(np.argmax(row(draft, tokens))))
            tokens.append(props[-1])
        rows = np.stack([row(target, committed + props[:i]) for i in range(len(props) + 1)])
        p_rows = rows.argmax(axis=1) if not params.temperature > 0 else rows
        emitted, a = accept(props, p_rows, params, rng)
        drafted, accepted = drafted + len(props), accepted + a
        assert 1 <= len(emitted) == a + 1 <= len(props) + 1
        committed += emitted
        out += emitted
    return out[:n], drafted, accepted


def plain_greedy(table: np.ndarray, prompt: list[int], n: int) -> list[int]:
    tokens = list(prompt)
    for _ in range(n):
        tokens.append(int(np.argmax(row(table, tokens))))
    return tokens[len(prompt):]


GREEDY = SamplingParams(temperature=0, max_tokens=64)


@pytest.mark.parametrize("noise", [0.0, 0.5, math.inf], ids=["same", "noisy", "independent"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_rounds_equal_plain_greedy(noise, k):
    target, draft = tables(vocab=50, noise=noise, seed=k)
    prompt = [3, 1, 4, 1, 5]
    got, drafted, accepted = play(target, draft, prompt, 40, k, GREEDY)
    assert got == plain_greedy(target, prompt, 40)
    if noise == 0.0:
        assert accepted == drafted  # the draft is the target: every proposal stands
    if noise == math.inf and k > 1:
        assert accepted < 0.5 * drafted  # independent tables rarely agree


def test_a_rejected_proposal_is_replaced_by_the_targets_token():
    p_rows = np.array([7, 8, 9], np.int32)  # the target's argmax after each fed token
    assert accept([7, 5], p_rows, GREEDY, np.random.default_rng(0)) == ([7, 8], 1)
    assert accept([7, 8], p_rows, GREEDY, np.random.default_rng(0)) == ([7, 8, 9], 2)
    assert accept([], p_rows[:1], GREEDY, np.random.default_rng(0)) == ([7], 0)


def exact_joint(table: np.ndarray, prompt: list[int], n: int, params: SamplingParams) -> dict[tuple, float]:
    """The target's exact distribution of its next n tokens (enumerating every sequence)."""
    vocab = table.shape[0]
    out = {}
    for seq in itertools.product(range(vocab), repeat=n):
        tokens, prob = list(prompt), 1.0
        for x in seq:
            prob *= distribution(row(table, tokens), params.temperature, params.top_k, params.top_p)[x]
            tokens.append(x)
            if prob == 0.0:
                break
        if prob > 0:
            out[seq] = prob
    return out


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.8, top_k=4,
                                                                                     top_p=0.9)],
                         ids=["T1", "T0.8-topk4-topp0.9"])
def test_sampled_rounds_have_the_targets_distribution(params):
    """The first four tokens of 8,000 seeded runs (k = 3: one round can emit all four) against the
    target's exact distribution: Pearson's chi-square on the joint of tokens 1-2 and of tokens 3-4
    (36 cells each), each at alpha = 1e-4. The draft (an independent table, greedy proposals) differs
    from the target by far more than the test's resolution; drawing a rejected position from p instead
    of p without the proposal, or accepting every proposal, fails it by orders of magnitude."""
    vocab, n_runs, k = 6, 8_000, 3
    target, draft = tables(vocab=vocab, noise=math.inf, seed=42)
    prompt = [0, 1]
    counts12, counts34 = {}, {}
    for seed in range(n_runs):
        out, _, _ = play(target, draft, prompt, 4, k, params, seed)
        counts12[tuple(out[:2])] = counts12.get(tuple(out[:2]), 0) + 1
        counts34[tuple(out[2:])] = counts34.get(tuple(out[2:]), 0) + 1
    assert_split_fits(exact_joint(target, prompt, 4, params), 2, counts12, counts34, n_runs,
                      ("tokens 1-2", "tokens 3-4"))
