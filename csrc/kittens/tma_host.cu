#include "tma.cuh"

#include <cuda_runtime.h>

namespace tk::tma {
namespace {

using encode_fn = CUresult (*)(CUtensorMap*, CUtensorMapDataType, cuuint32_t, void*, const cuuint64_t*,
                               const cuuint64_t*, const cuuint32_t*, const cuuint32_t*, CUtensorMapInterleave,
                               CUtensorMapSwizzle, CUtensorMapL2promotion, CUtensorMapFloatOOBfill);

// The driver entry point is looked up at run time, so the module never links libcuda.
encode_fn encoder() {
    static encode_fn fn = [] {
        void* p = nullptr;
        cudaDriverEntryPointQueryResult status;
        if (cudaGetDriverEntryPointByVersion("cuTensorMapEncodeTiled", &p, 12000, cudaEnableDefault, &status) !=
                cudaSuccess ||
            status != cudaDriverEntryPointSuccess)
            return static_cast<encode_fn>(nullptr);
        return reinterpret_cast<encode_fn>(p);
    }();
    return fn;
}

}  // namespace

CUresult make_tensor_map_2d(CUtensorMap* map, const void* base, CUtensorMapDataType dtype, int element_bytes,
                            uint64_t inner, uint64_t outer, uint64_t outer_stride, uint32_t box_inner,
                            uint32_t box_outer, swizzle sw) {
    const uint64_t stride_bytes = outer_stride * element_bytes;
    const uint32_t span = sw == swizzle::b128 ? 128 : sw == swizzle::b64 ? 64 : sw == swizzle::b32 ? 32 : 0;
    if (reinterpret_cast<uintptr_t>(base) % 16 || (outer > 1 && stride_bytes % 16) || box_inner > 256 ||
        box_outer > 256 || (span && box_inner * element_bytes > span) || inner == 0 || outer == 0)
        return CUDA_ERROR_INVALID_VALUE;
    encode_fn encode = encoder();
    if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
    const cuuint64_t dims[2] = {inner, outer};
    // The stride of a single line is never used; TMA still wants a valid multiple of 16.
    const cuuint64_t strides[1] = {outer > 1 ? stride_bytes : ((inner * element_bytes + 15) / 16) * 16};
    const cuuint32_t box[2] = {box_inner, box_outer};
    const cuuint32_t element_strides[2] = {1, 1};
    return encode(map, dtype, 2, const_cast<void*>(base), dims, strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, static_cast<CUtensorMapSwizzle>(static_cast<int>(sw)),
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

CUresult make_tensor_map_4d(CUtensorMap* map, const void* base, CUtensorMapDataType dtype, int element_bytes,
                            const uint64_t (&dims)[4], const int64_t (&strides)[3], uint32_t box_inner,
                            uint32_t box_outer, swizzle sw) {
    const uint32_t span = sw == swizzle::b128 ? 128 : sw == swizzle::b64 ? 64 : sw == swizzle::b32 ? 32 : 0;
    if (reinterpret_cast<uintptr_t>(base) % 16 || box_inner > 256 || box_outer > 256 ||
        (span && box_inner * element_bytes > span))
        return CUDA_ERROR_INVALID_VALUE;
    cuuint64_t global_dims[4];
    cuuint64_t global_strides[3];
    uint64_t extent = dims[0] * element_bytes;  // a placeholder stride for dimensions of length 1
    for (int i = 0; i < 4; ++i) {
        if (dims[i] == 0) return CUDA_ERROR_INVALID_VALUE;
        global_dims[i] = dims[i];
    }
    for (int i = 0; i < 3; ++i) {
        const int64_t bytes = strides[i] * element_bytes;
        if (dims[i + 1] == 1) {  // never stepped over: any valid multiple of 16 serves
            global_strides[i] = ((extent + 15) / 16) * 16;
        } else {
            if (bytes <= 0 || bytes % 16) return CUDA_ERROR_INVALID_VALUE;
            global_strides[i] = uint64_t(bytes);
        }
        extent = global_strides[i] * dims[i + 1];
    }
    encode_fn encode = encoder();
    if (encode == nullptr) return CUDA_ERROR_NOT_FOUND;
    const cuuint32_t box[4] = {box_inner, box_outer, 1, 1};
    const cuuint32_t element_strides[4] = {1, 1, 1, 1};
    return encode(map, dtype, 4, const_cast<void*>(base), global_dims, global_strides, box, element_strides,
                  CU_TENSOR_MAP_INTERLEAVE_NONE, static_cast<CUtensorMapSwizzle>(static_cast<int>(sw)),
                  CU_TENSOR_MAP_L2_PROMOTION_L2_256B, CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE);
}

}  // namespace tk::tma
