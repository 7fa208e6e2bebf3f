"""Kernel choice: which entry point, build and shape a launch runs, as pure functions of its shape, its cache
and the GPU (no device access). The launchers (kernels/attention.py) call them; so does the engine, through
what tileinfer.kernels exports (engine_fuses_input, int8_decode_blocks)."""

# ============================================================================= attention
# Query rows per (sequence, KV head) up to which a step runs in the decode shape (keys mode,
# cuda_src/attention_decode.cu): up to 4 row tiles of 16, each reading the sequence's keys and values itself,
# where the prefill shape's one 64-row tile would leave 2-3 of its 4 warps idle (a k = 4 verify step of
# qwen3-8b has 5 tokens x a group of 4 = 20 rows).
KEYS_MAX_ROWS = 64
# Blocks of at most this many rows (one row tile: a decode step's token x a group of <= 8) run the keys mode's
# _h8 build, which skips the padding rows 8-15 of its score accumulators and computes O^T = V^T P^T (8 rows
# as the mma's N: half the P V products and accumulators; for INT8 also the registers that let 4 blocks
# share an SM, int8_decode_blocks).
HALF_ROWS = 8
# A decode step (one token a sequence) whose attention runs an _h8 build can skip attn_input: the attention kernel
# norms and rotates its group's queries itself, and the block that holds the new position stores its key and
# value (cuda_src/attention.cuh, "fused input"). The engine does so from FUSED_MIN_SPLITS key splits on (a long
# cache): over a shorter cache the fused launch was slower than the attn_input and attention launches it replaces.
FUSED_MIN_SPLITS = 16
WG_MAX_POOL = 1 << 32  # attention_wg.cu's producer indexes a pool with 32-bit element offsets


def keys_mode(*, max_q_len: int, group: int, decode_shape: bool = True) -> bool:
    """Whether a launch runs the decode shape (attention_decode.cu): at most KEYS_MAX_ROWS query rows per
    sequence and KV head, unless decode_shape=False (batch invariance keeps every launch in the prefill shape)."""
    return decode_shape and max_q_len * group <= KEYS_MAX_ROWS


def half_build(keys_mode: bool, rows: int) -> bool:
    """Whether a launch with `rows` query rows per sequence and KV head runs the decode shape's _h8 build."""
    return keys_mode and rows <= HALF_ROWS


def fuses_input(*, max_q_len: int, num_heads: int, num_kv_heads: int, decode_shape: bool = True) -> bool:
    """Whether an attention launch of this shape can do attn_input's work itself (pass `fused=`): a decode step
    of one token a sequence on an _h8 build."""
    group = num_heads // num_kv_heads
    return max_q_len == 1 and half_build(keys_mode(max_q_len=1, group=group, decode_shape=decode_shape), group)


def engine_fuses_input(*, max_q_len: int, num_heads: int, num_kv_heads: int, num_splits: int,
                       decode_shape: bool = True) -> bool:
    """Whether the engine's forward pass fuses the input of an attention launch: where the shape allows it, from
    FUSED_MIN_SPLITS splits on."""
    if num_splits < FUSED_MIN_SPLITS:
        return False
    return fuses_input(max_q_len=max_q_len, num_heads=num_heads, num_kv_heads=num_kv_heads, decode_shape=decode_shape)


def int8_decode_blocks(rows: int) -> int:
    """Blocks an SM of the INT8 decode kernel for blocks of `rows` query rows (attention.cuh's Smem and the
    builds' registers): the _h8 build (under 128 registers, 3 stages, 55 KB) fits 4, the 16-row build (158,
    4 stages) 3."""
    return 4 if half_build(True, rows) else 3


def kernel_name(*, int8: bool, keys_mode: bool, num_splits: int, pool_elements: int, arch: str,
                rows: int = KEYS_MAX_ROWS, wg: bool = True) -> str:
    """The entry point a launch runs: attention_wg (attention_wg.cu) for the prefill shape over a BF16
    cache without a key split on Hopper (arch sm_90, compiled as sm_90a: wgmma), unless the pool is too
    large for its 32-bit offsets (or wg=False: the tests that compare the two kernels); otherwise
    attention_prefill.cu's attention / attention_int8, or attention_decode.cu's attention_decode /
    attention_int8_decode for the decode shape (keys mode), + "_h8" when a block has at most HALF_ROWS rows
    (`rows`: query rows per sequence and KV head, max_q_len x the group)."""
    if wg and not int8 and not keys_mode and num_splits == 1 and arch == "sm_90" and pool_elements < WG_MAX_POOL:
        return "attention_wg"
    name = ("attention_int8" if int8 else "attention") + ("_decode" if keys_mode else "")
    return name + "_h8" if half_build(keys_mode, rows) else name


def kernel_file(name: str) -> str:
    """The cuda_src file that holds attention entry point `name` (kernel_name's, or attention_combine)."""
    if name in ("attention_wg", "attention_combine"):
        return name + ".cu"
    return "attention_decode.cu" if "_decode" in name else "attention_prefill.cu"
