// Register accumulators to shared-memory panels, the way TMA stores read them: a warpgroup's fp32 fragment is
// rounded to 16 bits and written with stmatrix (four 8 x 8 matrices per instruction) into 64 x 64 panels in the
// 128-byte swizzle. The GEMM epilogue, the attention forward's O and the tile library's test share it.
#pragma once

#include <cstdint>

#include "register_tile.cuh"
#include "tma.cuh"

namespace tk::rt {

// The values as they are (the `pair` of store_swizzled without a bias or scale).
struct as_is {
    __device__ __forceinline__ float2 operator()(int, float x, float y) const { return make_float2(x, y); }
};

// Columns [col0, col0 + COLS) of a warpgroup's 64 x N accumulator fragment d (wgmma's layout; col0 and COLS
// multiples of 16, col0 a compile-time constant where the caller unrolls) to shared memory: fragment row r lands in
// row row0 + r of the panel `panel(c)` returns for fragment column c (the panel's generic address; one panel per 64
// columns), at column c % 64. `pair(i, d[i], d[i + 1])` gives the two values to round (a bias, say).
// Matrices per instruction: (8-column group g, top rows), (g, bottom), (g + 1, top), (g + 1, bottom): the
// accumulator's four registers of a 16-column slice in order; lane 8m + r names row r of matrix m.
template <typename T, int COLS, int N, typename Panel, typename Pair = as_is>
__device__ __forceinline__ void store_swizzled(const float (&d)[N / 2], int col0, int row0, Panel panel,
                                               Pair pair = {}) {
    static_assert(COLS % 16 == 0 && COLS <= N, "whole 16-column slices of the fragment");
    const int lane = threadIdx.x & 31, m = lane / 8;
    const int row = row0 + ((threadIdx.x / 32) & 3) * 16 + (m & 1) * 8 + (lane & 7);
#pragma unroll
    for (int group = 0; group < COLS / 8; group += 2) {
        uint32_t r[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = (col0 / 8 + group + k / 2) * 4 + (k & 1) * 2;
            const float2 v = pair(i, d[i], d[i + 1]);
            r[k] = pack2<T>(v.x, v.y);
        }
        const int col = col0 + (group + m / 2) * 8;  // the first column of this lane's matrix
        store_matrices_x4(static_cast<uint32_t>(__cvta_generic_to_shared(
                              panel(col) + tma::swizzled_offset_128b(row, col % 64))),
                          r[0], r[1], r[2], r[3]);
    }
}

}  // namespace tk::rt
