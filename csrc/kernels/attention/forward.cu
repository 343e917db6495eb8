// Attention forward for Hopper, FlashAttention-style: a persistent grid (one block per SM) walks tiles of query
// rows of one head (128 at D = 128, 192 at D = 64), heaviest first when causal; Q is double-buffered, so the next
// tile's Q and first K/V stages load while a tile's output is written. A producer warp
// streams K and V in 128-key stages with TMA (separate rings, so S = Q K^T can start before V lands); the consumer
// warpgroups (two at D = 128, three at D = 64) each own 64 query rows, keep S, P and O in registers, and overlap the
// softmax of key block j with the P V product of block j - 1 (issued before it, waited for after it); the
// warpgroups take turns to issue their products (ping-pong, round robin), so their softmax runs while another's
// products keep the tensor cores busy. After a tile's first key block, each block's exponents are taken against the
// running maximum without the block's own maxima first (softmax_against_max), with slower paths for the rare block
// that passes it. Tails in both lengths are handled
// in-kernel: TMA zero-fills rows past the end, the softmax masks keys past kv_len, and the O store is clipped.
// A causal sliding window (args.window = W: query i keeps keys i - W < j <= i) skips the key blocks before the tile's
// first row's window and masks keys at or below row - W; a warp whose rows' windows have not all begun takes the
// softmax with block maxima (rows with no key yet keep m = -inf; see `exact`).
#include "forward.h"
#include "../../kittens/kittens.cuh"
#include "layout.cuh"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <type_traits>

