#include "common.cuh"

namespace tk {

int multiprocessor_count() {
    // Device attributes never change while the process runs; read each device once.
    static int cached[128] = {0};
    int device = 0;
    if (cudaGetDevice(&device) != cudaSuccess || device < 0 || device >= 128) return 132;
    if (cached[device] == 0) {
        int count = 0;
        if (cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device) != cudaSuccess || count <= 0)
            count = 132;
        cached[device] = count;
    }
    return cached[device];
}

}  // namespace tk
