// Attention backward for Hopper: one block per 128 keys of one key/value head, walking every query tile (64 rows)
// of every query head of its group. A producer warp streams Q and dO tiles and their log-sum-exp and delta rows
// with TMA, another issues the dQ reduce-adds. Two consumer warpgroups each own 64 keys and keep
// dK and dV for them in registers for the whole walk, so both leave the block once, already summed over the group
// (grouped-query attention needs no atomics for them). Per query tile a consumer computes
//   S^T = K Q^T, P^T = exp(scale S^T - lse), dP^T = V dO^T, dS^T = P^T (dP^T - delta),
//   dV += P^T dO, dK += dS^T Q        (A operands from registers)
// and the block's dQ tile, dS K over its 128 keys, is staged in shared memory (two buffers) and added into an
// fp32 accumulator by the writer warp's TMA reduce-stores.
// The same shared-memory boxes of Q, dO and K serve as K-major and MN-major operands (wgmma::tile_at).
// Head dim 256 (consume_wide): dK and dV of 128 keys would need 256 registers a thread per warpgroup, so a block takes
// 64 keys and its two warpgroups split D instead: one computes S^T and P^T, the other dP^T and dS^T (P^T handed over
// in shared memory), and each adds its 128 columns of dV, dK and dQ with both operands from shared memory; dQ is
// staged (fp32) over the step's own Q and dO boxes once both are done with them, and the writer warp adds it into
// the accumulator by TMA reduce-adds and then releases the stage.
// Causal walks start at the block's diagonal; with a sliding window (args.window = W) they also end at the query tile
// of the block's last key + W - 1, and P is 0 where key <= query - W as well.
#include "backward.h"
#include "../../kittens/kittens.cuh"
#include "layout.cuh"

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <type_traits>

