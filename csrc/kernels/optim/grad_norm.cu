// The squared global norm of many tensors (gradient clipping's), a read-only pass: each thread keeps four 16-byte
// loads in flight and adds their squares in fp32; each block leaves one partial sum, and a last one-block launch
// adds the partials in index order. No atomics, so the bits repeat on one GPU; the table of tensors is the kernel's
// parameter, as in adamw.cu, so a launch can be captured in a graph.
#include "grad_norm.h"
#include "../../kittens/kittens.cuh"
#include "../../kittens/multi_tensor.cuh"

#include <algorithm>

namespace tk::optim {
namespace {

constexpr int THREADS = 256;
constexpr int BATCH = 256;      // tensors per launch
constexpr int UNROLL = 4;       // 16-byte loads a thread has in flight
constexpr int MAX_GRID = 2048;  // blocks (partial sums) per launch: more than fit on the GPU at once
constexpr int FINISH_THREADS = 1024;

struct batch {
    const void* tensor[BATCH];
    chunk_index<BATCH> index;  // aligned: the tensor starts on a 16-byte boundary
    float* partials;           // this launch's: one per block
};

template <typename T> constexpr int chunk_elems = THREADS * UNROLL * vec16_elems<T>;

template <typename T>
__global__ void __launch_bounds__(THREADS) sq_norm_kernel(const __grid_constant__ batch b) {
    constexpr int V = vec16_elems<T>, CHUNK = chunk_elems<T>;
    pdl::start();
    float acc = 0.f;
    const int64_t chunks = b.index.chunks();
    int t = 0;  // chunks are taken in increasing order, so the tensor index only moves forward
    for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
        const auto at = b.index.template locate<CHUNK>(c, t);
        const int n = at.n;
        const T* x = static_cast<const T*>(b.tensor[t]) + at.start;
        if (n == CHUNK && at.aligned) {
            packed<T, V> r[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) r[u] = load_packed<T, V>(x + (u * THREADS + threadIdx.x) * V);
#pragma unroll
            for (int u = 0; u < UNROLL; ++u)
#pragma unroll
                for (int j = 0; j < V; ++j) {
                    const float f = to_float(r[u].v[j]);
                    acc = fmaf(f, f, acc);
                }
        } else {  // a tensor's last chunk, or a tensor off 16 bytes
            for (int i = threadIdx.x; i < n; i += THREADS) {
                const float f = to_float(x[i]);
                acc = fmaf(f, f, acc);
            }
        }
    }
    __shared__ float slots[THREADS / 32];
    acc = block_sum<THREADS>(acc, slots);
    if (threadIdx.x == 0) b.partials[blockIdx.x] = acc;
}

__global__ void __launch_bounds__(FINISH_THREADS) sq_norm_finish(const float* partials, int64_t n, float* out,
                                                                 bool accumulate) {
    pdl::start();
    float acc = 0.f;
    for (int64_t i = threadIdx.x; i < n; i += FINISH_THREADS) acc += partials[i];
    __shared__ float slots[FINISH_THREADS / 32];
    acc = block_sum<FINISH_THREADS>(acc, slots);
    if (threadIdx.x == 0) *out = accumulate ? *out + acc : acc;
}

template <typename T>
cudaError_t launch_typed(const sq_norm_args& a, cudaStream_t stream) {
    constexpr int CHUNK = chunk_elems<T>;
    constexpr auto kernel = sq_norm_kernel<T>;
    int grid_cap = resident_blocks<kernel>(THREADS, 0);
    if (grid_cap <= 0) grid_cap = 8 * multiprocessor_count();
    grid_cap = std::min(grid_cap, MAX_GRID);
    batch b;
    int64_t written = 0;  // partials so far, packed one launch after another
    const cudaError_t e = for_each_batch<BATCH>(a.count, cudaSuccess, [&](int first, int count) -> cudaError_t {
        b.index.clear();
        for (int i = 0; i < count; ++i) {
            b.tensor[i] = a.tensors[first + i];
            b.index.add(a.numels[first + i], CHUNK, is_aligned(a.tensors[first + i], 16));
        }
        const int64_t chunks = b.index.chunks();
        if (chunks == 0) return cudaSuccess;
        const int grid = static_cast<int>(std::min<int64_t>(chunks, grid_cap));
        b.partials = a.partials + written;
        written += grid;
        return launch_kernel(kernel, dim3(grid), dim3(THREADS), 0, stream, 1, b);
    });
    if (e != cudaSuccess) return e;
    return launch_kernel(sq_norm_finish, dim3(1), dim3(FINISH_THREADS), 0, stream, 1,
                         static_cast<const float*>(a.partials), written, a.out, a.accumulate);
}

}  // namespace

int64_t sq_norm_workspace(int count) {
    return count <= 0 ? 0 : static_cast<int64_t>((count + BATCH - 1) / BATCH) * MAX_GRID;
}

const char* sq_norm_unsupported(const sq_norm_args& a) {
    if (a.dtype != int(dtype::bf16) && a.dtype != int(dtype::fp16) && a.dtype != int(dtype::fp32))
        return "dtype must be bfloat16, float16 or float32";
    if (a.count < 0) return "the tensor count must not be negative";
    if (a.count > 0 && (a.tensors == nullptr || a.numels == nullptr)) return "the tensor list is needed";
    if (a.out == nullptr) return "the output is needed";
    if (a.partials_size < sq_norm_workspace(a.count)) return "the workspace is smaller than sq_norm_workspace(count)";
    if (a.partials_size > 0 && a.partials == nullptr) return "the workspace is needed";
    for (int i = 0; i < a.count; ++i) {
        if (a.numels[i] < 0) return "element counts must not be negative";
        if (a.numels[i] > 0 && a.tensors[i] == nullptr) return "a tensor with elements has a null pointer";
    }
    return nullptr;
}

cudaError_t launch_sq_norm(const sq_norm_args& a, cudaStream_t stream) {
    if (sq_norm_unsupported(a) != nullptr) return cudaErrorInvalidValue;
    switch (dtype(a.dtype)) {
        case dtype::bf16: return launch_typed<__nv_bfloat16>(a, stream);
        case dtype::fp16: return launch_typed<__half>(a, stream);
        default: return launch_typed<float>(a, stream);
    }
}

}  // namespace tk::optim
