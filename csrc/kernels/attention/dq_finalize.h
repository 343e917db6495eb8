// Attention backward's last step: dq = scale * dq_accum (fp32, as the backward kernel's TMA reduce-adds left it),
// rounded to the input dtype, in one pass over both (instead of a scaled fp32 copy and then a conversion).
// Host-visible declarations only.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::attention {

// `count` elements of contiguous `accum` into contiguous `out` (tk::dtype bf16 or fp16); both 16-byte aligned and
// `count` a multiple of 8 (the head dim is). Null when it can run, else why not.
const char* dq_finalize_unsupported(const float* accum, const void* out, int dtype, int64_t count);

// Enqueues on `stream`; never synchronises.
cudaError_t launch_dq_finalize(const float* accum, void* out, int dtype, int64_t count, float scale,
                               cudaStream_t stream);

}  // namespace tk::attention
