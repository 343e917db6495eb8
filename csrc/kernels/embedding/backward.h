// The embedding's weight gradient, dense and deterministic: out[v] = sum over positions i with ids[i] == v of
// grad[i] (fp32 sums in position order, rounded once), every other row zero. Host-visible declarations only.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::embedding {

struct backward_args {
    const void* grad;       // (tokens, dim) rows of grad_stride elements, unit column stride
    int64_t grad_stride;
    const int64_t* sorted;  // the token ids sorted, stably
    const int64_t* order;   // the positions of sorted[i] among the tokens (the sort's permutation)
    void* out;              // (rows, dim) contiguous: the whole weight gradient
    int64_t tokens, rows, dim;
    int64_t padding_idx;    // its row stays zero; negative: none
    int dtype;              // tk::dtype of grad and out
};

// Why `args` cannot run (alignment, sizes), or nullptr.
const char* backward_unsupported(const backward_args& args);

// Enqueues on `stream`; never synchronises.
cudaError_t launch_backward(const backward_args& args, cudaStream_t stream);

}  // namespace tk::embedding
