// All-gather and reduce-scatter over NVLink peer mappings (see p2p.h for the protocol).
//
// Block b of every rank handles units b, b + grid, ... of the message (with `pairs`: the blocks of lane
// b / (world - 1), one per peer distance, handle units lane, lane + lanes, ..., each with its own peer). Unit k of a block (counted over the
// block's whole life, across calls) is staged in cell k % slots and announced with flag value k + 1. A sender
// may refill a cell once every receiver has reported the unit `slots` earlier as consumed. Each block is two
// teams of warps running side by side: the sending team streams units out over NVLink while the receiving team
// drains the units that have arrived, so the link never waits for a local copy. tests/test_collectives_schedule.py
// plays this schedule on the CPU for 2-16 ranks: change its index arithmetic there too.
#include "kernels/collectives/p2p.h"
#include "kernels/collectives/rank_sum.cuh"

#include <algorithm>

#include "kittens/common.cuh"
#include "kittens/peer.cuh"
#include "kittens/sync.cuh"

namespace tk::collectives {
namespace {

constexpr int threads = 512;
constexpr int unroll = 8;  // 16-byte vectors in flight per thread per destination pass (loads are latency-bound)
constexpr int reduce_unroll = 4;  // per source: a reduce has `world` sources in flight

// Part of the block: the senders (the first `senders` threads, named barrier 1) or the receivers (the rest, named
// barrier 2).
struct team {
    int id;    // 0: senders, 1: receivers
    int size;  // threads in the team, a multiple of 32
    int first; // the team's first thread
    __device__ static team mine(int senders) {
        return threadIdx.x < senders ? team{0, senders, 0} : team{1, threads - senders, senders};
    }
    __device__ int rank() const { return threadIdx.x - first; }
    __device__ bool leader() const { return rank() == 0; }
    __device__ void sync() const { sync::named_sync(1 + id, size); }
    // The leader's verdict, seen by the whole team.
    __device__ bool agrees(bool leader_ok) const {
        __shared__ int ok[2];
        if (leader()) ok[id] = leader_ok;
        sync();
        const bool r = ok[id] != 0;
        sync();
        return r;
    }
};

// The flag area of one rank's buffer.
struct flags_of {
    uint64_t* base;
    const channel_layout& L;

    __device__ int64_t cells() const { return int64_t(L.blocks) * L.slots * L.world; }
    // At the receiver: the sender `src` announces unit `value` in cell (b, j).
    __device__ uint64_t* ready(int b, int j, int src) const { return base + (int64_t(b) * L.slots + j) * L.world + src; }
    // At the sender: receiver `dst` has drained the unit `value` of cell (b, j).
    __device__ uint64_t* consumed(int b, int j, int dst) const {
        return base + cells() + (int64_t(b) * L.slots + j) * L.world + dst;
    }
    __device__ uint64_t* seq(int b) const { return base + 2 * cells() + b; }  // units block b has done, ever
    // Nonzero once any launch on this channel failed: later launches return at once (the host raises).
    __device__ uint64_t* abort_word() const { return base + 2 * cells() + L.blocks; }
};

// Staging cell (b, j) in `receiver_buffer` that holds data from the sender `src` (receiver = `receiver`).
__device__ __forceinline__ char* cell(void* receiver_buffer, const channel_layout& L, int b, int j, int src,
                                      int receiver) {
    const int index = L.pairs ? 0 : (src - receiver - 1 + L.world) % L.world;
    return static_cast<char*>(receiver_buffer) + L.stage_offset() +
           ((int64_t(b) * L.slots + j) * L.cells_per_slot() + index) * L.cell_bytes;
}

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15) == 0; }

// Thread 0 only. The first failure on a channel writes the host-visible record; every later one just stops.
__device__ void fail(const channel_args& ch, const flags_of& mine, int64_t code, int64_t op, int peer, int b,
                     uint64_t expected, uint64_t seen) {
    auto* abort_word = reinterpret_cast<unsigned long long*>(mine.abort_word());
    if (atomicCAS(abort_word, 0ull, static_cast<unsigned long long>(code)) != 0ull) return;
    volatile int64_t* e = ch.error;
    e[err_op] = op;
    e[err_peer] = peer;
    e[err_block] = b;
    e[err_expected] = static_cast<int64_t>(expected);
    e[err_seen] = static_cast<int64_t>(seen);
    e[err_rank] = ch.rank;
    __threadfence_system();
    e[err_code] = code;
    __threadfence_system();
}

