// Tensor Memory Accelerator: 2-D tiled copies global <-> shared that complete on an mbarrier.
// Tensor maps are built on the host (make_tensor_map_2d) and passed to kernels as __grid_constant__ params.
#pragma once

#include <cuda.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cstdint>
#include <type_traits>

#include "sync.cuh"

namespace tk::tma {

// ---------------------------------------------------------------------------------------------
// Host side

enum class swizzle { none = 0, b32 = 1, b64 = 2, b128 = 3 };

// The tensor-map element type of T (bf16, fp16 or fp32).
template <typename T>
constexpr CUtensorMapDataType element_type() {
    static_assert(std::is_same_v<T, __nv_bfloat16> || std::is_same_v<T, __half> || std::is_same_v<T, float>);
    return std::is_same_v<T, __nv_bfloat16> ? CU_TENSOR_MAP_DATA_TYPE_BFLOAT16
           : std::is_same_v<T, __half>      ? CU_TENSOR_MAP_DATA_TYPE_FLOAT16
                                            : CU_TENSOR_MAP_DATA_TYPE_FLOAT32;
}

// A 2-D view: `inner` contiguous elements per line, `outer` lines `outer_stride` elements apart; boxes of
// box_inner x box_outer elements. Out-of-bounds parts of a box read as zero. Returns a CUDA driver status.
// Requirements (checked, CUDA_ERROR_INVALID_VALUE otherwise): 16-byte aligned base and line stride,
// box_inner * element bytes <= the swizzle span, box sizes <= 256.
CUresult make_tensor_map_2d(CUtensorMap* map, const void* base, CUtensorMapDataType dtype, int element_bytes,
                            uint64_t inner, uint64_t outer, uint64_t outer_stride, uint32_t box_inner,
                            uint32_t box_outer, swizzle sw);

// A 4-D strided view (attention's (B, H, S, D) tensors): dims[0] contiguous elements, dims[i] (i = 1..3) strides[i - 1]
// elements apart; boxes of box[0] x box[1] elements (one index of dims 2 and 3). Out-of-bounds rows read as zero
// and are not written, so a box never reaches into the next head or batch. Checked as make_tensor_map_2d, and
// every stride of a dimension longer than 1 a non-zero multiple of 16 bytes.
CUresult make_tensor_map_4d(CUtensorMap* map, const void* base, CUtensorMapDataType dtype, int element_bytes,
                            const uint64_t (&dims)[4], const int64_t (&strides)[3], uint32_t box_inner,
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

namespace tk::tma {

// Shared memory at `src` -> box at element coordinates (inner, outer); clipped at the tensor's bounds, but only at
// 16-byte granularity: a map whose inner extent is not a multiple of 16 bytes gets the rest of its last chunk
// overwritten (seen on the H100). Store only through maps with inner extent * element bytes % 16 == 0.
// Writers of `src` must have run fence_shared_to_async() and synchronised with the issuing thread.
__device__ __forceinline__ void store_2d(const CUtensorMap* map, const void* src, int32_t inner, int32_t outer) {
    asm volatile("cp.async.bulk.tensor.2d.global.shared::cta.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(inner), "r"(outer), "r"(sync::smem_addr(src))
                 : "memory");
}
// Stores and reductions need the box's inner coordinate at a 16-byte boundary (inner * element bytes % 16 == 0):
// an unaligned one is an illegal instruction (seen on the H100), not a clipped copy.
// As store_2d (same 16-byte clipping), but adds the tile to what global memory holds (element type from the map: f32, f16, bf16), as
// one atomic reduction per element: how partial results of several blocks meet in one output (attention's dQ).
__device__ __forceinline__ void store_add_2d(const CUtensorMap* map, const void* src, int32_t inner, int32_t outer) {
    asm volatile("cp.reduce.async.bulk.tensor.2d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2}], [%3];" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(inner), "r"(outer), "r"(sync::smem_addr(src))
                 : "memory");
}
// 4-D forms: a box at (inner, row, c2, c3), from make_tensor_map_4d maps.
__device__ __forceinline__ void load_4d(void* dst, const CUtensorMap* map, int32_t inner, int32_t row, int32_t c2,
                                        int32_t c3, sync::barrier& bar) {
    asm volatile(
        "cp.async.bulk.tensor.4d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4, %5}], "
        "[%6];" ::"r"(sync::smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(row), "r"(c2), "r"(c3), "r"(sync::smem_addr(&bar))
        : "memory");
}
__device__ __forceinline__ void store_4d(const CUtensorMap* map, const void* src, int32_t inner, int32_t row,
                                         int32_t c2, int32_t c3) {
    asm volatile("cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(
                     reinterpret_cast<uint64_t>(map)),
                 "r"(inner), "r"(row), "r"(c2), "r"(c3), "r"(sync::smem_addr(src))
                 : "memory");
}

// As store_4d, adding to global memory (element type from the map): attention's dQ, summed over key blocks.
__device__ __forceinline__ void store_add_4d(const CUtensorMap* map, const void* src, int32_t inner, int32_t row,
                                             int32_t c2, int32_t c3) {
    asm volatile(
        "cp.reduce.async.bulk.tensor.4d.global.shared::cta.add.tile.bulk_group [%0, {%1, %2, %3, %4}], [%5];" ::"l"(
            reinterpret_cast<uint64_t>(map)),
        "r"(inner), "r"(row), "r"(c2), "r"(c3), "r"(sync::smem_addr(src))
        : "memory");
}

// Plain byte ranges, no tensor map: `bytes` (a multiple of 16, both addresses 16-byte aligned) from global memory to
// shared memory at `dst`, completing on `bar`; and back (a bulk group, as the tiled stores).
__device__ __forceinline__ void load_bytes(void* dst, const void* src, uint32_t bytes, sync::barrier& bar) {
    asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                     sync::smem_addr(dst)),
                 "l"(reinterpret_cast<uint64_t>(src)), "r"(bytes), "r"(sync::smem_addr(&bar))
                 : "memory");
}
__device__ __forceinline__ void store_bytes(void* dst, const void* src, uint32_t bytes) {
    asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(reinterpret_cast<uint64_t>(dst)),
                 "r"(sync::smem_addr(src)), "r"(bytes)
                 : "memory");
}

