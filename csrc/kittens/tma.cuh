// Tensor Memory Accelerator: 2-D tiled copies global <-> shared that complete on an mbarrier.
// Tensor maps are built on the host (make_tensor_map_2d) and passed to kernels as __grid_constant__ params.
#pragma once

#include <cuda.h>
#include <cstdint>

#include "sync.cuh"

namespace tk::tma {

// ---------------------------------------------------------------------------------------------
// Host side

enum class swizzle { none = 0, b32 = 1, b64 = 2, b128 = 3 };

// A 2-D view: `inner` contiguous elements per line, `outer` lines `outer_stride` elements apart; boxes of
// box_inner x box_outer elements. Out-of-bounds parts of a box read as zero. Returns a CUDA driver status.
// Requirements (checked, CUDA_ERROR_INVALID_VALUE otherwise): 16-byte aligned base and line stride,
// box_inner * element bytes <= the swizzle span, box sizes <= 256.
CUresult make_tensor_map_2d(CUtensorMap* map, const void* base, CUtensorMapDataType dtype, int element_bytes,
                            uint64_t inner, uint64_t outer, uint64_t outer_stride, uint32_t box_inner,
                            uint32_t box_outer, swizzle sw);

// ---------------------------------------------------------------------------------------------
// Device side (one thread issues)

__device__ __forceinline__ void prefetch_map(const CUtensorMap* map) {
    asm volatile("prefetch.tensormap [%0];" ::"l"(reinterpret_cast<uint64_t>(map)) : "memory");
}

// Box at element coordinates (inner, outer) -> shared memory at `dst`; bytes complete on `bar`.
__device__ __forceinline__ void load_2d(void* dst, const CUtensorMap* map, int32_t inner, int32_t outer,
                                        sync::barrier& bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];" ::
            "r"(sync::smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(sync::smem_addr(&bar))
        : "memory");
}

}  // namespace tk::tma