// Thread 0 only: wait until *flag >= want (== want when `exact`), within the channel's timeout.
__device__ bool wait_flag(const channel_args& ch, const flags_of& mine, const uint64_t* flag, uint64_t want,
                          bool exact, int64_t op, int peer, int b) {
    const uint64_t start = peer::now_ns();
    for (uint32_t spin = 0;; ++spin) {
        const uint64_t v = peer::load_acquire(flag);
        if (v >= want) {
            if (exact && v != want) {
                fail(ch, mine, out_of_step, op, peer, b, want, v);
                return false;
            }
            return true;
        }
        if ((spin & 255) == 255) {
            if (*reinterpret_cast<volatile uint64_t*>(mine.abort_word()) != 0) return false;
            if (static_cast<int64_t>(peer::now_ns() - start) > ch.timeout_ns) {
                fail(ch, mine, timeout, op, peer, b, want, v);
                return false;
            }
        }
    }
}

// Copy `bytes` from `src` to each of `n_dst` destinations with the whole block: 16-byte vectors when every
// pointer allows, then `elem`-byte elements for the rest. Stage reads bypass L1 (cells are rewritten by peers).
template <bool SrcIsStage>
__device__ void copy_team(const team& t, char* const* dst, int n_dst, const char* src, int64_t bytes, int elem) {
    const int threads = t.size;
    bool vec = aligned16(src);
    for (int d = 0; d < n_dst; ++d) vec = vec && aligned16(dst[d]);
    int64_t done = 0;
    if (vec) {
        const int64_t n_vec = bytes / 16;
        const uint4* s = reinterpret_cast<const uint4*>(src);
        for (int64_t base = t.rank(); base < n_vec; base += int64_t(threads) * unroll) {
            uint4 r[unroll];
#pragma unroll
            for (int u = 0; u < unroll; ++u) {
                const int64_t i = base + int64_t(u) * threads;
                if (i < n_vec) r[u] = SrcIsStage ? __ldcg(s + i) : s[i];
            }
            for (int d = 0; d < n_dst; ++d) {
                uint4* t = reinterpret_cast<uint4*>(dst[d]);
#pragma unroll
                for (int u = 0; u < unroll; ++u) {
                    const int64_t i = base + int64_t(u) * threads;
                    if (i < n_vec) t[i] = r[u];
                }
            }
        }
        done = n_vec * 16;
    }
    if (elem == 4) {
        for (int64_t i = done / 4 + t.rank(); i < bytes / 4; i += threads) {
            const uint32_t v = reinterpret_cast<const uint32_t*>(src)[i];
            for (int d = 0; d < n_dst; ++d) reinterpret_cast<uint32_t*>(dst[d])[i] = v;
        }
    } else {
        for (int64_t i = done / 2 + t.rank(); i < bytes / 2; i += threads) {
            const uint16_t v = reinterpret_cast<const uint16_t*>(src)[i];
            for (int d = 0; d < n_dst; ++d) reinterpret_cast<uint16_t*>(dst[d])[i] = v;
        }
    }
}

// State one block keeps while streaming its units.
struct stream_state {
    const channel_args& ch;
    flags_of mine;
    int b, me, world;
    uint64_t seq0;  // units this block had done before this launch
    int64_t op;
    int senders;    // threads of the sending team
    int d0, npeers; // the block sends to the ranks d0 .. d0 + npeers - 1 ahead, receives from as many behind
    int lane, lanes;  // the block's units are lane, lane + lanes, ... (siblings of a lane share its units)

