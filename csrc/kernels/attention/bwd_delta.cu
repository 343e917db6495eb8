#include "bwd_delta.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>
#include <utility>

namespace tk::attention {
namespace {

constexpr int kThreads = 256;

struct row_offsets {
    int64_t o, grad_o;
};

// Row `row` = (b, h, s) split by division, in 32 bits when the row count fits.
struct row_index {
    int64_t b, h, s;
};
__device__ __forceinline__ row_index split_row(const bwd_delta_args& a, int64_t row) {
    if (a.batch * a.heads * a.seq <= int64_t(UINT32_MAX)) {
        const uint32_t r = uint32_t(row), S = uint32_t(a.seq), H = uint32_t(a.heads);
        const uint32_t bh = r / S, b = bh / H;
        return {b, bh - b * H, r - bh * S};
    }
    const int64_t bh = row / a.seq, b = bh / a.heads;
    return {b, bh - b * a.heads, row - bh * a.seq};
}

// Element offsets of row `row` in o and grad_o. FLAT: the (B, H, S) dims of both collapse into one stride, so no
// division is needed (contiguous rows, or the forward's (B, S, H, D) output once launch_bwd_delta swaps H and S).
// The delta's offset is worked out apart (delta_offset), once a row's sum is in: carried beside the loads, it took
// the strided path to 88 registers at 2 rows (2 blocks of 256 threads a multiprocessor; 70 now, 3 blocks).
template <bool FLAT>
__device__ __forceinline__ row_offsets offsets_of(const bwd_delta_args& a, int64_t row) {
    if constexpr (FLAT) {
        return {row * a.o_stride[2], row * a.grad_o_stride[2]};
    } else {
        const row_index i = split_row(a, row);
        return {i.b * a.o_stride[0] + i.h * a.o_stride[1] + i.s * a.o_stride[2],
                i.b * a.grad_o_stride[0] + i.h * a.grad_o_stride[1] + i.s * a.grad_o_stride[2]};
    }
}
__device__ __forceinline__ int64_t delta_offset(const bwd_delta_args& a, int64_t row) {
    const row_index i = split_row(a, row);
    return i.b * a.delta_stride[0] + i.h * a.delta_stride[1] + i.s * a.delta_stride[2];
}

// A group of LANES lanes reduces kRows rows per step, issuing all their loads before any math;
// each lane reads VEC elements per access.
template <typename T, int VEC, int LANES, bool FLAT, int kRows>
__global__ void __launch_bounds__(kThreads) bwd_delta_kernel(const bwd_delta_args args) {
    pdl::start();
    using group = lanes<LANES>;
    constexpr int groups_per_block = kThreads / LANES;
    constexpr int rows_per_step = groups_per_block * kRows;
    const T* __restrict__ o = static_cast<const T*>(args.o);
    const T* __restrict__ grad_o = static_cast<const T*>(args.grad_o);
    const int64_t rows = args.batch * args.heads * args.seq;
    const int64_t D = args.head_dim;

    // Bounds are uniform across the block, so every lane reaches every shuffle.
    for (int64_t first = int64_t(blockIdx.x) * rows_per_step; first < rows;
         first += int64_t(gridDim.x) * rows_per_step) {
        // Neighbouring groups take neighbouring rows, so a warp's loads stay contiguous.
        const auto row_of = [&](int i) { return first + int64_t(i) * groups_per_block + group::group_index(); };
        row_offsets off[kRows];
        bool valid[kRows];
        float acc[kRows];
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            const int64_t row = row_of(i);
            valid[i] = row < rows;
            off[i] = offsets_of<FLAT>(args, valid[i] ? row : 0);
            acc[i] = 0.f;
        }
        for (int64_t d = int64_t(group::rank()) * VEC; d < D; d += int64_t(LANES) * VEC) {
            packed<T, VEC> ov[kRows], gv[kRows];
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                if (valid[i]) {
                    ov[i] = load_packed<T, VEC>(o + off[i].o + d);
                    gv[i] = load_packed<T, VEC>(grad_o + off[i].grad_o + d);
                }
            }
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                if (valid[i]) {
#pragma unroll
                    for (int j = 0; j < VEC; ++j) acc[i] = fmaf(to_float(ov[i].v[j]), to_float(gv[i].v[j]), acc[i]);
                }
            }
        }
#pragma unroll
        for (int i = 0; i < kRows; ++i) {
            const float total = group::sum(acc[i]);
            if (valid[i] && group::rank() == 0) args.delta[delta_offset(args, row_of(i))] = total;
        }
        // Every row of zero_rows is cleared once, whichever order the rows go in (launch_bwd_delta).
        if (args.zero_rows != nullptr) {
#pragma unroll
            for (int i = 0; i < kRows; ++i) {
                if (!valid[i]) continue;
                float4* row = reinterpret_cast<float4*>(args.zero_rows + row_of(i) * D);
                for (int64_t c = group::rank(); c < D / 4; c += LANES) row[c] = make_float4(0.f, 0.f, 0.f, 0.f);
            }
        }
    }
}