namespace tk::attention {
namespace {

using wgmma::major;

constexpr int BQ = 64;   // query rows per step
constexpr int BK = 128;  // keys per block, 64 per consumer warpgroup (D <= 128)
template <int D>
constexpr int BK_OF = D == 256 ? 64 : BK;  // keys per block at head dim D
constexpr int STAGES = 2;
constexpr int CONSUMERS = 2, THREADS = (CONSUMERS + 1) * warpgroup::threads;
constexpr int BOX = 64 * 64;  // elements of one 64 x 64 TMA box
constexpr float LOG2E = 1.4426950408889634f;
constexpr int PRODUCER_REGISTERS = 24, CONSUMER_REGISTERS = 240;
static_assert(warpgroup::register_split_fits(1, PRODUCER_REGISTERS, CONSUMERS, CONSUMER_REGISTERS));

// Consumer warpgroups that compute a share of dQ (DQ_COLS columns from DQ_COLS * slice): D = 128 both, D = 64 the
// first.
constexpr int DQ_COLS = 64;
// S^T's A (this warpgroup's K rows) from registers, loaded once: D = 64 (16 registers). At D = 128 (32) ptxas runs
// short beside dK, dV, S^T, dP^T and P^T and serialises every wgmma.
template <int D>
constexpr bool K_IN_REGISTERS = D == 64;
// Whether S^T, dP^T and dQ start with wgmma::mma_overwrite (their old values dead across the loop). D = 64 was
// measured so (with K in registers: 1.007-1.013x); at D = 128 the same change alone ran 0.98-1.00x (H100,
// 2026-11-25, benchmarks/NOTES.md), so it keeps the products that read their accumulator.
template <int D>
constexpr bool FRESH_ACCUMULATORS = D == 64;
template <int D>
constexpr int DQ_SLICES = D / DQ_COLS;

// Named barriers (0 is __syncthreads). Each consumer warpgroup's own and both consumers'; and dQ's hand-over between
// a consumer and the dQ writer warp, per slice and staging buffer: `staged` (the consumer arrives, the writer waits)
// and `free` (the writer arrives once its reduce-add has read the buffer; the consumer waits before restaging it).
namespace barrier_id {
__device__ __forceinline__ int warpgroup(int slice) { return 1 + slice; }
constexpr int consumers = 3;
// D = 256 (no dQ hand-over barriers there): role 0's S^T is done, so role 1 issues dP^T; role 0 has stored P^T.
constexpr int s_done = 4, pt_ready = 5;
// D = 256: both roles have staged a step's dQ for the writer warp (per stage, so that the roles' arrivals for the next
// step never count towards this one); the writer's last reduce-adds have read their staging.
__device__ __forceinline__ int dq_staged_wide(int stage) { return 6 + stage; }
constexpr int dq_written_wide = 8;
__device__ __forceinline__ int dq_staged(int slice, int buf) { return 4 + 2 * slice + buf; }
__device__ __forceinline__ int dq_free(int slice, int buf) { return 8 + 2 * slice + buf; }
}  // namespace barrier_id
constexpr int DQ_HANDOFF_THREADS = warpgroup::threads + 32;  // a consumer warpgroup and the writer warp

template <typename T, int D>
struct shared_state {
    alignas(1024) T k[2][D / 64][BOX];  // [key chunk][D panel]: chunk w belongs to consumer w
    alignas(1024) T v[2][D / 64][BOX];
    alignas(1024) T q[STAGES][D / 64][BOX];
    alignas(1024) T dout[STAGES][D / 64][BOX];
    alignas(1024) T ds[2][2][BOX];          // [step parity][key chunk]: dS^T as the MN-major A of dQ = dS K
    alignas(1024) float dq[2][DQ_SLICES<D>][BOX];  // [step parity][slice]: 64 x 64 fp32 of dQ, two 64 x 32 boxes
    // The tiles' log-sum-exp and delta rows (TMA: 0 past q_len, where Q and dO are 0 too, so P = 1 there but
    // dV, dS and dK get nothing from those rows).
    alignas(128) float lse[STAGES][BQ];
    alignas(128) float delta[STAGES][BQ];
    pipeline::ring<STAGES> ring;  // full: Q, dO bytes and the lse/delta rows; empty: every consumer warp is done
    sync::barrier kv_full;
    int last_part[2];  // per consumer: whether its part of a split unit counted in last (it sums and stores)
    static constexpr uint32_t kv_bytes = 2 * BK * D * sizeof(T), step_bytes = 2 * BQ * D * sizeof(T) + 2 * BQ * 4;
};

// Head dim 256: 64 keys; two Q/dO stages; P^T and dS^T (keys = lines, queries = elements) for the products both
// warpgroups take from shared memory. 208 KB.
template <typename T>
struct shared_state<T, 256> {
    alignas(1024) T k[1][4][BOX];  // [key chunk][D panel]
    alignas(1024) T v[1][4][BOX];
    alignas(1024) T q[STAGES][4][BOX];
    alignas(1024) T dout[STAGES][4][BOX];
    alignas(1024) T pt[BOX];
    alignas(1024) T dst[BOX];
    alignas(128) float lse[STAGES][BQ];
    alignas(128) float delta[STAGES][BQ];
    pipeline::ring<STAGES> ring;
    sync::barrier kv_full;
    static constexpr uint32_t kv_bytes = 2 * BK_OF<256> * 256 * sizeof(T),
                              step_bytes = 2 * BQ * 256 * sizeof(T) + 2 * BQ * 4;
};

struct kernel_params {
    backward_args args;
    int q_tiles, kv_tiles;
    int group;            // query heads per key/value head
    int heads_per_block;  // of them, the ones a block walks: group / group_split
    int chunk_heads;      // causal: (key/value head, split) pairs per L2 chunk of the block order (layout::chunked_order)
    int split_from, parts;  // the last wave split: args.split_from and args.split_parts
    float scale_log2;
    int64_t zero_share;  // float4s of args.zero_next a block zeroes (the host divides: no 64-bit division here)
};

struct block_work {
    int kv_tile, kv_head, batch;
    int first_q_tile, end_q_tile;  // the query tiles [first, end) that see its keys (causal, window), of every head
    int first_head;  // the first query head the block walks
    int out_head;    // the head of dk and dv it writes: kv_head * group_split + its split
    // Its steps [step0, step1) of the unit's walk (heads_per_block x its query tiles); a split unit's part, or -1.
    int step0, step1, split_unit, part;
    // Its dQ rows' counter in args.dq_done: (batch, key/value head, split), the order of dq_accum's row groups.
    __device__ __forceinline__ int64_t dq_counter(const backward_args& a) const {
        return int64_t(batch) * a.kv_heads * a.group_split + out_head;
    }
};

// The query tiles [first, end) that see the keys of key tile kv_tile (KEYS a tile): causal walks start at the tile of
// its first key; a sliding window (WINDOW, of `window` keys) ends them at the tile of its last key + window - 1.
// work_of and the host's count of a head's steps (backward_dq_steps) share it.
struct query_tiles {
    int first, end;
};
template <int KEYS, bool WINDOW>
__host__ __device__ __forceinline__ query_tiles query_tiles_of(int kv_tile, int q_tiles, bool causal, int window) {
    return {causal ? (kv_tile * KEYS) / BQ : 0,
            WINDOW ? int(std::min<int64_t>(q_tiles, (int64_t(kv_tile) * KEYS + KEYS - 2 + window) / BQ + 1)) : q_tiles};
}

// Causal: key tile 0 sees every query tile, so within each L2 chunk of heads the low key tiles (the heaviest)
// start first; the blocks of a chunk share its heads' Q, dO and dQ in L2.
template <int KEYS, bool WINDOW>
__device__ __forceinline__ block_work work_of(const kernel_params& p) {
    const backward_args& a = p.args;
    // A "head" here is a (batch, key/value head, split of its group): the splits of one key/value head are adjacent.
    const int64_t heads = a.batch * a.kv_heads * a.group_split;
    int64_t linear = blockIdx.x;
    int split_unit = -1, part = -1;
    if (p.parts > 0 && linear >= p.split_from) {  // blocks from split_from on: parts of the units from there
        split_unit = int((linear - p.split_from) / p.parts);
        part = int((linear - p.split_from) % p.parts);
        linear = p.split_from + split_unit;
    }
    int kv_tile;
    int64_t bh;
    if (a.causal) {
        const layout::chunked_tile t = layout::chunked_order(int(linear), int(heads), p.kv_tiles, p.chunk_heads);
        bh = t.head;
        kv_tile = t.rank;
    } else {
        kv_tile = int(linear % p.kv_tiles);
        bh = linear / p.kv_tiles;
    }
    // Causal: query tiles that end before the block's first key see none of its keys. Sliding window: nor do those
    // that start past its last key + window - 1 (the last query that keeps that key; 64 bits, then clipped).
    const auto [first, end] = query_tiles_of<KEYS, WINDOW>(kv_tile, p.q_tiles, a.causal, a.window);
    const int split = int(bh % a.group_split), kv_head = int(bh / a.group_split % a.kv_heads);
    const int steps = p.heads_per_block * (end - first);
    return {kv_tile,
            kv_head,
            int(bh / a.group_split / a.kv_heads),
            first,
            end,
            kv_head * p.group + split * p.heads_per_block,
            kv_head * int(a.group_split) + split,
            part < 0 ? 0 : int(int64_t(steps) * part / p.parts),
            part < 0 ? steps : int(int64_t(steps) * (part + 1) / p.parts),
            split_unit,
            part};
}

// The end of a block's query tiles: without a window every tile up to q_tiles (read from the parameters, as the
// kernels without a window always did, so that their code is unchanged).
template <bool WINDOW>
__device__ __forceinline__ int end_q_tile_of(const kernel_params& p, const block_work& w) {
    return WINDOW ? w.end_q_tile : p.q_tiles;
}

// A step of a block's walk: its query head and tile. The walk goes over the block's query tiles [first_q_tile,
// end_q_tile) of one head, then of the next.
struct walk_position {
    int head, q_tile;
    template <bool WINDOW>
    __device__ __forceinline__ void next(const kernel_params& p, const block_work& w) {
        if (++q_tile == end_q_tile_of<WINDOW>(p, w)) {
            q_tile = w.first_q_tile;
            ++head;
        }
    }
};
// Where a block's walk starts: the query head and tile of its step0.
template <bool WINDOW>
__device__ __forceinline__ walk_position start_of(const kernel_params& p, const block_work& w) {
    const int per_head = end_q_tile_of<WINDOW>(p, w) - w.first_q_tile;
    return {w.first_head + w.step0 / per_head, w.first_q_tile + w.step0 % per_head};
}

template <typename T, int D, bool WINDOW>
__device__ __forceinline__ void produce_tiles(shared_state<T, D>& st, const kernel_params& p, const block_work& w,
                                              const CUtensorMap& map_q, const CUtensorMap& map_k,
                                              const CUtensorMap& map_v, const CUtensorMap& map_do,
                                              const CUtensorMap& map_lse, const CUtensorMap& map_delta) {
    tma::prefetch_map(&map_q);
    tma::prefetch_map(&map_do);
    tma::prefetch_map(&map_lse);
    tma::prefetch_map(&map_delta);
    const int kv0 = w.kv_tile * BK_OF<D>;
    sync::arrive_expect_bytes(st.kv_full, shared_state<T, D>::kv_bytes);
    for (int c = 0; c < BK_OF<D> / 64; ++c)
        for (int dp = 0; dp < D / 64; ++dp) {
            tma::load_4d(st.k[c][dp], &map_k, dp * 64, kv0 + 64 * c, w.kv_head, w.batch, st.kv_full);
            tma::load_4d(st.v[c][dp], &map_v, dp * 64, kv0 + 64 * c, w.kv_head, w.batch, st.kv_full);
        }
    pipeline::cursor<STAGES> at;
    walk_position walk = start_of<WINDOW>(p, w);
    auto& [head, i] = walk;
    for (int step = w.step0; step < w.step1; ++step) {
        st.ring.wait_empty(at);
        sync::barrier& full = st.ring.full[at.stage];
        sync::arrive_expect_bytes(full, shared_state<T, D>::step_bytes);
        for (int dp = 0; dp < D / 64; ++dp) {
            tma::load_4d(st.q[at.stage][dp], &map_q, dp * 64, i * BQ, head, w.batch, full);
            tma::load_4d(st.dout[at.stage][dp], &map_do, dp * 64, i * BQ, head, w.batch, full);
        }
        tma::load_4d(st.lse[at.stage], &map_lse, i * BQ, head, w.batch, 0, full);
        tma::load_4d(st.delta[at.stage], &map_delta, i * BQ, head, w.batch, 0, full);
        at.advance();
        walk.template next<WINDOW>(p, w);
    }
}

// With args.dq_done: once the block's dQ reduce-adds are complete in global memory (not only read from the
// staging), its steps are added to its rows' counter, releasing them to a finalize pass that rounds each row group as
// soon as all its steps are in (attention_dq_finalize with counters), while the kernel's last blocks still run.
__device__ __forceinline__ void count_dq_written(const kernel_params& p, const block_work& w) {
    tma::store_wait();
    tma::fence_async_to_global();
    sync::count_release(p.args.dq_done + w.dq_counter(p.args), static_cast<unsigned long long>(w.step1 - w.step0));
}

// The next launch's dQ accumulator (args.zero_next): the block's share of its float4s (zero_share) is zeroed by the
// dQ writer warp, ZERO_STEP of them (4 KB) a step from `from` (a step index) up to `to` (exclusive; INT_MAX: the
// rest), between its reduce-adds: spread over the walk, the stores use the multiprocessor's spare bandwidth to L2
// (the same 64 KB at the block's start delayed its first loads: the kernel lost 1%). Streaming stores: nothing
// reads the lines before the next launch. Computed from the parameters each time: the warp has no register to keep.
constexpr int ZERO_STEP = 256;
__device__ __forceinline__ void zero_next_steps(const kernel_params& p, int from, int to) {
    const int64_t begin = p.zero_share * blockIdx.x;
    // The block's share in 32-bit offsets (backward_unsupported keeps zero_share below 2^31 - ZERO_STEP); steps
    // past it are compared before they are multiplied, so that a long walk's step index cannot overflow.
    const int share = int(std::max<int64_t>(0, std::min(p.zero_share, p.args.zero_next_count / 4 - begin)));
    const int share_steps = (share + ZERO_STEP - 1) / ZERO_STEP;
    if (from >= share_steps) return;
    const int last = to >= share_steps ? share : to * ZERO_STEP;
    float4* const out = reinterpret_cast<float4*>(p.args.zero_next) + begin;
#pragma unroll 1
    for (int i = from * ZERO_STEP + threadIdx.x % 32; i < last; i += 32) __stcs(out + i, make_float4(0.f, 0.f, 0.f, 0.f));
}

// One producer warp issues every dQ reduce-add, so a consumer only stores its share, fences and arrives. Per step
// and slice it waits for the staged buffer and adds its two 64 x 32 boxes into dq_accum; once they have been read,
// the buffer goes back to its consumer for the step after next.
template <typename T, int D, bool WINDOW>
__device__ __forceinline__ void write_dq(shared_state<T, D>& st, const kernel_params& p, const block_work& w,
                                         const CUtensorMap& map_dq) {
    const bool issuer = (threadIdx.x & 31) == 0;
    if (issuer) tma::prefetch_map(&map_dq);
    const int steps = w.step1 - w.step0;
    walk_position walk = start_of<WINDOW>(p, w);
    auto& [head, i] = walk;
#pragma unroll 1  // unrolled, its copies spill at the producers' 24 registers
    for (int step = 0; step < steps; ++step) {
        const int buf = step & 1;
        if (p.args.zero_next != nullptr) zero_next_steps(p, step, step + 1);  // while the consumers stage dQ
        for (int slice = 0; slice < DQ_SLICES<D>; ++slice) {
            sync::named_sync(barrier_id::dq_staged(slice, buf), DQ_HANDOFF_THREADS);
            if (issuer) {
                const uint8_t* staging = reinterpret_cast<const uint8_t*>(st.dq[buf][slice]);
                for (int box = 0; box < DQ_COLS / 32; ++box)
                    tma::store_add_4d(&map_dq, staging + box * 64 * 128, DQ_COLS * slice + 32 * box, i * BQ, head,
                                      w.batch);
                tma::store_commit();
            }
        }
        if (step + 2 < steps) {  // a consumer waits for this buffer two steps on
            if (issuer) tma::store_wait_read();
            __syncwarp();
            for (int slice = 0; slice < DQ_SLICES<D>; ++slice)
                sync::named_arrive(barrier_id::dq_free(slice, buf), DQ_HANDOFF_THREADS);
        }
        walk.template next<WINDOW>(p, w);
    }
    if (p.args.zero_next != nullptr) zero_next_steps(p, steps, INT_MAX);  // a short walk's rest
    if (issuer) {
        if (p.args.dq_done == nullptr) {
            tma::store_wait_read();  // the staging outlives the last reads
        } else {
            count_dq_written(p, w);
        }
    }
}

// Where this thread's pairs of a warpgroup's fp32 accumulator go in 64 x 32 boxes with the 128-byte swizzle (what the
// dQ reduce-adds read): 8-column group j sits in box j / 4 at 16-byte chunk 2 (j % 4) + (lane % 4) / 2 of its
// 128-byte row, XOR-ed with the row within 8 (the same for the bottom row, 8 further, 1024 bytes on). So four chunk
// offsets and constants, not an address per pair.
struct fp32_box_chunks {
    uint32_t at[4];
    __device__ __forceinline__ fp32_box_chunks() {
        const int lane = threadIdx.x & 31, top = rt::top_row();
#pragma unroll
        for (int c = 0; c < 4; ++c) at[c] = top * 128 + (lane & 1) * 8 + (((2 * c + ((lane & 3) >> 1)) ^ (top & 7)) << 4);
    }
    // Columns [0, COLS) of the accumulator d into staging (COLS / 32 boxes of 8 KB).
    template <int COLS>
    __device__ __forceinline__ void store(uint8_t* staging, const float (&d)[COLS / 2]) const {
#pragma unroll
        for (int e = 0; e < COLS / 2; e += 2) {
            const int j = e / 4;
            *reinterpret_cast<float2*>(staging + (j / 4) * 64 * 128 + (rt::is_bottom(e) ? 1024 : 0) + at[j % 4]) =
                make_float2(d[e], d[e + 1]);
        }
    }
};

// P^T = exp2(c S^T - lse[query] log2(e)) in place, over a thread's share of a 64 keys x 64 queries fragment (the
// queries in column pairs). `masked`: 0 where the key is past the query (causal: key - query, as
// row + `ahead` against rt::column_offset, in 32 bits; `ahead` INT_MIN where the step is clear of the diagonal)
// and for this thread's key rows at or past `keys_left` (keys past kv_len, which TMA filled with zeros: their
// exp(-lse) can overflow dS). `windowed` (sliding window; with `masked`): 0 too where the key is at or below
// query - window, i.e. rt::column_offset >= row + `behind` (key - query + window at the thread's first column).
// Masked entries are set to 0 whatever their exponent was (even inf: a dropped key can score far above the row's
// lse), so dS is exactly 0 there. Both consumers take it; constant flags drop the masks' instructions.
__device__ __forceinline__ void exponentiate_scores(float (&d)[32], const float* lse, float c, bool masked, int ahead,
                                                    int keys_left, bool windowed = false, int behind = 0) {
#pragma unroll
    for (int e = 0; e < 32; e += 2) {
        const float2 l = *reinterpret_cast<const float2*>(&lse[rt::column(e)]);
        float x0 = exp2_approx(fmaf(d[e], c, -l.x * LOG2E)), x1 = exp2_approx(fmaf(d[e + 1], c, -l.y * LOG2E));
        if (masked) {
            const int row = rt::is_bottom(e) ? 8 : 0, row_ahead = ahead + row;
            if (row_ahead > rt::column_offset(e) || row >= keys_left) x0 = 0.0f;
            if (row_ahead > rt::column_offset(e + 1) || row >= keys_left) x1 = 0.0f;
            if (windowed) {
                const int row_behind = behind + row;
                if (rt::column_offset(e) >= row_behind) x0 = 0.0f;
                if (rt::column_offset(e + 1) >= row_behind) x1 = 0.0f;
            }
        }
        d[e] = x0;
        d[e + 1] = x1;
    }
}

// COMPUTES_DQ: whether this warpgroup issues a dQ product. A template parameter, not a branch on the warpgroup
// index: ptxas serialises every wgmma of a kernel that issues one in a warpgroup-divergent branch (C7520).
template <typename T, int D, bool COMPUTES_DQ, bool WINDOW>
__device__ __forceinline__ void consume(shared_state<T, D>& st, const kernel_params& p, const block_work& w,
                                        const CUtensorMap& map_dk, const CUtensorMap& map_dv) {
    using k_major64 = wgmma::operand_tile<T, 64, major::k>;  // 64 rows x 64 deep
    using mn_major_d = wgmma::operand_tile<T, D, major::mn>;  // D rows (N) x 64 deep, from D/64 boxes
    using mn_major64 = wgmma::operand_tile<T, 64, major::mn>;
    const backward_args& a = p.args;
    const int slice = warpgroup::uniform_index() - 1;  // keys [64 slice, 64 slice + 64) of the block
    const int64_t key0 = int64_t(w.kv_tile) * BK + 64 * slice;
    const bool leader = warpgroup::thread() == 0;
    const float c = p.scale_log2;
    const int top = rt::top_row();
    // dQ columns this warpgroup computes (DQ_SLICES): D = 128 splits them, D = 64 leaves them to warpgroup 0.
    constexpr bool computes_dq = COMPUTES_DQ;
    const int dq_col0 = DQ_COLS * slice;

    rt::acc_tile<D> dv, dk;
    rt::fill(dv, 0.0f);
    rt::fill(dk, 0.0f);
    rt::acc_tile<64> s, dp;
    rt::acc_tile<DQ_COLS> dq;
    rt::a_operand<T, 64> pt, dst;
    rt::a_operand<T, K_IN_REGISTERS<D> ? D : 16> k_rows;  // this warpgroup's 64 keys, for the whole walk
    pipeline::cursor<STAGES> at;
    int step = 0;

    // acc = A B^T over D for this warpgroup's 64 keys (A: its K or V rows) and the step's 64 queries (B: Q or dO
    // rows as K-major boxes), committed as one wgmma group. A is K-major boxes, or K as a register fragment (k_rows).
    auto keys_times = [&](rt::acc_tile<64>& acc, const auto& a, const T (&b)[D / 64][BOX]) {
        constexpr bool a_in_registers = std::is_same_v<std::decay_t<decltype(a)>, rt::a_operand<T, D>>;
        wgmma::fence();
#pragma unroll
        for (int d = 0; d < D / 64; ++d)
#pragma unroll
            for (int k16 = 0; k16 < 4; ++k16) {
                const auto& b_tile = wgmma::tile_at<k_major64>(b[d]);
                const bool first = (d | k16) == 0;
                if constexpr (a_in_registers) {
                    if (FRESH_ACCUMULATORS<D> && first)
                        wgmma::mma_overwrite<64, T>(acc.d, a, 0, b_tile, 0, 0);
                    else
                        wgmma::mma<64, T>(acc.d, a, 4 * d + k16, b_tile, 0, k16, !first);
                } else {
                    const auto& a_tile = wgmma::tile_at<k_major64>(a[d]);
                    if (FRESH_ACCUMULATORS<D> && first)
                        wgmma::mma_overwrite<64, T>(acc.d, a_tile, 0, b_tile, 0, 0);
                    else
                        wgmma::mma<64, T>(acc.d, a_tile, 0, b_tile, 0, k16, !first);
                }
            }
        wgmma::commit();
    };

    // A step's dQ tile, once its product is done, is stored (fp32, two 64 x 32 boxes with the 128-byte swizzle)
    // into the staging buffer the writer warp freed. The fence and hand-over wait for the next step's S^T product to
    // be issued (publish_dq).
    auto stage_dq = [&] {
        if constexpr (!computes_dq) return;
        wgmma::pin(dq.d);
        const int buf = step & 1;
        if (step >= 2) sync::named_sync(barrier_id::dq_free(slice, buf), DQ_HANDOFF_THREADS);
        fp32_box_chunks().store<DQ_COLS>(reinterpret_cast<uint8_t*>(st.dq[buf][slice]), dq.d);
    };
    // The end of a step, once its products are done: its stage goes back to the producers.
    auto finish_step = [&](int stage) {
        // Every lane read the stage's lse/delta rows; __syncwarp orders those reads before lane 0's arrive (release,
        // cumulative), and TMA alone rewrites the stage: one arrive per warp, not per thread (+1.3% on the
        // backward, H100; benchmarks/NOTES.md).
        __syncwarp();
        if ((threadIdx.x & 31) == 0) sync::arrive(st.ring.empty[stage]);
    };
    // Hands the dQ tile staged by the step before to the writer warp.
    auto publish_dq = [&] {
        if constexpr (!computes_dq) return;
        if (step == 0) return;
        tma::fence_shared_to_async();
        sync::named_arrive(barrier_id::dq_staged(slice, (step - 1) & 1), DQ_HANDOFF_THREADS);
    };

    // Keys past kv_len (the last block's rows that TMA filled with zeros) score 0, so their P would be exp(-lse): large
    // where a row's lse is very negative (few keys, negative scores), and dS = -P delta then overflows 16 bits (fp16
    // from lse of about -6 at large delta), which times K's zero rows is NaN in dQ. Their P is 0 instead: this
    // thread's rows top + r with r >= keys_left are such keys (r is 0 or 8).
    const int keys_left = int(std::min<int64_t>(a.kv_len - key0 - top, 64));
    const bool key_tail = key0 + 64 > a.kv_len;
    sync::wait(st.kv_full, 0);
    if constexpr (K_IN_REGISTERS<D>)
        rt::load_swizzled(k_rows, 0, [&](int col) { return reinterpret_cast<const uint8_t*>(st.k[slice][col / 64]); });
    walk_position walk = start_of<WINDOW>(p, w);  // (its head goes unread here)
    int& i = walk.q_tile;
    for (const int steps = w.step1 - w.step0; step < steps; ++step) {
        const int64_t q0 = int64_t(i) * BQ;
        st.ring.wait_full(at);
        const int stage = at.stage;
        // S^T = K Q^T and dP^T = V dO^T (64 keys x 64 queries each), one wgmma group each.
        if constexpr (K_IN_REGISTERS<D>)
            keys_times(s, k_rows, st.q[stage]);
        else
            keys_times(s, st.k[slice], st.q[stage]);
        publish_dq();
        keys_times(dp, st.v[slice], st.dout[stage]);
        wgmma::wait<1>();
        wgmma::pin(s.d);
        // P^T = exp2(c S^T - lse[query] log2(e)); causal: 0 where key > query. Rows come in column pairs.
        // key > query as (key - q0 - this thread's first column) > rt::column_offset(e), in 32 bits (both
        // positions < 2^31). Only steps that cross the diagonal take the masked copy: the branch is
        // warp-uniform (slice is), so the descriptors stay in uniform registers, and a step clear of the
        // diagonal (every step without causal) skips the mask's 48 instructions (D = 128: 603 -> 556 per step).
        // The last key block's rows past kv_len take the masked copy too (see keys_left).
        const int col0 = rt::column(0);
        const int ahead = a.causal && key0 + 63 > q0 ? int(key0 - q0) + top - col0 : INT_MIN;
        // Sliding window: steps where some query drops some of this warpgroup's keys (key <= query - window) take
        // a copy with that mask too; key0 - q0 + window is in [-128, 63] there, so 32 bits.
        if (WINDOW && key0 + a.window <= q0 + 63)
            exponentiate_scores(s.d, st.lse[stage], c, true, ahead, keys_left, true,
                                int(key0 - q0) + a.window + top - col0);
        else if (ahead != INT_MIN || key_tail)
            exponentiate_scores(s.d, st.lse[stage], c, true, ahead, keys_left);
        else
            exponentiate_scores(s.d, st.lse[stage], c, false, ahead, keys_left);
        rt::to_a_operand(pt, s);
        // dV += P^T dO: dO's boxes as the MN-major B (D rows, 64 queries deep).
        wgmma::fence();
#pragma unroll
        for (int k16 = 0; k16 < 4; ++k16)
            wgmma::mma<D, T>(dv.d, pt, k16, wgmma::tile_at<mn_major_d>(st.dout[stage][0]), 0, k16, 1);
        wgmma::commit();
        wgmma::wait<1>();  // dP^T is done (dV may run on)
        wgmma::pin(dp.d);
        // dS^T = P^T (dP^T - delta[query]).
#pragma unroll
        for (int e = 0; e < 32; e += 2) {
            const float2 dl = *reinterpret_cast<const float2*>(&st.delta[stage][rt::column(e)]);
            dp.d[e] = s.d[e] * (dp.d[e] - dl.x);
            dp.d[e + 1] = s.d[e + 1] * (dp.d[e + 1] - dl.y);
        }
        rt::to_a_operand(dst, dp);
        // dS^T into shared memory (keys = lines, queries = elements): the A of dQ = dS K, MN-major.
        T* ds = st.ds[step & 1][slice];
        rt::store_swizzled(dst, 0, [&](int) { return reinterpret_cast<uint8_t*>(ds); });
        tma::fence_shared_to_async();
        sync::named_sync(barrier_id::consumers, CONSUMERS * warpgroup::threads);  // both halves of dS are in
        // dQ before dK, so that dQ's stores run under dK's product (D = 64: 3.23 -> 3.16 ms, B = 4, S = 4096;
        // D = 128 even).
        wgmma::fence();
        if constexpr (computes_dq) {
            // dQ (64 queries x DQ_COLS) = dS (64 x 128 keys) K (128 keys x D)[:, dq_col0 ...].
#pragma unroll
            for (int chunk = 0; chunk < 2; ++chunk)
#pragma unroll
                for (int k16 = 0; k16 < 4; ++k16) {
                    const auto& ds_tile = wgmma::tile_at<mn_major64>(st.ds[step & 1][chunk]);
                    const auto& k_tile = wgmma::tile_at<mn_major_d>(st.k[chunk][0]);
                    if (FRESH_ACCUMULATORS<D> && (chunk | k16) == 0)
                        wgmma::mma_overwrite<DQ_COLS, T>(dq.d, ds_tile, 0, k_tile, dq_col0, 0);
                    else
                        wgmma::mma<DQ_COLS, T>(dq.d, ds_tile, 0, k_tile, dq_col0, k16, (chunk | k16) != 0);
                }
            wgmma::commit();
        }
        // dK += dS^T Q.
#pragma unroll
        for (int k16 = 0; k16 < 4; ++k16)
            wgmma::mma<D, T>(dk.d, dst, k16, wgmma::tile_at<mn_major_d>(st.q[stage][0]), 0, k16, 1);
        wgmma::commit();
        wgmma::wait<1>();  // dQ is done (dK may run on)
        stage_dq();
        // Nothing stays in flight across steps: with accumulators of this step's products still in flight
        // while the next step's are issued, ptxas runs short of registers at D = 128 (C7512) or cannot
        // follow the waits (C7514) and then makes every wgmma of the kernel synchronous, which costs far
        // more than this wait (scripts/check_kernels.py checks it).
        wgmma::wait<0>();
        wgmma::pin(dv.d);
        wgmma::pin(dk.d);
        finish_step(stage);
        at.advance();
        walk.template next<WINDOW>(p, w);
    }

    publish_dq();
    // dK (times scale) and dV -> the input dtype, staged in this consumer's Q / dO stage, stored by TMA.
    sync::named_sync(barrier_id::consumers, CONSUMERS * warpgroup::threads);  // neither consumer reads a stage any more
    if (w.part >= 0) {
        // A part of a split unit: its fp32 dK, dV to the scratch ([value][thread], coalesced), counted in; the last
        // part in sums every part's, in part order (the same sum whichever part is last), and stores as a whole
        // unit does. The others are done.
        const int t = warpgroup::thread();
        auto part_values = [&](int part) {
            return a.split_scratch + ((int64_t(w.split_unit) * p.parts + part) * 2 + slice) * (int64_t(128) * D);
        };
        float* mine = part_values(w.part);
#pragma unroll
        for (int e = 0; e < D / 2; ++e) {
            mine[e * 128 + t] = dk.d[e];
            mine[(D / 2 + e) * 128 + t] = dv.d[e];
        }
        __threadfence();  // the values before the count (with the barrier: every thread's before the leader's add)
        sync::named_sync(barrier_id::warpgroup(slice), warpgroup::threads);
        if (leader) {
            int* count = a.split_counts + 2 * w.split_unit + slice;
            const bool last = atomicAdd(count, 1) == p.parts - 1;
            if (last) *count = 0;  // left zero for the next launch that takes this slot
            st.last_part[slice] = last;
        }
        sync::named_sync(barrier_id::warpgroup(slice), warpgroup::threads);
        if (!st.last_part[slice]) return;
        __threadfence();
#pragma unroll
        for (int e = 0; e < D / 2; ++e) {
            dk.d[e] = __ldcg(part_values(0) + e * 128 + t);
            dv.d[e] = __ldcg(part_values(0) + (D / 2 + e) * 128 + t);
        }
        for (int part = 1; part < p.parts; ++part) {
#pragma unroll
            for (int e = 0; e < D / 2; ++e) {
                dk.d[e] += __ldcg(part_values(part) + e * 128 + t);
                dv.d[e] += __ldcg(part_values(part) + (D / 2 + e) * 128 + t);
            }
        }
    }
    const float scale = a.scale;
    rt::mul(dk, dk, scale);
#pragma unroll
    for (int e = 0; e < D / 2; e += 2) {
        const auto pos = wgmma::accumulator_position(e);
        const uint32_t offset = tma::swizzled_offset_128b(pos.row, pos.col % 64);
        *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(st.q[slice][pos.col / 64]) + offset) =
            rt::pack2<T>(dk.d[e], dk.d[e + 1]);
        *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(st.dout[slice][pos.col / 64]) + offset) =
            rt::pack2<T>(dv.d[e], dv.d[e + 1]);
    }
    tma::fence_shared_to_async();
    sync::named_sync(barrier_id::warpgroup(slice), warpgroup::threads);
    if (leader) {
        if (key0 < a.kv_len) {
            for (int d = 0; d < D / 64; ++d) {
                tma::store_4d(&map_dk, st.q[slice][d], d * 64, int32_t(key0), w.out_head, w.batch);
                tma::store_4d(&map_dv, st.dout[slice][d], d * 64, int32_t(key0), w.out_head, w.batch);
            }
        }
        tma::store_commit();
        // The staging must outlive the stores' reads, not their writes: the block leaves (and the next one takes
        // its multiprocessor) while the writes drain, which they do before the grid completes.
        tma::store_wait_read();
    }
}

