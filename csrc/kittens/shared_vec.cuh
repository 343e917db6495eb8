// Shared-memory vectors: per-row values of a tile (softmax max and sum, the log-sum-exp) parked between
// warpgroups or on their way to global memory.
#pragma once

#include "register_tile.cuh"

namespace tk::sv {

template <typename T, int N>
struct shared_vec {
    static constexpr int size = N;
    alignas(16) T data[N];
};

// The warpgroup's row values into elements [0, 64): one lane of each quad writes its two rows.
template <typename T>
__device__ __forceinline__ void store_rows(shared_vec<T, 64>& dst, const rt::row_vec& v) {
    if ((threadIdx.x & 3) == 0) {
        dst.data[rt::top_row()] = T(v.top);
        dst.data[rt::top_row() + 8] = T(v.bottom);
    }
}
// Elements [0, 64) as the warpgroup's row values (after a barrier that orders the writes).
template <typename T>
__device__ __forceinline__ void load_rows(rt::row_vec& dst, const shared_vec<T, 64>& src) {
    dst = {float(src.data[rt::top_row()]), float(src.data[rt::top_row() + 8])};
}

}  // namespace tk::sv