    // The block's state at the start of a launch of `op` on channel `ch`.
    __device__ static stream_state of(const channel_args& ch, int64_t op, int sender_warps) {
        const flags_of mine{static_cast<uint64_t*>(ch.buffers[ch.rank]), ch.layout};
        const int b = blockIdx.x, P = ch.layout.peers(), grid = gridDim.x;
        const bool pairs = ch.layout.pairs;
        return {ch, mine, b, ch.rank, ch.layout.world, *mine.seq(b), op, 32 * sender_warps,
                pairs ? 1 + b % P : 1, pairs ? 1 : P, pairs ? b / P : b, pairs ? grid / P : grid};
    }
    __device__ bool pairs() const { return ch.layout.pairs; }
    __device__ int to(int i) const { return (me + d0 + i) % world; }            // i-th rank sent to
    __device__ int from(int i) const { return (me + world - d0 - i) % world; }  // i-th rank received from
    // Where the block's unit k starts, in units of `unit` (bytes or elements): units go round the lanes.
    __device__ int64_t unit_offset(int64_t k, int64_t unit) const { return (lane + k * lanes) * unit; }
    // With pairs, the siblings of a lane take turns at work done once per unit (all-gather's own copy,
    // reduce-scatter's sum).
    __device__ bool my_turn(int64_t k) const { return !pairs() || k % ch.layout.peers() == d0 - 1; }
    // Block of this lane paired with the peer distance d (1..world-1).
    __device__ int sibling(int d) const { return pairs() ? lane * ch.layout.peers() + d - 1 : b; }
    __device__ int slot(int64_t k) const { return static_cast<int>((seq0 + k) % ch.layout.slots); }
    __device__ uint64_t value(int64_t k) const { return seq0 + k + 1; }
    __device__ flags_of flags_at(int rank) const { return {static_cast<uint64_t*>(ch.buffers[rank]), ch.layout}; }
};

// Before staging unit k: every receiver has drained the unit that last used this cell.
__device__ bool wait_cell_free(const team& t, const stream_state& s, int64_t k) {
    bool ok = true;
    const uint64_t v = s.value(k);
    const int slots = s.ch.layout.slots;
    if (t.leader() && v > uint64_t(slots)) {
        for (int i = 0; i < s.npeers && ok; ++i) {
            const int p = s.to(i);
            ok = wait_flag(s.ch, s.mine, s.mine.consumed(s.b, s.slot(k), p), v - slots, false, s.op, p, s.b);
        }
    }
    return t.agrees(ok);
}

// After the team staged unit k at every receiver.
__device__ void announce(const team& t, const stream_state& s, int64_t k) {
    t.sync();  // the team's writes happen before the leader's release store (cumulative at system scope)
    if (t.leader()) {
        for (int i = 0; i < s.npeers; ++i) {
            const int p = s.to(i);
            peer::store_release(s.flags_at(p).ready(s.b, s.slot(k), s.me), s.value(k));
        }
    }
}

// The cells a receiving team drains for one unit: the i-th (i < n) is the cell of block(i) holding data from
// rank src(i). Either the block's own cells (one per peer it receives from), or with `whole` (a reduction needs
// every rank's part in one place) and pairs, on the sibling's turn the cells of its whole lane, and none otherwise.
struct inbox {
    int n;
    bool lane;  // the lane's cells: the i-th from the sibling paired with distance i + 1
    __device__ static inbox of(const stream_state& s, int64_t k, bool whole) {
        if (!whole || !s.pairs()) return {s.npeers, false};
        return {s.my_turn(k) ? s.world - 1 : 0, true};
    }
    __device__ int block(const stream_state& s, int i) const { return lane ? s.sibling(i + 1) : s.b; }
    __device__ int src(const stream_state& s, int i) const {
        return lane ? (s.me + s.world - 1 - i) % s.world : s.from(i);
    }
};

__device__ bool wait_ready(const team& t, const stream_state& s, const inbox& in, int64_t k) {
    bool ok = true;
    if (t.leader())
        for (int i = 0; i < in.n && ok; ++i)
            ok = wait_flag(s.ch, s.mine, s.mine.ready(in.block(s, i), s.slot(k), in.src(s, i)), s.value(k), true,
                           s.op, in.src(s, i), in.block(s, i));
    return t.agrees(ok);
}

__device__ void release_cells(const team& t, const stream_state& s, const inbox& in, int64_t k) {
    t.sync();
    if (t.leader())
        for (int i = 0; i < in.n; ++i)
            peer::store_release(s.flags_at(in.src(s, i)).consumed(in.block(s, i), s.slot(k), s.me), s.value(k));
}

