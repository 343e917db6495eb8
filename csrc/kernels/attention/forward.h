// Attention forward: O = softmax(scale * Q K^T (+ causal mask)) V and the log-sum-exp of each query row.
// Host-visible declarations only (no device code).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::attention {

// Tensors in torch's (B, H, S, D) layout with the last dimension contiguous; strides in elements (batch, head,
// sequence). Query head h reads key/value head h / (q_heads / kv_heads) (grouped-query attention).
struct forward_args {
    const void* q;
    const void* k;
    const void* v;
    void* o;       // (B, q_heads, q_len, D), input dtype
    float* lse;    // (B, q_heads, q_len) natural-log log-sum-exp of the scaled scores; lse_stride: batch, head
    int dtype;     // tk::dtype: bf16 or fp16
    int64_t batch, q_heads, kv_heads, q_len, kv_len, head_dim;
    int64_t q_stride[3], k_stride[3], v_stride[3], o_stride[3], lse_stride[2];
    float scale;   // multiplies Q K^T; positive
    bool causal;   // mask key j > query i (top-left aligned; q_len == kv_len)
    // Causal sliding window: with window = W >= 1 query i keeps keys i - W < j <= i (W keys with its own; LitGPT,
    // Mistral, Gemma). 0: none. Needs causal; W >= kv_len is plain causal.
    int window = 0;
    int max_blocks = 0;  // grid limit (0: one block per SM); tests set it to walk several tiles per block cheaply
    // Dynamic tile schedule: a zeroed int in device memory that the launch leaves zeroed again (null: static,
    // e.g. under CUDA-graph capture, where every replay would reuse the one counter).
    int* tickets = nullptr;
    // The last wave's tiles split by keys (forward_split_plan): fp32 scratch for the parts' O and log-sum-exp, and
    // zeroed int counters that the launch leaves zeroed. Too little of either (or none): no split.
    float* split_scratch = nullptr;
    int64_t split_scratch_floats = 0;
    int* split_counts = nullptr;
    int64_t split_counts_len = 0;
};

// Why `args` cannot run (null when it can): head dim, dtype, sizes, strides, alignment.
const char* forward_unsupported(const forward_args& args);

// How launch_forward would split the last wave's tiles for `args` (their sizes and max_blocks; `dynamic`: tickets
// will be given): the fp32 scratch and the counters it needs (0 and 0: no split).
struct forward_split_needs {
    int64_t scratch_floats, counts;
};
forward_split_needs forward_split_plan(const forward_args& args, bool dynamic);

// Enqueues on `stream`; never synchronises.
cudaError_t launch_forward(const forward_args& args, cudaStream_t stream);

}  // namespace tk::attention
