// Thread-block cluster helpers (sm_90) shared by the split-K GEMMs (gemm_swap.cu, gemm_tma.cu): the
// block's rank in its cluster, cluster-wide barriers, and loads from and stores into another block's shared
// memory (distributed shared memory: mapa + ld.shared::cluster, st.async).
#pragma once
#include "common.cuh"

__device__ __forceinline__ int cluster_rank() {
    u32 r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return (int)r;
}

// Every non-exited thread of every block of the cluster; release/acquire orders the shared-memory writes
// before it with the reads after it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\n\tbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// Every non-exited thread of every block of the cluster has arrived; no memory ordering (a release arrive is a
// GPU-wide memory barrier on sm_90, which waits for every earlier global store of the block to complete).
__device__ __forceinline__ void cluster_sync_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;\n\tbarrier.cluster.wait.aligned;" ::: "memory");
}

// The address, in the cluster's shared window, of this shared-memory address in the block of rank `rank`.
__device__ __forceinline__ u32 cluster_addr(u32 local, int rank) {
    u32 remote;
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(remote) : "r"(local), "r"(rank));
    return remote;
}

// 16 bytes into the shared memory of a block of the cluster (`remote`, a cluster_addr), counted as 16 transaction
// bytes on that block's mbarrier (`remote_bar`, a cluster_addr): the receiver learns of it through its barrier,
// with no fence on either side.
__device__ __forceinline__ void st_async_f4(u32 remote, float4 v, u32 remote_bar) {
    asm volatile("st.async.shared::cluster.mbarrier::complete_tx::bytes.v4.f32 [%0], {%1, %2, %3, %4}, [%5];"
                 ::"r"(remote), "f"(v.x), "f"(v.y), "f"(v.z), "f"(v.w), "r"(remote_bar) : "memory");
}

// The float2 at this shared-memory address in the block of cluster rank `rank`.
__device__ __forceinline__ float2 ld_cluster_f2(u32 local, int rank) {
    float2 v;
    asm volatile("ld.shared::cluster.v2.f32 {%0, %1}, [%2];"
                 : "=f"(v.x), "=f"(v.y) : "r"(cluster_addr(local, rank)) : "memory");
    return v;
}
