"""A DFlash drafter on the CPU: the float32 reference drafter (model/dflash_reference.py) over a paged numpy
cache of its own.

The cache is the seed's second sequence: per layer, keys and values [num_pages, kv_heads, page_size,
head_dim] with a BlockManager of its own, laid out as the target's (runner/cpu.py NumpyPagedCache). A
request's drafter sequence holds one entry per context position (the keys and values every drafter
layer derives from the target's features there, written by `add_context` as the target computes them);
a draft step appends the block after them, attends over all of it without a mask, and the caller
truncates the block away again.
Entries are in the order the context arrived; their RoPE positions are the target's positions, which
the attention does not need beyond the keys themselves (nothing is masked).
"""
from __future__ import annotations

from pathlib import Path

import numpy as np

from ..kv.paged_cache import cdiv
from ..model.checkpoint import Checkpoint
from ..model.dflash_config import DFlashConfig
from ..model.dflash_reference import DFlashReference
from .base import AheadRow, ContextRow, DraftRow, Proposals
from .cpu import CPURunner, NumpyPagedCache, _SequenceView


class CPUDFlashRunner:
    """A DFlash checkpoint loaded for the CPU runner; `bind_target` pairs it with the target it drafts for."""

    use_graphs = False

    def __init__(self, path: str | Path, *, max_num_seqs: int = 8):
        self.checkpoint = Checkpoint.open_dflash(path)
        self.config: DFlashConfig = self.checkpoint.config
        self.model = DFlashReference.from_checkpoint(self.checkpoint)
        self.max_num_seqs = max_num_seqs
        self.cache: NumpyPagedCache | None = None
        self.target: CPURunner | None = None

    def bind_target(self, target: CPURunner) -> None:
        """Draft for `target` (a CPURunner; ValueError if this drafter does not fit it)."""
        if not isinstance(target, CPURunner):
            raise ValueError("a DFlash drafter loaded for the CPU (device='cpu') drafts for a CPU model; load it "
                             "with device='cuda' to draft for a GPU model")
        self.model.bind_target(target.reference)
        self.target = target

    # ------------------------------------------------------------------ cache
    def new_cache(self, *, num_pages: int, page_size: int = 64) -> NumpyPagedCache:
        """The drafter's own pool (float32, no prefix caching: context entries are per request)."""
        return NumpyPagedCache(self.config.decoder, num_pages=num_pages, page_size=page_size)

    def attach_cache(self, cache: NumpyPagedCache, *, max_context: int = 0) -> None:
        self.cache = cache

    def ensure_cache(self, max_tokens: int, page_size: int = 64) -> NumpyPagedCache:
        """A pool of at least max_tokens entries (a new one if the attached one is smaller)."""
        if self.cache is None or self.cache.capacity < max_tokens or self.cache.page_size != page_size:
            self.attach_cache(self.new_cache(num_pages=cdiv(max_tokens, page_size), page_size=page_size))
        return self.cache

    # ------------------------------------------------------------------ drafting
    def add_context(self, rows: list[ContextRow]) -> None:
        """Each row's context entries, written now from the target's states at its rows of the target's
        last step (`last_features`)."""
        if not rows:
            return
        features = self.target.last_features
        for row in rows:
            m = len(row.positions)
            if row.row < 0 or row.row + m > len(features):
                raise ValueError(f"add_context: rows {row.row}..{row.row + m - 1} of a step of {len(features)}")
            view = _SequenceView(self.cache, row.seq, row.entry, m)
            self.model.write_context(features[row.row:row.row + m], row.positions, view, 0)

    def draft(self, rows: list[DraftRow]) -> Proposals:
        """Each row's k drafts (the argmax of block rows 1..k). The block's entries are written into the pool;
        the caller truncates each sequence back to its context afterwards."""
        out = []
        for row in rows:
            entry = row.entry
            view = _SequenceView(self.cache, row.seq, entry, len(row.block))
            logits = self.model.forward(np.zeros((0, self.config.feature_size), np.float32), np.zeros(0, np.int64),
                                        row.block, row.start, view, 0)
            out.append([int(t) for t in logits.argmax(axis=1)])
        return Proposals.of(out)

    def draft_ahead(self, rows: list[AheadRow]) -> None:
        """Nothing: on the CPU a block is drafted when draft() asks for it (GPUDFlashRunner.draft_ahead
        launches it early to keep the GPU busy while the host reads a round)."""

    def close(self) -> None:
        self.cache = None

    def __enter__(self) -> "CPUDFlashRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
