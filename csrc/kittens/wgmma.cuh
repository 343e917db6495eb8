// Warpgroup matrix multiply (wgmma, sm_90a) on shared-memory tiles in the 128-byte swizzled layout that TMA
// writes. A tile type fixes its layout (K-major or MN-major) and can describe any 16-deep K slice of itself
// to the tensor cores, so kernels never hand-assemble descriptors.
#pragma once

#include <cstdint>

#include "common.cuh"
#include "register_tile.cuh"
#include "sync.cuh"
#include "wgmma_ops.cuh"

namespace tk::wgmma {

enum class major { k = 0, mn = 1 };

// Descriptor: start address, leading/stride byte offsets (all >> 4), swizzle mode 1 = 128 B. The low word holds
// the address and leading offset, the high word the stride offset and the mode.
__device__ __forceinline__ uint32_t descriptor_low(uint32_t smem_address, uint32_t lbo) {
    return ((smem_address & 0x3FFFF) >> 4) | (((lbo & 0x3FFFF) >> 4) << 16);
}
__device__ __forceinline__ constexpr uint32_t descriptor_high(uint32_t sbo) {
    return ((sbo & 0x3FFFF) >> 4) | (1u << 30);
}

// A Rows x 64 (MN x K) operand tile of 16-bit elements, as one TMA box pattern writes it.
//  K-major:  Rows lines of 64 K-elements (128 B), swizzled in 8-line (1024 B) atoms.
//  MN-major: Rows/64 panels; a panel is 64 lines of 64 MN-elements (one line per k), 8 KB.
// Both need the tile 1024-byte aligned.
template <typename T, int Rows, major M>
struct operand_tile {
    static_assert(sizeof(T) == 2, "16-bit operands");
    // MN-major panels are 64 rows wide; K-major tiles need whole 8-line swizzle atoms (a wgmma B of N = 16 or 32).
    static_assert(M == major::k ? Rows % 8 == 0 : Rows % 64 == 0, "K-major: rows in 8s; MN-major: in 64s");
    static constexpr int rows = Rows, depth = 64;
    static constexpr major layout = M;
    static constexpr int bytes = Rows * depth * 2;
    static constexpr int panel_bytes = 64 * depth * 2;  // MN-major: one 64-wide panel

    alignas(1024) T data[Rows * depth];

    // Descriptor of rows [row0, row0 + n) (row0 a multiple of 64) and K slice [16 k16, 16 k16 + 16).
    // The tile's own descriptor plus the slice's byte offset >> 4 in the 32-bit low word, whose address field
    // cannot carry (shared addresses stay below 2^18): one add per product, not a rebuild of every field
    // (a D = 128 attention backward step: 771 -> 663 instructions).
    __device__ __forceinline__ uint64_t slice(int row0, int k16) const {
        const uint32_t base = sync::smem_addr(data);
        uint32_t low;
        if constexpr (M == major::k) {
            // K advances inside the swizzled 128-byte line (32 B per 16 elements); 8-line atoms 1024 B apart.
            low = descriptor_low(base, 16) + (uint32_t(row0 * 128 + k16 * 32) >> 4);
        } else {
            // K advances by 16 lines of 128 B; panels (64 MN elements each) are panel_bytes apart.
            low = descriptor_low(base, panel_bytes) + (uint32_t((row0 / 64) * panel_bytes + k16 * 16 * 128) >> 4);
        }
        return uint64_t(low) | (uint64_t(descriptor_high(1024)) << 32);
    }
};

// The tile `Tile` laid over shared memory that TMA filled with 64 x 64 boxes (1024-byte aligned). A box of 64 lines
// of 64 elements is both a K-major tile (lines = rows, elements = K) and one panel of an MN-major tile (lines = K,
// elements = rows), so one copy of Q, K or dO in shared memory serves products that need it either way round
// (attention's backward reads Q as B of S^T = K Q^T and as B of dK = dS^T Q).
template <typename Tile>
__device__ __forceinline__ const Tile& tile_at(const void* boxes) {
    return *reinterpret_cast<const Tile*>(boxes);
}

__device__ __forceinline__ void fence() { asm volatile("wgmma.fence.sync.aligned;" ::: "memory"); }
__device__ __forceinline__ void commit() { asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory"); }
template <int Pending>
__device__ __forceinline__ void wait() {
    asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(Pending) : "memory");
}

// Keeps the compiler from moving accumulator reads/writes across asynchronous wgmma work.
template <int R>
__device__ __forceinline__ void pin(float (&d)[R]) {
#pragma unroll
    for (int i = 0; i < R; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// D(64 x N) (+)= A[a_row0 : a_row0 + 64, 16-slice] * B[0 : N, 16-slice]^T, for one warpgroup.
template <int N, typename T, typename TileA, typename TileB>
__device__ __forceinline__ void mma(float (&d)[N / 2], const TileA& a, int a_row0, const TileB& b, int b_row0, int k16,
                                    int accumulate) {
    detail::mma_ss<N, T>::template run<int(TileA::layout), int(TileB::layout)>(d, a.slice(a_row0, k16),
                                                                             b.slice(b_row0, k16), accumulate);
}

// D(64 x N) = A[a_row0 : a_row0 + 64, 16-slice] * B[0 : N, 16-slice]^T, D's old values dead: the first product of
// an accumulator that is refilled, so that the compiler need not keep it alive in between (mma with accumulate = 0
// reads D, and an accumulator refilled every loop turn stays live all the way round).
template <int N, typename T, typename TileA, typename TileB>
__device__ __forceinline__ void mma_overwrite(float (&d)[N / 2], const TileA& a, int a_row0, const TileB& b,
                                              int b_row0, int k16) {
    detail::mma_ss<N, T>::template run_overwrite<int(TileA::layout), int(TileB::layout)>(d, a.slice(a_row0, k16),
                                                                                       b.slice(b_row0, k16));
}

// D(64 x N) (+)= A[:, 16-slice a_k16] * B[b_row0 : b_row0 + N, 16-slice b_k16]^T with A in registers (for
// instance P = softmax(S) converted by rt::to_a_operand). Registers of A written since the last fence() need one.
template <int N, typename T, int K, typename TileB>
__device__ __forceinline__ void mma(float (&d)[N / 2], const rt::a_operand<T, K>& a, int a_k16, const TileB& b,
                                    int b_row0, int b_k16, int accumulate) {
    detail::mma_rs<N, T>::template run<int(TileB::layout)>(d, a.r[a_k16], b.slice(b_row0, b_k16), accumulate);
}

// D(64 x N) = A[:, 16-slice a_k16] * B[b_row0 : b_row0 + N, 16-slice b_k16]^T with A in registers, D's old values
// dead (see the shared-memory mma_overwrite).
template <int N, typename T, int K, typename TileB>
__device__ __forceinline__ void mma_overwrite(float (&d)[N / 2], const rt::a_operand<T, K>& a, int a_k16,
                                              const TileB& b, int b_row0, int b_k16) {
    detail::mma_rs<N, T>::template run_overwrite<int(TileB::layout)>(d, a.r[a_k16], b.slice(b_row0, b_k16));
}

// Position of accumulator element d[i] of the calling thread in its warpgroup's 64 x N tile.
struct fragment_position {
    int row, col;
};
__device__ __forceinline__ fragment_position accumulator_position(int i) {
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    return {warp * 16 + lane / 4 + ((i & 2) ? 8 : 0), (i / 4) * 8 + (lane & 3) * 2 + (i & 1)};
}

}  // namespace tk::wgmma
