// All-gather and reduce-scatter along dim 0 whose data crosses NVLink on the GPUs' copy engines
// (cudaMemcpyAsync between peer mappings), so the transfers occupy no SMs while compute runs beside them.
// Host-visible declarations only.
//
// Every rank owns one symmetric buffer of this layout (mapped into every peer): 32-bit flag words, then staging,
// one region of `slots` slots per sending peer. Both ops push: a rank copies a chunk of its input straight into
// its region at each peer (a write over NVLink, no staging copy before it) and raises that peer's "ready" word.
// The receiver waits for all w - 1 chunks, then one small kernel either copies them (all-gather: each staged
// chunk and its own input's chunk to their places in the output) or sums them with its own part (reduce-scatter:
// fp32, rank order), and writes "done" back to each sender. A region's slot is rewritten only after its reader's
// "done" for the chunk `slots` earlier has arrived; the two ops count their chunks together and share the slots
// and the flags. The receiver's local work runs on SMs so that no local copy queues on the copy engines beside the
// transfers (an earlier all-gather staged its input with local copies and pulled: 280 GB/s where plain copies
// over NVLink reach 376, on 2 H200s).
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

    // Flag words: ready, then done, each [source rank][slot]; then one local scratch word per internal stream
    // (the values its flag copies read): the local stream's, then link p's.
    int64_t flag_words() const { return 2ll * world * slots + world + 1; }
    int64_t stage_offset() const { return (flag_words() * 4 + 4095) / 4096 * 4096; }
    int64_t stage_bytes() const { return buffer_bytes - stage_offset(); }
    // Bytes a slot holds (each sending peer has `slots` of them); a multiple of 256, so every slot starts 256-byte
    // aligned.
    int64_t slot_bytes() const { return stage_bytes() / (int64_t(slots) * (world - 1)) / 256 * 256; }
};

class copy_engine {
  public:
    // `buffers`: every rank's symmetric buffer as mapped in this process (world entries); `reduce_blocks`: the
    // grid of the receiver's kernel (all-gather's copy, reduce-scatter's sum); `signal_by_copy`: raise peers'
    // flags by a 4-byte copy from a local word instead of a stream write into the peer's mapping. Throws
    // std::runtime_error or std::invalid_argument.
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
    uint32_t* flag(int rank, int kind, int source, int slot) const;  // kind 0: ready, 1: done
    // Where the chunk from `sender` sits in `receiver`'s staging.
    char* region(int receiver, int sender, int slot) const;
    cudaError_t signal(cudaStream_t s, int scratch, uint32_t value, int to_rank, int kind, int slot);
    cudaError_t wait(cudaStream_t s, int kind, int source, int slot, uint32_t value);
    cudaError_t push(uint64_t k, int p, const void* from, int64_t bytes);
    cudaError_t await_peers(uint64_t k);
    cudaError_t release(uint64_t k);
    cudaError_t fork(cudaStream_t caller);
    cudaError_t join(cudaStream_t caller);
    template <typename PeerPiece, typename LocalStep>
    cudaError_t for_each_chunk(int64_t units, int64_t unit_bytes, cudaStream_t stream, PeerPiece peer_piece,
                               LocalStep local_step);

    copy_engine_layout layout_{};
    bool signal_by_copy_ = false;
    int rank_ = 0, reduce_blocks_ = 0;
    void* buffers_[max_ranks] = {};
    cudaStream_t local_ = nullptr, link_[max_ranks] = {};  // local_: the receiver's kernels; link_[p]: pushes to p
    cudaEvent_t forked_ = nullptr, joined_[max_ranks] = {};
    // Chunks so far, of both ops: they share the slots and the flags, so a reduce-scatter never writes into a slot
    // whose all-gather chunk a peer has yet to copy out (and the reverse). 64 bits: a slot's reuse test (chunk >=
    // slots) must never see the count start over; the flags carry its low 32 bits + 1, compared with wrap-around.
    uint64_t chunks_ = 0;
};

}  // namespace tk::collectives