namespace tk::attention {
namespace {

using wgmma::major;

// Keys per stage: 128, or 64 at D = 256, where S (64 x 128) beside O (64 x 256, 128 registers) and the stages'
// shared memory (2 x 64 KB of K and V at 128 keys) would not fit.
template <int D>
constexpr int BN = D == 256 ? 64 : 128;
constexpr int STAGES = 2;
constexpr float LOG2E = 1.4426950408889634f, LN2 = 0.6931471805599453f;
constexpr int PRODUCER_REGISTERS = 24;
constexpr float LAZY_SLACK = 8.0f;  // base-2 exponent by which a row may pass the maximum in use (see softmax)

// C consumer warpgroups per block, 64 query rows each: two, or three at D = 64 (consumers_for), whose
// products are short next to the softmax of the same scores, so two warpgroups' softmax can run under the third's
// products. At D = 128 S, P and O need 240 registers a thread: two only.
// At D = 256 a 128-row tile's Q is 64 KB: one buffer only (with the K and V stages, 192 KB). Its O then goes
// through a staging of its own (OWN_O_STAGING: 16 KB a warpgroup, 128 columns at a time, 224 KB in all) instead of
// over Q, so that Q goes back to the producer as soon as the tile's last scores are done and the next tile's Q
// loads under its last P V and epilogue. (Stored from registers, 4 bytes a thread and row, O cost 1.23-1.40x the
// whole kernel at S <= 1024 and 1.04-1.11x at 4096: H100, benchmarks/NOTES.md.)
template <int D, int C>
struct config {
    static_assert(C == 2 || (C == 3 && D == 64), "three consumer warpgroups fit D = 64's registers only");
    static_assert(D == 64 || D == 128 || D == 256, "head dims 64, 128 and 256");
    static constexpr int CONSUMERS = C;
    static constexpr int Q_BUFFERS = D == 256 ? 1 : 2;
    static constexpr bool OWN_O_STAGING = D == 256;
    static constexpr int BM = 64 * C;  // query rows per tile
    static constexpr int THREADS = (C + 1) * warpgroup::threads;
    static constexpr int CONSUMER_REGISTERS = C == 3 ? 160 : 240;
    static_assert(warpgroup::register_split_fits(1, PRODUCER_REGISTERS, CONSUMERS, CONSUMER_REGISTERS));
};
// Named barriers: 0 is __syncthreads; 1 + wg a consumer warpgroup's own; the ping-pong turns after them.
template <int C>
__device__ __forceinline__ int turn_barrier(int wg) { return 1 + C + wg; }

template <typename T, int D, int C>
struct shared_state {
    static constexpr int BM = config<D, C>::BM, QB = config<D, C>::Q_BUFFERS;
    // [tile parity][64-wide panel of D]; each warpgroup stages its O rows here once its last scores are done
    // (not with OWN_O_STAGING)
    wgmma::operand_tile<T, BM, major::k> q[QB][D / 64];
    wgmma::operand_tile<T, BN<D>, major::k> k[STAGES][D / 64];   // S = Q K^T: keys are B's N, D the reduction
    wgmma::operand_tile<T, D, major::mn> v[STAGES][BN<D> / 64];  // O += P V: D is B's N (contiguous), keys the reduction
    pipeline::ring<STAGES> k_ring, v_ring;  // full: the stage's bytes landed; empty: every consumer warp is done
    pipeline::ring<QB> q_ring;              // full: Q landed; empty: every consumer is done with the buffer
    int q_tile_of[QB];                      // the work item whose Q a buffer holds (-1: no more), with its `full`
    int merges[C];                          // a warpgroup's leader tells it that it merges its tile's parts
    // OWN_O_STAGING: [warpgroup][64-wide panel] of 128 of O's columns (last, so that the other members sit where
    // they do without it)
    std::conditional_t<config<D, C>::OWN_O_STAGING, wgmma::operand_tile<T, 64, major::k>[C][2], uint8_t[1]> o_staging;
    static constexpr uint32_t q_bytes = BM * D * sizeof(T), kv_bytes = BN<D> * D * sizeof(T);
};

// The last wave's tiles split by keys (dynamic schedule, no causal): where tiles % grid blocks leave most of the
// last wave idle, the last `tiles - split_from` tiles are each walked as `parts` key ranges by separate work items
// (tickets split_from + parts * (tile - split_from) + part). Each part leaves its O (divided by its own row sums)
// and its base-2 log-sum-exp in fp32 scratch; the part that completes a tile's count (per warpgroup's rows)
// sums them all and stores O and lse as a whole tile does.
struct tail_split {
    int split_from;     // the first split tile (tiles: none)
    int parts;          // key ranges per split tile
    float* partial_o;   // [tile - split_from][part][BM rows][D], O / l of the part's keys
    float* partial_lse; // [tile - split_from][part][BM rows], m + log2(l)
    int* counts;        // [tile - split_from][consumer]: zero at launch, left zero
};

struct kernel_params {
    forward_args args;
    int q_tiles;
    int tiles;         // q_tiles * batch * q_heads
    int items;         // work items: tiles, plus (parts - 1) per split tile
    tail_split split;
    int* tickets;      // dynamic schedule counter (blocks take the next tile when they get to it), or null: static
    int kv_group;      // query heads per key/value head
    int chunk_heads;   // causal: heads per L2 chunk of the tile order (layout::chunked_order)
    int causal_padding;  // causal: the first tile's empty rows above row 0, whole 64-row slices (work_of)
    float scale_log2;  // scale * log2(e) > 0: scores go to base 2, so each exponent is one FFMA and one ex2
};

struct block_work {
    int q_tile, head, batch, kv_blocks;
    int row0;  // the tile's first query row; causal tiles can start above row 0 (see work_of)
};

// A work item: a tile, or one key range of a split tile (part >= 0, tail = tile - split_from).
struct work_item {
    int tile, part, tail;
};
__device__ __forceinline__ work_item item_of(const kernel_params& p, int ticket) {
    if (ticket < p.split.split_from) return {ticket, -1, 0};
    const int tail = (ticket - p.split.split_from) / p.split.parts;
    return {p.split.split_from + tail, ticket - p.split.split_from - tail * p.split.parts, tail};
}
// Key blocks [first, end) of an item: all of the tile's, or its part's share (the parts differ by at most one).
// With a sliding window the tile's first row keeps keys from row0 - window + 1 on, and every later row from further
// on, so the blocks before that key's are skipped (padding rows, row0 < 0, start at block 0; in 32 bits: row0 >=
// window there, and window < kv_len < 2^31 once launch has normalised it). Split tiles have no window.
template <int KEYS, bool WINDOW>
__device__ __forceinline__ int2 key_blocks_of(const kernel_params& p, const work_item& it, const block_work& w) {
    if (it.part < 0) {
        const int window = p.args.window;
        return {WINDOW && w.row0 >= window ? int(unsigned(w.row0 - window + 1) / KEYS) : 0, w.kv_blocks};
    }
    return {it.part * w.kv_blocks / p.split.parts, (it.part + 1) * w.kv_blocks / p.split.parts};
}

// Causal tiles differ in work (row tile i sees i + 1 key blocks): within each L2 chunk of heads the heaviest
// tiles start first. Otherwise the query tiles of one head are neighbours, so blocks running together share its
// K and V in L2.
// Causal tiles are laid out from the last row up, in whole 64-row steps: where q_len is not a multiple of the tile,
// the part-filled tile is the first one (rows near 0 see few keys), with its empty 64-row slices above row 0, instead
// of the last one (which computes every key for its empty rows). With 192-row tiles at q_len = 2048 this lifts the
// share of the computed scores that the mask keeps from 0.85 to 0.89 (4096: 0.89 to 0.94).
template <int BM, int KEYS>
__device__ __forceinline__ block_work work_of(const kernel_params& p, int linear) {
    const forward_args& a = p.args;
    const int64_t bh_count = a.batch * a.q_heads;
    int q_tile;
    int64_t bh;
    if (a.causal) {
        const layout::chunked_tile t = layout::chunked_order(linear, int(bh_count), p.q_tiles, p.chunk_heads);
        bh = t.head;
        q_tile = p.q_tiles - 1 - t.rank;
    } else {
        q_tile = int(linear % p.q_tiles);
        bh = linear / p.q_tiles;
    }
    const int row0 = q_tile * BM - p.causal_padding;  // q_len < 2^31 (layout::shape_unsupported)
    int kv_blocks = int((a.kv_len + KEYS - 1) / KEYS);
    if (a.causal) kv_blocks = min(kv_blocks, (row0 + BM + KEYS - 1) / KEYS);
    return {q_tile, int(bh % a.q_heads), int(bh / a.q_heads), kv_blocks, row0};
}

template <typename T, int D, int C, bool WINDOW>
__device__ __forceinline__ void produce(shared_state<T, D, C>& st, const kernel_params& p, const CUtensorMap& map_q,
                                        const CUtensorMap& map_k, const CUtensorMap& map_v) {
    tma::prefetch_map(&map_q);
    tma::prefetch_map(&map_k);
    tma::prefetch_map(&map_v);
    constexpr int BN = attention::BN<D>;
    pipeline::cursor<config<D, C>::Q_BUFFERS> at_q;
    pipeline::cursor<STAGES> at;  // K and V stages run on across tiles
    // Static: items blockIdx.x, + grid, ... Dynamic: every block takes tickets until one is past the end, so a
    // launch hands out exactly items + grid of them, and the holder of the last one resets the counter.
    auto next_tile = [&](int previous) {
        if (p.tickets == nullptr) return previous < 0 ? int(blockIdx.x) : previous + int(gridDim.x);
        const int ticket = atomicAdd(p.tickets, 1);
        if (ticket == p.items + int(gridDim.x) - 1) atomicExch(p.tickets, 0);
        return ticket;
    };
    for (int t = next_tile(-1);; t = next_tile(t)) {
        st.q_ring.wait_empty(at_q);  // both warpgroups' O stores have read this buffer (two tiles ago)
        sync::barrier& q_full = st.q_ring.full[at_q.stage];
        if (t >= p.items) {  // the end: a buffer with no bytes whose item is -1
            st.q_tile_of[at_q.stage] = -1;
            sync::arrive(q_full);
            return;
        }
        st.q_tile_of[at_q.stage] = t;
        constexpr int BM = config<D, C>::BM;
        const work_item it = item_of(p, t);
        const block_work w = work_of<BM, BN>(p, it.tile);
        const int2 blocks = key_blocks_of<BN, WINDOW>(p, it, w);
        const int kv_head = w.head / p.kv_group;
        // 64-row slices above row 0 (causal padding) are not loaded: their rows are masked whole.
        constexpr uint32_t slice_bytes = shared_state<T, D, C>::q_bytes / (BM / 64);
        sync::arrive_expect_bytes(q_full, slice_bytes * uint32_t(BM / 64 + min(w.row0, 0) / 64));
        for (int r = 0; r < BM / 64; ++r)
            if (w.row0 + r * 64 >= 0)
                for (int dp = 0; dp < D / 64; ++dp)
                    tma::load_4d(st.q[at_q.stage][dp].data + r * 64 * 64, &map_q, dp * 64, w.row0 + r * 64,
                                 w.head, w.batch, q_full);
        at_q.advance();
        for (int j = blocks.x; j < blocks.y; ++j) {
            const int s = at.stage, key0 = j * BN;
            st.k_ring.wait_empty(at);
            sync::arrive_expect_bytes(st.k_ring.full[s], shared_state<T, D, C>::kv_bytes);
            for (int dp = 0; dp < D / 64; ++dp)
                for (int r = 0; r < BN / 64; ++r)
                    tma::load_4d(st.k[s][dp].data + r * 64 * 64, &map_k, dp * 64, key0 + r * 64, kv_head, w.batch,
                                 st.k_ring.full[s]);
            st.v_ring.wait_empty(at);
            sync::arrive_expect_bytes(st.v_ring.full[s], shared_state<T, D, C>::kv_bytes);
            for (int kp = 0; kp < BN / 64; ++kp)
                for (int dp = 0; dp < D / 64; ++dp)  // panel dp of the MN-major tile: 64 keys (lines) x 64 of D
                    tma::load_4d(st.v[s][kp].data + dp * 64 * 64, &map_v, dp * 64, key0 + kp * 64, kv_head,
                                 w.batch, st.v_ring.full[s]);
            at.advance();
        }
    }
}

// A split tile's part, at its end (o divided by its row sums, lse2 its base-2 log-sum-exp): its rows go to the
// scratch, and the warpgroup whose part completes the count of its rows (parts in any order) sums all parts into
// o and lse2: O = sum_p 2^(lse2_p - L) O_p with L = log2(sum_p 2^lse2_p). Returns whether this warpgroup stores the
// tile's rows (it merged).
template <typename T, int D, int C>
__device__ __forceinline__ bool merge_parts(shared_state<T, D, C>& st, const kernel_params& p, const work_item& it,
                                            int slice, rt::acc_tile<D>& o, rt::row_vec& lse2) {
    constexpr int BM = config<D, C>::BM;
    const tail_split& sp = p.split;
    const int top = rt::top_row();
    auto part_rows = [&](int part) { return (int64_t(it.tail) * sp.parts + part) * BM + slice * 64; };
    float* const own_o = sp.partial_o + part_rows(it.part) * D;
#pragma unroll
    for (int e = 0; e < D / 2; e += 2) {
        const auto pos = wgmma::accumulator_position(e);
        *reinterpret_cast<float2*>(own_o + pos.row * D + pos.col) = make_float2(o.d[e], o.d[e + 1]);
    }
    if ((threadIdx.x & 3) == 0) {
        sp.partial_lse[part_rows(it.part) + top] = lse2.top;
        sp.partial_lse[part_rows(it.part) + top + 8] = lse2.bottom;
    }
    __threadfence();  // this thread's share is visible on the GPU before the count says so
    sync::named_sync(1 + slice, warpgroup::threads);
    if (warpgroup::thread() == 0) {
        int* count = sp.counts + it.tail * C + slice;
        const bool last = atomicAdd(count, 1) == sp.parts - 1;
        if (last) *count = 0;  // every part has counted: left zero for the next launch
        st.merges[slice] = last;
    }
    sync::named_sync(1 + slice, warpgroup::threads);
    if (!st.merges[slice]) return false;
    __threadfence();  // the other parts' shares, counted before this one, are read after the count
    // Summed in part order whichever part merges, so that a launch's result does not depend on which finished last;
    // this part's own share is read back too (its own stores: the same fp32 values), freeing o to sum into.
    auto lse_of = [&](int part, int row) {
        return part == it.part ? (row == top ? lse2.top : lse2.bottom) : __ldcg(sp.partial_lse + part_rows(part) + row);
    };
    rt::row_vec big{-INFINITY, -INFINITY};
    for (int part = 0; part < sp.parts; ++part) {
        big.top = fmaxf(big.top, lse_of(part, top));
        big.bottom = fmaxf(big.bottom, lse_of(part, top + 8));
    }
    // Rows with no key at all (-inf everywhere) end with O = 0.
    if (big.top == -INFINITY) big.top = 0.0f;
    if (big.bottom == -INFINITY) big.bottom = 0.0f;
    rt::row_vec sum{0.0f, 0.0f};
    for (int part = 0; part < sp.parts; ++part) {
        const rt::row_vec w{exp2_approx(lse_of(part, top) - big.top), exp2_approx(lse_of(part, top + 8) - big.bottom)};
        sum.top += w.top;
        sum.bottom += w.bottom;
        const float* share = sp.partial_o + part_rows(part) * D;
#pragma unroll
        for (int e = 0; e < D / 2; e += 2) {
            const auto pos = wgmma::accumulator_position(e);
            const float2 x = __ldcg(reinterpret_cast<const float2*>(share + pos.row * D + pos.col));
            const float wr = rt::is_bottom(e) ? w.bottom : w.top;
            o.d[e] = part == 0 ? wr * x.x : fmaf(wr, x.x, o.d[e]);
            o.d[e + 1] = part == 0 ? wr * x.y : fmaf(wr, x.y, o.d[e + 1]);
        }
    }
    const rt::row_vec inv{sum.top > 0.0f ? 1.0f / sum.top : 0.0f, sum.bottom > 0.0f ? 1.0f / sum.bottom : 0.0f};
    rt::mul_rows(o, o, inv);
    lse2 = {big.top + __log2f(sum.top), big.bottom + __log2f(sum.bottom)};
    return true;
}

template <typename T, int D, int C, bool WINDOW>
__device__ __forceinline__ void consume_tile(shared_state<T, D, C>& st, const kernel_params& p, const block_work& w,
                                             const work_item& it, int qb, int& pending, pipeline::cursor<STAGES>& at_k,
                                             pipeline::cursor<STAGES>& at_v, const CUtensorMap& map_o) {
    const forward_args& a = p.args;
    constexpr int CONSUMERS = config<D, C>::CONSUMERS, BN = attention::BN<D>;
    constexpr bool OWN_O_STAGING = config<D, C>::OWN_O_STAGING;
    const int slice = warpgroup::uniform_index() - 1;  // query rows [64 slice, 64 slice + 64) of the tile
    const int64_t row0 = w.row0 + slice * 64;  // < 0: a causal padding slice (masked whole, nothing stored)
    const bool lane0 = (threadIdx.x & 31) == 0;
    rt::acc_tile<BN> s;
    rt::acc_tile<D> o;
    rt::a_operand<T, BN> pr;
    rt::fill(o, 0.0f);
    rt::row_vec m{-INFINITY, -INFINITY};  // running row max of the base-2 scores
    rt::row_vec l{0.0f, 0.0f};            // running row sum over this thread's columns (quad-reduced at the end)
    auto& q = st.q[qb];

    auto scores = [&](int stage) {  // s = Q K^T (unscaled), one wgmma group
        wgmma::fence();
#pragma unroll
        for (int dp = 0; dp < D / 64; ++dp)
#pragma unroll
            for (int k16 = 0; k16 < 4; ++k16)
                wgmma::mma<BN, T>(s.d, q[dp], slice * 64, st.k[stage][dp], 0, k16, (dp | k16) != 0);
        wgmma::commit();
    };
    auto accumulate_pv = [&](int stage) {  // o += P V, one wgmma group
        wgmma::fence();
#pragma unroll
        for (int kv16 = 0; kv16 < BN / 16; ++kv16)
            wgmma::mma<D, T>(o.d, pr, kv16, st.v[stage][kv16 / 4], 0, kv16 % 4, 1);
        wgmma::commit();
    };
    // Online softmax of key block j in place (s becomes exp2(scaled s - new max)); returns the factor that
    // rescales what o and l held before this block.
    // The maximum is taken on raw scores (scale > 0 keeps their order) and scaled once per row.
    const float c = p.scale_log2;
    bool moved = true;  // warp-uniform: the last softmax moved some row's maximum (o needs rescaling)
    auto mask = [&](int j) {
        const int64_t key0 = int64_t(j) * BN;
        // Sliding window (causal): some row of this slice drops keys of this block at or below row - window.
        const bool window_cut = WINDOW && key0 + a.window <= row0 + 63;
        if (key0 + BN > a.kv_len || (a.causal && key0 + BN - 1 > row0) || window_cut) {
            // Keys past kv_len and (causal) past the row are masked: each element is one compare of its
            // rt::column_offset against its row's last kept offset, in 32 bits (lengths < 2^31; row0 - key0 is
            // below q_len, and with the window cut row0 - key0 - window >= -63).
            const int col0 = rt::column(0);
            const int tail = int(a.kv_len - key0 < BN ? a.kv_len - key0 : BN) - 1 - col0;
            const int diag = a.causal ? int(row0 - key0) + rt::top_row() - col0 : tail;
            const int last_top = min(tail, diag), last_bottom = min(tail, a.causal ? diag + 8 : tail);
            if (window_cut) {
                // ... and keys at or below row - window: offsets up to diag - window. A copy of its own, so that
                // blocks without the cut (every block without a window) keep the one compare.
                const int cut_top = diag - a.window, cut_bottom = cut_top + 8;
#pragma unroll
                for (int i = 0; i < BN / 2; ++i) {
                    const int offset = rt::column_offset(i);
                    const bool bottom = rt::is_bottom(i);
                    if (offset > (bottom ? last_bottom : last_top) || offset <= (bottom ? cut_bottom : cut_top))
                        s.d[i] = -INFINITY;
                }
            } else {
#pragma unroll
                for (int i = 0; i < BN / 2; ++i)
                    if (rt::column_offset(i) > (rt::is_bottom(i) ? last_bottom : last_top)) s.d[i] = -INFINITY;
            }
        }
    };
    // s becomes exp2(scaled s - base) in place, each row's sum over this thread's columns added to sum_top/bottom.
    auto exponents = [&](const rt::row_vec& base, float& sum_top, float& sum_bottom) {
#pragma unroll
        for (int i = 0; i < BN / 2; ++i) {
            const bool bottom = rt::is_bottom(i);
            const float e = exp2_approx(fmaf(s.d[i], c, -(bottom ? base.bottom : base.top)));
            s.d[i] = e;
            if (bottom)
                sum_bottom += e;
            else
                sum_top += e;
        }
    };
    auto softmax = [&](int j) {
        mask(j);
        rt::row_vec block_max;
        rt::row_max(block_max, s);
        rt::row_vec m_new{fmaxf(m.top, block_max.top * c), fmaxf(m.bottom, block_max.bottom * c)};
        // Lazy rescaling: the maximum in use moves only when a row of the warp passes it by more than
        // LAZY_SLACK (base 2), so most blocks leave o and l as they are; exact, since l, o and the lse share the
        // maximum in use, and exponents stay below 2^LAZY_SLACK.
        moved = __any_sync(0xffffffffu, m_new.top > m.top + LAZY_SLACK || m_new.bottom > m.bottom + LAZY_SLACK);
        if (!moved) m_new = m;
        // A row with every key masked so far keeps -inf: subtract 0 there so the exponents are 0, not NaN.
        const rt::row_vec base{m_new.top == -INFINITY ? 0.0f : m_new.top,
                               m_new.bottom == -INFINITY ? 0.0f : m_new.bottom};
        const rt::row_vec alpha{exp2_approx(m.top - base.top), exp2_approx(m.bottom - base.bottom)};
        float sum_top = 0.0f, sum_bottom = 0.0f;
        exponents(base, sum_top, sum_bottom);
        l = {l.top * alpha.top + sum_top, l.bottom * alpha.bottom + sum_bottom};
        m = m_new;
        return alpha;
    };

    // The same block against the maximum in use, without the block's own maxima (64 FMNMX and their shuffles a
    // thread, on the path from the scores to the exponents): every exponent is taken against m. Where each of this
    // warp's partial row sums (32 keys) is at most 2^LAZY_SLACK, every exponent is too, and the block is kept as
    // softmax(j) keeps it when no row moves. Otherwise the maxima are taken from the exponents themselves, and where
    // a row passed the maximum by more than the slack, every row of the warp moves to its block maximum as in
    // softmax(j) (its exponents divided by it; alpha rescales o). Returns false only where a partial sum passed
    // 2^126 (a block about 2^126 above the maximum, or overflowed): the caller then scores the block again for
    // softmax(j). Rows with no key yet (m = -inf; l and o are 0) take 0 as their maximum.
    auto softmax_against_max = [&](int j, rt::row_vec& alpha) {
        mask(j);
        const rt::row_vec base{m.top == -INFINITY ? 0.0f : m.top, m.bottom == -INFINITY ? 0.0f : m.bottom};
        float sum_top = 0.0f, sum_bottom = 0.0f;
        exponents(base, sum_top, sum_bottom);
        constexpr float bound = float(1 << int(LAZY_SLACK));
        moved = false;
        m = base;
        if (!__all_sync(0xffffffffu, sum_top <= bound && sum_bottom <= bound)) {
            // Past 2^126 the rescale below, 2^-log2(max), would flush to zero (ex2.approx.ftz), and past 2^128
            // the exponents overflowed: both go back to the scores. (NaN stays here and propagates.)
            constexpr float top_bound = 0x1p126f;
            if (__any_sync(0xffffffffu, sum_top > top_bound || sum_bottom > top_bound)) return false;
            rt::row_vec big;
            rt::row_max(big, s);
            moved = __any_sync(0xffffffffu, big.top > bound || big.bottom > bound);
            if (moved) {
                // log2 of the rows' largest exponents (0 where below 1) raises m; alpha = 2^-that scales by
                // special-function instructions alone (a division would bring its slow-path call into the loop).
                const rt::row_vec up{__log2f(fmaxf(big.top, 1.0f)), __log2f(fmaxf(big.bottom, 1.0f))};
                alpha = {exp2_approx(-up.top), exp2_approx(-up.bottom)};
                rt::mul_rows(s, s, alpha);
                sum_top *= alpha.top;
                sum_bottom *= alpha.bottom;
                l = {l.top * alpha.top, l.bottom * alpha.bottom};
                m = {base.top + up.top, base.bottom + up.bottom};
            }
        }
        l = {l.top + sum_top, l.bottom + sum_bottom};
        return true;
    };

    // softmax_against_max's rare path: this thread's raw scores of the block, Q and K read from shared memory and
    // multiplied on the CUDA cores. Warp-local, so one warp can take it alone (a wgmma would need the whole
    // warpgroup to agree first); fp32 sums of exact products, as the tensor cores form them.
    auto rescore = [&](int stage) {
        const int top = slice * 64 + rt::top_row();
        auto chunk_of = [&](const T* panel, int line, int chunk) {
            return *reinterpret_cast<const uint4*>(reinterpret_cast<const uint8_t*>(panel) +
                                                   tma::swizzled_byte_offset_128b(line, chunk * 16));
        };
        auto element = [](const uint4& raw, int k) { return to_float(reinterpret_cast<const T*>(&raw)[k]); };
        // Eight keys' columns (four registers) per turn, rotated into s at its end: a rolled loop holds few
        // registers (three warpgroups have 160), and registers are named by constants only.
#pragma unroll 1
        for (int g = 0; g < BN / 8; ++g) {
            float fresh[4];
#pragma unroll
            for (int pair = 0; pair < 2; ++pair) {
                const int key = rt::column(4 * g + pair);
                float sum_top = 0.0f, sum_bottom = 0.0f;
#pragma unroll 1
                for (int d8 = 0; d8 < D / 8; ++d8) {  // 8 elements of D at a time: one 16-byte swizzle chunk
                    const int panel = d8 / 8, chunk = d8 % 8;
                    const uint4 qt = chunk_of(q[panel].data, top, chunk), qb = chunk_of(q[panel].data, top + 8, chunk);
                    const uint4 kx = chunk_of(st.k[stage][panel].data, key, chunk);
#pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        sum_top = fmaf(element(qt, k), element(kx, k), sum_top);
                        sum_bottom = fmaf(element(qb, k), element(kx, k), sum_bottom);
                    }
                }
                fresh[pair] = sum_top;
                fresh[2 + pair] = sum_bottom;
            }
#pragma unroll
            for (int i = 0; i < BN / 2 - 4; ++i) s.d[i] = s.d[i + 4];
#pragma unroll
            for (int i = 0; i < 4; ++i) s.d[BN / 2 - 4 + i] = fresh[i];
        }
    };