// Head dim 256: the writer warp adds each step's dQ, staged by both roles over the stage's Q (columns 0-127) and dO
// (128-255) boxes, into the fp32 accumulator, and hands the stage back to the producer once the reduce-adds have read
// it; so neither role waits for them. After the last step it tells the roles their staging has been read.
constexpr int DQ_WIDE_THREADS = CONSUMERS * warpgroup::threads + 32;
template <typename T, bool WINDOW>
__device__ __forceinline__ void write_dq_wide(shared_state<T, 256>& st, const kernel_params& p, const block_work& w,
                                              const CUtensorMap& map_dq) {
    const bool issuer = (threadIdx.x & 31) == 0;
    if (issuer) tma::prefetch_map(&map_dq);
    pipeline::cursor<STAGES> at;
    walk_position walk = start_of<WINDOW>(p, w);
    auto& [head, i] = walk;
#pragma unroll 1
    for (int step = w.step0; step < w.step1; ++step) {
        if (p.args.zero_next != nullptr) zero_next_steps(p, step - w.step0, step - w.step0 + 1);
        sync::named_sync(barrier_id::dq_staged_wide(at.stage), DQ_WIDE_THREADS);
        if (issuer) {
            for (int half = 0; half < 2; ++half) {
                const uint8_t* staging = reinterpret_cast<const uint8_t*>(half == 0 ? st.q[at.stage][0] : st.dout[at.stage][0]);
                for (int box = 0; box < 4; ++box)
                    tma::store_add_4d(&map_dq, staging + box * 64 * 128, 128 * half + 32 * box, i * BQ, head, w.batch);
            }
            tma::store_commit();
            tma::store_wait_read();
            sync::arrive(st.ring.empty[at.stage]);
        }
        __syncwarp();
        at.advance();
        walk.template next<WINDOW>(p, w);
    }
    if (p.args.zero_next != nullptr) zero_next_steps(p, w.step1 - w.step0, INT_MAX);  // a short walk's rest
    sync::named_sync(barrier_id::dq_written_wide, DQ_WIDE_THREADS);  // (waits only for the roles to get there)
    if (issuer && p.args.dq_done != nullptr) count_dq_written(p, w);
}

