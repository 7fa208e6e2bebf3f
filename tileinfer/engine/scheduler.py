"""Continuous batching: which requests run in the next step, and with how many tokens.

Pure host code over a BlockManager (no device), so it is tested on the CPU.

A request's tokens are its prompt followed by what it generated so far; `num_computed` of them
have their keys and values in the cache. Each step gives every scheduled request a contiguous
run of its not-yet-computed tokens:

  * a decoding request has exactly one (its last sampled token);
  * a prefilling request gets a chunk of its prompt, as large as the step's token budget allows
    (`max_num_batched_tokens`), so a long prompt shares steps with decoding requests instead of
    stalling them.

When a step computes a request's last known token, the step's sample for it is its next token.

Order of a step (vLLM's v1 policy):
  1. running requests, oldest first: each gets its next chunk or decode token. When the pool
     cannot hold a request's next positions, the NEWEST running request is preempted: its pages
     are released (full ones stay cached for prefix hits) and it goes back to the front of the
     waiting queue, to be recomputed from its tokens later. Nothing fails.
  2. then, if nothing was preempted, waiting requests are admitted in arrival order while there
     is budget, a free row (`max_num_seqs`) and room for the whole prompt. A prompt's pages are
     all allocated at admission (sharing cached prefix pages), so a prefill is never preempted
     for lack of a page halfway through its chunks unless decodes need them.

A request that could never fit (its prompt plus max_tokens beyond `max_context`, or more pages
than the whole pool) is rejected when it is added.

A request may arrive holding a sequence whose positions already hold a prefix of its prompt (a
chat's earlier turns): it is admitted onto those pages, reserving the rest, and with `keep_seq`
it keeps its sequence when it finishes instead of releasing it (its owner cuts it to
`known_positions()` once no step is in flight). Preempted, it loses the held positions like any other request.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from ..kv import BlockManager, Sequence
from .params import SamplingParams

WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass(eq=False)
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    seed: int
    token_ids: list[int] = field(default_factory=list)   # prompt + generated
    seq: Sequence = field(default_factory=Sequence)
    num_computed: int = 0
    status: str = WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0        # prompt tokens served by the prefix cache at first admission
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.perf_counter)
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finish_time: float | None = None
    # Set by the engine when the request is admitted:
    sampling_row: object | None = None     # runner.step.SamplingRow
    penalties: object | None = None        # the penalty entries, when a penalty is on
    stop_ids: set[int] = field(default_factory=set)
    detokenizer: object | None = None
    logprobs: list[dict[int, float]] | None = None
    sync: bool = False        # needs each step's results before the next is planned (penalties, logprobs)
    unresolved: int = 0       # sampled tokens launched but not yet read back (placeholders in token_ids)
    closed: bool = False      # finished by a stop or an abort: results still in flight are dropped
    matcher: object | None = None   # structured.Matcher: the grammar its text is held to
    spec: object | None = None      # speculative.SpecStats, when the engine speculates for this request
    spec_rng: object | None = None  # numpy Generator of its acceptance draws (sampling)
    keep_seq: bool = False          # keep the sequence's pages when finished (a chat's next turn reuses them)
    shares_prompt_with: Request | None = None  # a sibling (n > 1 choices) whose prompt pages this one shares

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_ids)

    @property
    def num_prompt(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    def known_positions(self) -> int:
        """Leading positions of the sequence whose tokens are known and were computed: never the last token
        (no step fed it for certain) nor one behind a placeholder. Once no step is in flight, what a held
        sequence may keep (ChatSession cuts it to this)."""
        known = next((i for i, t in enumerate(self.token_ids) if t < 0), len(self.token_ids))
        return max(0, min(self.seq.num_positions, self.num_computed, known, len(self.token_ids) - 1))


@dataclass(frozen=True, slots=True)
class ScheduledRow:
    request: Request
    start: int     # first position computed in this step
    count: int     # tokens computed in this step

    @property
    def samples(self) -> bool:
        """Whether this step's sample is the request's next token (it computes its last known token)."""
        return self.start + self.count == self.request.num_tokens


class Scheduler:
    def __init__(self, manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_context: int, watermark: float = 0.01):
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        self.manager = manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_context = max_context
        # Admission leaves this many pages free, so running requests can grow a while before
        # anything has to be preempted.
        self.watermark_pages = int(watermark * manager.num_pages)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    # ------------------------------------------------------------------ requests
    def check_fits(self, num_prompt: int, max_tokens: int) -> None:
        """Raise ValueError if a request of this size could never run."""
        total = num_prompt + max_tokens
        if total > self.max_context:
            raise ValueError(
                f"the prompt ({num_prompt} tokens) plus max_tokens ({max_tokens}) = {total} exceeds "
                f"max_context ({self.max_context}); shorten the prompt, lower max_tokens, or raise max_context")
        pages = self.manager.pages_for(total)
        if pages > self.manager.num_pages:
            raise ValueError(
                f"a request of {total} positions needs {pages} pages but the KV pool has only "
                f"{self.manager.num_pages}; lower max_tokens or give the cache more memory")

    def add(self, request: Request) -> None:
        self.check_fits(request.num_prompt, request.params.max_tokens)
        self.waiting.append(request)

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, request: Request, reason: str, stop_reason=None) -> None:
        """Mark a request finished and give its pages back at once.

        (A step still in flight may write into those pages; whoever gets them next writes later in
        the same stream, so that is harmless.)"""
        if request.status == RUNNING:
            self.running.remove(request)
            if not request.keep_seq:  # a held sequence stays as it is: its owner trims it (Request.known_positions)
                self.manager.release(request.seq)
        elif request.status == WAITING:  # preempted, then its last in-flight token ended it
            self.waiting.remove(request)
        request.status = FINISHED
        request.finish_reason = reason
        request.stop_reason = stop_reason
        request.finish_time = time.perf_counter()

    def abort(self, request: Request) -> None:
        """End a request where it stands: the tokens of steps still in flight are dropped with their
        placeholders, so its output holds only tokens read back."""
        if request.status != FINISHED:
            self.finish(request, "abort")
        request.closed = True
        if request.unresolved:
            del request.token_ids[len(request.token_ids) - request.unresolved:]
            request.unresolved = 0

    # ------------------------------------------------------------------ one step
    def schedule(self) -> list[ScheduledRow]:
        budget = self.max_num_batched_tokens
        rows: list[ScheduledRow] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            count = min(req.num_tokens - req.num_computed, budget)
            need = req.num_computed + count - req.seq.num_positions
            if need > 0:
                while not self.manager.try_reserve(req.seq, need):
                    self._preempt(self.running[-1])
                    preempted = True
                    if req.status != RUNNING:
                        break
                if req.status != RUNNING:
                    break  # it was the newest; everything after it is gone too
            rows.append(ScheduledRow(req, req.num_computed, count))
            budget -= count
            i += 1
        if not preempted:
            while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
                req = self.waiting[0]
                if self._sibling_computing(req):
                    break
                if self.manager.num_free_pages - self.manager.pages_for(req.num_tokens) < self.watermark_pages \
                        and self.running:
                    break
                cached = self._allocate(req)
                if cached is None:
                    break
                self.waiting.popleft()
                req.num_computed = cached
                if req.first_scheduled_time is None:  # first admission (not a readmission after preemption)
                    req.num_cached_tokens = cached
                    req.first_scheduled_time = time.perf_counter()
                req.status = RUNNING
                self.running.append(req)
                count = min(req.num_tokens - cached, budget)
                rows.append(ScheduledRow(req, cached, count))
                budget -= count
        return rows

    def _sibling_computing(self, req: Request) -> bool:
        """A request sharing a sibling's prompt waits, at its first admission, until the sibling's prompt is
        computed: then the prefix cache hands it those pages (all the full ones) instead of a second prefill."""
        lead = req.shares_prompt_with
        return (lead is not None and self.manager.enable_prefix_caching and req.first_scheduled_time is None
                and lead.status != FINISHED and lead.num_computed < lead.num_prompt)

    def _allocate(self, req: Request) -> int | None:
        """Pages for a waiting request's prompt; how many leading positions are cached already (None: no room).
        A held sequence keeps its positions (at most all but the prompt's last token, whose logits start the
        reply) and reserves the rest; an empty one shares the prefix cache's pages."""
        seq = req.seq
        if seq.num_positions:
            held = min(seq.num_positions, req.num_tokens - 1)
            self.manager.truncate(seq, held)
            if not self.manager.can_reserve(seq, req.num_tokens - held):
                return None
            self.manager.reserve(seq, req.num_tokens - held)
            return held
        if not self.manager.can_allocate_prompt(seq, req.token_ids):
            return None
        return self.manager.allocate_prompt(seq, req.token_ids)

    def _preempt(self, req: Request) -> None:
        """Release a running request's pages; it is recomputed from its tokens when readmitted."""
        self.running.remove(req)
        self.manager.release(req.seq)
        req.num_computed = 0
        req.status = WAITING
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def update(self, rows: list[ScheduledRow]) -> None:
        """Record that a step was launched for these rows (before their samples are appended), and
        name the pages it fills whose tokens are all known (see `register`)."""
        for row in rows:
            row.request.num_computed = row.start + row.count
        self.register(rows)

    def register(self, rows: list[ScheduledRow]) -> None:
        """Prefix caching: name the pages these rows fill. A page may be named as soon as its step is
        launched: a later prompt that shares it reads it in a later step, after this one wrote it.
        Rows whose token is still a placeholder (sampled by the step in flight) wait: call again
        once the token is known. Naming a page twice is a no-op."""
        if not self.manager.enable_prefix_caching:
            return
        ps = self.manager.page_size
        for row in rows:
            req = row.request
            end = row.start + row.count
            if end // ps > row.start // ps and req.status == RUNNING and req.seq.num_positions >= end \
                    and req.token_ids[end - 1] >= 0 and req.token_ids[row.start] >= 0:
                self.manager.cache_full_pages(req.seq, req.token_ids[:end])
