// Paged causal attention for prefill chunks over a BF16 cache on Hopper's warpgroup tensor-core
// instructions (wgmma, sm_90a), flash-attention 3 style: on Hopper it replaces the rows mode
// ("prefill shape") of attention_prefill.cu's `attention` kernel over a BF16 cache without a key split (the
// routing is in tileinfer/kernels/routing.py), with its arguments, its cache layout and its
// output; see attention.cuh's header for the cache layout (pool[page, kv_head, offset, 128],
// block tables), the (token, head-in-group) rows of grouped-query attention, cu_q / kv_lens and the
// causal positions (sequence b's first query sits at position kv_lens[b] - q_len).
//
// Work decomposition. A block owns ROWS = 128 rows of one sequence and one KV head (row R: token
// R / G, query head kv_head * G + R % G; with G = 4, 32 tokens) and walks key tiles of KT = 128
// positions, gathered page by page, from position 0 up to the block's last query position. Grid
// (KV heads, row tiles, sequences), row tiles taken from the last (the most keys) to the first, so
// the heaviest blocks start first and the light ones fill the tail.
//
// Block: 3 warpgroups (384 threads), warp-specialized.
//   - Warpgroup 0, the producer (`setmaxnreg.dec` to 40 registers): its 128 threads copy each key
//     tile's K and V with cp.async (16-byte chunks; positions past kv_len are zero-filled) into a
//     ring of STAGES stages, looking up each position's page in the block table. Completion is
//     signalled on per-stage "full" mbarriers by cp.async.mbarrier.arrive.noinc (128 arrivals: one
//     per producer thread, fired when that thread's copies have landed). K and V have separate
//     barriers, so a stage's K can be refilled as soon as S = Q K^T has read it, before P V is done
//     with its V.
//   - Warpgroups 1 and 2, the consumers (`setmaxnreg.inc` to 232): each owns 64 of the 128 rows. It
//     copies its rows of Q to shared memory itself (cp.async, once), then per key tile:
//       S = Q K^T        wgmma.m64n128k16, A = Q and B = K both from shared memory (K-major);
//       mask (only the tiles that reach past the warpgroup's first query position), online
//       softmax in base 2 as attention_prefill.cu (scores times scale * log2(e), a row maximum and
//       sum), except that the reference maximum m moves lazily: only when a row's maximum passes it
//       by more than RESCALE_LOG2 (then every row of the warp moves, and O and l are rescaled by
//       2^(m_old - m_new)), so most tiles past the first few skip the rescale;
//       O += P V         wgmma.m64n128k16 with A = P from registers: the S accumulators converted to
//                        bf16 in place (the accumulator fragment of 16 columns is exactly the
//                        register A fragment of a k16 slice), B = V read MN-major (transpose-B).
//     Overlap within a warpgroup (flash-attention 3's): S of tile j and P V of tile j - 1 are issued
//     as two wgmma groups, S first; the warpgroup waits for S alone (wait_group 1), runs tile j's
//     softmax while its P V is still on the tensor cores, then waits for that (wait_group 0),
//     rescales O if the softmax moved m, and converts P_j to bf16 over P_{j-1}. After S's group has
//     completed, lane 0 of each consumer warp arrives on the stage's "emptyK" barrier (8 arrivals free
//     the stage's K); after P V's, on "emptyV". After each wait on a full barrier the consumers execute
//     fence.proxy.async (cp.async writes in the generic proxy, wgmma reads in the async proxy;
//     flash-attention 3's cp.async path does without, kept for safety).
//   - Ping-pong (PP = 1): two named barriers make the consumer warpgroups take turns issuing their
//     wgmma batches (S_j + PV_j-1), so one warpgroup's softmax overlaps the other's tensor-core work.
//     Warpgroup 1 arrives once up front (warpgroup 0 goes first) and skips its last hand-over, so
//     every bar.sync has its bar.arrive.
//
// Shared memory (1024-byte aligned): Q [2 warpgroups][2 halves][64 rows][64], then K [STAGES] and
// V [STAGES] tiles of [2 halves][KT keys][64], then the mbarriers. Every tile is stored as two
// 64-channel halves ("sub-tiles") of 128-byte rows, the 16-byte chunk c of row r at chunk c ^ (r % 8):
// the 128-byte swizzle, in 8-row atoms of 1024 bytes, that the wgmma descriptors name:
//   - K-major (Q as A, K as B of Q K^T): stride byte offset 1024 (8-row groups), k16 slice ks at
//     +32 bytes within a half (ks % 4) and + the half's offset (ks / 4);
//   - MN-major (V as B of P V, transpose-B = 1): V's rows are keys (the k dimension) and its 64
//     contiguous channels the n dimension, i.e. the canonical MN-major 128-byte-swizzled layout
//     ((8,8,m),(8,k)):((1,8,LBO),(64,SBO)) in elements: leading byte offset = the distance between
//     the two 64-channel halves (KT * 128 bytes), stride byte offset = 1024 (8 keys), k16 slice kk at
//     + kk * 2048 bytes. (The same layout ThunderKittens' transposed descriptors use.)
//
// Build. The ring depth STAGES and the ping-pong PP are template parameters of the body; the one
// kernel is STAGES = 2 with ping-pong.
//
// Resources (NVRTC 13 ptxas, sm_90a): 168 registers a thread at launch (384 threads, one block per SM);
// after setmaxnreg the consumers' code names registers up to R198 of their 232 and the producer's up to R37
// of its 40 (cuobjdump -sass). No spills, no wgmma serialization (ptxas C7515) warning.
// Dynamic shared memory 164,928 bytes with 2 stages, 230,496 with 3 (of 232,448).
//
// Differences from attention_prefill.cu's rows mode: 128 rows and 128 keys per block step instead of 64 and
// 64; the sums run in a different order, so results agree to rounding, not bitwise. Split-K
// (num_splits > 1) and the INT8 cache are not handled: the launcher (tileinfer/kernels/attention.py)
// sends those to attention_prefill.cu; num_splits != 1 traps here. Only sm_90a has wgmma / setmaxnreg: a
// plain sm_90 build (and any other arch) gets a body that traps.
#include "common.cuh"
#include "mbarrier.cuh"
#include "wgmma.cuh"