// Head dim 256, warpgroup ROLE (0 or 1) of a block of 64 keys: columns [128 ROLE, 128 ROLE + 128) of dK, dV and dQ.
// Per query tile, role 0 computes S^T = K Q^T and P^T into shared memory; role 1 computes dP^T = V dO^T once S^T is
// done (so that role 0's exponents run under it), takes P^T and stores dS^T = P^T (dP^T - delta). Each role adds
// dV += P^T dO as soon as P^T is in (role 1's under its dS^T arithmetic), then dK += dS^T Q and forms dQ = dS K over
// its columns, all operands from shared memory. Once both roles' products are done, role 0 stages its
// dQ columns (fp32, 32 KB) over the stage's Q boxes and role 1 over its dO boxes, and the writer warp adds them into
// the accumulator (write_dq_wide). Bulk reduce-adds, not `red.global.add.v2` from registers: those measured 246-279
// TFLOP/s (H100, S >= 2048), 8192 single-address atomics a step and block.
// A template parameter, not a branch on the warpgroup index (see consume).
template <typename T, int ROLE, bool WINDOW>
__device__ __forceinline__ void consume_wide(shared_state<T, 256>& st, const kernel_params& p, const block_work& w,
                                             const CUtensorMap& map_dk, const CUtensorMap& map_dv) {
    constexpr int HALF = 128, KEYS = BK_OF<256>;
    constexpr int threads = CONSUMERS * warpgroup::threads;
    using k_major64 = wgmma::operand_tile<T, 64, major::k>;
    using mn_major64 = wgmma::operand_tile<T, 64, major::mn>;
    using mn_major_half = wgmma::operand_tile<T, HALF, major::mn>;  // 128 of D (N) x 64 deep, two boxes
    const backward_args& a = p.args;
    const int64_t key0 = int64_t(w.kv_tile) * KEYS;
    const float c = p.scale_log2;
    const int top = rt::top_row();

    rt::acc_tile<HALF> dv, dk, dq;
    rt::fill(dv, 0.0f);
    rt::fill(dk, 0.0f);
    rt::acc_tile<64> x;  // S^T (role 0) or dP^T (role 1): 64 keys x 64 queries
    rt::a_operand<T, 64> frag;
    pipeline::cursor<STAGES> at;
    const uint8_t* pt_bytes = reinterpret_cast<const uint8_t*>(st.pt);
    const uint8_t* dst_bytes = reinterpret_cast<const uint8_t*>(st.dst);
    const fp32_box_chunks dq_chunks;  // where this thread's dQ pairs are staged
    // Keys past kv_len get P = 0 (see consume): this thread's rows top + r with r >= keys_left.
    const int keys_left = int(std::min<int64_t>(a.kv_len - key0 - top, 64));
    const bool key_tail = key0 + KEYS > a.kv_len;

    sync::wait(st.kv_full, 0);
    walk_position walk = start_of<WINDOW>(p, w);  // (its head goes unread here: the writer warp adds dQ)
    int& i = walk.q_tile;
    for (int step = w.step0; step < w.step1; ++step) {
        const int64_t q0 = int64_t(i) * BQ;
        st.ring.wait_full(at);
        const int stage = at.stage;
        {
            const auto& rows = ROLE == 0 ? st.k[0] : st.v[0];
            const auto& cols = ROLE == 0 ? st.q[stage] : st.dout[stage];
            if constexpr (ROLE == 1) sync::named_sync(barrier_id::s_done, threads);
            wgmma::fence();
#pragma unroll
            for (int d = 0; d < 4; ++d)
#pragma unroll
                for (int k16 = 0; k16 < 4; ++k16) {
                    const auto& a_tile = wgmma::tile_at<k_major64>(rows[d]);
                    const auto& b_tile = wgmma::tile_at<k_major64>(cols[d]);
                    if ((d | k16) == 0)
                        wgmma::mma_overwrite<64, T>(x.d, a_tile, 0, b_tile, 0, 0);
                    else
                        wgmma::mma<64, T>(x.d, a_tile, 0, b_tile, 0, k16, 1);
                }
            wgmma::commit();
            wgmma::wait<0>();
            wgmma::pin(x.d);
            if constexpr (ROLE == 0) sync::named_arrive(barrier_id::s_done, threads);
        }
        // acc[:, half] += A B[:, half]: A keys x queries (P^T or dS^T, K-major), B this role's columns of dO or Q.
        auto accumulate = [&](rt::acc_tile<HALF>& acc, const T(&a)[BOX], const T(&b)[4][BOX]) {
#pragma unroll
            for (int k16 = 0; k16 < 4; ++k16)
                wgmma::mma<HALF, T>(acc.d, wgmma::tile_at<k_major64>(a), 0, wgmma::tile_at<mn_major_half>(b[2 * ROLE]),
                                    0, k16, 1);
            wgmma::commit();
        };
        // dV += P^T dO, once P^T is in.
        auto add_dv = [&] {
            wgmma::fence();
            accumulate(dv, st.pt, st.dout[stage]);
        };
        if constexpr (ROLE == 0) {
            // P^T = exp2(c S^T - lse log2(e)); causal: 0 where key > query; 0 for keys past kv_len (see consume's
            // probabilities and keys_left).
            const int col0 = rt::column(0);
            const int ahead = a.causal && key0 + 63 > q0 ? int(key0 - q0) + top - col0 : INT_MIN;
            // Sliding window: keys at or below query - window too (see consume).
            if (WINDOW && key0 + a.window <= q0 + 63)
                exponentiate_scores(x.d, st.lse[stage], c, true, ahead, keys_left, true,
                                    int(key0 - q0) + a.window + top - col0);
            else
                exponentiate_scores(x.d, st.lse[stage], c, ahead != INT_MIN || key_tail, ahead, keys_left);
            rt::to_a_operand(frag, x);
            rt::store_swizzled(frag, 0, [&](int) { return const_cast<uint8_t*>(pt_bytes); });
            tma::fence_shared_to_async();
            sync::named_arrive(barrier_id::pt_ready, threads);
            sync::named_sync(barrier_id::warpgroup(ROLE), warpgroup::threads);  // this role's own P^T stores too
            add_dv();
        } else {
            // dS^T = P^T (dP^T - delta[query]), P^T as role 0 rounded it (the 16-bit P^T that dV multiplies too).
#pragma unroll
            for (int e = 0; e < 32; e += 2) {
                const float2 dl = *reinterpret_cast<const float2*>(&st.delta[stage][rt::column(e)]);
                x.d[e] -= dl.x;
                x.d[e + 1] -= dl.y;
            }
            sync::named_sync(barrier_id::pt_ready, threads);
            add_dv();
            rt::load_swizzled(frag, 0, [&](int) { return pt_bytes; });
#pragma unroll
            for (int j = 0; j < 4; ++j)
#pragma unroll
                for (int q = 0; q < 4; ++q) {
                    const float2 pr = rt::unpack2<T>(frag.r[j][q]);
                    x.d[8 * j + 2 * q] *= pr.x;
                    x.d[8 * j + 2 * q + 1] *= pr.y;
                }
            rt::to_a_operand(frag, x);
            rt::store_swizzled(frag, 0, [&](int) { return const_cast<uint8_t*>(dst_bytes); });
            tma::fence_shared_to_async();
        }
        sync::named_sync(barrier_id::consumers, threads);  // dS^T is in
        wgmma::fence();
        accumulate(dk, st.dst, st.q[stage]);  // dK += dS^T Q
        // dQ[:, half] = dS K[:, half] over the block's 64 keys (A: dS^T's boxes read MN-major).
#pragma unroll
        for (int k16 = 0; k16 < 4; ++k16) {
            const auto& ds_tile = wgmma::tile_at<mn_major64>(st.dst);
            const auto& k_tile = wgmma::tile_at<mn_major_half>(st.k[0][2 * ROLE]);
            if (k16 == 0)
                wgmma::mma_overwrite<HALF, T>(dq.d, ds_tile, 0, k_tile, 0, 0);
            else
                wgmma::mma<HALF, T>(dq.d, ds_tile, 0, k_tile, 0, k16, 1);
        }
        wgmma::commit();
        wgmma::wait<0>();
        wgmma::pin(dv.d);
        wgmma::pin(dk.d);
        wgmma::pin(dq.d);
        // Both roles are done with P^T, dS^T and the stage's Q and dO (and every lane with its lse/delta rows).
        sync::named_sync(barrier_id::consumers, threads);
        {
            uint8_t* staging = reinterpret_cast<uint8_t*>(ROLE == 0 ? st.q[stage][0] : st.dout[stage][0]);
            dq_chunks.store<HALF>(staging, dq.d);
            tma::fence_shared_to_async();
            sync::named_arrive(barrier_id::dq_staged_wide(stage), DQ_WIDE_THREADS);  // the writer adds it (write_dq_wide)
        }
        at.advance();
        walk.template next<WINDOW>(p, w);
    }

    // dK (times scale) and dV -> the input dtype, staged where this role staged its dQ (role 0 in stage 0's Q boxes,
    // role 1 in its dO boxes: dK in the first two, dV in the last two), once the writer's last dQ reduce-adds have
    // read them. Neither role writes where the other one staged.
    sync::named_sync(barrier_id::dq_written_wide, DQ_WIDE_THREADS);
    rt::mul(dk, dk, a.scale);
    T(&own)[4][BOX] = ROLE == 0 ? st.q[0] : st.dout[0];
#pragma unroll
    for (int e = 0; e < HALF / 2; e += 2) {
        const auto pos = wgmma::accumulator_position(e);
        const int box = pos.col / 64;
        const uint32_t offset = tma::swizzled_offset_128b(pos.row, pos.col % 64);
        *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(own[box]) + offset) = rt::pack2<T>(dk.d[e], dk.d[e + 1]);
        *reinterpret_cast<uint32_t*>(reinterpret_cast<uint8_t*>(own[2 + box]) + offset) =
            rt::pack2<T>(dv.d[e], dv.d[e + 1]);
    }
    tma::fence_shared_to_async();
    sync::named_sync(barrier_id::warpgroup(ROLE), warpgroup::threads);
    if (warpgroup::thread() == 0) {
        if (key0 < a.kv_len) {
            for (int b = 0; b < 2; ++b) {
                tma::store_4d(&map_dk, own[b], (2 * ROLE + b) * 64, int32_t(key0), w.out_head, w.batch);
                tma::store_4d(&map_dv, own[2 + b], (2 * ROLE + b) * 64, int32_t(key0), w.out_head, w.batch);
            }
        }
        tma::store_commit();
        tma::store_wait_read();
    }
}

