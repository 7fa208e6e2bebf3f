"""Speculative decoding's algorithm (tileinfer/engine/speculative.py) on the CPU.

Two kinds of model stand in for the GPU one:
  * `TableDecoder`: next-token logits from a random table indexed by (last token, position mod 7),
    over a small vocabulary. Its greedy continuations vary and its distributions are known
    exactly, so greedy equality and the sampled distribution can be checked precisely.
  * the float32 numpy reference of the tiny checkpoint (`ReferenceDecoder`), for the real model's
    cache and truncation.
"""
from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from tileinfer.engine.speculative import (ModelDraft, OracleDraft, ReferenceDecoder, Sampling, select_logits,
                                          speculative_decode)
from tileinfer.model.checkpoint import Checkpoint
from tileinfer.model.reference import ReferenceModel

from stats_helpers import assert_split_fits  # noqa: E402  (tests/ is on sys.path)

PERIOD = 7


class TableDecoder:
    """logits(next | tokens so far) = table[last token, position % PERIOD]; keeps the tokens it holds."""

    def __init__(self, table: np.ndarray):
        self.table = table
        self.tokens: list[int] = []

    def logits_after(self, tokens: list[int]) -> np.ndarray:
        return self.table[tokens[-1], (len(tokens) - 1) % PERIOD]

    def extend(self, ids, logits="all"):
        rows = []
        for t in ids:
            self.tokens.append(int(t))
            rows.append(self.logits_after(self.tokens))
        return select_logits(np.array(rows, np.float32), logits)

    def truncate(self, n):
        assert 0 <= n <= len(self.tokens)
        del self.tokens[n:]

    def __len__(self):
        return len(self.tokens)


def tables(vocab: int, noise: float, seed: int, scale: float = 1.0) -> tuple[np.ndarray, np.ndarray]:
    """(target, draft) tables; the draft is the target plus `noise` x fresh noise (inf: independent)."""
    rng = np.random.default_rng(seed)
    target = (rng.standard_normal((vocab, PERIOD, vocab)) * scale).astype(np.float32)
    fresh = (rng.standard_normal(target.shape) * scale).astype(np.float32)
    draft = fresh if noise == math.inf else target + np.float32(noise) * fresh
    return target, draft


def plain_greedy(table: np.ndarray, prompt: list[int], n: int) -> list[int]:
    dec, out = TableDecoder(table), []
    logits = dec.extend(prompt)[-1]
    for _ in range(n):
        out.append(int(np.argmax(logits)))
        logits = dec.extend([out[-1]])[-1]
    return out


def checked_round(target: TableDecoder, draft_decoder):
    """on_round: the target holds exactly the committed tokens but the last, the draft a prefix of them
    (it catches up on what it lacks when it next proposes)."""
    rounds = []

    def on_round(committed, accepted):
        assert target.tokens == committed[:-1], "the target's cache holds something not committed"
        held = draft_decoder.tokens
        assert held == committed[:len(held)], "the draft's cache holds a rejected token"
        rounds.append(accepted)
    return on_round, rounds


