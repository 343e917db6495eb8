// RMSNorm over the last dimension (LLaMA's, as LitGPT computes it), forward and backward, for rows of n elements:
//   forward:  s = x (+ r, rounded to the input dtype),  rstd = 1 / sqrt(mean(s^2) + eps),  y = s * rstd * w
//   backward: dx = rstd * g - rstd^3 * s * mean(g * s) (+ dres),  g = dy * w,  dw = sum over rows of dy * s * rstd
// All arithmetic in fp32; each output rounded once. Host-visible declarations only.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::norm {

// Rows are `n` contiguous elements (unit column stride), `*_stride` elements apart; a 16-bit dtype (bf16/fp16) for
// the activations, the weight bf16, fp16 or fp32. Vectors of 16 bytes: n, the strides and the pointers must allow
// them (see *_unsupported).
struct forward_args {
    const void* x;           // (rows, n)
    int64_t x_stride;
    const void* residual;    // (rows, n) added to x before the norm, or nullptr
    int64_t residual_stride;
    void* sum;               // (rows, n): x + residual, rounded (where residual is given; else unused)
    int64_t sum_stride;
    const void* weight;      // (n)
    void* y;                 // (rows, n)
    int64_t y_stride;
    float* rstd;             // (rows), rstd_stride apart
    int64_t rstd_stride;
    int64_t rows, n;
    float eps;
    int dtype;               // tk::dtype of x, residual, sum and y
    int weight_dtype;        // tk::dtype of weight
};

struct backward_args {
    const void* grad;        // dy (rows, n)
    int64_t grad_stride;
    const void* input;       // s, the norm's input (rows, n)
    int64_t input_stride;
    const float* rstd;       // (rows), rstd_stride apart: the forward's
    int64_t rstd_stride;
    const void* weight;      // (n)
    const void* residual_grad;  // (rows, n) added to dx, or nullptr
    int64_t residual_grad_stride;
    void* dx;                // (rows, n)
    int64_t dx_stride;
    void* dw;                // (n), in the weight's dtype
    float* partial;          // scratch: backward_partial_rows(...) x n floats, written before read
    int64_t rows, n;
    int dtype;               // tk::dtype of grad, input, residual_grad and dx
    int weight_dtype;        // tk::dtype of weight and dw
};

// Why the arguments cannot run (dtype, alignment, sizes), or nullptr.
const char* forward_unsupported(const forward_args& args);
const char* backward_unsupported(const backward_args& args);

// The rows of fp32 scratch the backward needs for `rows` x `n` on the current device (one per block of its grid;
// at least 1): the weight gradient's partial sums, summed in a fixed order by a second launch, so that repeated
// runs give the same bits.
int64_t backward_partial_rows(int64_t rows, int64_t n, int dtype);

// Enqueue on `stream`; never synchronise.
cudaError_t launch_forward(const forward_args& args, cudaStream_t stream);
cudaError_t launch_backward(const backward_args& args, cudaStream_t stream);

}  // namespace tk::norm