// WINDOW: the launch's window is > 0 (a sliding window); without one the kernel has none of the window's code.
template <typename T, int D, bool WINDOW>
__global__ void __launch_bounds__(THREADS, 1)
    backward_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                    const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_do,
                    const __grid_constant__ CUtensorMap map_dq, const __grid_constant__ CUtensorMap map_dk,
                    const __grid_constant__ CUtensorMap map_dv, const __grid_constant__ CUtensorMap map_lse,
                    const __grid_constant__ CUtensorMap map_delta, const __grid_constant__ kernel_params p) {
    using state_t = shared_state<T, D>;
    extern __shared__ uint8_t raw_smem[];
    // At D = 128 reached through an integer, so its plain loads and stores stay generic (LD.E / ST.E); at D = 64 as
    // shared memory (LDS / STS). In one process against the other kind (H100, 2026-11-24, benchmarks/NOTES.md):
    // shared at D = 64 1.015-1.026x at S = 2048-8192, at D = 128 0.986-1.002x (once, at 2026-11-22's kernel, the
    // reverse; ncu then: the lse/delta reads wait on the short scoreboard and MIO queue beside the products'
    // shared-memory reads).
    state_t* state;
    if constexpr (D == 64)
        state = &aligned_shared<state_t>(raw_smem);
    else
        state = reinterpret_cast<state_t*>((reinterpret_cast<uintptr_t>(raw_smem) + 1023) & ~uintptr_t(1023));
    auto& st = *state;
    if (threadIdx.x == 0) {
        // full: the TMA thread (Q, dO, lse and delta bytes); empty: lane 0 of every consumer warp.
        st.ring.init(1, D == 256 ? 1 : CONSUMERS * 4);  // D = 256: the dQ writer warp (write_dq_wide)
        sync::init(st.kv_full, 1);
        sync::fence_init();
    }
    __syncthreads();
    pdl::start();  // set up under the previous kernel's tail; from here on global memory
    // Each role works out its block's work after setmaxnreg: carried across it, the values spill at the producers' 24.
    if (warpgroup::index() == 0) {
        // setmaxnreg moves registers within the block's launch allocation (168 x 384): 24 x 128 + 240 x 256 is all
        // of it (asking for more blocks the consumers forever). The producers only wait and issue copies, while
        // the consumers' dK and dV accumulators need every register of theirs.
        warpgroup::decrease_registers<PRODUCER_REGISTERS>();
        const block_work w = work_of<BK_OF<D>, WINDOW>(p);
        if (threadIdx.x == 0) produce_tiles<T, D, WINDOW>(st, p, w, map_q, map_k, map_v, map_do, map_lse, map_delta);
        if (threadIdx.x / 32 == 2) {
            if constexpr (D == 256)
                write_dq_wide<T, WINDOW>(st, p, w, map_dq);
            else
                write_dq<T, D, WINDOW>(st, p, w, map_dq);
        }
    } else {
        warpgroup::increase_registers<CONSUMER_REGISTERS>();
        const block_work w = work_of<BK_OF<D>, WINDOW>(p);
        if constexpr (D == 256) {
            if (warpgroup::index() == 1)
                consume_wide<T, 0, WINDOW>(st, p, w, map_dk, map_dv);
            else
                consume_wide<T, 1, WINDOW>(st, p, w, map_dk, map_dv);
        } else {
            // D = 128: both warpgroups compute half of dQ's columns; D = 64: warpgroup 0 all of them.
            if (D == 128 || warpgroup::index() == 1)
                consume<T, D, true, WINDOW>(st, p, w, map_dk, map_dv);
            else
                consume<T, D, false, WINDOW>(st, p, w, map_dk, map_dv);
        }
    }
}

