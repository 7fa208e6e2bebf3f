"""Start-up: the runner(s) an EngineConfig asks for, with their KV pools sized and their graphs captured.

On the GPU (`start_gpu`), sizing the pool from what NVML says is free, after a worst-case warm-up:
  1. the CUDA context, weights and workspace (activations for the largest step); every kernel file loaded
     (cuda/module.py load_all), so that a server never waits for a compile nor loads one inside a capture;
  2. a warm-up on a small temporary cache: the largest prefill chunk, then a decode step of every
     batch bucket, then every decode graph captured once to measure what graphs take; the temporary cache and
     graphs are freed;
  3. the pool: floor((floor(u x total) - used - reserve) / bytes per page) pages, u =
     gpu_memory_utilization (a fraction of the device's TOTAL memory; see kv/sizing.py for why),
     reserve = the measured graph memory plus a margin; or exactly `num_pages` / `max_tokens`;
  4. every decode graph captured over the real pool; the memory report is logged.
After that nothing is allocated: steps only launch kernels over persistent buffers.

With a draft model (speculative decoding) the draft runs on its own pool of as many pages as the
target's, the memory split between them; a DFlash drafter (runner/gpu_dflash.py) likewise, plus a block's
pages per sequence, and the target captures the hidden states it reads from the warm-up on. The target's logits
workspace holds max_num_seqs x (k + 1) rows for the verify step.

Under tensor parallelism (runner/tensor_parallel.py) every rank runs start_gpu for its own shards with its
group: it joins the communicator before its weights load, and after step 3 the ranks take the smallest pool
any of them has room for, so one block table serves them all.

On the CPU (`start_cpu`) the pool is num_pages / max_tokens, or max_num_seqs sequences of max_context
capped at runner/cpu.py's DEFAULT_POOL_BYTES. A DFlash drafter (runner/cpu_dflash.py) gets a pool of
its own of as many pages plus a block's per sequence.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from ..config import EngineConfig
from ..cuda import CudaError, allocated_bytes, get_device, pci_bus_id
from ..cuda.module import load_all, start_compiling
from ..graphs import DECODE
from ..kv import Sequence
from ..kv import sizing
from ..model.config import read_config
from ..model.dflash_config import is_dflash_dir
from .cpu import CPURunner
from .cpu_dflash import CPUDFlashRunner
from .gpu import GPURunner
from .gpu_dflash import GPUDFlashRunner
from .memory_report import MemoryReport
from .sampler import MAX_BANNED_TOKENS, MAX_LOGIT_BIAS
from .step import SamplingRow

log = logging.getLogger(__name__)

GRAPH_RESERVE_MARGIN = 1.25          # graphs measured during warm-up, times this, are kept free
FIXED_RESERVE_BYTES = 256 * 1024**2  # and this much more (driver growth, allocator granularity)


@dataclass(frozen=True, slots=True)
class StartupTimes:
    """Where start-up went (seconds): opening the device (NVML and the CUDA context, before `total`); loading
    the weights; compiling (0 kernels with a warm disk cache) and loading every kernel; the warm-up (the largest
    prefill chunk, a decode step per bucket and a first capture, on a temporary cache, to measure their memory);
    capturing every decode graph over the real pool. `total` also counts sizing and allocating the pool."""
    device: float
    total: float
    weights: float
    kernels: float
    kernels_compiled: int
    warm_up: float
    capture: float
    graphs: int

    def format(self) -> str:
        return (f"device opened in {self.device:.2f} s; start-up {self.total:.2f} s: weights {self.weights:.2f} s, "
                f"kernels {self.kernels:.2f} s "
                f"({self.kernels_compiled} compiled), warm-up {self.warm_up:.2f} s, {self.graphs} decode graphs "
                f"captured in {self.capture:.2f} s")


@dataclass
class Started:
    runner: object                    # GPURunner or CPURunner, its pool attached
    draft: object | None              # the draft model's runner, its own pool attached
    memory_report: MemoryReport | None = None
    startup: StartupTimes | None = None


def _penalty_capacity(config: EngineConfig) -> int:
    # a row's distinct tokens are never more than its positions; a ban (min_tokens) adds its stop ids, a logit
    # bias its tokens
    return config.max_num_seqs * (config.max_context + MAX_BANNED_TOKENS + MAX_LOGIT_BIAS)


def start_cpu(config: EngineConfig) -> Started:
    def runner(path, logit_rows, draft):
        r = CPURunner(path, max_batch_tokens=config.max_num_batched_tokens, max_num_seqs=config.max_num_seqs,
                      max_logit_rows=logit_rows, load_format="auto" if draft else config.load_format)
        pages = config.num_pages
        if pages is None and config.max_tokens is not None:
            pages = -(-config.max_tokens // config.page_size)
        if pages is None:
            pages = r.default_pages(config.max_context, config.page_size, config.kv_quantize)
        _check_pool_holds_one_sequence(config, pages)
        cache = r.new_cache(num_pages=pages, page_size=config.page_size,
                            enable_prefix_caching=config.enable_prefix_caching and not draft,
                            kv_quantize=None if draft else config.kv_quantize, smoothing=config.kv_smoothing)
        r.attach_cache(cache, max_context=config.max_context)
        return r

    target = runner(config.model, config.max_num_seqs * config.tokens_per_verify_row, False)
    draft = None
    if config.speculative:
        draft = (_dflash_runner(config, target.cache.num_pages) if is_dflash_dir(config.draft_model)
                 else runner(config.draft_model, config.max_num_seqs, True))
    return Started(target, draft)


def _dflash_runner(config: EngineConfig, num_pages: int) -> CPUDFlashRunner:
    """A DFlash drafter with a pool of its own: the target's pages, plus one block's worth per sequence
    (a draft step holds a request's context and its block)."""
    r = CPUDFlashRunner(config.draft_model, max_num_seqs=config.max_num_seqs)
    block_pages = -(-r.config.block_size // config.page_size)
    r.attach_cache(r.new_cache(num_pages=num_pages + config.max_num_seqs * block_pages, page_size=config.page_size))
    return r


def _check_pool_holds_one_sequence(config: EngineConfig, num_pages: int) -> None:
    need = -(-config.max_context // config.page_size)
    if num_pages < need:
        raise ValueError(f"num_pages={num_pages} cannot hold one sequence of max_context={config.max_context} "
                         f"({need} pages of {config.page_size}); give more pages or lower max_context")


class _Nvml:
    """NVML's (free, total, used) of the configured GPU, or None where NVML cannot read it."""

    def __init__(self, ordinal: int):
        bus = pci_bus_id(ordinal)
        try:
            sizing.nvml_memory(pci_bus_id=bus)
            self.bus = bus
        except RuntimeError as e:
            log.warning("NVML cannot read the GPU's memory (%s): only explicit sizing (num_pages) works", e)
            self.bus = None

    def used(self) -> int:
        return sizing.nvml_memory(pci_bus_id=self.bus)[2] if self.bus else 0

    def read(self):
        return sizing.nvml_memory(pci_bus_id=self.bus) if self.bus else None


def start_gpu(config: EngineConfig, group=None) -> Started:
    """group: this rank's tensor-parallel group (runner/tensor_parallel.py; None on one GPU): the runner loads
    the rank's shards, and the ranks agree on one pool size."""
    made: list = []  # closed again, last first, if start-up fails half-way
    try:
        return _start_gpu(config, made, group)
    except BaseException:
        for runner in reversed(made):
            runner.close()
        raise


def _start_gpu(config: EngineConfig, made: list, group) -> Started:
    t_device = time.perf_counter()
    start_compiling(config.gpu_ordinal, config.progress)  # what the kernel cache lacks compiles while the device opens
    nvml = _Nvml(config.gpu_ordinal)
    before = nvml.read()
    get_device(config.gpu_ordinal)
    device_seconds = time.perf_counter() - t_device
    used_ctx = nvml.used()
    tp = None
    if group is not None:  # every rank joins the communicator before its weights load
        tp = group.connect(read_config(config.model / "config.json").vocab_size)  # (the runner loads the rest)
    alloc0 = allocated_bytes()
    t_start = time.perf_counter()
    runner = _gpu_runner(config, config.model, config.max_num_seqs * config.tokens_per_verify_row,
                         config.batch_invariant, load_format=config.load_format, tensor_parallel=tp)
    made.append(runner)
    runner.use_graphs = config.use_graphs
    workspace_bytes = runner.workspace.nbytes
    weights_bytes = allocated_bytes() - alloc0 - workspace_bytes
    draft, draft_bytes = None, 0
    if config.speculative:
        mark = allocated_bytes()
        if is_dflash_dir(config.draft_model):
            draft = GPUDFlashRunner(config.draft_model, max_num_seqs=config.max_num_seqs)
            made.append(draft)
            draft.bind_target(runner)  # its weights, and the target's hidden-state capture buffers
        else:
            draft = _gpu_runner(config, config.draft_model, config.max_num_seqs, False)  # only proposes: fast kernels
            made.append(draft)
            draft.use_graphs = config.use_graphs
        draft_bytes = allocated_bytes() - mark
    alloc0 += draft_bytes  # what follows is measured as before, without the draft
    t_kernels = time.perf_counter()
    kernels_compiled = load_all(config.progress)  # every file loaded before the warm-up and the captures
    kernel_seconds = time.perf_counter() - t_kernels

    warm = _warm_up(config, runner, nvml, alloc0 + weights_bytes + workspace_bytes)
    num_pages, utilization = _pool_pages(config, runner, draft, nvml, warm)
    if group is not None:
        num_pages = group.agree_pages(num_pages)  # one block table for every rank's pool
    cache = _allocate_pool(runner, config, num_pages, draft=False)
    runner.attach_cache(cache, max_context=config.max_context, penalty_capacity=_penalty_capacity(config))
    if draft is not None:
        draft_bytes += _attach_draft_pool(config, draft, num_pages, nvml)
    graphs_before = nvml.used()
    capture = _capture(config, runner)
    times = StartupTimes(device=device_seconds, total=time.perf_counter() - t_start,
                         weights=runner.weights.load_seconds, kernels=kernel_seconds,
                         kernels_compiled=kernels_compiled, warm_up=warm["seconds"], capture=capture,
                         graphs=runner.graphs.count(DECODE) if config.use_graphs else 0)
    log.info("%s", times.format())
    end = nvml.read()
    report = None
    if end is not None and before is not None:
        free, total, used_end = end
        report = MemoryReport(
            total=total, used_before=before[2], context=used_ctx - before[2], weights=weights_bytes,
            workspace=workspace_bytes + warm["steps_bytes"], kernels=warm["kernels_bytes"],
            graphs=(used_end - graphs_before) if config.use_graphs else 0, kv_pool=cache.layout.nbytes, free=free,
            kv_dtype=config.kv_quantize or "bf16", kv_pages=num_pages, kv_positions=cache.capacity,
            page_size=config.page_size, max_context=config.max_context, gpu_memory_utilization=utilization,
            draft=draft_bytes)
        log.info("%s", report.format())
    return Started(runner, draft, report, times)


def _attach_draft_pool(config: EngineConfig, draft, num_pages: int, nvml: _Nvml) -> int:
    """The draft's pool (as many pages as the target's; a DFlash drafter's one block's more per sequence) and
    graphs (a draft model's); the bytes they took (allocated + NVML)."""
    mark, used = allocated_bytes(), nvml.used()
    if isinstance(draft, GPUDFlashRunner):
        num_pages += config.max_num_seqs * -(-draft.config.block_size // config.page_size)
    draft.attach_cache(_allocate_pool(draft, config, num_pages, draft=True), max_context=config.max_context)
    if config.use_graphs and not isinstance(draft, GPUDFlashRunner):  # (a DFlash drafter's are per block shape)
        draft.graphs.capture(draft.stream, DECODE, draft.buckets)
    return allocated_bytes() - mark + (nvml.used() - used)


def _gpu_runner(config: EngineConfig, path, logit_rows: int, batch_invariant: bool, *,
                load_format: str = "auto", tensor_parallel=None) -> GPURunner:
    return GPURunner(path, device=config.gpu_ordinal, max_batch_tokens=config.max_num_batched_tokens,
                     max_num_seqs=config.max_num_seqs, max_logit_rows=logit_rows, batch_invariant=batch_invariant,
                     progress=config.progress, load_format=load_format, tensor_parallel=tensor_parallel)


def _warm_up(config: EngineConfig, runner: GPURunner, nvml: _Nvml, allocated_before: int) -> dict:
    """Every kernel loaded and the graphs' memory measured, on a temporary cache that is freed again:
    one page per decode sequence, the largest chunk's pages, plus a partial page per piece of it."""
    used0 = nvml.used()
    chunk = runner.max_batch_tokens
    pages = config.max_num_seqs + -(-chunk // config.page_size) + config.max_num_seqs
    warm = runner.new_cache(num_pages=pages, page_size=config.page_size, max_seq_len=config.max_context,
                            kv_quantize=config.kv_quantize, smoothing=config.kv_smoothing)
    runner.attach_cache(warm, max_context=config.max_context, penalty_capacity=_penalty_capacity(config))
    steps_bytes = allocated_bytes() - allocated_before - warm.layout.nbytes
    start = time.perf_counter()
    _warm_up_steps(config, runner, chunk)
    graph_bytes = 0
    if config.use_graphs:
        before = nvml.used()
        runner.graphs.capture(runner.stream, DECODE, runner.buckets)
        graph_bytes = nvml.used() - before
    runner.detach_cache()
    return dict(seconds=time.perf_counter() - start, steps_bytes=steps_bytes, graph_bytes=graph_bytes,
                kernels_bytes=nvml.used() - used0)


def _warm_up_steps(config: EngineConfig, runner: GPURunner, chunk: int) -> None:
    """The largest prefill chunk, then one decode step of every bucket, eagerly."""
    manager = runner.cache.manager
    # The largest step: `chunk` tokens, as sequences of at most max_context positions each.
    sizes = [min(config.max_context, chunk - i) for i in range(0, chunk, config.max_context)][:config.max_num_seqs]
    seqs = [Sequence() for _ in sizes]
    for s, n in zip(seqs, sizes):
        manager.reserve(s, n)
    runner.step([(s, [0] * n) for s, n in zip(seqs, sizes)], sample=True)
    for s in seqs:
        manager.release(s)
    seqs = [Sequence() for _ in range(config.max_num_seqs)]
    for s in seqs:
        manager.reserve(s, 1)
    greedy = SamplingRow()
    sampled = SamplingRow(temperature=1.0, top_k=5, top_p=0.9, min_p=0.01, repetition=1.1)
    runner.use_graphs = False  # eager: capturing comes after the warm-up
    try:
        for b in runner.buckets:
            runner.step([(s, [0]) for s in seqs[:b]], [sampled if i % 2 else greedy for i in range(b)])
    finally:
        runner.use_graphs = config.use_graphs
    for s in seqs:
        manager.release(s)


def _pool_pages(config: EngineConfig, runner: GPURunner, draft, nvml: _Nvml, warm: dict) -> tuple[int, float | None]:
    """The pool's pages (and the utilization they were sized by, None when given explicitly), each page sized
    by what this GPU's cache holds of it (under tensor parallelism, the rank's KV heads)."""
    kv_dtype = config.kv_quantize or "bf16"
    page_bytes = sizing.bytes_per_page(runner.local_config, config.page_size, kv_dtype)
    need = -(-config.max_context // config.page_size)
    if config.num_pages is not None or config.max_tokens is not None:
        pages = config.num_pages or -(-config.max_tokens // config.page_size)
        _check_pool_holds_one_sequence(config, pages)
        return pages, None
    now = nvml.read()
    if now is None:
        raise RuntimeError("NVML is not available to size the KV pool; pass num_pages or max_tokens")
    _, total, used_now = now
    reserve = int(warm["graph_bytes"] * GRAPH_RESERVE_MARGIN) + FIXED_RESERVE_BYTES + warm["steps_bytes"]
    if draft is not None:  # the draft's graphs and step buffers, taken as large as the target's
        reserve *= 2
    utilization = config.gpu_memory_utilization
    plan = sizing.plan(runner.local_config, total, used_bytes=used_now, utilization=utilization,
                       reserve_bytes=reserve, weights=0, page_size=config.page_size, kv_dtype=kv_dtype)
    pages = plan.pages
    if draft is not None:  # the draft's pool holds as many positions: the pages' memory is shared
        draft_page_bytes = sizing.bytes_per_page(draft.local_config, config.page_size, "bf16")
        pages = pages * page_bytes // (page_bytes + draft_page_bytes)
    if pages < need:
        missing = (need - pages) * page_bytes
        raise ValueError(
            f"the KV pool would hold {pages} pages ({pages * config.page_size} positions) but one sequence of "
            f"max_context={config.max_context} needs {need}: {missing / 1e9:.2f} GB more memory is needed. Raise "
            f"gpu_memory_utilization (now {utilization}), lower max_context or max_num_batched_tokens, or free "
            f"GPU memory ({used_now / 1e9:.1f} GB of {total / 1e9:.1f} GB is in use).")
    return pages, utilization


def _allocate_pool(runner: GPURunner, config: EngineConfig, num_pages: int, *, draft: bool):
    """The target's pool as configured; the draft's BF16, without prefix caching."""
    try:
        return runner.new_cache(num_pages=num_pages, page_size=config.page_size, max_seq_len=config.max_context,
                                enable_prefix_caching=config.enable_prefix_caching and not draft,
                                kv_quantize=None if draft else config.kv_quantize, smoothing=config.kv_smoothing)
    except CudaError as e:
        raise MemoryError(f"could not allocate a KV pool of {num_pages} pages: {e}. Give fewer pages or a lower "
                          f"gpu_memory_utilization.") from None


def _capture(config: EngineConfig, runner: GPURunner) -> float:
    if not config.use_graphs:
        return 0.0
    start = time.perf_counter()
    runner.graphs.capture(runner.stream, DECODE, runner.buckets, progress=config.progress)
    seconds = time.perf_counter() - start
    log.info("captured %d decode graphs (batch %s) in %.2f s", runner.graphs.count(DECODE),
             ",".join(map(str, runner.buckets)), seconds)
    return seconds
