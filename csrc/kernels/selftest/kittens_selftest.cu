// Single-primitive kernels for the GPU unit tests of the tile library; see kittens_selftest.h.
#include "kittens_selftest.h"
#include "../../kittens/kittens.cuh"

#include <type_traits>

namespace tk::selftest {
namespace {

using wgmma::major;

__device__ __forceinline__ int row_of(int i) { return rt::top_row() + (rt::is_bottom(i) ? 8 : 0); }

template <int N>
__global__ void __launch_bounds__(128) row_softmax_kernel(const float* in, float* out, float* row_max, float* row_sum) {
    __shared__ sv::shared_vec<float, 64> max_vec, sum_vec;
    rt::acc_tile<N> t;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) t.d[i] = in[row_of(i) * N + rt::column(i)];
    rt::row_vec m, l;
    rt::row_max(m, t);
    rt::sub_rows(t, t, m);
    rt::map(t, t, [](float x) { return expf(x); });
    rt::row_sum(l, t);
    rt::div_rows(t, t, l);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) out[row_of(i) * N + rt::column(i)] = t.d[i];
    sv::store_rows(max_vec, m);
    sv::store_rows(sum_vec, l);
    __syncthreads();
    rt::row_vec m2, l2;
    sv::load_rows(m2, max_vec);
    sv::load_rows(l2, sum_vec);
    if ((threadIdx.x & 3) == 0) {
        row_max[rt::top_row()] = m2.top;
        row_max[rt::top_row() + 8] = m2.bottom;
        row_sum[rt::top_row()] = l2.top;
        row_sum[rt::top_row() + 8] = l2.bottom;
    }
}

template <int N, typename T, major MB>
__global__ void __launch_bounds__(128) mma_rs_kernel(const float* a, const T* b, float* out) {
    using tile_t = wgmma::operand_tile<T, N, MB>;
    extern __shared__ uint8_t raw[];
    auto& tile = aligned_shared<tile_t>(raw);
    uint8_t* base = reinterpret_cast<uint8_t*>(tile.data);
    for (int e = threadIdx.x; e < N * 64; e += blockDim.x) {
        if constexpr (MB == major::k) {  // b: (N, 64) row-major; line `row` holds its 64 K elements
            const int row = e / 64, k = e % 64;
            *reinterpret_cast<T*>(base + tma::swizzled_offset_128b(row, k)) = b[row * 64 + k];
        } else {  // b: (64, N) row-major; panel n / 64, line k holds 64 N elements
            const int k = e / N, n = e % N;
            *reinterpret_cast<T*>(base + (n / 64) * tile_t::panel_bytes + tma::swizzled_offset_128b(k, n % 64)) =
                b[k * N + n];
        }
    }
    tma::fence_shared_to_async();  // thread writes -> wgmma's (async proxy) reads
    __syncthreads();

    rt::acc_tile<64> at;
#pragma unroll
    for (int i = 0; i < 32; ++i) at.d[i] = a[row_of(i) * 64 + rt::column(i)];
    rt::a_operand<T, 64> ap;
    rt::to_a_operand(ap, at);
    rt::acc_tile<N> d;
    wgmma::fence();
#pragma unroll
    for (int k16 = 0; k16 < 4; ++k16) wgmma::mma<N, T>(d.d, ap, k16, tile, 0, k16, k16 != 0);
    wgmma::commit();
    wgmma::wait<0>();
    wgmma::pin(d.d);
#pragma unroll
    for (int i = 0; i < N / 2; ++i) out[row_of(i) * N + rt::column(i)] = d.d[i];
}

template <typename T>
__global__ void __launch_bounds__(128) reduce_add_kernel(const __grid_constant__ CUtensorMap map, const T* src,
                                                         int row0, int col0) {
    constexpr int cols = 128 / sizeof(T);
    __shared__ alignas(128) T tile[64 * cols];
    for (int e = threadIdx.x; e < 64 * cols; e += blockDim.x) tile[e] = src[e];
    tma::fence_shared_to_async();
    __syncthreads();
    if (threadIdx.x == 0) {
        tma::store_add_2d(&map, tile, col0, row0);
        tma::store_commit();
        tma::store_wait();
    }
}