// A (B, H, S) fp32 tensor of row values (lse, delta) as a map of 64-row boxes, zero past S.
inline CUresult rows_map(CUtensorMap* map, const float* base, int64_t batch, int64_t heads, int64_t len,
                         const int64_t (&stride)[2]) {
    const uint64_t dims[4] = {uint64_t(len), uint64_t(heads), uint64_t(batch), 1};
    const int64_t strides[3] = {stride[1], stride[0], stride[0] * batch};
    return tma::make_tensor_map_4d(map, base, tma::element_type<float>(), 4, dims, strides, BQ, 1, tma::swizzle::none);
}

template <typename T, int D>
constexpr int smem_bytes_of = sizeof(shared_state<T, D>) + 1024;
static_assert(smem_bytes_of<__nv_bfloat16, 256> <= 227 * 1024, "the D = 256 state fits an H100's 227 KB");

// A unit is one key tile of one (batch, dK/dV head): kv_heads * group_split heads, one partial sum per split of
// each group. The grid has a block per unit, or split_parts blocks per unit from split_from on.
int64_t units_of(const backward_args& a) {
    const int64_t keys = a.head_dim == 256 ? BK_OF<256> : BK;
    return a.batch * a.kv_heads * a.group_split * ((a.kv_len + keys - 1) / keys);
}

