// Attention backward pre-pass: delta[b, h, s] = sum_d dO[b, h, s, d] * O[b, h, s, d], accumulated in fp32.
// Host-visible declarations only (no device code), so the binding compiles with the host compiler.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::attention {

struct bwd_delta_args {
    const void* o;        // (B, H, S, D), last dim contiguous
    const void* grad_o;   // same shape and dtype as o, own strides
    float* delta;         // (B, H, S) fp32
    int dtype;            // tk::dtype of o and grad_o
    int64_t batch, heads, seq, head_dim;
    int64_t o_stride[3];       // strides of o in elements for (B, H, S)
    int64_t grad_o_stride[3];  // strides of grad_o
    int64_t delta_stride[3];   // strides of delta
    int rows_per_group;        // rows a lane group reduces per step: 1, 2 or 4 (0: chosen by the launcher)
    bool resident_grid;        // grid of resident blocks looping over rows (else one step per block)
    // Optional (null: none): a contiguous fp32 (B, H, S, head_dim) buffer that this pass sets to zero, row by row
    // beside its reads (the backward's dQ accumulator: one pass over memory instead of a separate fill).
    // head_dim a multiple of 4, 16-byte aligned.
    float* zero_rows;
};

// Why `args` cannot run, or nullptr.
const char* bwd_delta_unsupported(const bwd_delta_args& args);

// Enqueues the kernel on `stream`; never synchronises. Returns the launch status.
cudaError_t launch_bwd_delta(const bwd_delta_args& args, cudaStream_t stream);

}  // namespace tk::attention
