// The attention backward's last pass when q and k were split from one fused qkv projection and roped: the rotary
// embedding's backward applied where the gradients are finalized, so that dq and dk go straight into the
// projection's gradient (B, S, (Hq + 2 Hkv) D) with no rope kernels and no concatenation after the attention
// backward. Host-visible declarations only.
//
// Rotate-half rope over a head's first `rope_dims` columns (h = rope_dims / 2) at sequence position s, with
// C = cos[s] and S = sin[s]:
//   y[c] = x[c] C[c] - x[c + h] S[c],   y[c + h] = x[c + h] C[c + h] + x[c] S[c + h]
// so the gradient is
//   dx[c] = dy[c] C[c] + dy[c + h] S[c + h],   dx[c + h] = dy[c + h] C[c + h] - dy[c] S[c]
// and columns from rope_dims on pass through.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::attention {

struct rope_grad_args {
    // dq: scale * dq_accum (fp32, contiguous (B, q_heads, S, D): the backward kernel's dQ accumulator) rotated back,
    // into dq at dq_stride (batch, head, seq; the last dim contiguous) in `dtype`.
    const float* dq_accum;
    void* dq;
    int64_t dq_stride[3];
    int64_t q_heads;
    float scale;
    // dk (`dtype`, (B, kv_heads, S, D) at dk_stride) rotated back in place; null: no dk.
    void* dk;
    int64_t dk_stride[3];
    int64_t kv_heads;
    // cos and sin: (>= S, rope_dims) rows at angle_stride elements; fp32 or `dtype` (angle_fp32).
    const void* cos;
    const void* sin;
    bool angle_fp32;
    int64_t angle_stride;
    int dtype;  // tk::dtype: bf16 or fp16
    int64_t batch, seq, head_dim, rope_dims;
};

// Null when `args` can run, else why not: 16-byte aligned pointers and rows, head_dim a multiple of 8, rope_dims a
// multiple of 16 up to head_dim.
const char* rope_grad_unsupported(const rope_grad_args& args);

// One launch for dq and dk; enqueued on `stream`, never synchronises.
cudaError_t launch_rope_grad(const rope_grad_args& args, cudaStream_t stream);

}  // namespace tk::attention