    // Ping-pong: a warpgroup issues its products only in its turn and then hands the turn to the next (round
    // robin). Every turn is matched over the whole walk: the last warpgroup opens with a hand-over and warpgroup 0
    // takes a last, empty turn (both in consume).
    constexpr int turn_threads = 2 * warpgroup::threads;
    auto my_turn = [&] { sync::named_sync(turn_barrier<C>(slice), turn_threads); };
    auto hand_over = [&] { sync::named_arrive(turn_barrier<C>((slice + 1) % CONSUMERS), turn_threads); };

    // The item's key blocks: the tile's, or its part's.
    const int2 blocks = key_blocks_of<BN, WINDOW>(p, it, w);
    // With a sliding window a row's first kept key can lie past the tile's first block, so a row can enter a block
    // with no key yet (m = -inf). softmax_against_max would take such a row's exponents against 0, where a block of
    // scores far below 0 underflows to l = 0 (and far above it goes the slow way), so until the warp's last row has
    // its first key (its block included) the warp takes softmax(j), whose block maxima handle rows with no key:
    // block j is such a block while j BN + window <= the warp's last row + 1 (its first key, last row - window + 1,
    // is at or past j BN). Worked out again for each block from values the loop holds anyway (kept in a register of
    // its own, it spilled in the three-warpgroup kernel). Without a window only the first block, as before.
    // First block: scores, softmax, P.
    st.k_ring.wait_full(at_k);
    my_turn();
    scores(at_k.stage);
    hand_over();
    if (pending >= 0) {  // the previous tile's O store has had these scores' time to read its staging
        if (warpgroup::thread() == 0) {
            tma::store_wait_read();
            sync::arrive(st.q_ring.empty[pending]);  // the leader's share of handing that Q buffer back
        }
        __syncwarp();  // lane 0 rejoins its warp before the .aligned wgmma wait
        pending = -1;
    }
    wgmma::wait<0>();
    wgmma::pin(s.d);
    if (lane0) sync::arrive(st.k_ring.empty[at_k.stage]);
    at_k.advance();
    softmax(blocks.x);
    rt::to_a_operand(pr, s);
    // Block j: issue its scores and block j - 1's P V, softmax block j while P V runs, then rescale o.
    for (int j = blocks.x + 1; j < blocks.y; ++j) {
        st.k_ring.wait_full(at_k);
        st.v_ring.wait_full(at_v);
        my_turn();
        scores(at_k.stage);
        accumulate_pv(at_v.stage);
        hand_over();
        wgmma::wait<1>();  // the scores (committed first) are done; P V may still run
        wgmma::pin(s.d);
        rt::row_vec alpha{1.0f, 1.0f};
        bool exact = false;  // a row of this warp may have no key yet (sliding window)
        if constexpr (WINDOW)  // the warp's last row: top_row (16 warp + lane / 4) | 15
            exact = int64_t(j) * BN + a.window <= row0 + (rt::top_row() | 15) + 1;
        if (exact || !softmax_against_max(j, alpha)) {
            // Overflowed (rare): this warp's scores of the block again (K's stage is still held), then the softmax
            // with its maxima. P V's registers are freed first (three warpgroups' 160 registers hold no more).
            // Exact: the scores are still raw, the softmax with maxima right away.
            wgmma::wait<0>();
            wgmma::pin(o.d);
            if (!exact) rescore(at_k.stage);
            alpha = softmax(j);
        }
        if (lane0) sync::arrive(st.k_ring.empty[at_k.stage]);
        at_k.advance();
        // The wait for P V after a branch on the softmax's result: in the softmax's own block, ptxas hoists it to
        // the block's top (ahead of the exponents, which then no longer overlap P V).
        if (moved) {
            wgmma::wait<0>();
            wgmma::pin(o.d);
            rt::mul_rows(o, o, alpha);
        }
        wgmma::wait<0>();
        wgmma::pin(o.d);
        wgmma::pin(s.d);  // P's registers are rewritten only after the P V that reads them is done
        if (lane0) sync::arrive(st.v_ring.empty[at_v.stage]);
        at_v.advance();
        rt::to_a_operand(pr, s);
    }
    // OWN_O_STAGING: Q is read no more (the scores and any rescore are done), so its buffer goes back now and the
    // next tile's Q loads under this one's last P V and epilogue.
    if constexpr (OWN_O_STAGING) sync::arrive(st.q_ring.empty[qb]);
    st.v_ring.wait_full(at_v);
    my_turn();
    accumulate_pv(at_v.stage);
    hand_over();
    wgmma::wait<0>();
    wgmma::pin(o.d);
    if (lane0) sync::arrive(st.v_ring.empty[at_v.stage]);
    at_v.advance();  // the cursors run on into the next tile