// The senders run send(k) for each of the block's units, the receivers recv(k, inbox) for each unit their
// inbox has cells of (`whole`: see inbox_of); a failed wait (the channel is then aborted) ends the team's loop,
// and the other team's waits end on the abort word. Siblings of a lane have the same units, so their sequence
// numbers (and so the slot of each unit) stay equal.
template <class Send, class Recv>
__device__ void run_units(stream_state& s, int64_t units, bool whole, Send send, Recv recv) {
    const int64_t mine = units > s.lane ? (units - s.lane + s.lanes - 1) / s.lanes : 0;
    const team t = team::mine(s.senders);
    for (int64_t k = 0; k < mine; ++k) {
        if (t.id == 0) {
            if (!wait_cell_free(t, s, k)) break;
            send(t, k);
            announce(t, s, k);
        } else {
            const inbox in = inbox::of(s, k, whole);
            if (in.n == 0) continue;
            if (!wait_ready(t, s, in, k)) break;
            recv(t, k, in);
            release_cells(t, s, in, k);
        }
    }
    __syncthreads();
    if (threadIdx.x == 0 && *reinterpret_cast<volatile uint64_t*>(s.mine.abort_word()) == 0)
        *s.mine.seq(s.b) = s.seq0 + mine;
}

// Elementwise a + b (halved when `half`) of two 16-byte vectors, each result rounded once.
template <typename T> __device__ __forceinline__ uint4 add_packed(uint4 a, uint4 b, bool half);
template <> __device__ __forceinline__ uint4 add_packed<float>(uint4 a, uint4 b, bool half) {
    const float m = half ? 0.5f : 1.0f;
    return make_uint4(__float_as_uint((__uint_as_float(a.x) + __uint_as_float(b.x)) * m),
                      __float_as_uint((__uint_as_float(a.y) + __uint_as_float(b.y)) * m),
                      __float_as_uint((__uint_as_float(a.z) + __uint_as_float(b.z)) * m),
                      __float_as_uint((__uint_as_float(a.w) + __uint_as_float(b.w)) * m));
}
template <typename T2> __device__ __forceinline__ uint32_t add2(uint32_t a, uint32_t b, bool half) {
    const T2 r = __hadd2(*reinterpret_cast<const T2*>(&a), *reinterpret_cast<const T2*>(&b));
    // Halving is exact (a power of two) except where it makes a subnormal, as in fp32.
    const T2 h = half ? __hmul2(r, T2(__float2half2_rn(0.5f))) : r;
    return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint4 add_packed<__half>(uint4 a, uint4 b, bool half) {
    return make_uint4(add2<__half2>(a.x, b.x, half), add2<__half2>(a.y, b.y, half), add2<__half2>(a.z, b.z, half),
                      add2<__half2>(a.w, b.w, half));
}
__device__ __forceinline__ uint32_t add2_bf16(uint32_t a, uint32_t b, bool half) {
    const __nv_bfloat162 r = __hadd2(*reinterpret_cast<const __nv_bfloat162*>(&a), *reinterpret_cast<const __nv_bfloat162*>(&b));
    const __nv_bfloat162 h = half ? __hmul2(r, __float2bfloat162_rn(0.5f)) : r;
    return *reinterpret_cast<const uint32_t*>(&h);
}
template <> __device__ __forceinline__ uint4 add_packed<__nv_bfloat16>(uint4 a, uint4 b, bool half) {
    return make_uint4(add2_bf16(a.x, b.x, half), add2_bf16(a.y, b.y, half), add2_bf16(a.z, b.z, half),
                      add2_bf16(a.w, b.w, half));
}

// out[i] = own[i] + cell[i] over n_vec 16-byte vectors, U vectors in flight per source and thread. With two
// terms the order is immaterial (a + b == b + a, rounded once), so the loads need not depend on the rank: the
// cell is read past L1 (peers rewrite it), the input through it.
template <typename T, int U>
__device__ __forceinline__ void add_pairs(const team& t, const T* own, const T* cell, T* out, int64_t n_vec,
                                          bool half) {
    const int threads = t.size;
    const uint4* po = reinterpret_cast<const uint4*>(own);
    const uint4* pc = reinterpret_cast<const uint4*>(cell);
    uint4* pout = reinterpret_cast<uint4*>(out);
    for (int64_t base = t.rank(); base < n_vec; base += int64_t(threads) * U) {
        uint4 x[U], y[U];
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int64_t i = base + int64_t(u) * threads;
            if (i < n_vec) {
                x[u] = po[i];
                y[u] = __ldcg(pc + i);
            }
        }
#pragma unroll
        for (int u = 0; u < U; ++u) {
            const int64_t i = base + int64_t(u) * threads;
            if (i < n_vec) pout[i] = add_packed<T>(x[u], y[u], half);
        }
    }
}

