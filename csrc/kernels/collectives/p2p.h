// All-gather and reduce-scatter along dim 0 between the GPUs of one node, over NVLink peer mappings.
// Host-visible declarations only.
//
// Every rank owns one symmetric buffer (the same size on each rank, mapped into every peer): a flag area, then
// a staging area. Data moves by pushing: a rank reads its own input and stores it straight into the receiving
// rank's staging cells (remote writes), then stores a "ready" flag there; the receiver copies (all-gather) or
// reduces (reduce-scatter) from its own staging into the output and stores a "consumed" flag back at the sender.
// Each block of the grid owns `slots` cells per peer, used round robin, so a message of any size streams
// through a fixed buffer. With `pairs` (three or more ranks) a block exchanges with one peer each way instead
// of all of them: block b sends to the rank 1 + b % (world - 1) ahead and receives from the rank as far behind,
// so its handshakes wait for one peer, and it owns `slots` cells in all. Flags carry per-block sequence numbers that keep growing across calls: no resets,
// no host involvement, and the same launch works in a CUDA graph only if replayed in the same order on all
// ranks (as for any collective).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::collectives {

constexpr int max_ranks = 16;

// The layout of one rank's symmetric buffer, identical on every rank (all sizes in bytes).
struct channel_layout {
    int world;          // ranks in the group
    int blocks;         // grid blocks the flags are laid out for (a launch uses at most this many)
    int slots;          // staging cells per (block, peer), used round robin
    int64_t cell_bytes; // capacity of one staging cell, a multiple of 16
    bool pairs;         // blocks paired with one peer each (needs world >= 3 and blocks >= world - 1)

    __host__ __device__ int peers() const { return world > 1 ? world - 1 : 1; }
    __host__ __device__ int cells_per_slot() const { return pairs ? 1 : peers(); }  // of one block
    __host__ __device__ int64_t flag_words() const { return 2ll * blocks * slots * world + blocks + 1; }
    __host__ __device__ int64_t stage_offset() const { return (flag_words() * 8 + 4095) / 4096 * 4096; }
    __host__ __device__ int64_t total_bytes() const {
        return stage_offset() + int64_t(blocks) * slots * cells_per_slot() * cell_bytes;
    }
};

struct channel_args {
    channel_layout layout;
    int rank;
    void* buffers[max_ranks];     // every rank's symmetric buffer, as mapped in this process
    int64_t* error;               // host-mapped error record (error_record), shared by the channel's launches
    int64_t timeout_ns;           // how long a block waits for a peer before giving up
};

// Written (once, by the first block that fails) into channel_args::error.
enum error_field : int { err_code = 0, err_op, err_peer, err_block, err_expected, err_seen, err_rank, err_fields };
enum error_code : int64_t { ok = 0, timeout = 1, out_of_step = 2, aborted = 3 };
enum op_code : int64_t { op_all_gather = 1, op_reduce_scatter = 2 };

// out[r * bytes_per_rank + i] = input of rank r [i], for every rank r.
struct all_gather_args {
    channel_args ch;
    const void* in;
    void* out;
    int64_t bytes_per_rank;
    int64_t chunk_bytes;  // per unit of work; <= cell_bytes, multiple of 16
    int elem_bytes;       // 2 or 4: the unit of unaligned copies
    int sender_warps;     // of a block's 16 warps, how many send (1..15); the rest receive
};

// out[i] = sum over ranks r of (input of rank r)[rank * elems_per_rank + i], accumulated in fp32 in rank order,
// times 1/world when `average`.
struct reduce_scatter_args {
    channel_args ch;
    const void* in;
    void* out;
    int64_t elems_per_rank;
    int64_t chunk_elems;  // per unit of work; chunk_elems * element size <= cell_bytes, 16-byte multiple
    int dtype;            // tk::dtype
    bool average;
    int sender_warps;     // of a block's 16 warps, how many send (1..15); the rest receive and reduce
};

// Enqueue on `stream`; never synchronise. `grid` <= layout.blocks (0: as many as the message needs).
cudaError_t launch_all_gather(const all_gather_args& args, int grid, cudaStream_t stream);
cudaError_t launch_reduce_scatter(const reduce_scatter_args& args, int grid, cudaStream_t stream);

}  // namespace tk::collectives
