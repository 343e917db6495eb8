// Register tiles of one warpgroup, in the layout wgmma gives and takes, and the row-wise operations that
// attention's online softmax needs (row max, row sum, broadcasts), plus the conversion that feeds an fp32
// result back into wgmma as a 16-bit A operand held in registers (S = Q K^T -> P -> P V without shared memory).
//
// Layout (wgmma's m64nN accumulator): warp w of the warpgroup owns rows 16w .. 16w + 15; lane l holds rows
// 16w + l/4 ("top") and 16w + l/4 + 8 ("bottom"), columns 8j + 2(l%4) + {0, 1} for j < N/8. Register d[i] is
// row top/bottom by bit 1 of i, column 8(i/4) + 2(l%4) + (i&1): see wgmma::accumulator_position.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace tk::rt {

// A warpgroup's 64 x N fp32 tile (N a multiple of 16).
template <int N>
struct acc_tile {
    static_assert(N % 16 == 0 && N >= 16 && N <= 256, "wgmma N: a multiple of 16 up to 256");
    static constexpr int rows = 64, cols = N, regs = N / 2;
    float d[N / 2];
};

// One value per row of a 64-row tile: each thread keeps the values of its two rows.
struct row_vec {
    float top, bottom;
};

// A 64 x K tile of 16-bit elements as wgmma's A operand in registers: per 16-deep K slice, four 32-bit
// registers of two elements each (rows top/bottom x columns 2(l%4) and 2(l%4) + 8 of the slice).
template <typename T, int K>
struct a_operand {
    static_assert(sizeof(T) == 2 && K % 16 == 0, "16-bit elements, whole 16-deep slices");
    static constexpr int slices = K / 16;
    uint32_t r[K / 16][4];
};

// ---- element positions ----
__device__ __forceinline__ int lane() { return threadIdx.x & 31; }
// Row (0..63) of this thread's top (bottom = top + 8) row in the warpgroup's tile.
__device__ __forceinline__ int top_row() { return ((threadIdx.x / 32) & 3) * 16 + lane() / 4; }
__device__ __forceinline__ bool is_bottom(int i) { return (i & 2) != 0; }
__device__ __forceinline__ int column(int i) { return (i / 4) * 8 + (lane() & 3) * 2 + (i & 1); }
// column(i) - column(0): the same in every lane, so a mask compares register i against one bound per row (the
// bound less column(0)) instead of each element's own column.
__host__ __device__ constexpr int column_offset(int i) { return (i / 4) * 8 + (i & 1); }

// ---- whole-tile maps (destination first) ----
template <int N>
__device__ __forceinline__ void fill(acc_tile<N>& dst, float value) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) dst.d[i] = value;
}
template <int N>
__device__ __forceinline__ void mul(acc_tile<N>& dst, const acc_tile<N>& src, float factor) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) dst.d[i] = src.d[i] * factor;
}
template <int N, typename F>
__device__ __forceinline__ void map(acc_tile<N>& dst, const acc_tile<N>& src, F f) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) dst.d[i] = f(src.d[i]);
}
// dst = f(src, row value) with the row's value broadcast along the row.
template <int N, typename F>
__device__ __forceinline__ void map_rows(acc_tile<N>& dst, const acc_tile<N>& src, const row_vec& v, F f) {
#pragma unroll
    for (int i = 0; i < N / 2; ++i) dst.d[i] = f(src.d[i], is_bottom(i) ? v.bottom : v.top);
}
template <int N>
__device__ __forceinline__ void sub_rows(acc_tile<N>& dst, const acc_tile<N>& src, const row_vec& v) {
    map_rows(dst, src, v, [](float x, float r) { return x - r; });
}
template <int N>
__device__ __forceinline__ void mul_rows(acc_tile<N>& dst, const acc_tile<N>& src, const row_vec& v) {
    map_rows(dst, src, v, [](float x, float r) { return x * r; });
}
template <int N>
__device__ __forceinline__ void div_rows(acc_tile<N>& dst, const acc_tile<N>& src, const row_vec& v) {
    map_rows(dst, src, v, [](float x, float r) { return x / r; });
}

