"""The engine loop: schedule -> run -> accept, the one path every request takes.

`LLM.generate`, `generate`, `ChatSession` and the server all add requests here and call `step()`:

  1. schedule: the Scheduler picks this step's rows (decode tokens and prompt chunks, continuous
     batching, preemption when the pool runs out);
  2. run: the runner launches the step (runner/gpu.py or runner/cpu.py); decoding requests that
     speculate instead get a draft-propose / verify round (`_verify`);
  3. accept: the sampled tokens are appended, the detokenizer, stop strings, stop tokens, logprobs
     and max_tokens see them, finished requests free their pages.

Steps are pipelined: step k + 1 is planned and launched while step k runs on the GPU, and step k's
tokens are read back afterwards. A decode row whose token step k has not returned yet takes it straight
from the device (the runner's token_src); the host keeps a placeholder (-1) in the request's tokens
until the value arrives. A request that step k ends (EOS, a stop) may still be in step k + 1: that
row's result is dropped. Requests with penalties or logprobs need every token before the next step is
planned, and so do speculative rounds; while one is running, steps are not pipelined.

Structured output stays pipelined: a step's bitmasks are computed after it is launched, as soon as the
matchers have consumed the tokens of the step before it (`_finish(..., then_masks_of=)`), so each
matcher has seen every token before the one it constrains; the GPU runs the step's forward meanwhile
and its sampling waits for them. That grammar work runs on a background thread (structured.Grammars.start)
while this one accepts the tokens, schedules and launches the next step (the runner queues it behind
the one waiting for its masks); it is waited for before a step is read back (`_wait_grammar`), and only
that thread touches the matchers meanwhile.

A request may hold a sequence from before (a chat's earlier turns, `Request.seq` with positions already
computed, `keep_seq=True`): it is admitted onto its held pages, and when it finishes it keeps them.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np

from ..config import EngineConfig
from ..cuda import CudaError
from ..kv import BlockManager
from ..model.tokenizer import encode_text
from ..runner.step import SamplingRow
from ..runner.tensor_parallel import WorkerError
from .detokenize import IncrementalDetokenizer
from .outputs import EngineStats, RequestOutput
from .params import SamplingParams
from .scheduler import FINISHED, Request, ScheduledRow, Scheduler
from .speculative import SpecStats, accept
from .structured import Grammars, GrammarStep

log = logging.getLogger(__name__)

Event = tuple[Request, int, str]  # (request, new token, the text it completes)


@dataclass
class _InFlight:
    """A launched step: its rows, the slot of its samples, (row, request, token index) of every
    placeholder it will fill, and the requests of its masked rows (in row order) until their bitmasks
    are published."""
    rows: list[ScheduledRow]
    slot: int | None
    samplers: list[tuple[int, Request, int]]
    masked: list[Request] = field(default_factory=list)

    @property
    def decode(self) -> bool:
        """Every row is one new token (no prompt chunk)."""
        return all(r.count == 1 for r in self.rows)


@dataclass
class _Penalties:
    """One request's sampler entries: every distinct prompt/output token and its output count (with a penalty
    on), the tokens it bans (count -1) until its min_tokens-th output token, and its logit bias (a token only
    biased: count -2)."""
    index: dict[int, int] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    banned: list[int] = field(default_factory=list)
    ban_until: int = 0   # output tokens before which `banned` is in force
    bias: dict[int, float] = field(default_factory=dict)

    def add(self, token: int, output: bool) -> None:
        at = self.index.get(token)
        if at is None:
            self.index[token] = at = len(self.ids)
            self.ids.append(token)
            self.counts.append(0)
        if output:
            self.counts[at] += 1

    def arrays(self, num_output: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """The entries (ids, counts, biases) for sampling output token `num_output` (None: nothing to apply)."""
        banned = set(self.banned) if num_output < self.ban_until else set()
        ids = self.ids + [t for t in self.bias if t not in self.index]
        ids += [t for t in banned if t not in self.index and t not in self.bias]
        if not ids:
            return None
        counts = [-1 if t in banned else self.counts[self.index[t]] if t in self.index else -2 for t in ids]
        return (np.asarray(ids, np.int32), np.asarray(counts, np.int32),
                np.asarray([self.bias.get(t, 0.0) for t in ids], np.float32))


def sampling_row(params: SamplingParams, seed: int) -> SamplingRow:
    """A request's SamplingParams packed as the sampling kernel reads them."""
    return SamplingRow(temperature=float(params.temperature), top_k=int(params.top_k), top_p=float(params.top_p),
                       min_p=float(params.min_p), seed=seed, repetition=float(params.repetition_penalty),
                       presence=float(params.presence_penalty), frequency=float(params.frequency_penalty))


