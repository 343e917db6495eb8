// Warpgroup scope: 4 consecutive warps (128 threads) that issue wgmma together, and register reallocation
// between producer and consumer warpgroups (setmaxnreg, sm_90a).
#pragma once

namespace tk::warpgroup {

constexpr int threads = 128;

__device__ __forceinline__ int index() { return threadIdx.x / threads; }
__device__ __forceinline__ int thread() { return threadIdx.x % threads; }

template <int Registers>
__device__ __forceinline__ void decrease_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void increase_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Registers));
}

}  // namespace tk::warpgroup
