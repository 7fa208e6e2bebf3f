"""Launchers for paged causal attention over a BF16 or INT8 cache: cuda_src/attention_prefill.cu (the prefill
shape), attention_decode.cu (the decode shape), attention_combine.cu (the split-K combine), and
attention_wg.cu, which takes the prefill shape over a BF16 cache on Hopper. Which kernel a launch runs is
routing.py's (kernel_name)."""
import math
from typing import NamedTuple

from ..cuda import F32, I32, DeviceArray, get_device, kernel
from ._check import BF16, FLOAT32, INT8, INT32, cdiv, expect
from .attn_input import check_inputs
from . import routing
from .routing import fuses_input, kernel_file, kernel_name, keys_mode

HEAD_DIM = 128
KEY_TILE = 64
MAX_SPLITS = 128  # attention_combine merges up to one split per thread (attention_combine.cu COMBINE_MAX_SPLITS)
COMBINE_THREADS = 512  # attention_combine.cu's COMBINE_WARPS * 32
LOG2E = 1.4426950408889634
# attention_wg.cu: blocks of 128 rows (token, head-in-group: 2 consumer warpgroups x 64) and 384 threads (+ a
# producer warpgroup), key tiles of 128 positions in a ring of 2 stages. Dynamic shared memory as its
# WgSmem<2>::TOTAL: Q, the stages' K and V tiles, 4 mbarriers a stage, 1024 bytes of alignment slack (164,928).
WG_ROWS = 128
WG_THREADS = 384
WG_KEY_TILE = 128
WG_STAGES = 2
WG_SMEM = WG_ROWS * HEAD_DIM * 2 + 2 * WG_STAGES * WG_KEY_TILE * HEAD_DIM * 2 + 4 * WG_STAGES * 8 + 1024


# attention_decode_h8_items (routing.decode_items_blocks): ItemsSmem::TOTAL in attention.cuh, the _h8 build's Q
# tile, K and V tiles for each of its 3 stages and two more Q tiles (110,592 bytes).
ITEMS_SMEM = 3 * 16 * HEAD_DIM * 2 + 2 * 3 * KEY_TILE * HEAD_DIM * 2


def rows_per_block(keys_mode: bool) -> int:
    return 16 if keys_mode else 64


class FusedInput(NamedTuple):
    """attn_input's inputs, for an attention launch that does its work (`fuses_input`)."""
    qkv: DeviceArray          # [T, (H + 2 KV) * 128] bf16, the QKV product
    positions: DeviceArray    # [T] int32
    slots: DeviceArray        # [T] int32, < 0: a padding token (nothing stored)
    q_norm: DeviceArray       # [128] bf16
    k_norm: DeviceArray       # [128] bf16
    inv_freq: DeviceArray     # [64] float32
    smoothing: DeviceArray | None  # INT8 cache: [128] float32 key-smoothing factors, or None
    eps: float


def stages(int8: bool, keys_mode: bool, half: bool = False) -> int:
    if not keys_mode:
        return 2
    return (3 if half else 4) if int8 else 3


def smem_bytes(int8: bool, keys_mode: bool, half: bool = False) -> int:
    """Dynamic shared memory of one block, as Smem<Q8, KEYS, HALF>::TOTAL in attention.cuh."""
    tile = KEY_TILE * HEAD_DIM * 2
    q_bytes = rows_per_block(keys_mode) * HEAD_DIM * 2
    n = stages(int8, keys_mode, half)
    kv = 2 * ((0 if keys_mode else 1) if int8 else n) * tile  # INT8 decode reads the int8 tiles directly
    stage = n * (2 * KEY_TILE * HEAD_DIM + 2 * KEY_TILE * 4) if int8 else 0
    return q_bytes + kv + stage