@pytest.mark.parametrize("noise", [0.0, 0.5, math.inf], ids=["same", "noisy", "independent"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_equals_plain_greedy_and_caches_roll_back(noise, k):
    target_t, draft_t = tables(vocab=50, noise=noise, seed=k)
    prompt = [3, 1, 4, 1, 5]
    want = plain_greedy(target_t, prompt, 40)
    target, draft_dec = TableDecoder(target_t), TableDecoder(draft_t)
    on_round, rounds = checked_round(target, draft_dec)
    got, stats = speculative_decode(target, ModelDraft(draft_dec), prompt, max_new_tokens=40, num_draft_tokens=k,
                                    on_round=on_round)
    assert got == want
    assert stats.target_steps == len(rounds) and stats.accepted == sum(rounds)
    if noise == 0.0:
        assert stats.acceptance_rate == 1.0  # the draft is the target: every proposal stands
    if noise == math.inf and k > 1:
        assert stats.acceptance_rate < 0.5  # independent tables rarely agree
    assert 0 < stats.tokens_per_target_step <= k + 1


def test_oracle_draft_accepts_everything():
    target_t, _ = tables(vocab=50, noise=0.0, seed=9)
    prompt = [2, 7]
    want = plain_greedy(target_t, prompt, 41)
    k = 4
    got, stats = speculative_decode(TableDecoder(target_t), OracleDraft(len(prompt), want), prompt,
                                    max_new_tokens=41, num_draft_tokens=k)
    assert got == want
    assert stats.acceptance_rate == 1.0
    # Each round emits k + 1 tokens (k accepted, 1 from the target) until the budget's end: 41 = 8 x 5 + 1.
    assert stats.target_steps == 9 and stats.emitted == 41


def test_stops_at_eos_and_budget():
    target_t, draft_t = tables(vocab=50, noise=0.5, seed=3)
    prompt = [1, 2, 3]
    want = plain_greedy(target_t, prompt, 30)
    eos = want[11]
    got, _ = speculative_decode(TableDecoder(target_t), ModelDraft(TableDecoder(draft_t)), prompt,
                                max_new_tokens=30, num_draft_tokens=4, eos_token_ids=[eos])
    assert got == want[:want.index(eos) + 1]
    got, _ = speculative_decode(TableDecoder(target_t), ModelDraft(TableDecoder(draft_t)), prompt,
                                max_new_tokens=7, num_draft_tokens=4)
    assert got == want[:7]


def test_bad_arguments():
    t, d = tables(vocab=10, noise=0.5, seed=1)
    with pytest.raises(ValueError, match="num_draft_tokens"):
        speculative_decode(TableDecoder(t), ModelDraft(TableDecoder(d)), [1], max_new_tokens=4, num_draft_tokens=0)
    with pytest.raises(ValueError, match="prompt is empty"):
        speculative_decode(TableDecoder(t), ModelDraft(TableDecoder(d)), [], max_new_tokens=4, num_draft_tokens=2)
    used = TableDecoder(t)
    used.extend([1])
    with pytest.raises(ValueError, match="at most the prompt's first 0"):
        speculative_decode(used, ModelDraft(TableDecoder(d)), [1], max_new_tokens=4, num_draft_tokens=2)


def test_target_and_draft_holding_a_prefix_continue_from_it():
    # A chat's next turn: both caches already hold the start of the prompt; only the rest is fed.
    t, d = tables(vocab=50, noise=0.5, seed=4)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    want = plain_greedy(t, prompt, 20)
    target, draft_dec = TableDecoder(t), TableDecoder(d)
    target.extend(prompt[:4])
    draft = ModelDraft(draft_dec)
    draft_dec.extend(prompt[:5])
    draft.fed = prompt[:5]
    got, stats = speculative_decode(target, draft, prompt, max_new_tokens=20, num_draft_tokens=3)
    assert got == want
    assert stats.prefill_seconds >= 0


# ---------------------------------------------------------------------------- the sampled distribution


def exact_joint(table: np.ndarray, prompt: list[int], n: int, sampling: Sampling) -> dict[tuple, float]:
    """The target's exact distribution of its next n tokens (enumerating every sequence)."""
    vocab = table.shape[0]
    out = {}
    for seq in itertools.product(range(vocab), repeat=n):
        tokens, prob = list(prompt), 1.0
        for x in seq:
            prob *= sampling.distribution(table[tokens[-1], (len(tokens) - 1) % PERIOD])[x]
            tokens.append(x)
            if prob == 0.0:
                break
        if prob > 0:
            out[seq] = prob
    return out


@pytest.mark.parametrize("sampling", [Sampling(temperature=1.0), Sampling(temperature=0.8, top_k=4, top_p=0.9)],
                         ids=["T1", "T0.8-topk4-topp0.9"])
def test_sampled_output_has_the_targets_distribution(sampling):
    """The first four output tokens of 20,000 seeded runs (k = 3: the first round proposes three,
    so one round can emit all four) against the target's exact distribution: Pearson's chi-square
    on the joint of tokens 1-2 and on the joint of tokens 3-4 (36 cells each), each at
    alpha = 1e-4. Power: a deviation of total variation 0.02 put on two cells of probability
    ~0.03 adds a noncentrality of N * sum(delta^2 / p) ~ 20,000 * 2 * 0.01^2 / 0.03 ~ 130 to a
    statistic whose critical value is ~75 (35 dof), so such a bug is caught with power ~1; the
    draft (an independent table) differs from the target by far more than that. Injected into the
    code one at a time, four plausible bugs (drawing a rejected position from p instead of the
    residual; accepting every proposal; the bonus token from the wrong position; the acceptance
    ratio inverted) gave chi-square 3,757 to 71,748 here."""
    vocab, n_runs, k = 6, 20_000, 3
    target_t, draft_t = tables(vocab=vocab, noise=math.inf, seed=42, scale=1.0)
    prompt = [0, 1]
    counts12, counts34 = {}, {}
    for seed in range(n_runs):
        out, _ = speculative_decode(TableDecoder(target_t), ModelDraft(TableDecoder(draft_t)), prompt,
                                    max_new_tokens=4, num_draft_tokens=k, sampling=sampling, seed=seed)
        counts12[tuple(out[:2])] = counts12.get(tuple(out[:2]), 0) + 1
        counts34[tuple(out[2:])] = counts34.get(tuple(out[2:]), 0) + 1
    assert_split_fits(exact_joint(target_t, prompt, 4, sampling), 2, counts12, counts34, n_runs,
                      ("tokens 1-2", "tokens 3-4"))


# ---------------------------------------------------------------------------- the reference model


def test_reference_model_greedy_and_rollback(tiny_checkpoint):
    ref = ReferenceModel.from_checkpoint(Checkpoint.open(tiny_checkpoint))
    prompt = list(range(1000, 1030))
    want = ref.greedy(prompt, 20)
    for k in (2, 4):
        # A draft that is the target with a noisy LM head: it agrees sometimes.
        draft_model = ReferenceModel.from_checkpoint(Checkpoint.open(tiny_checkpoint))
        rng = np.random.default_rng(k)
        draft_model.lm_head = (draft_model.lm_head + rng.standard_normal(draft_model.lm_head.shape).astype(np.float32)
                               * np.float32(0.5 * float(np.std(draft_model.lm_head))))
        target, draft_dec = ReferenceDecoder(ref), ReferenceDecoder(draft_model)
        lengths = []
        got, stats = speculative_decode(target, ModelDraft(draft_dec), prompt, max_new_tokens=20, num_draft_tokens=k,
                                        on_round=lambda committed, _: lengths.append((len(committed), len(target))))
        assert got == want
        assert all(t == c - 1 for c, t in lengths), "the target's cache holds more than the committed tokens"
        # Oracle: the target's own continuation, every proposal accepted.
        got, stats = speculative_decode(ReferenceDecoder(ref), OracleDraft(len(prompt), want), prompt,
                                        max_new_tokens=20, num_draft_tokens=k)
        assert got == want and stats.acceptance_rate == 1.0
