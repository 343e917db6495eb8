// Attention backward: dQ, dK, dV of O = softmax(scale Q K^T (+ causal mask)) V from the forward's log-sum-exp.
// Host-visible declarations only (no device code).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::attention {

// Layouts as forward_args: (B, H, S, D) with the last dimension contiguous, strides in elements (batch, head,
// sequence). q, dout: q_heads; k, v, dk, dv: kv_heads.
struct backward_args {
    const void* q;
    const void* k;
    const void* v;
    const void* dout;      // dO, the gradient of O
    const float* lse;      // the forward's log-sum-exp (natural log), (B, q_heads, q_len): strides batch, head
    const float* delta;    // rowsum(dO * O) in fp32, (B, q_heads, q_len): strides batch, head
    float* dq_accum;       // zeroed fp32 (B, q_heads, q_len, D), contiguous: receives dS K (not yet times scale)
    void* dk;              // input dtype, (B, kv_heads * group_split, kv_len, D): times scale, summed over the head
    void* dv;              // group, or over each of its group_split parts (head kv * group_split + part)
    int dtype;             // tk::dtype: bf16 or fp16
    int64_t batch, q_heads, kv_heads, q_len, kv_len, head_dim;
    int64_t q_stride[3], k_stride[3], v_stride[3], dout_stride[3], dk_stride[3], dv_stride[3];
    int64_t lse_stride[2], delta_stride[2];
    float scale;  // positive
    bool causal;  // q_len == kv_len
    int window = 0;  // causal sliding window as forward_args::window: query i keeps keys i - W < j <= i (0: none)
    // 1, or a divisor of q_heads / kv_heads: each key/value head's query heads in that many parts, one block per
    // part and key tile, so that small batches of grouped heads still fill the GPU; the caller sums the parts.
    int64_t group_split = 1;
    // The last wave split (not causal): units (blocks of 128 keys, in block order) from split_from on are each walked
    // by split_parts blocks (2-8), one query range each. A part leaves its dK, dV in fp32 split_scratch and counts
    // itself in split_counts (zeroed; left zero); the unit's last part sums all parts in part order and stores.
    // split_parts 0: every unit walked whole.
    int64_t split_from = 0;
    int split_parts = 0;
    float* split_scratch = nullptr;  // (units - split_from) * split_parts * 2 * 128 * head_dim floats
    int* split_counts = nullptr;     // (units - split_from) * 2 ints
    // Optional, zeroed: batch * kv_heads * group_split counters, one per group of dQ rows (its (batch, key/value
    // head, split)'s query heads: contiguous in dq_accum). A block adds its steps once its dQ reduce-adds are
    // complete; a group's rows are final when its counter reaches backward_dq_steps(args).
    unsigned long long* dq_done = nullptr;
    // Optional: zero_next_count floats (a multiple of 4, on 16 bytes, apart from dq_accum) set to zero by the
    // launch's dQ writer warps, 4 KB a step of their walks: the next launch's dQ accumulator, which then needs no
    // zeroing in its delta pass. Every block zeroes its share once the grids before it are complete.
    float* zero_next = nullptr;
    int64_t zero_next_count = 0;
};

const char* backward_unsupported(const backward_args& args);

// The steps (64-query tiles of one query head against one key block) that add into each group of dQ rows: what
// every counter of args.dq_done reaches.
int64_t backward_dq_steps(const backward_args& args);

// The most float4s of args.zero_next one block zeroes (its offsets are 32-bit): backward_unsupported refuses a
// zero_next_count whose share over the launch's blocks passes it.
int64_t backward_max_zero_share();

// Enqueues on `stream`; never synchronises.
cudaError_t launch_backward(const backward_args& args, cudaStream_t stream);

}  // namespace tk::attention
