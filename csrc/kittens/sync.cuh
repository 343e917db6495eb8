// mbarriers in shared memory: the producer/consumer handshake of every pipelined kernel.
// A barrier completes a phase when its expected arrivals (and expected TMA bytes) are in; waiters name the
// phase parity they wait for.
#pragma once

#include <cstdint>

namespace tk::sync {

struct barrier {
    uint64_t word;
};

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
    return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// One thread initialises; make it visible to the async proxy (TMA) and the block before use.
__device__ __forceinline__ void init(barrier& b, uint32_t arrivals) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_addr(&b)), "r"(arrivals));
}
__device__ __forceinline__ void fence_init() {
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

__device__ __forceinline__ void arrive(barrier& b) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.release.cta.shared::cta.b64 st, [%0];\n}" ::"r"(smem_addr(&b))
                 : "memory");
}

// Counts as this thread's arrival and announces `bytes` of TMA traffic that will complete on `b`.
__device__ __forceinline__ void arrive_expect_bytes(barrier& b, uint32_t bytes) {
    asm volatile("{\n.reg .b64 st;\nmbarrier.arrive.expect_tx.release.cta.shared::cta.b64 st, [%0], %1;\n}" ::"r"(
                     smem_addr(&b)),
                 "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ bool try_wait(barrier& b, uint32_t parity) {
    uint32_t done;
    asm volatile(
        "{\n.reg .pred p;\nmbarrier.try_wait.parity.acquire.cta.shared::cta.b64 p, [%1], %2;\nselp.u32 %0, 1, 0, p;\n}"
        : "=r"(done)
        : "r"(smem_addr(&b)), "r"(parity)
        : "memory");
    return done != 0;
}

__device__ __forceinline__ void wait(barrier& b, uint32_t parity) {
    while (!try_wait(b, parity)) {
    }
}

// Named barrier over `threads` threads (a multiple of 32), id 1..15 (0 is __syncthreads).
__device__ __forceinline__ void named_sync(int id, int threads) {
    asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(threads) : "memory");
}
// Counts this thread's arrival at named barrier `id` without waiting (the waiters use named_sync with the same
// total): how one warpgroup hands a turn to another.
__device__ __forceinline__ void named_arrive(int id, int threads) {
    asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(threads) : "memory");
}

// ---- flags in global memory between the blocks of one grid (gpu scope) ----

// Raises a flag after this thread's earlier writes (and those ordered before them, e.g. by a barrier).
__device__ __forceinline__ void flag_release(int* flag, int value) {
    asm volatile("st.release.gpu.global.s32 [%0], %1;" ::"l"(flag), "r"(value) : "memory");
}
// Reads a flag; this thread's later reads see what was written before it was raised.
__device__ __forceinline__ int flag_acquire(const int* flag) {
    int value;
    asm volatile("ld.acquire.gpu.global.s32 %0, [%1];" : "=r"(value) : "l"(flag) : "memory");
    return value;
}

// A count that several blocks (or grids) add to, each after its own writes, and another waits on: the add releases
// this thread's earlier writes; a reader that acquires a total sees every adder's.
__device__ __forceinline__ void count_release(unsigned long long* counter, unsigned long long add) {
    asm volatile("red.release.gpu.global.add.u64 [%0], %1;" ::"l"(counter), "l"(add) : "memory");
}
__device__ __forceinline__ unsigned long long count_acquire(const unsigned long long* counter) {
    unsigned long long value;
    asm volatile("ld.acquire.gpu.global.u64 %0, [%1];" : "=l"(value) : "l"(counter) : "memory");
    return value;
}

}  // namespace tk::sync

namespace tk::sync {

// ---- clusters (thread-block clusters, sm_90) ----

__device__ __forceinline__ uint32_t cluster_rank() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t cluster_id() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%clusterid.x;" : "=r"(r));
    return r;
}
__device__ __forceinline__ uint32_t cluster_count() {
    uint32_t r;
    asm volatile("mov.u32 %0, %%nclusterid.x;" : "=r"(r));
    return r;
}

// Every thread of every block of the cluster (release/acquire): orders barrier initialisation before peers use
// it, and keeps a block's shared memory alive until its peers are done with it.
__device__ __forceinline__ void cluster_sync() {
    asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;" ::: "memory");
}

// cluster_sync in two halves, for work between them: every block of a cluster arrives once it has started, and
// waits before its first access to a peer's shared memory (a peer's memory is only there once the peer runs).
__device__ __forceinline__ void cluster_arrive_relaxed() {
    asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;" ::: "memory"); }

// Two floats into cluster block `rank`'s shared memory at the offset of `local` (this block's own copy of it);
// visible to that block after a cluster_sync.
__device__ __forceinline__ void store_cluster(const void* local, uint32_t rank, float a, float b) {
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "st.shared::cluster.v2.f32 [remote], {%2, %3};\n}" ::"r"(smem_addr(local)),
        "r"(rank), "f"(a), "f"(b)
        : "memory");
}
__device__ __forceinline__ uint32_t cluster_size() {
    uint32_t n;
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
    return n;
}

// Arrive on the barrier at the same shared-memory offset in cluster block `rank` (this block's own too), with
// release semantics at block scope, which is what freeing a pipeline stage needs: the arriving thread read the
// stage only through wgmma that it has already waited for. Release at cluster scope (.release.cluster) made
// every such arrive wait like a fence and ran the two-block GEMM at 0.4x (benchmarks/NOTES.md).
__device__ __forceinline__ void arrive_cluster(barrier& b, uint32_t rank) {
    asm volatile(
        "{\n.reg .b32 remote;\nmapa.shared::cluster.u32 remote, %0, %1;\n"
        "mbarrier.arrive.shared::cluster.b64 _, [remote];\n}" ::"r"(smem_addr(&b)),
        "r"(rank)
        : "memory");
}

}  // namespace tk::sync
