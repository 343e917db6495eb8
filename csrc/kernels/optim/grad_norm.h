// The sum of squares of every element of a list of dense tensors, in fp32: the global gradient norm that clipping
// by norm needs (its square, so that shards' sums add up across ranks). Host-visible declarations only.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::optim {

struct sq_norm_args {
    const void* const* tensors;
    const int64_t* numels;
    int count;
    int dtype;              // tk::dtype of every tensor
    float* partials;        // workspace of sq_norm_workspace(count) floats, overwritten
    int64_t partials_size;  // its length in floats
    float* out;             // one float on the device: the sum, written, or added to its value where `accumulate`
    bool accumulate;
};

// Floats of workspace a call over `count` tensors needs.
int64_t sq_norm_workspace(int count);

// Why `args` cannot run (dtype, sizes, missing pointers, workspace too small), or nullptr.
const char* sq_norm_unsupported(const sq_norm_args& args);

// Enqueues the sum on `stream`: one launch per 256 tensors, each block's partial sum in the workspace, then one
// block adding the partials in a fixed order, so the result's bits repeat from call to call on one GPU. Never
// synchronises.
cudaError_t launch_sq_norm(const sq_norm_args& args, cudaStream_t stream);

}  // namespace tk::optim
