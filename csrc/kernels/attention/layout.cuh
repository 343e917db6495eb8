// Host-side pieces the attention kernels share: the (B, H, S, D) tensor maps and the argument checks common to
// forward and backward.
#pragma once

#include <cmath>
#include <cstdint>

#include "../../kittens/kittens.cuh"

namespace tk::attention::layout {

// A (B, H, S, D) tensor with strides (batch, head, sequence) in elements, as a 4-D map of boxes of box_inner of D
// by 64 rows, 128-byte swizzled.
inline CUresult map_of(CUtensorMap* map, const void* base, CUtensorMapDataType type, int element_bytes,
                       int64_t batch, int64_t heads, int64_t len, int64_t head_dim, const int64_t (&stride)[3],
                       uint32_t box_inner = 64) {
    const uint64_t dims[4] = {uint64_t(head_dim), uint64_t(len), uint64_t(heads), uint64_t(batch)};
    const int64_t strides[3] = {stride[2], stride[1], stride[0]};  // sequence, head, batch
    return tma::make_tensor_map_4d(map, base, type, element_bytes, dims, strides, box_inner, 64, tma::swizzle::b128);
}

// Whether TMA can step over a tensor with these strides: every stride of a dimension longer than 1 a positive
// multiple of 16 bytes (8 elements of 16 bits).
inline bool strides_ok(const int64_t (&stride)[3], int64_t batch, int64_t heads, int64_t len) {
    const int64_t sizes[3] = {batch, heads, len};
    for (int i = 0; i < 3; ++i)
        if (sizes[i] > 1 && (stride[i] <= 0 || stride[i] % 8)) return false;
    return true;
}

// The longest query or key length the kernels take.
constexpr int64_t max_len = (int64_t(1) << 31) - 65536;

// Why these sizes and options cannot run (null when they can), for forward and backward alike.
inline const char* shape_unsupported(int dtype_code, int64_t head_dim, int64_t batch, int64_t q_heads,
                                     int64_t kv_heads, int64_t q_len, int64_t kv_len, bool causal, float scale,
                                     int window = 0) {
    if (dtype_code != int(dtype::bf16) && dtype_code != int(dtype::fp16)) return "dtype must be bfloat16 or float16";
    if (head_dim != 64 && head_dim != 128 && head_dim != 256) return "head_dim must be 64, 128 or 256";
    if (batch < 1 || q_heads < 1 || kv_heads < 1 || q_len < 1 || kv_len < 1)
        return "batch, heads and lengths must be at least 1";
    if (q_heads % kv_heads) return "q_heads must be a multiple of kv_heads";
    if (causal && q_len != kv_len) return "causal attention needs q_len == kv_len";
    if (window < 0) return "window must be >= 0 (0: no sliding window)";
    if (window > 0 && !causal) return "a sliding window (window > 0) needs causal attention";
    // Below 2^31 with room: the kernels add up to a tile and a key block to a row index in 32 bits (the forward's
    // causal key blocks of a tile, row0 + BM + 127).
    if (q_len > max_len || kv_len > max_len) return "sequence length too large";
    // ops.attention_forward/backward fold a negative scale into q and replace 0 with a tiny positive one.
    if (!std::isfinite(scale) || !(scale > 0.0f)) return "scale must be positive and finite";
    return nullptr;
}

// Causal tiles differ in work, so the kernels start the heaviest first; but heaviest-first over all heads makes
// every wave of blocks touch a different head each, and the tensors that blocks of one head share (K/V in the
// forward; Q, dO and dQ in the backward) stop fitting in L2 (at S = 2048 the causal backward took as long as the
// full one). So heads go in chunks whose shared bytes fit this budget, heaviest tiles first within a chunk.
constexpr int64_t l2_chunk_budget = int64_t(16) << 20;

// Heads per chunk: at least 1, at most `heads`. With `min_tiles`, the chunk doubles until it holds that many tiles
// (`tiles_per_head` each): chunks much smaller than a wave put the grid's last heavy tiles on its tail. Grouped heads
// (the backward's blocks walk every query head of a group, so a head's bytes are G times more and its chunk G times
// smaller) had chunks of 64 blocks for 132 SMs and ran 8% slower than the same heads repeated: a 1.22x longest-to-
// mean load in a greedy model of the block order, 1.03x with 128 blocks. The backward asks for half the SMs, which
// leaves the ungrouped chunks as they were (128 blocks at D = 128 for every S).
inline int heads_per_chunk(int64_t bytes_per_head, int64_t heads, int64_t tiles_per_head = 0, int64_t min_tiles = 0) {
    const int64_t fit = bytes_per_head > 0 ? l2_chunk_budget / bytes_per_head : heads;
    int64_t chunk = fit < 1 ? 1 : (fit > heads ? heads : fit);
    while (chunk < heads && chunk * tiles_per_head < min_tiles) chunk *= 2;
    return int(chunk > heads ? heads : chunk);
}

// Tile `linear` of a chunked, heaviest-first order over `heads` heads of `tiles` tiles each: (head, rank), where
// rank 0 is a head's heaviest tile. Chunks of `chunk` heads (the last may hold fewer) follow each other; within a
// chunk rank r of every head comes before rank r + 1 of any. 32-bit: the launchers keep heads * tiles < 2^31.
struct chunked_tile {
    int head, rank;
};
__host__ __device__ inline chunked_tile chunked_order(int linear, int heads, int tiles, int chunk) {
    const int per_chunk = chunk * tiles, first = linear / per_chunk * chunk, r = linear % per_chunk;
    const int here = heads - first < chunk ? heads - first : chunk;
    return {first + r % here, r / here};
}

}  // namespace tk::attention::layout
