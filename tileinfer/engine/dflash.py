"""The DFlash drafter in the engine: one context sequence per request in the drafter's own pool.

The engine tells the drafter what the target computed (`add_context`: after a prompt chunk, every
position of it; a verify step's every position, the last committed token's and all the drafts', while the
step still runs), by the rows of the target's step that computed them. The drafter's runner turns them into
entries of the request's drafter sequence at once, from the target's hidden states where that step left
them (on the GPU they never leave the device). Once the round is accepted, rollback cuts the entries of
rejected drafts (a truncate). A round's `propose` drafts k tokens in one forward over [the cached context,
the last committed token, k masks]; the block's entries are truncated away right after, so between rounds
a sequence holds exactly its context. On the GPU, one round is one wait for the device: the block pass, the
verify step (reading the drafts where the block pass left them) and the context pass go out back to back; after a
greedy verify step the next round's block pass follows them (`then_draft`: the runner finds each request's
verdict on the device), so the GPU drafts the next round while the host reads this one.

Positions whose target states were never computed in this request (a prefix-cache hit, a chat turn's
held positions), or that arrived while the drafter's pool had no room for them, are missing from the
context: drafting goes on over what there is (acceptance may drop; verification keeps the output exact).
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import numpy as np

from ..kv import Sequence
from ..runner.base import AheadRow, ContextRow, DraftRow, Proposals


@dataclass
class _Context:
    """A request's drafter state: its sequence (one entry per cached context position) and those positions."""
    seq: Sequence
    positions: list[int] = field(default_factory=list)  # the cached entries' positions, ascending


class DFlashDrafter:
    """The engine's drafter interface (propose / rollback / release / held, as DraftRunner) over a DFlash
    runner (runner/cpu_dflash.py, runner/gpu_dflash.py), plus `add_context` and the target layers it reads."""

    def __init__(self, runner, target):
        runner.bind_target(target)
        self.runner = runner
        self.config = runner.config
        self.target_layer_ids = self.config.target_layer_ids
        self.held: dict[int, _Context] = {}
        self._first: dict[int, int] = {}  # request id -> where its last drafts lie on the device (DeviceDrafts.first)

    @property
    def manager(self):
        return self.runner.cache.manager

    def add_context(self, items: list[tuple[int, int, int, int]], *, then_draft: int = 0) -> None:
        """items: (request id, start, row, n): the target's last step computed positions start..start+n-1 of
        the request in its rows row..row+n-1. They become the request's context entries now (context at or
        past `start` from before, a recomputed prompt after preemption, is replaced). A request whose drafter
        pool has no room for them drafts without them.

        then_draft = k > 0: the step was a greedy verify step of the drafts last proposed (each row the
        request's last committed token and its n - 1 drafts): the runner may launch the next round's blocks of
        k drafts now, on the device's verdict, for the next propose() to take (runner draft_ahead)."""
        rows, added, ahead = [], [], []
        for rid, start, row, n in items:
            ctx = self.held.get(rid)
            if ctx is None:
                ctx = self.held[rid] = _Context(Sequence())
            self._cut(ctx, start)
            if n < 1 or not self.manager.can_reserve(ctx.seq, n):
                continue
            entry = ctx.seq.num_positions
            self.manager.reserve(ctx.seq, n)
            ctx.positions.extend(range(start, start + n))
            rows.append(ContextRow(ctx.seq, entry, np.arange(start, start + n, dtype=np.int64), row))
            added.append((ctx, start))
            if then_draft and (n == 1 or rid in self._first):
                ahead.append(AheadRow(ctx.seq, row, n - 1, self._first.get(rid, -1), start, entry, then_draft + 1))
        try:
            self.runner.add_context(rows)
        except BaseException:
            for ctx, start in added:  # entries never written are no context
                self._cut(ctx, start)
            raise
        if ahead and len(ahead) == len(items):
            self.runner.draft_ahead(ahead)

    def _cut(self, ctx: _Context, position: int) -> None:
        """Forget the context at `position` and after."""
        keep = bisect.bisect_left(ctx.positions, position)
        if keep < len(ctx.positions):
            self.manager.truncate(ctx.seq, keep)
            del ctx.positions[keep:]

    def propose(self, items: list[tuple[int, list[int], int]]) -> Proposals:
        """items: (request id, committed tokens, k). k drafts for each (k <= block_size - 1); none for a
        request the drafter's pool has no room for this round (it then decodes one token as usual). On the
        GPU the drafts are still being computed when this returns: the verify step reads them on the device."""
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
        drafts = self.runner.draft(rows)
        if drafts.device is not None:
            self._first = {items[i][0]: first for i, first in zip(owners, drafts.device.first)}
        for i in owners:  # the block's entries go (the pass in flight still writes them), the context stays
            ctx = self.held[items[i][0]]
            self.manager.truncate(ctx.seq, len(ctx.positions))
        return drafts.spread(owners, len(items))

    def _row(self, rid: int, committed: list[int], k: int) -> DraftRow | None:
        """The request's draft step with its block's entries reserved, or None when the pool has no room."""
        ctx = self.held.get(rid)
        if ctx is None:
            ctx = self.held[rid] = _Context(Sequence())
        start = len(committed) - 1
        if ctx.positions and ctx.positions[-1] >= start:
            raise RuntimeError(f"request {rid}: context at position {ctx.positions[-1]} reaches the block at {start} "
                               f"(the last committed token is not computed yet)")
        if not self.manager.can_reserve(ctx.seq, k + 1):
            return None
        self.manager.reserve(ctx.seq, k + 1)
        return DraftRow(ctx.seq, [int(committed[-1])] + [self.config.mask_token_id] * k, start)

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
