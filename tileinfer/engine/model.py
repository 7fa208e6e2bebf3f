"""A loaded model on the GPU: weights, workspace, a paged KV cache, step buffers, decode graphs.

`Model.step` runs one forward step for a batch of (sequence, new tokens) pairs and returns
the next token of each sequence. Decode steps (one new token per sequence) replay a CUDA
graph per batch bucket; prefill chunks run eagerly (their shapes vary).
"""
from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from .. import kernels as K
from ..cuda import Stream, get_device
from ..graphs import DecodeGraphs, bucket_for
from ..kv import PagedKVCache, Sequence
from ..model.checkpoint import Checkpoint
from ..model.qwen3 import Workspace, forward
from ..model.weights import DeviceWeights
from .step import SamplingRow, StepBuffers, StepShape, prepare_step

log = logging.getLogger(__name__)

DECODE_BUCKETS = (1, 2, 4, 8)
MAX_SPLITS = 16
KEY_TILE = 64  # positions per attention key tile (cuda_src/attention.cu)


class Model:
    def __init__(self, path: str | Path, *, device: int = 0, max_batch_tokens: int = 2048,
                 max_logit_rows: int = 256, progress: bool = True):
        self.checkpoint = Checkpoint.open(path)
        self.config = self.checkpoint.config
        if self.config.head_dim != 128:
            raise ValueError(f"{path}: head_dim {self.config.head_dim} is not supported (the kernels need 128)")
        self.eos_token_ids = list(self.checkpoint.eos_token_ids)
        self.device = get_device(device)
        self.stream = Stream()
        self.weights = DeviceWeights(self.checkpoint, self.stream, progress=progress)
        self.max_batch_tokens = max_batch_tokens
        self.workspace = Workspace(self.config, max_tokens=max_batch_tokens, max_logit_rows=max_logit_rows,
                                   max_decode_rows=max(DECODE_BUCKETS), max_splits=MAX_SPLITS)
        self.cache: PagedKVCache | None = None
        self.steps: StepBuffers | None = None
        self.graphs = None
        self.use_graphs = True
        self._tokenizer = None
        self._closed = False

    # ------------------------------------------------------------------ tokenizer
    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.checkpoint.tokenizer()
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    # ------------------------------------------------------------------ cache and graphs
    def ensure_cache(self, max_tokens: int, page_size: int = 64) -> PagedKVCache:
        """A cache holding at least `max_tokens` positions (reallocated, and graphs dropped, if smaller)."""
        self._check_open()
        if self.cache is not None and self.cache.capacity >= max_tokens and self.cache.page_size == page_size:
            return self.cache
        self._drop_cache()
        self.cache = PagedKVCache(self.config, max_tokens=max_tokens, page_size=page_size)
        self.steps = StepBuffers(self.max_batch_tokens, max(DECODE_BUCKETS), self.cache.layout.block_table_width)
        self.graphs = DecodeGraphs(self._enqueue_decode, DECODE_BUCKETS)
        log.info("KV cache: %d pages of %d positions, %.2f GB", self.cache.layout.num_pages, page_size,
                 self.cache.layout.nbytes / 1e9)
        return self.cache

    def decode_splits(self, batch: int) -> int:
        """Key-range splits per sequence for decode attention: enough blocks to cover the SMs."""
        sms = self.device.info.num_sms
        tiles = -(-self.cache.capacity // KEY_TILE)
        want = -(-2 * sms // (batch * self.config.num_key_value_heads))
        return max(1, min(MAX_SPLITS, tiles, want))

    def _enqueue(self, shape: StepShape, *, all_logits: bool, sample: bool, num_splits: int, stream) -> None:
        logits = forward(self.weights, self.workspace, self.cache, self.steps, shape, all_logits=all_logits,
                         num_splits=num_splits, stream=stream)
        if sample:
            d, b = self.steps.dev, shape.num_seqs
            K.sample(logits, d["temperature"].rows(0, b), d["top_k"].rows(0, b), d["top_p"].rows(0, b),
                     d["seeds"].rows(0, b), d["counters"].rows(0, b), self.steps.sampled.rows(0, b), stream)

    def _enqueue_decode(self, bucket: int, stream) -> None:
        shape = StepShape(num_tokens=bucket, num_seqs=bucket, max_q_len=1)
        self._enqueue(shape, all_logits=False, sample=True, num_splits=self.decode_splits(bucket), stream=stream)

    # ------------------------------------------------------------------ steps
    def step(self, batch: list[tuple[Sequence, list[int]]], sampling: list[SamplingRow] | None = None,
             *, sample: bool = True) -> np.ndarray | None:
        """One forward step; the sequences' new positions must already be reserved.

        Returns each sequence's next token (or None with sample=False, e.g. a non-final prefill chunk).
        """
        self._check_open()
        decode = all(len(ids) == 1 for _, ids in batch) and len(batch) <= max(DECODE_BUCKETS)
        if decode and self.use_graphs:
            bucket = bucket_for(len(batch), DECODE_BUCKETS)
            prepare_step(self.steps, self.cache.manager, batch, sampling, pad_to=bucket)
            self.steps.upload(self.stream)
            if bucket in self.graphs.graphs:
                self.graphs.replay(len(batch), self.stream)
            else:
                # First step of this bucket: run it eagerly (loading every kernel it uses), then
                # capture the same launches for the steps that follow.
                self._enqueue_decode(bucket, self.stream)
                self.graphs.capture(self.stream, [bucket])
        else:
            shape = prepare_step(self.steps, self.cache.manager, batch, sampling)
            splits = self.decode_splits(len(batch)) if decode else 1
            self.steps.upload(self.stream)
            self._enqueue(shape, all_logits=False, sample=sample, num_splits=splits, stream=self.stream)
        if not sample:
            self.stream.synchronize()
            return None
        return self.steps.download_sampled(len(batch), self.stream)

    def logits(self, token_ids: list[int], *, chunk: int | None = None) -> np.ndarray:
        """Teacher-forced next-token logits for every position: float32 [len(token_ids), vocab].

        Runs the prompt through the paged cache in chunks (each chunk attends to the pages the
        earlier ones wrote), exactly as a prefill does.
        """
        ids = self._validate_ids(token_ids)
        chunk = min(chunk or self.workspace.max_logit_rows, self.workspace.max_logit_rows, self.max_batch_tokens)
        cache = self.ensure_cache(max(len(ids), 1))
        seq = Sequence()
        out = np.empty((len(ids), self.config.vocab_size), np.float32)
        try:
            for start in range(0, len(ids), chunk):
                part = ids[start: start + chunk]
                cache.manager.reserve(seq, len(part))
                shape = prepare_step(self.steps, cache.manager, [(seq, part)])
                self.steps.upload(self.stream)
                logits = forward(self.weights, self.workspace, cache, self.steps, shape, all_logits=True,
                                 num_splits=1, stream=self.stream)
                out[start: start + len(part)] = logits.to_host(self.stream)
        finally:
            cache.manager.release(seq)
        return out

    def _validate_ids(self, token_ids) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("token_ids is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token_ids: {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    # ------------------------------------------------------------------ lifetime
    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this Model was closed; load it again")

    def _drop_cache(self) -> None:
        if self.graphs is not None:
            self.graphs.destroy()
        if self.steps is not None:
            self.steps.free()
        if self.cache is not None:
            self.cache.free()
        self.cache = self.steps = self.graphs = None

    def close(self) -> None:
        """Free every device allocation this model made."""
        if self._closed:
            return
        self.stream.synchronize()
        self._drop_cache()
        self.workspace.free()
        self.weights.free()
        self.stream.destroy()
        self._closed = True

    def __enter__(self) -> "Model":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def load_model(path: str | Path, **kwargs) -> Model:
    """Load a Hugging Face Qwen3 checkpoint directory onto the GPU."""
    return Model(path, **kwargs)