    // Epilogue: full row sums, O / l, the log-sum-exp, O staged in this warpgroup's Q rows and stored by TMA.
#pragma unroll
    for (int offset = 1; offset < 4; offset *= 2) {
        l.top += __shfl_xor_sync(0xffffffffu, l.top, offset);
        l.bottom += __shfl_xor_sync(0xffffffffu, l.bottom, offset);
    }
    // One reciprocal per row, then products: 64 IEEE divisions were ~1000 instructions a tile (a divide is a
    // reciprocal, a Newton step and a slow-path check each), about two key blocks' worth. A row with no key (l = 0)
    // is never stored.
    const rt::row_vec inv_l{l.top > 0.0f ? 1.0f / l.top : 0.0f, l.bottom > 0.0f ? 1.0f / l.bottom : 0.0f};
    rt::mul_rows(o, o, inv_l);
    rt::row_vec lse2{m.top + __log2f(l.top), m.bottom + __log2f(l.bottom)};  // base 2
    // A part of a split tile: its share to the scratch; the warpgroup that completes its rows' count merges.
    bool stores = true;
    if constexpr (!OWN_O_STAGING)  // OWN_O_STAGING tiles are never split (choose_split)
        if (it.part >= 0) stores = merge_parts(st, p, it, slice, o, lse2);
    if (stores && (threadIdx.x & 3) == 0 && row0 >= 0) {
        const int64_t top = row0 + rt::top_row();
        float* lse = a.lse + int64_t(w.batch) * a.lse_stride[0] + int64_t(w.head) * a.lse_stride[1];
        if (top < a.q_len) lse[top] = lse2.top * LN2;
        if (top + 8 < a.q_len) lse[top + 8] = lse2.bottom * LN2;
    }
    if constexpr (OWN_O_STAGING) {
        // O rounded into this warpgroup's staging and stored by TMA, 128 columns at a time; rows past q_len are
        // clipped by the map, and a causal padding slice (row0 < 0) stores nothing. Before each half, the leader
        // sees the staging's last store (the other half, or the previous tile's) read.
        auto& staging = st.o_staging[slice];
#pragma unroll
        for (int h = 0; h < 2; ++h) {
            if (warpgroup::thread() == 0) tma::store_wait_read();
            sync::named_sync(1 + slice, warpgroup::threads);
            rt::store_swizzled<T, 128, D>(o.d, 128 * h, 0, [&](int col) {
                return reinterpret_cast<uint8_t*>(staging[col / 64 - 2 * h].data);
            });
            tma::fence_shared_to_async();
            sync::named_sync(1 + slice, warpgroup::threads);
            if (warpgroup::thread() == 0 && row0 >= 0 && row0 < a.q_len) {
                for (int dp = 0; dp < 2; ++dp)
                    tma::store_4d(&map_o, staging[dp].data, (2 * h + dp) * 64, int32_t(row0), w.head, w.batch);
                tma::store_commit();
            }
        }
        __syncwarp();  // lane 0 rejoins its warp before the next tile's .aligned barriers and wgmma
        return;
    }
    // O rounded into this warpgroup's rows of the Q stage.
    if (stores)
        rt::store_swizzled<T, D, D>(o.d, 0, slice * 64,
                                    [&](int col) { return reinterpret_cast<uint8_t*>(q[col / 64].data); });
    tma::fence_shared_to_async();
    sync::named_sync(1 + slice, warpgroup::threads);
    if (stores && warpgroup::thread() == 0 && row0 >= 0 && row0 < a.q_len) {
        for (int dp = 0; dp < D / 64; ++dp)
            tma::store_4d(&map_o, q[dp].data + slice * 64 * 64, dp * 64, int32_t(row0), w.head, w.batch);
        tma::store_commit();
    }
    __syncwarp();  // lane 0 rejoins its warp before the next tile's .aligned barriers and wgmma
    // Every consumer thread read the buffer's tile index, so every one hands the buffer back itself (release):
    // the others now, the leader once its store has read the staged O, which it checks in the next tile after
    // its first products are issued (waiting here held the whole warpgroup's next turn on the store).
    if (warpgroup::thread() != 0) sync::arrive(st.q_ring.empty[qb]);
    pending = qb;
}

template <typename T, int D, int C, bool WINDOW>
__device__ __forceinline__ void consume(shared_state<T, D, C>& st, const kernel_params& p, const CUtensorMap& map_o) {
    constexpr int CONSUMERS = config<D, C>::CONSUMERS;
    // Warpgroup 0 takes the first turn: the last one hands it over.
    if (warpgroup::index() == CONSUMERS) sync::named_arrive(turn_barrier<C>(0), 2 * warpgroup::threads);
    pipeline::cursor<config<D, C>::Q_BUFFERS> at_q;
    pipeline::cursor<STAGES> at_k, at_v;
    int pending = -1;  // the Q buffer whose O store the leader has yet to see read (its hand-back is owed)
    for (;; at_q.advance()) {
        st.q_ring.wait_full(at_q);
        const int t = st.q_tile_of[at_q.stage];
        if (t < 0) break;
        const work_item it = item_of(p, t);
        consume_tile<T, D, C, WINDOW>(st, p, work_of<config<D, C>::BM, BN<D>>(p, it.tile), it, at_q.stage, pending,
                                      at_k, at_v, map_o);
    }
    // Warpgroup 0 takes the last warpgroup's last hand-over.
    if (warpgroup::index() == 1) sync::named_sync(turn_barrier<C>(0), 2 * warpgroup::threads);
    if (warpgroup::thread() == 0) tma::store_wait();  // the last outputs are in global memory
}

// WINDOW: the launch's window is > 0 (a sliding window); without one the kernel has none of the window's code.
template <typename T, int D, int C, bool WINDOW>
__global__ void __launch_bounds__(config<D, C>::THREADS, 1)
    forward_kernel(const __grid_constant__ CUtensorMap map_q, const __grid_constant__ CUtensorMap map_k,
                   const __grid_constant__ CUtensorMap map_v, const __grid_constant__ CUtensorMap map_o,
                   const __grid_constant__ kernel_params p) {
    using state_t = shared_state<T, D, C>;
    extern __shared__ uint8_t raw_smem[];
    auto& st = aligned_shared<state_t>(raw_smem);
    constexpr int CONSUMERS = config<D, C>::CONSUMERS;
    if (threadIdx.x == 0) {
        st.k_ring.init(1, CONSUMERS * 4);  // the producer; lane 0 of every consumer warp
        st.v_ring.init(1, CONSUMERS * 4);
        st.q_ring.init(1, CONSUMERS * warpgroup::threads);  // the producer; every consumer thread
        sync::fence_init();
    }
    __syncthreads();
    pdl::start();  // set up under the previous kernel's tail; from here on global memory
    if (warpgroup::index() == 0) {
        warpgroup::decrease_registers<PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) produce<T, D, C, WINDOW>(st, p, map_q, map_k, map_v);
    } else {
        warpgroup::increase_registers<config<D, C>::CONSUMER_REGISTERS>();
        consume<T, D, C, WINDOW>(st, p, map_o);
    }
}