def attention(q: DeviceArray, k_pool: DeviceArray, v_pool: DeviceArray, out: DeviceArray,
              cu_q: DeviceArray, kv_lens: DeviceArray, block_tables: DeviceArray, *,
              max_q_len: int, num_splits: int = 1, partials: tuple[DeviceArray, DeviceArray] | None = None,
              scales: tuple[DeviceArray, DeviceArray] | None = None, decode_shape: bool = True,
              fused: FusedInput | None = None, wg: bool = True, stream) -> None:
    """out [T, H, 128] = causal attention of q [T, H, 128] over each sequence's cached positions.

    cu_q [B+1] are the sequences' query offsets into q, kv_lens [B] their cached lengths after
    this step, block_tables [B, W] their pages. `max_q_len` bounds cu_q[b+1] - cu_q[b] (it sets
    the grid, and whether the decode shape runs: at most KEYS_MAX_ROWS query rows per KV head, unless
    decode_shape=False, which keeps every launch in the prefill shape for batch invariance). With
    num_splits > 1 each sequence's keys are split across blocks, whose results go to `partials`
    = (part_o [S, T, H, 128] f32, part_ml [S, T, H, 2] f32) and are merged. On Hopper the prefill
    shape over a BF16 cache without a split runs attention_wg.cu instead of attention_prefill.cu (`kernel_name`).

    An INT8 cache (int8 pools) needs `scales` = (k_scale, v_scale) float32 [pages, KV, page_size];
    its queries must already carry the key-smoothing factors if the keys were stored smoothed.

    `fused` (only where `fuses_input` says so): attn_input's inputs; the launch then does its work (the
    queries from `fused.qkv`, `q` unread; the new keys and values stored into the pools) and the caller skips
    attn_input.

    wg=False keeps a launch that attention_wg.cu would take on attention_prefill.cu (which runs it for
    pools past attention_wg's 32-bit offsets and on other GPUs): for tests that compare the two kernels.
    """
    T, H, hd = q.shape
    pages, KV, page_size, _ = k_pool.shape
    B = kv_lens.shape[0]
    int8 = k_pool.dtype == INT8
    group = H // KV
    _check_pools(q, k_pool, v_pool, out, cu_q, kv_lens, block_tables, num_splits)
    k_scale, v_scale = _check_scales(int8, scales, k_pool.shape[:3])
    part_o, part_ml = _check_partials(num_splits, partials, (T, H, hd))
    if fused is not None:
        _check_fused(fused, q, int8, max_q_len=max_q_len, num_heads=H, num_kv_heads=KV, decode_shape=decode_shape)
    keys = keys_mode(max_q_len=max_q_len, group=group, decode_shape=decode_shape)
    name = kernel_name(int8=int8, keys_mode=keys, num_splits=num_splits,
                       pool_elements=pages * KV * page_size * hd, arch=get_device().info.arch,
                       rows=max_q_len * group, wg=wg, fused=fused is not None)
    args = [q, k_pool, v_pool, k_scale, v_scale, out, part_o, part_ml, cu_q, kv_lens, block_tables,
            I32(block_tables.shape[1]), I32(H), I32(KV), I32(page_size), I32(num_splits), I32(T),
            F32(LOG2E / math.sqrt(hd))]
    if name == "attention_wg":
        # Row tiles of 128 in the grid's y, the KV heads in x (the other kernels have them the other way round).
        kernel(kernel_file(name), name).launch((KV, cdiv(max_q_len * group, WG_ROWS), B), (WG_THREADS,), args,
                                               stream, smem=WG_SMEM)
        return
    grid = (cdiv(max_q_len * group, rows_per_block(keys)), KV, B * num_splits)
    items = math.prod(grid)
    blocks = routing.decode_items_blocks(name, items, get_device().info.num_sms)
    if blocks:
        kernel(kernel_file(name), name + "_items").launch((blocks,), (128,), args + [I32(items)], stream,
                                                          smem=ITEMS_SMEM)
    else:
        if fused is None:
            args += [None] * 7 + [F32(0.0)]
        else:
            args += [fused.qkv, fused.positions, fused.slots, fused.q_norm, fused.k_norm, fused.inv_freq,
                     fused.smoothing, F32(fused.eps)]
        kernel(kernel_file(name), name).launch(grid, (128,), args, stream, smem=smem_bytes(int8, keys, "_h8" in name))
    if num_splits > 1:
        kernel("attention_combine.cu", "attention_combine").launch(
            (T, H), (COMBINE_THREADS,), [part_o, part_ml, out, I32(num_splits), I32(T), I32(H)], stream)


