"""Speculative decoding: a draft proposes k tokens, the target checks them all in one step.

Each engine step, for the decoding requests that speculate (engine/engine.py `_verify`):
  1. the draft catches up on the committed tokens it has not seen and proposes k tokens greedily,
     every request together in batched steps (DraftRunner.propose; a `Proposals`: how many each
     request has, their values, and for a DFlash drafter on the GPU where they lie on the device);
  2. the target runs one verify step over each request's last committed token and its proposals,
     with k more positions reserved, and gets k + 1 next-token rows p_0..p_k per request;
  3. `accept`: greedy keeps the proposals while each is argmax p_{i-1}, then the target's own token;
     under sampling proposal x_i (a point mass: the draft is greedy) is kept with probability
     p_{i-1}(x_i), and at the first rejection one token is drawn from p_{i-1} with x_i removed
     (renormalised), so every emitted token follows the target's distribution exactly (Leviathan et
     al. 2023; Chen et al. 2023); when all k pass one more comes from p_k;
  4. rollback is free: both caches drop the rejected positions with BlockManager.truncate, a
     block-table edit on the host; nothing is copied or cleared on the device.

The draft is a model of its own (DraftRunner, below) or a DFlash drafter (engine/dflash.py: one forward
drafts a whole block from the target's hidden states); `make_drafter` picks by what was loaded.
One sequence is batch 1 of the same path: `generate` and `ChatSession` speculate through it too.
`OracleDraft` proposes a known continuation at no cost (acceptance 100%: the ceiling of the verify
machinery, for benchmarks).
"""
from __future__ import annotations

from collections.abc import Sequence as Seq
from dataclasses import dataclass

import numpy as np

from ..config import DEFAULT_DRAFT_TOKENS
from ..kv import Sequence
from ..model.dflash_config import DFlashConfig
from ..runner.base import Proposals
from ..runner.sampler import kept_mask, scaled
from .dflash import DFlashDrafter


def distribution(logits: np.ndarray, temperature: float, top_k: int = 0, top_p: float = 1.0,
                 min_p: float = 0.0) -> np.ndarray:
    """The distribution a token is drawn from: softmax(logits / T) over the min-p / top-k / top-p set. # float64"""
    z = scaled(logits, temperature).astype(np.float64)
    keep = kept_mask(logits, temperature, top_k, top_p, min_p=min_p)
    p = np.where(keep, np.exp(z - z[keep].max()), 0.0)
    return p / p.sum()


def draw(p: np.ndarray, rng: np.random.Generator) -> int:
    """One draw from the distribution p (inverse CDF)."""
    c = np.cumsum(p)
    return int(min(np.searchsorted(c, rng.random() * c[-1], side="right"), p.size - 1))


@dataclass
class SpecStats:
    drafted: int = 0        # proposals the target checked
    accepted: int = 0       # of those, kept
    target_steps: int = 0   # verify steps of the target (one per round)
    emitted: int = 0        # tokens the rounds produced (before cutting at max_tokens or EOS)

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.drafted if self.drafted else 0.0

    @property
    def tokens_per_target_step(self) -> float:
        return self.emitted / self.target_steps if self.target_steps else 0.0