__device__ bool channel_open(const flags_of& mine) {
    __shared__ int open;
    if (threadIdx.x == 0) open = *reinterpret_cast<volatile uint64_t*>(mine.abort_word()) == 0;
    __syncthreads();
    return open != 0;
}

__global__ void __launch_bounds__(threads) all_gather_kernel(const all_gather_args a) {
    const channel_args& ch = a.ch;
    stream_state s = stream_state::of(ch, op_all_gather, a.sender_warps);
    if (!channel_open(s.mine)) return;
    const int64_t n = a.bytes_per_rank, C = a.chunk_bytes;
    const char* in = static_cast<const char*>(a.in);
    char* out = static_cast<char*>(a.out);
    auto unit_offset = [&](int64_t k) { return s.unit_offset(k, C); };

    auto send = [&](const team& t, int64_t k) {
        const int64_t off = unit_offset(k), len = min(C, n - off);
        char* dst[max_ranks];
        int n_dst = 0;
        if (s.my_turn(k)) dst[n_dst++] = out + s.me * n + off;  // this rank's own part, once per unit
        for (int i = 0; i < s.npeers; ++i) {
            const int p = s.to(i);
            dst[n_dst++] = cell(ch.buffers[p], ch.layout, s.b, s.slot(k), s.me, p);
        }
        copy_team<false>(t, dst, n_dst, in + off, len, a.elem_bytes);
    };
    auto recv = [&](const team& t, int64_t k, const inbox& box) {
        const int64_t off = unit_offset(k), len = min(C, n - off);
        for (int i = 0; i < box.n; ++i) {
            const int p = box.src(s, i);
            char* dst[1] = {out + p * n + off};
            copy_team<true>(t, dst, 1, cell(ch.buffers[s.me], ch.layout, box.block(s, i), s.slot(k), p, s.me), len,
                            a.elem_bytes);
        }
    };
    run_units(s, (n + C - 1) / C, false, send, recv);
}

// TwoRanks: the packed two-term path only; otherwise the fp32 accumulation over any number of ranks. Separate
// kernels, so that the general path's accumulators do not cost the two-rank kernel registers.
template <typename T, bool TwoRanks>
__global__ void __launch_bounds__(threads) reduce_scatter_kernel(const reduce_scatter_args a) {
    const channel_args& ch = a.ch;
    stream_state s = stream_state::of(ch, op_reduce_scatter, a.sender_warps);
    if (!channel_open(s.mine)) return;
    const int64_t n = a.elems_per_rank, C = a.chunk_elems;
    const T* in = static_cast<const T*>(a.in);
    T* out = static_cast<T*>(a.out);
    const float scale = a.average ? 1.0f / s.world : 1.0f;
    auto unit_offset = [&](int64_t k) { return s.unit_offset(k, C); };

    auto send = [&](const team& t, int64_t k) {
        const int64_t off = unit_offset(k), len = min(C, n - off);
        for (int i = 0; i < s.npeers; ++i) {
            const int p = s.to(i);
            char* dst[1] = {cell(ch.buffers[p], ch.layout, s.b, s.slot(k), s.me, p)};
            copy_team<false>(t, dst, 1, reinterpret_cast<const char*>(in + p * n + off), len * sizeof(T), sizeof(T));
        }
    };
    auto recv = [&](const team& t, int64_t k, const inbox&) {
        const int threads = t.size;
        const int64_t off = unit_offset(k), len = min(C, n - off);
        const T* own = in + s.me * n + off;
        T* o = out + off;
        // Rank r's part arrived in the cell of the lane's block paired with r's distance behind this rank (with
        // pairs, each such block has one cell per slot).
        const int slot = s.slot(k);
        const char* first = s.pairs() ? cell(ch.buffers[s.me], ch.layout, s.sibling(1), slot, s.me, s.me) : nullptr;
        auto source = [&](int r) -> const T* {
            if (r == s.me) return own;
            if (!s.pairs()) return reinterpret_cast<const T*>(cell(ch.buffers[s.me], ch.layout, s.b, slot, r, s.me));
            const int d = s.me > r ? s.me - r : s.me - r + s.world;  // the sibling(d) cells follow sibling(1)'s
            return reinterpret_cast<const T*>(first + int64_t(d - 1) * ch.layout.slots * ch.layout.cell_bytes);
        };
        // This rank's own part is never rewritten by a peer; the staged ones skip L1.
        auto load = [&](int r, const auto* q) { return r == s.me ? *q : __ldcg(q); };
        constexpr int V = vec16_elems<T>;
        int64_t done = 0;
        if constexpr (TwoRanks) {
          if (aligned16(own) && aligned16(o)) {
            // Two ranks: one correctly rounded packed add per element pair (what fp32 accumulation rounds to,
            // at a fraction of the instructions; the reduction is instruction-bound otherwise).
            const int64_t n_vec = len / V;
            add_pairs<T, 4>(t, own, source(1 - s.me), o, n_vec, a.average);
            done = n_vec * V;
          }
        } else if (aligned16(own) && aligned16(o)) {
            const int64_t n_vec = len / V;
            sum_rank_vectors<T, reduce_unroll>(o, n_vec, t.rank(), threads, s.world, scale, source, load);
            done = n_vec * V;
        }
        sum_rank_elements<T>(o, done, len, t.rank(), threads, s.world, scale, source, load);
    };
    run_units(s, (n + C - 1) / C, true, send, recv);
}