class Engine:
    """Requests, a scheduler and a runner (plus, speculating, a drafter with its own cache)."""

    def __init__(self, config: EngineConfig, runner, tokenizer, eos_token_ids, drafter=None):
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.drafter = drafter
        # A DFlash drafter reads the target's hidden states at every position a step computes.
        self._feeds_drafter = drafter is not None and bool(drafter.target_layer_ids)
        if self._feeds_drafter:
            runner.capture_hidden_states(drafter.target_layer_ids)
        manager: BlockManager = runner.cache.manager
        self.scheduler = Scheduler(manager, max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=runner.max_batch_tokens, max_context=config.max_context)
        self.stats = EngineStats()
        self.broken: str | None = None  # the CUDA error that stopped the engine
        self._next_id = 0
        self._inflight: _InFlight | None = None
        self._last_rows: dict[int, int] = {}  # request id -> its row in the step in flight (if it samples)
        self._grammars: Grammars | None = None  # made for the first structured-output request
        self._grammar_step: GrammarStep | None = None  # grammar work in the background (until _wait_grammar)

    # ------------------------------------------------------------------ requests
    def prompt_ids(self, prompt, index: int = 0) -> tuple[list[int], str | None]:
        """A prompt (text, UTF-8 bytes or token ids) as token ids, and its text; ValueError if unusable."""
        if isinstance(prompt, (bytes, bytearray)):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"prompt {index} is not valid UTF-8 ({e}); pass text (str) or token ids") from None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is empty: give some text or token ids")
            return encode_text(self.tokenizer, prompt, f"prompt {index}"), prompt
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is an empty token list")
        vocab = self.runner.config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt {index}: token ids {bad[:5]} outside the vocabulary [0, {vocab})")
        return ids, None

    def make_request(self, prompt_ids: list[int], params: SamplingParams, *, seq=None, keep_seq: bool = False,
                     shares_prompt_with: Request | None = None) -> Request:
        """A request for these tokens (checked to fit); seq: a held sequence whose positions hold a prefix;
        shares_prompt_with: an earlier request of the same prompt (another of n choices), whose computed
        prompt pages this one takes from the prefix cache."""
        self.scheduler.check_fits(len(prompt_ids), params.max_tokens)
        vocab = self.runner.config.vocab_size
        outside = sorted(t for t in params.logit_bias or {} if t >= vocab)
        if outside:
            raise ValueError(f"logit_bias: token ids {outside[:5]} are outside the vocabulary [0, {vocab})")
        req = Request(request_id=self._next_id, prompt_ids=prompt_ids, params=params, seed=params.resolved_seed())
        if seq is not None:
            req.seq = seq
        req.keep_seq = keep_seq
        req.shares_prompt_with = shares_prompt_with
        if params.structured_outputs is not None:
            if self.config.tensor_parallel_size > 1:
                raise ValueError("structured output is not supported with tensor_parallel_size > 1")
            if self._grammars is None:
                self._grammars = Grammars(self.tokenizer, self.runner.config.vocab_size, self.eos_token_ids)
            req.matcher = self._grammars.matcher(params.structured_outputs)
        self._next_id += 1
        return req

    def add(self, req: Request, *, stream: bool = False) -> None:
        """Queue a request: its sampling row, penalties, detokenizer and stops are set up here."""
        self._check_usable()
        p = req.params
        req.sampling_row = sampling_row(p, req.seed)
        req.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        req.penalties = None
        if p.has_penalties or p.min_tokens or p.logit_bias:
            req.penalties = _Penalties(banned=sorted(req.stop_ids), ban_until=p.min_tokens,
                                       bias=dict(p.logit_bias or {}))
            for t in req.prompt_ids if p.has_penalties else ():
                req.penalties.add(t, output=False)
        if p.stop or stream:
            req.detokenizer = IncrementalDetokenizer(
                self.tokenizer, skip_special_tokens=p.skip_special_tokens, stop=p.stop,
                include_stop_str_in_output=p.include_stop_str_in_output)
        if p.logprobs is not None:
            req.logprobs = []
        # a ban needs only the count of tokens (known ahead); penalties and logprobs need the tokens
        req.sync = p.has_penalties or p.logprobs is not None
        if self.drafter is not None and not req.sync and not p.min_tokens and not p.logit_bias \
                and req.matcher is None:
            # speculating: one token a step for the others (a grammar would have to check every proposal, a
            # bias or a ban would change the verify step's argmax)
            req.spec = SpecStats()
            req.spec_rng = np.random.default_rng(req.seed)
        self.scheduler.add(req)
        self.stats.prompt_tokens += req.num_prompt

    def abort(self, req: Request) -> None:
        self.scheduler.abort(req)
        if self.drafter is not None:
            self.drafter.release(req.request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    def output(self, req: Request, prompt: str | None = None) -> RequestOutput:
        out_ids = req.output_ids
        if req.detokenizer is not None:
            if req.status == FINISHED:
                req.detokenizer.flush()
            text = req.detokenizer.text
        else:
            text = self.tokenizer.decode(out_ids, skip_special_tokens=req.params.skip_special_tokens)
        t0 = req.arrival_time
        return RequestOutput(
            request_id=req.request_id, prompt=prompt, prompt_token_ids=req.prompt_ids, text=text, token_ids=out_ids,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason, logprobs=req.logprobs,
            num_cached_tokens=req.num_cached_tokens, num_preemptions=req.num_preemptions,
            time_to_first_token=(req.first_token_time - t0) if req.first_token_time else 0.0,
            seconds=(req.finish_time - t0) if req.finish_time else 0.0, speculation=req.spec)

    # ------------------------------------------------------------------ one step
    def step(self) -> list[Event]:
        """Launch the next step (if any) and finish the previous one; (request, new token, new text) for
        every token read back.

        A CUDA error (often reported at the next synchronisation, not at the launch that caused it)
        leaves the device state unknown: the engine refuses all further work and says why."""
        self._check_usable()
        start = time.perf_counter()
        try:
            events = self._speculative_step() if self.drafter is not None else self._pipelined_step()
        except (CudaError, WorkerError) as e:  # (a tensor-parallel rank lost: the group was aborted)
            self.broken = str(e)
            if "OUT_OF_MEMORY" in str(e):
                raise MemoryError(f"the GPU ran out of memory during a step ({e}); another process probably took "
                                  f"memory after start-up. Start with a lower gpu_memory_utilization.") from None
            raise
        self.stats.step_seconds += time.perf_counter() - start
        self.stats.preemptions = self.scheduler.num_preemptions
        return events

    def _pipelined_step(self) -> list[Event]:
        start = time.perf_counter()
        events: list[Event] = []
        finished = None  # the last step this iteration waited for: its time is counted as that step's
        sync = not self.config.async_scheduling or self._sync_needed()
        if sync and self._inflight is not None:
            events += self._finish(self._inflight)
            finished, self._inflight = self._inflight, None
        rows = self.scheduler.schedule() if self.scheduler.has_unfinished else []
        launched = self._launch(rows) if rows else None
        if self._inflight is not None:  # (an error in it leaves `launched` waiting: closing releases it)
            events += self._finish(self._inflight, then_masks_of=launched)
            finished = self._inflight
        else:
            self._publish_masks(launched)
        self._inflight = launched
        if launched is not None and sync:
            events += self._finish(launched)
            finished, self._inflight = launched, None
        self._check_progress(launched is not None, events)
        if finished is not None and finished.decode:
            self.stats.decode_seconds += time.perf_counter() - start
        return events

    def _speculative_step(self) -> list[Event]:
        """Rows that are one decoding token of a request that speculates get a round (`_verify`); the others
        (prompt chunks, requests with penalties or logprobs) run first as a plain step. Not pipelined: a
        round's proposals depend on every token before them."""
        events: list[Event] = []
        rows = self.scheduler.schedule() if self.scheduler.has_unfinished else []
        speculates = [r.count == 1 and r.samples and r.request.spec is not None for r in rows]
        plain = [r for r, s in zip(rows, speculates) if not s]
        if plain:
            step = self._launch(plain)
            self._publish_masks(step)
            events += self._finish(step)
            if self._feeds_drafter:
                self._feed_drafter(plain)
        spec = [r for r, s in zip(rows, speculates) if s]
        if spec:
            events += self._verify(spec)
        live = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        for rid in [rid for rid in self.drafter.held if rid not in live]:
            self.drafter.release(rid)  # finished or aborted: its draft pages go back
        self._check_progress(bool(rows), events)
        return events

    def _feed_drafter(self, rows: list[ScheduledRow]) -> None:
        """A DFlash drafter's context: every position these rows computed (the step's rows, in order), for the
        requests that speculate."""
        items, at = [], 0
        for r in rows:
            if r.request.spec is not None:
                items.append((r.request.request_id, r.start, at, r.count))
            at += r.count
        self.drafter.add_context(items)

    def _check_progress(self, ran: bool, events: list) -> None:
        """A step that ran nothing and returned nothing while requests wait would loop forever."""
        if not ran and not events and self.scheduler.has_unfinished:
            raise RuntimeError("the scheduler found nothing to run although requests are unfinished; "
                               "this is a bug in the scheduler")

    def _sync_needed(self) -> bool:
        return any(r.sync for r in self.scheduler.running) or any(r.sync for r in self.scheduler.waiting)

    # ------------------------------------------------------------------ run
    def _step_inputs(self, rows: list[ScheduledRow]):
        """The runner's rows (sequence, token ids, start), their sampling rows and, per row, the previous step's
        row whose sample is its token (-1: the token is known on the host)."""
        batch, sampling, token_src = [], [], []
        for r in rows:
            req = r.request
            ids = req.token_ids[r.start:r.start + r.count]
            src = -1
            if ids[-1] < 0:  # sampled by the step in flight: read it on the device
                assert r.count == 1, "a placeholder token inside a prefill chunk"
                src = self._last_rows[req.request_id]
                ids = [0]
            batch.append((req.seq, ids, r.start))
            sampling.append(req.sampling_row)
            token_src.append(src)
        return batch, sampling, token_src

    def _launch(self, rows: list[ScheduledRow]) -> _InFlight:
        samples = [r.samples for r in rows]  # once: the placeholders appended below change what it says
        batch, sampling, token_src = self._step_inputs(rows)
        penalties = None
        if any(r.request.penalties is not None for r in rows):
            penalties = [r.request.penalties.arrays(r.request.num_output) if r.request.penalties is not None
                         and s else None for r, s in zip(rows, samples)]
        masked = [r.request.matcher is not None and s for r, s in zip(rows, samples)] \
            if self._grammars is not None else []
        slot = self.runner.launch(batch, sampling, sample=any(samples), penalties=penalties,
                                  masked=masked if any(masked) else None,
                                  token_src=token_src if max(token_src) >= 0 else None)
        self.scheduler.update(rows)
        self._count_step(rows, samples)
        samplers = []
        self._last_rows = {}
        for i, r in enumerate(rows):
            if not samples[i]:
                continue
            req = r.request
            samplers.append((i, req, len(req.token_ids)))
            req.token_ids.append(-1)
            req.unresolved += 1
            self._last_rows[req.request_id] = i
            if len(req.token_ids) - req.num_prompt >= req.params.max_tokens:
                self.scheduler.finish(req, "length")  # known now; its last token arrives with this step
        return _InFlight(rows, slot, samplers, [r.request for r, m in zip(rows, masked) if m])

    def _publish_masks(self, step: _InFlight | None) -> None:
        """A launched step's bitmasks, each from its matcher's state after every token of the steps before
        it, written in one parallel call into the runner's staging rows. A request ended since the launch
        gets an all-allowing mask: its row's sample is dropped."""
        if step is None or not step.masked:
            return
        start = time.perf_counter()
        matchers = [None if req.closed else req.matcher for req in step.masked]
        step.masked = []
        self.runner.publish_masks(lambda out: self._grammars.fill_masks(matchers, out))
        self.stats.grammar_seconds += time.perf_counter() - start

    def _count_step(self, rows: list[ScheduledRow], samples: list[bool]) -> None:
        s = self.stats
        decode = all(r.count == 1 for r in rows)
        s.steps += 1
        s.graph_steps += int(decode and self.runner.use_graphs)
        s.decode_steps += int(decode)
        s.decode_rows += len(rows) if decode else 0
        s.decode_positions += sum(r.start + 1 for r in rows) if decode else 0
        s.computed_tokens += sum(r.count for r in rows)
        s.prefill_tokens += sum(r.count for r, sampled in zip(rows, samples)
                                if not (r.count == 1 and sampled and r.start >= len(r.request.prompt_ids)))

    # ------------------------------------------------------------------ accept
    def _finish(self, step: _InFlight, then_masks_of: _InFlight | None = None) -> list[Event]:
        """Read a step's tokens back and accept them. then_masks_of: the step launched after it, whose masks
        are published as soon as the matchers have consumed these tokens (before the detokenizer and the
        stop checks run: a request they end drops that step's row anyway)."""
        self._wait_grammar()
        if step.slot is None:
            # A step that samples nothing (prompt chunks only) advances no matcher, so the next step's masks are
            # known now; and waiting for it waits for the device's whole queue, that next step included, whose
            # sampling waits for its masks.
            self._publish_masks(then_masks_of)
        sampled = self.runner.collect(step.slot, len(step.rows))
        self.scheduler.register(step.rows)
        # requests ended by a stop or an abort in an earlier step are skipped (their placeholders are gone)
        live = [(i, req, index) for i, req, index in step.samplers if not req.closed]
        constrained = [(i, req.matcher) for i, req, _ in live if req.matcher is not None]
        grammar = self._start_grammar(constrained, sampled, then_masks_of)
        logprob_rows = [i for i, req, _ in live if req.logprobs is not None]
        logprobs = self._logprobs(logprob_rows, step.rows, sampled) if logprob_rows else {}
        events = {}
        for i, req, index in live:  # the unconstrained ones while the matchers advance
            req.unresolved -= 1
            token = int(sampled[i])
            req.token_ids[index] = token
            if req.matcher is None:
                events[i] = self._accept(req, index, token, logprobs.get(i))
        if constrained:
            errors, done = grammar.consumed.result()
            verdicts = {i: (e, d) for (i, _), e, d in zip(constrained, errors, done)}
            for i, req, index in live:
                if req.matcher is not None:
                    events[i] = self._accept(req, index, req.token_ids[index], logprobs.get(i), *verdicts[i])
        if grammar is not None and grammar.published is None:
            self._wait_grammar()  # no next step's masks to overlap with
        return [events[i] for i, _, _ in live]

    def _start_grammar(self, constrained: list[tuple[int, object]], sampled,
                       then_masks_of: _InFlight | None) -> GrammarStep | None:
        """In the background: the step's constrained requests' matchers advanced by their tokens (together),
        then the next step's masks from them (published to the runner). None if there is nothing to do."""
        masked = then_masks_of.masked if then_masks_of is not None else []
        if not constrained and not masked:
            return None
        matchers = [None if req.closed else req.matcher for req in masked] if masked else None
        if then_masks_of is not None:
            then_masks_of.masked = []
        self._grammar_step = self._grammars.start([(m, int(sampled[i])) for i, m in constrained], matchers,
                                                  self.runner.publish_masks)
        return self._grammar_step

    def _wait_grammar(self) -> None:
        """Until the grammar work in the background is done (before the runner or the matchers are used)."""
        if self._grammar_step is None:
            return
        step, self._grammar_step = self._grammar_step, None
        try:
            step.wait()
        finally:
            self.stats.grammar_seconds += self._grammars.background_seconds
            self._grammars.background_seconds = 0.0

    def _accept(self, req: Request, index: int, token: int, logprobs, refused: str | None = None,
                grammar_done: bool = False) -> Event:
        """A token read back: the detokenizer, penalties, logprobs and the stop checks see it (its matcher
        has consumed it already: refused is the grammar's error if it did not allow it, grammar_done whether
        the grammar is complete after it)."""
        self.stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        if req.penalties is not None and req.params.has_penalties:
            req.penalties.add(token, output=True)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        # before min_tokens no stop string is looked for (EOS and stop ids cannot be sampled then)
        text = req.detokenizer.add(token, find_stop=index - req.num_prompt + 1 >= req.params.min_tokens) \
            if req.detokenizer is not None else ""
        if refused is not None:  # this request cannot go on; the others can
            log.error("request %d: the grammar refused token %d sampled under its mask: %s", req.request_id,
                      token, refused)
            self._end(req, index, "abort", "grammar")
            return req, token, text
        stop = None
        if token in req.stop_ids:
            stop = token
        elif req.detokenizer is not None and req.detokenizer.stopped_by is not None:
            stop = req.detokenizer.stopped_by
        if stop is not None or grammar_done:
            self._end(req, index, "stop", stop)
        return req, token, text

    def _end(self, req: Request, index: int, reason: str, stop_reason) -> None:
        """Finish a request at its token `index`: tokens launched after it are dropped."""
        req.closed = True
        req.unresolved = 0
        del req.token_ids[index + 1:]
        self.scheduler.finish(req, reason, stop_reason)

    def _logprobs(self, indices: list[int], rows: list[ScheduledRow], sampled) -> dict[int, dict[int, float]]:
        """Top-n log-probabilities (of the logits after penalties, before temperature) per row."""
        self._wait_grammar()
        logits = self.runner.logits_rows(max(indices) + 1)
        out = {}
        for i in indices:
            n = rows[i].request.params.logprobs
            row = logits[i].astype(np.float64)
            m = row.max()
            lp = row - (m + np.log(np.exp(row - m).sum()))
            top = np.argpartition(-lp, n)[:n] if n else np.array([], np.int64)
            top = top[np.argsort(-lp[top], kind="stable")]
            entry = {int(t): float(lp[t]) for t in top}
            entry[int(sampled[i])] = float(lp[int(sampled[i])])
            out[i] = entry
        return out

    # ------------------------------------------------------------------ speculation
    def _proposal_counts(self, rows: list[ScheduledRow]) -> list[tuple[int, list[int], int]]:
        """(request id, committed tokens, k) per row, k positions reserved: at most num_draft_tokens, none past
        max_tokens (a round always emits one token more), none the pool or the verify step has no room for."""
        manager = self.scheduler.manager
        room = self.runner.max_verify_tokens - len(rows)
        items = []
        for r in rows:
            req = r.request
            k = min(self.config.num_draft_tokens, req.params.max_tokens - req.num_output - 1, room)
            if k > 0 and manager.can_reserve(req.seq, k):
                room -= k
                manager.reserve(req.seq, k)
            else:
                k = 0
            items.append((req.request_id, req.token_ids, k))
        return items

    def _verify(self, rows: list[ScheduledRow]) -> list[Event]:
        """One speculative round for these decode rows: the draft's proposals, one target step over every
        row's last token and proposals, each request's accepted tokens, both caches rolled back. Drafts the
        drafter leaves on the GPU are read there by the verify step, and a DFlash drafter's context pass over
        the step's positions is launched while the step runs (rollback cuts the rejected ones after): the host
        waits for the device once a round."""
        items = self._proposal_counts(rows)
        proposals = self.drafter.propose(items)
        known = None if proposals.device is not None else proposals.tokens()
        batch, context, at = [], [], 0
        for i, (r, (_, _, k), m) in enumerate(zip(rows, items, proposals.counts)):
            if m < k:  # the draft's pool had no room for this request
                self.scheduler.manager.truncate(r.request.seq, r.start + 1 + m)
            batch.append((r.request.seq, [r.request.token_ids[-1]] + (known[i] if known is not None else [0] * m),
                          r.start))
            context.append((r.request.request_id, r.start, at, m + 1))
            at += m + 1
        greedy = all(not r.request.params.temperature > 0 for r in rows)
        width = self.config.num_draft_tokens + 1 if self.runner.use_graphs else None
        # A greedy round's verdict is the argmaxes: a DFlash drafter may draft the next round from them on the
        # device while the host reads this one.
        ahead = self.config.num_draft_tokens if greedy else 0
        out = self.runner.verify(batch, logits="argmax" if greedy else "all", graph_width=width,
                                 drafted=proposals.device,
                                 meanwhile=(lambda: self.drafter.add_context(context, then_draft=ahead))
                                 if self._feeds_drafter else None)
        self.scheduler.update(rows)
        self.stats.steps += 1
        self.stats.computed_tokens += at
        events, at = [], 0
        for r, props in zip(rows, proposals.tokens()):
            p_rows = out[at: at + len(props) + 1]
            if not greedy and not r.request.params.temperature > 0:
                p_rows = p_rows.argmax(axis=1)
            events += self._accept_round(r, props, p_rows)
            at += len(props) + 1
        return events

    def _accept_round(self, r: ScheduledRow, props: list[int], p_rows) -> list[Event]:
        """A request's round accepted: its events; the target's and the drafter's sequences cut to what it
        keeps."""
        req = r.request
        emitted, accepted = accept(props, p_rows, req.params, req.spec_rng)
        st = req.spec
        st.target_steps += 1
        st.drafted += len(props)
        st.accepted += accepted
        st.emitted += len(emitted)
        keep = r.start + 1 + accepted  # the target keeps the committed tokens but the last (fed next round)
        self.scheduler.manager.truncate(req.seq, keep)
        req.num_computed = keep
        events = []
        for token in emitted:
            index = len(req.token_ids)
            req.token_ids.append(token)
            events.append(self._accept(req, index, token, None))
            if req.closed:
                break
            if req.num_output >= req.params.max_tokens:
                self.scheduler.finish(req, "length")
                break
        if req.status == FINISHED:
            return events
        self.scheduler.register([ScheduledRow(req, r.start, 1 + accepted)])
        self.drafter.rollback(req.request_id, req.token_ids)
        return events

    # ------------------------------------------------------------------ lifetime
    def drain(self) -> None:
        """Collect a step still in flight (launched ahead for requests that have finished since)."""
        if self._inflight is not None and not self.broken:
            self._finish(self._inflight)
            self._inflight = None
        self._wait_grammar()

    def _check_usable(self) -> None:
        if self.broken:
            raise RuntimeError(f"this engine stopped after a GPU error ({self.broken}); its results can no longer "
                               f"be trusted: close it and create a new one")
