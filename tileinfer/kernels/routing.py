"""Kernel choice: which entry point, build and shape a launch runs, as pure functions of its shape, its cache
and the GPU (no device access). The launchers (kernels/attention.py) call them; so does the engine, through
what tileinfer.kernels exports (engine_fuses_input, int8_decode_blocks)."""
from dataclasses import dataclass

from ._check import cdiv


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
# value (cuda_src/attention.cuh, "fused input"; each warp prepares its tasks before the wait for the QKV product
# and requests their heads together after it). The engine fuses:
# - from FUSED_MIN_SPLITS key splits on (a long cache). Over a shorter cache at batch 1 a few blocks carry the
#   input's work on the step's critical path, and the fused launch was slower than attn_input (whose work hides in
#   the QKV product's tail under programmatic dependent launch) then attention: -2.4% (qwen3-0.6b) and -1.2%
#   (qwen3-4b) at 10 splits on an NVIDIA H100.
# - at the batches of FUSED_SEQS, by the group: (largest group, fewest sequences, most sequences). There every
#   (sequence, KV head) block prepares its group's queries and its head's new key and value while its first tiles
#   load, and attn_input's launch and wait go. On an NVIDIA H100 (bench.py --no-single, against attn_input then
#   attention) a group of 2 (qwen3-0.6b) gained 5.3-6.5% at 2-7 sequences, 0.5-2.2% at 80-256, its offline run
#   2.4%. A group of 4 gained at 4 and 256 sequences (qwen3-4b 1.2% and 1.4%, qwen3-8b 0.9% and 0.4%; with the
#   INT8 cache qwen3-4b -0.8% and +1.7%), but at 2 qwen3-8b lost 3.3%. Groups of 5-8 (their tasks three rounds of
#   the four warps) keep the range measured on the H200 before a warp's tasks ran together, where fusing lost
#   0.4-2.3% at 144 and 256 sequences.
FUSED_MIN_SPLITS = 16
FUSED_SEQS = ((3, 2, 256), (4, 4, 256), (HALF_ROWS, 8, 64))
WG_MAX_POOL = 1 << 32  # attention_wg.cu's producer indexes a pool with 32-bit element offsets
# Blocks an SM of the BF16 decode builds (100 KB of shared memory; the persistent one's 108 KB), decode_items_blocks.
DECODE_ITEMS_BLOCKS = 2


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


def engine_fuses_input(*, max_q_len: int, num_heads: int, num_kv_heads: int, num_splits: int, num_seqs: int = 1,
                       decode_shape: bool = True, rows_share_keys: bool = False) -> bool:
    """Whether the engine's forward pass fuses the input of an attention launch: where the shape allows it, from
    FUSED_MIN_SPLITS splits on, or at the batches FUSED_SEQS gives the group; never where rows read each other's
    new keys (StepShape.rows_share_keys)."""
    group = num_heads // num_kv_heads
    lo, hi = next(((lo, hi) for most, lo, hi in FUSED_SEQS if group <= most), (1, 0))
    if rows_share_keys or (num_splits < FUSED_MIN_SPLITS and not lo <= num_seqs <= hi):
        return False
    return fuses_input(max_q_len=max_q_len, num_heads=num_heads, num_kv_heads=num_kv_heads, decode_shape=decode_shape)


def decode_items_blocks(name: str, items: int, sms: int) -> int:
    """The grid of attention_decode_h8_items for a launch kernel_name routes to `name`, of `items` blocks
    (sequence, split, KV head): a wave of DECODE_ITEMS_BLOCKS an SM, each block taking items in turn with its
    key-tile pipeline running on from one into the next (cuda_src/attention_decode.cu, "the persistent build"), so
    that it waits for its first tiles once rather than once a wave; 0 where the plain grid runs (other builds, and
    launches of at most a wave)."""
    if name != "attention_decode_h8" or items <= DECODE_ITEMS_BLOCKS * sms:
        return 0
    return DECODE_ITEMS_BLOCKS * sms


def int8_decode_blocks(rows: int) -> int:
    """Blocks an SM of the INT8 decode kernel for blocks of `rows` query rows (attention.cuh's Smem and the
    builds' registers): the _h8 build (under 128 registers, 3 stages, 55 KB) fits 4, the 16-row build (158,
    4 stages) 3."""
    return 4 if half_build(True, rows) else 3


# Batch-1 decode over a BF16 cache sizes its key splits for one block an SM where a layer's cache at max_context is
# under this share of the layer's matrices' weights (bf16_decode_blocks).
ONE_BLOCK_CACHE_SHARE = 4


def bf16_decode_blocks(*, batch: int, layer_cache_bytes: int, layer_weight_bytes: int) -> int:
    """Blocks an SM that a decode step's key splits over a BF16 cache are sized for (attention_splits' per_sm): the
    DECODE_ITEMS_BLOCKS the builds fit (100 KB of shared memory each), or one at batch 1 where a layer's cache at
    max_context (`layer_cache_bytes`) is under 1 / ONE_BLOCK_CACHE_SHARE of its matrices' weights
    (`layer_weight_bytes`): qwen3-4b below 12,320 positions, qwen3-0.6b below 1,920. One block an SM there halves
    the splits (a grid of about half the SMs' slots, half the partials for attention_combine). On the H200 it was
    the faster for qwen3-4b at 2,048 and 8,192 positions and the slower at 16,384 and 32,768 (on an H100 it had been
    the faster at 32,768 too; why the two differ was not measured): docs/benchmarks.md, Batch-1 decode."""
    one = batch == 1 and ONE_BLOCK_CACHE_SHARE * layer_cache_bytes < layer_weight_bytes
    return 1 if one else DECODE_ITEMS_BLOCKS


