"""Launchers for cuda_src/attention.cu: paged causal attention (+ split-K combine)."""
import math

from ..cuda import F32, I32, DeviceArray, kernel
from ._check import BF16, FLOAT32, INT32, cdiv, expect

HEAD_DIM = 128
ROWS_PER_BLOCK = 64
SMEM = (64 + 4 * 64) * HEAD_DIM * 2  # Q tile + double-buffered K and V tiles, as in attention.cu
LOG2E = 1.4426950408889634


def attention(q: DeviceArray, k_pool: DeviceArray, v_pool: DeviceArray, out: DeviceArray,
              cu_q: DeviceArray, kv_lens: DeviceArray, block_tables: DeviceArray, *,
              max_q_len: int, num_splits: int = 1, partials: tuple[DeviceArray, DeviceArray] | None = None,
              stream) -> None:
    """out [T, H, 128] = causal attention of q [T, H, 128] over each sequence's cached positions.

    cu_q [B+1] are the sequences' query offsets into q, kv_lens [B] their cached lengths after
    this step, block_tables [B, W] their pages. `max_q_len` bounds cu_q[b+1] - cu_q[b] (it sets
    the grid). With num_splits > 1 each sequence's keys are split across blocks, whose results
    go to `partials` = (part_o [S, T, H, 128] f32, part_ml [S, T, H, 2] f32) and are merged.
    """
    T, H, hd = q.shape
    if hd != HEAD_DIM:
        raise ValueError(f"attention: head_dim must be {HEAD_DIM}, got {hd}")
    pages, KV, page_size, _ = k_pool.shape
    B = kv_lens.shape[0]
    expect("q", q, (T, H, hd), BF16)
    expect("k_pool", k_pool, (pages, KV, page_size, hd), BF16)
    expect("v_pool", v_pool, (pages, KV, page_size, hd), BF16)
    expect("out", out, (T, H, hd), BF16)
    expect("cu_q", cu_q, (B + 1,), INT32)
    expect("kv_lens", kv_lens, (B,), INT32)
    expect("block_tables", block_tables, (B, None), INT32)
    if H % KV:
        raise ValueError(f"attention: {H} query heads are not a multiple of {KV} KV heads")
    if num_splits < 1:
        raise ValueError(f"attention: num_splits must be >= 1, got {num_splits}")
    part_o = part_ml = None
    if num_splits > 1:
        if partials is None:
            raise ValueError("attention: num_splits > 1 needs the partials buffers")
        part_o, part_ml = partials
        expect("part_o", part_o, (num_splits, T, H, hd), FLOAT32)
        expect("part_ml", part_ml, (num_splits, T, H, 2), FLOAT32)
    group = H // KV
    grid = (cdiv(max_q_len * group, ROWS_PER_BLOCK), KV, B * num_splits)
    scale_log2 = LOG2E / math.sqrt(hd)
    kernel("attention.cu", "attention").launch(
        grid, (128,), [q, k_pool, v_pool, out, part_o, part_ml, cu_q, kv_lens, block_tables,
                       I32(block_tables.shape[1]), I32(H), I32(KV), I32(page_size), I32(num_splits), I32(T),
                       F32(scale_log2)], stream, smem=SMEM)
    if num_splits > 1:
        kernel("attention.cu", "attention_combine").launch(
            (T, H), (HEAD_DIM,), [part_o, part_ml, out, I32(num_splits), I32(T), I32(H)], stream)
