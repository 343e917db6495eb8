// thunder_tk tile library: scalar types, packed vectors and scoped reductions shared by every kernel.
// Later layers (register/shared tiles, TMA, wgmma) build on these names.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <atomic>
#include <cstdint>

namespace tk {

// ---------------------------------------------------------------------------------------------
// Element types. `dtype` is what crosses the binding; `scalar<dtype>` is the device type.
enum class dtype : int { bf16 = 0, fp16 = 1, fp32 = 2 };

template <dtype D> struct scalar;
template <> struct scalar<dtype::bf16> { using type = __nv_bfloat16; };
template <> struct scalar<dtype::fp16> { using type = __half; };
template <> struct scalar<dtype::fp32> { using type = float; };

__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_float(float x) { return x; }

// 2^x by the special-function unit (ex2.approx, flush-to-zero: about 2 ulp; exp2(-inf) = 0). Softmax's exponent.
__device__ __forceinline__ float exp2_approx(float x) {
    float y;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
    return y;
}

// Dynamic shared memory from its first 1024-byte boundary (what the 128-byte swizzle of TMA and wgmma needs), as a
// State&. The offset is added to the shared array itself: a round trip of the address through an integer loses its
// address space, and every access through the result then compiles to a generic load or store (LD.E / ST.E, on the
// long scoreboard, with a MEMBAR before each async-proxy fence) instead of LDS / STS. Size the allocation with
// 1023 bytes of slack.
template <typename State>
__device__ __forceinline__ State& aligned_shared(uint8_t* raw) {
    const uint32_t at = static_cast<uint32_t>(__cvta_generic_to_shared(raw));
    return *reinterpret_cast<State*>(raw + ((1024u - (at & 1023u)) & 1023u));
}

// Elements of T that fit one 16-byte access.
template <typename T> constexpr int vec16_elems = 16 / static_cast<int>(sizeof(T));

// A 16-byte (or narrower, N == 1) bundle of elements, loaded with one instruction when N * sizeof(T) == 16.
template <typename T, int N> struct alignas(N * sizeof(T)) packed {
    T v[N];
};

template <typename T, int N>
__device__ __forceinline__ packed<T, N> load_packed(const T* p) {
    return *reinterpret_cast<const packed<T, N>*>(p);
}

// ---------------------------------------------------------------------------------------------
// Scopes. A `lanes<N>` group is N consecutive lanes of one warp (N a power of two <= 32);
// warp = lanes<32>. Reductions leave the result in every lane of the group.
template <int N> struct lanes {
    static_assert(N >= 1 && N <= 32 && (N & (N - 1)) == 0, "lane group must be a power of two <= 32");
    static constexpr int size = N;
    __device__ __forceinline__ static int rank() { return threadIdx.x & (N - 1); }
    // Index of this group among all groups of the block.
    __device__ __forceinline__ static int group_index() { return threadIdx.x / N; }

    __device__ __forceinline__ static float sum(float x) {
#pragma unroll
        for (int offset = N / 2; offset > 0; offset /= 2) x += __shfl_xor_sync(0xffffffffu, x, offset);
        return x;
    }
    __device__ __forceinline__ static float max(float x) {
#pragma unroll
        for (int offset = N / 2; offset > 0; offset /= 2) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, offset));
        return x;
    }
};
using warp = lanes<32>;

// The sum of `v` over a block of THREADS threads, in a fixed order (warps, then their sums in warp order), in every
// thread. `slots` is THREADS / 32 floats of shared memory, free again once every thread has returned.
template <int THREADS>
__device__ __forceinline__ float block_sum(float v, float (&slots)[THREADS / 32]) {
    static_assert(THREADS % 32 == 0 && THREADS <= 1024, "a block of whole warps");
    v = warp::sum(v);
    if ((threadIdx.x & 31) == 0) slots[threadIdx.x / 32] = v;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < THREADS / 32; ++w) total += slots[w];
    return total;
}

// ---------------------------------------------------------------------------------------------
// Host-side helpers shared by launchers.
int multiprocessor_count();  // of the current device, cached per device
constexpr int max_devices = 128;  // per-device caches in launchers are indexed by device id
int current_device();  // the current device's id, or -1 if there is none or it is >= max_devices

// Opts `Kernel` in to `bytes` of dynamic shared memory on the current device, once per device (the attribute
// belongs to the kernel in each device's context, so a second GPU in the process needs its own).
template <auto Kernel>
cudaError_t opt_in_shared_memory(int bytes) {
    static std::atomic<bool> ready[max_devices];
    const int device = current_device();
    if (device < 0) return cudaErrorInvalidDevice;
    if (ready[device].load(std::memory_order_acquire)) return cudaSuccess;
    const cudaError_t e = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (e == cudaSuccess) ready[device].store(true, std::memory_order_release);
    return e;
}

// Blocks of `Kernel` (`threads` threads, `smem_bytes` of dynamic shared memory) resident at once on the current
// device, all SMs together; cached per device. 0 on error. After opt_in_shared_memory for that size.
template <auto Kernel>
int resident_blocks(int threads, int smem_bytes) {
    static std::atomic<int> known[max_devices];
    const int device = current_device();
    if (device < 0) return 0;
    int blocks = known[device].load(std::memory_order_acquire);
    if (blocks == 0) {
        int per_sm = 0;
        if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, Kernel, threads, smem_bytes) != cudaSuccess)
            return 0;
        blocks = per_sm * multiprocessor_count();
        known[device].store(blocks, std::memory_order_release);
    }
    return blocks;
}

inline bool is_aligned(const void* p, std::size_t bytes) {
    return (reinterpret_cast<std::uintptr_t>(p) % bytes) == 0;
}

}  // namespace tk
