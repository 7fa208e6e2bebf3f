"""The DFlash drafter in the engine: one context sequence per request in the drafter's own pool.

The engine tells the drafter what the target computed (`add_context`: after a prompt chunk, every
position of it; after a verify round, the last committed token's position and the accepted drafts'),
with the target's hidden states there (the runner captures them in the same pass). A round's `propose`
turns the context not yet cached into entries of the request's drafter sequence and drafts k tokens in
one forward over [that context, the last committed token, k masks]; the block's entries are truncated
away right after, so between rounds a sequence holds exactly its context, and rollback is a truncate.

Positions whose target states were never computed in this request (a prefix-cache hit, a chat turn's
held positions) are missing from the context: drafting goes on over what there is (acceptance may drop;
verification keeps the output exact).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from ..kv import Sequence
from ..runner.base import DraftRow


@dataclass
class _Context:
    """A request's drafter state: its sequence (one entry per cached context position) and the context
    that has arrived since the last draft."""
    seq: Sequence
    positions: list[int] = field(default_factory=list)  # the cached entries' positions, ascending
    pending_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    pending: np.ndarray | None = None                    # [m, feature_size]


class DFlashDrafter:
    """The engine's drafter interface (propose / rollback / release / held, as DraftRunner) over a DFlash
    runner (runner/cpu_dflash.py), plus `add_context` and the target layers it reads."""

    def __init__(self, runner, target):
        runner.bind_target(target)
        self.runner = runner
        self.config = runner.config
        self.target_layer_ids = self.config.target_layer_ids
        self.held: dict[int, _Context] = {}

    @property
    def manager(self):
        return self.runner.cache.manager

    def add_context(self, request_id: int, start: int, features: np.ndarray) -> None:
        """The target computed positions start..start+n-1 of this request (features [n, feature_size]).
        Context at or past `start` from before (a recomputed prompt after preemption) is replaced."""
        ctx = self.held.get(request_id)
        if ctx is None:
            ctx = self.held[request_id] = _Context(Sequence())
        self._cut(ctx, start)
        new = np.arange(start, start + len(features))
        ctx.pending_positions = np.concatenate([ctx.pending_positions, new])
        ctx.pending = features if ctx.pending is None else np.concatenate([ctx.pending, features])

    def _cut(self, ctx: _Context, position: int) -> None:
        """Forget the context at `position` and after (cached entries and pending ones)."""
        keep = bisect.bisect_left(ctx.positions, position)
        if keep < len(ctx.positions):
            self.manager.truncate(ctx.seq, keep)
            del ctx.positions[keep:]
        if ctx.pending is not None:
            kept = ctx.pending_positions < position
            ctx.pending_positions, ctx.pending = ctx.pending_positions[kept], ctx.pending[kept]

    def propose(self, items: list[tuple[int, list[int], int]]) -> list[list[int]]:
        """items: (request id, committed tokens, k). k drafts for each (k <= block_size - 1); none for a
        request the drafter's pool has no room for this round (it then decodes one token as usual)."""
        out: list[list[int]] = [[] for _ in items]
        rows, owners = [], []
        for i, (rid, committed, k) in enumerate(items):
            if k < 1:
                continue
            if k > self.config.max_draft_tokens:
                raise ValueError(f"a DFlash drafter of block_size {self.config.block_size} drafts at most "
                                 f"{self.config.max_draft_tokens} tokens a round, not {k}")
            row = self._row(rid, committed, k)
            if row is not None:
                rows.append(row)
                owners.append(i)
        for i, row, drafts in zip(owners, rows, self.runner.draft(rows)):
            out[i] = drafts
            self._keep_context(items[i][0], row)
        return out

    def _row(self, rid: int, committed: list[int], k: int) -> DraftRow | None:
        """The request's draft step with its entries reserved, or None when the pool has no room."""
        ctx = self.held.get(rid)
        if ctx is None:
            ctx = self.held[rid] = _Context(Sequence())
        start = len(committed) - 1
        if ctx.pending_positions.size and ctx.pending_positions.max() >= start:
            raise RuntimeError(f"request {rid}: context at position {int(ctx.pending_positions.max())} reaches the "
                               f"block at {start} (the last committed token is not computed yet)")
        m = len(ctx.pending_positions)
        if not self.manager.can_reserve(ctx.seq, m + k + 1):
            return None
        self.manager.reserve(ctx.seq, m + k + 1)
        features = ctx.pending if ctx.pending is not None else np.zeros((0, self.config.feature_size), np.float32)
        return DraftRow(ctx.seq, features, ctx.pending_positions, [int(committed[-1])] +
                        [self.config.mask_token_id] * k, start)

    def _keep_context(self, rid: int, row: DraftRow) -> None:
        """After a draft: the block's entries go (a truncate), the new context's stay."""
        ctx = self.held[rid]
        ctx.positions.extend(int(p) for p in row.context_positions)
        self.manager.truncate(ctx.seq, len(ctx.positions))
        ctx.pending_positions, ctx.pending = ctx.pending_positions[:0], None

    def rollback(self, request_id: int, committed: list[int]) -> None:
        """A round is over and `committed` is what the request kept: the context holds no position past
        the last committed token's (whose states come with the next round)."""
        ctx = self.held.get(request_id)
        if ctx is not None:
            self._cut(ctx, len(committed) - 1)

    def release(self, request_id: int) -> None:
        """The request is over: give its drafter pages back."""
        ctx = self.held.pop(request_id, None)
        if ctx is not None:
            self.manager.release(ctx.seq)
