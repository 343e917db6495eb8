// The producer/consumer ring of a warp-specialised kernel: Stages shared-memory stages, each with a `full`
// barrier (its bytes landed: TMA complete_tx plus the producer's arrival) and an `empty` barrier (every consumer
// is done with it). Producer and consumers each walk the ring with a cursor whose phase flips every lap, so a
// wait names the lap it expects and a stage is never reused before it is drained.
#pragma once

#include <cstdint>

#include "sync.cuh"

namespace tk::pipeline {

template <int Stages>
struct cursor {
    int stage = 0;
    uint32_t phase = 0;  // parity of the lap

    __device__ __forceinline__ void advance() {
        if (++stage == Stages) stage = 0, phase ^= 1;
    }
    // Past n stages that another consumer drains (n >= 0).
    __device__ __forceinline__ void skip(int n) {
        const int to = stage + n;
        stage = to % Stages;
        phase ^= uint32_t(to / Stages) & 1u;
    }
};

template <int Stages>
struct ring {
    static constexpr int stages = Stages;
    sync::barrier full[Stages];
    sync::barrier empty[Stages];

    // One thread, before anyone uses the ring (then fence_init and a block or cluster barrier).
    __device__ __forceinline__ void init(uint32_t producer_arrivals, uint32_t consumer_arrivals) {
        for (int s = 0; s < Stages; ++s) {
            sync::init(full[s], producer_arrivals);
            sync::init(empty[s], consumer_arrivals);
        }
    }
    // Consumer: until the cursor's stage holds this lap's data.
    __device__ __forceinline__ void wait_full(const cursor<Stages>& c) { sync::wait(full[c.stage], c.phase); }
    // Producer: until the consumers drained the cursor's stage on the previous lap (at once on the first lap).
    __device__ __forceinline__ void wait_empty(const cursor<Stages>& c) { sync::wait(empty[c.stage], c.phase ^ 1); }
};

}  // namespace tk::pipeline