template <typename T, int VEC, int LANES, bool FLAT, int kRows>
cudaError_t launch_with(const bwd_delta_args& args, cudaStream_t stream) {
    constexpr int rows_per_step = (kThreads / LANES) * kRows;
    auto kernel = bwd_delta_kernel<T, VEC, LANES, FLAT, kRows>;
    // As many blocks as can be resident at once (read once per device and instantiation); the row loop
    // covers the rest.
    static int resident_per_sm[128] = {0};
    int device = 0;
    cudaError_t status = cudaGetDevice(&device);
    if (status != cudaSuccess) return status;
    int& per_sm = resident_per_sm[device & 127];
    if (per_sm == 0) {
        status = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, kThreads, 0);
        if (status != cudaSuccess) return status;
        per_sm = std::max(per_sm, 1);
    }
    const int64_t rows = args.batch * args.heads * args.seq;
    const int64_t wanted = (rows + rows_per_step - 1) / rows_per_step;
    const int64_t cap = args.resident_grid ? int64_t(multiprocessor_count()) * per_sm : int64_t(INT32_MAX);
    const unsigned grid = static_cast<unsigned>(std::max<int64_t>(1, std::min(wanted, cap)));
    return launch_kernel(kernel, dim3(grid), dim3(kThreads), 0, stream, 1, args);
}

template <typename T, int VEC, int LANES, bool FLAT>
cudaError_t dispatch_rows(const bwd_delta_args& args, cudaStream_t stream) {
    switch (args.rows_per_group) {
        case 1: return launch_with<T, VEC, LANES, FLAT, 1>(args, stream);
        case 2: return launch_with<T, VEC, LANES, FLAT, 2>(args, stream);
        default: return launch_with<T, VEC, LANES, FLAT, 4>(args, stream);
    }
}

// Lanes per row: enough that one pass covers a short row, never more than a warp.
template <typename T, int VEC, bool FLAT>
cudaError_t dispatch_lanes(const bwd_delta_args& args, cudaStream_t stream) {
    const int64_t accesses = (args.head_dim + VEC - 1) / VEC;
    if (accesses <= 4) return dispatch_rows<T, VEC, 4, FLAT>(args, stream);
    if (accesses <= 8) return dispatch_rows<T, VEC, 8, FLAT>(args, stream);
    if (accesses <= 16) return dispatch_rows<T, VEC, 16, FLAT>(args, stream);
    return dispatch_rows<T, VEC, 32, FLAT>(args, stream);
}

bool collapses(const int64_t* stride, const bwd_delta_args& a) {
    // (b, h, s) -> ((b * H) + h) * S + s, all with the one stride of s. Size-1 dims impose nothing.
    const bool h_ok = a.heads == 1 || stride[1] == a.seq * stride[2];
    const bool b_ok = a.batch == 1 || stride[0] == a.heads * a.seq * stride[2];
    return h_ok && b_ok;
}