#define HD 128
#define KT 128                     // keys per tile
#define ROWS 128                   // rows per block: 2 consumer warpgroups x 64
#define WG_THREADS 128
#define THREADS (3 * WG_THREADS)
#define PRODUCER_REGS 40
#define CONSUMER_REGS 232
#define RESCALE_LOG2 8.f           // how far (base 2) a row's max may pass its reference before O is rescaled

// Named barriers (0 is __syncthreads): 1, 2: a consumer warpgroup's Q is in shared memory;
// 3, 4: warpgroup 0's / 1's turn to issue wgmma (ping-pong).
#define BAR_Q0 1
#define BAR_TURN0 3

template <int STAGES>
struct WgSmem {
    static constexpr int Q_BYTES = ROWS * HD * 2;           // 32 KB: 2 warpgroups x 2 halves x 64 rows x 128 B
    static constexpr int Q_WG = 64 * HD * 2;                // one warpgroup's Q (16 KB)
    static constexpr int HALF_Q = 64 * 64 * 2;              // one 64-channel half of it (8 KB)
    static constexpr int TILE = KT * HD * 2;                // one K or V tile (32 KB)
    static constexpr int HALF = KT * 64 * 2;                // one 64-channel half of a tile (16 KB)
    static constexpr int K_OFF = Q_BYTES;
    static constexpr int V_OFF = K_OFF + STAGES * TILE;
    static constexpr int BAR_OFF = V_OFF + STAGES * TILE;   // fullK, fullV, emptyK, emptyV: [STAGES] each
    static constexpr int TOTAL = BAR_OFF + 4 * STAGES * 8 + 1024;  // + alignment slack
};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// ----------------------------------------------------------------------------- mbarriers, named barriers
__device__ __forceinline__ void mbar_fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// One arrival on `bar` once every cp.async this thread issued so far has landed (counted in the
// barrier's expected arrivals: .noinc).
__device__ __forceinline__ void cp_async_mbar_arrive(u32 bar) {
    asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_bar_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
template <int N> __device__ __forceinline__ void setmaxnreg_dec() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(N));
}
template <int N> __device__ __forceinline__ void setmaxnreg_inc() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(N));
}
__device__ __forceinline__ float fast_exp2(float x) {  // 2^x; -inf -> 0
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// ----------------------------------------------------------------------------- descriptors, wgmma
__device__ __forceinline__ unsigned long long desc_encode(u32 x) { return (unsigned long long)((x & 0x3FFFF) >> 4); }

// V as the B operand of P V: MN-major, 128-byte swizzle; leading byte offset = the distance between
// the two 64-channel halves of the tile, stride byte offset = 1024 (8 keys of 128 bytes).
__device__ __forceinline__ unsigned long long desc_mn(u32 addr) {
    return desc_encode(addr) | (desc_encode(KT * 64 * 2) << 16) | (desc_encode(1024) << 32) | (1ull << 62);
}

// s (64 x 128 per warpgroup) = A (64 x 16, shared memory) * B (16 x 128, shared memory, K-major),
// accumulating unless FIRST (then s is write-only: no dependence on its old values).
template <bool FIRST>
__device__ __forceinline__ void wgmma_ss(float (&d)[64], unsigned long long da, unsigned long long db) {
    if constexpr (FIRST) {
        asm volatile(
            "{\n"
            "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
            "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
            "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
            "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
            "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
            "}, %64, %65, 0, 1, 1, 0, 0;\n}\n"
            : WGMMA_W16(0), WGMMA_W16(16), WGMMA_W16(32), WGMMA_W16(48)
            : "l"(da), "l"(db));
    } else {
        wgmma_m64n128k16(d, da, db, 1);
    }
}

// o (64 x 128 per warpgroup) += P (64 x 16, registers: the A fragment a[0..3]) * V (16 x 128, shared
// memory, MN-major: transpose-B = 1).
__device__ __forceinline__ void wgmma_rs_tb(float (&d)[64], const u32 (&a)[4], unsigned long long db) {
    asm volatile(
        "{\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
        "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, "
        "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, "
        "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, "
        "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
        "}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n}\n"
        : WGMMA_D16(0), WGMMA_D16(16), WGMMA_D16(32), WGMMA_D16(48)
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db));
}

