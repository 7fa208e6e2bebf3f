"""A DFlash drafter on the GPU: its layers beside its target's (whose embedding and LM head it borrows), a
paged KV pool of its own, and the target's kernels. Two passes, on the target's stream:

  context  `add_context(rows)`, right after the target step that computed those positions: the target's
           captured states there (runner/gpu.py capture_hidden_states), gathered as bf16 from where the
           step left them on the device (gather_states: they never cross to the host); c = rmsnorm(fc(f),
           hidden_norm), then for every layer qkv = c @ W_qkv and attn_input, which stores the k-normed,
           RoPE'd keys and the values at the entries' slots (RoPE at the target's positions; the queries it
           computes are not used). c does not depend on the layer, so the context needs no layer-by-layer pass.
           Its inputs (positions, slots, capture rows) have buffers and an upload of their own.
  block    `draft(rows)`: every row's last committed token and k masks at positions start..start+k through
           forward(), the target's own step: each block token is a one-token pseudo-sequence that shares its
           row's block table and attends to all of the row's entries (context, then the whole block, which
           the layer's attn_input has written before its attention reads it). A one-token query has no causal
           mask, so the block attends non-causally, as DFlash's does. The LM head gives every block token's
           logits; their argmax on the GPU, rows 1..k of each block, are the drafts. They are copied to
           `drafted`, where the target's verify step reads them (GPURunner.verify(drafted=...)), and to the
           host without a wait: the engine reads them once the verify step is done.
After a greedy verify step the next round's block pass can go out before the host has read the step
(`draft_ahead`): next_block_inputs (cuda_src/embedding.cu) finds each row's verdict from the step's argmaxes
and the drafts it checked and writes the pass's inputs, and the pass follows; the next draft() over those very
blocks takes its drafts. The GPU then runs the block while the host reads the round and stages the next verify
step.
A context of at most CONTEXT_GRAPH_TOKENS entries (a round's: k + 1 a request) is one graph, replayed per
row count rounded up to CONTEXT_GRAPH_STEP; a longer one (a prompt's) goes eagerly in chunks of
CONTEXT_TOKENS. Blocks go in groups of at most DRAFT_TOKENS tokens, one graph per group's token count (and one
per token count and block size for the passes drafted ahead). Their inputs are rows of the step buffers (and
the context's source rows), uploaded before the replay, so only those counts pick the graph. With the target's
graphs off (use_graphs) all is eager.
"""
from __future__ import annotations

from itertools import accumulate
from pathlib import Path

import numpy as np
from cuda.bindings import driver

from .. import kernels as K
from ..cuda import DeviceArray, Event, PinnedBuffer
from ..cuda.driver import call
from ..graphs import GraphManager
from ..kv import PagedKVCache
from ..kv.paged_cache import cdiv
from ..model.checkpoint import Checkpoint
from ..model.dflash_config import DFlashConfig
from ..model.forward import BF16, Workspace, check_supported, forward
from ..model.weights import DeviceWeights
from .base import AheadRow, ContextRow, DeviceDrafts, DraftRow, Proposals
from .gpu import KEY_TILE, GPURunner, attention_splits
from .step import StepBuffers, prepare_token_rows, token_rows_shape

CONTEXT_TOKENS = 512        # context entries a chunk of the context pass takes (its workspace rows)
DRAFT_TOKENS = 128          # block tokens a group of the block pass takes (its logits rows)
CONTEXT_GRAPH_TOKENS = 256  # at most this much new context goes through a graph (a round's: k + 1 a request)
CONTEXT_GRAPH_STEP = 16     # the graphed context pass's rows are rounded up to a multiple of this
# The block pass splits each block token's keys as a decode step does (attention blocks of a BF16 cache an SM),
# but below FUSED_MIN_SPLITS: a fused launch would store each token's key in the block that attends for it,
# while every block token reads the whole block's keys, which attn_input stores before any attention reads.
BLOCK_PER_SM = 2
BLOCK_MAX_SPLITS = K.FUSED_MIN_SPLITS - 1


