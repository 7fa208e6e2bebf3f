"""Per-step inputs: persistent device buffers, their pinned host mirror, and prepare_step.

Every value a step needs on the device (token ids, positions, slots, query offsets, cached
lengths, block tables, sampling parameters) lives in one persistent device allocation whose
fields never move. prepare_step fills the pinned host mirror; `upload` sends it with one
asynchronous copy, or a decode step fetches it itself (K.fetch_step, its first kernel: the mirror is
mapped into the device's address space). Kernels (and the graphs that captured them) only ever read these
addresses, so a graph captured at one length stays valid as sequences grow.

Allowed-token bitmasks (structured output) are the one input that arrives after the launch: the host
computes a step's masks while its forward runs (they depend on the token the step before sampled).
A step with masks forks a stream of its own where its forward begins (`fork_masks`): there it waits
for a mapped host word (`mask_flag`) to read 1, copies the masks from pinned memory and sets the word
back to 0, while the forward runs; the step's sampling waits for that copy (`join_masks`). The host
fills `mask_staging`, then sets the word (`release_masks`). Masks published before the forward ends
are copied beside it. Steps without masks have none of this.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from cuda.bindings import driver

from ..cuda import DeviceArray, Event, PinnedBuffer, Stream, call
from ..kv import BlockManager
from ..model.inputs import StepInputs, StepShape

_ALIGN = 16


@dataclass(eq=False)
class SamplingRow:
    """One sequence's sampling parameters packed as the sampling kernel reads them (the engine builds it
    from a request's SamplingParams)."""
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int = 0
    repetition: float = 1.0
    presence: float = 0.0
    frequency: float = 0.0


_GREEDY = SamplingRow()