// ----------------------------------------------------------------------------- the kernel body
template <int STAGES, bool PP>
__device__ __forceinline__ void attention_wg_body(
        const bf16 *__restrict__ q, const bf16 *__restrict__ k_pool, const bf16 *__restrict__ v_pool,
        bf16 *__restrict__ out, const int *__restrict__ cu_q, const int *__restrict__ kv_lens,
        const int *__restrict__ block_tables, int bt_stride, int num_heads, int num_kv_heads, int page_size,
        int num_splits, float scale_log2) {
    using S = WgSmem<STAGES>;
    if (num_splits != 1) __trap();  // split-K is attention_prefill.cu's (the launcher never sends it here)

    const int kv_head = blockIdx.x, b = blockIdx.z;
    const int row0 = (gridDim.y - 1 - blockIdx.y) * ROWS;  // the last row tiles (most keys) start first
    const int G = num_heads / num_kv_heads;
    const int q0 = cu_q[b], q_len = cu_q[b + 1] - q0;
    const int kv_len = kv_lens[b];
    const int rows = q_len * G;
    if (row0 >= rows) return;  // the whole block, before any barrier
    const int first_pos = kv_len - q_len;
    const int max_qpos = first_pos + (min(row0 + ROWS, rows) - 1) / G;
    const int n_tiles = max_qpos / KT + 1;
    const int *table = block_tables + (size_t)b * bt_stride;

    extern __shared__ __align__(1024) unsigned char smem_raw[];
    const u32 base = (smem_addr(smem_raw) + 1023) & ~1023u;
    const u32 sQ = base, sK = base + S::K_OFF, sV = base + S::V_OFF;
    const u32 fullK = base + S::BAR_OFF, fullV = fullK + 8 * STAGES;
    const u32 emptyK = fullV + 8 * STAGES, emptyV = emptyK + 8 * STAGES;

    if (threadIdx.x == 0) {
#pragma unroll
        for (int s = 0; s < STAGES; ++s) {
            mbar_init(fullK + 8 * s, WG_THREADS);  // one cp.async arrival per producer thread
            mbar_init(fullV + 8 * s, WG_THREADS);
            mbar_init(emptyK + 8 * s, 8);          // lane 0 of each consumer warp
            mbar_init(emptyV + 8 * s, 8);
        }
        mbar_fence_init();
    }
    __syncthreads();

    const int wg = threadIdx.x / WG_THREADS, tid = threadIdx.x % WG_THREADS;
    if (wg == 0) {
        // ------------------------------------------------------------------- producer
        setmaxnreg_dec<PRODUCER_REGS>();
        // Thread -> chunk c16 (of 16) of key rows r8 + 8 i, i = 0 .. 15. The swizzled chunk depends on the
        // row only through r % 8 = r8, so one offset serves every row: + i * 1024 bytes.
        const int c16 = tid & 15, r8 = tid >> 4;
        const u32 dst = (c16 >> 3) * S::HALF + r8 * 128 + (((c16 & 7) ^ r8) << 4);
        for (int j = 0; j < n_tiles; ++j) {
            const int st = j % STAGES;
            const u32 par = (j / STAGES) & 1;
            // Element offset into the pool of each of this thread's 16 rows' chunk: ((page * KV + kv_head) *
            // page_size + offset) * 128 + c16 * 8 (32 bits: a pool holds < 2^32 elements), ~0 past kv_len.
            // The page offset steps by 8 positions from row to row.
            u32 at[KT / 8];
            {
                const int p0 = j * KT + r8;
                int page = p0 / page_size, off = p0 - page * page_size;
#pragma unroll
                for (int i = 0; i < KT / 8; ++i) {
                    if (i > 0) {
                        off += 8;
                        while (off >= page_size) { off -= page_size; ++page; }
                    }
                    at[i] = p0 + 8 * i < kv_len
                                ? ((u32)(__ldg(table + page) * num_kv_heads + kv_head) * page_size + off) * HD + c16 * 8
                                : ~0u;
                }
            }
            mbar_wait(emptyK + 8 * st, par ^ 1);  // the consumers are done with this stage's K
#pragma unroll
            for (int i = 0; i < KT / 8; ++i) {
                const bool ok = at[i] != ~0u;
                cp_async16(sK + st * S::TILE + dst + i * 1024, k_pool + (ok ? at[i] : 0u), ok);
            }
            cp_async_mbar_arrive(fullK + 8 * st);
            mbar_wait(emptyV + 8 * st, par ^ 1);  // ... and with its V
#pragma unroll
            for (int i = 0; i < KT / 8; ++i) {
                const bool ok = at[i] != ~0u;
                cp_async16(sV + st * S::TILE + dst + i * 1024, v_pool + (ok ? at[i] : 0u), ok);
            }
            cp_async_mbar_arrive(fullV + 8 * st);
        }
        cp_async_wait<0>();  // nothing in flight when the thread exits
        return;
    }

    // ----------------------------------------------------------------------- consumers
    setmaxnreg_inc<CONSUMER_REGS>();
    const int c = wg - 1;                              // rows 64 c .. 64 c + 63 of the block's
    const int warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const u32 sQc = sQ + c * S::Q_WG;

    // Q: this warpgroup's 64 rows x 16 chunks (rows past the sequence's are zero), then visible to the
    // tensor cores: fence (each thread, its own copies), then a barrier of the warpgroup.
#pragma unroll
    for (int i = 0; i < 64 * (HD / 8) / WG_THREADS; ++i) {
        const int idx = tid + i * WG_THREADS, r = idx >> 4, ch = idx & 15;
        const int R = row0 + 64 * c + r;
        const bool ok = R < rows;
        const size_t at = ok ? ((size_t)(q0 + R / G) * num_heads + kv_head * G + R % G) * HD + ch * 8 : 0;
        cp_async16(sQc + (ch >> 3) * S::HALF_Q + r * 128 + (((ch & 7) ^ (r & 7)) << 4), q + at, ok);
    }
    cp_async_commit();
    cp_async_wait<0>();
    fence_async_smem();
    named_bar_sync(BAR_Q0 + c, WG_THREADS);

    // The two rows this thread accumulates: 16 warp + g and + 8 of the warpgroup's; rows past the
    // sequence's take the block's last position (computed, never stored). A key tile needs the causal
    // mask only if it reaches past the warpgroup's first position.
    int qpos[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int R = row0 + 64 * c + 16 * warp + g + 8 * h;
        qpos[h] = R < rows ? first_pos + R / G : max_qpos;
    }
    const int wg_min_qpos = row0 + 64 * c < rows ? first_pos + (row0 + 64 * c) / G : max_qpos;

    // Descriptors: Q's k16 slice ks at + (ks / 4) half + (ks % 4) * 32 bytes; K's likewise in its tile.
    const unsigned long long dq = smem_desc(sQc);
    auto turn_wait = [&]() {
        if constexpr (PP) named_bar_sync(BAR_TURN0 + c, 2 * WG_THREADS);
    };
    auto turn_pass = [&](bool last) {
        if constexpr (PP) {
            if (!(c == 1 && last)) named_bar_arrive(BAR_TURN0 + (1 - c), 2 * WG_THREADS);
        }
    };
    auto issue_s = [&](float (&s)[64], int st) {
        const unsigned long long dk = smem_desc(sK + st * S::TILE);
        wgmma_ss<true>(s, dq, dk);
#pragma unroll
        for (int ks = 1; ks < HD / 16; ++ks) {
            const u32 off_q = (ks >> 2) * S::HALF_Q + (ks & 3) * 32, off_k = (ks >> 2) * S::HALF + (ks & 3) * 32;
            wgmma_ss<false>(s, dq + desc_encode(off_q), dk + desc_encode(off_k));
        }
    };

    if constexpr (PP) {
        if (c == 1) named_bar_arrive(BAR_TURN0, 2 * WG_THREADS);  // warpgroup 0 issues first
    }
    auto issue_pv = [&](float (&o)[64], const u32 (&pa)[KT / 16][4], int st) {
        const unsigned long long dv = desc_mn(sV + st * S::TILE);
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) wgmma_rs_tb(o, pa[kk], dv + desc_encode(kk * 2048));
    };

    float o[64], s[64];
