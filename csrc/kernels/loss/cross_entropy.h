// Cross-entropy over the classes of each row of a (rows, classes) logits matrix, fused: one read of the logits for
// the forward (row loss and log-sum-exp) and one read plus one write for the backward (the logits' gradient), in
// fp32 whatever the logits' dtype, so a 16-bit model's loss never materialises an fp32 copy of its logits.
// Host-visible declarations only.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::loss {

struct cross_entropy_args {
    const void* logits;     // (rows, classes), unit class stride, row stride `logits_row_stride` elements
    const int64_t* target;  // (rows,) contiguous class indices; `ignore_index` marks rows left out
    int dtype;              // tk::dtype of logits (and of grad): bf16, fp16 or fp32
    int64_t rows, classes, logits_row_stride;
    int64_t ignore_index;
    // Forward outputs, fp32 (rows,) contiguous: lse - logit[target] (0 for an ignored row, NaN for a target outside
    // [0, classes)), and the natural-log log-sum-exp of the row.
    float* loss;
    float* lse;
    // Backward: grad[r, c] = grad_loss[r] * (softmax[r, c] - (c == target[r])), zero for an ignored row; grad_loss
    // fp32 with stride `grad_loss_stride` (0: one value for every row), grad with row stride `grad_row_stride`.
    const float* grad_loss;
    int64_t grad_loss_stride;
    void* grad;
    int64_t grad_row_stride;
};

// Why the arguments cannot run (null when they can).
const char* cross_entropy_unsupported(const cross_entropy_args& args, bool backward);

// Enqueue on `stream`; never synchronise.
cudaError_t launch_cross_entropy_forward(const cross_entropy_args& args, cudaStream_t stream);
cudaError_t launch_cross_entropy_backward(const cross_entropy_args& args, cudaStream_t stream);

// Forward and gradient from one read of the logits: loss and lse as the forward, and grad = softmax - onehot(target)
// (not scaled by an incoming gradient; zero rows where ignored). Rows of whole 16-byte vectors, 16-byte aligned; grad
// may be the logits themselves (written over them, same row stride). Each row stays on chip, split over the blocks
// of a cluster in the fewest parts (up to 8) of at most `part_bytes` (> 0; parts never exceed 200 KB): one block a
// row where the row fits one part. Null when it can run, else why not.
constexpr int CROSS_ENTROPY_PART_BYTES = 64 * 1024;
const char* cross_entropy_forward_grad_unsupported(const cross_entropy_args& args,
                                                   int part_bytes = CROSS_ENTROPY_PART_BYTES);
// The widest row (classes) that launch_cross_entropy_forward_grad keeps on chip for logits of `dtype`, whatever
// part_bytes: 8 parts of 200 KB (819200 bf16 classes).
int64_t cross_entropy_forward_grad_max_classes(int dtype);
cudaError_t launch_cross_entropy_forward_grad(const cross_entropy_args& args, cudaStream_t stream,
                                              int part_bytes = CROSS_ENTROPY_PART_BYTES);

}  // namespace tk::loss