// ---- row reductions: the four lanes of a quad share rows, so a row's value is reduced over the thread's
// columns and then across the quad (lanes l ^ 1, l ^ 2). Every lane of the quad gets the result. ----
// A thread's columns are reduced as up to four interleaved partial chains per row, each starting from its first
// value (op's identity is not needed): one chain of N / 4 dependent operations is what the softmax would wait for
// before its exponents.
template <int N, typename Op>
__device__ __forceinline__ void reduce_rows(row_vec& dst, const acc_tile<N>& src, Op op) {
    constexpr int P = N / 8 >= 4 ? 4 : N / 8;  // partials per row: a row has 2 values per 8 columns
    float top_part[P], bottom_part[P];
#pragma unroll
    for (int i = 0; i < N / 2; ++i) {
        float& part = is_bottom(i) ? bottom_part[(i / 4) % P] : top_part[(i / 4) % P];
        part = i < 4 * P && (i & 1) == 0 ? src.d[i] : op(part, src.d[i]);
    }
    float top = top_part[0], bottom = bottom_part[0];
#pragma unroll
    for (int k = 1; k < P; ++k) {
        top = op(top, top_part[k]);
        bottom = op(bottom, bottom_part[k]);
    }
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {
        top = op(top, __shfl_xor_sync(0xffffffffu, top, offset));
        bottom = op(bottom, __shfl_xor_sync(0xffffffffu, bottom, offset));
    }
    dst = {top, bottom};
}
template <int N>
__device__ __forceinline__ void row_max(row_vec& dst, const acc_tile<N>& src) {
    reduce_rows(dst, src, [](float a, float b) { return fmaxf(a, b); });
}
template <int N>
__device__ __forceinline__ void row_sum(row_vec& dst, const acc_tile<N>& src) {
    reduce_rows(dst, src, [](float a, float b) { return a + b; });
}

// ---- conversions ----
template <typename T>
__device__ __forceinline__ uint32_t pack2(float lo, float hi) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    } else {
        __half2 v = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t*>(&v);
    }
}

// The reverse of pack2: a register's two 16-bit elements as floats (low half first).
template <typename T>
__device__ __forceinline__ float2 unpack2(uint32_t packed) {
    if constexpr (std::is_same_v<T, __nv_bfloat16>)
        return __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&packed));
    else
        return __half22float2(*reinterpret_cast<const __half2*>(&packed));
}

// Warp-wide store of four 8 x 8 matrices of 16-bit elements from registers to shared memory (stmatrix): register k
// of lane l holds row l/4, columns 2(l%4) and 2(l%4) + 1 of matrix k (packed, low half first: the accumulator's
// layout per 8-column group and 8-row half), and lane 8k + r gives the shared address of row r of matrix k, whose
// 16 bytes are contiguous (one chunk of a 128-byte swizzle). One instruction instead of 16 32-bit stores per lane.
__device__ __forceinline__ void store_matrices_x4(uint32_t row_address, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(row_address), "r"(r0),
                 "r"(r1), "r"(r2), "r"(r3)
                 : "memory");
}

__device__ __forceinline__ void load_matrices_x4(uint32_t row_address, uint32_t& r0, uint32_t& r1, uint32_t& r2,
                                                 uint32_t& r3) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r0), "=r"(r1), "=r"(r2), "=r"(r3)
                 : "r"(row_address)
                 : "memory");
}

// An fp32 accumulator tile (64 x K) as a 16-bit A operand: the accumulator's 8 values of each 16-column slice
// sit exactly where the A fragment wants them, so this is a pairwise rounding with no data movement.
template <typename T, int K>
__device__ __forceinline__ void to_a_operand(a_operand<T, K>& dst, const acc_tile<K>& src) {
#pragma unroll
    for (int j = 0; j < K / 16; ++j) {
#pragma unroll
        for (int q = 0; q < 4; ++q) dst.r[j][q] = pack2<T>(src.d[8 * j + 2 * q], src.d[8 * j + 2 * q + 1]);
    }
}

}  // namespace tk::rt