class _DecoderView:
    """A DFlash checkpoint seen as DeviceWeights reads a model's: its layers under "model.layers.N.", its final
    norm as "model.norm.weight" (z-lab's checkpoints have no "model." prefix), its config the decoder's."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.config = checkpoint.config.decoder
        self.total_bytes = checkpoint.total_bytes

    def read(self, name: str) -> np.ndarray:
        return self.checkpoint.read(name.removeprefix("model."))


class GPUDFlashRunner:
    """A DFlash checkpoint for the GPU runner; `bind_target` pairs it with the GPURunner it drafts for (and
    uploads its weights: the embedding and LM head are the target's). Drafts replay graphs when the target's
    steps do (use_graphs)."""

    def __init__(self, path: str | Path, *, max_num_seqs: int = 8):
        self.checkpoint = Checkpoint.open_dflash(path)
        self.config: DFlashConfig = self.checkpoint.config
        self.local_config = self.config.decoder  # what a page of its pool holds (kv/sizing.py)
        check_supported(self.local_config, path)
        self.max_num_seqs = max_num_seqs
        self.target: GPURunner | None = None
        self.cache: PagedKVCache | None = None
        self.steps: StepBuffers | None = None
        self.graphs: GraphManager | None = None  # draft graphs over the attached pool's step buffers
        self.use_graphs = True
        self._arrays: list[DeviceArray] = []

    def bind_target(self, target: GPURunner) -> None:
        """Draft for `target`: check the pair fits, make the target capture the layers this drafter reads, and
        upload the weights and workspace. Binding the same target again does nothing."""
        if self.target is target:
            return
        if not isinstance(target, GPURunner):
            raise ValueError("a DFlash drafter on the GPU drafts for a GPU model (load both with device='cuda'); "
                             "on the CPU load it with device='cpu'")
        if self.target is not None:
            raise ValueError("this DFlash drafter already drafts for another model; load it again for this one")
        if target.tensor_parallel is not None:
            raise ValueError("DFlash drafting under tensor parallelism is not supported")
        self.config.check_target(target.config)
        target.capture_hidden_states(self.config.target_layer_ids)
        self.stream = target.stream  # one stream: a draft follows the target step whose states it reads
        c = self.local_config
        self.weights = DeviceWeights(_DecoderView(self.checkpoint), self.stream, progress=False,
                                     vocab_from=target.weights)
        self.fc = self._upload("fc.weight")               # [hidden, feature_size]
        self.hidden_norm = self._upload("hidden_norm.weight")
        self.draft_tokens = max(DRAFT_TOKENS, self.config.block_size)
        self.workspace = Workspace(c, max_tokens=max(CONTEXT_TOKENS, self.draft_tokens),
                                   max_logit_rows=self.draft_tokens, max_splits=BLOCK_MAX_SPLITS,
                                   max_partial_rows=BLOCK_PER_SM * target.device.info.num_sms // c.num_key_value_heads)
        # Each draft's block argmaxes (target token ids), as the target's verify step reads them, and their
        # copies on the host: two, taken in turn by the block passes, so that a pass launched ahead
        # (draft_ahead) does not overwrite the drafts of the round still being read.
        self.drafted = DeviceArray((max(target.max_verify_tokens, self.draft_tokens),), np.int32)
        self._drafted_host = [PinnedBuffer(self.drafted.nbytes) for _ in range(2)]
        self._drafted_ready = [Event(timing=False) for _ in range(2)]
        self._passes = 0  # block passes launched (pass i copies its drafts to _drafted_host[i % 2])
        self._ahead: _Ahead | None = None  # the block pass draft_ahead launched, until draft() takes it
        self.features = DeviceArray((CONTEXT_TOKENS, self.config.feature_size), BF16)
        # The context pass's inputs: positions, slots and each entry's row of the capture, in one upload of
        # their own (the block pass's step buffers are staged while a context pass may still read these).
        self._context_host = PinnedBuffer(3 * CONTEXT_TOKENS * 4)
        self._context_inputs = DeviceArray((3, CONTEXT_TOKENS), np.int32)
        self._context_uploaded = Event(timing=False)
        self._context_pending = False
        self.context_positions, self.context_slots, self.context_src = (
            self._context_inputs.rows(i, i + 1).view((CONTEXT_TOKENS,)) for i in range(3))
        self._arrays += [self.drafted, self.features, self._context_inputs]
        self._capture = cap = target.capture  # what the context graphs read
        # Where the target's last layer's states sit in the capture rows (gather_states reads them from `last`).
        self._last_col = 0
        if cap.last is not None:
            self._last_col = cap.layers.index(target.config.num_hidden_layers - 1) * target.config.hidden_size
        self.use_graphs = target.use_graphs
        self.target = target

    def _upload(self, name: str) -> DeviceArray:
        out = DeviceArray.from_host(self.checkpoint.read(name), self.stream)
        self._arrays.append(out)
        return out

    # ------------------------------------------------------------------ cache
    def new_cache(self, *, num_pages: int | None = None, max_tokens: int | None = None, page_size: int = 64,
                  max_seq_len: int | None = None, **_) -> PagedKVCache:
        """The drafter's own pool: BF16, no prefix caching (context entries are per request). A sequence holds
        its context and a block: max_seq_len is raised by one block."""
        if max_seq_len is not None:
            max_seq_len += self.config.block_size
        return PagedKVCache(self.local_config, num_pages=num_pages, max_tokens=max_tokens, page_size=page_size,
                            max_seq_len=max_seq_len)

    def attach_cache(self, cache: PagedKVCache, *, max_context: int = 0) -> None:
        """Use `cache` (the previous one is freed) with step buffers for its block tables."""
        self._check_bound()
        self.detach_cache()
        self.cache = cache
        self.steps = StepBuffers(self.workspace.max_tokens, self.draft_tokens, cache.layout.block_table_width)
        self.graphs = GraphManager()
        # draft_ahead's rows (next_block_inputs' layout: 7 ints and a block table a request), their upload
        self._ahead_rows = DeviceArray((self.draft_tokens, 7 + cache.layout.block_table_width), np.int32)
        self._ahead_host = PinnedBuffer(self._ahead_rows.nbytes)
        self._ahead_uploaded = Event(timing=False)

    def ensure_cache(self, max_tokens: int, page_size: int = 64) -> PagedKVCache:
        """A pool of at least max_tokens entries (a new one if the attached one is smaller), each sequence up to
        max_tokens entries long."""
        c = self.cache
        if c is None or c.capacity < max_tokens or c.page_size != page_size:
            self.attach_cache(self.new_cache(num_pages=cdiv(max_tokens, page_size), page_size=page_size,
                                             max_seq_len=max_tokens))
        return self.cache

    def detach_cache(self) -> None:
        if self.graphs is not None:
            self.graphs.destroy()
        if self.steps is not None:
            if not self.target._closed:  # (the stream is the target's)
                self.stream.synchronize()
            self.steps.free()
            self._ahead_rows.free()
            self._ahead_host.free()
            self._ahead_uploaded.destroy()
        self._ahead = None
        if self.cache is not None:
            self.cache.free()
        self.cache = self.steps = self.graphs = None

    # ------------------------------------------------------------------ context
    def add_context(self, rows: list[ContextRow]) -> None:
        """Each row's context entries (reserved at row.entry of its sequence), written now from the target's
        states at rows row.row.. of its last step, which must still be on the device (no target step since)."""
        self._check_attached()
        rows = [row for row in rows if len(row.positions)]
        if not rows:
            return
        if self.target.capture is not self._capture:
            raise RuntimeError("the target's capture buffers changed since this drafter was bound to it")
        first, n = self.target.captured_on_device
        for row in rows:
            if row.row < first or row.row + len(row.positions) > first + n:
                raise ValueError(f"add_context: rows {row.row}..{row.row + len(row.positions) - 1} of the target's "
                                 f"last step, whose rows {first}..{first + n - 1} are on the device")
        manager = self.cache.manager
        positions = np.concatenate([row.positions for row in rows])
        slots = np.concatenate([manager.slots(row.seq, row.entry, len(row.positions)) for row in rows])
        src = np.concatenate([row.row - first + np.arange(len(row.positions)) for row in rows])
        for start in range(0, len(src), CONTEXT_TOKENS):
            stop = min(start + CONTEXT_TOKENS, len(src))
            count = stop - start
            graphed = self.use_graphs and count <= CONTEXT_GRAPH_TOKENS
            padded = -(-count // CONTEXT_GRAPH_STEP) * CONTEXT_GRAPH_STEP if graphed else count
            self._stage_context(positions[start:stop], slots[start:stop], src[start:stop], padded)
            if graphed:
                if not self.graphs.has_kind("context"):
                    self.graphs.add_kind("context", self._enqueue_context)
                self.graphs.run("context", padded, self.stream)
            else:
                self._enqueue_context(count, self.stream)

    def _stage_context(self, positions: np.ndarray, slots: np.ndarray, src: np.ndarray, padded: int) -> None:
        """Context entries' positions, slots and capture rows into rows 0..padded of the context inputs (rows
        past the entries: slot -1, nothing stored; source -1, zero states), uploaded."""
        n = len(slots)
        if self._context_pending:  # the last upload has read the pinned rows
            self._context_uploaded.synchronize()
        host = self._context_host.array((3, CONTEXT_TOKENS), np.int32)
        host[0, :n], host[1, :n], host[2, :n] = positions, slots, src
        host[0, n:padded], host[1:, n:padded] = 0, -1
        call(driver.cuMemcpyHtoDAsync, self._context_inputs.ptr, self._context_host.ptr, self._context_inputs.nbytes,
             self.stream.handle)
        self._context_uploaded.record(self.stream)
        self._context_pending = True

    def _enqueue_context(self, n: int, stream) -> None:
        """The context pass over rows 0..n of the inputs: their states gathered from the target's capture
        buffers into `features`, c = rmsnorm(fc(f)), then every layer's keys and values of c stored at the
        slots."""
        c, ws, cap = self.local_config, self.workspace, self._capture
        f = self.features.rows(0, n)
        K.gather_states(self.context_src.rows(0, n), cap.states, cap.last, self._last_col, f, stream)
        resid, x, qkv, q = ws.resid.rows(0, n), ws.x.rows(0, n), ws.qkv.rows(0, n), ws.q.rows(0, n)
        K.linear(f, self.fc, resid, "f32", stream)
        K.rmsnorm(resid, self.hidden_norm, x, c.rms_norm_eps, stream)
        positions, slots = self.context_positions.rows(0, n), self.context_slots.rows(0, n)
        for i, lw in enumerate(self.weights.layers):
            K.linear(x, lw.w_qkv, qkv, "bf16", stream)
            K.attn_input(qkv, positions, slots, lw.q_norm, lw.k_norm, ws.inv_freq, q, self.cache.k_pool(i),
                         self.cache.v_pool(i), c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps, stream)

    # ------------------------------------------------------------------ drafting
    def draft(self, rows: list[DraftRow]) -> Proposals:
        """Each row's k drafts (the argmax of block rows 1..k), over the context its sequence holds. Enqueued,
        not waited for: every row's block argmaxes go to `drafted`, one row's after another, where the target's
        verify step reads them (Proposals.device); `tokens()` reads them back. The block's entries are written
        into the pool; the caller truncates each sequence back to its context afterwards. When draft_ahead
        launched the pass these rows describe, that pass's drafts are the answer and nothing is launched."""
        self._check_attached()
        offsets = list(accumulate((len(r.block) for r in rows), initial=0))
        n = offsets[-1]
        ahead, self._ahead = self._ahead, None
        if ahead is not None and ahead.drafts(rows):
            return self._proposals(rows, offsets, ahead.index)
        if n > self.drafted.shape[0]:
            raise ValueError(f"draft: {n} block tokens in one call; a round drafts at most "
                             f"{self.drafted.shape[0]} (the target's verify step)")
        group: list[DraftRow] = []
        at = size = 0
        for row in rows:
            if group and size + len(row.block) > self.draft_tokens:
                at = self._block(group, at)
                group, size = [], 0
            group.append(row)
            size += len(row.block)
        if group:
            self._block(group, at)
        return self._proposals(rows, offsets, self._read_back(n))

    def draft_ahead(self, rows: list[AheadRow]) -> None:
        """Launch the next round's block pass now, before the host has read the verify step whose result it
        needs: next_block_inputs decides each row's block (the token the step commits, its position and entry)
        from the step's argmaxes and the drafts it checked, on the device, after the context pass of the
        step's positions (add_context, called first), and writes the pass's step inputs; the pass follows
        (one graph a block size and token count). The next draft() whose rows are exactly these blocks takes
        the pass's drafts instead of launching one (a row that did not go as the greedy verdict says does not
        match, and draft() launches a fresh pass); drafts only ever steer speculation, so a pass taken or not
        never changes what the target emits. Each row holds `count` entries past its context's end (where the
        block may start at the latest) while the pass is launched."""
        self._check_attached()
        self._ahead = None
        n = sum(r.count for r in rows)
        if not rows or n > self.draft_tokens or len({r.count for r in rows}) != 1:
            return
        manager, stream, width = self.cache.manager, self.stream, self.steps.table_width
        held = []
        try:
            for r in rows:
                if not manager.can_reserve(r.seq, r.count):
                    return
                held.append((r.seq, r.seq.num_positions))
                manager.reserve(r.seq, r.count)
                if len(r.seq.block_table) > width:
                    return
            self._ahead_uploaded.synchronize()  # the last upload has read the pinned rows
            table = self._ahead_host.array((len(rows), 7 + width), np.int32)
            out = 0
            for i, r in enumerate(rows):
                table[i, :7] = (r.src, r.m, r.first, r.start, r.entry, r.count, out)
                pages = r.seq.block_table
                table[i, 7:7 + len(pages)] = pages
                table[i, 7 + len(pages):] = 0
                out += r.count
            call(driver.cuMemcpyHtoDAsync, self._ahead_rows.ptr, self._ahead_host.ptr, table.nbytes, stream.handle)
            self._ahead_uploaded.record(stream)
            self._launch_block(n, 0, ("ahead", rows[0].count))
            self._ahead = _Ahead([(r.seq, r.start, r.entry, r.m, r.count) for r in rows], self._read_back(n))
        finally:
            for seq, kept in held:
                manager.truncate(seq, kept)

    def _enqueue_ahead(self, count: int, n: int, stream) -> None:
        """next_block_inputs over the n // count rows of `_ahead_rows`, then the block pass of n tokens."""
        target = self.target
        K.next_block_inputs(self._ahead_rows.rows(0, n // count), target.workspace.logit_argmax, self.drafted,
                            self.config.mask_token_id, self.cache.page_size, self.steps.inputs, stream)
        self._enqueue_block(n, stream)

    def _read_back(self, n: int) -> int:
        """Copy the n drafts of the pass just enqueued to the host (the next of the two copies); the pass's index."""
        index = self._passes
        self._passes += 1
        if n:
            call(driver.cuMemcpyDtoHAsync, self._drafted_host[index % 2].ptr, self.drafted.ptr, n * 4,
                 self.stream.handle)
            self._drafted_ready[index % 2].record(self.stream)
        return index

    def _proposals(self, rows: list[DraftRow], offsets: list[int], index: int) -> Proposals:
        """The drafts of block pass `index` for these rows (block i at offsets[i] of `drafted`)."""
        n = offsets[-1]

        def read() -> list[list[int]]:
            if self._passes > index + 2:
                raise RuntimeError("draft: these drafts were not read before later block passes overwrote them")
            if n:
                self._drafted_ready[index % 2].synchronize()
            ids = self._drafted_host[index % 2].array((max(n, 1),), np.int32)
            return [ids[o + 1: o + len(r.block)].tolist() for o, r in zip(offsets, rows)]

        return Proposals([len(r.block) - 1 for r in rows], read=read, device=DeviceDrafts(self.drafted, offsets[:-1]))

    def _block(self, group: list[DraftRow], at: int) -> int:
        """One block pass over these rows (one launch sequence, or a graph replay), its argmaxes copied to
        drafted[at:]; returns the offset past them."""
        manager, stream = self.cache.manager, self.stream
        tokens, positions, slots, kv_lens = [], [], [], []
        for row in group:
            m = len(row.block)
            first = row.entry                 # the block's first entry
            tokens += row.block
            positions.append(row.start + np.arange(m))           # the target's positions, not the entries'
            slots.append(manager.slots(row.seq, first, m))        # each token's own entry
            kv_lens.append(np.full(m, first + m))                 # every block token attends to entries [0, first + m)
        shape = prepare_token_rows(self.steps, [(row.seq, len(row.block)) for row in group], tokens,
                                   np.concatenate(positions), np.concatenate(slots), np.concatenate(kv_lens))
        self.steps.upload(stream)
        self._launch_block(shape.num_tokens, at)
        return at + shape.num_tokens

    def _launch_block(self, n: int, at: int, kind="draft") -> None:
        """The block pass of n tokens (a graph replay when graphs are on): over rows 0..n of the step buffers
        ("draft"), or over the inputs next_block_inputs writes first ("ahead", count); its argmaxes copied to
        drafted[at:]."""
        stream = self.stream
        enqueue = self._enqueue_block if kind == "draft" else (lambda b, s: self._enqueue_ahead(kind[1], b, s))
        if self.use_graphs:
            if not self.graphs.has_kind(kind):
                self.graphs.add_kind(kind, enqueue)
            self.graphs.run(kind, n, stream)
        else:
            enqueue(n, stream)
        call(driver.cuMemcpyDtoDAsync, self.drafted.ptr + at * 4, self.workspace.logit_argmax.ptr, n * 4,
             stream.handle)

    def _enqueue_block(self, n: int, stream) -> None:
        """A block pass of n tokens (rows 0..n of the step inputs) and each logits row's argmax."""
        logits = forward(self.weights, self.workspace, self.cache, self.steps.inputs,
                         token_rows_shape(n), all_logits=True,
                         num_splits=self._block_splits(n), stream=stream)
        K.argmax(logits, self.workspace.logit_argmax.rows(0, n), stream)

    def _block_splits(self, n: int) -> int:
        """Key-range splits of a block pass of n tokens (one block a KV head and split each): one wave of
        BLOCK_PER_SM blocks an SM over the longest sequence the pool holds, at most BLOCK_MAX_SPLITS."""
        L = self.cache.layout
        tiles = cdiv(min(L.block_table_width, L.num_pages) * L.page_size, KEY_TILE)
        splits = attention_splits(n, L.num_kv_heads, tiles, BLOCK_PER_SM, self.target.device.info.num_sms)
        return max(1, min(splits, BLOCK_MAX_SPLITS, self.workspace.max_partial_rows // n))

    # ------------------------------------------------------------------ lifetime
    def _check_bound(self) -> None:
        if self.target is None:
            raise RuntimeError("bind_target() first: a DFlash drafter embeds and decodes with its target's weights")

    def _check_attached(self) -> None:
        self._check_bound()
        if self.cache is None:
            raise RuntimeError("no KV pool is attached to this drafter: call ensure_cache() first")

    def close(self) -> None:
        """Free what this drafter allocated (not the target's embedding and LM head it borrows)."""
        if self.target is None:
            return
        self.detach_cache()
        self.weights.free()
        self.workspace.free()
        for a in self._arrays:
            a.free()
        self._arrays.clear()
        for buffer in self._drafted_host + [self._context_host]:
            buffer.free()
        self.target = None

    def __enter__(self) -> "GPUDFlashRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Ahead:
    """A block pass draft_ahead launched: each row's (sequence, start, entry, m, count) as its AheadRow gave
    them, and the pass's index (where its drafts are read back)."""

    def __init__(self, rows: list[tuple], index: int):
        self.rows, self.index = rows, index

    def drafts(self, rows: list[DraftRow]) -> bool:
        """Whether this pass drafted exactly these rows: the same sequences and block sizes, each block where
        its step's greedy verdict put it (acc of the m drafts accepted: position start + acc + 1, context entry
        entry + acc + 1). The block's first token is the committed token the verdict chose, which the device
        took from the same argmaxes."""
        if len(rows) != len(self.rows):
            return False
        for row, (seq, start, entry, m, count) in zip(rows, self.rows):
            acc = row.start - start - 1
            if row.seq is not seq or len(row.block) != count or not 0 <= acc <= m or row.entry != entry + acc + 1:
                return False
        return True
