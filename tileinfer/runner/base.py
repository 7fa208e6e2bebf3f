"""What the GPU and CPU runners share: the checkpoint's tokenizer, token-id checks, a waited-for step,
teacher-forced logits, and what a DFlash drafter's step reads."""
from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ..kv import Sequence
from ..model.tokenizer import encode_text


class CheckpointRunner:
    """A runner over `self.checkpoint`; subclasses provide ensure_cache and extend."""

    checkpoint = None
    config = None
    _tokenizer = None
    _awaiting: deque  # (bitmasks, slot) of each launched step that waits for publish_masks, oldest first

    def capture_layer_ids(self, layer_ids) -> tuple[int, ...]:
        """capture_hidden_states' layers as a tuple, checked to be distinct layers of this model."""
        ids = tuple(int(i) for i in layer_ids)
        if any(not 0 <= i < self.config.num_hidden_layers for i in ids) or len(set(ids)) != len(ids):
            raise ValueError(f"capture_hidden_states: layers {list(ids)} are not distinct layers of the model's "
                             f"{self.config.num_hidden_layers}")
        return ids

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            self._tokenizer = self.checkpoint.tokenizer()
        return self._tokenizer

    def encode(self, text: str) -> list[int]:
        return encode_text(self.tokenizer, text)

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def validate_ids(self, token_ids) -> list[int]:
        ids = [int(t) for t in token_ids]
        if not ids:
            raise ValueError("token_ids is empty: give at least one token")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(f"token_ids: {bad[:5]} outside the vocabulary [0, {self.config.vocab_size})")
        return ids

    def _check_not_awaiting(self, what: str, slot: int | None = None) -> None:
        """Refuse what would wait for a step that waits for its bitmasks (that slot's, or any, slot None)."""
        if any(slot is None or slot == s for _, s in self._awaiting):
            raise RuntimeError(f"cannot {what}: a launched step waits for its bitmasks (call publish_masks "
                               f"first; its sampling cannot run without them)")

    def step(self, batch, sampling=None, *, sample: bool = True, penalties: list | None = None,
             masks: list | None = None) -> np.ndarray | None:
        """One step over (sequence, new ids[, start]) rows (see prepare_step), waited for; the positions must
        already be reserved. masks: per row None or its allowed-token bitmask (int32 words, as
        sampler.apply_mask reads it).

        Returns each sequence's next token (or None with sample=False, e.g. a non-final prefill chunk)."""
        given = checked_masks(masks, self.config.vocab_size)
        masked = None if masks is None else [m is not None for m in masks]
        slot = self.launch(batch, sampling, sample=sample, penalties=penalties, masked=masked)
        if sample and given is not None:
            self.publish_masks(lambda out: np.copyto(out, given))
        return self.collect(slot, len(batch))

    def logits(self, token_ids: list[int], *, chunk: int | None = None, kv_quantize: str | None = None,
               smoothing: bool = True) -> np.ndarray:
        """Teacher-forced next-token logits for every position: float32 [len(token_ids), vocab].

        Runs the prompt through the paged cache in chunks (each chunk attends to the pages the earlier ones
        wrote, and to its own keys as the cache stores them), exactly as a prefill does; kv_quantize="int8"
        uses an INT8 cache (smoothed keys unless smoothing=False)."""
        ids = self.validate_ids(token_ids)
        cache = self.ensure_cache(len(ids), kv_quantize=kv_quantize, smoothing=smoothing)
        seq = Sequence()
        try:
            return self.extend(seq, ids, chunk=chunk)
        finally:
            cache.manager.release(seq)


def checked_masks(masks: list | None, vocab_size: int) -> np.ndarray | None:
    """The given rows' bitmasks stacked, int32 [rows with a mask, words] (None: none given); ValueError
    naming a mask of the wrong shape or type."""
    words = (vocab_size + 31) // 32
    given = [np.asarray(m) for m in masks or () if m is not None]
    for i, m in enumerate(given):
        if m.shape != (words,) or m.dtype != np.int32:
            raise ValueError(f"bitmask {i} is {m.dtype} {m.shape}; a vocabulary of {vocab_size} needs int32 "
                             f"({words},): one bit per token")
    return np.stack(given) if given else None


