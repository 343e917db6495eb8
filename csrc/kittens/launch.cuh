// Launching tk's kernels: one place that sets a launch's cluster and programmatic-dependence attributes, and the
// device side of programmatic dependent launch (launch.h has the switch).
#pragma once

#include <cuda_runtime.h>

#include <utility>

#include "launch.h"

namespace tk {

namespace pdl {

// Blocks the calling thread until the grids this one depends on have completed and their memory is visible. Every
// thread that touches global memory (loads, stores, atomics, TMA) calls it first; tensor-map prefetches, shared
// memory and barrier set-up may come before. A no-op for a grid launched without the attribute.
__device__ __forceinline__ void wait_prior_grid() { asm volatile("griddepcontrol.wait;" ::: "memory"); }

// Lets the next launch in the stream be scheduled once every block of this grid has called it or exited. Called
// after wait_prior_grid, so no more than one grid waits ahead of the running one.
__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;" :::); }

// A kernel's start of memory work: both of the above.
__device__ __forceinline__ void start() {
    wait_prior_grid();
    launch_dependents();
}

}  // namespace pdl

// Enqueues `kernel` on `stream` with `smem` bytes of dynamic shared memory, in clusters of `cluster` blocks (1: no
// cluster attribute), programmatically dependent on the previous launch where dependent_launch() is on. The kernel
// must call pdl::wait_prior_grid() before it touches global memory. Returns the launch status.
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          unsigned cluster, Args&&... args) {
    cudaLaunchAttribute attribute[2];
    unsigned count = 0;
    if (cluster > 1) {
        attribute[count].id = cudaLaunchAttributeClusterDimension;
        attribute[count].val.clusterDim.x = cluster;
        attribute[count].val.clusterDim.y = 1;
        attribute[count].val.clusterDim.z = 1;
        ++count;
    }
    if (dependent_launch()) {
        attribute[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
        attribute[count].val.programmaticStreamSerializationAllowed = 1;
        ++count;
    }
    cudaLaunchConfig_t config{};
    config.gridDim = grid;
    config.blockDim = block;
    config.dynamicSmemBytes = smem;
    config.stream = stream;
    config.attrs = attribute;
    config.numAttrs = count;
    return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace tk
