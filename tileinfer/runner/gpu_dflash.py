"""A DFlash drafter on the GPU: its layers beside its target's (whose embedding and LM head it borrows), a
paged KV pool of its own, and the target's kernels.

A draft (`draft(rows)`, one DraftRow per request from engine/dflash.py) runs two passes on the target's
stream:
  context  the rows' new context entries: the target's captured states at the positions it computed since
           the last draft (runner/gpu.py capture_hidden_states), as bf16; c = rmsnorm(fc(f), hidden_norm),
           then for every layer qkv = c @ W_qkv and attn_input, which stores the k-normed, RoPE'd keys and the
           values at the entries' slots (RoPE at the target's positions; the queries it computes are not
           used). c does not depend on the layer, so the context needs no layer-by-layer pass.
  block    every row's last committed token and k masks at positions start..start+k through forward(), the
           target's own step: each block token is a one-token pseudo-sequence that shares its row's block
           table and attends to all of the row's entries (context, then the whole block, which the layer's
           attn_input has written before its attention reads it). A one-token query has no causal mask, so
           the block attends non-causally, as DFlash's does. The LM head gives every block token's logits;
           their argmax on the GPU, rows 1..k of each block, are the drafts.
A round's draft (new context of at most CONTEXT_GRAPH_TOKENS entries, blocks of at most DRAFT_TOKENS tokens in
all) is one graph, replayed per (context rows rounded up to CONTEXT_GRAPH_STEP, block tokens): its inputs are
rows of the step buffers, uploaded before the replay, so only those shapes pick the graph. A longer context (a
prompt's) goes first, eagerly, in chunks of CONTEXT_TOKENS entries; then the blocks, in groups of at most
DRAFT_TOKENS tokens, each a graph of no context rows. With the target's graphs off (use_graphs) all is eager.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import kernels as K
from ..cuda import DeviceArray
from ..graphs import GraphManager
from ..kv import PagedKVCache
from ..kv.paged_cache import cdiv
from ..model.checkpoint import Checkpoint
from ..model.dflash_config import DFlashConfig
from ..model.forward import BF16, Workspace, check_supported, forward
from ..model.inputs import StepShape
from ..model.weights import DeviceWeights
from .base import DraftRow
from .gpu import GPURunner
from .step import StepBuffers, prepare_step

CONTEXT_TOKENS = 512       # context entries a chunk of the context pass takes (its workspace rows)
DRAFT_TOKENS = 128         # block tokens a group of the block pass takes (its logits rows)
CONTEXT_GRAPH_TOKENS = 64  # at most this much new context goes through a draft's graph (a round's: k + 1 a row)
CONTEXT_GRAPH_STEP = 16    # the graphed context pass's rows are rounded up to a multiple of this


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
                                   max_logit_rows=self.draft_tokens, max_decode_rows=self.draft_tokens, max_splits=1)
        self.features = DeviceArray((CONTEXT_TOKENS, self.config.feature_size), BF16)
        self._arrays.append(self.features)
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
        if self.cache is not None:
            self.cache.free()
        self.cache = self.steps = self.graphs = None

    # ------------------------------------------------------------------ drafting
    def draft(self, rows: list[DraftRow]) -> list[list[int]]:
        """Each row's k drafts (the argmax of block rows 1..k). The rows' new context and block entries are
        written into the pool; the caller truncates each sequence back to its context afterwards."""
        self._check_bound()
        if self.cache is None:
            raise RuntimeError("no KV pool is attached to this drafter: call ensure_cache() first")
        if not rows:
            return []
        entries = [row.entry for row in rows]
        positions, slots, features = self._context_rows(rows, entries)
        if len(slots) <= CONTEXT_GRAPH_TOKENS and sum(len(row.block) for row in rows) <= self.draft_tokens:
            return self._block(list(zip(rows, entries)), (positions, slots, features))  # one launch or replay
        for start in range(0, len(slots), CONTEXT_TOKENS):
            stop = min(start + CONTEXT_TOKENS, len(slots))
            self._stage_context(features[start:stop], positions[start:stop], slots[start:stop], 0, stop - start)
            self.steps.upload(self.stream)
            self._enqueue_context(stop - start, 0, self.stream)
        out: list[list[int]] = []
        group: list[tuple[DraftRow, int]] = []
        for row, entry in zip(rows, entries):
            if sum(len(r.block) for r, _ in group) + len(row.block) > self.draft_tokens:
                out += self._block(group)
                group = []
            group.append((row, entry))
        if group:
            out += self._block(group)
        return out

    def _context_rows(self, rows: list[DraftRow], entries: list[int]):
        """The rows' new context entries: their target positions, their slots in the pool, their states."""
        manager = self.cache.manager
        have = [(row, entry) for row, entry in zip(rows, entries) if len(row.context_positions)]
        if not have:
            return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros((0, self.config.feature_size), np.float32)
        return (np.concatenate([row.context_positions for row, _ in have]),
                np.concatenate([manager.slots(row.seq, entry, len(row.context_positions)) for row, entry in have]),
                np.concatenate([row.features for row, _ in have]))

    def _stage_context(self, features: np.ndarray, positions: np.ndarray, slots: np.ndarray, at: int,
                       padded: int) -> None:
        """Context entries' positions and slots into rows at..at+padded of the host mirror (rows past the
        entries: slot -1, nothing stored), their states (bf16) into the first rows of `features`."""
        n = len(slots)
        host = self.steps.host
        self.steps.wait_upload()
        host["positions"][at:at + n] = positions
        host["slots"][at:at + n] = slots
        host["positions"][at + n:at + padded] = 0
        host["slots"][at + n:at + padded] = -1
        if n:
            self.features.rows(0, n).copy_from_host(np.ascontiguousarray(features, np.float32).astype(BF16),
                                                    self.stream)

    def _enqueue_context(self, n: int, at: int, stream) -> None:
        """The context pass over n entries whose positions and slots are rows at..at+n of the step inputs and
        whose states are the first n rows of `features`: c = rmsnorm(fc(f)), then every layer's keys and values
        of c stored at the slots."""
        c, ws = self.local_config, self.workspace
        f = self.features.rows(0, n)
        resid, x, qkv, q = ws.resid.rows(0, n), ws.x.rows(0, n), ws.qkv.rows(0, n), ws.q.rows(0, n)
        K.linear(f, self.fc, resid, "f32", stream)
        K.rmsnorm(resid, self.hidden_norm, x, c.rms_norm_eps, stream)
        inputs = self.steps.inputs
        positions, slots = inputs.positions.rows(at, at + n), inputs.slots.rows(at, at + n)
        for i, lw in enumerate(self.weights.layers):
            K.linear(x, lw.w_qkv, qkv, "bf16", stream)
            K.attn_input(qkv, positions, slots, lw.q_norm, lw.k_norm, ws.inv_freq, q, self.cache.k_pool(i),
                         self.cache.v_pool(i), c.num_attention_heads, c.num_key_value_heads, c.rms_norm_eps, stream)

    def _block(self, group: list[tuple[DraftRow, int]], context=None) -> list[list[int]]:
        """One block pass over these rows: each row's drafts. Their context is in the pool already, or (context:
        its positions, slots and states, at most CONTEXT_GRAPH_TOKENS entries) goes in first, in the same
        launch sequence (graph)."""
        manager, stream = self.cache.manager, self.stream
        batch, positions, slots = [], [], []
        for row, entry in group:
            first = entry + len(row.context_positions)  # the block's first entry
            end = first + len(row.block)                 # every block token attends to entries [0, end)
            batch += [(row.seq, [token], end - 1) for token in row.block]
            positions.append(row.start + np.arange(len(row.block)))
            slots.append(manager.slots(row.seq, first, len(row.block)))
        shape = prepare_step(self.steps, manager, batch)
        n = shape.num_tokens
        host = self.steps.host
        host["positions"][:n] = np.concatenate(positions)  # the target's positions, not the entries'
        host["slots"][:n] = np.concatenate(slots)          # each token's own entry (prepare_step put the last)
        rows = 0
        if context is not None:
            rows = -(-len(context[1]) // CONTEXT_GRAPH_STEP) * CONTEXT_GRAPH_STEP
            self._stage_context(context[2], context[0], context[1], self.draft_tokens, rows)
        self.steps.upload(stream)
        if self.use_graphs:
            kind = ("draft", rows)
            if not self.graphs.has_kind(kind):
                self.graphs.add_kind(kind, lambda b, s: self._enqueue_block(b, rows, s))
            self.graphs.run(kind, n, stream)
        else:
            self._enqueue_block(n, rows, stream)
        ids = self.workspace.logit_argmax.rows(0, n).to_host(stream)
        out, at = [], 0
        for row, _ in group:
            out.append([int(t) for t in ids[at + 1: at + len(row.block)]])
            at += len(row.block)
        return out

    def _enqueue_block(self, n: int, context_rows: int, stream) -> None:
        """A block pass of n tokens (rows 0..n of the step inputs) and each logits row's argmax; context_rows:
        first the context pass over that many rows staged after the block's (_stage_context)."""
        if context_rows:
            self._enqueue_context(context_rows, self.draft_tokens, stream)
        logits = forward(self.weights, self.workspace, self.cache, self.steps.inputs,
                         StepShape(num_tokens=n, num_seqs=n, max_q_len=1), all_logits=True, num_splits=1,
                         stream=stream)
        K.argmax(logits, self.workspace.logit_argmax.rows(0, n), stream)

    # ------------------------------------------------------------------ lifetime
    def _check_bound(self) -> None:
        if self.target is None:
            raise RuntimeError("bind_target() first: a DFlash drafter embeds and decodes with its target's weights")

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
        self.target = None

    def __enter__(self) -> "GPUDFlashRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
