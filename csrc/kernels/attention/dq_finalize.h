// Attention backward's last step: dq = scale * dq_accum (fp32, as the backward kernel's TMA reduce-adds left it),
// rounded to the input dtype, in one pass over both (instead of a scaled fp32 copy and then a conversion).
// Host-visible declarations only.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::attention {

// Optional: round each group of rows as soon as the backward has added all of it (backward_args::dq_done), so that
// the pass runs beside the backward's last wave instead of after it. Groups of `group_elements` (contiguous, in
// counter order); group g is complete when done[g] reaches `target` (backward_dq_steps).
struct dq_finalize_order {
    const unsigned long long* done = nullptr;
    int64_t group_elements = 0;
    unsigned long long target = 0;
};

// `count` elements of contiguous `accum` into contiguous `out` (tk::dtype bf16 or fp16); both 16-byte aligned and
// `count` a multiple of 8 (the head dim is). Null when it can run, else why not.
const char* dq_finalize_unsupported(const float* accum, const void* out, int dtype, int64_t count,
                                    const dq_finalize_order& order = {});

// Enqueues on `stream`; never synchronises. With `order`, launched right after the backward that counts into it.
cudaError_t launch_dq_finalize(const float* accum, void* out, int dtype, int64_t count, float scale,
                               cudaStream_t stream, const dq_finalize_order& order = {});

}  // namespace tk::attention
