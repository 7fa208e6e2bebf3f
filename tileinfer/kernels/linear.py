"""Launchers for cuda_src/gemv.cu (decode, 1-2 rows), cuda_src/gemm_swap.cu (swap-AB wgmma weight
streaming: batches of 3-64 rows, verify steps included) and cuda_src/gemm_tma.cu (wgmma tensor cores fed
by TMA: prefill, and batches of 65 rows or more).

`linear` computes y = x W^T for x [M, K] bf16 and W [N, K] bf16 with a fused epilogue:
  "bf16"      out [M, N] bf16
  "residual"  out [M, N] float32, out += x W^T (the residual stream)
  "silu_mul"  W is [gate; up] ([2I, K]); out [M, I] bf16 = silu(x gate^T) * (x up^T)
  "f32"       out [M, N] float32 (logits)
  "xielu"     out [M, N] bf16 = xielu(x W^T) with the layer's parameters `act` (Apertus' up projection,
              cuda_src/common.cuh)
`norm_linear` is the same product after an RMSNorm of the float32 residual stream.

Which kernel (`default_path`; chosen from scripts/bench_gemm_small.py and engine runs on the H200,
figures in docs/benchmarks.md):
  - M in (1, 2): the bandwidth-bound GEMV; after a norm, the GEMV that normalizes its own input.
  - 3 <= M <= 64: the swap-AB GEMM, every weight byte read once for all rows (swap_config); a gate/up product of
    33-64 rows whose swap-AB grid would be more than a wave of blocks runs on gemm_tma.cu (TMA_GATE_UP_ROWS).
  - Everything else: gemm_tma.cu, split along K by a cluster of blocks when its tiles are too few for the
    SMs, and for the residual products of prefill size (tma_plan).

Routing (which kernel and build, pure functions of the shapes) lives in kernels/routing.py; this module
holds validation (the arguments' shapes and dtypes) and the launches.
"""
from functools import cache

from ..cuda import F32, I32, U64, DeviceArray, get_device, kernel
from ..cuda.tensormap import bf16_tensor_map
from ._check import BF16, FLOAT32, INT32, UINT64, cdiv, expect
from .rmsnorm import rmsnorm
from .routing import (EPILOGUES, PATHS, GEMV_WARPS, GEMV_ROWS, GEMV_SPLITS, PIPE_EPILOGUES, SWAP_TILE, SWAP_THREADS,
                      NORM_MAX_TILES, TMA_BM, TMA_THREADS, TMA_SMEM, TMA_WIDTHS, TMA_ROUND_WIDTHS, TMA_ROUND_SPLITS,
                      TMA_SPLITS, tma_split_built,
                      default_path, fuses_norm, gemv_pairs, gemv_ksplit, gemv_grid, gemv_pipe, gemv_kernel_name,
                      norm_kernel_name, norm_tiles, swap_config, tma_tiles, tma_width, tma_plan, tma_kernel_name,
                      tma_smem,
                      TmaPlan, SWAP_BATCHES, SWAP_BK, FLOW_EPILOGUES, FLOW_ROWS, flow_tiles_per_chunk)

