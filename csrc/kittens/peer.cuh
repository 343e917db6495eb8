// Memory shared with other GPUs of the node (NVLink peer mappings): system-scope flags and a timer.
//
// A producer writes data (plain stores, local or into a peer's mapping), makes the whole block's writes
// visible (`publish`), then stores a flag; a consumer polls the flag with acquire semantics, then the block
// reads. Flags are monotonically increasing 64-bit sequence numbers, so they never need resetting.
#pragma once

#include <cstdint>

namespace tk::peer {

__device__ __forceinline__ uint64_t load_acquire(const uint64_t* p) {
    uint64_t v;
    asm volatile("ld.acquire.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}

__device__ __forceinline__ void store_release(uint64_t* p, uint64_t v) {
    asm volatile("st.release.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// Nanoseconds (the GPU's global timer: comparable across blocks of one GPU, coarse but monotonic).
__device__ __forceinline__ uint64_t now_ns() {
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// Called by every thread of the block after its share of the writes: one thread then orders all of them
// before whatever it stores next (a flag) for observers on any GPU.
__device__ __forceinline__ void publish_block_writes() {
    __syncthreads();
    if (threadIdx.x == 0) __threadfence_system();
}

}  // namespace tk::peer
