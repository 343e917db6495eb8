// The rotary embedding's backward, applied where the attention backward's gradients are finalized, so that dq and dk
// go straight into the fused qkv projection's gradient (B, S, (Hq + 2 Hkv) D) with no rope kernels and no
// concatenation after the attention backward. Host-visible declarations only.
//
// Rotate-half rope over a head's first `rope_dims` columns (half = rope_dims / 2) at sequence position s:
//   y[c] = x[c] cos[s, c] - x[c + half] sin[s, c],   y[c + half] = x[c + half] cos[s, c + half] + x[c] sin[s, c + half]
// so the gradient is
//   dx[c] = dy[c] cos[s, c] + dy[c + half] sin[s, c + half],   dx[c + half] = dy[c + half] cos[s, c + half] - dy[c] sin[s, c]
// and columns from rope_dims on pass through.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::attention {

struct rope_grad_args {
    // dy: (B, H, S, D) fp32 and contiguous (the backward's dQ accumulator) when src_fp32, else `dtype` with
    // src_stride (batch, head, seq; the last dim contiguous).
    const void* src;
    bool src_fp32;
    int64_t src_stride[3];
    // dx in `dtype` at dst_stride (batch, head, seq): may be src itself (in place; each thread reads what it writes).
    void* dst;
    int64_t dst_stride[3];
    // cos and sin: (>= S, rope_dims) rows at angle_stride elements; fp32 or `dtype` (angle_fp32).
    const void* cos;
    const void* sin;
    bool angle_fp32;
    int64_t angle_stride;
    int dtype;  // tk::dtype: bf16 or fp16
    int64_t batch, heads, seq, head_dim, rope_dims;
    float scale;  // dy is scaled by this first (the dQ accumulator's softmax scale)
};

// Null when `args` can run, else why not: 16-byte aligned pointers and rows, head_dim a multiple of 8, rope_dims a
// multiple of 16 up to head_dim.
const char* rope_grad_unsupported(const rope_grad_args& args);

// Enqueues on `stream`; never synchronises.
cudaError_t launch_rope_grad(const rope_grad_args& args, cudaStream_t stream);

}  // namespace tk::attention