def kernel_name(*, int8: bool, keys_mode: bool, num_splits: int, pool_elements: int, arch: str,
                rows: int = KEYS_MAX_ROWS, wg: bool = True, fused: bool = False) -> str:
    """The entry point a launch runs: attention_wg (attention_wg.cu) for the prefill shape over a BF16
    cache without a key split on Hopper (arch sm_90, compiled as sm_90a: wgmma), unless the pool is too
    large for its 32-bit offsets (or wg=False: the tests that compare the two kernels); otherwise
    attention_prefill.cu's attention / attention_int8, or attention_decode.cu's attention_decode /
    attention_int8_decode for the decode shape (keys mode), + "_h8" when a block has at most HALF_ROWS rows
    (`rows`: query rows per sequence and KV head, max_q_len x the group), + "_fused" for the fused input (an _h8
    build's entry point of its own, so that the other carries none of its code)."""
    if wg and not int8 and not keys_mode and num_splits == 1 and arch == "sm_90" and pool_elements < WG_MAX_POOL:
        return "attention_wg"
    name = ("attention_int8" if int8 else "attention") + ("_decode" if keys_mode else "")
    if not half_build(keys_mode, rows):
        return name
    return name + ("_h8_fused" if fused else "_h8")


def kernel_file(name: str) -> str:
    """The cuda_src file that holds attention entry point `name` (kernel_name's, or attention_combine)."""
    if name in ("attention_wg", "attention_combine"):
        return name + ".cu"
    return "attention_decode.cu" if "_decode" in name else "attention_prefill.cu"


# ============================================================================= matrix products (kernels/linear.py)
# The kernels' own sizes: tests/test_linear_routing.py compiles each .cu with static_asserts against them.
# enum Epilogue of the three .cu files; "xielu" (Apertus' up projection) also takes the parameters `act`
EPILOGUES = {"bf16": 0, "residual": 1, "silu_mul": 2, "f32": 3, "xielu": 4}
PATHS = ("gemv", "swap", "gemm")
H200_SMS = 132

# gemv.cu: GEMV_WARPS warps a block, each owning a pair of W rows (or warps sharing one: ksplit); a warp
# reads GEMV_SEGMENT elements of a row per 16-byte load across its lanes.
GEMV_WARPS = 8
GEMV_SEGMENT = 256
GEMV_ROWS = (1, 2)  # the gemv_m{M}_* builds, and the M the GEMV takes (from 3 rows on the swap-AB GEMM)
GEMV_SPLITS = (1, 2, 4, 8)
PIPE_EPILOGUES = ("residual", "f32")  # gemv_pipe_m1_*: o_proj, down_proj and the LM head
PIPE_MIN_SEGMENTS = 4
NORM_EPILOGUES = ("bf16", "silu_mul", "xielu")  # the gemv_norm_* builds: the products after a norm (QKV, gate/up, up)
NORM_SHORT_K = 1024  # batch-1 QKV rows this short take the 64-register build (gemv.cu, GEMV_NORM_KERNEL)

# gemm_swap.cu: blocks of SWAP_TILE W rows (one warpgroup) against the whole batch padded to B rows,
# k-chunks of SWAP_BK, `ksplit` blocks per cluster splitting K; Cfg<B, 1>::STAGES chunks in flight.
SWAP_BATCHES = (16, 32, 64)
SWAP_TILE = 64
SWAP_BK = 64
SWAP_THREADS = 128
SWAP_SPLITS = (1, 2, 4, 8)
SWAP_STAGES = {16: 10, 32: 8, 64: 6}
SWAP_DEEP_STAGES = 20  # the deep B = 16 builds (gemm_swap_b16d_*): one block an SM
SWAP_WAVE = 0.9  # swap_config: the fewest splits whose grid reaches this fraction of the SMs
SWAP_SLOTS_PER_SM = 2  # blocks of the ordinary builds an SM holds at once (~97-103 KB of shared memory each)
SWAP_DEFAULT_ROWS = range(3, 65)  # M the swap-AB GEMM takes by default; the TMA GEMM takes the rest
NORM_MAX_TILES = 96  # gemm_swap.cu: 32 * SS_LOADS, row_norm's partials a row

