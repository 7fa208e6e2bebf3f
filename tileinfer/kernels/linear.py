"""Launchers for cuda_src/gemv.cu (decode, 1-2 rows), cuda_src/gemm_swap.cu (swap-AB wgmma weight
streaming: batches of 3-64 rows, verify steps included) and cuda_src/gemm_tma.cu (wgmma tensor cores fed
by TMA: prefill, and batches of 65 rows or more).

`linear` computes y = x W^T for x [M, K] bf16 and W [N, K] bf16 with a fused epilogue:
  "bf16"      out [M, N] bf16
  "residual"  out [M, N] float32, out += x W^T (the residual stream)
  "silu_mul"  W is [gate; up] ([2I, K]); out [M, I] bf16 = silu(x gate^T) * (x up^T)
  "f32"       out [M, N] float32 (logits)
`norm_linear` is the same product after an RMSNorm of the float32 residual stream.

Which kernel (`default_path`; chosen from scripts/bench_gemm_small.py and engine runs on the H200,
figures in docs/benchmarks.md):
  - M in (1, 2): the bandwidth-bound GEMV; after a norm, the GEMV that normalizes its own input.
  - 3 <= M <= 64: the swap-AB GEMM, every weight byte read once for all rows (swap_config).
  - Everything else: gemm_tma.cu, split along K by a cluster of blocks when its tiles are too few for the
    SMs (tma_plan).

The module reads in three stages: routing (which kernel and build, pure functions of the shapes),
validation (the arguments' shapes and dtypes), launch.
"""
from dataclasses import dataclass

from ..cuda import F32, I32, DeviceArray, get_device, kernel
from ..cuda.tensormap import bf16_tensor_map
from ._check import BF16, FLOAT32, UINT64, cdiv, expect
from .rmsnorm import rmsnorm

# ============================================================================= routing
# The kernels' own sizes: tests/test_linear_routing.py compiles each .cu with static_asserts against them.
EPILOGUES = {"bf16": 0, "residual": 1, "silu_mul": 2, "f32": 3}  # enum Epilogue of the three .cu files
PATHS = ("gemv", "swap", "gemm")
H200_SMS = 132

# gemv.cu: GEMV_WARPS warps a block, each owning a pair of W rows (or warps sharing one: ksplit); a warp
# reads GEMV_SEGMENT elements of a row per 16-byte load across its lanes.
GEMV_WARPS = 8
GEMV_SEGMENT = 256
GEMV_ROWS = (1, 2, 4, 8)  # the gemv_m{M}_* builds
GEMV_SPLITS = (1, 2, 4, 8)
GEMV_DEFAULT_ROWS = (1, 2)  # M the GEMV takes by default; 4 and 8 only when forced (tests, benchmarks)
PIPE_EPILOGUES = ("residual", "f32")  # gemv_pipe_m1_*: o_proj, down_proj and the LM head
PIPE_MIN_SEGMENTS = 4
NORM_EPILOGUES = ("bf16", "silu_mul")  # the gemv_norm_* builds: the products after a norm (QKV, gate/up)
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
SWAP_DEFAULT_ROWS = range(3, 65)  # M the swap-AB GEMM takes by default; the TMA GEMM takes the rest
NORM_MAX_TILES = 96  # gemm_swap.cu: 32 * SS_LOADS, row_norm's partials a row

# gemm_tma.cu: 128-row tiles, k-steps of 64, one block per SM (SMEM_BYTES), 128 or 256 W rows a tile.
TMA_BM = 128
TMA_BK = 64
TMA_THREADS = 384
TMA_SMEM = 192 * 1024 + 256 + 1024  # SMEM_BYTES: the stage ring, mbarriers, alignment
TMA_WIDTHS = (256, 128)  # gemm_tma_e* and gemm_tma_n128_e*
TMA_SPLITS = (2, 3, 4)  # gemm_tma_s{KS}_e*, gemm_tma_n128_s{KS}_e*: KS blocks (a cluster) per output tile
TMA_WIDE_COST = 0.92  # a 128 x 256 tile's time over two 128 x 128 tiles': an estimate, not fitted
# tma_plan's cost model, in k-steps (64 deep) of a 128 x 128 tile at the full per-SM rate: a split block's
# fixed cost (its first TMA loads, the epilogue), and its cluster reduction per rank and 128 columns (the
# persistent kernel hides its fills behind the previous tile). Estimates, not fitted; a split must beat
# the unsplit launch by TMA_SPLIT_MARGIN.
TMA_SPLIT_FILL = 3.0
TMA_SPLIT_REDUCE = 0.5
TMA_SPLIT_MARGIN = 0.9
TMA_SPLIT_MIN_KSTEPS = 2  # k-steps each block of a split gets at least


