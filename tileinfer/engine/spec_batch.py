"""The draft side of speculative decoding in the batching engine (LLM).

Each engine step, for the decoding requests that speculate:
  1. the draft model catches up on the committed tokens it has not seen and proposes k tokens
     greedily, every request together in batched steps (DraftRunner.propose);
  2. the target runs one step over each request's last committed token and its proposals
     (Model.verify), with k more positions reserved;
  3. each request keeps the longest accepted prefix of its proposals plus one token of the target's
     (speculative.accept: exact under greedy; under sampling every token follows the target's
     distribution, the greedy proposals counting as point masses);
  4. both caches drop the rejected positions: block-table edits on the host (BlockManager.truncate),
     nothing copied or cleared on the device.
Steps 2-4 are LLM._verify; this module holds the draft's state.
"""
from __future__ import annotations

from ..kv import Sequence
from .speculative import common_prefix


SHORT = 4  # catch-ups of at most this many tokens a row run as one-token decode steps (graph replays)


class DraftRunner:
    """The draft model's sequences, one per request, in its own paged cache. A request's draft
    sequence holds a prefix of the request's committed tokens, never the last one (the next
    proposals need the draft's logits after it, which come from feeding it)."""

    def __init__(self, model):
        self.model = model
        self.held: dict[int, tuple[Sequence, list[int]]] = {}  # request id -> (sequence, tokens it holds)

    @property
    def manager(self):
        return self.model.cache.manager

    def propose(self, items: list[tuple[int, list[int], int]]) -> list[list[int]]:
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
            tokens = self.model.step([(seq, [out[i][-1]], pos) for i, seq, pos in rows])
            for (i, _, _), token in zip(rows, tokens):
                self.held[items[i][0]][1].append(out[i][-1])
                out[i].append(int(token))
        return out

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
                tokens = self.model.step(step)
            return [int(x) for x in tokens]  # every row is in the last step, in order
        limit, max_rows = self.model.max_batch_tokens, self.model.max_num_seqs
        result = [0] * len(rows)
        step, owners, used = [], [], 0

        def flush():
            nonlocal step, owners, used
            if step:
                tokens = self.model.step(step)
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