# gemm_tma.cu: 128-row tiles, k-steps of 64, one block per SM (SMEM_BYTES), 128 or 256 W rows a tile
# (the persistent kernel also 160, 96 or 64).
TMA_BM = 128
TMA_BK = 64
TMA_THREADS = 384
TMA_SMEM = 192 * 1024 + 256 + 1024  # SMEM_BYTES: the stage ring, mbarriers, alignment
TMA_WIDTHS = (256, 128)  # gemm_tma_e* and gemm_tma_n128_e*: every build (persistent, split, multicast)
# Widths of the persistent kernel alone (gemm_tma_n160_e*, gemm_tma_n96_e*, gemm_tma_n64_e*), whose tiles fill whole
# rounds of the SMs at batched-decode row counts where 128 and 256 leave a round partly empty: qwen3-4b at 256 rows,
# gate/up in 244 tiles of 160 (two rounds of 132) against 304 of 128 (three) or 152 of 256 (two of twice the cost); QKV
# in 128 tiles of 96 against 96 of 128 (one round either way, a quarter less work a tile); qwen3-0.6b's QKV at 65-256
# rows and its gate/up at 65-128 in 128 and 96 tiles of 64 against 86 and 64 of 96 (alone on an H100,
# `scripts/bench_gemm_small.py --tma`: QKV at 96 / 256 rows 6.7 / 7.7 us against 7.4 / 9.1, gate/up at 96 rows 7.1
# against 8.1; in the engine, `bench.py --models qwen3-0.6b --no-single`, +1.8% at 96 sequences, +0.4% at 144, +0.3% at
# 256). Below TMA_TAIL_SPLIT_ROWS rows: past them the rounds are many (a partial one costs less) and the plan's tail
# split and multicast builds exist at TMA_WIDTHS only.
TMA_ROUND_WIDTHS = (160, 96, 64)
# Their k-step's cost, in k-steps of a 128 x 128 tile: estimates, not fitted (a 96-wide tile reads the same A tile
# for three quarters of the columns, so a little over 0.75; a 64-wide one for half, 0.7). Over every build of
# qwen3-0.6b's and 4b's products at 96-256 rows alone on an H100, the plan's picks at 0.7 took 650.4 us in all
# against 647.8 for the fastest build of each; 64 wide also beat the plan's 2-way split of qwen3-4b's QKV at 96 and
# 128 rows (14.6 / 15.4 us against 15.7 / 16.1), which a cost of 0.6 would pick, but 0.6 also picks 64 wide for
# qwen3-8b's o_proj at 129-256 rows, where qwen3-4b's o_proj lost 64 wide (17.3-18.3 us against 14.8-15.5).
TMA_ROUND_COST = {160: 1.25, 96: 0.8, 64: 0.7}
# The split builds at a round width (gemm_tma_n96_s{2,4}_e*): 2- and 4-block clusters on 96-wide tiles. qwen3-4b's
# o_proj and down_proj at 129-256 rows (N = 2,560): 54 tiles, 108 blocks split 2 ways, against the 40 narrow tiles'
# 80 blocks of a 2-way split (the 3-way's 120 blocks are more than the 117 the H200 holds in 3-block clusters);
# alone on an H100 (`scripts/bench_gemm_small.py --tma`) o_proj / down_proj at 256 rows took 15.8 / 33.5 us against
# 19.5 / 40.2. Up to 128 rows, 27 tiles split 4 ways (108 blocks): 12.2 / 23.5 us at 96 rows against 14.0 / 26.4
# split 4 ways 128 wide; qwen3-0.6b's (N = 1,024, 11 tiles, 88 blocks at 129-256 rows) at 144 rows 7.9 / 9.4 us
# against 8.5 split 2 ways 96 wide / 11.2 split 4 ways 128 wide. 160-wide splits and 3-way 96-wide ones were slower
# or no faster in every such product measured (qwen3-0.6b, 4b and 8b at 96-256 rows).
TMA_ROUND_SPLITS = {96: (2, 4)}
TMA_SPLITS = (2, 3, 4)  # gemm_tma_s{KS}_e*, gemm_tma_n128_s{KS}_e*: KS blocks (a cluster) per output tile
# Tiles of 256 rows (gemm_tma_m256_n{width}[_s{KS}]_e*, a 224 KB stage ring: TMA_TALL_SMEM): each consumer
# warpgroup 128 rows in two m64 wgmmas a k16, so that a block reads a W tile once for 256 rows of A. tma_plan weighs
# them up to TMA_TALL_MAX_ROWS where the last 256-row tile is more than half full (tma_tall_rows), a k-step costing
# TMA_TALL_COST k-steps of a 128 x 128 tile (fitted to `scripts/bench_gemm_small.py --tma` on an H100, qwen3-0.6b,
# 4b and 8b at 144 and 256 rows: 1.29-1.43 at 96 wide, 2.24 at 160). Measured each alone at 144 / 256 rows:
# qwen3-4b's gate/up 42.9 / 45.9 us 160 wide against 46.8 / 48.3 in the 128-row tiles' two rounds, its down_proj
# 29.7 / 32.3 split 4 ways 96 wide against 34.2 / 33.9 split 2 ways; qwen3-8b's gate/up 82.2 / 84.3 in two rounds
# 96 wide against 93.3 / 92.7 in three rounds 128 wide.
# In the engine (bench.py --no-single) qwen3-4b gained 2.8% at 144 sequences and 0.2% at 256 (docs/benchmarks.md).
# At 512 rows: qwen3-4b's QKV 28.1 us 96 wide against 32.3 in 128-row tiles, its gate/up 77.6 160 wide against
# 92.9 (128 wide), qwen3-8b's QKV 40.7 against 47.9. At 641-768 and 897-1,024 rows they took the 768- and
# 1,024-token prefill of qwen3-4b +11.7% and +4.3%, of qwen3-8b +17.9% and +2.7% (bench.py --prefill 768,1024).
# 128-wide 256-row builds and 96-wide 2-way splits were slower than the plan's in every product swept.
# Up to TMA_TALL_MAX_ROWS: at 1,409-1,536 rows they took the 1,536-token prefill of qwen3-0.6b, 4b and 8b +3.4%,
# +1.9% and +3.8% (at 1,280 tokens -0.5% to +2.2%); at 1,792 and 2,048 rows they replaced gate/up plans whose last
# round splits 4 ways (with multicast at 2,048) and the prefill lost up to 8.5% (bench.py --prefill, A/B on an H100).
TMA_TALL = 256
TMA_TALL_MAX_ROWS = 1536
TMA_TALL_SPLITS = {96: (1, 4), 160: (1,)}
TMA_TALL_COST = {96: 1.4, 160: 2.24}
TMA_TALL_SMEM = 224 * 1024 + 256 + 1024  # SMEM_BYTES_TALL
# A 128 x 256 tile's time over two 128 x 128 tiles': in the persistent kernel an estimate, not fitted; in a split
# launch fitted to `scripts/bench_gemm_small.py --tma` on the H200 (qwen3-0.6b, 4b and 8b at 96-384 rows;
# qwen3-4b's down_proj at 256 rows took 44.6 us split 4 ways in wide tiles, 42.5 split 2 ways in narrow ones,
# at 384 rows 46.1 and 40.1). Split launches only: the persistent kernel's narrow tiles gained alone where their
# extra round lost in the engine (qwen3-4b's gate/up at 96 rows: 40.2 us narrow against 42.4 wide alone, yet
# batch-96 decode fell from 16,246 to 15,724 tok/s with them).
TMA_WIDE_COST = 0.92
TMA_WIDE_SPLIT_COST = 1.05
# tma_plan's cost model, in k-steps (64 deep) of a 128 x 128 tile at the full per-SM rate: a launch's fixed
# cost (its first TMA loads, the epilogue; the persistent kernel hides its later fills behind the previous
# tile), a split block's (the cluster's launch and barriers besides), and a split's reduction per rank and 128
# columns. The split's two are the values whose picks took the least time in total over `scripts/bench_gemm_small.py
# --tma` (qwen3-0.6b and 4b at 96-256 rows, every build alone, on an H100). With the estimates before them (3 and
# 0.5) qwen3-0.6b's QKV and gate/up at 65-256 rows split 2 ways, slower alone (QKV at 96 rows 8.8 us against 7.3
# unsplit 96 wide) and in the engine. A split must beat the unsplit launch by TMA_SPLIT_MARGIN.
TMA_FILL = 3.0
TMA_SPLIT_FILL = 6.0
TMA_SPLIT_REDUCE = 2.0
TMA_SPLIT_MARGIN = 0.9
TMA_SPLIT_MIN_KSTEPS = 2  # k-steps each block of a split gets at least
# From this many rows on, a residual product (o_proj, down_proj: out += x W^T in float32) splits 2 ways however
# many waves that takes, unless the persistent kernel at a round width is cheaper (tma_residual_plan).
# `scripts/bench_gemm_small.py --tma --m 1024,2048,4096` on the H200: such a split beat the unsplit kernel at
# 128 and 256 wide for qwen3-0.6b, 4b and 8b at 1,024-4,096 rows (qwen3-4b's o_proj / down_proj at 4,096 rows
# 165.8 / 343.0 us against 186.2 / 383.4 unsplit in narrow tiles), equal for qwen3-8b at 4,096, and lost only for
# qwen3-0.6b at 2,048 rows (18.8 / 24.0 against 17.9 / 23.4). The products of the other epilogues lost split at
# every size. On an H100 the persistent kernel 160 wide beat the split for qwen3-4b, whose N = 2,560 is 16 such
# tiles (o_proj / down_proj at 1,024 rows 36.7 / 81.7 us against 56.0 / 114.6 split, at 2,048 rows 83.1 / 163.8
# against 101.3 / 230.8, at 4,096 158.7 / 356.2 against 174.9 / 349.1), and lost to it for qwen3-0.6b and 8b
# (qwen3-8b's down_proj at 4,096 rows 788.2 against 673.3).
TMA_RESIDUAL_SPLIT_ROWS = 1024
# Past this many multiply-adds (M x N x K) a prefill-sized residual product splits whatever its rounds: on the
# H100, qwen3-32b's down_proj (N = 5,120 = 32 x 160, K = 25,600) took 388 us 160 wide against 504 split at 1,024
# rows (0.98 x 2^37), but 909 against 840 at 2,048 and 1,920 against 1,768 at 4,096; Apertus-70B's o_proj at 4,096
# rows (2^38) 1,033 against 973. The cost model does not see this (the long products' cost is not in their rounds).
TMA_RESIDUAL_ROUND_MAX_MACS = 2 ** 37
# From this many rows on, a residual product that no one-wave split takes (tma_plan) runs tma_residual_plan too,
# instead of the persistent kernel at tma_width. On an H100 (`scripts/bench_gemm_small.py --tma --m
# 384,512,640,768,896`) the persistent kernel 128 wide, which the cost model picked there, took qwen3-4b's o_proj /
# down_proj at 640 rows 43.0 / 78.0 us against 29.7 / 59.5 split 2 ways 256 wide, qwen3-8b's at 512 rows 50.9 /
# 102.3 against 33.4 / 79.2; where the cost model picked 160 or 96 wide, tma_residual_plan picked the same width in
# every product measured.
TMA_RESIDUAL_PLAN_ROWS = 512
# From this many rows on, the persistent kernel's last round, when it leaves SMs idle, may run as a separate split
# launch (tma_tail_split): its tiles' K ranges shared by 2-4 blocks so that the idle SMs take part. On the H200
# qwen3-4b's gate/up at 4,096 rows took 630.3 us against 651.9 with its last round unsplit
# (`scripts/bench_gemm_small.py`); smaller products, whose rounds are fewer and shorter, were not measured with it.
TMA_TAIL_SPLIT_ROWS = 1024
# From this many rows on, the persistent kernel runs in clusters of 2 blocks on a pair of row tiles under one column
# tile of W, each block loading half of that W tile into both (gemm_tma.cu's multicast build; tma_multicast): a
# third less traffic from L2 into the SMs. On the H200, alone (`gemm(..., multicast=True)` against False), qwen3-4b's
# QKV and gate/up took the same time with it at 2,048 rows (106.0 us; 314 against 316) and at 1,024 up to 8%
# longer; qwen3-4b's whole 4,096-token prefill, back to back at the power limit, ran 549-550 TFLOP/s with it
# against 544-547 without (`scripts/bench.py --models qwen3-4b --prefill 4096 --repeats 5`, alternated).
TMA_MULTICAST_ROWS = 2048


