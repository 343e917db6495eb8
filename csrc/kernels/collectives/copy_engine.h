// All-gather and reduce-scatter along dim 0 whose data crosses NVLink on the GPUs' copy engines
// (cudaMemcpyAsync between peer mappings), so the transfers occupy no SMs while compute runs beside them.
// Host-visible declarations only.
//
// Every rank owns one symmetric buffer of this layout (mapped into every peer): 32-bit flag words, then staging.
// All-gather pulls: a rank copies its input, a chunk at a time, into one of its own staging slots, and tells each
// peer so by writing the chunk's sequence number into that peer's "ready" word; each peer copies the slot
// straight into its output (a read over NVLink) and writes back into the owner's "done" word. Reduce-scatter
// pushes: a rank copies the part of its input that peer p reduces into p's staging (a write over NVLink) and
// raises p's "ready" word; p sums its own part and the w - 1 staged parts with a small kernel (fp32, rank order,
// the SM kernels' sum) and writes "done" back to each sender. A slot is rewritten only after every reader's
// "done" for the chunk `slots` earlier has arrived.
//
// Flags are raised by stream writes into the peer's mapping (cuStreamWriteValue32), or by a 4-byte copy from a
// local word a stream write set; waits are stream waits on local words (cuStreamWaitValue32). Driver entry points
// are found at run time. A message moves in several chunks so that one chunk's local step overlaps the next's
// transfer.
// Sequence numbers count a channel's chunks since it was made, the same on every rank as long as every rank
// issues the same collectives: as with any collective, a rank that skips one leaves the others waiting. Streams
// under CUDA-graph capture are not served here (the caller uses the SM kernels there).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

#include "kernels/collectives/p2p.h"

namespace tk::collectives {

struct copy_engine_layout {
    int world;
    int slots;             // staging slots per source, used round robin
    int64_t buffer_bytes;  // the whole symmetric buffer

    // Flag words: ready and done for all-gather, then for reduce-scatter, each [source rank][slot]; then one
    // local scratch word per internal stream (the values its flag copies read).
    int64_t flag_words() const { return 4ll * world * slots + world + 2; }
    int64_t stage_offset() const { return (flag_words() * 4 + 4095) / 4096 * 4096; }
    int64_t stage_bytes() const { return buffer_bytes - stage_offset(); }
    // Bytes a slot holds: all-gather stages whole slots of its own input; reduce-scatter keeps one region of
    // `slots` slots per sending peer. Multiples of 256 so that every slot starts 256-byte aligned.
    int64_t gather_slot_bytes() const { return stage_bytes() / slots / 256 * 256; }
    int64_t scatter_slot_bytes() const { return stage_bytes() / (int64_t(slots) * (world - 1)) / 256 * 256; }
};

class copy_engine {
  public:
    // `buffers`: every rank's symmetric buffer as mapped in this process (world entries); `reduce_blocks`: the
    // grid of reduce-scatter's sum kernel; `signal_by_copy`: raise peers' flags by a 4-byte copy from a local
    // word instead of a stream write into the peer's mapping. Throws std::runtime_error or std::invalid_argument.
    copy_engine(int world, int rank, int slots, int64_t buffer_bytes, const std::uintptr_t* buffers, int reduce_blocks,
                bool signal_by_copy);
    ~copy_engine();
    copy_engine(const copy_engine&) = delete;
    copy_engine& operator=(const copy_engine&) = delete;

    // Enqueue on `stream` (the work forks onto the engine's streams and joins back); never synchronises.
    cudaError_t all_gather(const void* in, void* out, int64_t bytes_per_rank, cudaStream_t stream);
    cudaError_t reduce_scatter(const void* in, void* out, int64_t elems_per_rank, int dtype, bool average,
                               cudaStream_t stream);

    const copy_engine_layout& layout() const { return layout_; }

  private:
    uint32_t* flag(int rank, int kind, int source, int slot) const;  // kind 0..3: ag ready, ag done, rs ready, rs done
    char* stage(int rank) const { return static_cast<char*>(buffers_[rank]) + layout_.stage_offset(); }
    cudaError_t signal(cudaStream_t s, int scratch, uint32_t value, int to_rank, int kind, int slot);
    cudaError_t wait(cudaStream_t s, int kind, int source, int slot, uint32_t value);
    cudaError_t fork(cudaStream_t caller);
    cudaError_t join(cudaStream_t caller);

    copy_engine_layout layout_{};
    bool signal_by_copy_ = false;
    int rank_ = 0, reduce_blocks_ = 0;
    void* buffers_[max_ranks] = {};
    cudaStream_t stage_ = nullptr, reduce_ = nullptr, link_[max_ranks] = {};  // link_[p]: traffic with peer p
    cudaEvent_t forked_ = nullptr, joined_[max_ranks + 2] = {};
    // Chunks so far. 64 bits: a slot's reuse test (chunk >= slots) must never see the count start over; the flags
    // carry its low 32 bits + 1, compared with wrap-around.
    uint64_t gathered_ = 0, scattered_ = 0;
};

}  // namespace tk::collectives