def default_path(M: int, N: int) -> str:
    """The kernel `linear` runs for an [M, K] x [N, K]^T product (see the module docstring)."""
    if M in GEMV_DEFAULT_ROWS:
        return "gemv"
    if M in SWAP_DEFAULT_ROWS:
        return "swap"
    return "gemm"


def fuses_norm(path: str, M: int, epilogue: str) -> bool:
    """Whether norm_linear runs one gemv_norm_* launch (the GEMV normalizing its own rows) instead of the
    rmsnorm kernel and then `linear`."""
    return path == "gemv" and M in GEMV_DEFAULT_ROWS and epilogue in NORM_EPILOGUES


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


def tma_tiles(M: int, N: int, silu: bool, width: int) -> int:
    """gemm_tma.cu's output tiles: 128 rows x `width` columns of W (width / 2 outputs for SiLU)."""
    return cdiv(M, TMA_BM) * (cdiv(N // 2, width // 2) if silu else cdiv(N, width))


def tma_kstep_cost(width: int) -> float:
    """One k-step (64 deep) of a 128 x `width` tile, in k-steps of a 128 x 128 tile."""
    return 2 * TMA_WIDE_COST if width == 256 else 1.0


def tma_width(M: int, N: int, silu: bool, sms: int = H200_SMS) -> int:
    """gemm_tma.cu's tile width: 256 or 128, whichever gives fewer (rounds of tiles per SM) x (a tile's
    cost), 256 on a tie. At 4,096 tokens qwen3-4b's QKV and gate/up take 256; its o_proj and down_proj
    (N = 2560: 320 wide tiles are 2.4 rounds on 132 SMs, 640 narrow ones 4.85) take 128."""
    return min(TMA_WIDTHS, key=lambda width: cdiv(tma_tiles(M, N, silu, width), sms) * tma_kstep_cost(width))


def tma_split_cost(K: int, width: int, split: int) -> float:
    """Estimated time of one split launch that fits in one wave: a block's share of the k-steps, its
    fill and its share of the reduction."""
    return (cdiv(cdiv(K, TMA_BK), split) * tma_kstep_cost(width) + TMA_SPLIT_FILL
            + TMA_SPLIT_REDUCE * split * width / 128)


def tma_plan(M: int, N: int, K: int, silu: bool, sms: int, slots: dict[int, int]) -> tuple[int, int]:
    """(tile width, blocks per tile) for gemm_tma.cu. Unsplit: the persistent kernel at tma_width. A split
    (KS blocks of a cluster share a tile's K range) is considered only when its whole grid is resident at
    once (tiles x KS <= slots[KS], the blocks of KS-clusters the GPU holds: cluster_slots) and it must
    beat the unsplit estimate by TMA_SPLIT_MARGIN. One wave, because the cost model does not hold past
    it: a split grid of several waves was slower than the persistent kernel."""
    width = tma_width(M, N, silu, sms)
    unsplit = cdiv(tma_tiles(M, N, silu, width), sms) * cdiv(K, TMA_BK) * tma_kstep_cost(width) + TMA_SPLIT_FILL
    best = (unsplit, width, 1)
    for split in TMA_SPLITS:
        if cdiv(K, TMA_BK) < TMA_SPLIT_MIN_KSTEPS * split:
            continue
        for w in TMA_WIDTHS:
            if tma_tiles(M, N, silu, w) * split <= slots.get(split, 0):
                c = tma_split_cost(K, w, split)
                if c < TMA_SPLIT_MARGIN * unsplit and c < best[0]:
                    best = (c, w, split)
    return best[1], best[2]


def tma_kernel_name(width: int, split: int, epilogue: str) -> str:
    """gemm_tma.cu's build: gemm_tma[_n128][_s{split}]_e{epilogue}."""
    return f"gemm_tma{'_n128' if width == 128 else ''}{f'_s{split}' if split > 1 else ''}_e{EPILOGUES[epilogue]}"


# ============================================================================= validation
def out_spec(epilogue: str, M: int, N: int):
    """(shape, dtype) of the product's output."""
    if epilogue == "silu_mul":
        if N % 2:
            raise ValueError(f"linear silu_mul: W must stack [gate; up], got an odd N={N}")
        return (M, N // 2), BF16
    return (M, N), (BF16 if epilogue == "bf16" else FLOAT32)


def check_product(fn: str, M: int, K: int, w: DeviceArray, out: DeviceArray, epilogue: str) -> int:
    """Checks W [N, K] bf16, `out` for the epilogue and the 16-byte rows; returns N."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"{fn}: unknown epilogue {epilogue!r}; choose one of {', '.join(EPILOGUES)}")
    N = w.shape[0]
    expect("w", w, (N, K), BF16)
    shape, dtype = out_spec(epilogue, M, N)
    expect("out", out, shape, dtype)
    if K % 8 or N % 8:
        raise ValueError(f"{fn}: K and N must be multiples of 8 (16-byte rows), got K={K}, N={N}")
    return N


def check_path_options(path: str, head_keys, norm_out, row_norm) -> None:
    """The options that only one path takes."""
    if path not in PATHS:
        raise ValueError(f"linear: force must be 'gemm', 'gemv' or 'swap', got {path!r}")
    if (norm_out is not None or row_norm is not None) and path != "swap":
        raise ValueError(f"linear: norm_out and row_norm need the swap-AB path (3-64 rows), got the {path!r} path")
    if norm_out is not None and row_norm is not None:
        raise ValueError("linear: one product either writes the norm statistics (norm_out) or applies them "
                         "(row_norm), not both")
    if head_keys is not None and path != "gemv":
        raise ValueError(f"linear: head_keys need the GEMV, got the {path!r} path")


def check_gemv(M: int, epilogue: str, ksplit: int, pipe: bool, argmax: bool) -> None:
    """The GEMV's builds: M rows, warps per row pair, the pipelined loop, the LM head's keys."""
    if M not in GEMV_ROWS:
        raise ValueError(f"linear: the GEMV handles M in {GEMV_ROWS}, got M={M}")
    if ksplit not in GEMV_SPLITS:
        raise ValueError(f"linear: ksplit must be 1, 2, 4 or 8, got {ksplit}")
    if pipe and not (M == 1 and epilogue in PIPE_EPILOGUES):
        raise ValueError(f"linear: the pipelined GEMV takes M = 1 and the {' or '.join(PIPE_EPILOGUES)} "
                         f"epilogue, got M={M}, {epilogue!r}")
    if argmax and (M != 1 or epilogue != "f32"):
        raise ValueError(f"linear: head_keys need one row and the f32 epilogue, got M={M}, {epilogue!r}")


def swap_norm_args(M: int, N: int, K: int, epilogue: str, norm_out, row_norm) -> tuple[list, str]:
    """The extra arguments and kernel-name suffix of the norm statistics' producer (norm_out) or consumer
    (row_norm) build of gemm_swap.cu, checked; ([], "") for the plain build."""
    if norm_out is not None:
        if epilogue != "residual":
            raise ValueError(f"linear: norm_out needs the residual epilogue, got {epilogue!r}")
        next_w, next_x, ss_out = norm_out
        expect("next_w", next_w, (N,), BF16)
        expect("next_x", next_x, (M, N), BF16)
        expect("ss (norm_out)", ss_out, (M, norm_tiles(N)), FLOAT32)
        return [next_w, next_x, ss_out], "_np"
    if row_norm is not None:
        ss_in, eps = row_norm
        ss_tiles = norm_tiles(K)
        expect("ss (row_norm)", ss_in, (M, ss_tiles), FLOAT32)
        if ss_tiles > NORM_MAX_TILES:
            raise ValueError(f"linear: row_norm sums at most {NORM_MAX_TILES} partials a row "
                             f"(K <= {NORM_MAX_TILES * SWAP_TILE}), got K={K}")
        return [ss_in, I32(ss_tiles), F32(eps)], "_nc"
    return [], ""


# ============================================================================= launch
_cluster_slots: dict[int, int] = {}


def cluster_slots() -> dict[int, int]:
    """Blocks of gemm_tma.cu's split kernels resident at once, by split: the driver's count of clusters
    that fit (one block per SM; a cluster's blocks share a GPC) times the split."""
    if not _cluster_slots:
        for split in TMA_SPLITS:
            k = kernel("gemm_tma.cu", tma_kernel_name(128, split, "bf16"))
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
    kernel("gemm_tma.cu", tma_kernel_name(width, split, epilogue)).launch(
        (grid,), (TMA_THREADS,),
        [x, w, out, I32(M), I32(N), I32(K), bf16_tensor_map(x.ptr, M, K, TMA_BM),
         bf16_tensor_map(w.ptr, N, K, width // 2)], stream, smem=TMA_SMEM)


def launch_gemv(x: DeviceArray, w: DeviceArray, out: DeviceArray, epilogue: str, stream, *, ksplit: int | None,
                pipe: bool | None, head_keys: DeviceArray | None) -> None:
    """The "gemv" path of `linear` (shapes already checked): gemv.cu, and with head_keys its ARGMAX build."""
    M, K = x.shape
    N = w.shape[0]
    pairs = gemv_pairs(N, epilogue)
    ksplit = ksplit or gemv_ksplit(pairs, K)
    argmax = head_keys is not None
    check_gemv(M, epilogue, ksplit, pipe, argmax)
    if pipe is None:
        pipe = gemv_pipe(M, K, ksplit, epilogue)
    grid = gemv_grid(pairs, ksplit)
    args = [x, w, out, I32(N), I32(K), I32(ksplit)]
    if argmax:
        expect("head_keys", head_keys, grid, UINT64)
        args.append(head_keys)
    kernel("gemv.cu", gemv_kernel_name(M, epilogue, pipe, argmax)).launch(grid, (GEMV_WARPS * 32,), args, stream)


def launch_swap(x: DeviceArray, w: DeviceArray, out: DeviceArray, epilogue: str, stream, *, ksplit: int | None,
                norm_out, row_norm) -> None:
    """The "swap" path of `linear` (shapes already checked): gemm_swap.cu, its plain, producer or consumer build."""
    M, K = x.shape
    N = w.shape[0]
    cfg = swap_config(M, N, K, epilogue, ksplit=ksplit, sms=get_device().info.num_sms)
    norm_args, suffix = swap_norm_args(M, N, K, epilogue, norm_out, row_norm)
    if M == 0:
        return
    kernel("gemm_swap.cu", cfg.kernel_name + suffix).launch(
        cfg.grid, (SWAP_THREADS,), [x, w, out, I32(M), I32(N), I32(K), I32(EPILOGUES[epilogue]), *norm_args],
        stream, smem=cfg.smem)


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
    M, K = x.shape
    expect("x", x, (M, K), BF16)
    N = check_product("linear", M, K, w, out, epilogue)
    path = force or default_path(M, N)
    check_path_options(path, head_keys, norm_out, row_norm)
    if path == "gemv":
        launch_gemv(x, w, out, epilogue, stream, ksplit=ksplit, pipe=pipe, head_keys=head_keys)
    elif path == "swap":
        launch_swap(x, w, out, epilogue, stream, ksplit=ksplit, norm_out=norm_out, row_norm=row_norm)
    elif force:
        # The batch-invariant mode forces every product here: one tile width and no split whatever M is,
        # so that a row's sums never depend on the rows beside it.
        gemm(x, w, out, epilogue, stream, width=TMA_WIDTHS[0], split=1)
    else:
        gemm(x, w, out, epilogue, stream)


def norm_linear(resid: DeviceArray, norm_w: DeviceArray, eps: float, x: DeviceArray, w: DeviceArray,
                out: DeviceArray, epilogue: str, stream, *, force: str | None = None) -> None:
    """out <- epilogue(rmsnorm(resid) * norm_w @ w.T), resid [M, K] float32: a product that follows a
    norm. Where fuses_norm says (the GEMV path at 1-2 rows, QKV and gate/up) each block normalizes the
    rows itself (cuda_src/gemv.cu, gemv_norm_*: bitwise what the rmsnorm kernel would write) and `x` is
    left as it was; otherwise the rmsnorm kernel writes x [M, K] bf16 and `linear` runs."""
    M, K = resid.shape
    if not fuses_norm(force or default_path(M, w.shape[0]), M, epilogue):
        rmsnorm(resid, norm_w, x, eps, stream)
        linear(x, w, out, epilogue, stream, force=force)
        return
    expect("resid", resid, (M, K), FLOAT32)
    expect("norm_w", norm_w, (K,), BF16)
    N = check_product("norm_linear", M, K, w, out, epilogue)
    pairs = gemv_pairs(N, epilogue)
    ksplit = gemv_ksplit(pairs, K)
    kernel("gemv.cu", norm_kernel_name(M, K, epilogue)).launch(
        gemv_grid(pairs, ksplit), (GEMV_WARPS * 32,),
        [resid, norm_w, F32(eps), w, out, I32(N), I32(K), I32(ksplit)], stream, smem=M * K * 2)