#pragma unroll
    for (int i = 0; i < 64; ++i) o[i] = 0.f;
    fence_regs(o);  // zeroed here, not sunk by the compiler into the first wgmma group (ptxas would serialize)
    float m[2] = {-TI_INF, -TI_INF}, l[2] = {0.f, 0.f};
    u32 pa[KT / 16][4];  // P of the last key tile in bf16: the register A operand of its P V

    // Softmax of tile j's scores s (S_j, complete) into its probabilities P_j (s, float32), against a lazily
    // updated reference max m (scaled scores): a row's m moves to its running max only when that max exceeds m
    // by more than RESCALE_LOG2, and then every row of the warp moves (warp-uniform), l is rescaled here and O
    // (once the P V in flight has completed) by `alpha`; returns whether O must be. Between moves P = 2^(score -
    // m) stays below 2^RESCALE_LOG2, and O and l carry the same m, so O / l is the same softmax; most key tiles
    // past the first few skip the rescale. l is this thread's columns only, reduced over the row's 4 threads at
    // the end.
    auto softmax = [&](int j, float (&alpha)[2]) -> bool {
        // Mask (the diagonal tiles only). Accumulator s[4 jj + e]: row 16 warp + g + 8 (e >> 1) of the
        // warpgroup's, key j KT + 8 jj + 2 t + (e & 1).
        if (j * KT + KT - 1 > wg_min_qpos) {
#pragma unroll
            for (int jj = 0; jj < KT / 8; ++jj)
#pragma unroll
                for (int e = 0; e < 4; ++e) {
                    const int key = j * KT + 8 * jj + 2 * t + (e & 1);
                    if (key > qpos[e >> 1]) s[4 * jj + e] = -TI_INF;
                }
        }
        // Row maxima: trees of depth 5, not chains of 16.
        float mx[2];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            float u[8];
#pragma unroll
            for (int q = 0; q < 8; ++q)
                u[q] = fmaxf(fmaxf(s[4 * q + 2 * h], s[4 * q + 2 * h + 1]),
                             fmaxf(s[4 * (q + 8) + 2 * h], s[4 * (q + 8) + 2 * h + 1]));
#pragma unroll
            for (int w = 4; w > 0; w >>= 1)
#pragma unroll
                for (int q = 0; q < w; ++q) u[q] = fmaxf(u[q], u[q + w]);
            mx[h] = u[0];
        }
        float m_run[2];
        bool grow = false;
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            m_run[h] = fmaxf(m[h], mx[h] * scale_log2);
            grow |= m_run[h] > m[h] + RESCALE_LOG2;  // false while a row has no visible key (-inf > -inf)
        }
        const bool rescale = __any_sync(0xffffffffu, grow);
        if (rescale) {
#pragma unroll
            for (int h = 0; h < 2; ++h) {
                alpha[h] = fast_exp2(m[h] - (m_run[h] == -TI_INF ? 0.f : m_run[h]));  // 0 from m = -inf
                m[h] = m_run[h];
                l[h] *= alpha[h];
            }
        }
        float m_use[2], rowsum[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
#pragma unroll
        for (int h = 0; h < 2; ++h) m_use[h] = m[h] == -TI_INF ? 0.f : m[h];  // no visible key yet: avoid inf - inf
#pragma unroll
        for (int i = 0; i < 64; ++i) {
            const int h = (i >> 1) & 1;
            const float p = fast_exp2(fmaf(s[i], scale_log2, -m_use[h]));
            rowsum[h][(i >> 2) & 1] += p;
            s[i] = p;
        }
#pragma unroll
        for (int h = 0; h < 2; ++h) l[h] += rowsum[h][0] + rowsum[h][1];
        return rescale;
    };
    // P as the A operand: k16 slice kk = accumulator column blocks 2 kk and 2 kk + 1: a0 = (row g, keys 2t,
    // 2t+1), a1 = (row g + 8, same keys), a2 / a3 = the same 8 keys further.
    auto pack_p = [&]() {
#pragma unroll
        for (int kk = 0; kk < KT / 16; ++kk) {
            pa[kk][0] = pack_bf16x2(s[8 * kk + 0], s[8 * kk + 1]);
            pa[kk][1] = pack_bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
            pa[kk][2] = pack_bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
            pa[kk][3] = pack_bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
        }
    };

    // Tile 0: S_0, its softmax (O is still zero: no rescale), P_0.
    {
        mbar_wait(fullK, 0);
        fence_async_smem();
        turn_wait();
        wgmma_fence();
        issue_s(s, 0);
        wgmma_commit();
        turn_pass(false);
        wgmma_wait<0>();
        fence_regs(s);
        if (lane == 0) mbar_arrive(emptyK);
        float alpha[2];
        softmax(0, alpha);
        pack_p();
    }
    // Tile j >= 1: S_j and P V of tile j - 1 issued as two wgmma groups, S_j's first; the softmax of S_j runs
    // while P V_{j-1} is on the tensor cores (flash-attention 3's overlap within a warpgroup), then O is
    // rescaled if the softmax moved m, and P_j replaces P_{j-1}.
    for (int j = 1; j < n_tiles; ++j) {
        const int st = j % STAGES, sp = (j - 1) % STAGES;
        mbar_wait(fullK + 8 * st, (j / STAGES) & 1);
        mbar_wait(fullV + 8 * sp, ((j - 1) / STAGES) & 1);
        fence_async_smem();
        turn_wait();
        wgmma_fence();
        issue_s(s, st);
        wgmma_commit();
        issue_pv(o, pa, sp);
        wgmma_commit();
        turn_pass(false);
        wgmma_wait<1>();  // S_j has completed (P V_{j-1} may not have)
        fence_regs(s);
        if (lane == 0) mbar_arrive(emptyK + 8 * st);
        float alpha[2];
        const bool rescale = softmax(j, alpha);
        wgmma_wait<0>();  // P V_{j-1}
        fence_regs(o);
        if (lane == 0) mbar_arrive(emptyV + 8 * sp);
        if (rescale) {
#pragma unroll
            for (int i = 0; i < 64; ++i) o[i] *= alpha[(i >> 1) & 1];
        }
        pack_p();
    }
    // P V of the last tile.
    {
        const int sp = (n_tiles - 1) % STAGES;
        mbar_wait(fullV + 8 * sp, ((n_tiles - 1) / STAGES) & 1);
        fence_async_smem();
        turn_wait();
        wgmma_fence();
        issue_pv(o, pa, sp);
        wgmma_commit();
        turn_pass(true);
        wgmma_wait<0>();
        fence_regs(o);
        if (lane == 0) mbar_arrive(emptyV + 8 * sp);  // (nothing waits for it)
    }