def common_prefix(a: Seq[int], b: Seq[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def accept(proposals: Seq[int], p_rows, params, rng: np.random.Generator) -> tuple[list[int], int]:
    """One round's verdict on k greedy proposals: (the tokens it emits, how many proposals were accepted).

    p_rows: the target's k + 1 next-token rows after the last committed token and after each proposal
    (logits, or under greedy their argmaxes); params: the request's SamplingParams."""
    greedy = not params.temperature > 0
    emitted, accepted = [], 0
    for i, x in enumerate(proposals):
        if greedy:
            best = int(p_rows[i])
            if x != best:
                return emitted + [best], accepted
        else:
            p = distribution(p_rows[i], params.temperature, params.top_k, params.top_p, params.min_p)
            if not rng.random() < p[x]:  # rejected: draw from p without x
                residual = p.copy()
                residual[x] = 0.0
                return emitted + [draw(residual, rng) if residual.sum() > 0 else draw(p, rng)], accepted
        emitted.append(x)
        accepted += 1
    last = p_rows[len(proposals)]  # every proposal kept: one more token from p_k
    if greedy:
        return emitted + [int(last)], accepted
    return emitted + [draw(distribution(last, params.temperature, params.top_k, params.top_p, params.min_p),
                           rng)], accepted


class OracleDraft:
    """Proposes a given continuation of the prompt (e.g. the target's own greedy output), at no cost."""

    target_layer_ids: tuple[int, ...] = ()  # reads none of the target's hidden states

    def __init__(self, prompt_len: int, continuation: Seq[int]):
        self.prompt_len, self.continuation = prompt_len, list(continuation)
        self.held: dict[int, None] = {}

    def propose(self, items: list[tuple[int, list[int], int]]) -> Proposals:
        out = []
        for _, committed, k in items:
            start = len(committed) - self.prompt_len
            out.append(self.continuation[start:start + k] if k > 0 else [])
        return Proposals.of(out)

    def rollback(self, request_id: int, committed: list[int]) -> None:
        pass

    def release(self, request_id: int) -> None:
        pass


SHORT = 4  # catch-ups of at most this many tokens a row run as one-token decode steps (graph replays)


class DraftRunner:
    """The draft model's sequences, one per request, in its own paged cache. A request's draft
    sequence holds a prefix of the request's committed tokens, never the last one (the next
    proposals need the draft's logits after it, which come from feeding it)."""

    target_layer_ids: tuple[int, ...] = ()  # reads none of the target's hidden states (a DFlash drafter does)

    def __init__(self, runner):
        self.runner = runner
        self.held: dict[int, tuple[Sequence, list[int]]] = {}  # request id -> (sequence, tokens it holds)

    @property
    def manager(self):
        return self.runner.cache.manager

    def propose(self, items: list[tuple[int, list[int], int]]) -> Proposals:
        """items: (request id, committed tokens, k). Up to k greedy proposals for each; none for a
        request the draft's pool has no room for this step (it then decodes one token as usual)."""
        out: list[list[int]] = [[] for _ in items]
        catch_up, live = [], []  # (seq, ids, start) rows; (item index, seq, next start, k)
        for i, (rid, committed, k) in enumerate(items):
            if k < 1:
                continue
            seq, fed = self.held.get(rid) or (Sequence(), [])
            missing = list(committed[len(fed):])  # at least the last committed token
            if not self.manager.can_reserve(seq, len(missing) + k - 1):
                continue
            self.held[rid] = seq, fed
            self.manager.reserve(seq, len(missing) + k - 1)  # the sequence holds exactly `fed` between rounds
            catch_up.append((seq, missing, len(fed)))
            fed.extend(missing)
            live.append((i, seq, len(fed), k))
        firsts = self._run(catch_up)
        for (i, _, _, _), token in zip(live, firsts):
            out[i].append(int(token))
        for j in range(1, max((k for *_, k in live), default=0)):
            rows = [(i, seq, start + j - 1) for i, seq, start, k in live if k > j]
            tokens = self.runner.step([(seq, [out[i][-1]], pos) for i, seq, pos in rows])
            for (i, _, _), token in zip(rows, tokens):
                self.held[items[i][0]][1].append(out[i][-1])
                out[i].append(int(token))
        return Proposals.of(out)

    def _run(self, rows: list[tuple[Sequence, list[int], int]]) -> list[int]:
        """Feed every row its ids (start: the first position); each row's greedy next token after its
        last id. Short catch-ups (at most SHORT tokens a row: after a round, one or two) run as decode
        steps of one token a row, aligned to end together, so they replay the draft's decode graphs;
        longer ones (a new request's prompt) in steps of at most max_batch_tokens tokens and
        max_num_seqs rows, a long row in chunks."""
        if not rows:
            return []
        longest = max(len(ids) for _, ids, _ in rows)
        if longest <= SHORT:
            tokens = []
            for t in range(longest):  # row r's token i goes in step longest - len(ids_r) + i
                step = [(seq, [ids[i]], start + i) for seq, ids, start in rows
                        for i in [t - longest + len(ids)] if i >= 0]
                tokens = self.runner.step(step)
            return [int(x) for x in tokens]  # every row is in the last step, in order
        limit, max_rows = self.runner.max_batch_tokens, self.runner.max_num_seqs
        result = [0] * len(rows)
        step, owners, used = [], [], 0

        def flush():
            nonlocal step, owners, used
            if step:
                tokens = self.runner.step(step)
                for owner, token in zip(owners, tokens):
                    if owner is not None:
                        result[owner] = int(token)
            step, owners, used = [], [], 0

        for r, (seq, ids, start) in enumerate(rows):
            pos = 0
            while pos < len(ids):
                take = min(len(ids) - pos, limit - used)
                step.append((seq, ids[pos:pos + take], start + pos))
                owners.append(r if pos + take == len(ids) else None)
                used += take
                pos += take
                if used == limit or len(step) == max_rows:
                    flush()
        flush()
        return result

    def rollback(self, request_id: int, committed: list[int]) -> None:
        """A round is over and `committed` is what the request kept: drop the draft's positions past it
        (and its last token, which is fed with the next proposals)."""
        if request_id not in self.held:
            return
        seq, fed = self.held[request_id]
        keep = min(common_prefix(fed, committed), len(committed) - 1)
        self.manager.truncate(seq, keep)
        del fed[keep:]

    def release(self, request_id: int) -> None:
        """The request is over: give its draft pages back."""
        held = self.held.pop(request_id, None)
        if held is not None:
            self.manager.release(held[0])


def default_draft_tokens(draft) -> int:
    """A drafter's proposals a round when none are asked for: a DFlash drafter's block_size - 1, else 4."""
    if not isinstance(draft, OracleDraft) and isinstance(draft.config, DFlashConfig):
        return draft.config.max_draft_tokens
    return DEFAULT_DRAFT_TOKENS


def make_drafter(draft, target, num_draft_tokens: int):
    """The engine's drafter over a loaded draft: a DFlash drafter's runner (checked to fit the target, and
    num_draft_tokens to fit its block) or a draft model's runner."""
    if isinstance(draft.config, DFlashConfig):
        if num_draft_tokens > draft.config.max_draft_tokens:
            raise ValueError(f"num_draft_tokens {num_draft_tokens} exceeds what this DFlash drafter drafts a round "
                             f"(block_size {draft.config.block_size} - 1 = {draft.config.max_draft_tokens})")
        return DFlashDrafter(draft, target)
    return DraftRunner(draft)
