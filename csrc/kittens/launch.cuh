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

// A launch's configuration with its attributes: blocks in clusters of `cluster` (1: no cluster attribute), and
// programmatically dependent on the previous launch in the stream where `dependent`. One builder for launches and
// occupancy queries alike; not copyable, since the configuration points at the attributes beside it.
struct launch_config {
    cudaLaunchAttribute attribute[2];
    cudaLaunchConfig_t config{};

    launch_config(dim3 grid, dim3 block, size_t smem, cudaStream_t stream, unsigned cluster, bool dependent) {
        unsigned count = 0;
        if (cluster > 1) {
            attribute[count].id = cudaLaunchAttributeClusterDimension;
            attribute[count].val.clusterDim.x = cluster;
            attribute[count].val.clusterDim.y = 1;
            attribute[count].val.clusterDim.z = 1;
            ++count;
        }
        if (dependent) {
            attribute[count].id = cudaLaunchAttributeProgrammaticStreamSerialization;
            attribute[count].val.programmaticStreamSerializationAllowed = 1;
            ++count;
        }
        config.gridDim = grid;
        config.blockDim = block;
        config.dynamicSmemBytes = smem;
        config.stream = stream;
        config.attrs = attribute;
        config.numAttrs = count;
    }
    launch_config(const launch_config&) = delete;
    launch_config& operator=(const launch_config&) = delete;
};

// Enqueues `kernel` on `stream` with `smem` bytes of dynamic shared memory, in clusters of `cluster` blocks (1: no
// cluster attribute), programmatically dependent on the previous launch where dependent_launch() is on. The kernel
// must call pdl::wait_prior_grid() before it touches global memory. Returns the launch status (the binding's
// check_launch clears a failure from the runtime's last error as it raises).
template <typename... Params, typename... Args>
cudaError_t launch_kernel(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                          unsigned cluster, Args&&... args) {
    const launch_config launch(grid, block, smem, stream, cluster, dependent_launch());
    return cudaLaunchKernelEx(&launch.config, kernel, std::forward<Args>(args)...);
}

}  // namespace tk