template <typename T, int D, int C>
constexpr int smem_bytes_of = sizeof(shared_state<T, D, C>) + 1024;  // + alignment to 1024 bytes
static_assert(smem_bytes_of<__nv_bfloat16, 256, 2> <= 227 * 1024, "the D = 256 state fits an H100's 227 KB");

// The consumer warpgroups of the kernel for head dim D: three (192-row tiles) at D = 64, two otherwise. Against two
// at D = 64 in one process (H100, benchmarks/NOTES.md, session 22): causal 1.03x, 1.06x, 1.11x at S = 512, 1024,
// 2048, 1.14-1.18x at 8192-16384 with or without the mask. (Causal attention under 2048 queries took two until
// causal tiles were laid out from the last row, when 192-row tiles masked more of their diagonal blocks.)
constexpr int consumers_for(int head_dim) { return head_dim == 64 ? 3 : 2; }

struct split_choice {
    int blocks, split_from, parts;
    int64_t scratch_floats, counts;
};

// Splits the last wave where that shortens it: with tiles % blocks = r > 0 tiles in the last wave (every tile the
// same work: no causal), r * parts items take ceil(r * parts / blocks) / parts of a tile's time instead of one
// whole tile's; parts 2-4, the shortest taken when it saves a twentieth of a tile. Only where a part still walks
// many key blocks: each item pays a tile's start and end (and a part its merge), which at 16-32 key blocks ate the
// gain (H100, D = 128 at 2048 and 4096 keys: 0.97x and 1.00x; 8192 and 16384: 1.02x). Only with two consumer
// warpgroups: the D = 64 kernel's 192-row tiles fill more of their last wave (0.99-1.02x). The dynamic schedule
// only (items go to whichever block is free; under CUDA-graph capture the static one runs).
constexpr int SPLIT_MIN_KEY_BLOCKS = 64;

