"""A DFlash drafter on the GPU: its layers beside its target's (whose embedding and LM head it borrows), a
paged KV pool of its own, and the target's kernels.

A draft (`draft(rows)`, one DraftRow per request from engine/dflash.py) runs two passes on the target's
stream, eagerly (their shapes change every round):
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
The context goes in chunks of CONTEXT_TOKENS entries, the blocks in groups of at most DRAFT_TOKENS tokens.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from .. import kernels as K
from ..cuda import DeviceArray
from ..kv import PagedKVCache
from ..kv.paged_cache import cdiv
from ..model.checkpoint import Checkpoint, CheckpointError
from ..model.dflash_config import DFlashConfig
from ..model.forward import BF16, Workspace, check_supported, forward
from ..model.weights import DeviceWeights
from .base import DraftRow
from .gpu import GPURunner
from .step import StepBuffers, prepare_step

CONTEXT_TOKENS = 512  # context entries a chunk of the context pass takes (its workspace rows)
DRAFT_TOKENS = 128    # block tokens a group of the block pass takes (its logits rows)


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
    uploads its weights: the embedding and LM head are the target's)."""

    use_graphs = False

    def __init__(self, path: str | Path, *, max_num_seqs: int = 8):
        self.checkpoint = Checkpoint.open_draft(path)
        if not isinstance(self.checkpoint.config, DFlashConfig):
            raise CheckpointError(f"{path}: not a DFlash drafter (architectures has no DFlashDraftModel); load a "
                                  f"draft model with load_model instead")
        self.config: DFlashConfig = self.checkpoint.config
        self.local_config = self.config.decoder  # what a page of its pool holds (kv/sizing.py)
        check_supported(self.local_config, path)
        self.max_num_seqs = max_num_seqs
        self.target: GPURunner | None = None
        self.cache: PagedKVCache | None = None
        self.steps: StepBuffers | None = None
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
        self.target = target

    def _upload(self, name: str) -> DeviceArray:
        out = DeviceArray.from_host(self.checkpoint.read(name), self.stream)
        self._arrays.append(out)
        return out

    @property
    def nbytes(self) -> int:
        """Device bytes of the weights, workspace and buffers (not the pool or the borrowed embedding)."""
        return self.weights.nbytes + self.workspace.nbytes + sum(a.nbytes for a in self._arrays)

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

    def ensure_cache(self, max_tokens: int, page_size: int = 64) -> PagedKVCache:
        """A pool of at least max_tokens entries (a new one if the attached one is smaller), each sequence up to
        max_tokens entries long."""
        c = self.cache
        if c is None or c.capacity < max_tokens or c.page_size != page_size:
            self.attach_cache(self.new_cache(num_pages=cdiv(max_tokens, page_size), page_size=page_size,
                                             max_seq_len=max_tokens))
        return self.cache

    def detach_cache(self) -> None:
        if self.steps is not None:
            if not self.target._closed:  # (the stream is the target's)
                self.stream.synchronize()
            self.steps.free()
        if self.cache is not None:
            self.cache.free()
        self.cache = self.steps = None

    # ------------------------------------------------------------------ drafting
    def draft(self, rows: list[DraftRow]) -> list[list[int]]:
        """Each row's k drafts (the argmax of block rows 1..k). The rows' new context and block entries are
        written into the pool; the caller truncates each sequence back to its context afterwards."""
        self._check_bound()
        if self.cache is None:
            raise RuntimeError("no KV pool is attached to this drafter: call ensure_cache() first")
        entries = []
        for row in rows:
            n = len(row.context_positions) + len(row.block)
            entry = row.seq.num_positions - n
            if entry < 0:
                raise ValueError(f"draft: a row needs {n} entries reserved, its sequence has {row.seq.num_positions}")
            entries.append(entry)
        self._context(rows, entries)
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

    def _context(self, rows: list[DraftRow], entries: list[int]) -> None:
        """Every row's new context entries into the pool, CONTEXT_TOKENS at a time."""
        manager = self.cache.manager
        slots = [manager.slots(row.seq, entry, len(row.context_positions))
                 for row, entry in zip(rows, entries) if len(row.context_positions)]
        if not slots:
            return
        slots = np.concatenate(slots)
        positions = np.concatenate([row.context_positions for row in rows])
        features = np.concatenate([row.features for row in rows if len(row.context_positions)])
        for start in range(0, len(slots), CONTEXT_TOKENS):
            stop = min(start + CONTEXT_TOKENS, len(slots))
            self._context_chunk(features[start:stop], positions[start:stop], slots[start:stop])

    def _context_chunk(self, features: np.ndarray, positions: np.ndarray, slots: np.ndarray) -> None:
        c, ws, stream = self.local_config, self.workspace, self.stream
        n = len(slots)
        host = self.steps.host
        self.steps.wait_upload()
        host["positions"][:n] = positions
        host["slots"][:n] = slots
        self.steps.upload(stream)
        f = self.features.rows(0, n)
        f.copy_from_host(np.ascontiguousarray(features, np.float32).astype(BF16), stream)
        resid, x, qkv, q = ws.resid.rows(0, n), ws.x.rows(0, n), ws.qkv.rows(0, n), ws.q.rows(0, n)
        K.linear(f, self.fc, resid, "f32", stream)
        K.rmsnorm(resid, self.hidden_norm, x, c.rms_norm_eps, stream)
        inputs = self.steps.inputs
        for i, lw in enumerate(self.weights.layers):
            K.linear(x, lw.w_qkv, qkv, "bf16", stream)
            K.attn_input(qkv, inputs.positions.rows(0, n), inputs.slots.rows(0, n), lw.q_norm, lw.k_norm,
                         ws.inv_freq, q, self.cache.k_pool(i), self.cache.v_pool(i), c.num_attention_heads,
                         c.num_key_value_heads, c.rms_norm_eps, stream)

    def _block(self, group: list[tuple[DraftRow, int]]) -> list[list[int]]:
        """One block pass over these rows (their context already in the pool): each row's drafts."""
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
        self.steps.upload(stream)
        logits = forward(self.weights, self.workspace, self.cache, self.steps.inputs, shape, all_logits=True,
                         num_splits=1, stream=stream)
        best = self.workspace.logit_argmax.rows(0, n)
        K.argmax(logits, best, stream)
        ids = best.to_host(stream)
        out, at = [], 0
        for row, _ in group:
            out.append([int(t) for t in ids[at + 1: at + len(row.block)]])
            at += len(row.block)
        return out

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