# Gate/up products (SiLU) of this many rows run on the TMA GEMM, not the swap-AB GEMM, where the swap-AB grid would
# be more than a wave of blocks (swap_beyond_wave: qwen3-4b, qwen3-8b, whose MLPs ran the flow here). On an NVIDIA
# H100, in the engine against the flow (scripts/ab.py, bench.py --no-single, two runs each), qwen3-4b gained 1.0% and
# 1.2% at 48 and 64 sequences, qwen3-8b 2.9% and 3.6%; qwen3-0.6b (one wave, no flow) lost 1.7% and 0.9% on the TMA
# GEMM, so it keeps the swap-AB GEMM (docs/benchmarks.md, The batched products).
TMA_GATE_UP_ROWS = range(33, 65)


def default_path(M: int, N: int, K: int, epilogue: str = "bf16", sms: int = H200_SMS) -> str:
    """The kernel `linear` runs for an [M, K] x [N, K]^T product (see the module docstring)."""
    if M in GEMV_ROWS:
        return "gemv"
    if M in SWAP_DEFAULT_ROWS and not (epilogue == "silu_mul" and M in TMA_GATE_UP_ROWS
                                       and swap_beyond_wave(M, N, K, epilogue, sms)):
        return "swap"
    return "gemm"


def fuses_norm(path: str, M: int, epilogue: str) -> bool:
    """Whether norm_linear runs one gemv_norm_* launch (the GEMV normalizing its own rows) instead of the
    rmsnorm kernel and then `linear`."""
    return path == "gemv" and M in GEMV_ROWS and epilogue in NORM_EPILOGUES


