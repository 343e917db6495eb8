#include "dq_finalize.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>

namespace tk::attention {
namespace {

constexpr int THREADS = 256;
constexpr int BLOCKS_PER_SM = 8;

// Eight elements per thread and step: two 16-byte loads, one 16-byte store.
template <typename T>
__global__ void __launch_bounds__(THREADS) dq_finalize_kernel(const float4* __restrict__ accum,
                                                              uint4* __restrict__ out, int64_t octets,
                                                              float scale) {
    pdl::start();
    for (int64_t i = int64_t(blockIdx.x) * THREADS + threadIdx.x; i < octets; i += int64_t(gridDim.x) * THREADS) {
        const float4 a = accum[2 * i], b = accum[2 * i + 1];
        out[i] = make_uint4(rt::pack2<T>(a.x * scale, a.y * scale), rt::pack2<T>(a.z * scale, a.w * scale),
                            rt::pack2<T>(b.x * scale, b.y * scale), rt::pack2<T>(b.z * scale, b.w * scale));
    }
}

}  // namespace

const char* dq_finalize_unsupported(const float* accum, const void* out, int dtype, int64_t count) {
    if (dtype != int(dtype::bf16) && dtype != int(dtype::fp16)) return "dtype must be bfloat16 or float16";
    if (count < 0 || count % 8) return "count must be a non-negative multiple of 8";
    if (count > 0 && (accum == nullptr || out == nullptr || !is_aligned(accum, 16) || !is_aligned(out, 16)))
        return "accum and out must be 16-byte aligned";
    return nullptr;
}

cudaError_t launch_dq_finalize(const float* accum, void* out, int dtype, int64_t count, float scale,
                               cudaStream_t stream) {
    if (dq_finalize_unsupported(accum, out, dtype, count) != nullptr) return cudaErrorInvalidValue;
    const int64_t octets = count / 8;
    if (octets == 0) return cudaSuccess;
    const int64_t blocks = std::min<int64_t>((octets + THREADS - 1) / THREADS,
                                             int64_t(multiprocessor_count()) * BLOCKS_PER_SM);
    const auto* in = reinterpret_cast<const float4*>(accum);
    auto* dst = reinterpret_cast<uint4*>(out);
    auto kernel = dtype == int(dtype::bf16) ? dq_finalize_kernel<__nv_bfloat16> : dq_finalize_kernel<__half>;
    return launch_kernel(kernel, dim3(unsigned(blocks)), dim3(THREADS), 0, stream, 1, in, dst, octets, scale);
}

}  // namespace tk::attention
