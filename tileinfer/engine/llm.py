"""LLM: many requests at once over one model, continuous batching, prefix caching.

    with tileinfer.LLM("path/to/Qwen3-0.6B") as llm:
        outs = llm.generate(["Hello", "The capital of France is"], SamplingParams(max_tokens=32))
        for o in outs:
            print(o.text, o.finish_reason)

Start-up (sizes the page pool from what NVML says is free, after a worst-case warm-up):
  1. the CUDA context, weights and workspace (activations for the largest step);
  2. a warm-up on a small temporary cache: the largest prefill chunk, then a decode step of
     every batch bucket (this loads every kernel), then every decode graph captured once to
     measure what graphs take; the temporary cache and graphs are freed;
  3. the pool: floor((floor(u x total) - used - reserve) / bytes per page) pages, u =
     gpu_memory_utilization (a fraction of the device's TOTAL memory; see kv/sizing.py for why),
     reserve = the measured graph memory plus a margin; or exactly `num_pages` / `max_tokens`;
  4. every decode graph captured over the real pool; the memory report is logged.
After that nothing is allocated: steps only launch kernels over persistent buffers.

Each step (`_step`): the scheduler picks rows (decode tokens and prefill chunks), the model
runs them (a graph replay when every row is one decode token), and the sampled tokens are
appended; finished requests free their pages at once.

Speculative decoding (`draft_model=`, `num_draft_tokens=k`): a second, smaller model with the same
vocabulary runs on its own pool (as many pages as the target's, the memory split between them). Each
step, every decoding request without penalties or logprobs gets k greedy proposals from the draft
(batched), and one target step checks all of them (`Model.verify`); each request keeps the longest
accepted prefix plus one token of the target's: under greedy the target's argmax at every position
(token for token what plain decoding gives when batch_invariant; otherwise kernels of other shapes
may break near-ties differently), under sampling by rejection sampling, so the tokens follow the
target's distribution (engine/spec_batch.py). Steps are then not pipelined, and the verify step
runs eagerly (with TILEINFER_VERIFY_GRAPHS=1 it replays a graph per batch bucket and k: GPU-tested,
not yet benchmarked). The target's logits workspace holds max_num_seqs x (k + 1) rows for the
verify step (float32 over the vocabulary: 0.78 GB for 256 sequences and k = 4).
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..cuda import CudaError, allocated_bytes, get_device, pci_bus_id
from ..kv import Sequence
from ..kv.paged_cache import check_kv_quantize
from ..kv import sizing
from ..model.checkpoint import Checkpoint
from .detokenize import IncrementalDetokenizer
from .memory_report import MemoryReport
from .model import Model
from .params import SamplingParams
from .scheduler import FINISHED, Request, ScheduledRow, Scheduler
from .spec_batch import DraftRunner
from .speculative import Sampling, SpecStats, accept, check_count, check_draft_model
from .step import SamplingRow

log = logging.getLogger(__name__)

GRAPH_RESERVE_MARGIN = 1.25          # graphs measured during warm-up, times this, are kept free
FIXED_RESERVE_BYTES = 256 * 1024**2  # and this much more (driver growth, allocator granularity)


@dataclass
class RequestOutput:
    """What one request produced. `text` excludes a matched stop string (unless asked)."""
    request_id: int
    prompt: str | None
    prompt_token_ids: list[int]
    text: str
    token_ids: list[int]
    finish_reason: str | None          # "stop" (EOS, stop token or stop string), "length", or None
    stop_reason: str | int | None = None  # the stop string or token id that ended it
    logprobs: list[dict[int, float]] | None = None
    num_cached_tokens: int = 0         # prompt tokens served by the prefix cache
    num_preemptions: int = 0
    time_to_first_token: float = 0.0   # seconds from generate() to the first new token
    seconds: float = 0.0               # seconds from generate() to the end
    speculation: SpecStats | None = None  # drafted, accepted, target steps: when a draft model speculated

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class StreamOutput:
    """New tokens of one request from one step of `generate_stream`."""
    index: int                 # position of the request in the prompts given
    request_id: int
    token_ids: list[int]       # the new token(s)
    text: str                  # the new text they complete (may be "" mid-character or near a stop string)
    finished: bool
    finish_reason: str | None = None


@dataclass
class EngineStats:
    steps: int = 0
    graph_steps: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    computed_tokens: int = 0      # prefill and decode tokens run through the model
    prefill_tokens: int = 0       # prompt (and recomputed) positions run through the model
    generated_tokens: int = 0
    preemptions: int = 0
    step_seconds: float = 0.0
    # Steps of one new token per row (a decode graph's shape), their rows, and the wall time of the
    # engine iterations that finished one. With async scheduling an iteration launches step n + 1 and
    # then waits for step n, so its time is step n's (the GPU's, when the GPU is the bottleneck).
    decode_steps: int = 0
    decode_rows: int = 0
    decode_positions: int = 0     # cached positions those rows' attention read (each row's start + 1)
    decode_seconds: float = 0.0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _InFlight:
    """A launched step: its rows, the pinned slot of its samples, and (row, request, token index)
    of every placeholder it will fill."""
    rows: list[ScheduledRow]
    slot: int | None
    samplers: list[tuple[int, Request, int]]

    @property
    def decode(self) -> bool:
        """Every row is one new token (no prompt chunk)."""
        return all(r.count == 1 for r in self.rows)


@dataclass
class _Penalties:
    """One request's penalty entries: every distinct prompt/output token and its output count."""
    index: dict[int, int] = field(default_factory=dict)
    ids: list[int] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)

    def add(self, token: int, output: bool) -> None:
        at = self.index.get(token)
        if at is None:
            self.index[token] = at = len(self.ids)
            self.ids.append(token)
            self.counts.append(0)
        if output:
            self.counts[at] += 1

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        return np.asarray(self.ids, np.int32), np.asarray(self.counts, np.int32)