class StepBuffers:
    def __init__(self, max_tokens: int, max_seqs: int, table_width: int, penalty_capacity: int = 0,
                 mask_words: int = 1):
        self.max_tokens, self.max_seqs, self.table_width = max_tokens, max_seqs, table_width
        fields = [
            ("tokens", (max_tokens,), np.int32),
            ("token_src", (max_tokens,), np.int32),     # >= 0: take the token the previous step sampled in that row
            ("positions", (max_tokens,), np.int32),
            ("slots", (max_tokens,), np.int32),
            ("cu_q", (max_seqs + 1,), np.int32),
            ("kv_lens", (max_seqs,), np.int32),
            ("last_rows", (max_seqs,), np.int32),      # row of each sequence's last new token
            ("block_tables", (max_seqs, table_width), np.int32),
            ("temperature", (max_seqs,), np.float32),
            ("top_k", (max_seqs,), np.int32),
            ("top_p", (max_seqs,), np.float32),
            ("min_p", (max_seqs,), np.float32),
            ("seeds", (max_seqs,), np.uint64),
            ("counters", (max_seqs,), np.int32),       # position being sampled (the RNG counter)
            ("repetition", (max_seqs,), np.float32),
            ("presence", (max_seqs,), np.float32),
            ("frequency", (max_seqs,), np.float32),
            ("pen_offsets", (max_seqs + 1,), np.int32),  # each row's range of penalty entries
            ("mask_rows", (max_seqs,), np.int32),      # each row's allowed-token bitmask in `masks` (-1: none)
            ("sample_slot", (1,), np.int32),           # the row of sampled_host the step's tokens go to
        ]
        offsets, offset = {}, 0
        for name, shape, dtype in fields:
            offset = -(-offset // _ALIGN) * _ALIGN
            offsets[name] = offset
            offset += int(np.prod(shape)) * np.dtype(dtype).itemsize
        self.nbytes = offset = -(-offset // 16) * 16  # whole 16-byte pieces for fetch_step
        self.device = DeviceArray((offset,), np.uint8)
        self.pinned = PinnedBuffer(offset, mapped=True)
        self.mirror = self.pinned.device_array((offset,), np.uint8)  # the mirror as fetch_step reads it
        self.host: dict[str, np.ndarray] = {}
        self.dev: dict[str, DeviceArray] = {}
        for name, shape, dtype in fields:
            self.host[name] = self.pinned.array(shape, dtype, offsets[name])
            self.dev[name] = DeviceArray(shape, dtype, ptr=self.device.ptr + offsets[name], base=self.device)
        self.pinned.bytes[:] = 0
        self.host["token_src"][:] = -1
        self.host["mask_rows"][:] = -1
        self.src_dirty = 0  # leading token_src entries a step set (reset to -1 by the next)
        # Sampled token ids: on the device in `sampled` (the next step's token_src reads them there), and
        # written by the sampling kernel straight into mapped page-locked memory, one row per step in
        # flight (two, row sample_slot), so a step's ids can be read while the next step runs and no copy
        # follows the step in the stream.
        self.sampled = DeviceArray((max_seqs,), np.int32)
        d = self.dev
        self.inputs = StepInputs(tokens=d["tokens"], token_src=d["token_src"], positions=d["positions"],
                                 slots=d["slots"], cu_q=d["cu_q"], kv_lens=d["kv_lens"], last_rows=d["last_rows"],
                                 block_tables=d["block_tables"], sampled=self.sampled)
        self.sampled_host = PinnedBuffer(2 * max_seqs * 4, mapped=True)
        self.sampled_out = self.sampled_host.device_array((2, max_seqs), np.int32)
        self.sampled_ready = [Event(), Event()]
        self.uploaded = Event()  # recorded after each upload or fetch: the mirror may be rewritten once it completes
        self._upload_pending = False
        # Penalty entries (token id, output count, bias as float32 bits) of every row, uploaded only as far as used.
        self.penalty_capacity = max(int(penalty_capacity), 1)
        self.penalties = DeviceArray((3, self.penalty_capacity), np.int32)
        self.penalties_host = PinnedBuffer(self.penalties.nbytes)
        self.num_penalty_entries = 0
        # Allowed-token bitmasks (structured output) of the rows that have one, in row order; the host
        # writes them after the launch, the step copies them in on a stream of its own (fork_masks).
        self.masks = DeviceArray((max_seqs, max(int(mask_words), 1)), np.int32)
        self.masks_host = PinnedBuffer(self.masks.nbytes)
        self.num_masks = 0  # masked rows of the step prepared last
        self.mask_flag = PinnedBuffer(4, mapped=True)  # 1: masks_host holds the waiting step's masks
        self._flag = self.mask_flag.array((1,), np.uint32)
        self.mask_stream = Stream()
        self._masks_fork, self._masks_in = Event(timing=False), Event(timing=False)
        self._flag[0] = 0
        # What each row of the block tables and sampling fields holds now: (sequence, table version)
        # and the SamplingRow object, so unchanged rows are not rewritten every step.
        self.row_tables: list[tuple[object, int] | None] = [None] * max_seqs
        self.row_sampling: list[SamplingRow | None] = [None] * max_seqs

    @property
    def penalty_tokens(self) -> DeviceArray:
        return self.penalties.rows(0, 1).view((self.penalty_capacity,))

    @property
    def penalty_counts(self) -> DeviceArray:
        return self.penalties.rows(1, 2).view((self.penalty_capacity,))

    @property
    def penalty_biases(self) -> DeviceArray:
        return self.penalties.rows(2, 3).view((self.penalty_capacity,), np.float32)

    def wait_upload(self) -> None:
        """Block until the last upload has read the pinned mirror (before writing it again)."""
        if self._upload_pending:
            self.uploaded.synchronize()
            self._upload_pending = False

    def upload(self, stream) -> None:
        """Copy the mirror and the penalty entries to the device; record `uploaded`."""
        call(driver.cuMemcpyHtoDAsync, self.device.ptr, self.pinned.ptr, self.nbytes, stream.handle)
        self.upload_entries(stream)
        self.uploaded.record(stream)
        self._upload_pending = True

    def record_fetched(self, stream) -> None:
        """After fetch_step (in a decode graph: an event-record node): the mirror has been read."""
        self.uploaded.record(stream, external=True)

    def fetched(self) -> None:
        """A step that fetches the mirror itself was launched: wait for it before rewriting the mirror."""
        self._upload_pending = True

    def upload_entries(self, stream) -> None:
        """Copy the penalty entries in use (they live outside the mirror)."""
        n = self.num_penalty_entries
        if n:
            cap = self.penalty_capacity
            for row in range(3):  # tokens, counts, biases
                call(driver.cuMemcpyHtoDAsync, self.penalties.ptr + row * cap * 4,
                     self.penalties_host.ptr + row * cap * 4, n * 4, stream.handle)

    # ------------------------------------------------------------------ bitmasks after the launch
    def fork_masks(self, rows: int, stream) -> None:
        """In a step with masks, where its forward begins (graph-capturable: a branch of two memory-operation
        nodes and a copy): on mask_stream, wait until mask_flag is 1, copy `rows` bitmasks in, set mask_flag
        to 0. The flag goes back to 0 only after the copy has read masks_host, so a host that sees 0 may write
        the next step's masks. The step's sampling must then `join_masks`."""
        self._masks_fork.record(stream)
        self.mask_stream.wait(self._masks_fork)
        flag, side = self.mask_flag.device_ptr, self.mask_stream.handle
        eq = int(driver.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ)
        call(driver.cuStreamWaitValue32, side, flag, 1, eq, detail="the wait for a step's bitmasks")
        nbytes = rows * self.masks.shape[1] * 4
        call(driver.cuMemcpyHtoDAsync, self.masks.ptr, self.masks_host.ptr, nbytes, side)
        call(driver.cuStreamWriteValue32, side, flag, 0, 0, detail="the bitmasks' flag reset")
        self._masks_in.record(self.mask_stream)

    def join_masks(self, stream) -> None:
        """Before a step's sampling: what `stream` enqueues next waits for the masks fork_masks copies in."""
        stream.wait(self._masks_in)

    def masks_taken(self, timeout: float) -> bool:
        """Wait (at most `timeout` seconds) until the step that last waited for masks has copied them in
        (mask_flag back to 0); whether it has. At once in the engine's order: that step was read back
        before the next step's masks are written."""
        start = time.perf_counter()
        while self._flag[0] != 0:
            if time.perf_counter() - start > timeout:
                return False
            time.sleep(0)
        return True

    def mask_staging(self, n: int, timeout: float = 60.0) -> np.ndarray:
        """The pinned rows the next n bitmasks go to, once the masks before them are taken. # [n, words] int32"""
        if not self.masks_taken(timeout):
            raise RuntimeError(f"the GPU has not taken the previous step's bitmasks after {timeout:.0f} s; "
                               "the device is stuck or a step's masks were never released")
        return self.masks_host.array((n, self.masks.shape[1]), np.int32)

    def release_masks(self) -> None:
        """The masks are in place: the step waiting for them goes on to sample."""
        self._flag[0] = 1

    def set_sample_slot(self, slot: int) -> None:
        """The row of sampled_host (0 or 1) the next uploaded step's sampling kernel writes."""
        self.host["sample_slot"][0] = slot

    def mark_sampled(self, slot: int, n: int, stream) -> None:
        """Record that slot's event after the step's launches (read the ids with read_sampled)."""
        self.sampled_ready[slot].record(stream)

    def read_sampled(self, n: int, slot: int) -> np.ndarray:
        """Wait for the step that wrote `slot`; its first n sampled ids."""
        self.sampled_ready[slot].synchronize()
        return self.sampled_host.array((n,), np.int32, slot * self.max_seqs * 4).copy()

    def free(self) -> None:
        self.device.free()
        self.pinned.free()
        self.sampled.free()
        self.sampled_host.free()
        self.penalties.free()
        self.penalties_host.free()
        self.masks.free()
        self.masks_host.free()
        self.mask_flag.free()
        self.mask_stream.destroy()
        for e in (*self.sampled_ready, self.uploaded, self._masks_fork, self._masks_in):
            e.destroy()


def prepare_step(buffers: StepBuffers, manager: BlockManager, batch, sampling: list[SamplingRow] | None = None,
                 pad_to: int | None = None, penalties: list | None = None, masked: list[bool] | None = None,
                 token_src: list[int] | None = None, pad_tokens: int | None = None) -> StepShape:
    """Fill the pinned mirror for one step; the positions it computes must be reserved already.

    batch: (sequence, new token ids, start) triples: the step computes positions start ..
    start + len(ids) - 1 of the sequence and attends to positions < start + len(ids). A pair
    (sequence, ids) means start = sequence.num_positions - len(ids) (its last reserved positions).
    pad_to: the number of sequences (and, for one-token steps, tokens) of the graph bucket;
    padding rows have no query tokens (attention skips them) and slot -1 (nothing is stored).
    penalties: per row None or (token ids, counts, biases) for apply_penalties.
    masked: per row whether it samples under an allowed-token bitmask: the masked rows take bitmasks
    0, 1, ... in row order (mask_rows), written after the launch (StepBuffers.mask_staging).
    token_src: per row -1, or (for a one-token row) the row of the previous step whose sample is
    this row's token: it is read on the device, so the host need not have it yet.
    pad_tokens: the step's token rows, padding included (a graphed verify step: bucket x tokens a row).
    """
    buffers.wait_upload()
    num_seqs = pad_to or len(batch)
    if num_seqs > buffers.max_seqs or num_seqs < len(batch):
        raise ValueError(f"prepare_step: {len(batch)} sequences padded to {num_seqs}, buffers hold {buffers.max_seqs}")
    rows = _gather_rows(buffers, manager, batch, sampling)
    offset = len(rows.tokens)
    if offset > buffers.max_tokens:
        raise ValueError(f"prepare_step: {offset} tokens in one step, the buffers hold {buffers.max_tokens}")
    _write_rows(buffers, rows, token_src)
    num_tokens = offset
    if pad_tokens is not None:
        if not offset <= pad_tokens <= buffers.max_tokens:
            raise ValueError(f"prepare_step: {offset} tokens padded to {pad_tokens}, buffers hold {buffers.max_tokens}")
        num_tokens = pad_tokens
    elif pad_to and rows.max_q == 1:
        num_tokens = num_seqs  # a decode bucket: one row per (padding) sequence
    _write_padding(buffers, len(batch), num_seqs, offset, num_tokens)
    _fill_penalties(buffers, penalties, num_seqs)
    _set_mask_rows(buffers, masked, num_seqs)
    return StepShape(num_tokens=num_tokens, num_seqs=num_seqs, max_q_len=rows.max_q)


def prepare_token_rows(buffers: StepBuffers, groups, tokens, positions, slots, kv_lens) -> StepShape:
    """Fill the pinned mirror for a step in which every token is a sequence of its own, attending to its
    sequence's first kv_lens[i] entries (a DFlash block pass: each block token sees its request's whole context
    and block). groups: (sequence, count) in token order, `count` consecutive tokens sharing that sequence's
    block table; tokens, positions, slots (where each token's key and value go), kv_lens: [n] ints. The
    positions must be reserved already. Written with whole-array stores: a block of 16 tokens a request would
    cost prepare_step a row of Python each."""
    buffers.wait_upload()
    n = len(tokens)
    if n > min(buffers.max_tokens, buffers.max_seqs):
        raise ValueError(f"prepare_token_rows: {n} one-token sequences, the buffers hold "
                         f"{min(buffers.max_tokens, buffers.max_seqs)}")
    h = buffers.host
    _clear_token_src(buffers)
    h["tokens"][:n], h["positions"][:n], h["slots"][:n] = tokens, positions, slots
    h["kv_lens"][:n] = kv_lens
    h["counters"][:n] = kv_lens
    h["cu_q"][:n + 1] = np.arange(n + 1)
    h["last_rows"][:n] = np.arange(n)
    at = 0
    for seq, count in groups:
        _write_table(buffers, at, seq)
        h["block_tables"][at + 1:at + count] = h["block_tables"][at]
        buffers.row_tables[at + 1:at + count] = [buffers.row_tables[at]] * (count - 1)
        at += count
    if at != n:
        raise ValueError(f"prepare_token_rows: groups of {at} tokens for {n} tokens")
    return token_rows_shape(n)


def token_rows_shape(n: int) -> StepShape:
    """The shape of prepare_token_rows' step of n tokens: n one-token sequences whose block tokens read each
    other's new keys."""
    return StepShape(num_tokens=n, num_seqs=n, max_q_len=1, rows_share_keys=True)


@dataclass
class _Rows:
    """One step's token rows and per-sequence values, in batch order."""
    tokens: list[int]
    positions: list[int]
    slots: list[int]
    cu_q: list[int]
    kv_lens: list[int]
    last_rows: list[int]
    max_q: int = 1


def _gather_rows(buffers: StepBuffers, manager: BlockManager, batch, sampling) -> _Rows:
    """Each sequence's tokens, positions and slots; its block table and sampling row are written into
    the mirror only when they changed since the step before (rows keep their sequence step to step)."""
    ps = manager.page_size
    rows = _Rows([], [], [], [], [], [])
    for i, item in enumerate(batch):
        seq, ids = item[0], item[1]
        n = len(ids)
        start = item[2] if len(item) > 2 else seq.num_positions - n
        end = start + n
        if n < 1 or start < 0 or end > seq.num_positions:
            raise ValueError(f"prepare_step: sequence {i} computes positions [{start}, {end}) but has "
                             f"{seq.num_positions} reserved")
        rows.cu_q.append(len(rows.tokens))
        if n == 1:
            rows.tokens.append(int(ids[0]))
            rows.positions.append(start)
            rows.slots.append(seq.block_table[start // ps] * ps + start % ps)
        else:
            rows.tokens.extend(ids)
            rows.positions.extend(range(start, end))
            rows.slots.extend(manager.slots(seq, start, n).tolist())
        rows.kv_lens.append(end)
        rows.last_rows.append(len(rows.tokens) - 1)
        rows.max_q = max(rows.max_q, n)
        _write_table(buffers, i, seq)
        row = sampling[i] if sampling else _GREEDY
        if buffers.row_sampling[i] is not row:
            _write_sampling(buffers.host, i, row)
            buffers.row_sampling[i] = row
    return rows


def _write_table(buffers: StepBuffers, i: int, seq) -> None:
    if len(seq.block_table) > buffers.table_width:
        raise ValueError(f"prepare_step: sequence {i} has {len(seq.block_table)} pages, the table holds "
                         f"{buffers.table_width}")
    held = buffers.row_tables[i]
    if held is None or held[0] is not seq or held[1] != seq.table_version:
        table = seq.block_table
        buffers.host["block_tables"][i, :len(table)] = table
        buffers.host["block_tables"][i, len(table):] = 0
        buffers.row_tables[i] = (seq, seq.table_version)


def _clear_token_src(buffers: StepBuffers) -> None:
    """Every row's token from the host again: clear the sources the last step set (it may have been longer
    than this one)."""
    if buffers.src_dirty:
        buffers.host["token_src"][:buffers.src_dirty] = -1
        buffers.src_dirty = 0


def _write_rows(buffers: StepBuffers, rows: _Rows, token_src: list[int] | None) -> None:
    h, offset, b = buffers.host, len(rows.tokens), len(rows.cu_q)
    h["tokens"][:offset] = rows.tokens
    src = h["token_src"]
    _clear_token_src(buffers)
    if token_src is not None:
        for i, r in enumerate(token_src):
            if r >= 0:
                src[rows.cu_q[i]] = r
        buffers.src_dirty = offset
    h["positions"][:offset] = rows.positions
    h["slots"][:offset] = rows.slots
    h["cu_q"][:b] = rows.cu_q
    h["kv_lens"][:b] = rows.kv_lens
    h["counters"][:b] = rows.kv_lens  # the position a row's sample is for seeds the draw
    h["last_rows"][:b] = rows.last_rows


def set_token_sources(buffers: StepBuffers, rows: np.ndarray, sources: np.ndarray) -> None:
    """After prepare_step: the step's token rows `rows` (ascending) take their ids on the device, from
    sources[i] of the array its forward reads them from (a verify step's drafts, where the drafter left them)."""
    if len(rows):
        buffers.host["token_src"][rows] = sources
        buffers.src_dirty = max(buffers.src_dirty, int(rows[-1]) + 1)


def _write_padding(buffers: StepBuffers, b: int, num_seqs: int, offset: int, num_tokens: int) -> None:
    """Token rows offset..num_tokens and sequences b..num_seqs are padding: no tokens, slot -1, greedy."""
    h = buffers.host
    pad = slice(offset, num_tokens)
    h["tokens"][pad], h["positions"][pad], h["slots"][pad], h["token_src"][pad] = 0, 0, -1, -1
    if num_seqs > b:
        h["cu_q"][b:num_seqs] = offset
        h["kv_lens"][b:num_seqs] = 0
        h["counters"][b:num_seqs] = 0
        h["last_rows"][b:num_seqs] = min(offset, num_tokens - 1)
        for i in range(b, num_seqs):
            if buffers.row_tables[i] is not None:
                h["block_tables"][i] = 0
                buffers.row_tables[i] = None
            if buffers.row_sampling[i] is not _GREEDY:
                _write_sampling(h, i, _GREEDY)
                buffers.row_sampling[i] = _GREEDY
    h["cu_q"][num_seqs] = offset


def _write_sampling(h: dict[str, np.ndarray], i: int, row: SamplingRow) -> None:
    h["temperature"][i], h["top_k"][i], h["top_p"][i], h["min_p"][i] = row.temperature, row.top_k, row.top_p, row.min_p
    h["seeds"][i] = np.uint64(row.seed & 0xFFFFFFFFFFFFFFFF)
    h["repetition"][i], h["presence"][i], h["frequency"][i] = row.repetition, row.presence, row.frequency


def _fill_penalties(buffers: StepBuffers, penalties: list | None, num_seqs: int) -> None:
    offsets = buffers.host["pen_offsets"]
    if not penalties or all(p is None for p in penalties):
        if buffers.num_penalty_entries or offsets[num_seqs]:
            offsets[:] = 0
        buffers.num_penalty_entries = 0
        return
    cap = buffers.penalty_capacity
    entries = buffers.penalties_host.array((3, cap), np.int32)
    biases = entries[2].view(np.float32)
    n = 0
    for i in range(num_seqs):
        offsets[i] = n
        p = penalties[i] if i < len(penalties) else None
        if p is None:
            continue
        ids, counts, bias = p
        if n + len(ids) > cap:
            raise ValueError(f"prepare_step: more than {cap} penalty entries in one step")
        entries[0, n:n + len(ids)] = ids
        entries[1, n:n + len(ids)] = counts
        biases[n:n + len(ids)] = bias
        n += len(ids)
    offsets[num_seqs:] = n
    buffers.num_penalty_entries = n


def _set_mask_rows(buffers: StepBuffers, masked: list[bool] | None, num_seqs: int) -> None:
    rows = buffers.host["mask_rows"]
    if not masked or not any(masked):
        if buffers.num_masks:
            rows[:] = -1
        buffers.num_masks = 0
        return
    if len(masked) > num_seqs:
        raise ValueError(f"prepare_step: {len(masked)} mask flags for {num_seqs} rows")
    rows[:] = -1
    at = np.flatnonzero(np.asarray(masked, bool))
    rows[at] = np.arange(at.size, dtype=np.int32)
    buffers.num_masks = int(at.size)