split_choice choose_split(const forward_args& a, bool dynamic) {
    const int c = consumers_for(int(a.head_dim)), bm = 64 * c;
    const int64_t tiles = (a.q_len + bm - 1) / bm * a.batch * a.q_heads;
    const int blocks = int(std::min<int64_t>(tiles, a.max_blocks > 0 ? a.max_blocks : multiprocessor_count()));
    split_choice s{blocks, int(tiles), 1, 0, 0};
    const int r = blocks > 0 ? int(tiles % blocks) : 0;
    const int64_t kv_blocks = (a.kv_len + BN<128> - 1) / BN<128>;
    // D = 256 is not split: its kernel (64-key stages, one Q buffer, O staged apart from it) has no merge.
    if (a.causal || !dynamic || r == 0 || c != 2 || a.head_dim == 256 || kv_blocks < SPLIT_MIN_KEY_BLOCKS) return s;
    double best = 1.0 - 0.05;
    for (int parts = 2; parts <= 4; ++parts) {
        const double rounds = double((int64_t(r) * parts + blocks - 1) / blocks) / parts;
        if (rounds < best) {
            best = rounds;
            s.parts = parts;
        }
    }
    if (s.parts == 1) return s;
    s.split_from = int(tiles) - r;
    s.scratch_floats = int64_t(r) * s.parts * bm * (a.head_dim + 1);
    s.counts = int64_t(r) * c;
    return s;
}

