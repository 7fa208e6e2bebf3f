"""Per-step inputs: persistent device buffers, their pinned host mirror, and prepare_step.

Every value a step needs on the device (token ids, positions, slots, query offsets, cached
lengths, block tables, sampling parameters) lives in one persistent device allocation whose
fields never move. prepare_step fills the pinned host mirror; `upload` sends it with one
asynchronous copy. Kernels (and the graphs that captured them) only ever read these
addresses, so a graph captured at one length stays valid as sequences grow.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver

from ..cuda import DeviceArray, PinnedBuffer, call
from ..kv import BlockManager, Sequence

_ALIGN = 16


@dataclass
class SamplingRow:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0


@dataclass(frozen=True, slots=True)
class StepShape:
    """What the kernels of one step are launched for."""
    num_tokens: int     # rows of the step (sum of the sequences' new tokens, padding included)
    num_seqs: int       # sequences (padding included)
    max_q_len: int      # most new tokens of any one sequence


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, table_width: int):
        self.max_tokens, self.max_seqs, self.table_width = max_tokens, max_seqs, table_width
        fields = [
            ("tokens", (max_tokens,), np.int32),
            ("positions", (max_tokens,), np.int32),
            ("slots", (max_tokens,), np.int32),
            ("cu_q", (max_seqs + 1,), np.int32),
            ("kv_lens", (max_seqs,), np.int32),
            ("last_rows", (max_seqs,), np.int32),      # row of each sequence's last new token
            ("block_tables", (max_seqs, table_width), np.int32),
            ("temperature", (max_seqs,), np.float32),
            ("top_k", (max_seqs,), np.int32),
            ("top_p", (max_seqs,), np.float32),
            ("seeds", (max_seqs,), np.uint64),
            ("counters", (max_seqs,), np.int32),       # position being sampled (the RNG counter)
        ]
        offsets, offset = {}, 0
        for name, shape, dtype in fields:
            offset = -(-offset // _ALIGN) * _ALIGN
            offsets[name] = offset
            offset += int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.nbytes = offset
        self.device = DeviceArray((offset,), np.uint8)
        self.pinned = PinnedBuffer(offset)
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, DeviceArray] = {}
        for name, shape, dtype in fields:
            self.host[name] = self.pinned.array(shape, dtype, offsets[name])
            self.dev[name] = DeviceArray(shape, dtype, ptr=self.device.ptr + offsets[name], base=self.device)
        self.pinned.bytes[:] = 0
        # Sampled token ids come back through their own small buffers.
        self.sampled = DeviceArray((max_seqs,), np.int32)
        self.sampled_host = PinnedBuffer(max_seqs * 4)

    def upload(self, stream) -> None:
        call(driver.cuMemcpyHtoDAsync, self.device.ptr, self.pinned.ptr, self.nbytes, stream.handle)

    def download_sampled(self, n: int, stream) -> np.ndarray:
        """Copy the first n sampled ids back and wait for them (the step's one host sync)."""
        call(driver.cuMemcpyDtoHAsync, self.sampled_host.ptr, self.sampled.ptr, n * 4, stream.handle)
        stream.synchronize()
        return self.sampled_host.array((n,), np.int32).copy()

    def free(self) -> None:
        self.device.free()
        self.pinned.free()
        self.sampled.free()
        self.sampled_host.free()


def prepare_step(buffers: StepBuffers, manager: BlockManager, batch: list[tuple[Sequence, list[int]]],
                 sampling: list[SamplingRow] | None = None, pad_to: int | None = None) -> StepShape:
    """Fill the pinned mirror for one step; the sequences' new positions must be reserved already.

    batch: (sequence, its new token ids) pairs; each sequence's last len(ids) reserved positions
    are the ones this step computes. pad_to: the number of sequences (and, for one-token steps,
    tokens) of the graph bucket; padding rows have no query tokens (attention skips them) and
    slot -1 (nothing is stored).
    """
    h = buffers.host
    num_seqs = pad_to or len(batch)
    if num_seqs > buffers.max_seqs or num_seqs < len(batch):
        raise ValueError(f"prepare_step: {len(batch)} sequences padded to {num_seqs}, buffers hold {buffers.max_seqs}")
    offset, max_q = 0, 1
    for i, (seq, ids) in enumerate(batch):
        n = len(ids)
        start = seq.num_positions - n
        if n < 1 or start < 0:
            raise ValueError(f"prepare_step: sequence {i} has {n} new tokens and {seq.num_positions} reserved positions")
        if offset + n > buffers.max_tokens:
            raise ValueError(f"prepare_step: more than {buffers.max_tokens} tokens in one step")
        rows = slice(offset, offset + n)
        h["tokens"][rows] = ids
        h["positions"][rows] = np.arange(start, start + n, dtype=np.int32)
        h["slots"][rows] = manager.slots(seq, start, n)
        h["cu_q"][i] = offset
        h["kv_lens"][i] = seq.num_positions
        h["last_rows"][i] = offset + n - 1
        table = seq.block_table
        if len(table) > buffers.table_width:
            raise ValueError(f"prepare_step: sequence {i} has {len(table)} pages, the table holds {buffers.table_width}")
        h["block_tables"][i, :len(table)] = table
        h["block_tables"][i, len(table):] = 0
        row = sampling[i] if sampling else SamplingRow()
        h["temperature"][i], h["top_k"][i], h["top_p"][i] = row.temperature, row.top_k, row.top_p
        h["seeds"][i] = np.uint64(row.seed & 0xFFFFFFFFFFFFFFFF)
        h["counters"][i] = seq.num_positions
        offset += n
        max_q = max(max_q, n)
    num_tokens = offset
    if pad_to and max_q == 1:
        num_tokens = num_seqs  # a decode bucket: one row per (padding) sequence
    pad = slice(offset, num_tokens)
    h["tokens"][pad], h["positions"][pad], h["slots"][pad] = 0, 0, -1
    for i in range(len(batch), num_seqs):
        h["cu_q"][i] = offset
        h["kv_lens"][i] = 0
        h["last_rows"][i] = min(offset, num_tokens - 1)
        h["block_tables"][i] = 0
        h["temperature"][i], h["top_k"][i], h["top_p"][i], h["seeds"][i], h["counters"][i] = 0.0, 0, 1.0, 0, 0
    h["cu_q"][num_seqs] = offset
    return StepShape(num_tokens=num_tokens, num_seqs=num_seqs, max_q_len=max_q)
