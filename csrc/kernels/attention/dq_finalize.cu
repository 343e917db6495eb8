#include "dq_finalize.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>

namespace tk::attention {
namespace {

constexpr int THREADS = 256;
constexpr int BLOCKS_PER_SM = 8;
// Rounded in order: a block's share of a row group at a time, 8 octets (two 16-byte loads and a store each) a thread.
constexpr int64_t TILE_OCTETS = 8 * THREADS;

template <typename T>
__device__ __forceinline__ uint4 scaled_octet(float4 a, float4 b, float scale) {
    return make_uint4(rt::pack2<T>(a.x * scale, a.y * scale), rt::pack2<T>(a.z * scale, a.w * scale),
                      rt::pack2<T>(b.x * scale, b.y * scale), rt::pack2<T>(b.z * scale, b.w * scale));
}

// Eight elements per thread and step: two 16-byte loads, one 16-byte store.
template <typename T>
__global__ void __launch_bounds__(THREADS) dq_finalize_kernel(const float4* __restrict__ accum,
                                                              uint4* __restrict__ out, int64_t octets,
                                                              float scale) {
    pdl::start();
    for (int64_t i = int64_t(blockIdx.x) * THREADS + threadIdx.x; i < octets; i += int64_t(gridDim.x) * THREADS)
        out[i] = scaled_octet<T>(accum[2 * i], accum[2 * i + 1], scale);
}

// The same, each group of rows once its counter says the backward's blocks have added all of it (dq_finalize_order).
// Launched dependent on the backward, it starts once every backward block runs, on the multiprocessors its last wave
// leaves idle, and rounds the groups finished so far while that wave runs. So it waits for no grid before its reads
// (the counters' acquire orders them), and for the backward's completion only at its end: a grid that depends on
// this one then also finds the backward's dK and dV written. Groups are taken in the backward's order of finishing
// (ascending), tiles of a group spread over blocks.
template <typename T>
__global__ void __launch_bounds__(THREADS) dq_finalize_in_order_kernel(const float4* __restrict__ accum,
                                                                       uint4* __restrict__ out, int64_t octets,
                                                                       float scale, dq_finalize_order order,
                                                                       int64_t group_octets, int64_t group_tiles) {
    pdl::launch_dependents();
    const int64_t tiles = (octets / group_octets) * group_tiles;
    int64_t ready = -1;  // the last group this block has seen complete
    for (int64_t t = blockIdx.x; t < tiles; t += gridDim.x) {
        const int64_t group = t / group_tiles;
        if (group != ready) {  // the same in every thread of the block
            // One thread polls (hundreds of thousands polling would crowd the backward's L2 traffic); the barrier
            // then orders the other threads' loads after its acquire.
            if (threadIdx.x == 0)
                while (sync::count_acquire(order.done + group) < order.target) __nanosleep(500);
            __syncthreads();
            ready = group;
        }
        const int64_t begin = group * group_octets + (t % group_tiles) * TILE_OCTETS;
        const int64_t end = std::min(begin + TILE_OCTETS, (group + 1) * group_octets);
        for (int64_t i = begin + threadIdx.x; i < end; i += THREADS)
            out[i] = scaled_octet<T>(__ldcg(accum + 2 * i), __ldcg(accum + 2 * i + 1), scale);
    }
    pdl::wait_prior_grid();
}

}  // namespace

const char* dq_finalize_unsupported(const float* accum, const void* out, int dtype, int64_t count,
                                    const dq_finalize_order& order) {
    if (dtype != int(dtype::bf16) && dtype != int(dtype::fp16)) return "dtype must be bfloat16 or float16";
    if (count < 0 || count % 8) return "count must be a non-negative multiple of 8";
    if (count > 0 && (accum == nullptr || out == nullptr || !is_aligned(accum, 16) || !is_aligned(out, 16)))
        return "accum and out must be 16-byte aligned";
    if (order.done != nullptr) {
        if (!is_aligned(order.done, 8)) return "the counters must be 8-byte aligned";
        if (order.group_elements <= 0 || order.group_elements % 8 || count % order.group_elements)
            return "group_elements must be a positive multiple of 8 that divides count";
    }
    return nullptr;
}

cudaError_t launch_dq_finalize(const float* accum, void* out, int dtype, int64_t count, float scale,
                               cudaStream_t stream, const dq_finalize_order& order) {
    if (dq_finalize_unsupported(accum, out, dtype, count, order) != nullptr) return cudaErrorInvalidValue;
    const int64_t octets = count / 8;
    if (octets == 0) return cudaSuccess;
    const int64_t most = int64_t(multiprocessor_count()) * BLOCKS_PER_SM;
    const auto* in = reinterpret_cast<const float4*>(accum);
    auto* dst = reinterpret_cast<uint4*>(out);
    const bool bf16 = dtype == int(dtype::bf16);
    if (order.done == nullptr) {
        const int64_t blocks = std::min<int64_t>((octets + THREADS - 1) / THREADS, most);
        auto kernel = bf16 ? dq_finalize_kernel<__nv_bfloat16> : dq_finalize_kernel<__half>;
        return launch_kernel(kernel, dim3(unsigned(blocks)), dim3(THREADS), 0, stream, 1, in, dst, octets, scale);
    }
    const int64_t group_octets = order.group_elements / 8;
    const int64_t group_tiles = (group_octets + TILE_OCTETS - 1) / TILE_OCTETS;
    const int64_t blocks = std::min<int64_t>((octets / group_octets) * group_tiles, most);
    auto kernel = bf16 ? dq_finalize_in_order_kernel<__nv_bfloat16> : dq_finalize_in_order_kernel<__half>;
    return launch_kernel(kernel, dim3(unsigned(blocks)), dim3(THREADS), 0, stream, 1, in, dst, octets, scale, order,
                         group_octets, group_tiles);
}

}  // namespace tk::attention