__device__ __forceinline__ void store_commit() { asm volatile("cp.async.bulk.commit_group;" ::: "memory"); }
// Wait until the committed stores, all but the newest `Pending` groups, have finished reading shared memory (it
// may then be overwritten).
template <int Pending = 0>
__device__ __forceinline__ void store_wait_read() {
    asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(Pending) : "memory");
}
// Wait until the committed stores are complete in global memory.
__device__ __forceinline__ void store_wait() { asm volatile("cp.async.bulk.wait_group 0;" ::: "memory"); }

// Orders this thread's completed async-proxy global writes (TMA stores and reduce-adds after store_wait) before its
// later ordinary accesses, e.g. a release that hands the written memory to another grid.
__device__ __forceinline__ void fence_async_to_global() { asm volatile("fence.proxy.async.global;" ::: "memory"); }

// Orders this thread's ordinary shared-memory writes before later async-proxy (TMA, wgmma) reads.
__device__ __forceinline__ void fence_shared_to_async() {
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}

// Byte offset of byte `byte_col` of line `row` in lines of 128 bytes written with the 128-byte swizzle (16-byte
// chunks XOR-ed with the row within 8): any element type, e.g. fp32 tiles of 32 columns.
__device__ __forceinline__ uint32_t swizzled_byte_offset_128b(int row, int byte_col) {
    return row * 128 + ((((byte_col >> 4) ^ (row & 7))) << 4) + (byte_col & 15);
}

// Byte offset of element (row, col) in a 64-column panel of 16-bit elements written with the 128-byte
// swizzle (the layout TMA reads for a {64, rows} box): 16-byte chunks XOR-ed with the row within 8.
__device__ __forceinline__ uint32_t swizzled_offset_128b(int row, int col) {
    const int chunk = (col * 2) >> 4, within = (col * 2) & 15;
    return row * 128 + ((chunk ^ (row & 7)) << 4) + within;
}

}  // namespace tk::tma

namespace tk::tma {

// As load_2d, but the box lands at the same offset in every block of the cluster named in `cta_mask`, and
// completes bytes on the barrier at the same offset in each.
__device__ __forceinline__ void load_2d_multicast(void* dst, const CUtensorMap* map, int32_t inner, int32_t outer,
                                                  sync::barrier& bar, uint16_t cta_mask) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.tile.mbarrier::complete_tx::bytes.multicast::cluster"
        " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(sync::smem_addr(dst)),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(inner), "r"(outer), "r"(sync::smem_addr(&bar)), "h"(cta_mask)
        : "memory");
}

}  // namespace tk::tma