template <typename T, int VEC>
cudaError_t dispatch_layout(const bwd_delta_args& args, cudaStream_t stream) {
    if (collapses(args.o_stride, args) && collapses(args.grad_o_stride, args))
        return dispatch_lanes<T, VEC, true>(args, stream);
    return dispatch_lanes<T, VEC, false>(args, stream);
}

template <typename T>
cudaError_t dispatch_vector(const bwd_delta_args& args, cudaStream_t stream) {
    constexpr int V = vec16_elems<T>;
    // 16-byte accesses need every row start 16-byte aligned: aligned bases, strides and D in whole vectors.
    bool vectorizable = args.head_dim % V == 0 && is_aligned(args.o, 16) && is_aligned(args.grad_o, 16);
    for (int i = 0; i < 3; ++i)
        vectorizable = vectorizable && args.o_stride[i] % V == 0 && args.grad_o_stride[i] % V == 0;
    if (vectorizable) return dispatch_layout<T, V>(args, stream);
    return dispatch_layout<T, 1>(args, stream);
}

}  // namespace

const char* bwd_delta_unsupported(const bwd_delta_args& a) {
    if (a.zero_rows != nullptr && (a.head_dim % 4 != 0 || !is_aligned(a.zero_rows, 16)))
        return "zero_rows needs head_dim a multiple of 4 and a 16-byte aligned buffer";
    return nullptr;
}

cudaError_t launch_bwd_delta(const bwd_delta_args& in, cudaStream_t stream) {
    if (bwd_delta_unsupported(in) != nullptr) return cudaErrorInvalidValue;
    if (in.batch * in.heads * in.seq == 0) return cudaSuccess;
    bwd_delta_args args = in;
    // Where both o's and grad_o's heads lie closer together than their positions (the attention forward's
    // (B, S, H, D) output seen as (B, H, S, D), and LitGPT's gradient of it), the rows go by (b, s, h): heads and
    // positions swapped with their strides, so that both collapse into one stride and take the flat path (no
    // divisions, 64 registers). Not where only o is laid out so (a contiguous grad_o): its rows would then be
    // S * D elements apart instead of o's H * D (0.105 against 0.100 ms, B = 8, H = 16, S = 2048, D = 128, H100).
    if (args.heads > 1 && args.seq > 1 && args.o_stride[1] < args.o_stride[2] &&
        args.grad_o_stride[1] < args.grad_o_stride[2]) {
        std::swap(args.heads, args.seq);
        for (int64_t* stride : {args.o_stride, args.grad_o_stride, args.delta_stride}) std::swap(stride[1], stride[2]);
    }
    if (args.rows_per_group == 0) {
        // One row a group, one step a block. Sweeps (benchmarks/attention_bwd_delta.py --sweep, bf16, D 64 and 128):
        // on an H100 1 row gave 2.37 TB/s and 2 rows 2.40; on an H200 (2026-12-02) 1 row 2.48-2.49 against 2 rows'
        // 1.87-1.91 where o lies heads-inner beside a contiguous grad_o (the strided path, the backward's own case in
        // attention.py), and 3.12 against 3.01 where both lie so. What sets the pace is the blocks a multiprocessor
        // holds (registers: 39 at 1 row, 70 at 2 on the strided path); 4 rows drop to 1.15-1.94. Loading a step ahead
        // in resident blocks (measured on the same H200) ran 1.6-2.3 TB/s: its second step's registers cost more
        // blocks than the overlap won.
        args.rows_per_group = 1;
        args.resident_grid = false;
    }
    switch (static_cast<tk::dtype>(args.dtype)) {
        case tk::dtype::bf16: return dispatch_vector<__nv_bfloat16>(args, stream);
        case tk::dtype::fp16: return dispatch_vector<__half>(args, stream);
        case tk::dtype::fp32: return dispatch_vector<float>(args, stream);
    }
    return cudaErrorInvalidValue;
}

}  // namespace tk::attention