int64_t blocks_of(const backward_args& a, int64_t units) {
    return a.split_parts ? a.split_from + (units - a.split_from) * a.split_parts : units;
}

template <typename T, int D>
cudaError_t launch(const backward_args& a, cudaStream_t stream) {
    const bool window = a.window > 0 && a.window < a.kv_len;  // a window >= kv_len keeps every causal key
    const auto kernel = window ? backward_kernel<T, D, true> : backward_kernel<T, D, false>;
    if (cudaError_t e = window ? opt_in_shared_memory<backward_kernel<T, D, true>>(smem_bytes_of<T, D>)
                               : opt_in_shared_memory<backward_kernel<T, D, false>>(smem_bytes_of<T, D>);
        e != cudaSuccess)
        return e;
    constexpr CUtensorMapDataType type = tma::element_type<T>();
    const int64_t dq_stride[3] = {a.q_heads * a.q_len * D, a.q_len * D, D};
    CUtensorMap maps[9];
    const int64_t out_heads = a.kv_heads * a.group_split;  // dk and dv: one partial sum per split of each group
    using layout::map_of;
    if (map_of(&maps[0], a.q, type, 2, a.batch, a.q_heads, a.q_len, D, a.q_stride) != CUDA_SUCCESS ||
        map_of(&maps[1], a.k, type, 2, a.batch, a.kv_heads, a.kv_len, D, a.k_stride) != CUDA_SUCCESS ||
        map_of(&maps[2], a.v, type, 2, a.batch, a.kv_heads, a.kv_len, D, a.v_stride) != CUDA_SUCCESS ||
        map_of(&maps[3], a.dout, type, 2, a.batch, a.q_heads, a.q_len, D, a.dout_stride) != CUDA_SUCCESS ||
        map_of(&maps[4], a.dq_accum, tma::element_type<float>(), 4, a.batch, a.q_heads, a.q_len, D, dq_stride,
               32) != CUDA_SUCCESS ||
        map_of(&maps[5], a.dk, type, 2, a.batch, out_heads, a.kv_len, D, a.dk_stride) != CUDA_SUCCESS ||
        map_of(&maps[6], a.dv, type, 2, a.batch, out_heads, a.kv_len, D, a.dv_stride) != CUDA_SUCCESS ||
        rows_map(&maps[7], a.lse, a.batch, a.q_heads, a.q_len, a.lse_stride) != CUDA_SUCCESS ||
        rows_map(&maps[8], a.delta, a.batch, a.q_heads, a.q_len, a.delta_stride) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    kernel_params p;
    p.args = a;
    if (!window) p.args.window = 0;
    p.q_tiles = int((a.q_len + BQ - 1) / BQ);
    p.kv_tiles = int((a.kv_len + BK_OF<D> - 1) / BK_OF<D>);
    p.group = int(a.q_heads / a.kv_heads);
    p.heads_per_block = int(p.group / a.group_split);
    p.scale_log2 = a.scale * LOG2E;
    // The bytes a chunk's blocks share per (key/value head, split): Q and dO (input dtype) and dQ (fp32) of its
    // query heads.
    p.chunk_heads = layout::heads_per_chunk(int64_t(p.heads_per_block) * a.q_len * D * (2 * int64_t(sizeof(T)) + 4),
                                            out_heads * a.batch, p.kv_tiles, (multiprocessor_count() + 1) / 2);
    p.split_from = int(a.split_from);
    p.parts = a.split_parts;
    const int64_t blocks = blocks_of(a, units_of(a));
    p.zero_share = (a.zero_next_count / 4 + blocks - 1) / blocks;
    return launch_kernel(kernel, dim3(unsigned(blocks)), dim3(THREADS), smem_bytes_of<T, D>, stream, 1,
                         maps[0], maps[1], maps[2], maps[3], maps[4], maps[5], maps[6], maps[7], maps[8], p);
}

}  // namespace