@dataclass(frozen=True, slots=True)
class StartupTimes:
    """Where an LLM's start-up went (seconds): loading the weights; compiling (0 kernels with a warm
    disk cache) and loading every kernel; the warm-up (the largest prefill chunk, a decode step per
    bucket and a first capture, on a temporary cache, to measure their memory); capturing every
    decode graph over the real pool. `total` also counts sizing and allocating the pool."""
    total: float
    weights: float
    kernels: float
    kernels_compiled: int
    warm_up: float
    capture: float
    graphs: int

    def format(self) -> str:
        return (f"start-up {self.total:.2f} s: weights {self.weights:.2f} s, kernels {self.kernels:.2f} s "
                f"({self.kernels_compiled} compiled), warm-up {self.warm_up:.2f} s, {self.graphs} decode graphs "
                f"captured in {self.capture:.2f} s")


class LLM:
    def __init__(self, model: str | Path, *, max_num_seqs: int = 256, max_context: int = 4096, page_size: int = 64,
                 enable_prefix_caching: bool = True, max_num_batched_tokens: int = 4096,
                 gpu_memory_utilization: float = sizing.DEFAULT_UTILIZATION, num_pages: int | None = None,
                 max_tokens: int | None = None, kv_quantize: str | None = None, use_graphs: bool = True,
                 batch_invariant: bool = False, async_scheduling: bool = True, device: int = 0,
                 progress: bool = True, kv_smoothing: bool = True, draft_model: str | Path | None = None,
                 num_draft_tokens: int = 4):
        path = Path(model)
        if draft_model is not None:
            check_count("num_draft_tokens", num_draft_tokens)
        self.kv_quantize = "int8" if check_kv_quantize(kv_quantize) else None
        self.kv_smoothing = bool(kv_smoothing)
        for name, value in (("max_num_seqs", max_num_seqs), ("max_context", max_context), ("page_size", page_size),
                            ("max_num_batched_tokens", max_num_batched_tokens)):
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if num_pages is not None and max_tokens is not None:
            raise ValueError("give at most one of num_pages or max_tokens (or neither, to size from free memory)")
        sizing.check_utilization(gpu_memory_utilization)
        config = Checkpoint.open(path).config  # validates the checkpoint before touching the GPU
        if max_context > config.max_position_embeddings:
            raise ValueError(f"max_context {max_context} exceeds the model's {config.max_position_embeddings} "
                             f"positions (max_position_embeddings in config.json)")
        self.max_num_seqs = max_num_seqs
        self.max_context = max_context
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self.batch_invariant = batch_invariant
        self.stats = EngineStats()
        self._next_id = 0
        self._requests: dict[int, Request] = {}  # queued with add_request
        self._broken: str | None = None          # the CUDA error that stopped the engine
        self.async_scheduling = async_scheduling
        self._inflight: _InFlight | None = None
        self._last_rows: dict[int, int] = {}  # request id -> its row in the step in flight (if it samples)
        self._closed = False
        self.model: Model | None = None
        self.num_draft_tokens = num_draft_tokens if draft_model is not None else 0
        # Verify steps replaying a graph per (batch bucket, k) (Model.verify's graph_width): off until
        # benchmarked (its GPU tests pass); TILEINFER_VERIFY_GRAPHS=1 turns it on.
        self._verify_graphs = os.environ.get("TILEINFER_VERIFY_GRAPHS", "0") == "1"
        self.draft: Model | None = None           # the draft model (speculative decoding), on its own cache
        self.drafter: DraftRunner | None = None
        try:
            self._start(path, device, max_num_batched_tokens, gpu_memory_utilization, num_pages, max_tokens,
                        use_graphs, progress, draft_model)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ start-up
    def _start(self, path, device, max_num_batched_tokens, utilization, num_pages, max_tokens, use_graphs,
               progress, draft_path) -> None:
        bus = self._bus = pci_bus_id(device)
        nvml = lambda: sizing.nvml_memory(pci_bus_id=bus)  # noqa: E731
        try:
            _, total, used_before = nvml()
        except RuntimeError as e:
            log.warning("NVML cannot read the GPU's memory (%s): only explicit sizing (num_pages) works", e)
            nvml = None
        get_device(device)
        used_ctx = nvml()[2] if nvml else 0
        alloc0 = allocated_bytes()
        t_start = time.perf_counter()
        # A verify step has logits rows for every request's last token and its proposals.
        self.model = Model(path, device=device, max_batch_tokens=max_num_batched_tokens,
                           max_num_seqs=self.max_num_seqs,
                           max_logit_rows=self.max_num_seqs * (1 + self.num_draft_tokens),
                           batch_invariant=self.batch_invariant, progress=progress)
        model = self.model
        model.use_graphs = use_graphs
        workspace_bytes = model.workspace.nbytes
        weights_bytes = allocated_bytes() - alloc0 - workspace_bytes
        draft_bytes = 0  # the draft model's memory, for the report
        if draft_path is not None:
            before = allocated_bytes()
            self.draft = Model(draft_path, device=device, max_batch_tokens=max_num_batched_tokens,
                               max_num_seqs=self.max_num_seqs, max_logit_rows=self.max_num_seqs, progress=progress)
            check_draft_model(model, self.draft)
            draft_bytes = allocated_bytes() - before
        alloc0 += draft_bytes  # what follows is measured as before, without the draft
        self.tokenizer = model.tokenizer
        self.eos_token_ids = set(model.eos_token_ids)
        self.config = model.config

        # Warm-up on a temporary cache: the largest chunk, one decode step per bucket, all graphs.
        used_warm0 = nvml()[2] if nvml else 0
        chunk = model.max_batch_tokens
        # One page per decode sequence; the chunk's pages, plus a partial page per piece of it.
        warm_pages = self.max_num_seqs + -(-chunk // self.page_size) + self.max_num_seqs
        warm = model.new_cache(num_pages=warm_pages, page_size=self.page_size, max_seq_len=self.max_context,
                               kv_quantize=self.kv_quantize, smoothing=self.kv_smoothing)
        model.attach_cache(warm, max_context=self.max_context, penalty_capacity=self._penalty_capacity())
        steps_bytes = allocated_bytes() - alloc0 - weights_bytes - workspace_bytes - warm.layout.nbytes
        t_warm = time.perf_counter()
        self._warm_up(chunk)
        graph_bytes = 0
        if use_graphs:
            before = nvml()[2] if nvml else 0
            model.graphs.capture(model.stream)
            graph_bytes = (nvml()[2] - before) if nvml else 0
        model._drop_cache()
        kernels_bytes = (nvml()[2] - used_warm0) if nvml else 0
        warm_up_seconds = time.perf_counter() - t_warm

        # The pool.
        kv_dtype = self.kv_quantize or "bf16"
        page_bytes = sizing.bytes_per_page(self.config, self.page_size, kv_dtype)
        need = -(-self.max_context // self.page_size)
        if num_pages is None and max_tokens is not None:
            num_pages = -(-max_tokens // self.page_size)
        if num_pages is None:
            if not nvml:
                raise RuntimeError("NVML is not available to size the KV pool; pass num_pages or max_tokens")
            _, total, used_now = nvml()
            reserve = int(graph_bytes * GRAPH_RESERVE_MARGIN) + FIXED_RESERVE_BYTES + steps_bytes
            if self.draft is not None:  # the draft's graphs and step buffers, taken as large as the target's
                reserve *= 2
            plan = sizing.plan(self.config, total, used_bytes=used_now, utilization=utilization,
                               reserve_bytes=reserve, weights=0, page_size=self.page_size, kv_dtype=kv_dtype)
            num_pages = plan.pages
            if self.draft is not None:  # the draft's pool holds as many positions: the pages' memory is shared
                draft_page_bytes = sizing.bytes_per_page(self.draft.config, self.page_size, "bf16")
                num_pages = num_pages * page_bytes // (page_bytes + draft_page_bytes)
            if num_pages < need:
                missing = (need - num_pages) * page_bytes
                raise ValueError(
                    f"the KV pool would hold {num_pages} pages ({num_pages * self.page_size} positions) but one "
                    f"sequence of max_context={self.max_context} needs {need}: {missing / 1e9:.2f} GB more memory is "
                    f"needed. Raise gpu_memory_utilization (now {utilization}), lower max_context or "
                    f"max_num_batched_tokens, or free GPU memory ({used_now / 1e9:.1f} GB of "
                    f"{total / 1e9:.1f} GB is in use).")
        elif num_pages < need:
            raise ValueError(f"num_pages={num_pages} cannot hold one sequence of max_context={self.max_context} "
                             f"({need} pages of {self.page_size}); give more pages or lower max_context")
        else:
            utilization = None
        try:
            cache = model.new_cache(num_pages=num_pages, page_size=self.page_size, max_seq_len=self.max_context,
                                    enable_prefix_caching=self.enable_prefix_caching, kv_quantize=self.kv_quantize,
                                    smoothing=self.kv_smoothing)
        except CudaError as e:
            raise MemoryError(f"could not allocate a KV pool of {num_pages} pages ({num_pages * page_bytes / 1e9:.2f} "
                              f"GB): {e}. Give fewer pages or a lower gpu_memory_utilization.") from None
        model.attach_cache(cache, max_context=self.max_context, penalty_capacity=self._penalty_capacity())
        self.cache = cache
        if self.draft is not None:
            draft_bytes += self._start_draft(num_pages, use_graphs, nvml)
        graphs_before = nvml()[2] if nvml else 0
        if use_graphs:
            start = time.perf_counter()
            model.graphs.capture(model.stream, progress=progress)
            self.capture_seconds = time.perf_counter() - start
            log.info("captured %d decode graphs (batch %s) in %.2f s", len(model.graphs.graphs),
                     ",".join(map(str, model.buckets)), self.capture_seconds)
        else:
            self.capture_seconds = 0.0
        self.startup = StartupTimes(
            total=time.perf_counter() - t_start, weights=model.weights.load_seconds, kernels=model.kernel_seconds,
            kernels_compiled=model.kernels_compiled, warm_up=warm_up_seconds, capture=self.capture_seconds,
            graphs=len(model.graphs.graphs) if use_graphs else 0)
        log.info("%s", self.startup.format())
        if nvml:
            free, total, used_end = nvml()
            self.memory_report = MemoryReport(
                total=total, used_before=used_before, context=used_ctx - used_before, weights=weights_bytes,
                workspace=workspace_bytes + steps_bytes, kernels=kernels_bytes,
                graphs=(used_end - graphs_before) if use_graphs else 0, kv_pool=cache.layout.nbytes, free=free,
                kv_dtype=kv_dtype, kv_pages=num_pages, kv_positions=cache.capacity, page_size=self.page_size,
                max_context=self.max_context, gpu_memory_utilization=utilization, draft=draft_bytes)
            log.info("%s", self.memory_report.format())
        else:
            self.memory_report = None
        self.scheduler = Scheduler(cache.manager, max_num_seqs=self.max_num_seqs,
                                   max_num_batched_tokens=model.max_batch_tokens, max_context=self.max_context)

    def _start_draft(self, num_pages: int, use_graphs: bool, nvml) -> int:
        """The draft model's pool (as many pages as the target's, bf16, no prefix caching) and graphs;
        returns the bytes they took (the pool and step buffers allocated, the graphs by NVML)."""
        draft = self.draft
        before = allocated_bytes()
        try:
            cache = draft.new_cache(num_pages=num_pages, page_size=self.page_size, max_seq_len=self.max_context,
                                    enable_prefix_caching=False)
        except CudaError as e:
            raise MemoryError(f"could not allocate the draft model's KV pool of {num_pages} pages: {e}. Give fewer "
                              f"pages or a lower gpu_memory_utilization.") from None
        draft.attach_cache(cache, max_context=self.max_context)
        nbytes = allocated_bytes() - before
        draft.use_graphs = use_graphs
        if use_graphs:
            used = nvml()[2] if nvml else 0
            draft.graphs.capture(draft.stream)
            nbytes += (nvml()[2] - used) if nvml else 0
        self.drafter = DraftRunner(draft)
        return nbytes

    def _penalty_capacity(self) -> int:
        # Distinct tokens of every row: never more than its positions.
        return self.max_num_seqs * self.max_context

    def _warm_up(self, chunk: int) -> None:
        """Run the largest prefill chunk, then one decode step of every bucket, eagerly (loads every kernel)."""
        model = self.model
        manager = model.cache.manager
        # The largest step: `chunk` tokens, as sequences of at most max_context positions each.
        sizes = [min(self.max_context, chunk - i) for i in range(0, chunk, self.max_context)][:self.max_num_seqs]
        seqs = [Sequence() for _ in sizes]
        for s, n in zip(seqs, sizes):
            manager.reserve(s, n)
        model.step([(s, [0] * n) for s, n in zip(seqs, sizes)], sample=True)
        for s in seqs:
            manager.release(s)
        seqs = [Sequence() for _ in range(self.max_num_seqs)]
        for s in seqs:
            manager.reserve(s, 1)
        greedy = SamplingRow()
        sampled = SamplingRow(temperature=1.0, top_k=5, top_p=0.9, min_p=0.01, repetition=1.1)
        use = model.use_graphs
        model.use_graphs = False  # eager: capturing comes after the warm-up
        try:
            for b in model.buckets:
                model.step([(s, [0]) for s in seqs[:b]], [sampled if i % 2 else greedy for i in range(b)])
        finally:
            model.use_graphs = use
        for s in seqs:
            manager.release(s)

    # ------------------------------------------------------------------ requests
    def _make_requests(self, prompts, sampling_params) -> list[tuple[Request, str | None]]:
        if isinstance(prompts, (str, bytes, bytearray)) or (isinstance(prompts, list) and prompts and
                                                            isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("prompts is empty: give at least one prompt")
        if sampling_params is None:
            params = [SamplingParams()] * len(prompts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"{len(params)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
            if not all(isinstance(p, SamplingParams) for p in params):
                raise ValueError("sampling_params must be a SamplingParams or a list of them")
        made = []
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids, text = self._prompt_ids(prompt, i)
            self.scheduler.check_fits(len(ids), p.max_tokens)
            req = Request(request_id=self._next_id, prompt_ids=ids, params=p, seed=p.resolved_seed())
            self._next_id += 1
            made.append((req, text))
        return made

    def _prompt_ids(self, prompt, index: int) -> tuple[list[int], str | None]:
        if isinstance(prompt, (bytes, bytearray)):
            try:
                prompt = prompt.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"prompt {index} is not valid UTF-8 ({e}); pass text (str) or token ids") from None
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError(f"prompt {index} is empty: give some text or token ids")
            return self.model.encode(prompt), prompt
        ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError(f"prompt {index} is an empty token list")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"prompt {index}: token ids {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")
        return ids, None

    def _admit(self, req: Request, stream: bool) -> None:
        p = req.params
        req.sampling_row = SamplingRow(temperature=float(p.temperature), top_k=int(p.top_k), top_p=float(p.top_p),
                                       min_p=float(p.min_p), seed=req.seed, repetition=float(p.repetition_penalty),
                                       presence=float(p.presence_penalty), frequency=float(p.frequency_penalty))
        req.penalties = None
        if p.has_penalties:
            req.penalties = _Penalties()
            for t in req.prompt_ids:
                req.penalties.add(t, output=False)
        if p.stop or stream:
            req.detokenizer = IncrementalDetokenizer(self.tokenizer, skip_special_tokens=p.skip_special_tokens,
                                                     stop=p.stop, include_stop_str_in_output=p.include_stop_str_in_output)
        if p.logprobs is not None:
            req.logprobs = []
        req.stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids)
        req.sync = p.has_penalties or p.logprobs is not None
        if self.drafter is not None and not req.sync:  # penalties and logprobs decode one token a step
            req.spec = SpecStats()
            req.spec_rng = np.random.default_rng(req.seed)
        self.scheduler.add(req)
        self.stats.prompt_tokens += req.num_prompt

    # ------------------------------------------------------------------ stepping
    #
    # Steps are pipelined: step k+1 is planned and launched while step k runs on the GPU, and
    # step k's tokens are read back afterwards. A decode row whose token step k has not returned
    # yet takes it straight from the device (prepare_step's token_src); the host keeps a
    # placeholder (-1) in the request's tokens until the value arrives. A request that step k
    # ends (EOS, a stop) may still be in step k+1: that row's result is dropped. Requests with
    # penalties or logprobs need every token before the next step is planned; while one is
    # running, steps are not pipelined.

    def _step(self) -> list[tuple[Request, int, str]]:
        """Launch the next step (if any) and finish the previous one; returns (request, new token,
        new text) for every token read back.

        A CUDA error (often reported at the next synchronisation, not at the launch that caused it)
        leaves the device state unknown: the engine refuses all further work and says why."""
        try:
            return self._step_once()
        except CudaError as e:
            self._broken = str(e)
            if "OUT_OF_MEMORY" in str(e):
                raise MemoryError(f"the GPU ran out of memory during a step ({e}); another process probably took "
                                  f"memory after start-up. Start with a lower gpu_memory_utilization.") from None
            raise

    def _step_once(self) -> list[tuple[Request, int, str]]:
        if self.drafter is not None:
            return self._spec_step_once()
        start = time.perf_counter()
        events = []
        finished = None  # the last step this iteration waited for: its time is counted as that step's
        sync = not self.async_scheduling or self._sync_needed()
        if sync and self._inflight is not None:
            events += self._finish(self._inflight)
            finished, self._inflight = self._inflight, None
        rows = self.scheduler.schedule() if self.scheduler.has_unfinished else []
        launched = self._launch(rows) if rows else None
        if self._inflight is not None:
            events += self._finish(self._inflight)
            finished = self._inflight
        self._inflight = launched
        if launched is not None and sync:
            events += self._finish(launched)
            finished, self._inflight = launched, None
        self._check_progress(launched is not None, events)
        elapsed = time.perf_counter() - start
        self.stats.step_seconds += elapsed
        if finished is not None and finished.decode:
            self.stats.decode_seconds += elapsed
        return events

    # ------------------------------------------------------------------ speculative steps
    #
    # With a draft model, steps are not pipelined (a round's proposals depend on every token before
    # them). Each step: the rows the scheduler picked that are one decoding token of a request that
    # speculates go through _verify; the others (prefill chunks, requests with penalties or logprobs)
    # run first as a plain step. See engine/spec_batch.py for the round.

    def _spec_step_once(self) -> list[tuple[Request, int, str]]:
        start = time.perf_counter()
        events = []
        if self._inflight is not None:
            events += self._finish(self._inflight)
            self._inflight = None
        rows = self.scheduler.schedule() if self.scheduler.has_unfinished else []
        speculates = [r.count == 1 and r.samples and r.request.spec is not None for r in rows]
        plain = [r for r, s in zip(rows, speculates) if not s]
        if plain:
            events += self._finish(self._launch(plain))
        spec = [r for r, s in zip(rows, speculates) if s]
        if spec:
            events += self._verify(spec)
        live = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        for rid in [rid for rid in self.drafter.held if rid not in live]:
            self.drafter.release(rid)  # finished or aborted: its draft pages go back
        self._check_progress(bool(rows), events)
        self.stats.step_seconds += time.perf_counter() - start
        return events

    def _check_progress(self, ran: bool, events: list) -> None:
        """A step that ran nothing and returned nothing while requests wait would loop forever."""
        if not ran and not events and self.scheduler.has_unfinished:
            raise RuntimeError("the scheduler found nothing to run although requests are unfinished; "
                               "this is a bug in the scheduler")

    def _verify(self, rows: list[ScheduledRow]) -> list[tuple[Request, int, str]]:
        """One speculative round for these decode rows: the draft's proposals, one target step over
        every row's last token and proposals, each request's accepted tokens, both caches rolled back."""
        manager = self.scheduler.manager
        room = self.model.max_verify_tokens - len(rows)  # proposals the verify step has rows for
        items = []
        for r in rows:
            req = r.request
            # Proposals past max_tokens would be wasted: the round always emits one token more.
            k = min(self.num_draft_tokens, req.params.max_tokens - req.num_output - 1, room)
            if k > 0 and manager.can_reserve(req.seq, k):
                room -= k
                manager.reserve(req.seq, k)
            else:
                k = 0  # no room in the pool (or the step): this request decodes one token
            items.append((req.request_id, req.token_ids, k))
        proposals = self.drafter.propose(items)
        batch = []
        for r, (_, _, k), props in zip(rows, items, proposals):
            if len(props) < k:  # the draft's pool had no room for this request
                manager.truncate(r.request.seq, r.start + 1 + len(props))
            batch.append((r.request.seq, [r.request.token_ids[-1]] + props, r.start))
        greedy = all(not r.request.params.temperature > 0 for r in rows)
        width = self.num_draft_tokens + 1 if self._verify_graphs else None
        out = self.model.verify(batch, logits="argmax" if greedy else "all", graph_width=width)
        self.scheduler.update(rows)
        self.stats.steps += 1
        self.stats.computed_tokens += sum(len(ids) for _, ids, _ in batch)
        events, at = [], 0
        for r, props in zip(rows, proposals):
            req, p = r.request, r.request.params
            p_rows = out[at: at + len(props) + 1]
            at += len(props) + 1
            sampling = Sampling(temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p)
            if sampling.greedy and not greedy:
                p_rows = p_rows.argmax(axis=1)
            emitted, accepted = accept(props, None, p_rows, sampling, req.spec_rng)
            st = req.spec
            st.target_steps += 1
            st.drafted += len(props)
            st.accepted += accepted
            st.emitted += len(emitted)
            # The target keeps the committed tokens but the last one (fed with the next proposals).
            keep = r.start + 1 + accepted
            manager.truncate(req.seq, keep)
            req.num_computed = keep
            for token in emitted:
                index = len(req.token_ids)
                req.token_ids.append(token)
                events.append(self._accept(req, index, token, None))
                if req.closed:
                    break
                if req.num_output >= p.max_tokens:
                    self.scheduler.finish(req, "length")
                    break
            if req.status != FINISHED:
                self.scheduler.register([ScheduledRow(req, r.start, 1 + accepted)])
                self.drafter.rollback(req.request_id, req.token_ids)
        return events

    def _sync_needed(self) -> bool:
        return any(r.sync for r in self.scheduler.running) or any(r.sync for r in self.scheduler.waiting)

    def _launch(self, rows: list[ScheduledRow]) -> "_InFlight":
        batch, token_src = [], []
        for i, r in enumerate(rows):
            req = r.request
            ids = req.token_ids[r.start:r.start + r.count]
            src = -1
            if ids[-1] < 0:  # sampled by the step in flight: read it on the device
                assert r.count == 1, "a placeholder token inside a prefill chunk"
                src = self._last_rows[req.request_id]
                ids = [0]
            batch.append((req.seq, ids, r.start))
            token_src.append(src)
        sampling = [r.request.sampling_row for r in rows]
        penalties = None
        if any(r.request.penalties is not None for r in rows):
            penalties = [r.request.penalties.arrays() if r.request.penalties is not None else None for r in rows]
        any_sample = any(r.samples for r in rows)
        slot = self.model.launch(batch, sampling, sample=any_sample, penalties=penalties,
                                 token_src=token_src if max(token_src) >= 0 else None)
        self.scheduler.update(rows)
        # Counted before the placeholders below change what r.samples says.
        decode = all(r.count == 1 for r in rows)
        prefill = sum(r.count for r in rows if not (r.count == 1 and r.samples and r.start >= r.request.num_prompt))
        self.stats.steps += 1
        self.stats.graph_steps += int(decode and self.model.use_graphs)
        self.stats.decode_steps += int(decode)
        self.stats.decode_rows += len(rows) if decode else 0
        self.stats.decode_positions += sum(r.start + 1 for r in rows) if decode else 0
        self.stats.computed_tokens += sum(r.count for r in rows)
        self.stats.prefill_tokens += prefill
        samplers = []
        self._last_rows = {}
        for i, r in enumerate(rows):
            if not r.samples:
                continue
            req = r.request
            samplers.append((i, req, len(req.token_ids)))
            req.token_ids.append(-1)
            req.unresolved += 1
            self._last_rows[req.request_id] = i
            if req.num_output >= req.params.max_tokens:
                self.scheduler.finish(req, "length")  # known now; its last token arrives with this step
        return _InFlight(rows, slot, samplers)

    def _finish(self, step: "_InFlight") -> list[tuple[Request, int, str]]:
        sampled = self.model.collect(step.slot, len(step.rows))
        self.scheduler.register(step.rows)
        logprob_rows = [i for i, req, _ in step.samplers if req.logprobs is not None and not req.closed]
        logprobs = self._logprobs(logprob_rows, step.rows, sampled) if logprob_rows else {}
        events = []
        for i, req, index in step.samplers:
            if req.closed:
                continue  # ended by a stop or an abort in an earlier step (its placeholders are gone)
            req.unresolved -= 1
            token = int(sampled[i])
            req.token_ids[index] = token
            events.append(self._accept(req, index, token, logprobs.get(i)))
        return events

    def _accept(self, req: Request, index: int, token: int, logprobs) -> tuple[Request, int, str]:
        """A token read back: the detokenizer, penalties, logprobs and the stop checks see it."""
        self.stats.generated_tokens += 1
        if req.first_token_time is None:
            req.first_token_time = time.perf_counter()
        if req.penalties is not None:
            req.penalties.add(token, output=True)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        text = req.detokenizer.add(token) if req.detokenizer is not None else ""
        stop = None
        if token in req.stop_ids:
            stop = token
        elif req.detokenizer is not None and req.detokenizer.stopped_by is not None:
            stop = req.detokenizer.stopped_by
        if stop is not None:
            req.closed = True
            req.unresolved = 0
            del req.token_ids[index + 1:]  # tokens launched after this one are dropped
            self.scheduler.finish(req, "stop", stop)
        return req, token, text

    def _logprobs(self, indices: list[int], rows: list[ScheduledRow], sampled) -> dict[int, dict[int, float]]:
        """Top-n log-probabilities (of the logits after penalties, before temperature) per row."""
        logits = self.model.workspace.logits.rows(0, max(indices) + 1).to_host(self.model.stream)
        out = {}
        for i in indices:
            n = rows[i].request.params.logprobs
            row = logits[i].astype(np.float64)
            m = row.max()
            lse = m + np.log(np.exp(row - m).sum())
            lp = row - lse
            top = np.argpartition(-lp, n)[:n] if n else np.array([], np.int64)
            top = top[np.argsort(-lp[top], kind="stable")]
            entry = {int(t): float(lp[t]) for t in top}
            entry[int(sampled[i])] = float(lp[int(sampled[i])])
            out[i] = entry
        return out

    # ------------------------------------------------------------------ public API
    def add_request(self, prompt, sampling_params: SamplingParams | None = None) -> int:
        """Queue one request for `step()`; returns its request id."""
        self._check_open()
        (req, _), = self._make_requests([prompt], sampling_params)
        self._admit(req, stream=False)
        self._requests[req.request_id] = req
        return req.request_id

    def step(self) -> list[tuple[int, int, bool]]:
        """Run one engine step over everything queued: (request id, new token, finished) per token
        read back. Finished requests' outputs are then in `finished_outputs()`."""
        self._check_open()
        return [(req.request_id, token, req.status == FINISHED and not req.unresolved)
                for req, token, _ in self._step()]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished or self._inflight is not None

    def finished_outputs(self) -> list[RequestOutput]:
        """Outputs of the requests queued with add_request that have finished since the last call."""
        done = [r for r in self._requests.values() if r.status == FINISHED and not r.unresolved]
        for r in done:
            del self._requests[r.request_id]
        return [self._output(r, None, r.arrival_time) for r in done]

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Continue every prompt (text, or a list of token ids); outputs in the order given."""
        self._check_open()
        made = self._make_requests(prompts, sampling_params)
        t0 = time.perf_counter()
        for req, _ in made:
            self._admit(req, stream=False)
        try:
            while any(req.status != FINISHED or req.unresolved for req, _ in made):
                self._step()
        except BaseException:
            for req, _ in made:
                self.scheduler.abort(req)
            raise
        self._update_cache_stats(made)
        return [self._output(req, text, t0) for req, text in made]

    def generate_stream(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                        ) -> Iterator[StreamOutput]:
        """Like generate, but yields each request's tokens (and text) as the steps produce them.

        Closing the generator early aborts the requests still running and frees their pages."""
        self._check_open()
        made = self._make_requests(prompts, sampling_params)
        index = {req.request_id: i for i, (req, _) in enumerate(made)}
        for req, _ in made:
            self._admit(req, stream=True)
        try:
            while any(req.status != FINISHED or req.unresolved for req, _ in made):
                for req, token, _ in self._step():
                    if req.request_id not in index:
                        continue
                    done = req.status == FINISHED and not req.unresolved
                    yield StreamOutput(index=index[req.request_id], request_id=req.request_id, token_ids=[token],
                                       text=req.detokenizer.stream_delta(done), finished=done,
                                       finish_reason=req.finish_reason)
        finally:
            for req, _ in made:
                if req.status != FINISHED:
                    self.scheduler.abort(req)
            self._update_cache_stats(made)

    def _update_cache_stats(self, made) -> None:
        self.stats.cached_prompt_tokens += sum(req.num_cached_tokens for req, _ in made)
        self.stats.preemptions = self.scheduler.num_preemptions

    def _output(self, req: Request, prompt: str | None, t0: float) -> RequestOutput:
        out_ids = req.output_ids
        if req.detokenizer is not None:
            text = req.detokenizer.text
        else:
            text = self.tokenizer.decode(out_ids, skip_special_tokens=req.params.skip_special_tokens)
        return RequestOutput(
            request_id=req.request_id, prompt=prompt, prompt_token_ids=req.prompt_ids, text=text, token_ids=out_ids,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason, logprobs=req.logprobs,
            num_cached_tokens=req.num_cached_tokens, num_preemptions=req.num_preemptions,
            time_to_first_token=(req.first_token_time - t0) if req.first_token_time else 0.0,
            seconds=(req.finish_time - t0) if req.finish_time else 0.0, speculation=req.spec)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LLM was closed; create a new one")
        if self._broken:
            raise RuntimeError(f"this LLM stopped after a GPU error ({self._broken}); its results can no longer be "
                               f"trusted: close it and create a new one")

    def close(self) -> None:
        """Free every device allocation (weights, workspace, pool, graphs)."""
        if self._closed:
            return
        self._closed = True
        if self.model is not None:
            self.model.close()
        if self.draft is not None:
            self.draft.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