def gemv_pairs(N: int, epilogue: str) -> int:
    """Row pairs of gemv.cu: (gate row j, up row j + N / 2) for SiLU, else rows (2 p, 2 p + 1)."""
    return N // 2 if epilogue == "silu_mul" else cdiv(N, 2)


def gemv_ksplit(pairs: int, K: int, target_warps: int = 4 * H200_SMS * GEMV_WARPS, segment: int = 512) -> int:
    """Warps per row pair of gemv.cu: the most (1, 2, 4 or 8) that keep the grid within one wave of ~4
    blocks per SM on an H200, while each warp still streams at least two `segment`-element pieces of its
    rows. One wave, not the first split past it: a second, partial wave of warps leaves most SMs idle at
    the kernel's end."""
    ksplit = 1
    while ksplit < GEMV_SPLITS[-1] and pairs * ksplit * 2 <= target_warps and K >= segment * ksplit * 2:
        ksplit *= 2
    return ksplit


def gemv_grid(pairs: int, ksplit: int) -> tuple[int]:
    """gemv.cu's grid: GEMV_WARPS warps a block, ksplit warps a row pair."""
    return (cdiv(pairs * ksplit, GEMV_WARPS),)


def head_key_count(N: int, K: int) -> int:
    """Blocks of the batch-1 LM head GEMV ([N, K] weights): the keys linear(head_keys=) writes."""
    pairs = gemv_pairs(N, "f32")
    return gemv_grid(pairs, gemv_ksplit(pairs, K))[0]


def gemv_pipe(M: int, K: int, ksplit: int, epilogue: str) -> bool:
    """Whether the batch-1 GEMV runs its software-pipelined loop (gemv.cu, PIPE): for the products with
    no norm before them, when each warp streams at least PIPE_MIN_SEGMENTS segments of its rows (with
    fewer the pipelined loop was slower; after a norm it was no faster)."""
    return M == 1 and epilogue in PIPE_EPILOGUES and K // (GEMV_SEGMENT * ksplit) >= PIPE_MIN_SEGMENTS


def gemv_kernel_name(M: int, epilogue: str, pipe: bool, argmax: bool) -> str:
    """gemv.cu's build: gemv_[pipe_][argmax_]m{M}_e{epilogue}."""
    return f"gemv_{'pipe_' if pipe else ''}{'argmax_' if argmax else ''}m{M}_e{EPILOGUES[epilogue]}"


def norm_kernel_name(M: int, K: int, epilogue: str) -> str:
    """The gemv_norm_* build of a fused norm + product: batch-1 QKV over rows of at most NORM_SHORT_K takes
    the build capped at 64 registers (faster there, slower on longer rows)."""
    name = f"gemv_norm_m{M}_e{EPILOGUES[epilogue]}"
    return name + "_b4" if M == 1 and epilogue == "bf16" and K <= NORM_SHORT_K else name


@dataclass(slots=True, frozen=True)
class SwapConfig:
    """One launch of gemm_swap.cu: the batch padded to B rows, `ksplit` blocks per cluster, grid (ksplit, tiles)."""
    B: int
    ksplit: int
    grid: tuple[int, int]
    smem: int
    deep: bool = False

    @property
    def kernel_name(self) -> str:
        return f"gemm_swap_b{self.B}{'d' if self.deep else ''}_w1_c{self.ksplit}"


def norm_tiles(n: int) -> int:
    """Partial sums of squares a row that linear(norm_out=) writes for an N = n residual (one per 64 columns)."""
    return cdiv(n, SWAP_TILE)