@dataclass(slots=True)
class ContextRow:
    """One request's new DFlash context: m entries of its drafter sequence, from `entry` on (reserved), for the
    target positions `positions`, whose hidden states are rows row..row+m-1 of the target's last step (its
    captured states: runner/gpu.py capture_hidden_states, runner/cpu.py likewise)."""
    seq: Sequence
    entry: int
    positions: np.ndarray  # [m] int64, ascending
    row: int


@dataclass(slots=True)
class DraftRow:
    """One request's DFlash draft step: its drafter sequence holds its context, then room reserved for the
    block (the last committed token and k masks, at positions start..start+k)."""
    seq: Sequence
    block: list[int]               # the last committed token and k mask tokens
    start: int                     # the last committed token's position (the block's first)

    @property
    def entry(self) -> int:
        """The block's first entry: the block's reserved entries end the sequence."""
        n = len(self.block)
        if self.seq.num_positions < n:
            raise ValueError(f"draft: a row needs {n} entries reserved, its sequence has {self.seq.num_positions}")
        return self.seq.num_positions - n


@dataclass(slots=True)
class AheadRow:
    """One request's next block, drafted before the host has read the verify step that decides it
    (GPUDFlashRunner.draft_ahead): that step computed the request's last committed token and m drafts (draft j
    at ids[first + j] of the drafts it read) at its token rows src..src + m, target positions start.. and
    drafter context entries entry.. (just written by add_context). The block is `count` tokens: the token
    the step commits, then masks."""
    seq: Sequence
    src: int
    m: int
    first: int
    start: int
    entry: int
    count: int


@dataclass(slots=True)
class DeviceDrafts:
    """Drafts a target on the same GPU reads where the drafter left them: int32 `ids` on the device, and for
    each row of the verify step (a request's last committed token, then its drafts) `first[i]`: its draft j
    (j = 1, 2, ...) is ids[first[i] + j] (-1: the row has no drafts there)."""
    ids: object  # DeviceArray [n] int32
    first: list[int]


class Proposals:
    """A round's drafts, one list a request: how many each has (`counts`) at once, their values (`tokens()`)
    when they are known on the host, which may wait for the device, and where a target on the same GPU
    reads them without waiting (`device`, or None)."""

    def __init__(self, counts: list[int], *, values: list[list[int]] | None = None,
                 read: Callable[[], list[list[int]]] | None = None, device: DeviceDrafts | None = None):
        if (values is None) == (read is None):
            raise ValueError("Proposals: give the values or how to read them, not both")
        self.counts, self.device = counts, device
        self._values, self._read = values, read

    @classmethod
    def of(cls, values: list[list[int]]) -> "Proposals":
        """Drafts already on the host."""
        return cls([len(v) for v in values], values=values)

    def tokens(self) -> list[list[int]]:
        """Each request's drafts (read once; the first call may wait for the pass that computed them)."""
        if self._values is None:
            self._values = self._read()
            if [len(v) for v in self._values] != self.counts:
                raise RuntimeError(f"drafts of {[len(v) for v in self._values]} tokens read back for rows that "
                                   f"have {self.counts}")
            self._read = None
        return self._values

    def spread(self, owners: list[int], size: int) -> "Proposals":
        """These drafts (one list a row) as `size` requests' where request owners[j] has row j's and the others
        none."""
        counts = [0] * size
        for j, i in enumerate(owners):
            counts[i] = self.counts[j]
        device = None
        if self.device is not None:
            first = [-1] * size
            for j, i in enumerate(owners):
                first[i] = self.device.first[j]
            device = DeviceDrafts(self.device.ids, first)

        def read() -> list[list[int]]:
            out: list[list[int]] = [[] for _ in range(size)]
            for i, values in zip(owners, self.tokens()):
                out[i] = values
            return out

        return Proposals(counts, read=read, device=device)
