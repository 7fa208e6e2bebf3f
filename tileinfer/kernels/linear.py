"""Launchers for cuda_src/gemm_tma.cu (wgmma tensor cores fed by TMA: prefill, and batches of 65 rows or
more), cuda_src/gemv.cu (decode, 1-2 rows) and cuda_src/gemm_swap.cu (swap-AB wgmma weight streaming:
batches of 3-64 rows, verify steps included).

`linear` computes y = x W^T for x [M, K] bf16 and W [N, K] bf16 with a fused epilogue:
  "bf16"      out [M, N] bf16
  "residual"  out [M, N] float32, out += x W^T (the residual stream)
  "silu_mul"  W is [gate; up] ([2I, K]); out [M, I] bf16 = silu(x gate^T) * (x up^T)
  "f32"       out [M, N] float32 (logits)
Which kernel (`default_path`), from scripts/bench_gemm_small.py and A/B runs on the H200:
  - M in (1, 2): the bandwidth-bound GEMV.
  - 3 <= M <= 64: the swap-AB GEMM (every weight byte read once for all rows; swap_config).
    At 9-64 rows against the small tensor-core GEMM it replaced (engine tok/s in total, session 10):
    qwen3-0.6b batch 16 10,747 -> 11,395, batch 64 26,409 -> 28,028; qwen3-4b batch 16 4,119 -> 4,455,
    batch 32 7,081 -> 7,742, batch 64 10,449 -> 12,168.
    At 3-8 rows it beat the tensor-core GEMV and the small GEMM (both since deleted) on every layer
    matrix of qwen3-4b and qwen3-8b at M = 5 and 8 (session 11, us per call at M = 5, swap / tensor-core
    GEMV / small GEMM): qwen3-8b QKV 14.0 / 16.3 / 17.2, o_proj 11.7 / 14.7 / 17.2, gate/up 51.2 / 59.8 /
    56.0, down_proj 27.2 / 34.3 / 41.2; qwen3-4b o_proj 7.6 / 11.5 / 10.0, down_proj 15.9 / 24.8 / 17.2.
    In the engine: batch 8 qwen3-0.6b 6,428 -> 6,602 tok/s, qwen3-4b 2,236 -> 2,439, qwen3-8b
    1,166 -> 1,567; the qwen3-8b k = 4 verify step 5.45 -> 4.91 ms of GPU time.
  - Everything else takes gemm_tma.cu, split along K by a cluster of blocks when its tiles are too few
    for the SMs (tma_plan). Against the small GEMM and the unsplit kernel (session 10): qwen3-4b
    batch 128 14,972 -> 18,671, batch 256 18,101 -> 22,012; qwen3-0.6b batch 128 32,873 -> 34,085,
    batch 256 42,544 -> 42,616.
"""
from dataclasses import dataclass

from ..cuda import F32, I32, DeviceArray, get_device, kernel
from ..cuda.tensormap import bf16_tensor_map
from ._check import BF16, FLOAT32, UINT64, cdiv, expect
from .rmsnorm import rmsnorm

EPILOGUES = {"bf16": 0, "residual": 1, "silu_mul": 2, "f32": 3}
GEMV_ROWS = (1, 2, 4, 8)
TMA_BM = 128
TMA_BK = 64
TMA_WIDTHS = (256, 128)  # gemm_tma.cu: gemm_tma_e* and gemm_tma_n128_e*
TMA_WIDE_COST = 0.92  # a 128 x 256 tile's time over two 128 x 128 tiles': an estimate, not fitted
TMA_THREADS = 384
TMA_SMEM = 192 * 1024 + 256 + 1024  # as gemm_tma.cu's SMEM_BYTES: the stage ring, mbarriers, alignment
TMA_SPLITS = (2, 3, 4)  # gemm_tma_s{KS}_e*, gemm_tma_n128_s{KS}_e*: KS blocks (a cluster) per output tile
GEMV_WARPS = 8

