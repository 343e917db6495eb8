// AdamW's update over a list of dense tensors in one pass, as torch.optim.AdamW computes it (decoupled weight decay,
// no AMSGrad). Host-visible declarations only.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::optim {

struct adamw_hyper {
    float lr, beta1, beta2, eps, weight_decay;
    float step;     // this step's count after its increment (1 on the first), as torch's float32 step state
    bool maximize;  // ascend the gradient
    // Clipping by the global norm, as torch.nn.utils.clip_grad_norm_ followed by the step: where `clip_sq_norm`
    // (one float on the device, the squared norm of all gradients: sq_norm's) is given, each gradient is first
    // multiplied by min(1, max_norm / (norm + 1e-6)) as torch's in-place multiply by a factor on the GPU computes
    // it: the factor rounded to the gradient's dtype, the product rounded to it. The gradients are not written.
    const float* clip_sq_norm;  // nullptr: no clipping
    float clip_max_norm;
};

// Entry i of every list belongs together: a parameter, its gradient and its two moment buffers, all dense with
// the same layout (so that element j of each is the same weight) and numels[i] elements each.
struct adamw_args {
    void* const* params;
    const void* const* grads;
    void* const* exp_avgs;
    void* const* exp_avg_sqs;
    const int64_t* numels;
    int count;
    int dtype;  // tk::dtype of every tensor of every entry
    adamw_hyper hyper;
};

// Why `args` cannot run (dtype, sizes, missing pointers), or nullptr.
const char* adamw_unsupported(const adamw_args& args);

// Enqueues the update on `stream` (one launch per 256 entries); never synchronises.
cudaError_t launch_adamw(const adamw_args& args, cudaStream_t stream);

}  // namespace tk::optim