# ============================================================================= validation
def out_spec(epilogue: str, M: int, N: int):
    """(shape, dtype) of the product's output."""
    if epilogue == "silu_mul":
        if N % 2:
            raise ValueError(f"linear silu_mul: W must stack [gate; up], got an odd N={N}")
        return (M, N // 2), BF16
    return (M, N), (BF16 if epilogue in ("bf16", "xielu") else FLOAT32)


def check_product(fn: str, M: int, K: int, w: DeviceArray, out: DeviceArray, epilogue: str,
                  act: DeviceArray | None = None) -> int:
    """Checks W [N, K] bf16, `out` for the epilogue, `act` (xIELU's four float32 parameters for "xielu",
    None for every other epilogue) and the 16-byte rows; returns N."""
    if epilogue not in EPILOGUES:
        raise ValueError(f"{fn}: unknown epilogue {epilogue!r}; choose one of {', '.join(EPILOGUES)}")
    if epilogue == "xielu":
        if act is None:
            raise ValueError(f"{fn}: the 'xielu' epilogue needs its parameters (act=, 4 float32)")
        expect("act", act, (4,), FLOAT32)
    elif act is not None:
        raise ValueError(f"{fn}: act is for the 'xielu' epilogue, not {epilogue!r}")
    N = w.shape[0]
    expect("w", w, (N, K), BF16)
    shape, dtype = out_spec(epilogue, M, N)
    expect("out", out, shape, dtype)
    if K % 8 or N % 8:
        raise ValueError(f"{fn}: K and N must be multiples of 8 (16-byte rows), got K={K}, N={N}")
    return N


def capture_args(M: int, N: int, epilogue: str, capture: tuple[DeviceArray, int] | None) -> list:
    """The kernels' (cap, cap_stride) arguments: capture = (states [>= M, S] float32, column), the residual
    epilogue also writing row m's N new values at states[m, column:column + N]; (null, 0) without one."""
    if capture is None:
        return [None, I32(0)]
    states, column = capture
    if epilogue != "residual":
        raise ValueError(f"linear: capture needs the residual epilogue, got {epilogue!r}")
    expect("capture", states, (None, None), FLOAT32)
    rows, width = states.shape
    if rows < M or not 0 <= column <= width - N or column % 4 or width % 4:
        raise ValueError(f"linear: capture of {M} x {N} at column {column} does not fit states {states.shape} "
                         "(columns and row width multiples of 4)")
    return [U64(states.ptr + 4 * column), I32(width)]  # the address of states[0, column], the row width


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


@cache
def _tma_plan(M: int, N: int, K: int, epilogue: str, sms: int) -> TmaPlan:
    """tma_plan for this GPU's cluster slots, computed once a shape (the forward pass asks for the same
    few shapes every step)."""
    return tma_plan(M, N, K, epilogue, sms, cluster_slots())


def gemm(x: DeviceArray, w: DeviceArray, out: DeviceArray, epilogue: str, stream, *, width: int | None = None,
         split: int | None = None, tail: int | None = None, blocks: int | None = None,
         multicast: bool | None = None, rows: int | None = None, act: DeviceArray | None = None,
         capture: tuple[DeviceArray, int] | None = None) -> None:
    """The "gemm" path of `linear` (shapes already checked): gemm_tma.cu, fed by TMA through tensor maps
    of x and w. Unsplit it is persistent, one block per SM walking its tiles; `width` (128 or 256; 160, 96 or 64 for
    the persistent kernel without a tail or multicast; 96 for a 2- or 4-way split) forces its tile width, `blocks`
    caps its grid (tests: many tiles a block), `tail` (2-4) runs its last, partial round as a split launch of that
    many blocks a tile, `multicast` runs it in 2-block clusters that share their W tiles (an even number of row
    tiles and of blocks). `rows` (128 or 256) forces the tile's rows.
    `split` (2-4 blocks per tile, a cluster summing its partial tiles in rank order) forces a split, 1 forbids one;
    by default tma_plan decides. `act`: the parameters of the "xielu" epilogue; `capture`: as linear's."""
    M, K = x.shape
    N = w.shape[0]
    cap = capture_args(M, N, epilogue, capture)
    if M == 0:
        return
    silu = epilogue == "silu_mul"
    sms = get_device().info.num_sms
    if split is None and width is None and blocks is None and tail is None and multicast is None and rows is None:
        plan = _tma_plan(M, N, K, epilogue, sms)
    else:
        plan = forced_plan(M, N, silu, sms, width, split, tail, multicast, blocks, rows)
    width, split, tail, multicast, rows = plan.width, plan.split, plan.tail, plan.multicast, plan.rows
    tiles = tma_tiles(M, N, silu, width, rows)
    maps = [bf16_tensor_map(x.ptr, tile_rows(x, rows), K, TMA_BM), bf16_tensor_map(w.ptr, N, K, width // 2)]

    def launch(ks: int, first: int, last: int, grid: int) -> None:
        kernel("gemm_tma.cu", tma_kernel_name(width, ks, epilogue, multicast and ks == 1, rows)).launch(
            (grid,), (TMA_THREADS,), [x, w, out, I32(M), I32(N), I32(K), I32(first), I32(last), *maps, act, *cap],
            stream, smem=tma_smem(rows))

    if split > 1:
        launch(split, 0, tiles, tiles * split)
        return
    grid = min(tiles, blocks or sms)
    if multicast:
        grid -= grid % 2   # whole clusters (tiles is even: pairs of row tiles)
    whole = tiles - tiles % grid if tail > 1 else tiles   # whole rounds; the rest split `tail` ways
    launch(1, 0, whole, grid)
    if whole < tiles:
        launch(tail, whole, tiles, (tiles - whole) * tail)


def forced_plan(M: int, N: int, silu: bool, sms: int, width: int | None, split: int | None, tail: int | None,
                multicast: bool | None, blocks: int | None, rows: int | None = None) -> TmaPlan:
    """gemm's plan when a caller forces any of its options (each checked); the others as the persistent
    kernel's defaults (no split, tail or multicast; tma_width's width; 128-row tiles)."""
    if rows is not None and rows != TMA_BM:
        if width is None or tail not in (None, 1) or multicast:
            raise ValueError(f"gemm: rows={rows} needs a width, and takes no tail or multicast")
        tma_kernel_name(width, split or 1, "bf16", rows=rows)   # raises where no such build exists
        return TmaPlan(width, split or 1, rows=rows)
    for name, value in (("split", split), ("tail", tail)):
        if value not in (None, 1) + TMA_SPLITS:
            raise ValueError(f"gemm: {name} must be 1 or one of {TMA_SPLITS}, got {value}")
    if width not in (None,) + TMA_WIDTHS + TMA_ROUND_WIDTHS:
        raise ValueError(f"gemm: width must be one of {TMA_WIDTHS + TMA_ROUND_WIDTHS}, got {width}")
    split, tail, multicast = split or 1, tail or 1, bool(multicast)
    width = width or tma_width(M, N, silu, sms, persistent=split == 1 and tail == 1 and not multicast)
    if split > 1 and (blocks is not None or tail > 1 or multicast):
        raise ValueError("gemm: `blocks`, `tail` and `multicast` are for the persistent (unsplit) kernel only")
    if width in TMA_ROUND_WIDTHS and (tail > 1 or multicast or (split > 1 and not tma_split_built(width, split))):
        raise ValueError(f"gemm: width {width} is the persistent kernel's (no tail or multicast), and a split's only "
                         f"as {TMA_ROUND_SPLITS}")
    if multicast and (cdiv(M, TMA_BM) % 2 or (blocks or 2) % 2):
        raise ValueError(f"gemm: multicast pairs row tiles and blocks: {cdiv(M, TMA_BM)} row tiles, blocks={blocks}")
    return TmaPlan(width, split, tail, multicast)


def tile_rows(x: DeviceArray, tile: int) -> int:
    """Rows of x's tensor map for gemm_tma.cu: its M rows rounded up to whole `tile`-row tiles where x's
    allocation (the array it is a view of) continues that far, else M. TMA zero-fills a box that lies partly past
    the map's last row, and such loads were measured much slower: qwen3-4b's QKV product at 144 rows 28.3 us
    against 16.8 with the map over 256 rows (qwen3-0.6b's layer 48 against 41 us). The rows past M are read
    but their products are never stored: the kernel's M bounds every epilogue, and a product row depends on
    its own row of x alone."""
    M = x.shape[0]
    root = x
    while root.base is not None:
        root = root.base
    room = (root.ptr + root.nbytes - x.ptr) // (x.nbytes // M) if M else 0
    return max(M, min(cdiv(M, tile) * tile, room))


def launch_gemv(x: DeviceArray, w: DeviceArray, out: DeviceArray, epilogue: str, stream, *, ksplit: int | None,
                pipe: bool | None, head_keys: DeviceArray | None, act: DeviceArray | None = None,
                capture: tuple[DeviceArray, int] | None = None) -> None:
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
        if capture is not None:
            raise ValueError("linear: head_keys and capture do not go together (the LM head has no residual)")
        args.append(head_keys)
    else:
        args += [act, *capture_args(M, N, epilogue, capture)]
    kernel("gemv.cu", gemv_kernel_name(M, epilogue, pipe, argmax)).launch(grid, (GEMV_WARPS * 32,), args, stream)


def launch_swap(x: DeviceArray, w: DeviceArray, out: DeviceArray, epilogue: str, stream, *, ksplit: int | None,
                norm_out, row_norm, act: DeviceArray | None = None,
                capture: tuple[DeviceArray, int] | None = None) -> None:
    """The "swap" path of `linear` (shapes already checked): gemm_swap.cu, its plain, producer or consumer build."""
    M, K = x.shape
    N = w.shape[0]
    cfg = swap_config(M, N, K, epilogue, ksplit=ksplit, sms=get_device().info.num_sms)
    norm_args, suffix = swap_norm_args(M, N, K, epilogue, norm_out, row_norm)
    cap = capture_args(M, N, epilogue, capture)
    if M == 0:
        return
    if norm_out is not None:
        tail = cap           # the producer build (residual only) takes no act
    elif row_norm is not None:
        tail = [act]         # the consumer build (never residual) takes no capture
    else:
        tail = [act, *cap]
    kernel("gemm_swap.cu", cfg.kernel_name + suffix).launch(
        cfg.grid, (SWAP_THREADS,), [x, w, out, I32(M), I32(N), I32(K), I32(EPILOGUES[epilogue]), *norm_args, *tail],
        stream, smem=cfg.smem)


def linear(x: DeviceArray, w: DeviceArray, out: DeviceArray, epilogue: str, stream, *, force: str | None = None,
           ksplit: int | None = None, pipe: bool | None = None, head_keys: DeviceArray | None = None,
           norm_out: tuple[DeviceArray, DeviceArray, DeviceArray] | None = None,
           row_norm: tuple[DeviceArray, float] | None = None, act: DeviceArray | None = None,
           capture: tuple[DeviceArray, int] | None = None) -> None:
    """out <- epilogue(x @ w.T). `force` ("gemm", "gemv" or "swap") and `ksplit` override the choices: for
    the GEMV the warps per row pair, for the swap-AB GEMM the blocks per cluster splitting K (1, 2, 4 or
    8); `pipe` the batch-1 GEMV's loop (gemv_pipe). head_keys (the LM head at batch 1: one row, the f32
    epilogue, the GEMV): also each block's largest logit as a key, in head_keys[:blocks]
    with blocks = head_key_count(N, K) (gemv.cu, ARGMAX), for sample().

    Norm statistics, swap-AB path only (gemm_swap.cu's header): norm_out = (next_w [N] bf16, next_x [M, N]
    bf16, ss [M, norm_tiles(N)] float32) with the residual epilogue also writes next_x = bf16(out * next_w)
    and each row's sums of squares a tile; row_norm = (ss [M, norm_tiles(K)], eps), with x = such a
    next_x, scales row m of the result by 1 / sqrt(sum(ss[m]) / K + eps) before the epilogue.

    act: the parameters of the "xielu" epilogue (xIELU's [a_p, a_n, beta, eps], float32 on the device).

    capture = (states [>= M, S] float32, column), residual epilogue only: the kernel that adds the product into
    the residual stream also writes each new row m at states[m, column:column + N] (every path; a layer's hidden
    states for a drafter, model/forward.py)."""
    M, K = x.shape
    expect("x", x, (M, K), BF16)
    N = check_product("linear", M, K, w, out, epilogue, act)
    path = force or default_path(M, N, K, epilogue, get_device().info.num_sms)
    check_path_options(path, head_keys, norm_out, row_norm)
    if path == "gemv":
        launch_gemv(x, w, out, epilogue, stream, ksplit=ksplit, pipe=pipe, head_keys=head_keys, act=act,
                    capture=capture)
    elif path == "swap":
        launch_swap(x, w, out, epilogue, stream, ksplit=ksplit, norm_out=norm_out, row_norm=row_norm, act=act,
                    capture=capture)
    elif force:
        # The batch-invariant mode forces every product here: one tile width and no split whatever M is,
        # so that a row's sums never depend on the rows beside it.
        gemm(x, w, out, epilogue, stream, width=TMA_WIDTHS[0], split=1, act=act, capture=capture)
    else:
        gemm(x, w, out, epilogue, stream, act=act, capture=capture)


def mlp_flow(x: DeviceArray, w_up: DeviceArray, h: DeviceArray, w_down: DeviceArray, resid: DeviceArray,
             epilogue: str, flags: DeviceArray, stream, *, act: DeviceArray | None = None,
             row_norm: tuple[DeviceArray, float] | None = None,
             norm_out: tuple[DeviceArray, DeviceArray, DeviceArray] | None = None) -> None:
    """h <- epilogue(x @ w_up.T) ("silu_mul" or "xielu", act as linear's), then resid += h @ w_down.T, on
    gemm_swap.cu's flow builds (routing.uses_mlp_flow: 3-64 rows): the down product is launched right behind the up
    product and each of its blocks waits for the chunks of h it reads, counted in flags (int32 [chunks + 1], chunks =
    ceil(I / 64) for h [M, I], all zero before the call and again after it), instead of for the up product's end.
    row_norm (the up product's) and norm_out (the down product's) are linear's norm statistics: the flow builds are
    the roles the engine runs, so at 3-32 rows row_norm is needed (norm_out is None after the last layer) and at
    33-64 rows neither is taken; the up product's grid must be more than a wave of blocks (routing.uses_mlp_flow)."""
    M, D = x.shape
    expect("x", x, (M, D), BF16)
    if not (M in FLOW_ROWS or M == 0) or epilogue not in FLOW_EPILOGUES:
        raise ValueError(f"mlp_flow: the flow builds take {FLOW_ROWS.start}-{FLOW_ROWS.stop - 1} rows and the "
                         f"{' or '.join(FLOW_EPILOGUES)} epilogue, got M={M}, {epilogue!r}")
    N_up = check_product("mlp_flow", M, D, w_up, h, epilogue, act)
    I = h.shape[1]
    N = check_product("mlp_flow", M, I, w_down, resid, "residual")
    expect("flags", flags, (cdiv(I, SWAP_BK) + 1,), INT32)
    up_norm, up_role = swap_norm_args(M, N_up, D, epilogue, None, row_norm)
    down_norm, down_role = swap_norm_args(M, N, I, "residual", norm_out, None)
    if (up_role or down_role) and M > SWAP_BATCHES[1]:
        raise ValueError(f"mlp_flow: the norm statistics' flow builds take at most {SWAP_BATCHES[1]} rows, got M={M}")
    if not up_role and 0 < M <= SWAP_BATCHES[1]:
        raise ValueError(f"mlp_flow: at 3-{SWAP_BATCHES[1]} rows the flow builds take the up product's norm "
                         f"statistics (row_norm), as the engine's steps of those rows have them; got M={M} without")
    if M == 0:
        return
    sms = get_device().info.num_sms
    up, down = swap_config(M, N_up, D, epilogue, sms=sms), swap_config(M, N, I, "residual", sms=sms)
    if up.deep:
        raise ValueError(f"mlp_flow: the up product's grid ({up.grid[0] * up.grid[1]} blocks for {sms} SMs) would "
                         f"run a deep build, which has no flow build; the flow is for up products of more blocks "
                         f"than the GPU holds at once (routing.uses_mlp_flow)")
    kernel("gemm_swap.cu", up.kernel_name + up_role + "_fp").launch(
        up.grid, (SWAP_THREADS,), [x, w_up, h, I32(M), I32(N_up), I32(D), I32(EPILOGUES[epilogue]), *up_norm, act,
                                   flags], stream, smem=up.smem)
    kernel("gemm_swap.cu", down.kernel_name + down_role + "_fc").launch(
        down.grid, (SWAP_THREADS,), [h, w_down, resid, I32(M), I32(N), I32(I), I32(EPILOGUES["residual"]), *down_norm,
                                     flags, I32(up.grid[1]), I32(flow_tiles_per_chunk(epilogue)), I32(up.ksplit)],
        stream, smem=down.smem)


def norm_linear(resid: DeviceArray, norm_w: DeviceArray, eps: float, x: DeviceArray, w: DeviceArray,
                out: DeviceArray, epilogue: str, stream, *, force: str | None = None,
                act: DeviceArray | None = None) -> None:
    """out <- epilogue(rmsnorm(resid) * norm_w @ w.T), resid [M, K] float32: a product that follows a
    norm. Where fuses_norm says (the GEMV path at 1-2 rows, QKV and gate/up) each block normalizes the
    rows itself (cuda_src/gemv.cu, gemv_norm_*: bitwise what the rmsnorm kernel would write) and `x` is
    left as it was; otherwise the rmsnorm kernel writes x [M, K] bf16 and `linear` runs. act: as linear's."""
    M, K = resid.shape
    if not fuses_norm(force or default_path(M, w.shape[0], K, epilogue, get_device().info.num_sms), M, epilogue):
        rmsnorm(resid, norm_w, x, eps, stream)
        linear(x, w, out, epilogue, stream, force=force, act=act)
        return
    expect("resid", resid, (M, K), FLOAT32)
    expect("norm_w", norm_w, (K,), BF16)
    N = check_product("norm_linear", M, K, w, out, epilogue, act)
    pairs = gemv_pairs(N, epilogue)
    ksplit = gemv_ksplit(pairs, K)
    kernel("gemv.cu", norm_kernel_name(M, K, epilogue)).launch(
        gemv_grid(pairs, ksplit), (GEMV_WARPS * 32,),
        [resid, norm_w, F32(eps), w, out, I32(N), I32(K), I32(ksplit), act], stream, smem=M * K * 2)