# gemm_swap.cu: blocks of 64 W rows (one warpgroup) against the whole batch padded to B rows, k-chunks of
# 64, `ksplit` blocks per cluster splitting K; STAGES chunks in flight (Cfg<B, 1>::STAGES).
SWAP_BATCHES = (16, 32, 64)
SWAP_TILE = 64
SWAP_BK = 64
SWAP_SPLITS = (1, 2, 4, 8)
SWAP_STAGES = {16: 10, 32: 8, 64: 6}
# The deep B = 16 builds (gemm_swap_b16d_*, DEEP_STAGES stages, one block an SM): for grids of at most one
# block an SM whose blocks stream at least DEEP_STAGES k-chunks each (on the H200 they made qwen3-8b's verify
# step 1.7% faster; on qwen3-0.6b's short rows, 2-8 chunks a block, every batch of 4-16 20% slower).
SWAP_DEEP_STAGES = 20
SWAP_WAVE = 0.9  # swap_config: the fewest splits whose grid reaches this fraction of the SMs
NORM_MAX_TILES = 96  # gemm_swap.cu: 32 * SS_LOADS, row_norm's partials a row

GEMV_DEFAULT_ROWS = (1, 2)  # M the GEMV takes by default; 4 and 8 only when forced (tests, benchmarks)
SWAP_DEFAULT_ROWS = range(3, 65)  # M the swap-AB GEMM takes by default; the TMA GEMM takes the rest


def default_path(M: int, N: int) -> str:
    """The kernel `linear` runs for an [M, K] x [N, K]^T product (see the module docstring)."""
    if M in GEMV_DEFAULT_ROWS:
        return "gemv"
    if M in SWAP_DEFAULT_ROWS:
        return "swap"
    return "gemm"