template <int N, typename T>
__global__ void __launch_bounds__(128) store_matrices_kernel(const float* in, T* out) {
    __shared__ alignas(1024) T tile[64 * N];  // N / 64 panels of 64 rows x 128 bytes, 128-byte swizzle
    uint8_t* base = reinterpret_cast<uint8_t*>(tile);
    rt::acc_tile<N> t;
#pragma unroll
    for (int i = 0; i < N / 2; ++i) t.d[i] = in[row_of(i) * N + rt::column(i)];
    rt::store_swizzled<T, N, N>(t.d, 0, 0, [&](int col) { return base + (col / 64) * 64 * 128; });
    __syncthreads();
    for (int e = threadIdx.x; e < 64 * N; e += blockDim.x) {
        const int rr = e / N, c = e % N;
        out[e] = *reinterpret_cast<const T*>(base + (c / 64) * 64 * 128 + tma::swizzled_offset_128b(rr, c % 64));
    }
}

template <typename T>
cudaError_t launch_store_matrices(const float* in, void* out, int cols, cudaStream_t stream) {
    T* o = static_cast<T*>(out);
    switch (cols) {
        case 64: store_matrices_kernel<64, T><<<1, 128, 0, stream>>>(in, o); break;
        case 128: store_matrices_kernel<128, T><<<1, 128, 0, stream>>>(in, o); break;
        case 256: store_matrices_kernel<256, T><<<1, 128, 0, stream>>>(in, o); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

// The reverse of store_matrices for a 16-bit A fragment: plain stores into 128-byte-swizzled panels, ldmatrix
// (rt::load_swizzled) into registers, and each register's two elements written where the fragment layout says.
template <int K, typename T>
__global__ void __launch_bounds__(128) load_matrices_kernel(const T* in, T* out) {
    __shared__ alignas(1024) T tile[64 * K];
    uint8_t* base = reinterpret_cast<uint8_t*>(tile);
    for (int e = threadIdx.x; e < 64 * K; e += blockDim.x) {
        const int r = e / K, c = e % K;
        *reinterpret_cast<T*>(base + (c / 64) * 64 * 128 + tma::swizzled_offset_128b(r, c % 64)) = in[e];
    }
    __syncthreads();
    rt::a_operand<T, K> a;
    rt::load_swizzled(a, 0, [&](int col) { return base + (col / 64) * 64 * 128; });
    const int lane = threadIdx.x & 31, top = rt::top_row();
#pragma unroll
    for (int slice = 0; slice < K / 16; ++slice)
#pragma unroll
        for (int k = 0; k < 4; ++k) {  // (top, c), (bottom, c), (top, c + 8), (bottom, c + 8)
            const int row = top + (k & 1) * 8, col = 16 * slice + (k / 2) * 8 + 2 * (lane & 3);
            const uint32_t r = a.r[slice][k];
            out[row * K + col] = *reinterpret_cast<const T*>(&r);
            out[row * K + col + 1] = *(reinterpret_cast<const T*>(&r) + 1);
        }
}

template <typename T>
cudaError_t launch_load_matrices(const void* in, void* out, int cols, cudaStream_t stream) {
    const T* i = static_cast<const T*>(in);
    T* o = static_cast<T*>(out);
    switch (cols) {
        case 64: load_matrices_kernel<64, T><<<1, 128, 0, stream>>>(i, o); break;
        case 128: load_matrices_kernel<128, T><<<1, 128, 0, stream>>>(i, o); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

template <int N, typename T, major MB>
cudaError_t launch_mma_rs(const float* a, const void* b, float* out, cudaStream_t stream) {
    constexpr int smem = sizeof(wgmma::operand_tile<T, N, MB>) + 1024;
    auto kernel = mma_rs_kernel<N, T, MB>;
    if (cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
        e != cudaSuccess)
        return e;
    kernel<<<1, 128, smem, stream>>>(a, static_cast<const T*>(b), out);
    return cudaGetLastError();
}

template <int N, typename T>
cudaError_t dispatch_major(const float* a, const void* b, float* out, bool b_mn_major, cudaStream_t stream) {
    return b_mn_major ? launch_mma_rs<N, T, major::mn>(a, b, out, stream)
                      : launch_mma_rs<N, T, major::k>(a, b, out, stream);
}

template <typename T>
cudaError_t dispatch_n(const float* a, const void* b, float* out, int n, bool b_mn_major, cudaStream_t stream) {
    switch (n) {
        case 64: return dispatch_major<64, T>(a, b, out, b_mn_major, stream);
        case 128: return dispatch_major<128, T>(a, b, out, b_mn_major, stream);
        case 256: return dispatch_major<256, T>(a, b, out, b_mn_major, stream);
        default: return cudaErrorInvalidValue;
    }
}

// Two sums a block with one set of slots, the second of the input's negation, written by every thread: the
// slots are free again once every thread has returned (the second sum's result checks the first's reuse).
template <int THREADS>
__global__ void __launch_bounds__(THREADS) block_sum_kernel(const float* in, float* out) {
    __shared__ float slots[THREADS / 32];
    const int64_t i = int64_t(blockIdx.x) * THREADS + threadIdx.x;
    const float first = tk::block_sum<THREADS>(in[i], slots);
    __syncthreads();
    const float second = tk::block_sum<THREADS>(-in[i], slots);
    out[i] = first == -second ? first : __int_as_float(0x7fc00001);  // a NaN that no sum gives
}

// failed_launch's kernel: never runs (its launch asks for more threads a block than a block may have).
__global__ void oversized_block_kernel(int* out) {
    pdl::start();
    if (out != nullptr) *out = int(threadIdx.x);
}

}  // namespace

cudaError_t block_sum(const float* in, float* out, int blocks, int threads, cudaStream_t stream) {
    if (blocks <= 0) return cudaErrorInvalidValue;
    switch (threads) {
        case 32: block_sum_kernel<32><<<blocks, 32, 0, stream>>>(in, out); break;
        case 256: block_sum_kernel<256><<<blocks, 256, 0, stream>>>(in, out); break;
        case 1024: block_sum_kernel<1024><<<blocks, 1024, 0, stream>>>(in, out); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

cudaError_t failed_launch(cudaStream_t stream) {
    return launch_kernel(oversized_block_kernel, dim3(1), dim3(2048), 0, stream, 1, static_cast<int*>(nullptr));
}

cudaError_t row_softmax(const float* in, float* out, float* row_max, float* row_sum, int cols, cudaStream_t stream) {
    switch (cols) {
        case 64: row_softmax_kernel<64><<<1, 128, 0, stream>>>(in, out, row_max, row_sum); break;
        case 128: row_softmax_kernel<128><<<1, 128, 0, stream>>>(in, out, row_max, row_sum); break;
        case 256: row_softmax_kernel<256><<<1, 128, 0, stream>>>(in, out, row_max, row_sum); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

cudaError_t mma_registers_a(const float* a, const void* b, float* out, int n, bool b_mn_major, int dtype,
                            cudaStream_t stream) {
    if (dtype == int(tk::dtype::bf16)) return dispatch_n<__nv_bfloat16>(a, b, out, n, b_mn_major, stream);
    if (dtype == int(tk::dtype::fp16)) return dispatch_n<__half>(a, b, out, n, b_mn_major, stream);
    return cudaErrorInvalidValue;
}

cudaError_t store_matrices(const float* in, void* out, int cols, int dtype, cudaStream_t stream) {
    if (dtype == int(tk::dtype::bf16)) return launch_store_matrices<__nv_bfloat16>(in, out, cols, stream);
    if (dtype == int(tk::dtype::fp16)) return launch_store_matrices<__half>(in, out, cols, stream);
    return cudaErrorInvalidValue;
}

cudaError_t load_matrices(const void* in, void* out, int cols, int dtype, cudaStream_t stream) {
    if (dtype == int(tk::dtype::bf16)) return launch_load_matrices<__nv_bfloat16>(in, out, cols, stream);
    if (dtype == int(tk::dtype::fp16)) return launch_load_matrices<__half>(in, out, cols, stream);
    return cudaErrorInvalidValue;
}

cudaError_t reduce_add(void* dst, const void* src, int dtype, int64_t rows, int64_t cols, int64_t stride, int row0,
                       int col0, cudaStream_t stream) {
    const bool fp32 = dtype == int(tk::dtype::fp32);
    if (!fp32 && dtype != int(tk::dtype::bf16)) return cudaErrorInvalidValue;
    const int element = fp32 ? 4 : 2;
    CUtensorMap map;
    if (tma::make_tensor_map_2d(&map, dst, fp32 ? CU_TENSOR_MAP_DATA_TYPE_FLOAT32 : CU_TENSOR_MAP_DATA_TYPE_BFLOAT16,
                                element, cols, rows, stride, 128 / element, 64, tma::swizzle::none) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    if (fp32)
        reduce_add_kernel<float><<<1, 128, 0, stream>>>(map, static_cast<const float*>(src), row0, col0);
    else
        reduce_add_kernel<__nv_bfloat16><<<1, 128, 0, stream>>>(map, static_cast<const __nv_bfloat16*>(src), row0,
                                                                 col0);
    return cudaGetLastError();
}

}  // namespace tk::selftest