int64_t backward_dq_steps(const backward_args& a) {
    const int keys = a.head_dim == 256 ? BK_OF<256> : BK;
    const int q_tiles = int((a.q_len + BQ - 1) / BQ), kv_tiles = int((a.kv_len + keys - 1) / keys);
    const bool window = a.window > 0 && a.window < a.kv_len;  // as launch() picks its kernel
    const int64_t heads_per_block = a.q_heads / a.kv_heads / a.group_split;
    int64_t steps = 0;
    for (int t = 0; t < kv_tiles; ++t) {
        const query_tiles r = keys == BK ? (window ? query_tiles_of<BK, true>(t, q_tiles, a.causal, a.window)
                                                  : query_tiles_of<BK, false>(t, q_tiles, a.causal, a.window))
                                         : (window ? query_tiles_of<BK_OF<256>, true>(t, q_tiles, a.causal, a.window)
                                                   : query_tiles_of<BK_OF<256>, false>(t, q_tiles, a.causal, a.window));
        steps += heads_per_block * (r.end - r.first);
    }
    return steps;
}

int64_t backward_max_zero_share() { return INT32_MAX - ZERO_STEP; }

const char* backward_unsupported(const backward_args& a) {
    if (const char* reason = layout::shape_unsupported(a.dtype, a.head_dim, a.batch, a.q_heads, a.kv_heads, a.q_len,
                                                       a.kv_len, a.causal, a.scale, a.window))
        return reason;
    if (a.group_split < 1 || (a.q_heads / a.kv_heads) % a.group_split)
        return "group_split must divide q_heads / kv_heads";
    const int64_t units = units_of(a);
    if (units >= (int64_t(1) << 31)) return "too many blocks";
    if (a.split_parts != 0) {
        if (a.split_parts < 2 || a.split_parts > 8) return "split_parts must be 0 or 2 to 8";
        if (a.head_dim == 256) return "the last wave split is not taken at head_dim 256";
        if (a.causal) return "the last wave split is for non-causal attention";
        if (a.split_from < 0 || a.split_from >= units) return "split_from must name a unit (0 <= split_from < units)";
        if (a.split_scratch == nullptr || a.split_counts == nullptr) return "a split needs its scratch and counters";
        const int64_t steps = (a.q_heads / a.kv_heads / a.group_split) * ((a.q_len + BQ - 1) / BQ);
        if (steps < a.split_parts) return "a split unit needs a step per part";
        if (blocks_of(a, units) >= (int64_t(1) << 31)) return "too many blocks";
    }
    if (a.lse == nullptr || a.delta == nullptr) return "lse and delta must be given";
    // TMA reads their rows: each starts 16-byte aligned (ops pads S to a multiple of 4 in memory).
    const int64_t sizes[2] = {a.batch, a.q_heads};
    for (const auto* stride : {a.lse_stride, a.delta_stride})
        for (int i = 0; i < 2; ++i)
            if (sizes[i] > 1 && (stride[i] <= 0 || stride[i] % 4))
                return "lse and delta strides (batch, head) must be positive multiples of 4 elements";
    if (!is_aligned(a.lse, 16) || !is_aligned(a.delta, 16)) return "lse and delta must be 16-byte aligned";
    const void* tensors[7] = {a.q, a.k, a.v, a.dout, a.dq_accum, a.dk, a.dv};
    for (const void* t : tensors)
        if (t == nullptr || !is_aligned(t, 16)) return "q, k, v, dout, dq_accum, dk and dv must be 16-byte aligned";
    if (!is_aligned(a.dq_done, 8)) return "dq_done must be 8-byte aligned";
    if (a.zero_next_count < 0 || a.zero_next_count % 4 || (a.zero_next_count > 0 && a.zero_next == nullptr))
        return "zero_next_count must be a multiple of 4 (0 without zero_next)";
    if (a.zero_next != nullptr) {
        if (!is_aligned(a.zero_next, 16)) return "zero_next must be 16-byte aligned";
        const int64_t blocks = blocks_of(a, units);
        if ((a.zero_next_count / 4 + blocks - 1) / blocks > backward_max_zero_share())
            return "zero_next_count is too large for this launch's blocks (2^31 float4s a block at most)";
        const float* accum_end = a.dq_accum + a.batch * a.q_heads * a.q_len * a.head_dim;
        if (a.zero_next < accum_end && a.dq_accum < a.zero_next + a.zero_next_count)
            return "zero_next must not overlap dq_accum (the launch adds into it)";
    }
    using layout::strides_ok;
    if (!strides_ok(a.q_stride, a.batch, a.q_heads, a.q_len) ||
        !strides_ok(a.dout_stride, a.batch, a.q_heads, a.q_len) ||
        !strides_ok(a.k_stride, a.batch, a.kv_heads, a.kv_len) ||
        !strides_ok(a.v_stride, a.batch, a.kv_heads, a.kv_len) ||
        !strides_ok(a.dk_stride, a.batch, a.kv_heads * a.group_split, a.kv_len) ||
        !strides_ok(a.dv_stride, a.batch, a.kv_heads * a.group_split, a.kv_len))
        return "strides of q, k, v, dout, dk and dv must be positive multiples of 8 elements";
    return nullptr;
}

cudaError_t launch_backward(const backward_args& a, cudaStream_t stream) {
    if (backward_unsupported(a) != nullptr) return cudaErrorInvalidValue;
    const bool bf16 = a.dtype == int(dtype::bf16);
    if (a.head_dim == 64) return bf16 ? launch<__nv_bfloat16, 64>(a, stream) : launch<__half, 64>(a, stream);
    if (a.head_dim == 128) return bf16 ? launch<__nv_bfloat16, 128>(a, stream) : launch<__half, 128>(a, stream);
    return bf16 ? launch<__nv_bfloat16, 256>(a, stream) : launch<__half, 256>(a, stream);
}

}  // namespace tk::attention
