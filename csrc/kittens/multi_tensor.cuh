// Multi-tensor launches: many dense tensors handled by one grid, the table of tensors passed as the kernel's
// (__grid_constant__) parameter, so nothing is copied to the GPU first and a launch can be captured in a graph.
// Each tensor is cut into chunks of a kernel-chosen element count; chunks are numbered across the tensors in order,
// and a persistent grid takes them in increasing order, so a block finds a chunk's tensor by walking forward from
// the previous one. `chunk_index` is that numbering; a kernel's table holds one beside its own pointer arrays.
// Plain C++ apart from the host/device qualifiers, so that tests/cpp/multi_tensor_check.cpp walks it on the host.
#pragma once

#include <algorithm>
#include <cstdint>

namespace tk {

template <int N>
struct chunk_index {
    static_assert(N % 32 == 0, "tensors in whole 32-bit words of alignment bits");
    int64_t numel[N];
    int64_t chunk_end[N];      // chunks of tensors 0..i together
    uint32_t aligned[N / 32];  // bit i: every pointer of tensor i starts on a 16-byte boundary (the vector path)
    int count;

    void clear() {
        count = 0;
        std::fill(aligned, aligned + N / 32, 0u);
    }
    // Appends a tensor of `elements` elements cut into `chunk`-element chunks (the caller keeps count < N).
    void add(int64_t elements, int64_t chunk, bool aligned16) {
        const int i = count++;
        numel[i] = elements;
        chunk_end[i] = (i > 0 ? chunk_end[i - 1] : 0) + (elements + chunk - 1) / chunk;
        if (aligned16) aligned[i / 32] |= 1u << (i % 32);
    }
    __host__ __device__ int64_t chunks() const { return count > 0 ? chunk_end[count - 1] : 0; }

    // Where chunk `c` lies. `t` is the tensor of an earlier chunk (0 at first), advanced to this chunk's.
    struct place {
        int64_t start;  // the chunk's first element within its tensor
        int n;          // its elements: `chunk`, or fewer in a tensor's last chunk
        bool aligned;
    };
    template <int CHUNK>
    __device__ __forceinline__ place locate(int64_t c, int& t) const {
        while (c >= chunk_end[t]) ++t;
        const int64_t start = (c - (t > 0 ? chunk_end[t - 1] : 0)) * CHUNK;
        const int n = static_cast<int>(std::min<int64_t>(CHUNK, numel[t] - start));
        return {start, n, ((aligned[t / 32] >> (t % 32)) & 1u) != 0};
    }
};

// Calls `launch(first, count)` for each run of up to N consecutive entries of `total`, in order, and returns the
// first result that is not `ok` (the later runs not called), else `ok`.
template <int N, typename Status, typename Launch>
Status for_each_batch(int total, Status ok, Launch&& launch) {
    for (int first = 0; first < total; first += N) {
        const Status status = launch(first, std::min(N, total - first));
        if (status != ok) return status;
    }
    return ok;
}

}  // namespace tk
