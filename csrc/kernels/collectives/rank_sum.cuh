// The fp32 sum over ranks that both reduce-scatter paths end in (the SM kernels' receivers in p2p.cu, the copy
// engines' sum kernel): out[i] = scale * (source(0)[i] + source(1)[i] + ...) in rank order, so every rank rounds the
// same sum whichever path it takes.
#pragma once

#include <cstdint>

#include "kittens/common.cuh"

namespace tk::collectives {

// The whole 16-byte vectors [0, n_vec) of `out`: this thread's are first, first + stride, ...; U of them in flight
// per source, each source's loads issued together (enough bytes in flight to drain staging at local memory speed).
// `source(r)`: rank r's part; `load(r, p)`: reads rank r's vector or element at p (__ldcg where a peer's copy
// rewrites it, so that L1 never serves a stale line).
template <typename T, int U, typename Source, typename Load>
__device__ __forceinline__ void sum_rank_vectors(T* out, int64_t n_vec, int64_t first, int64_t stride, int world,
                                                 float scale, Source source, Load load) {
    constexpr int V = vec16_elems<T>;
    for (int64_t base = first; base < n_vec; base += stride * U) {
        float acc[U][V];
#pragma unroll
        for (int u = 0; u < U; ++u)
#pragma unroll
            for (int e = 0; e < V; ++e) acc[u][e] = 0.0f;
        for (int r = 0; r < world; ++r) {
            const uint4* p = reinterpret_cast<const uint4*>(source(r));
            uint4 raw[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const int64_t i = base + int64_t(u) * stride;
                if (i < n_vec) raw[u] = load(r, p + i);
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                const T* v = reinterpret_cast<const T*>(&raw[u]);
#pragma unroll
                for (int e = 0; e < V; ++e) acc[u][e] += to_float(v[e]);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int64_t i = base + int64_t(u) * stride;
            if (i >= n_vec) break;
            uint4 packed;
            T* w = reinterpret_cast<T*>(&packed);
#pragma unroll
            for (int e = 0; e < V; ++e) w[e] = static_cast<T>(acc[u][e] * scale);
            reinterpret_cast<uint4*>(out)[i] = packed;
        }
    }
}

// Elements [from, n) of `out` one at a time (the tail after the vectors, or every element where an address is not
// 16-byte aligned): this thread's are from + first, from + first + stride, ...
template <typename T, typename Source, typename Load>
__device__ __forceinline__ void sum_rank_elements(T* out, int64_t from, int64_t n, int64_t first, int64_t stride,
                                                  int world, float scale, Source source, Load load) {
    for (int64_t i = from + first; i < n; i += stride) {
        float acc = 0.0f;
        for (int r = 0; r < world; ++r) acc += to_float(load(r, source(r) + i));
        out[i] = static_cast<T>(acc * scale);
    }
}

}  // namespace tk::collectives
