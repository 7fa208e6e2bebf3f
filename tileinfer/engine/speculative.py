"""Speculative decoding: a draft proposes k tokens, the target checks them all in one step.

Each round, with T the tokens committed so far (prompt + output) and each model's cache holding a
prefix of T:

  1. The draft feeds what of T it lacks, then proposes x_1..x_k one step at a time: greedy, the
     argmax; sampling, a draw from its distribution q_i (after the same temperature, top-k and
     top-p as the target).
  2. The target feeds what of T it lacks (normally T's last token) and x_1..x_k in one step, and
     gets k + 1 distributions: p_{i-1} for the position x_i was proposed at, p_k after x_k.
  3. Greedy: accept x_i while it is argmax p_{i-1}. Sampling: accept x_i with probability
     min(1, p_{i-1}(x_i) / q_i(x_i)). At the first rejection, emit one token from the residual
     max(0, p_{i-1} - q_i) renormalised (greedy: argmax p_{i-1}) and stop; if all k pass, emit
     one more from p_k. So a round emits 1 to k + 1 tokens, and each is distributed exactly as
     the target alone would draw it (Leviathan et al. 2023; Chen et al. 2023). Greedy output is
     the target's greedy output, token for token, whatever the draft proposes.
  4. Rollback is free: both caches are truncated to the committed prefix they hold (the target to
     T minus its last token, which the next round feeds; the draft to what it fed that T kept).
     On the GPU that is a block-table edit on the host (BlockManager.truncate): nothing is copied
     or cleared, later writes overwrite the rejected positions.

A model takes part through the `Decoder` protocol (extend, truncate, len): `ReferenceDecoder`
wraps the float32 numpy reference, `ModelDecoder` a GPU `Model`. A draft is any `DraftSource`:
`ModelDraft` (a smaller model on its own cache) or `OracleDraft`, which proposes a given
continuation (the target's own greedy output, say) at no cost: acceptance 100%, the ceiling of
the verify machinery.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence as Seq
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from .sampler import kept_mask, scaled


class Decoder(Protocol):
    def extend(self, ids: list[int], logits: str = "all") -> np.ndarray | None:
        """Append `ids` to the cached sequence; the next-token logits after each (logits="all",
        [len(ids), vocab]), after the last one ("last", [1, vocab]), the argmax of each ("argmax",
        int32 [len(ids)], lowest index on ties) or none ("none": None)."""

    def truncate(self, n: int) -> None:
        """Keep the first n cached positions."""

    def __len__(self) -> int:
        """Positions cached."""


@dataclass
class Sampling:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return not self.temperature > 0

    def distribution(self, logits: np.ndarray) -> np.ndarray:
        """The distribution a token is drawn from: softmax(logits / T) over the min-p / top-k / top-p set. # float64"""
        z = scaled(logits, self.temperature).astype(np.float64)
        keep = kept_mask(logits, self.temperature, self.top_k, self.top_p, min_p=self.min_p)
        p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
        return p / p.sum()


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from the distribution p (inverse CDF)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.size - 1))


class DraftSource(Protocol):
    def propose(self, committed: list[int], k: int, sampling: Sampling,
                rng: np.random.Generator) -> tuple[list[int], list[np.ndarray] | None]:
        """Up to k proposed tokens after `committed`, and the distributions they were drawn from
        (None: each proposal was certain, a point mass)."""

    def rollback(self, committed: list[int]) -> None:
        """The round is over and `committed` is what was kept: drop anything cached beyond it."""


