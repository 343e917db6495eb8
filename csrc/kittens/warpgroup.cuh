// Warpgroup scope: 4 consecutive warps (128 threads) that issue wgmma together, and register reallocation
// between producer and consumer warpgroups (setmaxnreg, sm_90a).
#pragma once

namespace tk::warpgroup {

constexpr int threads = 128;

__device__ __forceinline__ int index() { return threadIdx.x / threads; }
__device__ __forceinline__ int thread() { return threadIdx.x % threads; }
// index() as a warp-uniform value: broadcast from lane 0, ptxas can keep it (and the shared-memory addresses and
// wgmma descriptors derived from it) in uniform registers. Call with the whole warp converged.
__device__ __forceinline__ int uniform_index() { return __shfl_sync(0xffffffffu, index(), 0); }

// Registers per thread of a block of `threads` threads that fills an SM alone (ptxas's limit under
// __launch_bounds__(threads, 1): the register file over the threads, in steps of 8).
constexpr int launch_registers(int threads) { return (65536 / threads) / 8 * 8; }
// setmaxnreg only moves registers within the block's launch allocation: a split that asks for more makes the
// increasing warpgroups wait forever. Kernels static_assert their split with this.
constexpr bool register_split_fits(int producer_groups, int producer_registers, int consumer_groups,
                                   int consumer_registers) {
    return producer_groups * producer_registers + consumer_groups * consumer_registers <=
           (producer_groups + consumer_groups) * launch_registers((producer_groups + consumer_groups) * threads);
}

template <int Registers>
__device__ __forceinline__ void decrease_registers() {
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;" ::"n"(Registers));
}
template <int Registers>
__device__ __forceinline__ void increase_registers() {
    asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;" ::"n"(Registers));
}

}  // namespace tk::warpgroup