def _check_pools(q, k_pool, v_pool, out, cu_q, kv_lens, block_tables, num_splits: int) -> None:
    T, H, hd = q.shape
    if hd != HEAD_DIM:
        raise ValueError(f"attention: head_dim must be {HEAD_DIM}, got {hd}")
    pages, KV, page_size, _ = k_pool.shape
    B = kv_lens.shape[0]
    pool_dtype = INT8 if k_pool.dtype == INT8 else BF16
    expect("q", q, (T, H, hd), BF16)
    expect("k_pool", k_pool, (pages, KV, page_size, hd), pool_dtype)
    expect("v_pool", v_pool, (pages, KV, page_size, hd), pool_dtype)
    expect("out", out, (T, H, hd), BF16)
    expect("cu_q", cu_q, (B + 1,), INT32)
    expect("kv_lens", kv_lens, (B,), INT32)
    expect("block_tables", block_tables, (B, None), INT32)
    if H % KV:
        raise ValueError(f"attention: {H} query heads are not a multiple of {KV} KV heads")
    if not 1 <= num_splits <= MAX_SPLITS:
        raise ValueError(f"attention: num_splits must be in [1, {MAX_SPLITS}], got {num_splits}")


def _check_scales(int8: bool, scales, shape: tuple) -> tuple:
    """(k_scale, v_scale) [pages, KV, page_size] float32 of an INT8 cache, (None, None) for BF16."""
    if not int8:
        if scales is not None:
            raise ValueError("attention: scales were given for a BF16 cache")
        return None, None
    if scales is None:
        raise ValueError("attention: an INT8 cache needs its scales (k_scale, v_scale)")
    k_scale, v_scale = scales
    expect("k_scale", k_scale, shape, FLOAT32)
    expect("v_scale", v_scale, shape, FLOAT32)
    return k_scale, v_scale


def _check_partials(num_splits: int, partials, q_shape: tuple) -> tuple:
    """(part_o [S, T, H, 128], part_ml [S, T, H, 2]) float32 for a split launch, (None, None) without."""
    if num_splits == 1:
        return None, None
    if partials is None:
        raise ValueError("attention: num_splits > 1 needs the partials buffers")
    T, H, hd = q_shape
    part_o, part_ml = partials
    expect("part_o", part_o, (num_splits, T, H, hd), FLOAT32)
    expect("part_ml", part_ml, (num_splits, T, H, 2), FLOAT32)
    return part_o, part_ml


def _check_fused(fused: FusedInput, q, int8: bool, *, max_q_len: int, num_heads: int, num_kv_heads: int,
                 decode_shape: bool) -> None:
    if not fuses_input(max_q_len=max_q_len, num_heads=num_heads, num_kv_heads=num_kv_heads,
                       decode_shape=decode_shape):
        raise ValueError(f"attention: fused input needs a decode step of one token a sequence on an _h8 build "
                         f"(max_q_len {max_q_len}, group {num_heads // num_kv_heads}; fuses_input)")
    check_inputs(fused.qkv, fused.positions, fused.slots, fused.q_norm, fused.k_norm, fused.inv_freq, q, num_heads,
                 num_kv_heads)
    if fused.smoothing is not None:
        if not int8:
            raise ValueError("attention: smoothing factors were given for a BF16 cache")
        expect("smoothing", fused.smoothing, (HEAD_DIM,), FLOAT32)
