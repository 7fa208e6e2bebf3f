"""The GPU runner: weights, workspace, a paged KV cache, step buffers and CUDA graphs on one device.

`launch(batch, ...)` enqueues one forward step over (sequence, new token ids[, start]) rows and returns
the slot its sampled tokens arrive in; `collect(slot, n)` waits for them (`step` does both). A decode
step (one new token per sequence, at most `max_num_seqs` of them) is padded to its batch bucket and
replays that bucket's CUDA graph. A sampled step over one sequence's prompt of at most PREFILL_BUCKETS[-1]
(896) tokens is padded to its token bucket (prefill_bucket) and replays that bucket's prefill graph, captured on
its first use: launched one by one from Python its ~230 kernels (qwen3-0.6b) cost the host more than the GPU
takes to run them, so a short prompt's first token waited for the host. Other steps with prompt chunks (several
sequences, longer chunks) run eagerly. Eager or replayed, a padded step runs the same launches. `verify`
runs a speculative verify step (every new token's logits) from a graph per (bucket, tokens a row);
`extend` runs teacher-forced prompt chunks and returns their logits. The forward pass
(model/forward.py) has one caller, `_forward`. The engine (tileinfer/engine) drives a runner; the CPU
runner (runner/cpu.py) offers the same methods over the float32 reference.

Structured output. A step whose rows sample under allowed-token bitmasks (`launch(masked=...)`) is
launched whole, forward and sampling, before its masks exist: the host computes them while the forward
runs (a mask needs the token the step before sampled, which the engine reads only after this launch)
and hands them over with `publish_masks`. Beside the forward, on a stream forked where it begins, the
step waits on a mapped host word, copies the masks in and clears the word; its sampling kernel waits
for that copy (step.py, `fork_masks`, `join_masks`): a stream wait, a copy and a stream write, which a
CUDA graph captures as a branch, so a decode step with masks replays a graph of its own kind
(DECODE_MASKED) and a step without masks is exactly what it was. Masks published before the forward
ends are copied while it runs.
Launching the sampling kernel separately once the masks are written would instead cost every such
step one more launch from the host after the masks, and split each decode graph in two. A launched
step with masks must be published before it, or anything after it, is waited for (the runner refuses:
the host would wait forever). The next step may be launched before: it queues behind the waiting one,
and its own masks (published after) go through the same staging rows once the GPU has taken these.

Batch invariance. By default each matrix product picks its kernel by row count (the GEMV for 1
or 2 rows, the small-M GEMM up to 64, the tensor-core GEMM beyond), decode attention runs in its
decode shape and splits each sequence's keys by batch size. Different kernels sum in different
orders, so a sequence's logits can differ in the last bits with the batch around it, and at a
near-tie a greedy token can flip. With batch_invariant=True every product runs on the GEMM
(which sums k in the same order for every row, whatever M) and attention never splits and
always runs in its prefill shape (a decode query is summed exactly as the same query in a
prefill chunk), so each sequence's logits are bitwise the same alone, in any batch, prefilled in
any chunks, or recomputed after preemption; decode is slower.

Tensor parallelism (`tensor_parallel=`, one runner a rank, model/sharding.py): the runner loads its rank's
shards (ShardedCheckpoint) and runs the forward with the group's collectives; `config` stays the whole model's
(token ids, logits and bitmask widths), `local_config` is the rank's (weights, workspace, KV cache: its KV
heads only). Every rank samples the same tokens from the same gathered logits with the same seeds, so the
rest of the runner is the one-GPU runner's. The communicator is the caller's: close() leaves it open.
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path

import numpy as np
from cuda.bindings import driver

from .. import kernels as K
from ..cuda import DeviceArray, Event, PinnedBuffer, Stream, call, get_device
from ..cuda.module import start_compiling
from ..graphs import DECODE, DECODE_MASKED, PREFILL, PREFILL_MASKED, GraphManager, bucket_for
from ..kv import PagedKVCache, Sequence
from ..kv.int8 import smoothing_factors
from ..kv.paged_cache import check_kv_quantize
from ..model.checkpoint import load_checkpoint
from ..model.dflash_config import DFLASH_NOT_A_MODEL, is_dflash_dir
from ..model.forward import BF16, Capture, Workspace, check_supported, forward, head_keys_written
from ..model.sharding import ShardedCheckpoint, TensorParallel
from ..model.weights import DeviceWeights
from ..model.inputs import StepShape
from .base import CheckpointRunner, DeviceDrafts
from .step import SamplingRow, StepBuffers, prepare_step, set_token_sources

log = logging.getLogger(__name__)
# Where a GPURunner's construction went, logged at INFO (scripts/bench_goals.py's cold start reads it). Its kernels
# load at their first launch, each with the part of its file that holds it, once start_compiling's compile of that
# part is done (cuda/module.py Module.part).
RUNNER_LOG = "GPU runner: device opened in %.2f s, weights loaded in %.2f s"

# A sequence's key splits at most. qwen3-4b's INT8 step at 32,768 positions ran fastest at 48 of the 32-66
# tried, its _h8 build's full wave (66) 2.6% slower (docs/benchmarks.md, Known gaps).
MAX_SPLITS = 48
# Decode blocks an SM the splits aim at: the BF16 kernel fits 2; the INT8 kernel 3 (its 16-row build) or 4
# (the _h8 build of a decode step, group <= 8), kernels/attention.py's int8_decode_blocks.
INT8_DECODE_BLOCKS_MAX = 4
LOGITS_MODES = ("all", "last", "argmax", "none")  # what extend returns
KEY_TILE = 64  # positions per attention key tile (cuda_src/attention.cuh)
ROW_TILE = 16  # query rows per block of the decode-shape attention kernel (kernels/attention.py rows_per_block)


def attention_splits(row_tiles: int, kv_heads: int, max_tiles: int, per_sm: int, sms: int) -> int:
    """Key-range splits per sequence for an attention launch of `row_tiles` blocks a KV head and split (its
    sequences x each one's tiles of ROW_TILE query rows): the most whose blocks fit one wave of `per_sm`
    blocks an SM, at most MAX_SPLITS and one split a key tile (max_tiles), at least 1. Rounded down, not
    up: a grid just past one wave idles most SMs for a second, short one."""
    want = per_sm * sms // (row_tiles * kv_heads)
    return max(1, min(MAX_SPLITS, max_tiles, want))


# Token rows a one-sequence prompt step is padded to (prefill_bucket): steps of 64 from 64 tokens to 512, then of
# 128 (the tensor-core GEMM's row tile) to 896, so that a prompt past 512 tokens runs its products on as many row
# tiles as unpadded, and one past 64 computes at most 63 (127 past 512) padding rows. Buckets of 128 on to 2,048
# were measured and not kept (docs/benchmarks.md): qwen3-0.6b gained 7% at 1,000 tokens and 3-4% at 1,500, qwen3-4b
# lost 1-2%, and 11% at 1,000 tokens padded to 1,024, where its o_proj and down_proj then split 2 ways (they run
# 160 wide on both sides of 1,024 rows since: kernels/routing.py tma_residual_plan).
PREFILL_BUCKETS = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 640, 768, 896)


def prefill_bucket(tokens: int, max_tokens: int) -> int | None:
    """The token rows a sampled prompt step of one sequence with `tokens` new tokens is padded to and its prefill
    graph's bucket: the smallest of PREFILL_BUCKETS that holds them, or None (an eager step of its own size) past
    the largest bucket or past max_tokens (the runner's largest step)."""
    if tokens > PREFILL_BUCKETS[-1]:
        return None
    bucket = bucket_for(tokens, PREFILL_BUCKETS)
    return bucket if bucket <= max_tokens else None


def verify_kind(width: int, logits: str, drafted: int = 0) -> tuple:
    """The graph kind of a verify step of `width` tokens a row returning `logits` ("all" or "argmax"); drafted:
    the address of the device array its drafts are read from (0: none)."""
    return ("verify", width, logits, drafted)


def _draft_sources(batch, drafted: DeviceDrafts) -> tuple[np.ndarray, np.ndarray]:
    """A verify step's drafted tokens: their rows in the step, and where each is in drafted.ids."""
    if len(drafted.first) != len(batch):
        raise ValueError(f"verify: drafts placed for {len(drafted.first)} rows, the step has {len(batch)}")
    rows, sources, at = [], [], 0
    for item, first in zip(batch, drafted.first):
        m = len(item[1]) - 1  # the proposals after the row's last committed token
        if m > 0:
            if first < 0:
                raise ValueError(f"verify: a row of {m} proposals has none drafted on the device")
            rows.append(np.arange(at + 1, at + 1 + m))
            sources.append(np.arange(first + 1, first + 1 + m))
        at += len(item[1])
    if len(rows) < 2:
        return (rows[0], sources[0]) if rows else (np.zeros(0, np.int64), np.zeros(0, np.int64))
    return np.concatenate(rows), np.concatenate(sources)


def decode_buckets(max_num_seqs: int) -> tuple[int, ...]:
    """Batch sizes with a decode graph: 1, 2, 4, 8, then steps of 8 up to 64 and of 16 beyond,
    the last one max_num_seqs itself. A batch replays the smallest bucket that holds it."""
    if max_num_seqs < 1:
        raise ValueError(f"max_num_seqs must be >= 1, got {max_num_seqs}")
    buckets = [b for b in (1, 2, 4) if b < max_num_seqs]
    b = 8
    while b < max_num_seqs:
        buckets.append(b)
        b += 8 if b < 64 else 16
    buckets.append(max_num_seqs)
    return tuple(buckets)


class GPURunner(CheckpointRunner):
    def __init__(self, path: str | Path, *, device: int = 0, max_batch_tokens: int = 2048,
                 max_num_seqs: int = 8, max_logit_rows: int = 256, batch_invariant: bool = False,
                 progress: bool = True, load_format: str = "auto", tensor_parallel: TensorParallel | None = None):
        if is_dflash_dir(path):
            raise ValueError(f"{path}: {DFLASH_NOT_A_MODEL}")
        self.checkpoint = load_checkpoint(path, load_format)
        self.config = self.checkpoint.config  # the whole model's
        check_supported(self.config, path)
        self.tensor_parallel = tp = tensor_parallel
        shards = self.checkpoint if tp is None else self._shards(tp)
        self.local_config = shards.config     # what this GPU holds: the whole model, or a rank's shards
        self.eos_token_ids = list(self.checkpoint.eos_token_ids)
        start_compiling(device, progress)  # the compiles overlap the device's opening and the weights' load
        start = time.perf_counter()
        self.device = get_device(device)
        device_seconds = time.perf_counter() - start  # opening the device (its context), if not yet open
        self.stream = Stream()
        self.weights = DeviceWeights(shards, self.stream, progress=progress)
        log.info(RUNNER_LOG, device_seconds, self.weights.load_seconds)
        self.buckets = decode_buckets(max_num_seqs)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max(max_batch_tokens, max_num_seqs)
        self.max_context = 0  # the longest sequence the attached cache serves (sets decode splits)
        self.workspace = Workspace(self.local_config, max_tokens=self.max_batch_tokens,
                                   max_logit_rows=max(max_logit_rows, max_num_seqs), max_splits=MAX_SPLITS,
                                   max_partial_rows=self._partial_rows(), tp=tp)
        self._argmax_host = PinnedBuffer(self.workspace.logit_argmax.nbytes)  # a verify step's argmaxes
        self._argmax_ready = Event(timing=False)
        self.cache: PagedKVCache | None = None
        self.steps: StepBuffers | None = None
        self.graphs: GraphManager | None = None  # decode and verify graphs over the attached cache
        self.use_graphs = True
        self.wait_seconds = 0.0  # host time spent waiting for steps to finish on the GPU
        self._slot = 0           # row of the mapped sampled_host the next sampled step writes
        self._awaiting = deque()
        self.batch_invariant = batch_invariant
        self._smoothing: np.ndarray | None = None
        self.capture: Capture | None = None  # hidden states a DFlash drafter reads (capture_hidden_states)
        self._captured: list[np.ndarray] = []  # host copies of them from the last extend's earlier chunks
        self._captured_rows = 0                # rows of the capture buffers the last launch or verify wrote
        self._closed = False

    def _shards(self, tp: TensorParallel) -> ShardedCheckpoint:
        """This rank's view of the checkpoint, once the group is known to fit the model."""
        if tp.vocab_size != self.config.vocab_size:
            raise ValueError(f"tensor_parallel: its vocab_size {tp.vocab_size} is not the model's "
                             f"{self.config.vocab_size}")
        return ShardedCheckpoint(self.checkpoint, tp.rank, tp.world)

    # ------------------------------------------------------------------ hidden-state capture
    def capture_hidden_states(self, layer_ids) -> None:
        """From now on every step (launch, verify, extend) also copies, for each position it computes, the outputs
        of these layers side by side (`last_features`), in the same pass; () turns it off. A captured last layer
        gives the final-normed state, as transformers' hidden_states[num_layers] does. Graphs captured before
        are dropped (they are captured again at their next use, with or without the copies)."""
        self._check_open()
        ids = self.capture_layer_ids(layer_ids)
        c = self.config
        if (self.capture.layers if self.capture else ()) == ids:
            return
        if self.capture is not None:
            self.stream.synchronize()
            self.capture.free()
            self.capture = None
        if ids:
            rows = self.workspace.max_tokens
            last = c.num_hidden_layers - 1 in ids
            self.capture = Capture(ids, DeviceArray((rows, len(ids) * c.hidden_size), np.float32),
                                   DeviceArray((rows, c.hidden_size), BF16) if last else None)
        if self.graphs is not None:
            self.graphs.destroy()

    @property
    def last_features(self) -> np.ndarray:
        """The captured states of every position the last launch, verify or extend computed, in the step's row
        order (a row's positions in order): float32 [tokens, len(layers) * hidden]. Waits for that step."""
        if self.capture is None:
            raise RuntimeError("no hidden states are captured: call capture_hidden_states(layer_ids) first")
        return np.concatenate([*self._captured, self._read_capture(self._captured_rows)])

    @property
    def captured_on_device(self) -> tuple[int, int]:
        """(first, n): rows first..first+n-1 of the last launch, verify or extend are in rows 0..n-1 of the
        capture buffers (an extend's earlier chunks only in host copies), where a DFlash drafter on this
        GPU reads them (runner/gpu_dflash.py add_context)."""
        return sum(len(part) for part in self._captured), self._captured_rows

    def _read_capture(self, n: int) -> np.ndarray:
        """Rows [0, n) of the capture buffers to the host, in layer order."""
        cap, hidden = self.capture, self.config.hidden_size
        out = cap.states.rows(0, n).to_host(self.stream)
        if cap.last is not None:
            j = cap.layers.index(self.config.num_hidden_layers - 1)
            out[:, j * hidden:(j + 1) * hidden] = cap.last.rows(0, n).to_host(self.stream).astype(np.float32)
        return out

    # ------------------------------------------------------------------ cache and graphs
    def smoothing_factors(self) -> np.ndarray:
        """Key-smoothing factors for an INT8 cache, from each layer's key-norm weight. # [layers, head_dim] f32"""
        if self._smoothing is None:
            self._smoothing = np.stack([smoothing_factors(layer.k_norm.to_host(self.stream))
                                        for layer in self.weights.layers])
        return self._smoothing

    def new_cache(self, *, kv_quantize: str | None = None, smoothing: bool = True, **kwargs) -> PagedKVCache:
        """A PagedKVCache for this model (kwargs as PagedKVCache's); an INT8 one (kv_quantize="int8")
        stores keys smoothed unless smoothing=False."""
        int8 = check_kv_quantize(kv_quantize)
        factors = self.smoothing_factors() if int8 and smoothing else None
        return PagedKVCache(self.local_config, kv_quantize=kv_quantize, smoothing=factors, **kwargs)

    def ensure_cache(self, max_tokens: int, page_size: int = 64, *, kv_quantize: str | None = None,
                     smoothing: bool = True) -> PagedKVCache:
        """A cache holding at least `max_tokens` positions, BF16 or INT8 (reallocated, and graphs
        dropped, if smaller or of another kind)."""
        self._check_open()
        int8 = check_kv_quantize(kv_quantize)
        c = self.cache
        if (c is not None and c.capacity >= max_tokens and c.page_size == page_size and c.int8 == int8
                and (c.smoothing is not None) == (int8 and smoothing)):
            return c
        self.detach_cache()
        cache = self.new_cache(max_tokens=max_tokens, page_size=page_size, kv_quantize=kv_quantize, smoothing=smoothing)
        self.attach_cache(cache, max_context=cache.capacity)
        log.info("KV cache (%s): %d pages of %d positions, %.2f GB", cache.layout.dtype_name, cache.layout.num_pages,
                 page_size, cache.layout.nbytes / 1e9)
        return cache

    def attach_cache(self, cache: PagedKVCache, *, max_context: int, penalty_capacity: int = 0) -> None:
        """Use `cache` from now on (the previous one is freed): new step buffers, no graphs yet."""
        self._check_open()
        self.detach_cache()
        self.cache = cache
        self.max_context = max_context
        self.steps = StepBuffers(self.max_batch_tokens, self.max_num_seqs, cache.layout.block_table_width,
                                 penalty_capacity=penalty_capacity, mask_words=(self.config.vocab_size + 31) // 32)
        self.graphs = GraphManager()
        self.graphs.add_kind(DECODE, self._enqueue_decode)
        self.graphs.add_kind(DECODE_MASKED, lambda bucket, stream: self._enqueue_decode(bucket, stream, masked=True))
        self.graphs.add_kind(PREFILL, self._enqueue_prefill)
        self.graphs.add_kind(PREFILL_MASKED, lambda bucket, stream: self._enqueue_prefill(bucket, stream, masked=True))

    def _splits_for(self, row_tiles: int, max_tiles: int, per_sm: int | None = None) -> int:
        """attention_splits on this GPU for this runner's KV heads; per_sm by default the attached cache's
        decode kernel's blocks an SM (BF16: DECODE_ITEMS_BLOCKS; INT8: a decode step's _h8 build, one token x the
        group a block)."""
        if per_sm is None:
            per_sm = K.DECODE_ITEMS_BLOCKS
            if self.cache is not None and self.cache.int8:
                group = self.local_config.num_attention_heads // self.local_config.num_key_value_heads
                per_sm = K.int8_decode_blocks(group)
        return attention_splits(row_tiles, self.local_config.num_key_value_heads, max_tiles, per_sm,
                                self.device.info.num_sms)

    def _partial_rows(self) -> int:
        """Rows of split-attention partials the workspace holds: the most a step of any context and either
        cache needs. A decode step of b sequences splits at most per_sm x SMs / (b x KV) ways; a verify step
        of b rows of q tokens (q x the group query rows a KV head: q G / ROW_TILE row tiles or more) at most
        per_sm x SMs / (b q G / ROW_TILE x KV), so its b q rows x splits stay within
        per_sm x SMs x ROW_TILE / H."""
        c = self.local_config
        per_sm = max(K.DECODE_ITEMS_BLOCKS, INT8_DECODE_BLOCKS_MAX)
        decode = max(self._splits_for(b, 1 << 30, per_sm) * b for b in self.buckets)
        return max(decode, per_sm * self.device.info.num_sms * ROW_TILE // c.num_attention_heads)

    def decode_splits(self, batch: int) -> int:
        """Key-range splits per sequence for decode attention: as many as one wave of the kernel's blocks an SM
        holds (INT8: three or four; BF16: two, or one at batch 1 over a short cache: K.bf16_decode_blocks), at
        least one key tile per split (always 1 when batch-invariant): a split of one tile already hides its
        combine."""
        if self.batch_invariant:
            return 1
        per_sm = None  # the cache's kernel's (_splits_for)
        if not self.cache.int8:
            L, layer = self.cache.layout, self.weights.layers[0]
            per_sm = K.bf16_decode_blocks(
                batch=batch, layer_cache_bytes=self.max_context * L.bytes_per_position // L.num_layers,
                layer_weight_bytes=sum(w.nbytes for w in (layer.w_qkv, layer.w_o, layer.w_up, layer.w_down)))
        return self._splits_for(batch, -(-self.max_context // KEY_TILE), per_sm)

    def verify_splits(self, shape: StepShape) -> int:
        """Key-range splits per sequence for a verify step: as a decode step's, each sequence counting a
        block per ROW_TILE of its query rows (max_q_len x the group), within the workspace's partials; 1
        for a step in the prefill shape (more query rows than the decode shape takes) or batch-invariant.
        Without a split the few blocks of a small verify step walk the whole cache one after another."""
        c = self.local_config
        group = c.num_attention_heads // c.num_key_value_heads
        if self.batch_invariant or not K.keys_mode(max_q_len=shape.max_q_len, group=group):
            return 1
        rows = shape.max_q_len * group
        per_sm = K.int8_decode_blocks(rows) if self.cache.int8 else K.DECODE_ITEMS_BLOCKS
        splits = self._splits_for(shape.num_seqs * -(-rows // ROW_TILE), -(-self.max_context // KEY_TILE), per_sm)
        return max(1, min(splits, self.workspace.max_partial_rows // shape.num_tokens))

    def _forward(self, shape: StepShape, *, all_logits: bool, num_splits: int, stream, embedded: bool = False,
                 sampled: DeviceArray | None = None):
        """Enqueue the forward pass of one step (its only caller); returns its logits rows. sampled: where
        the tokens with a source row (token_src) are read, instead of the previous step's samples."""
        inputs = self.steps.inputs if sampled is None else dataclasses.replace(self.steps.inputs, sampled=sampled)
        return forward(self.weights, self.workspace, self.cache, inputs, shape, all_logits=all_logits,
                       num_splits=num_splits, stream=stream, batch_invariant=self.batch_invariant, embedded=embedded,
                       tp=self.tensor_parallel, capture=self.capture)

    def _enqueue_step(self, shape: StepShape, *, sample: bool, num_splits: int, stream, embedded: bool = False,
                      masked: bool = False):
        """A step's forward, then (sample=True) the sampling launch over each sequence's last logits row;
        masked=True: the bitmasks are copied in beside the forward and the sampling waits for them
        (StepBuffers.fork_masks, join_masks)."""
        d, b = self.steps.dev, shape.num_seqs
        if masked:
            self.steps.fork_masks(b, stream)
        logits = self._forward(shape, all_logits=False, num_splits=num_splits, stream=stream, embedded=embedded)
        if not sample:
            return
        if masked:
            self.steps.join_masks(stream)
        penalties = (d["pen_offsets"].rows(0, b + 1), self.steps.penalty_tokens, self.steps.penalty_counts,
                     self.steps.penalty_biases, d["repetition"].rows(0, b), d["presence"].rows(0, b),
                     d["frequency"].rows(0, b))
        keyed = head_keys_written(logits, self.batch_invariant, self.tensor_parallel)  # batch 1, one GPU
        K.sample(logits, d["temperature"].rows(0, b), d["top_k"].rows(0, b), d["top_p"].rows(0, b),
                 d["min_p"].rows(0, b), d["seeds"].rows(0, b), d["counters"].rows(0, b),
                 self.steps.sampled.rows(0, b), stream, penalties=penalties,
                 masks=(d["mask_rows"].rows(0, b), self.steps.masks) if masked else None,
                 head_keys=self.workspace.head_keys if keyed else None, host_out=self.steps.sampled_out,
                 host_slot=d["sample_slot"])

    def _enqueue_decode(self, bucket: int, stream, masked: bool = False) -> None:
        """A decode step of `bucket` rows (what its graph captures): its first kernel fetches the step's inputs
        from the mapped host mirror, resolves tokens sampled by the step before and embeds them (under tensor
        parallelism those of this rank's vocabulary range: the forward all-reduces them); masked=True: its
        sampling waits for the step's bitmasks."""
        shape = StepShape(num_tokens=bucket, num_seqs=bucket, max_q_len=1)
        d = self.steps.dev
        tp = self.tensor_parallel
        K.fetch_step(self.steps.mirror, self.steps.device, d["tokens"], d["token_src"], self.steps.sampled,
                     stream, embed=(self.weights.embed, self.workspace.resid.rows(0, bucket)),
                     first=0 if tp is None else tp.vocab_start)
        self.steps.record_fetched(stream)
        self._enqueue_step(shape, sample=True, num_splits=self.decode_splits(bucket), stream=stream, embedded=True,
                           masked=masked)

    def _enqueue_prefill(self, bucket: int, stream, masked: bool = False) -> None:
        """A sampled prompt step of one sequence padded to `bucket` token rows (what its graph captures): the
        padding rows are no sequence's (past cu_q[1]: attention skips them) and store nothing (slot -1); the
        sampling takes the sequence's last real row (last_rows)."""
        shape = StepShape(num_tokens=bucket, num_seqs=1, max_q_len=bucket)
        self._enqueue_step(shape, sample=True, num_splits=1, stream=stream, masked=masked)

    # ------------------------------------------------------------------ steps
    def launch(self, batch, sampling: list[SamplingRow] | None = None, *, sample: bool = True,
               penalties: list | None = None, masked: list[bool] | None = None,
               token_src: list[int] | None = None) -> int | None:
        """Enqueue one step without waiting for it; returns the slot to `collect` its samples from
        (None with sample=False). At most two sampled steps may be in flight. masked: per row whether
        it samples under a bitmask; the step then waits for `publish_masks` before it samples."""
        self._check_open()
        self._copy_pending_pages()
        self._set_captured(sum(len(item[1]) for item in batch))
        decode = all(len(item[1]) == 1 for item in batch) and len(batch) <= self.max_num_seqs
        if masked is not None and any(masked) and not sample:
            raise ValueError("launch: rows with bitmasks in a step that does not sample")
        if decode:
            # Padded to its bucket, eager or not, so a graph replay and an eager step run the same launches.
            bucket = bucket_for(len(batch), self.buckets)
            prepare_step(self.steps, self.cache.manager, batch, sampling, pad_to=bucket, penalties=penalties,
                         masked=masked, token_src=token_src)
            with_masks = self._await_masks()
            self.steps.set_sample_slot(self._slot)
            self.steps.upload_entries(self.stream)
            if self.use_graphs:
                self.graphs.run(DECODE_MASKED if with_masks else DECODE, bucket, self.stream)
            else:
                self._enqueue_decode(bucket, self.stream, masked=with_masks)
            self.steps.fetched()
        else:
            bucket = prefill_bucket(len(batch[0][1]), self.max_batch_tokens) if sample and len(batch) == 1 else None
            pad = dict(pad_to=1, pad_tokens=bucket) if bucket else {}
            shape = prepare_step(self.steps, self.cache.manager, batch, sampling, penalties=penalties,
                                 masked=masked, token_src=token_src, **pad)
            with_masks = self._await_masks()
            self.steps.set_sample_slot(self._slot)
            self.steps.upload(self.stream)
            if bucket is None:
                self._enqueue_step(shape, sample=sample, num_splits=1, stream=self.stream, masked=with_masks)
            elif self.use_graphs:
                self.graphs.run(PREFILL_MASKED if with_masks else PREFILL, bucket, self.stream)
            else:
                self._enqueue_prefill(bucket, self.stream, masked=with_masks)
        if not sample:
            return None
        slot = self._slot  # the sampling kernel writes the ids into this row of the mapped sampled_host
        self._slot ^= 1
        self.steps.mark_sampled(slot, len(batch), self.stream)
        return slot

    def _await_masks(self) -> bool:
        """Note the step being launched as waiting for its masks, if it has any (from here on the stream may
        wait for them: close releases a step left waiting)."""
        if not self.steps.num_masks:
            return False
        self._awaiting.append((self.steps.num_masks, self._slot))
        return True

    def publish_masks(self, fill) -> None:
        """Hand the oldest step that waits for bitmasks its masks: fill(out) writes them, int32 [masked rows,
        words] in row order, straight into pinned memory (once the GPU has taken the masks before them); then
        the step samples. The step is released even if fill raises. Another thread may call it while this
        one launches the next step."""
        if not self._awaiting:
            raise RuntimeError("publish_masks: no launched step waits for bitmasks")
        n, _ = self._awaiting[0]
        try:
            fill(self.steps.mask_staging(n))
        finally:
            self.steps.release_masks()
            self._awaiting.popleft()

    def collect(self, slot: int | None, n: int) -> np.ndarray | None:
        """Wait for a launched step; its n sampled tokens (None for a step that did not sample)."""
        self._check_not_awaiting("wait for that step", slot)
        t = time.perf_counter()
        if slot is None:
            self.stream.synchronize()
            out = None
        else:
            out = self.steps.read_sampled(n, slot)
        self.wait_seconds += time.perf_counter() - t
        return out

    def logits_rows(self, n: int) -> np.ndarray:
        """The last step's first n logits rows (after penalties, before temperature): for logprobs."""
        self._check_not_awaiting("read logits")
        return self.workspace.logits.rows(0, n).to_host(self.stream)

    def extend(self, seq: Sequence, token_ids: list[int], *, chunk: int | None = None,
               logits: str = "all") -> np.ndarray | None:
        """Append tokens to `seq` in the attached cache (prefill chunks) and return next-token logits:
        logits="all" after each token, float32 [len(token_ids), vocab]; "last" after the last one only,
        [1, vocab]; "argmax" each of "all"'s rows' argmax, int32 [len(token_ids)] (found on the GPU,
        lowest index on ties; greedy verification copies 4 bytes a row instead of the vocabulary);
        "none" none (a prefill: no LM head rows beyond one per chunk, nothing copied back).
        The pages are reserved here; the caller owns `seq` (release or truncate it through the
        cache's manager)."""
        self._check_open()
        self._check_not_awaiting("run extend")
        if self.cache is None:
            raise RuntimeError("no KV cache is attached to this model: call ensure_cache() first")
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {', '.join(map(repr, LOGITS_MODES))}, got {logits!r}")
        ids = self.validate_ids(token_ids)
        chunk = min(chunk or self.workspace.max_logit_rows, self.workspace.max_logit_rows, self.max_batch_tokens)
        cache = self.cache
        every_row = logits in ("all", "argmax")
        out = np.empty((len(ids), self.config.vocab_size), np.float32) if logits == "all" else None
        if logits == "argmax":
            out = np.empty(len(ids), np.int32)
        self._set_captured(0)
        for start in range(0, len(ids), chunk):
            part = ids[start: start + chunk]
            if self.capture is not None and start:  # the chunk before's states, before this one overwrites them
                self._captured.append(self._read_capture(self._captured_rows))
            self._captured_rows = len(part)
            cache.manager.reserve(seq, len(part))
            shape = prepare_step(self.steps, cache.manager, [(seq, part)])
            self.steps.upload(self.stream)
            n = len(part)
            rows = self._forward(shape, all_logits=every_row, num_splits=1, stream=self.stream)
            if every_row:
                out[start: start + n] = self._read_rows(rows, n, logits)
            elif logits == "last" and start + n == len(ids):
                out = rows.rows(rows.shape[0] - 1, rows.shape[0]).to_host(self.stream)
        if logits == "none":
            self.stream.synchronize()
        return out

    @property
    def max_verify_tokens(self) -> int:
        """The most tokens one verify step takes: one chunk, with a logits row for each."""
        return min(self.max_batch_tokens, self.workspace.max_logit_rows)

    def verify(self, batch, *, logits: str = "argmax", graph_width: int | None = None,
               drafted: DeviceDrafts | None = None, meanwhile: Callable[[], None] | None = None) -> np.ndarray:
        """One step over (sequence, new ids, start) rows, their positions reserved, returning every new
        token's next-token logits in row order: logits="argmax" their argmaxes (found on the GPU, lowest
        index on ties), int32 [tokens]; "all" float32 [tokens, vocab]. The engine's speculative decoding
        checks a batch of draft proposals with it: a row is a sequence's last committed token and its
        proposals. The step must fit one chunk (at most max_batch_tokens tokens and the workspace's
        logits rows).

        graph_width: with graphs on, the step is padded to the batch's decode bucket x graph_width
        tokens (each row at most graph_width) and replays the graph of that shape, captured on its
        first use; otherwise (or when the padded step would not fit) it runs eagerly.
        drafted: the proposals are read on the device from where a DFlash drafter's pass on this stream
        left them (row i's token j >= 1 is drafted.ids[drafted.first[i] + j]; the ids given for them are
        placeholders), so the host need not wait for the drafts before it launches the step.
        meanwhile: called once the step is launched, before its results are waited for (work for the
        host, or launches that follow the step on the GPU)."""
        self._check_open()
        self._check_not_awaiting("run verify")
        if logits not in ("argmax", "all"):
            raise ValueError(f"logits must be 'argmax' or 'all', got {logits!r}")
        n = sum(len(item[1]) for item in batch)
        if not batch or n > self.max_verify_tokens:
            raise ValueError(f"verify: {n} tokens in {len(batch)} rows; "
                             f"a verify step takes 1..{self.max_verify_tokens}")
        sources = _draft_sources(batch, drafted) if drafted is not None else None
        self._copy_pending_pages()
        self._set_captured(n)
        bucket = self._verify_bucket(batch, graph_width)
        pad = dict(pad_to=bucket, pad_tokens=bucket * graph_width) if bucket else {}
        shape = prepare_step(self.steps, self.cache.manager, batch, **pad)
        sampled = None
        if drafted is not None:
            set_token_sources(self.steps, *sources)
            sampled = drafted.ids
        self.steps.upload(self.stream)
        if bucket is None:
            rows = self._forward(shape, all_logits=True, num_splits=self.verify_splits(shape), stream=self.stream,
                                 sampled=sampled)
            if logits == "argmax":
                K.argmax(rows, self.workspace.logit_argmax.rows(0, n), self.stream)
        else:
            kind = verify_kind(graph_width, logits, sampled.ptr if sampled is not None else 0)
            if not self.graphs.has_kind(kind):
                self.graphs.add_kind(kind, lambda b, s: self._enqueue_verify(b, graph_width, logits, s, sampled))
            self.graphs.run(kind, bucket, self.stream)
        if logits == "argmax":
            # 4 bytes a row, copied into pinned memory ahead of what `meanwhile` launches: the host's wait
            # ends with the step, not behind the launches that follow it.
            call(driver.cuMemcpyDtoHAsync, self._argmax_host.ptr, self.workspace.logit_argmax.ptr, n * 4,
                 self.stream.handle)
            self._argmax_ready.record(self.stream)
        if meanwhile is not None:
            meanwhile()
        t = time.perf_counter()
        if logits == "argmax":
            self._argmax_ready.synchronize()
            out = self._argmax_host.array((n,), np.int32).copy()
        else:
            out = (rows if bucket is None else self.workspace.logits).rows(0, n).to_host(self.stream)
        self.wait_seconds += time.perf_counter() - t
        return out

    def _verify_bucket(self, batch, width: int | None) -> int | None:
        """The decode bucket a graphed verify step pads `batch` to, or None for an eager step."""
        if not (width and self.use_graphs and len(batch) <= self.max_num_seqs):
            return None
        bucket = bucket_for(len(batch), self.buckets)
        if bucket * width > self.max_verify_tokens or any(len(item[1]) > width for item in batch):
            return None
        return bucket

    def _enqueue_verify(self, bucket: int, width: int, logits: str, stream, sampled: DeviceArray | None) -> None:
        """A verify step of `bucket` rows of up to `width` tokens (padding rows do nothing), with the
        argmax of every row's logits when logits="argmax"; sampled: where its drafted tokens are read."""
        n = bucket * width
        shape = StepShape(num_tokens=n, num_seqs=bucket, max_q_len=width)
        rows = self._forward(shape, all_logits=True, num_splits=self.verify_splits(shape), stream=stream,
                             sampled=sampled)
        if logits == "argmax":
            K.argmax(rows, self.workspace.logit_argmax.rows(0, n), stream)

    def _set_captured(self, rows: int) -> None:
        """The step being launched writes `rows` rows of the capture buffers (last_features reads them)."""
        self._captured.clear()
        self._captured_rows = rows

    def _read_rows(self, rows, n: int, logits: str) -> np.ndarray:
        """The first n logits rows to the host: "all" as they are, "argmax" each row's argmax (found on
        the GPU, so 4 bytes a row cross instead of the vocabulary)."""
        if logits == "all":
            return rows.to_host(self.stream)
        best = self.workspace.logit_argmax.rows(0, n)
        K.argmax(rows, best, self.stream)
        return best.to_host(self.stream)

    def _copy_pending_pages(self) -> None:
        """Copy-on-write pages the block manager asked for, before a step writes into them."""
        copies = self.cache.manager.take_pending_copies()
        if copies:
            self.cache.copy_pages(copies, self.stream)

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this model was closed; load it again (tileinfer.load_model)")

    def detach_cache(self) -> None:
        """Free the attached cache, its step buffers and graphs."""
        if self.graphs is not None:
            self.graphs.destroy()
        if self.steps is not None:
            self.steps.free()
        if self.cache is not None:
            self.cache.free()
        self.cache = self.steps = self.graphs = None

    def close(self) -> None:
        """Free every device allocation this model made (not a tensor-parallel communicator: the caller's)."""
        if self._closed:
            return
        while self._awaiting:  # abandoned (an error between launch and publish): let the stream drain
            self._awaiting.popleft()
            self.steps.masks_taken(timeout=5.0)  # the step before it first (a dead device: synchronize says so)
            self.steps.release_masks()
        self.stream.synchronize()
        self.detach_cache()
        if self.capture is not None:
            self.capture.free()
        self.workspace.free()
        self.weights.free()
        self._argmax_host.free()
        self.stream.destroy()
        self._closed = True

    def __enter__(self) -> "GPURunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
