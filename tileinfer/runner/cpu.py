"""The CPU runner: the float32 numpy reference (model/reference.py) over a paged numpy KV cache.

It offers the GPU runner's methods (launch / publish_masks / collect / step, verify, extend, logits) and
honours the same block tables, slots, token sources, bitmasks and sampling rule (runner/sampler.py is
the sampling kernel's specification, bit for bit), so the whole engine (batching, chunked prefill,
prefix caching with copy-on-write, preemption, speculation, chat, structured output) runs on a
machine without a GPU: slowly and exactly. As on the GPU, a step with bitmasks samples only once
publish_masks has given them.
Each sequence of a step is computed on its own, so a request's logits never depend on the batch
around it. With `capture_hidden_states`, a step also keeps the outputs of given layers at every position
it computes, from the same pass (`last_features`): a DFlash drafter's context.

The cache: per layer, keys and values [num_pages, kv_heads, page_size, head_dim] float32, written at
the steps' slots; attention reads a sequence's positions through its block table. An INT8 cache stores
each vector quantized and dequantized once when written (kv/int8.py), keys smoothed, as the
reference's INT8 model does.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from pathlib import Path

import numpy as np

from ..kv import BlockManager, Sequence
from ..kv.int8 import dequantize, quantize, smoothing_factors
from ..kv.paged_cache import cdiv, check_kv_quantize
from ..model.checkpoint import load_checkpoint
from ..model.reference import ReferenceModel
from .sampler import apply_mask, apply_penalties, sample as sample_token
from .base import CheckpointRunner
from .step import SamplingRow

log = logging.getLogger(__name__)

LOGITS_MODES = ("all", "last", "argmax", "none")
DEFAULT_POOL_BYTES = 1 << 30  # a CPU pool sized without an explicit size holds at most this much


class NumpyPagedCache:
    """Paged keys and values in host memory, with the GPU cache's page layout and BlockManager."""

    def __init__(self, config, *, num_pages: int, page_size: int = 64, enable_prefix_caching: bool = False,
                 int8: bool = False, smoothing: list[np.ndarray] | None = None):
        shape = (num_pages, config.num_key_value_heads, page_size, config.head_dim)
        self.k = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
        self.v = [np.zeros(shape, np.float32) for _ in range(config.num_hidden_layers)]
        self.manager = BlockManager(num_pages, page_size, enable_prefix_caching=enable_prefix_caching)
        self.page_size, self.num_pages, self.int8 = page_size, num_pages, int8
        self.smoothing = smoothing  # per layer [head_dim]: the INT8 cache stores k / c
        self.nbytes = 2 * sum(k.nbytes for k in self.k)

    @property
    def capacity(self) -> int:
        return self.num_pages * self.page_size

    def write(self, layer: int, slots: np.ndarray, k: np.ndarray, v: np.ndarray) -> None:
        """Store new keys and values [n, kv_heads, head_dim] at flat slots (page * page_size + offset)."""
        if self.int8:
            if self.smoothing is not None:
                k = k / self.smoothing[layer]
            k, v = dequantize(*quantize(k)), dequantize(*quantize(v))
        pages, offsets = slots // self.page_size, slots % self.page_size
        self.k[layer][pages, :, offsets] = k
        self.v[layer][pages, :, offsets] = v

    def gather(self, layer: int, block_table: list[int], length: int) -> tuple[np.ndarray, np.ndarray]:
        """Positions 0..length-1 of a sequence: keys and values [length, kv_heads, head_dim]."""
        positions = np.arange(length)
        pages = np.asarray(block_table, np.int64)[positions // self.page_size]
        offsets = positions % self.page_size
        return self.k[layer][pages, :, offsets], self.v[layer][pages, :, offsets]

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages (src, dst) of every layer, in order (copy-on-write)."""
        for src, dst in copies:
            for pool in (*self.k, *self.v):
                pool[dst] = pool[src]


class _SequenceView:
    """One sequence's entries start..start+n-1 of a step, as ReferenceModel's layers read a cache: a write at
    `at` goes to the slots of entries start + at, ..., reads gather positions 0..end-1 through the block
    table. Slots and block table are taken when the view is made, as a GPU step's are when it is launched: a
    step that runs later (behind one that waits for its bitmasks) still runs over them if the engine has given
    the sequence's pages back since (a request ended by length at that launch)."""

    def __init__(self, cache: NumpyPagedCache, seq: Sequence, start: int, n: int):
        self.cache, self.start, self.end = cache, start, start + n
        self.slots = cache.manager.slots(seq, start, n).astype(np.int64)
        self.block_table = list(seq.block_table)
        self.smoothing = cache.smoothing

    def write(self, layer: int, at: int, k: np.ndarray, v: np.ndarray) -> None:
        if not 0 <= at <= len(self.slots) - len(k):
            raise ValueError(f"a write of {len(k)} entries at {at} of a view of {len(self.slots)}")
        self.cache.write(layer, self.slots[at:at + len(k)], k, v)

    def read(self, layer: int):
        keys, values = self.cache.gather(layer, self.block_table, self.end)
        return keys, values, np.arange(self.end)


class CPURunner(CheckpointRunner):
    """The reference model as a runner. `max_num_seqs` and `max_batch_tokens` bound a step as on the GPU."""

    use_graphs = False

    def __init__(self, path: str | Path, *, max_batch_tokens: int = 2048, max_num_seqs: int = 8,
                 max_logit_rows: int = 256, progress: bool = False, load_format: str = "auto"):
        self.checkpoint = load_checkpoint(path, load_format)
        self.config = self.checkpoint.config
        self.eos_token_ids = list(self.checkpoint.eos_token_ids)
        self.reference = ReferenceModel.from_checkpoint(self.checkpoint)
        self.max_num_seqs = max_num_seqs
        self.max_batch_tokens = max(max_batch_tokens, max_num_seqs)
        self.max_logit_rows = max(max_logit_rows, max_num_seqs)
        self.cache: NumpyPagedCache | None = None
        self.max_context = 0
        self.wait_seconds = 0.0
        self._pending: dict[int, np.ndarray] = {}  # slot -> sampled ids of a launched step
        self._slot = 0
        self._prev = np.zeros(0, np.int32)         # the last sampled step's ids (token_src reads them)
        self._unsampled = None                     # the launched step's rows and logits, until sampled
        self._awaiting = deque()                   # (masks, slot) of the step waiting for publish_masks
        self._deferred = None                      # a step launched behind it: run once it has sampled
        self._lock = threading.Lock()              # publish_masks may run on another thread than launch
        self._last_logits = np.zeros((0, self.config.vocab_size), np.float32)
        self.capture_layers: tuple[int, ...] = ()  # target layers whose outputs a DFlash drafter reads
        self._features: list[np.ndarray] = []      # the last step's, per row: [n_i, len(capture_layers) * hidden]

    # ------------------------------------------------------------------ hidden-state capture
    def capture_hidden_states(self, layer_ids) -> None:
        """From now on every step (launch, verify) also keeps, for each position it computes, the outputs of
        these layers side by side (`last_features`); () turns it off. A captured last layer gives the
        final-normed state, as transformers' hidden_states[num_layers] does."""
        self.capture_layers = self.capture_layer_ids(layer_ids)

    @property
    def last_features(self) -> np.ndarray:
        """The captured states of every position the last launch or verify computed, in the step's row
        order (a row's positions in order): float32 [tokens, len(capture_layers) * hidden]."""
        if not self.capture_layers:
            raise RuntimeError("no hidden states are captured: call capture_hidden_states(layer_ids) first")
        return np.concatenate(self._features)

    # ------------------------------------------------------------------ cache
    def new_cache(self, *, num_pages: int | None = None, max_tokens: int | None = None, page_size: int = 64,
                  enable_prefix_caching: bool = False, kv_quantize: str | None = None, smoothing: bool = True,
                  max_seq_len: int | None = None) -> NumpyPagedCache:
        """A paged numpy cache of num_pages (or max_tokens positions); INT8 with smoothed keys if asked."""
        if (num_pages is None) == (max_tokens is None):
            raise ValueError("new_cache: give exactly one of num_pages or max_tokens")
        int8 = check_kv_quantize(kv_quantize)
        factors = [smoothing_factors(layer.k_norm) for layer in self.reference.layers] if int8 and smoothing else None
        pages = num_pages if num_pages is not None else cdiv(max_tokens, page_size)
        return NumpyPagedCache(self.config, num_pages=pages, page_size=page_size,
                               enable_prefix_caching=enable_prefix_caching, int8=int8, smoothing=factors)

    def default_pages(self, max_context: int, page_size: int, kv_quantize: str | None) -> int:
        """Pages for max_num_seqs sequences of max_context, at most DEFAULT_POOL_BYTES, at least one sequence."""
        c = self.config
        page_bytes = 2 * c.num_hidden_layers * c.num_key_value_heads * page_size * c.head_dim * 4
        one = cdiv(max_context, page_size)
        return max(one, min(self.max_num_seqs * one, DEFAULT_POOL_BYTES // page_bytes))

    def attach_cache(self, cache: NumpyPagedCache, *, max_context: int, penalty_capacity: int = 0) -> None:
        self.cache, self.max_context = cache, max_context

    def ensure_cache(self, max_tokens: int, page_size: int = 64, *, kv_quantize: str | None = None,
                     smoothing: bool = True) -> NumpyPagedCache:
        """A cache holding at least max_tokens positions of this kind (a new one if the attached one is not)."""
        int8 = check_kv_quantize(kv_quantize)
        c = self.cache
        if (c is not None and c.capacity >= max_tokens and c.page_size == page_size and c.int8 == int8
                and (c.smoothing is not None) == (int8 and smoothing)):
            return c
        cache = self.new_cache(max_tokens=max_tokens, page_size=page_size, kv_quantize=kv_quantize,
                               smoothing=smoothing)
        self.attach_cache(cache, max_context=cache.capacity)
        return cache

    # ------------------------------------------------------------------ steps
    def _rows_logits(self, view: _SequenceView, ids: list[int], every_row: bool) -> np.ndarray:
        """One sequence's new tokens (the view's entries) through the reference: [n or 1, vocab] logits."""
        positions = np.arange(view.start, view.end)
        h, features = self.reference.hidden_rows(np.asarray(ids), positions, view, self.capture_layers)
        if features is not None:
            self._features.append(features)
        return self.reference.head(h if every_row else h[-1:])

    def _check_step(self, batch) -> list[tuple[_SequenceView, list[int]]]:
        rows = []
        for i, item in enumerate(batch):
            seq, ids = item[0], [int(t) for t in item[1]]
            start = item[2] if len(item) > 2 else seq.num_positions - len(ids)
            if not ids or start < 0 or start + len(ids) > seq.num_positions:
                raise ValueError(f"step: sequence {i} computes positions [{start}, {start + len(ids)}) but has "
                                 f"{seq.num_positions} reserved")
            rows.append((_SequenceView(self.cache, seq, start, len(ids)), ids))
        if sum(len(ids) for _, ids in rows) > self.max_batch_tokens:
            raise ValueError(f"step of {sum(len(ids) for _, ids in rows)} tokens exceeds max_batch_tokens "
                             f"({self.max_batch_tokens})")
        return rows

    def launch(self, batch, sampling: list[SamplingRow] | None = None, *, sample: bool = True,
               penalties: list | None = None, masked: list[bool] | None = None,
               token_src: list[int] | None = None) -> int | None:
        """Run one step's forward now; returns the slot to `collect` its sampled tokens from (None with
        sample=False). penalties: per row None or its penalty entries. masked: per row whether it samples
        under a bitmask; the step then samples when publish_masks gives them (the GPU step waits for them).
        Launched while a step waits for its masks, it runs once that one has sampled (as the GPU's stream
        would run it): its tokens may come from that step's samples (token_src)."""
        rows = self._check_step(batch)
        num_masks = sum(map(bool, masked)) if masked is not None else 0
        if num_masks and not sample:
            raise ValueError("launch: rows with bitmasks in a step that does not sample")
        with self._lock:
            slot = None
            if sample:
                slot, self._slot = self._slot, self._slot ^ 1
            step = (slot, rows, sampling, penalties, masked, num_masks, token_src)
            if self._awaiting:
                if self._deferred is not None:
                    raise RuntimeError("launch: a step already waits behind the one that waits for its bitmasks")
                self._deferred = step
            else:
                self._run(*step)
        return slot

    def _run(self, slot, rows, sampling, penalties, masked, num_masks: int, token_src) -> None:
        self._copy_pending_pages()
        self._features = []
        if token_src is not None:  # a decode row's token is the previous sampled step's sample in that row
            rows = [(view, [int(self._prev[src])] if src >= 0 else ids) for (view, ids), src in zip(rows, token_src)]
        last = np.concatenate([self._rows_logits(view, ids, False) for view, ids in rows])
        if slot is None:
            return
        self._unsampled = (slot, rows, last, sampling, penalties, masked)
        if num_masks:
            self._awaiting.append((num_masks, slot))
        else:
            self._sample(None)

    def publish_masks(self, fill) -> None:
        """Hand the step that waits its bitmasks: fill(out) writes them, int32 [masked rows, words] in row
        order; then the step samples (even if fill raises), and a step launched behind it runs."""
        with self._lock:
            if not self._awaiting:
                raise RuntimeError("publish_masks: no launched step waits for bitmasks")
            n, _ = self._awaiting.popleft()
            masks = np.zeros((n, (self.config.vocab_size + 31) // 32), np.int32)
            try:
                fill(masks)
            finally:
                self._sample(masks)
                step, self._deferred = self._deferred, None
                if step is not None:
                    self._run(*step)

    def _sample(self, masks: np.ndarray | None) -> None:
        """Sample the launched step's rows: penalties, then each masked row's bitmask (masks[k] for the
        k-th masked row), then the sampling rule."""
        slot, rows, last, sampling, penalties, masked = self._unsampled
        out = np.zeros(len(rows), np.int32)
        k = 0
        for i, (view, _) in enumerate(rows):
            row = sampling[i] if sampling else SamplingRow()
            if penalties is not None and penalties[i] is not None:
                ids, counts, biases = penalties[i]
                last[i] = apply_penalties(last[i], ids, counts, row.repetition, row.presence, row.frequency, biases)
            if masked is not None and masked[i]:
                last[i] = apply_mask(last[i], masks[k])
                k += 1
            out[i] = sample_token(last[i], temperature=row.temperature, top_k=row.top_k, top_p=row.top_p,
                                  min_p=row.min_p, seed=row.seed, counter=view.end)
        self._last_logits, self._prev = last, out
        self._pending[slot] = out

    def collect(self, slot: int | None, n: int) -> np.ndarray | None:
        self._check_not_awaiting("wait for that step", slot)
        if self._deferred is not None and (slot is None or slot == self._deferred[0]):
            raise RuntimeError("cannot wait for that step: it runs once the step before it has its bitmasks "
                               "(call publish_masks first)")
        return None if slot is None else self._pending.pop(slot)[:n]

    def logits_rows(self, n: int) -> np.ndarray:
        """The last sampled step's first n logits rows, after penalties, before temperature (for logprobs)."""
        self._check_not_awaiting("read logits")
        return self._last_logits[:n]

    @property
    def max_verify_tokens(self) -> int:
        return min(self.max_batch_tokens, self.max_logit_rows)

    def verify(self, batch, *, logits: str = "argmax", graph_width: int | None = None, drafted=None,
               meanwhile=None) -> np.ndarray:
        """Every new token's next-token logits ("all", [tokens, vocab]) or their argmaxes ("argmax", [tokens]);
        meanwhile() is called once they are computed (GPURunner.verify: before they are waited for)."""
        self._check_not_awaiting("run verify")
        if drafted is not None:
            raise ValueError("verify: drafts on a device are for the GPU runner; give the CPU runner the ids")
        if logits not in ("argmax", "all"):
            raise ValueError(f"logits must be 'argmax' or 'all', got {logits!r}")
        rows = self._check_step(batch)
        n = sum(len(ids) for _, ids in rows)
        if not rows or n > self.max_verify_tokens:
            raise ValueError(f"verify: {n} tokens in {len(rows)} rows; a verify step takes 1..{self.max_verify_tokens}")
        self._copy_pending_pages()
        self._features = []
        out = np.concatenate([self._rows_logits(view, ids, True) for view, ids in rows])
        if meanwhile is not None:
            meanwhile()
        return out.argmax(axis=1).astype(np.int32) if logits == "argmax" else out

    def extend(self, seq: Sequence, token_ids: list[int], *, chunk: int | None = None,
               logits: str = "all") -> np.ndarray | None:
        """Append tokens to `seq` in chunks (pages reserved here) and return their logits as the GPU runner's
        extend does: "all" [n, vocab], "last" [1, vocab], "argmax" [n], "none" None."""
        self._check_not_awaiting("run extend")
        if self.cache is None:
            raise RuntimeError("no KV cache is attached to this runner: call ensure_cache() first")
        if logits not in LOGITS_MODES:
            raise ValueError(f"logits must be one of {', '.join(map(repr, LOGITS_MODES))}, got {logits!r}")
        ids = self.validate_ids(token_ids)
        chunk = min(chunk or self.max_logit_rows, self.max_logit_rows, self.max_batch_tokens)
        parts = []
        self._features = []
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            self.cache.manager.reserve(seq, len(part))
            self._copy_pending_pages()
            view = _SequenceView(self.cache, seq, seq.num_positions - len(part), len(part))
            parts.append(self._rows_logits(view, part, True))
        rows = np.concatenate(parts)
        if logits == "none":
            return None
        return rows[-1:] if logits == "last" else rows.argmax(axis=1).astype(np.int32) if logits == "argmax" else rows

    def _copy_pending_pages(self) -> None:
        copies = self.cache.manager.take_pending_copies()
        if copies:
            self.cache.copy_pages(copies)

    def close(self) -> None:
        self.cache = None

    def __enter__(self) -> "CPURunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