// Blocks for a message of `units` (grid > 0: at most that many): one per unit up to the layout's count; with
// pairs, whole lanes of world - 1 blocks.
int grid_for(int64_t units, int grid, const channel_layout& L) {
    const int64_t cap = grid > 0 ? std::min(grid, L.blocks) : L.blocks;
    const int per_lane = L.pairs ? L.peers() : 1;
    const int64_t lanes = std::max<int64_t>(1, std::min<int64_t>(units, cap / per_lane));
    return static_cast<int>(lanes * per_lane);
}

template <typename T>
void launch_rs(const reduce_scatter_args& args, int grid, cudaStream_t stream) {
    if (args.ch.layout.world == 2)
        reduce_scatter_kernel<T, true><<<grid, threads, 0, stream>>>(args);
    else
        reduce_scatter_kernel<T, false><<<grid, threads, 0, stream>>>(args);
}

cudaError_t check(const channel_args& ch) {
    const auto& L = ch.layout;
    if (L.world < 2 || L.world > max_ranks || ch.rank < 0 || ch.rank >= L.world || L.blocks < 1 || L.slots < 2 ||
        L.cell_bytes < 16 || L.cell_bytes % 16 || (L.pairs && (L.world < 3 || L.blocks < L.peers())))
        return cudaErrorInvalidValue;
    return cudaSuccess;
}

}  // namespace

cudaError_t launch_all_gather(const all_gather_args& args, int grid, cudaStream_t stream) {
    if (cudaError_t e = check(args.ch); e != cudaSuccess) return e;
    if (args.chunk_bytes < 16 || args.chunk_bytes % 16 || args.chunk_bytes > args.ch.layout.cell_bytes ||
        (args.elem_bytes != 2 && args.elem_bytes != 4) || args.bytes_per_rank % args.elem_bytes)
        return cudaErrorInvalidValue;
    if (args.sender_warps < 1 || args.sender_warps >= threads / 32) return cudaErrorInvalidValue;
    if (args.bytes_per_rank == 0) return cudaSuccess;
    const int64_t units = (args.bytes_per_rank + args.chunk_bytes - 1) / args.chunk_bytes;
    all_gather_kernel<<<grid_for(units, grid, args.ch.layout), threads, 0, stream>>>(args);
    return cudaGetLastError();
}

cudaError_t launch_reduce_scatter(const reduce_scatter_args& args, int grid, cudaStream_t stream) {
    if (cudaError_t e = check(args.ch); e != cudaSuccess) return e;
    const int elem = args.dtype == static_cast<int>(dtype::fp32) ? 4 : 2;
    if (args.chunk_elems < 1 || (args.chunk_elems * elem) % 16 || args.chunk_elems * elem > args.ch.layout.cell_bytes ||
        args.sender_warps < 1 || args.sender_warps >= threads / 32)
        return cudaErrorInvalidValue;
    if (args.elems_per_rank == 0) return cudaSuccess;
    const int64_t units = (args.elems_per_rank + args.chunk_elems - 1) / args.chunk_elems;
    const int g = grid_for(units, grid, args.ch.layout);
    switch (static_cast<dtype>(args.dtype)) {
        case dtype::bf16: launch_rs<__nv_bfloat16>(args, g, stream); break;
        case dtype::fp16: launch_rs<__half>(args, g, stream); break;
        case dtype::fp32: launch_rs<float>(args, g, stream); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

}  // namespace tk::collectives