def _out_spec(epilogue: str, M: int, N: int):
    if epilogue == "silu_mul":
        if N % 2:
            raise ValueError(f"linear silu_mul: W must stack [gate; up], got an odd N={N}")
        return (M, N // 2), BF16
    return (M, N), (BF16 if epilogue == "bf16" else FLOAT32)


def gemv_ksplit(pairs: int, K: int, target_warps: int = 4 * 132 * GEMV_WARPS, segment: int = 512) -> int:
    """Warps per row pair of gemv.cu: the most (1, 2, 4 or 8) that keep the grid within one wave of ~4
    blocks per SM on an H200, while each warp still streams at least two `segment`-element pieces of its
    rows.

    One wave, not the first split past it: a second, partial wave of warps leaves most SMs idle at the
    kernel's end. Measured on the H200 (bench.py batch 1, GPU ms per step, against doubling until the
    grid passed one wave): qwen3-0.6b 0.729 -> 0.697, qwen3-4b 2.863 -> 2.795, qwen3-8b 4.437 -> 4.405;
    engine qwen3-4b batch 4 1,124 -> 1,196 tok/s, batch 8 2,090 -> 2,221."""
    ksplit = 1
    while ksplit < 8 and pairs * ksplit * 2 <= target_warps and K >= segment * ksplit * 2:
        ksplit *= 2
    return ksplit


def head_key_count(N: int, K: int) -> int:
    """Blocks of the batch-1 LM head GEMV ([N, K] weights): the keys linear(head_keys=) writes."""
    pairs = cdiv(N, 2)
    return cdiv(pairs * gemv_ksplit(pairs, K), GEMV_WARPS)


PIPE_EPILOGUES = ("residual", "f32")  # gemv_pipe_m1_*: o_proj, down_proj and the LM head
PIPE_MIN_SEGMENTS = 4


def gemv_pipe(M: int, K: int, ksplit: int, epilogue: str) -> bool:
    """Whether the batch-1 GEMV runs its software-pipelined loop (gemv.cu, PIPE): for the products with
    no norm before them, when each warp streams at least PIPE_MIN_SEGMENTS 256-element segments of its
    rows. Measured on the H200 (bench.py --ablate, in-graph us, one loop against the other):
    o_proj + down_proj qwen3-4b 800 -> 757, qwen3-8b 1,295 -> 1,214, qwen3-0.6b (2-3 segments a warp)
    108 -> 125; LM head 0.6b 71.1 -> 70.1, 4b 173.9 -> 171.3, 8b 283.7 -> 275.2. On the products after
    a norm (QKV, gate/up) it was slower or no faster, so those keep one loop."""
    return M == 1 and epilogue in PIPE_EPILOGUES and K // (256 * ksplit) >= PIPE_MIN_SEGMENTS


def tma_tiles(M: int, N: int, silu: bool, width: int) -> int:
    """gemm_tma.cu's output tiles: 128 rows x `width` columns of W (width / 2 outputs for SiLU)."""
    return cdiv(M, TMA_BM) * (cdiv(N // 2, width // 2) if silu else cdiv(N, width))


def tma_kstep_cost(width: int) -> float:
    """One k-step (64 deep) of a 128 x `width` tile, in k-steps of a 128 x 128 tile."""
    return 2 * TMA_WIDE_COST if width == 256 else 1.0


def tma_width(M: int, N: int, silu: bool, sms: int = 132) -> int:
    """gemm_tma.cu's tile width: 256 or 128, whichever gives fewer (rounds of tiles per SM) x (a tile's
    cost), 256 on a tie. At 4,096 tokens qwen3-4b's QKV and gate/up take 256; its o_proj and down_proj
    (N = 2560: 320 wide tiles are 2.4 rounds on 132 SMs, 640 narrow ones 4.85) take 128."""
    return min(TMA_WIDTHS, key=lambda width: cdiv(tma_tiles(M, N, silu, width), sms) * tma_kstep_cost(width))


# tma_plan's cost model, in k-steps (64 deep) of a 128 x 128 tile at the full per-SM rate: a split block's
# fixed cost (its first TMA loads, the epilogue), and its cluster reduction per rank and 128 columns (the
# persistent kernel hides its fills behind the previous tile). Estimates, not fitted; a split must beat
# the unsplit launch by TMA_SPLIT_MARGIN.
TMA_SPLIT_FILL = 3.0
TMA_SPLIT_REDUCE = 0.5
TMA_SPLIT_MARGIN = 0.9
TMA_SPLIT_MIN_KSTEPS = 2  # k-steps each block of a split gets at least


def tma_split_cost(K: int, width: int, split: int) -> float:
    """Estimated time of one split launch that fits in one wave: a block's share of the k-steps, its
    fill and its share of the reduction."""
    return (cdiv(cdiv(K, TMA_BK), split) * tma_kstep_cost(width) + TMA_SPLIT_FILL
            + TMA_SPLIT_REDUCE * split * width / 128)


def tma_plan(M: int, N: int, K: int, silu: bool, sms: int, slots: dict[int, int]) -> tuple[int, int]:
    """(tile width, blocks per tile) for gemm_tma.cu. Unsplit: the persistent kernel at tma_width. A split
    (KS blocks of a cluster share a tile's K range) is considered only when its whole grid is resident at
    once (tiles x KS <= slots[KS], the blocks of KS-clusters the GPU holds: cluster_slots) and it must
    beat the unsplit estimate by TMA_SPLIT_MARGIN. One wave, because the model did not hold past it: at
    M = 512 a split of qwen3-4b's down_proj into 320 blocks (3 waves of 4-block clusters) took 80 us
    where the persistent kernel took ~63 (H200, session 10); within one wave the splits won (prefill
    of 256 tokens 209 -> 254 TFLOP/s; batch 256 decode above)."""
    width = tma_width(M, N, silu, sms)
    best = (cdiv(tma_tiles(M, N, silu, width), sms) * cdiv(K, TMA_BK) * tma_kstep_cost(width) + TMA_SPLIT_FILL,
            width, 1)
    unsplit = best[0]
    for split in TMA_SPLITS:
        if cdiv(K, TMA_BK) < TMA_SPLIT_MIN_KSTEPS * split:
            continue
        for w in TMA_WIDTHS:
            if tma_tiles(M, N, silu, w) * split <= slots.get(split, 0):
                c = tma_split_cost(K, w, split)
                if c < TMA_SPLIT_MARGIN * unsplit and c < best[0]:
                    best = (c, w, split)
    return best[1], best[2]


_cluster_slots: dict[int, int] = {}


def cluster_slots() -> dict[int, int]:
    """Blocks of gemm_tma.cu's split kernels resident at once, by split: the driver's count of clusters
    that fit (one block per SM; a cluster's blocks share a GPC) times the split. The H200 said
    {2: 132, 3: 117, 4: 120} (session 10)."""
    if not _cluster_slots:
        for split in TMA_SPLITS:
            k = kernel("gemm_tma.cu", f"gemm_tma_n128_s{split}_e0")
            _cluster_slots[split] = k.max_active_clusters(split, TMA_THREADS, TMA_SMEM) * split
    return _cluster_slots


def gemm(x: DeviceArray, w: DeviceArray, out: DeviceArray, epilogue: str, stream, *, width: int | None = None,
         split: int | None = None, blocks: int | None = None) -> None:
    """The "gemm" path of `linear` (shapes already checked): gemm_tma.cu, fed by TMA through tensor maps
    of x and w. Unsplit it is persistent, one block per SM walking its tiles; `width` (128 or 256)
    forces its tile width, `blocks` caps its grid (tests: many tiles a block). `split` (2-4 blocks per
    tile, a cluster summing its partial tiles in rank order) forces a split, 1 forbids one; by default
    tma_plan decides."""
    M, K = x.shape
    N = w.shape[0]
    if M == 0:
        return
    epi = EPILOGUES[epilogue]
    silu = epilogue == "silu_mul"
    sms = get_device().info.num_sms
    if split not in (None, 1) + TMA_SPLITS:
        raise ValueError(f"gemm: split must be 1 or one of {TMA_SPLITS}, got {split}")
    if width not in (None,) + TMA_WIDTHS:
        raise ValueError(f"gemm: width must be one of {TMA_WIDTHS}, got {width}")
    if split is None and width is None and blocks is None:
        width, split = tma_plan(M, N, K, silu, sms, cluster_slots())
    width = width or tma_width(M, N, silu, sms)
    split = split or 1
    if split > 1 and blocks is not None:
        raise ValueError("gemm: `blocks` caps the persistent (unsplit) kernel only")
    tiles = tma_tiles(M, N, silu, width)
    grid = min(tiles, blocks or sms) if split == 1 else tiles * split
    name = f"gemm_tma{'_n128' if width == 128 else ''}{f'_s{split}' if split > 1 else ''}_e{epi}"
    kernel("gemm_tma.cu", name).launch(
        (grid,), (TMA_THREADS,),
        [x, w, out, I32(M), I32(N), I32(K), bf16_tensor_map(x.ptr, M, K, TMA_BM),
         bf16_tensor_map(w.ptr, N, K, width // 2)], stream, smem=TMA_SMEM)


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


def swap_config(M: int, N: int, K: int, epilogue: str, *, ksplit: int | None = None, sms: int = 132) -> SwapConfig:
    """The gemm_swap.cu launch for x [M, K] @ W [N, K]^T, M <= 64. Blocks per cluster: the fewest
    (1, 2, 4, 8) whose grid reaches SWAP_WAVE of the SMs, while each block keeps two k-chunks. Fitted to
    the H200 sweep of qwen3-0.6b's and qwen3-4b's layer matrices at M = 16 and 64 (session 10, us per
    call, one warpgroup a block): the rule's choice was the fastest split in 14 of 16 cases; at M = 16
    qwen3-0.6b's o_proj took 3.9 us (split 8) against 3.7 (split 4), its gate/up 5.8 (2) against 5.3 (1); e.g.
    qwen3-4b at M = 16: QKV 9.7 (the small GEMM 11.9), o_proj 7.9 (10.0), gate/up 30.8 (36.0),
    down_proj 16.3 (18.1). `ksplit` overrides."""
    if not 0 <= M <= SWAP_BATCHES[-1]:
        raise ValueError(f"swap_config: the swap-AB GEMM takes 0 <= M <= {SWAP_BATCHES[-1]} rows, got M={M}")
    B = next(b for b in SWAP_BATCHES if M <= b)
    tiles = cdiv(N // 2, SWAP_TILE // 2) if epilogue == "silu_mul" else cdiv(N, SWAP_TILE)
    if tiles > 65535:
        raise ValueError(f"swap_config: N={N} needs {tiles} tiles, more than grid.y allows (65535)")
    if ksplit is None:
        chunks = cdiv(K, SWAP_BK)
        ksplit = next((ks for ks in SWAP_SPLITS if tiles * ks >= SWAP_WAVE * sms), SWAP_SPLITS[-1])
        while ksplit > 1 and chunks < 2 * ksplit:
            ksplit //= 2
    elif ksplit not in SWAP_SPLITS:
        raise ValueError(f"swap_config: ksplit must be one of {SWAP_SPLITS}, got {ksplit}")
    deep = B == 16 and tiles * ksplit <= sms and cdiv(K, SWAP_BK) >= SWAP_DEEP_STAGES * ksplit
    stages = SWAP_DEEP_STAGES if deep else SWAP_STAGES[B]
    smem = stages * (SWAP_TILE + B) * SWAP_BK * 2 + 1024  # Cfg<B, 1, deep>::SMEM: the stages + alignment
    return SwapConfig(B, ksplit, (ksplit, tiles), smem, deep)


def linear(x: DeviceArray, w: DeviceArray, out: DeviceArray, epilogue: str, stream, *, force: str | None = None,
           ksplit: int | None = None, pipe: bool | None = None, head_keys: DeviceArray | None = None,
           norm_out: tuple[DeviceArray, DeviceArray, DeviceArray] | None = None,
           row_norm: tuple[DeviceArray, float] | None = None) -> None:
    """out <- epilogue(x @ w.T). `force` ("gemm", "gemv" or "swap") and `ksplit` override the choices: for
    the GEMV the warps per row pair, for the swap-AB GEMM the blocks per cluster splitting K (1, 2, 4 or
    8); `pipe` the batch-1 GEMV's loop (gemv_pipe). head_keys (the LM head at batch 1: one row, the f32
    epilogue, the GEMV): also each block's largest logit as a key, in head_keys[:blocks]
    with blocks = head_key_count(N, K) (gemv.cu, ARGMAX), for sample().

    Norm statistics, swap-AB path only (gemm_swap.cu's header): norm_out = (next_w [N] bf16, next_x [M, N]
    bf16, ss [M, norm_tiles(N)] float32) with the residual epilogue also writes next_x = bf16(out * next_w)
    and each row's sums of squares a tile; row_norm = (ss [M, norm_tiles(K)], eps), with x = such a
    next_x, scales row m of the result by 1 / sqrt(sum(ss[m]) / K + eps) before the epilogue."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"linear: unknown epilogue {epilogue!r}; choose one of {', '.join(EPILOGUES)}")
    M, K = x.shape
    N = w.shape[0]
    expect("x", x, (M, K), BF16)
    expect("w", w, (N, K), BF16)
    shape, dtype = _out_spec(epilogue, M, N)
    expect("out", out, shape, dtype)
    if K % 8 or N % 8:
        raise ValueError(f"linear: K and N must be multiples of 8 (16-byte rows), got K={K}, N={N}")
    path = force or default_path(M, N)
    epi = EPILOGUES[epilogue]
    if (norm_out is not None or row_norm is not None) and path != "swap":
        raise ValueError(f"linear: norm_out and row_norm need the swap-AB path (3-64 rows), got the {path!r} path")
    if norm_out is not None and row_norm is not None:
        raise ValueError("linear: one product either writes the norm statistics (norm_out) or applies them "
                         "(row_norm), not both")
    if path == "gemv":
        if M not in GEMV_ROWS:
            raise ValueError(f"linear: the GEMV handles M in {GEMV_ROWS}, got M={M}")
        pairs = N // 2 if epilogue == "silu_mul" else cdiv(N, 2)
        ksplit = ksplit or gemv_ksplit(pairs, K)
        if ksplit not in (1, 2, 4, 8):
            raise ValueError(f"linear: ksplit must be 1, 2, 4 or 8, got {ksplit}")
        if pipe is None:
            pipe = gemv_pipe(M, K, ksplit, epilogue)
        elif pipe and not (M == 1 and epilogue in PIPE_EPILOGUES):
            raise ValueError(f"linear: the pipelined GEMV takes M = 1 and the {' or '.join(PIPE_EPILOGUES)} "
                             f"epilogue, got M={M}, {epilogue!r}")
        grid = (cdiv(pairs * ksplit, GEMV_WARPS),)
        if head_keys is not None:
            if M != 1 or epilogue != "f32":
                raise ValueError(f"linear: head_keys need one row and the f32 epilogue, got M={M}, {epilogue!r}")
            expect("head_keys", head_keys, grid, UINT64)
            kernel("gemv.cu", f"gemv_{'pipe_' if pipe else ''}argmax_m1_e3").launch(
                grid, (GEMV_WARPS * 32,), [x, w, out, I32(N), I32(K), I32(ksplit), head_keys], stream)
            return
        kernel("gemv.cu", f"gemv_{'pipe_' if pipe else ''}m{M}_e{epi}").launch(
            grid, (GEMV_WARPS * 32,), [x, w, out, I32(N), I32(K), I32(ksplit)], stream)
    elif head_keys is not None:
        raise ValueError(f"linear: head_keys need the GEMV, got the {path!r} path")
    elif path == "gemm":
        # Forced (the batch-invariant mode forces every product here): one tile width and no split whatever
        # M is, so that a row's sums never depend on the rows beside it.
        if force:
            gemm(x, w, out, epilogue, stream, width=TMA_WIDTHS[0], split=1)
        else:
            gemm(x, w, out, epilogue, stream)
    elif path == "swap":
        cfg = swap_config(M, N, K, epilogue, ksplit=ksplit, sms=get_device().info.num_sms)
        args, name = [x, w, out, I32(M), I32(N), I32(K), I32(epi)], cfg.kernel_name
        if norm_out is not None:  # the producer build
            if epilogue != "residual":
                raise ValueError(f"linear: norm_out needs the residual epilogue, got {epilogue!r}")
            next_w, next_x, ss_out = norm_out
            expect("next_w", next_w, (N,), BF16)
            expect("next_x", next_x, (M, N), BF16)
            expect("ss (norm_out)", ss_out, (M, norm_tiles(N)), FLOAT32)
            args, name = args + [next_w, next_x, ss_out], name + "_np"
        elif row_norm is not None:  # the consumer build
            ss_in, eps = row_norm
            ss_tiles = norm_tiles(K)
            expect("ss (row_norm)", ss_in, (M, ss_tiles), FLOAT32)
            if ss_tiles > NORM_MAX_TILES:
                raise ValueError(f"linear: row_norm sums at most {NORM_MAX_TILES} partials a row "
                                 f"(K <= {NORM_MAX_TILES * SWAP_TILE}), got K={K}")
            args, name = args + [ss_in, I32(ss_tiles), F32(eps)], name + "_nc"
        if M == 0:
            return
        kernel("gemm_swap.cu", name).launch(cfg.grid, (128,), args, stream, smem=cfg.smem)
    else:
        raise ValueError(f"linear: force must be 'gemm', 'gemv' or 'swap', got {force!r}")


NORM_EPILOGUES = ("bf16", "silu_mul")  # the products that follow a norm: QKV and gate/up


NORM_SHORT_K = 1024  # QKV rows this short take the 64-register build (gemv.cu, GEMV_NORM_KERNEL)


def norm_kernel_name(M: int, K: int, epilogue: str) -> str:
    """The gemv_norm_* kernel of a fused norm + product: batch-1 QKV over rows of at most NORM_SHORT_K
    takes the build capped at 64 registers (measured faster for qwen3-0.6b, slower for 4b and 8b)."""
    name = f"gemv_norm_m{M}_e{EPILOGUES[epilogue]}"
    return name + "_b4" if M == 1 and epilogue == "bf16" and K <= NORM_SHORT_K else name


def norm_linear(resid: DeviceArray, norm_w: DeviceArray, eps: float, x: DeviceArray, w: DeviceArray,
                out: DeviceArray, epilogue: str, stream, *, force: str | None = None) -> None:
    """out <- epilogue(rmsnorm(resid) * norm_w @ w.T), resid [M, K] float32: a product that follows a
    norm. On the GEMV path at 1-2 rows (QKV, gate/up) each block normalizes the rows
    itself (cuda_src/gemv.cu, gemv_norm_*: bitwise what the rmsnorm kernel would write) and `x` is
    left as it was; otherwise the rmsnorm kernel writes x [M, K] bf16 and `linear` runs."""
    M, K = resid.shape
    path = force or default_path(M, w.shape[0])
    if not (path == "gemv" and M in GEMV_DEFAULT_ROWS and epilogue in NORM_EPILOGUES):
        rmsnorm(resid, norm_w, x, eps, stream)
        linear(x, w, out, epilogue, stream, force=force)
        return
    N = w.shape[0]
    expect("resid", resid, (M, K), FLOAT32)
    expect("norm_w", norm_w, (K,), BF16)
    expect("w", w, (N, K), BF16)
    shape, dtype = _out_spec(epilogue, M, N)
    expect("out", out, shape, dtype)
    if K % 8 or N % 8:
        raise ValueError(f"norm_linear: K and N must be multiples of 8 (16-byte rows), got K={K}, N={N}")
    pairs = N // 2 if epilogue == "silu_mul" else cdiv(N, 2)
    ksplit = gemv_ksplit(pairs, K)
    kernel("gemv.cu", norm_kernel_name(M, K, epilogue)).launch(
        (cdiv(pairs * ksplit, GEMV_WARPS),), (GEMV_WARPS * 32,),
        [resid, norm_w, F32(eps), w, out, I32(N), I32(K), I32(ksplit)], stream, smem=M * K * 2)