def swap_tiles(N: int, epilogue: str) -> int:
    """gemm_swap.cu's blocks along N: SWAP_TILE W rows each (SWAP_TILE / 2 outputs for SiLU)."""
    return cdiv(N // 2, SWAP_TILE // 2) if epilogue == "silu_mul" else cdiv(N, SWAP_TILE)


FLOW_ROWS = SWAP_DEFAULT_ROWS  # gemm_swap.cu's flow builds (B = 16, 32, 64): an MLP's two products at these rows
FLOW_EPILOGUES = ("silu_mul", "xielu")  # the up products with flow builds (their outputs are the down product's x)


def uses_mlp_flow(M: int, epilogue: str, hidden: int, intermediate: int, sms: int = H200_SMS) -> bool:
    """Whether an MLP of M rows (x [M, hidden], act [M, intermediate]) runs its up and down products as gemm_swap.cu's
    flow builds: the down product launched beside the up product, each of its blocks starting on a chunk of the up
    product's output as soon as the tiles that write it are done (the header's "The MLP's flow"). Only where the up
    product's blocks are more than the GPU holds at once (two an SM), so that its last ones would stream alone: on
    an H100, qwen3-4b (304 blocks) gained 2.9% at batch 16 and 3.8% at 64, and qwen3-0.6b (192 blocks, one wave)
    lost 7.1% and 3.6% (docs/benchmarks.md, The batched products). And only where the up product runs on the swap-AB
    GEMM: such a gate/up of 33-64 rows runs on the TMA GEMM instead (default_path)."""
    if M not in FLOW_ROWS or epilogue not in FLOW_EPILOGUES:
        return False
    N_up = 2 * intermediate if epilogue == "silu_mul" else intermediate
    return default_path(M, N_up, hidden, epilogue, sms) == "swap" and swap_beyond_wave(M, N_up, hidden, epilogue, sms)


def swap_beyond_wave(M: int, N: int, K: int, epilogue: str, sms: int = H200_SMS) -> bool:
    """Whether the swap-AB GEMM's grid for this product has more blocks than the GPU holds at once (two an SM)."""
    cfg = swap_config(M, N, K, epilogue, sms=sms)
    return cfg.grid[0] * cfg.grid[1] > SWAP_SLOTS_PER_SM * sms


def flow_tiles_per_chunk(epilogue: str) -> int:
    """The up product's tiles whose outputs make up one k-chunk (SWAP_BK columns) of the down product's x."""
    return SWAP_BK // (SWAP_TILE // 2 if epilogue == "silu_mul" else SWAP_TILE)


def swap_split(tiles: int, K: int, sms: int) -> int:
    """Blocks per cluster: the fewest (1, 2, 4, 8) whose grid reaches SWAP_WAVE of the SMs, while each
    block keeps two k-chunks."""
    ksplit = next((ks for ks in SWAP_SPLITS if tiles * ks >= SWAP_WAVE * sms), SWAP_SPLITS[-1])
    while ksplit > 1 and cdiv(K, SWAP_BK) < 2 * ksplit:
        ksplit //= 2
    return ksplit


def swap_deep(B: int, tiles: int, ksplit: int, K: int, sms: int) -> bool:
    """Whether the deep B = 16 build runs: for grids of at most one block an SM whose blocks stream at least
    SWAP_DEEP_STAGES k-chunks each. Such a grid has too few bytes in flight with the ordinary stages; on
    shorter rows the deep build's one block an SM was slower."""
    return B == 16 and tiles * ksplit <= sms and cdiv(K, SWAP_BK) >= SWAP_DEEP_STAGES * ksplit


def swap_smem(B: int, deep: bool) -> int:
    """Cfg<B, 1, deep>::SMEM of gemm_swap.cu: the stages of W and x tiles, plus alignment slack."""
    stages = SWAP_DEEP_STAGES if deep else SWAP_STAGES[B]
    return stages * (SWAP_TILE + B) * SWAP_BK * 2 + 1024


def swap_config(M: int, N: int, K: int, epilogue: str, *, ksplit: int | None = None,
                sms: int = H200_SMS) -> SwapConfig:
    """The gemm_swap.cu launch for x [M, K] @ W [N, K]^T, M <= 64: blocks per cluster from swap_split
    (fitted to an H200 sweep of the Qwen3 layer matrices, scripts/bench_gemm_small.py --swap) unless
    `ksplit` says, and the deep build where swap_deep says."""
    if not 0 <= M <= SWAP_BATCHES[-1]:
        raise ValueError(f"swap_config: the swap-AB GEMM takes 0 <= M <= {SWAP_BATCHES[-1]} rows, got M={M}")
    B = next(b for b in SWAP_BATCHES if M <= b)
    tiles = swap_tiles(N, epilogue)
    if tiles > 65535:
        raise ValueError(f"swap_config: N={N} needs {tiles} tiles, more than grid.y allows (65535)")
    if ksplit is None:
        ksplit = swap_split(tiles, K, sms)
    elif ksplit not in SWAP_SPLITS:
        raise ValueError(f"swap_config: ksplit must be one of {SWAP_SPLITS}, got {ksplit}")
    deep = swap_deep(B, tiles, ksplit, K, sms)
    return SwapConfig(B, ksplit, (ksplit, tiles), swap_smem(B, deep), deep)


def tma_tiles(M: int, N: int, silu: bool, width: int, rows: int = TMA_BM) -> int:
    """gemm_tma.cu's output tiles: `rows` (128 or 256) rows x `width` columns of W (width / 2 outputs for SiLU)."""
    return cdiv(M, rows) * (cdiv(N // 2, width // 2) if silu else cdiv(N, width))


def tma_smem(rows: int) -> int:
    """Dynamic shared memory of gemm_tma.cu's builds of `rows`-row tiles."""
    return TMA_TALL_SMEM if rows == TMA_TALL else TMA_SMEM


def tma_kstep_cost(width: int, split: bool = False, rows: int = TMA_BM) -> float:
    """One k-step (64 deep) of a `rows` x `width` tile (in a split launch: `split`), in k-steps of a 128 x 128
    tile."""
    if rows == TMA_TALL:
        return TMA_TALL_COST[width]
    if width in TMA_ROUND_COST:
        return TMA_ROUND_COST[width]
    return 1.0 if width == 128 else 2 * (TMA_WIDE_SPLIT_COST if split else TMA_WIDE_COST)


def tma_width(M: int, N: int, silu: bool, sms: int = H200_SMS, persistent: bool = True) -> int:
    """gemm_tma.cu's tile width: of TMA_WIDTHS (and for the persistent kernel alone, `persistent`, below
    TMA_TAIL_SPLIT_ROWS rows, TMA_ROUND_WIDTHS), the one with the fewest (rounds of tiles per SM) x (a tile's cost),
    the first listed on a tie. At 4,096 tokens qwen3-4b's QKV and gate/up take 256 (its o_proj and down_proj
    would take 128, but tma_plan gives those products of 512 rows on tma_residual_plan). At 256 rows its gate/up
    takes 160, its QKV 96 (TMA_ROUND_WIDTHS)."""
    widths = TMA_WIDTHS + (TMA_ROUND_WIDTHS if persistent and M < TMA_TAIL_SPLIT_ROWS else ())
    return min(widths, key=lambda width: cdiv(tma_tiles(M, N, silu, width), sms) * tma_kstep_cost(width))


def tma_split_cost(K: int, width: int, split: int, rows: int = TMA_BM) -> float:
    """Estimated time of one split launch that fits in one wave: a block's share of the k-steps, its
    fill and its share of the reduction."""
    return (cdiv(cdiv(K, TMA_BK), split) * tma_kstep_cost(width, split=True, rows=rows) + TMA_SPLIT_FILL
            + TMA_SPLIT_REDUCE * split * width / 128)


@dataclass(slots=True, frozen=True)
class TmaPlan:
    """How `gemm` runs one product on gemm_tma.cu: tiles `width` wide, `split` blocks (a cluster) per tile; for
    the persistent kernel (split 1) `tail` blocks per tile of the last round's tiles, launched apart as a
    split launch when the round would leave SMs idle (1: no such launch), and `multicast`: its multicast build
    (2-block clusters on pairs of row tiles sharing their W tiles, tma_multicast)."""
    width: int
    split: int
    tail: int = 1
    multicast: bool = False
    rows: int = TMA_BM


def tma_plan(M: int, N: int, K: int, epilogue: str, sms: int, slots: dict[int, int]) -> TmaPlan:
    """The launch plan for gemm_tma.cu. Unsplit: the persistent kernel at tma_width. A split
    (KS blocks of a cluster share a tile's K range) is considered only when its whole grid is resident at
    once (tiles x KS <= slots[KS], the blocks of KS-clusters the GPU holds: cluster_slots) and it must
    beat the unsplit estimate by TMA_SPLIT_MARGIN. One wave, because the cost model does not hold past
    it: a split grid of several waves was slower than the persistent kernel. Except for the residual products
    of prefill size (TMA_RESIDUAL_SPLIT_ROWS rows on, or TMA_RESIDUAL_PLAN_ROWS where no one-wave split is
    cheaper): those split 2 ways over as many waves as it takes, or run on the persistent kernel at a round width
    (tma_residual_plan). An unsplit plan of TMA_TAIL_SPLIT_ROWS rows on may split
    its last round (tma_tail_split), and one of TMA_MULTICAST_ROWS rows on runs in 2-block clusters that share their
    W tiles (tma_multicast). Where tma_tall_rows says, the persistent kernel and the splits on 256-row tiles are
    weighed too (TMA_TALL_COST)."""
    silu = epilogue == "silu_mul"
    residual = epilogue == "residual" and bool(slots.get(2)) and cdiv(K, TMA_BK) >= TMA_SPLIT_MIN_KSTEPS * 2
    if residual and M >= TMA_RESIDUAL_SPLIT_ROWS:
        return tma_residual_plan(M, N, K, sms, slots[2])
    width = tma_width(M, N, silu, sms)
    ksteps = cdiv(K, TMA_BK)
    unsplit = cdiv(tma_tiles(M, N, silu, width), sms) * ksteps * tma_kstep_cost(width) + TMA_FILL
    tall = None   # the persistent kernel on 256-row tiles, where it is estimated cheaper
    tiles = {(TMA_BM, w): tma_tiles(M, N, silu, w) for w in TMA_WIDTHS + tuple(TMA_ROUND_SPLITS)}
    if tma_tall_rows(M):
        for w, splits in TMA_TALL_SPLITS.items():
            tiles[TMA_TALL, w] = tma_tiles(M, N, silu, w, TMA_TALL)
            cost = cdiv(tiles[TMA_TALL, w], sms) * ksteps * tma_kstep_cost(w, rows=TMA_TALL) + TMA_FILL
            if 1 in splits and cost < unsplit:
                unsplit, tall = cost, TmaPlan(w, 1, rows=TMA_TALL)
    split = tma_cheapest_split(K, tiles, slots, TMA_SPLIT_MARGIN * unsplit)
    if split is not None:
        rows, width, ks = split
        return TmaPlan(width, ks, rows=rows)
    if tall is not None:
        return tall
    if residual and M >= TMA_RESIDUAL_PLAN_ROWS:
        return tma_residual_plan(M, N, K, sms, slots[2])
    tail = tma_tail_split(tma_tiles(M, N, silu, width), K, width, sms, slots) if M >= TMA_TAIL_SPLIT_ROWS else 1
    return TmaPlan(width, 1, tail, tma_multicast(M, sms, slots))


def tma_tall_rows(M: int) -> bool:
    """Whether tma_plan weighs 256-row tiles for M rows: up to TMA_TALL_MAX_ROWS, where the last 256-row tile is
    more than half full (129-256, 385-512, 641-768, 897-1,024, 1,153-1,280, 1,409-1,536). At 320 and 384 rows (a
    last tile a quarter or half full) they were slower than the 128-row tiles in every product swept."""
    return M <= TMA_TALL_MAX_ROWS and -M % TMA_TALL < TMA_BM


def tma_multicast(M: int, sms: int, slots: dict[int, int]) -> bool:
    """Whether the persistent kernel runs its multicast build: from TMA_MULTICAST_ROWS rows on, when the row tiles
    pair up (an even number of them: the tile order's tiles 2q and 2q + 1 then share a column tile) and the GPU
    holds a whole persistent grid of 2-block clusters at once."""
    return M >= TMA_MULTICAST_ROWS and cdiv(M, TMA_BM) % 2 == 0 and slots.get(2, 0) >= sms - sms % 2


def tma_tail_split(tiles: int, K: int, width: int, sms: int, slots: dict[int, int]) -> int:
    """Blocks per tile for the persistent kernel's last round when it is partial (tiles % sms of them), run as a
    split launch after the whole rounds; 1 for none. The split whose grid fits at once (rem x split <=
    slots[split]) and that costs least, if it beats the unsplit round by TMA_SPLIT_MARGIN. On the H200 qwen3-4b's
    gate/up at 4,096 rows (2,432 wide tiles: 18 rounds and 56 tiles) splits its last round 2 ways (112 blocks);
    its QKV's last 108 tiles do not split (216 blocks > 132)."""
    rem = tiles % sms
    if tiles < sms or rem == 0:
        return 1
    split = tma_cheapest_split(K, {(TMA_BM, width): rem}, slots,
                               TMA_SPLIT_MARGIN * cdiv(K, TMA_BK) * tma_kstep_cost(width))
    return 1 if split is None else split[2]


def tma_cheapest_split(K: int, tiles: dict[tuple[int, int], int], slots: dict[int, int],
                       bound: float) -> tuple[int, int, int] | None:
    """(rows, width, split) of the split launch that costs least (tma_split_cost) and less than `bound`, over the
    tile shapes of `tiles` ((rows, width) -> the launch's tiles of that shape), among those whose grid fits at once
    (tiles x split <= slots[split]) and gives each block TMA_SPLIT_MIN_KSTEPS k-steps at least; None when none does.
    Ties go to the smaller split, then to the shape first in `tiles`."""
    best = None
    for split in TMA_SPLITS:
        if cdiv(K, TMA_BK) < TMA_SPLIT_MIN_KSTEPS * split:
            continue
        for (rows, width), n in tiles.items():
            if not tma_split_built(width, split, rows):
                continue
            if n * split <= slots.get(split, 0) and (c := tma_split_cost(K, width, split, rows)) < bound:
                best, bound = (rows, width, split), c
    return best


def tma_split_built(width: int, split: int, rows: int = TMA_BM) -> bool:
    """Whether gemm_tma.cu has a split build (`split` > 1) `width` wide of `rows`-row tiles: at TMA_WIDTHS every
    split, at a round width those of TMA_ROUND_SPLITS, 256 rows those of TMA_TALL_SPLITS."""
    if rows == TMA_TALL:
        return split in TMA_TALL_SPLITS.get(width, ())
    return width in TMA_WIDTHS or split in TMA_ROUND_SPLITS.get(width, ())


def tma_residual_plan(M: int, N: int, K: int, sms: int, slots2: int) -> TmaPlan:
    """A prefill-sized residual product's plan: split 2 ways at tma_residual_width, over as many waves of 2-block
    clusters as that takes, unless the persistent kernel at the round width whose rounds cost least is cheaper:
    the split must beat it by TMA_SPLIT_MARGIN, each in (waves or rounds) x (a block's k-steps) x (a k-step's
    cost), fills and reductions left out. On an H100 the persistent kernel ran 160 wide at 0.43-0.50 us a unit
    of that cost, the split 256 wide at 0.50-0.60. qwen3-4b's o_proj at 4,096 rows: 4 rounds of 512 tiles 160
    wide, 4 x 64 x 1.25 = 320, against 5 waves of 640 blocks, 5 x 32 x 1.84 = 294 (> 0.9 x 320): 160 wide.
    qwen3-8b's (N = 4,096, 26 tiles of 160 with a partial one): 7 x 64 x 1.25 = 560 against 8 x 32 x 1.84 = 471:
    split. A product of more than TMA_RESIDUAL_ROUND_MAX_MACS multiply-adds always splits."""
    width = tma_residual_width(M, N, slots2)
    if M * N * K > TMA_RESIDUAL_ROUND_MAX_MACS:
        return TmaPlan(width, 2)
    ksteps = cdiv(K, TMA_BK)
    split = cdiv(tma_tiles(M, N, False, width) * 2, slots2) * cdiv(ksteps, 2) * tma_kstep_cost(width)
    rounds = {w: cdiv(tma_tiles(M, N, False, w), sms) * tma_kstep_cost(w) for w in TMA_ROUND_WIDTHS}
    round_width = min(rounds, key=rounds.get)
    if split < TMA_SPLIT_MARGIN * rounds[round_width] * ksteps:
        return TmaPlan(width, 2)
    return TmaPlan(round_width, 1)


def tma_residual_width(M: int, N: int, slots2: int) -> int:
    """The tile width of a prefill-sized residual product split 2 ways: the fewer (waves of slots2 blocks) x
    (a k-step's cost), 256 on a tie. On the H200 (slots2 = 132) qwen3-4b's o_proj and down_proj at 4,096 rows
    take wide tiles (640 blocks: 5 waves x 1.84 = 9.2 against 1,280 narrow blocks' 10 waves), at 1,024 rows narrow
    ones (3 waves against 2 x 1.84)."""
    return min(TMA_WIDTHS, key=lambda w: cdiv(tma_tiles(M, N, False, w) * 2, slots2) * tma_kstep_cost(w))


def tma_kernel_name(width: int, split: int, epilogue: str, multicast: bool = False, rows: int = TMA_BM) -> str:
    """gemm_tma.cu's build: gemm_tma[_n{width}][_s{split} | _mc]_e{epilogue} (no _n for 256; TMA_ROUND_WIDTHS:
    the persistent kernel, and the splits of TMA_ROUND_SPLITS); tiles of TMA_TALL rows
    gemm_tma_m256_n{width}[_s{split}]_e{epilogue} (TMA_TALL_SPLITS)."""
    if rows == TMA_TALL:
        if multicast or split not in TMA_TALL_SPLITS.get(width, ()):
            raise ValueError(f"gemm_tma.cu has no {rows}-row build {width} wide "
                             f"{'multicast' if multicast else f'split {split} ways'} (those built: {TMA_TALL_SPLITS})")
        return f"gemm_tma_m{rows}_n{width}{f'_s{split}' if split > 1 else ''}_e{EPILOGUES[epilogue]}"
    if rows != TMA_BM:
        raise ValueError(f"gemm_tma.cu's tiles are {TMA_BM} or {TMA_TALL} rows, got {rows}")
    if width in TMA_ROUND_WIDTHS and (multicast or (split > 1 and not tma_split_built(width, split))):
        raise ValueError(f"gemm_tma.cu has no {'multicast' if multicast else f'{split}-way split'} build {width} "
                         f"wide (multicast: {TMA_WIDTHS}; splits: {TMA_WIDTHS} and {TMA_ROUND_SPLITS})")
    build = f"_s{split}" if split > 1 else "_mc" if multicast else ""
    return f"gemm_tma{'' if width == 256 else f'_n{width}'}{build}_e{EPILOGUES[epilogue]}"