template <typename T, int D, int C>
cudaError_t launch(const forward_args& a, cudaStream_t stream) {
    const bool window = a.window > 0 && a.window < a.kv_len;  // a window >= kv_len keeps every causal key
    const auto kernel = window ? forward_kernel<T, D, C, true> : forward_kernel<T, D, C, false>;
    if (cudaError_t e = window ? opt_in_shared_memory<forward_kernel<T, D, C, true>>(smem_bytes_of<T, D, C>)
                               : opt_in_shared_memory<forward_kernel<T, D, C, false>>(smem_bytes_of<T, D, C>);
        e != cudaSuccess)
        return e;
    CUtensorMap map_q{}, map_k{}, map_v{}, map_o{};
    constexpr CUtensorMapDataType type = tma::element_type<T>();
    using layout::map_of;
    if (map_of(&map_q, a.q, type, 2, a.batch, a.q_heads, a.q_len, D, a.q_stride) != CUDA_SUCCESS ||
        map_of(&map_k, a.k, type, 2, a.batch, a.kv_heads, a.kv_len, D, a.k_stride) != CUDA_SUCCESS ||
        map_of(&map_v, a.v, type, 2, a.batch, a.kv_heads, a.kv_len, D, a.v_stride) != CUDA_SUCCESS ||
        map_of(&map_o, a.o, type, 2, a.batch, a.q_heads, a.q_len, D, a.o_stride) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    kernel_params p;
    p.args = a;
    if (!window) p.args.window = 0;
    p.q_tiles = int((a.q_len + config<D, C>::BM - 1) / config<D, C>::BM);
    p.kv_group = int(a.q_heads / a.kv_heads);
    constexpr int BM = config<D, C>::BM;
    p.causal_padding = a.causal ? (BM - int(a.q_len % BM)) % BM / 64 * 64 : 0;
    p.scale_log2 = a.scale * LOG2E;
    p.tiles = int(int64_t(p.q_tiles) * a.batch * a.q_heads);
    p.tickets = a.tickets;
    const split_choice split = choose_split(a, a.tickets != nullptr);
    p.split = {p.tiles, 1, nullptr, nullptr, nullptr};
    if (split.parts > 1 && a.split_scratch != nullptr && a.split_scratch_floats >= split.scratch_floats &&
        a.split_counts != nullptr && a.split_counts_len >= split.counts) {
        const int64_t o_floats = int64_t(p.tiles - split.split_from) * split.parts * BM * D;
        p.split = {split.split_from, split.parts, a.split_scratch, a.split_scratch + o_floats, a.split_counts};
    }
    p.items = p.split.split_from + (p.tiles - p.split.split_from) * p.split.parts;
    // The bytes a chunk's tiles share: each query head's K and V (shared again within a group: a bound). Chunks
    // need the dynamic schedule: a static one deals a chunk's uneven tiles out unevenly (up to 1.3x the mean per
    // block), so it keeps one heaviest-first order over all heads.
    p.chunk_heads = a.tickets != nullptr
                        ? layout::heads_per_chunk(2 * a.kv_len * D * int64_t(sizeof(T)), a.batch * a.q_heads)
                        : int(a.batch * a.q_heads);
    const int64_t blocks = split.blocks;
    if (blocks <= 0) return cudaErrorInvalidValue;
    return launch_kernel(kernel, dim3(unsigned(blocks)), dim3(config<D, C>::THREADS),
                         smem_bytes_of<T, D, C>, stream, 1, map_q, map_k, map_v, map_o, p);
}

}  // namespace