#pragma unroll
    for (int h = 0; h < 2; ++h) {
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 1);
        l[h] += __shfl_xor_sync(0xffffffffu, l[h], 2);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) {
        const int R = row0 + 64 * c + 16 * warp + g + 8 * h;
        if (R >= rows) continue;
        const size_t row = (size_t)(q0 + R / G) * num_heads + kv_head * G + R % G;
        const float inv = l[h] > 0.f ? 1.f / l[h] : 0.f;
        u32 *dst = reinterpret_cast<u32 *>(out + row * HD);
#pragma unroll
        for (int jj = 0; jj < HD / 8; ++jj)
            dst[jj * 4 + t] = pack_bf16x2(o[4 * jj + 2 * h] * inv, o[4 * jj + 2 * h + 1] * inv);
    }
}

#else
template <int STAGES, bool PP>
__device__ __forceinline__ void attention_wg_body(const bf16 *, const bf16 *, const bf16 *, bf16 *, const int *,
                                                  const int *, const int *, int, int, int, int, int, float) {
    __trap();
}
#endif

// ============================================================================= kernel
// 2 stages, ping-pong between the consumer warpgroups. Arguments as attention_prefill.cu's `attention`
// (k_scale, v_scale, part_o, part_ml and total_q unused; num_splits must be 1). Grid (num_kv_heads,
// ceil(max_q_len * G / 128), num_seqs), block (384), dynamic shared memory WgSmem<2>::TOTAL (the
// launcher's WG_SMEM).
extern "C" __global__ void __launch_bounds__(THREADS, 1) attention_wg(
        const bf16 *__restrict__ q, const void *__restrict__ k_pool, const void *__restrict__ v_pool,
        const float *__restrict__ k_scale, const float *__restrict__ v_scale, bf16 *__restrict__ out,
        float *__restrict__ part_o, float *__restrict__ part_ml, const int *__restrict__ cu_q,
        const int *__restrict__ kv_lens, const int *__restrict__ block_tables, int bt_stride,
        int num_heads, int num_kv_heads, int page_size, int num_splits, int total_q, float scale_log2) {
    pdl_start();
    attention_wg_body<2, true>(q, static_cast<const bf16 *>(k_pool), static_cast<const bf16 *>(v_pool), out, cu_q,
                               kv_lens, block_tables, bt_stride, num_heads, num_kv_heads, page_size, num_splits,
                               scale_log2);
}
