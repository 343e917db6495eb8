// The embedding's weight gradient without atomics: the ids come sorted (stably, by the caller), so each output row
// finds its run of positions by binary search and sums their gradient rows in position order, in fp32, in
// registers; rows no token names are written zero by the same pass. One pass over the output, which is most of the
// bytes (a 128256 x 2048 bf16 gradient is 525 MB against 33 MB of incoming rows for 8192 tokens), where the
// fuser's version zeroes an fp32 copy, adds into it and converts it (three passes over 1 GB).
#include "backward.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>

namespace tk::embedding {
namespace {

// One warp a row, eight rows a block: each row's search and stores are a chain of dependent loads, so many rows
// must be in flight (a block a row, looping over a resident grid, ran at 0.8 TB/s on an H200).
constexpr int WARPS = 8, THREADS = 32 * WARPS;

// First i in [0, n) with sorted[i] >= v (n if none).
__device__ __forceinline__ int64_t lower_bound(const int64_t* __restrict__ sorted, int64_t n, int64_t v) {
    int64_t lo = 0, hi = n;
    while (lo < hi) {
        const int64_t mid = (lo + hi) / 2;
        if (__ldg(sorted + mid) < v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

// One warp per output row (grid-stride over rows); each lane owns VEC-wide column groups.
template <typename T, int VEC>
__global__ void __launch_bounds__(THREADS) backward_kernel(const backward_args a) {
    const T* __restrict__ grad = static_cast<const T*>(a.grad);
    T* __restrict__ out = static_cast<T*>(a.out);
    const int lane = threadIdx.x & 31;
    pdl::start();
    for (int64_t v = int64_t(blockIdx.x) * WARPS + threadIdx.x / 32; v < a.rows; v += int64_t(gridDim.x) * WARPS) {
        // Every lane searches (the same addresses: one request a warp); the run is [first, last).
        int64_t first = lower_bound(a.sorted, a.tokens, v), last = first;
        if (v != a.padding_idx)
            while (last < a.tokens && __ldg(a.sorted + last) == v) ++last;
        else
            first = last;
        T* row = out + v * a.dim;
        for (int64_t c = int64_t(lane) * VEC; c < a.dim; c += 32 * VEC) {
            float sum[VEC] = {};
            for (int64_t i = first; i < last; ++i) {
                const packed<T, VEC> g = load_packed<T, VEC>(grad + __ldg(a.order + i) * a.grad_stride + c);
#pragma unroll
                for (int j = 0; j < VEC; ++j) sum[j] += to_float(g.v[j]);
            }
            packed<T, VEC> r;
#pragma unroll
            for (int j = 0; j < VEC; ++j) r.v[j] = T(sum[j]);
            *reinterpret_cast<packed<T, VEC>*>(row + c) = r;
        }
    }
}

template <typename T>
cudaError_t launch_typed(const backward_args& a, cudaStream_t stream) {
    constexpr int V = vec16_elems<T>;
    const bool vector = a.dim % V == 0 && a.grad_stride % V == 0 && is_aligned(a.grad, 16) && is_aligned(a.out, 16);
    auto kernel = vector ? backward_kernel<T, V> : backward_kernel<T, 1>;
    const unsigned grid = unsigned(std::min<int64_t>((a.rows + WARPS - 1) / WARPS, int64_t(1) << 20));
    return launch_kernel(kernel, dim3(grid), dim3(THREADS), 0, stream, 1, a);
}

}  // namespace

const char* backward_unsupported(const backward_args& a) {
    if (a.dtype != int(dtype::bf16) && a.dtype != int(dtype::fp16) && a.dtype != int(dtype::fp32))
        return "dtype must be bfloat16, float16 or float32";
    if (a.tokens < 0 || a.rows < 0 || a.dim < 0) return "sizes must not be negative";
    if (a.tokens > 0 && a.dim > 0 && (a.grad == nullptr || a.sorted == nullptr || a.order == nullptr))
        return "grad, sorted ids and order are needed";
    if (a.rows > 0 && a.dim > 0 && a.out == nullptr) return "out is needed";
    if (a.tokens > 1 && a.grad_stride < a.dim) return "grad's rows overlap (row stride below the dim)";
    return nullptr;
}

cudaError_t launch_backward(const backward_args& a, cudaStream_t stream) {
    if (backward_unsupported(a) != nullptr) return cudaErrorInvalidValue;
    if (a.rows == 0 || a.dim == 0) return cudaSuccess;
    switch (dtype(a.dtype)) {
        case dtype::bf16: return launch_typed<__nv_bfloat16>(a, stream);
        case dtype::fp16: return launch_typed<__half>(a, stream);
        default: return launch_typed<float>(a, stream);
    }
}

}  // namespace tk::embedding