class ModelDraft:
    """A draft model on its own cache (any Decoder)."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder
        self.fed: list[int] = []  # the tokens whose positions the draft's cache holds

    def propose(self, committed, k, sampling, rng):
        mode = "argmax" if sampling.greedy else "last"  # greedy needs only the argmax (found on the GPU)
        missing = committed[len(self.fed):]
        row = self.decoder.extend(missing, logits=mode)[-1]
        self.fed += missing
        tokens, dists = [], []
        for i in range(k):
            if sampling.greedy:
                x = int(row)
            else:
                q = sampling.distribution(row)
                x = draw(q, rng)
                dists.append(q)
            tokens.append(x)
            if i + 1 < k:  # the last proposal is never fed: the next round starts from T
                row = self.decoder.extend([x], logits=mode)[-1]
                self.fed.append(x)
        return tokens, (None if sampling.greedy else dists)

    def rollback(self, committed):
        # Keep what of T it holds, but at most all but T's last token: the next proposal needs the
        # logits after T, which come from feeding at least one token.
        keep = min(common_prefix(self.fed, committed), len(committed) - 1)
        self.decoder.truncate(keep)
        del self.fed[keep:]


class OracleDraft:
    """Proposes a given continuation of the prompt (e.g. the target's own greedy output), at no cost."""

    def __init__(self, prompt_len: int, continuation: Seq[int]):
        self.prompt_len, self.continuation = prompt_len, list(continuation)

    def propose(self, committed, k, sampling, rng):
        start = len(committed) - self.prompt_len
        return self.continuation[start:start + k], None

    def rollback(self, committed):
        pass


@dataclass
class SpecStats:
    drafted: int = 0        # proposals the target checked
    accepted: int = 0       # of those, kept
    target_steps: int = 0   # verify steps of the target (one per round)
    emitted: int = 0        # tokens the rounds produced (before cutting at max_tokens or EOS)
    prefill_seconds: float = 0.0  # the target's prompt prefill (all but the prompt's last token)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        return self.emitted / self.target_steps if self.target_steps else 0.0


def check_count(name: str, value) -> None:
    """A token count must be an integer >= 1; ValueError naming the field otherwise."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def check_draft_model(model, draft_model) -> None:
    """A draft model must be a second model with the target's vocabulary."""
    if draft_model is model:
        raise ValueError("draft_model is the target model itself; load a second copy (generate also takes an "
                         "OracleDraft)")
    if draft_model.config.vocab_size != model.config.vocab_size:
        raise ValueError(f"draft_model's vocabulary ({draft_model.config.vocab_size}) differs from the target's "
                         f"({model.config.vocab_size}); speculation needs the same tokenizer")


def select_logits(rows: np.ndarray, logits: str) -> np.ndarray | None:
    """What a Decoder's extend returns for logits="all", "last", "argmax" or "none", from every row's logits."""
    if logits not in ("all", "last", "argmax", "none"):
        raise ValueError(f"logits must be 'all', 'last', 'argmax' or 'none', got {logits!r}")
    if logits == "argmax":
        return rows.argmax(axis=1).astype(np.int32)
    return rows if logits == "all" else rows[-1:] if logits == "last" else None


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def accept(proposals: Seq[int], q: list[np.ndarray] | None, p_logits, sampling: Sampling,
           rng: np.random.Generator) -> tuple[list[int], int]:
    """One round's verdict on k proposals: (the tokens it emits, how many proposals were accepted).

    p_logits: the target's k + 1 next-token rows after the last committed token and after each
    proposal (logits, or under greedy their argmaxes). Greedy keeps the longest prefix of proposals
    that match the target's argmax, then the target's token. Otherwise proposal x_i (drawn from
    q_i, or certain when q is None) is kept with probability min(1, p_i(x_i) / q_i(x_i)); the first
    rejected one is replaced by a draw from max(p_i - q_i, 0) renormalized, so every emitted token
    follows the target's distribution exactly. When all k are kept, one more token comes from p_k."""
    emitted, accepted = [], 0
    for i, x in enumerate(proposals):
        if sampling.greedy:
            best = int(p_logits[i])
            if x != best:
                emitted.append(best)
                return emitted, accepted
        else:
            p = sampling.distribution(p_logits[i])
            qx = q[i][x] if q is not None else 1.0
            if not rng.random() < min(1.0, p[x] / qx):  # rejected: draw from the residual
                residual = np.maximum(p - (q[i] if q is not None else np.eye(1, p.size, x)[0]), 0.0)
                emitted.append(draw(residual, rng) if residual.sum() > 0 else draw(p, rng))
                return emitted, accepted
        emitted.append(x)
        accepted += 1
    last = p_logits[len(proposals)]  # every proposal kept: one more token from p_k
    emitted.append(int(last) if sampling.greedy else draw(sampling.distribution(last), rng))
    return emitted, accepted


def speculative_stream(target: Decoder, draft: DraftSource, prompt: list[int], *, max_new_tokens: int,
                       num_draft_tokens: int, sampling: Sampling | None = None, seed: int = 0,
                       eos_token_ids: Seq[int] = (), stats: SpecStats | None = None,
                       on_round: Callable[[list[int], int], None] | None = None) -> Iterator[int]:
    """Yield up to max_new_tokens after `prompt` (the last one an EOS token, if one comes), drawn as
    the target alone would draw them, the draft proposing num_draft_tokens a round. Tokens come out
    a round at a time; between rounds both caches hold only committed tokens.

    The target's cache may already hold a prefix of the prompt (a chat's earlier turns), at most all
    of it but the last token; the caller vouches that it is the prompt's prefix. `stats` (if given)
    is filled in as the rounds go. on_round(committed, accepted) is called after every round, once
    both caches are rolled back (tests use it to check that nothing rejected stays cached)."""
    if not prompt:
        raise ValueError("prompt is empty: give at least one token")
    check_count("num_draft_tokens", num_draft_tokens)
    check_count("max_new_tokens", max_new_tokens)
    if len(target) > len(prompt) - 1:
        raise ValueError(f"the target's cache holds {len(target)} positions; it may hold at most the prompt's "
                         f"first {len(prompt) - 1} (the last one is fed with the first proposals)")
    sampling = sampling or Sampling()
    stats = stats if stats is not None else SpecStats()
    rng = np.random.default_rng(seed)
    eos = set(eos_token_ids)
    committed = list(prompt)
    # The target's cache holds committed[:-1]; each round feeds the last token with the proposals.
    start = time.perf_counter()
    if len(target) < len(prompt) - 1:
        target.extend(prompt[len(target):-1], logits="none")
    stats.prefill_seconds += time.perf_counter() - start
    produced = 0
    while produced < max_new_tokens:
        k = min(num_draft_tokens, max_new_tokens - produced - 1)  # proposals beyond the budget are wasted
        proposals, q = draft.propose(committed, k, sampling, rng) if k > 0 else ([], None)
        fed = committed[len(target):] + list(proposals)
        # p_0..p_k: the target's logits after each fed token, or under greedy only their argmaxes
        p_logits = target.extend(fed, logits="argmax" if sampling.greedy else "all")[-(len(proposals) + 1):]
        stats.target_steps += 1
        stats.drafted += len(proposals)
        emitted, accepted = accept(proposals, q, p_logits, sampling, rng)
        stats.accepted += accepted
        stats.emitted += len(emitted)
        committed += emitted
        # Roll back: the target keeps committed[:-1] (the last token is fed next round).
        target.truncate(len(committed) - 1)
        draft.rollback(committed)
        if on_round is not None:
            on_round(committed, accepted)
        for token in emitted:
            produced += 1
            yield token
            if token in eos or produced == max_new_tokens:
                return


def speculative_decode(target: Decoder, draft: DraftSource, prompt: list[int], *,
                       on_token: Callable[[int], None] | None = None, **kwargs) -> tuple[list[int], SpecStats]:
    """speculative_stream collected: (tokens, statistics). on_token(token) is called with each token
    as its round ends (streaming)."""
    stats = SpecStats()
    out = []
    for token in speculative_stream(target, draft, prompt, stats=stats, **kwargs):
        out.append(token)
        if on_token is not None:
            on_token(token)
    return out, stats


class ReferenceDecoder:
    """The float32 numpy reference model as a Decoder (tests, and CPU checks of the algorithm)."""

    def __init__(self, model):
        self.model = model
        self.cache = model.new_cache()

    def extend(self, ids, logits="all"):
        return select_logits(self.model.forward(list(ids), self.cache), logits)

    def truncate(self, n):
        self.cache.truncate(n)

    def __len__(self):
        return len(self.cache)


class ModelDecoder:
    """One sequence of a GPU Model's attached cache as a Decoder: extend runs prefill chunks that
    return every row's logits (Model.extend); truncate edits the block table on the host."""

    def __init__(self, model, cache, seq=None, tokens: list[int] | None = None):
        """seq: an existing sequence of `cache` holding `tokens` (a chat's), or None for a new one."""
        from ..kv import Sequence
        self.model, self.cache = model, cache
        self.seq = seq if seq is not None else Sequence()
        self.tokens = list(tokens or [])  # what the sequence's positions hold
        if self.seq.num_positions != len(self.tokens):
            raise ValueError(f"the sequence holds {self.seq.num_positions} positions, not {len(self.tokens)}")

    def extend(self, ids, logits="all"):
        out = self.model.extend(self.seq, list(ids), logits=logits)
        self.tokens += ids
        return out

    def truncate(self, n):
        self.cache.manager.truncate(self.seq, n)
        del self.tokens[n:]

    def __len__(self):
        return self.seq.num_positions

    def release(self) -> None:
        self.cache.manager.release(self.seq)
