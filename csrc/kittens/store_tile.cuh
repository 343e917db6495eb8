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

namespace detail {
// Where this lane's stmatrix address points: lane 8m + r names row r of matrix m; odd m are the bottom 8 rows,
// m / 2 the second 8-column group of a slice.
struct stmatrix_lane {
    int row, m;
    __device__ __forceinline__ explicit stmatrix_lane(int row0) {
        const int lane = threadIdx.x & 31;
        m = lane / 8;
        row = row0 + ((threadIdx.x / 32) & 3) * 16 + (m & 1) * 8 + (lane & 7);
    }
    // The shared address of this lane's row of 8-column group `group + m / 2` from fragment column col0, in the
    // panel holding it, in the 128-byte swizzle (stmatrix and ldmatrix take the same per-lane row addresses).
    template <typename Panel>
    __device__ __forceinline__ uint32_t address(int col0, int group, Panel panel) const {
        const int col = col0 + (group + m / 2) * 8;  // the first column of this lane's matrix
        return static_cast<uint32_t>(__cvta_generic_to_shared(panel(col) + tma::swizzled_offset_128b(row, col % 64)));
    }
    // One stmatrix.x4: 8-column groups `group` and `group + 1` from fragment column col0 (one 16-column slice),
    // their four packed registers in matrix order, to the panel holding them.
    template <typename Panel>
    __device__ __forceinline__ void store(int col0, int group, Panel panel, uint32_t r0, uint32_t r1, uint32_t r2,
                                          uint32_t r3) const {
        store_matrices_x4(address(col0, group, panel), r0, r1, r2, r3);
    }
};
}  // namespace detail

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
    const detail::stmatrix_lane at(row0);
#pragma unroll
    for (int group = 0; group < COLS / 8; group += 2) {
        uint32_t r[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = (col0 / 8 + group + k / 2) * 4 + (k & 1) * 2;
            const float2 v = pair(i, d[i], d[i + 1]);
            r[k] = pack2<T>(v.x, v.y);
        }
        at.store(col0, group, panel, r[0], r[1], r[2], r[3]);
    }
}

// A 16-bit A fragment (a 64 x K tile already rounded, e.g. by to_a_operand) the same way: its registers per
// 16-column slice are in stmatrix's matrix order already.
template <typename T, int K, typename Panel>
__device__ __forceinline__ void store_swizzled(const a_operand<T, K>& a, int row0, Panel panel) {
    const detail::stmatrix_lane at(row0);
#pragma unroll
    for (int slice = 0; slice < K / 16; ++slice)
        at.store(0, slice * 2, panel, a.r[slice][0], a.r[slice][1], a.r[slice][2], a.r[slice][3]);
}

// Two 16-bit tiles u and v in the 128-byte swizzle (as TMA loads them; panels as store_swizzled's, row0 as there)
// updated in place from a warpgroup's 64 x N accumulator fragment d: for each fragment pair (d[i], d[i + 1]),
// fn(d[i], d[i + 1], u_pair, v_pair) replaces the packed 16-bit pairs of u and v at the same two positions
// (ldmatrix and stmatrix with the same lanes, so a thread rewrites only what it read).
template <int N, typename PanelU, typename PanelV, typename Fn>
__device__ __forceinline__ void update_swizzled_pairs(const float (&d)[N / 2], int row0, PanelU panel_u,
                                                      PanelV panel_v, Fn fn) {
    const detail::stmatrix_lane at(row0);
#pragma unroll
    for (int group = 0; group < N / 8; group += 2) {
        const uint32_t au = at.address(0, group, panel_u), av = at.address(0, group, panel_v);
        uint32_t u[4], v[4];
        load_matrices_x4(au, u[0], u[1], u[2], u[3]);
        load_matrices_x4(av, v[0], v[1], v[2], v[3]);
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = (group + k / 2) * 4 + (k & 1) * 2;
            fn(d[i], d[i + 1], u[k], v[k]);
        }
        store_matrices_x4(au, u[0], u[1], u[2], u[3]);
        store_matrices_x4(av, v[0], v[1], v[2], v[3]);
    }
}

// The reverse: rows [row0, row0 + 64) of 16-bit panels in the 128-byte swizzle (as TMA loads them) as a warpgroup's
// A fragment, K columns deep, with ldmatrix (the same lanes and matrix order as stmatrix above).
template <typename T, int K, typename Panel>
__device__ __forceinline__ void load_swizzled(a_operand<T, K>& a, int row0, Panel panel) {
    const detail::stmatrix_lane at(row0);
#pragma unroll
    for (int slice = 0; slice < K / 16; ++slice)
        load_matrices_x4(at.address(0, slice * 2, panel), a.r[slice][0], a.r[slice][1], a.r[slice][2], a.r[slice][3]);
}

}  // namespace tk::rt