const char* forward_unsupported(const forward_args& a) {
    if (const char* reason = layout::shape_unsupported(a.dtype, a.head_dim, a.batch, a.q_heads, a.kv_heads, a.q_len,
                                                       a.kv_len, a.causal, a.scale, a.window))
        return reason;
    // Tiles and the dynamic schedule's tickets (tiles + grid of them) count in int.
    if (a.batch * a.q_heads * ((a.q_len + 127) / 128) >= (int64_t(1) << 31) - 65536) return "too many tiles";
    if (a.batch * a.q_heads >= (int64_t(1) << 31)) return "too many heads";
    if (a.lse == nullptr) return "lse must be given";
    if (a.max_blocks < 0) return "max_blocks must be >= 0";
    const void* tensors[4] = {a.q, a.k, a.v, a.o};
    for (const void* t : tensors)
        if (t == nullptr || !is_aligned(t, 16)) return "q, k, v and o must be 16-byte aligned";
    using layout::strides_ok;
    if (!strides_ok(a.q_stride, a.batch, a.q_heads, a.q_len) || !strides_ok(a.k_stride, a.batch, a.kv_heads, a.kv_len) ||
        !strides_ok(a.v_stride, a.batch, a.kv_heads, a.kv_len) || !strides_ok(a.o_stride, a.batch, a.q_heads, a.q_len))
        return "strides of q, k, v and o must be positive multiples of 8 elements";
    return nullptr;
}

forward_split_needs forward_split_plan(const forward_args& a, bool dynamic) {
    if (a.head_dim != 64 && a.head_dim != 128) return {0, 0};
    const split_choice s = choose_split(a, dynamic);
    return {s.scratch_floats, s.counts};
}

cudaError_t launch_forward(const forward_args& a, cudaStream_t stream) {
    if (forward_unsupported(a) != nullptr) return cudaErrorInvalidValue;
    const bool bf16 = a.dtype == int(dtype::bf16);
    constexpr int C64 = consumers_for(64), C128 = consumers_for(128), C256 = consumers_for(256);
    if (a.head_dim == 64) return bf16 ? launch<__nv_bfloat16, 64, C64>(a, stream) : launch<__half, 64, C64>(a, stream);
    if (a.head_dim == 128)
        return bf16 ? launch<__nv_bfloat16, 128, C128>(a, stream) : launch<__half, 128, C128>(a, stream);
    return bf16 ? launch<__nv_bfloat16, 256, C256>(a, stream) : launch<__half, 256, C256>(a, stream);
}

}  // namespace tk::attention
