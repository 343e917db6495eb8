#include "common.cuh"
#include "launch.h"

namespace tk {

int current_device() {
    int device = -1;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= max_devices) return -1;
    return device;
}

int multiprocessor_count() {
    // Device attributes never change while the process runs; read each device once.
    static int cached[max_devices] = {0};
    const int device = current_device();
    if (device < 0) return 132;
    if (cached[device] == 0) {
        int count = 0;
        if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0)
            count = 132;
        cached[device] = count;
    }
    return cached[device];
}

namespace {
std::atomic<bool> dependent_launch_on{true};
}

void set_dependent_launch(bool enabled) { dependent_launch_on.store(enabled, std::memory_order_relaxed); }
bool dependent_launch() { return dependent_launch_on.load(std::memory_order_relaxed); }

}  // namespace tk
