// Persistent, warp-specialised Hopper GEMM: one producer warpgroup per block streams A and B tiles with TMA into
// a 4-stage shared-memory ring (optionally in clusters of two blocks that share B); two consumer warpgroups each
// multiply a 64 x 256 slice of the 128 x 256 output tile with wgmma and write it out (bias fused). Operand majors
// are template parameters, so the three products of a linear layer (X Wt, dY W, dYt X) read their operands in
// place, with no transposed copies.
//
// Where a block takes many tiles, a consumer warpgroup ends each by rounding it into its own shared staging and
// handing that to a store warp of the producer warpgroup, which issues the TMA stores and waits for them to read
// the staging; the consumers go straight on to their next tile. (Consumers that stored their tiles themselves ran
// the lm_head-shaped 8192 x 2048 x 128256 product at 618 TFLOP/s, 711 with no epilogue at all: benchmarks/NOTES.md.)
// The whole tile's staging leaves room for three stages instead of four, which costs more than the hidden
// epilogues gain where a block takes only a few tiles: there the consumers store their own rows.
//
// On request, a stream-K tail (schedule::split_tail): the grid's last, part-filled wave cut into k-block ranges,
// partial sums handed between blocks through a global workspace.
//
// Ping-pong variant: the consumers take 128 x 128 tiles of their own in turns (the ring's tiles alternate between
// them), so one writes its tile out while the other's products keep the tensor cores busy.
//
// SwiGLU variant (GATED): a block's B tile is 128 columns of B above the same 128 of B2, so the consumers' 64 x 256
// accumulators hold both products of 128 output columns; the store warp writes both, then silu(C) * C2 over C's half
// of the staging (one pass in shared memory, where the unfused step re-read both products from memory).
//
// SwiGLU's backward variant (GATE_GRAD): dg = A B, the gradient of g = silu(h1) * h2, is never written; the store
// warp loads a tile's h1 and h2 by TMA into shared memory while its products run, the consumers write
// dh1 = dg h2 silu'(h1) and dh2 = dg silu(h1) over them from their fp32 accumulators, and the store warp stores
// those (the unfused step wrote dg and read dg, h1 and h2 back). 128-wide tiles with five stages; by default the
// consumers take whole tiles in turns (ping-pong), one staging of a tile's h1 and h2 serving both by turns, so that
// one's epilogue runs under the other's products.
//
// A summed second product (gemm_args.sum_a): C = A B + A2 B2, the producer streaming A2's and B2's k-blocks after
// A's and B's into the same accumulators, so a layer's two input gradients that meet in a sum (LLaMA's MLP: dX of
// both up-projections) come out of one launch, added in fp32 and rounded once, the first never written.
//
// Rotary variant (ROPE): a fused qkv projection's output with LitGPT's rotate-half rope applied to q's and k's heads
// in the consumers' registers before the tile is stored: wgmma gives each thread columns c and c + h of its rows in
// fragments j and j + h / 8, so a head's pairs never leave the thread. Attention then reads q, k and v as strided
// views of the output; the fuser's pass that split, rotated and copied them (and its reads and writes of the whole
// projection) goes.
#include "gemm.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>
#include <atomic>
#include <type_traits>

namespace tk::gemm {
namespace {

using wgmma::major;

constexpr int BM = 128, BK = 64;
// Tile widths: 256 by default; 128 where 256-wide tiles would leave much of the last wave of the persistent grid
// idle (e.g. a 3072 x 2048 weight gradient: 192 tiles of 128 x 256 are 1.45 waves on 132 SMs, 384 of 128 x 128
// are 2.9). The narrower tile's stages are half as large, so it keeps more of them in flight.
// STORE_WARPS: the epilogue by store warps from a whole tile's staging (256-wide tiles only), which leaves room
// for three stages.
constexpr int stages_of(int tn, bool store_warps) { return tn == 256 ? (store_warps ? 3 : 4) : 6; }
// What a launch computes besides C = A B (+ bias): SwiGLU's forward (two products and the gate, in the store warps'
// epilogue), its backward (dh1 and dh2 from dg's accumulators, in the consumers' epilogue), or the rotary
// embedding of q's and k's heads (in the consumers' registers).
enum class fused { none, swiglu, swiglu_grad, rope };
// With clusters of C = 2 blocks, the blocks share their B tile: block r loads rows [128 r, 128 r + 128) of it
// and the copy engine writes them into both blocks' shared memory (halving L2 -> SM traffic for B).
// C = 1 is the plain persistent kernel.
constexpr int CONSUMERS = 2, THREADS = (CONSUMERS + 1) * warpgroup::threads;
constexpr int GROUP_ROWS = 8;  // default tile rows per L2 group of the persistent schedule
constexpr int PRODUCER_REGISTERS = 40, CONSUMER_REGISTERS = 232;
static_assert(warpgroup::register_split_fits(1, PRODUCER_REGISTERS, CONSUMERS, CONSUMER_REGISTERS));
// Named barriers. 0 is __syncthreads; 1 + wg a consumer warpgroup's own; the ping-pong turns 3 and 4.
namespace barrier_id {
__host__ __device__ constexpr int warpgroup(int wg) { return 1 + wg; }
__host__ __device__ constexpr int turn(int wg) { return 1 + CONSUMERS + wg; }
}  // namespace barrier_id

// SwiGLU's backward: h2's 64 x 128 block per consumer warpgroup as two swizzled 64 x 64 panels (h1's lies in the
// warpgroup's output staging; dh1 and dh2 are written over them and stored from there), and the barrier of their
// TMA loads. Ping-pong: the two warpgroups' blocks are the two 64-row halves of one whole tile, used by turns
// (each warpgroup's tiles through its own barriers). With it, five stages fit: 128-wide tiles take a third more
// operand bytes per product than 256-wide ones, so the ring must run further ahead than the plain kernel's four.
template <typename T, bool On>
struct gate_grad_staging {};
template <typename T>
struct gate_grad_staging<T, true> {
    alignas(1024) T h2[CONSUMERS][2][64 * 64];
    sync::barrier h_full[CONSUMERS];
};

template <typename T, major MA, major MB, int TileN, bool StoreWarps, fused F = fused::none>
struct shared_state {
    static constexpr int BN = TileN;
    static constexpr bool STORE_WARPS = StoreWarps;
    static constexpr int STAGES = F == fused::swiglu_grad ? 5 : stages_of(BN, STORE_WARPS);
    wgmma::operand_tile<T, BM, MA> a[STAGES];
    wgmma::operand_tile<T, BN, MB> b[STAGES];
    // Output staging for the TMA-store epilogue, per consumer warpgroup, as swizzled 64 x 64 panels: its 64 x BN
    // rows of the tile for the store warps; 64 x 128 at a time where the consumers store their own rows.
    alignas(1024) T c_stage[CONSUMERS][STORE_WARPS ? BN / 64 : 2][64 * 64];
    // The staged rows' first row and column (row -1: no more tiles), from a consumer warpgroup to its store warp,
    // and the hand-over: c_staged (every consumer thread arrives once its part is staged) and c_free (the store
    // warp arrives once its stores have read the staging). mbarriers rather than named barriers, so that
    // racecheck sees c_origin handed over.
    int c_origin[CONSUMERS][2];
    sync::barrier c_staged[CONSUMERS], c_free[CONSUMERS];
    pipeline::ring<STAGES> ring;  // full: TMA bytes landed; empty: every consumer warp (of the cluster) is done
    // Dynamic schedule: the tile (index into the schedule) whose first k-block a stage holds, written by the
    // producer before it arms the stage's `full` barrier; -1: no more tiles.
    int tile_at[STAGES];
    gate_grad_staging<T, F == fused::swiglu_grad> gate_grad;
    static constexpr uint32_t stage_bytes = (BM + BN) * BK * sizeof(T);
};

struct kernel_params {
    gemm_args args;
    schedule::grouped_order order;
    schedule::split_tail split;  // static schedule: whole tiles round robin, then the stream-K tail (if any)
    int k_blocks;        // k-blocks of a tile, of both products where a second is summed
    int first_k_blocks;  // those of the first product (A, B); the rest are the second's (A2, B2)
    bool tma_store;  // C rows 16-byte aligned: stage the epilogue in shared memory and store with TMA
    int* tickets;    // dynamic schedule counter, or null (static: p.split)
};

// The maps beyond A, B and C (unused, zeroed, elsewhere): SwiGLU's forward B2, C2 and C3; its backward C2 (dh2), H1
// and H2; a summed second product's A2 and B2 (B2 with that product's own box).
struct extra_maps {
    CUtensorMap a2, b2, c2, c3, h1, h2;
};

// Stream-K workspace: per block slot, per consumer warpgroup, its fp32 accumulators in fragment order (each
// thread's values as float4s 128 threads apart, so a warp's store or load is 512 contiguous bytes); sized for
// 256-wide tiles. One flag per slot and warpgroup: 1 once the partial sums are there, 0 again once added.
constexpr int SLOT_FLOATS = CONSUMERS * 64 * 256;

__device__ __forceinline__ float4* partial_slot(const kernel_params& p, int slot, int wg) {
    return reinterpret_cast<float4*>(p.args.partials + int64_t(slot) * SLOT_FLOATS + wg * 64 * 256) +
           warpgroup::thread();
}

// A consumer warpgroup's partial sums of a tile into its block's slot, then its flag raised (release at gpu scope,
// after every thread's stores: each fences, the warpgroup meets, one thread raises the flag).
template <int BN>
__device__ __forceinline__ void put_partial(const kernel_params& p, int block, int wg, const float (&d)[BN / 2]) {
    float4* to = partial_slot(p, block, wg);
#pragma unroll
    for (int v = 0; v < BN / 8; ++v)
        __stcg(to + v * warpgroup::threads, make_float4(d[4 * v], d[4 * v + 1], d[4 * v + 2], d[4 * v + 3]));
    __threadfence();
    sync::named_sync(barrier_id::warpgroup(wg), warpgroup::threads);
    if (warpgroup::thread() == 0) sync::flag_release(p.args.flags + block * CONSUMERS + wg, 1);
}

// The finisher's side: waits for the flags of blocks [from, block) (one thread, acquire at gpu scope; it lowers
// them for the next launch), then the warpgroup adds their partial sums, in block order (deterministic).
template <int BN>
__device__ __forceinline__ void take_partials(const kernel_params& p, int from, int block, int wg, float (&d)[BN / 2]) {
    if (warpgroup::thread() == 0) {
        for (int c = from; c < block; ++c) {
            int* flag = p.args.flags + c * CONSUMERS + wg;
            while (sync::flag_acquire(flag) == 0) {
            }
            *flag = 0;
        }
    }
    sync::named_sync(barrier_id::warpgroup(wg), warpgroup::threads);
    for (int c = from; c < block; ++c) {
        const float4* at = partial_slot(p, c, wg);
#pragma unroll
        for (int v = 0; v < BN / 8; ++v) {
            const float4 x = __ldcg(at + v * warpgroup::threads);
            d[4 * v] += x.x;
            d[4 * v + 1] += x.y;
            d[4 * v + 2] += x.z;
            d[4 * v + 3] += x.w;
        }
    }
}

template <typename T>
__device__ __forceinline__ void store_pair(T* p, float x, float y, bool vector) {
    if constexpr (std::is_same_v<T, float>) {
        if (vector) {
            *reinterpret_cast<float2*>(p) = make_float2(x, y);
            return;
        }
    } else if constexpr (sizeof(T) == 2) {
        if (vector) {
            if constexpr (std::is_same_v<T, __nv_bfloat16>)
                *reinterpret_cast<__nv_bfloat162*>(p) = __floats2bfloat162_rn(x, y);
            else
                *reinterpret_cast<__half2*>(p) = __floats2half2_rn(x, y);
            return;
        }
    }
    p[0] = T(x);
    p[1] = T(y);
}

// A rounded pair of output columns gc and gc + 1 plus their bias, where they lie below n (the tile's tail).
template <typename T>
__device__ __forceinline__ float2 plus_bias(const T* __restrict__ bias, int64_t gc, int64_t n, float x, float y) {
    if (bias != nullptr) {
        if (gc < n) x += to_float(bias[gc]);
        if (gc + 1 < n) y += to_float(bias[gc + 1]);
    }
    return make_float2(x, y);
}

// The angle tables' values as the epilogue loads them: a pair of adjacent columns at a time, packed as they are in
// memory (16-bit tables: one 32-bit word; fp32 tables, bf16-mixed training's: a float2), and value `second` (0 or
// 1) of a pair as a float (bf16: its bits are a float's top half).
template <typename A>
struct angle_pair {
    using type = uint32_t;
    static __device__ __forceinline__ float value(type pair, int second) {
        if constexpr (std::is_same_v<A, __nv_bfloat16>)
            return __uint_as_float(second ? pair & 0xffff0000u : pair << 16);
        else
            return __half2float(__ushort_as_half(static_cast<unsigned short>(second ? pair >> 16 : pair & 0xffffu)));
    }
};
template <>
struct angle_pair<float> {
    using type = float2;
    static __device__ __forceinline__ float value(type pair, int second) { return second ? pair.y : pair.x; }
};

// The rotary embedding over a consumer warpgroup's 64 x BN block of accumulators (first row row0, column col0 a
// multiple of BN, hence of D): heads of D columns, the first 2 h = 16 H8 of each turned. A thread holds columns
// 8 j + 2 (lane % 4) + {0, 1} of rows lane / 4 and lane / 4 + 8 (of its warp's 16) in fragment j, so column c's
// partner c + h is in fragment j + H8 of the same thread. Each head of the block uses the same table columns at
// the same positions: a thread loads them once per first-half fragment (packed, as they are in memory: unpacked
// up front they took the 256-wide tiles' consumers past their registers) and turns every head of q and k with them.
// A: the tables' element type (T, or float).
template <typename A, int BN, int D, int H8>
__device__ __forceinline__ void rope_block(const gemm_args& g, float (&d)[BN / 2], int row0, int col0) {
    static_assert(BN % D == 0 && 16 * H8 <= D, "whole heads in the block, the turned columns within the head");
    using pair = angle_pair<A>;
    constexpr int HEADS = BN / D, HEAD_FRAGMENTS = D / 8, HALF = 8 * H8;
    const int lane = threadIdx.x & 31, warp = (threadIdx.x / 32) & 3;
    const uint32_t top = uint32_t(row0 + warp * 16 + lane / 4), seq = uint32_t(g.rope_seq);
    const auto* cos = static_cast<const typename pair::type*>(g.rope_cos);
    const auto* sin = static_cast<const typename pair::type*>(g.rope_sin);
    // The two rows' positions, in packed pairs (rows past M have positions too: their values are never stored);
    // 32-bit offsets (rope_unsupported bounds the tables), which keeps the 256-wide tiles' consumers from spilling.
    const uint32_t row_pairs = uint32_t(g.rope_stride / 2);
    const uint32_t at[2] = {(top % seq) * row_pairs, ((top + 8) % seq) * row_pairs};
#pragma unroll
    for (int jj = 0; jj < H8; ++jj) {
        const int a = (jj * 8 + 2 * (lane & 3)) / 2;  // the pair of angle columns of this thread's two values
        typename pair::type c1[2], s1[2], c2[2], s2[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            c1[r] = __ldg(cos + at[r] + a);
            s1[r] = __ldg(sin + at[r] + a);
            c2[r] = __ldg(cos + at[r] + a + HALF / 2);
            s2[r] = __ldg(sin + at[r] + a + HALF / 2);
        }
#pragma unroll
        for (int head = 0; head < HEADS; ++head) {
            if (col0 + head * D >= g.rope_cols) break;  // v's heads: as they are
            const int j = head * HEAD_FRAGMENTS + jj;
#pragma unroll
            for (int e = 0; e < 4; ++e) {  // (row, column) = (e / 2, e % 2) of the fragment
                const int r = e >> 1, second = e & 1;
                const float x1 = d[4 * j + e], x2 = d[4 * (j + H8) + e];
                d[4 * j + e] = x1 * pair::value(c1[r], second) - x2 * pair::value(s1[r], second);
                d[4 * (j + H8) + e] = x2 * pair::value(c2[r], second) + x1 * pair::value(s2[r], second);
            }
        }
    }
}

// rope_block for the launch's head width and turned columns (gemm_unsupported admits only these), tables of A.
template <typename A, int BN>
__device__ __forceinline__ void rope_rows64_of(const gemm_args& g, float (&d)[BN / 2], int row0, int col0) {
    const int h8 = g.rope_dims / 16;
    switch (g.rope_head_dim) {
        case 64:
            if (h8 == 1) rope_block<A, BN, 64, 1>(g, d, row0, col0);
            else if (h8 == 2) rope_block<A, BN, 64, 2>(g, d, row0, col0);
            else rope_block<A, BN, 64, 4>(g, d, row0, col0);
            break;
        case 128:
            if (h8 == 1) rope_block<A, BN, 128, 1>(g, d, row0, col0);
            else if (h8 == 2) rope_block<A, BN, 128, 2>(g, d, row0, col0);
            else if (h8 == 4) rope_block<A, BN, 128, 4>(g, d, row0, col0);
            else rope_block<A, BN, 128, 8>(g, d, row0, col0);
            break;
        default:
            if constexpr (BN == 256) {
                if (h8 == 1) rope_block<A, BN, 256, 1>(g, d, row0, col0);
                else if (h8 == 2) rope_block<A, BN, 256, 2>(g, d, row0, col0);
                else if (h8 == 4) rope_block<A, BN, 256, 4>(g, d, row0, col0);
                else if (h8 == 8) rope_block<A, BN, 256, 8>(g, d, row0, col0);
                else rope_block<A, BN, 256, 16>(g, d, row0, col0);
            }
    }
}

template <typename T, int BN>
__device__ __forceinline__ void rope_rows64(const gemm_args& g, float (&d)[BN / 2], int row0, int col0) {
    if (col0 >= g.rope_cols) return;  // a block of v's columns
    // fp32 tables with bf16 only (bf16-mixed training): with fp16 the 256-wide tiles' consumers spill (24 bytes).
    if constexpr (std::is_same_v<T, __nv_bfloat16>) {
        if (g.rope_fp32) {
            rope_rows64_of<float, BN>(g, d, row0, col0);
            return;
        }
    }
    rope_rows64_of<T, BN>(g, d, row0, col0);
}

// fp32 output (O = float) through the warpgroup's staging: its two 64 x 64 16-bit panels hold two 64 x 32 fp32
// ones (128-byte rows either way, in the 128-byte swizzle), used in turns, a TMA store each. A panel is rewritten
// once the store of the one before it (the other panel) is all that may still read: the warpgroup meets once per
// panel, not once per pair of them. Each thread writes its pairs as 8-byte stores, a half-warp's 4 rows x 32 bytes
// at a time. Under the swizzle rows r and r ^ 1 put a column block in the same two 16-byte chunks, so in each store
// the odd rows write the block two further on (16 columns): the half-warp's rows then cover all 32 banks once.
template <int COLS, typename State, typename Pair>
__device__ __forceinline__ void write_rows64_fp32(State& st, const gemm_args& g, const CUtensorMap& map_c, int wg,
                                                  const float (&d)[COLS / 2], int64_t row0, int64_t col0, Pair pair) {
    const bool leader = warpgroup::thread() == 0;
    const int own_barrier = barrier_id::warpgroup(wg);
#pragma unroll
    for (int panel = 0; panel < COLS / 32; ++panel) {
        uint8_t* stage = reinterpret_cast<uint8_t*>(st.c_stage[wg][panel % 2]);
        if (leader) tma::store_wait_read<1>();  // this panel's last store (two back) has read it
        sync::named_sync(own_barrier, warpgroup::threads);
        const bool odd_row = (threadIdx.x >> 2) & 1;
#pragma unroll
        for (int i = panel * 16; i < panel * 16 + 16; i += 2) {  // fragment columns [32 panel, 32 panel + 32)
            const int partner = i ^ 8;  // the same row's pair 16 columns on, in this panel
            const int f = odd_row ? partner : i;
            const float x = odd_row ? d[partner] : d[i], y = odd_row ? d[partner + 1] : d[i + 1];
            const auto pos = wgmma::accumulator_position(f);
            // the 128-byte swizzle's offset, which that helper takes in 16-bit columns: two per fp32 column
            const uint32_t at = tma::swizzled_offset_128b(pos.row, 2 * (pos.col % 32));
            *reinterpret_cast<float2*>(stage + at) = pair(f, x, y);
        }
        tma::fence_shared_to_async();
        sync::named_sync(own_barrier, warpgroup::threads);
        if (leader) {
            const int64_t gc = col0 + panel * 32;
            if (gc < g.N && row0 < g.M) tma::store_2d(&map_c, st.c_stage[wg][panel % 2], int32_t(gc), int32_t(row0));
            tma::store_commit();
        }
    }
}

// A consumer warpgroup's 64 x COLS block of output (accumulator fragment d; first row row0, first column col0),
// plus bias, to C (elements O: T, or fp32): 128 columns at a time through the warpgroup's swizzled staging and TMA
// stores (fp32: 32 at a time, write_rows64_fp32), which run on while the warpgroup goes on; or, where C's rows are
// not 16-byte aligned, straight from registers.
template <typename T, typename O, int COLS, typename State>
__device__ __forceinline__ void write_rows64(State& st, const kernel_params& p, const CUtensorMap& map_c, int wg,
                                             const float (&d)[COLS / 2], int64_t row0, int64_t col0) {
    const gemm_args& g = p.args;
    const T* __restrict__ bias = static_cast<const T*>(g.bias);
    const bool leader = warpgroup::thread() == 0;
    const int own_barrier = barrier_id::warpgroup(wg);
    if constexpr (std::is_same_v<O, float>) {
        if (p.tma_store) {
            if (bias == nullptr)  // one branch for the block, as below
                write_rows64_fp32<COLS>(st, g, map_c, wg, d, row0, col0, rt::as_is{});
            else
                write_rows64_fp32<COLS>(st, g, map_c, wg, d, row0, col0, [&](int i, float x, float y) {
                    return plus_bias(bias, col0 + wgmma::accumulator_position(i).col, g.N, x, y);
                });
            return;
        }
    } else if (p.tma_store) {
#pragma unroll
        for (int half = 0; half < COLS / 128; ++half) {
            if (leader) tma::store_wait_read();
            sync::named_sync(own_barrier, warpgroup::threads);
            uint8_t* stage = reinterpret_cast<uint8_t*>(st.c_stage[wg]);  // this half's two panels
            auto panel = [&](int col) { return stage + ((col % 128) / 64) * 64 * 128; };
            // One branch on the bias for the whole half: tested per column pair it cost a branch and copies per
            // pair where there is none (the linears of LitGPT's models).
            if (bias == nullptr)
                rt::store_swizzled<T, 128, COLS>(d, half * 128, 0, panel);
            else
                rt::store_swizzled<T, 128, COLS>(d, half * 128, 0, panel, [&](int i, float x, float y) {
                    return plus_bias(bias, col0 + wgmma::accumulator_position(i).col, g.N, x, y);
                });
            tma::fence_shared_to_async();
            sync::named_sync(own_barrier, warpgroup::threads);
            if (leader) {
                for (int panel = 0; panel < 2; ++panel) {
                    const int64_t gc = col0 + half * 128 + panel * 64;
                    if (gc < g.N && row0 < g.M)
                        tma::store_2d(&map_c, st.c_stage[wg][panel], int32_t(gc), int32_t(row0));
                }
                tma::store_commit();
            }
        }
        return;
    }
    O* __restrict__ c = static_cast<O*>(g.c);
    const bool vector_store = (g.c_stride_m % 2 == 0) && (reinterpret_cast<uintptr_t>(g.c) % (2 * sizeof(O)) == 0);
#pragma unroll
    for (int i = 0; i < COLS / 2; i += 2) {
        const auto pos = wgmma::accumulator_position(i);
        const int64_t row = row0 + pos.row, col = col0 + pos.col;
        if (row >= g.M || col >= g.N) continue;
        float x = d[i], y = d[i + 1];
        const bool pair = col + 1 < g.N;
        if (bias != nullptr) {
            x += to_float(bias[col]);
            if (pair) y += to_float(bias[col + 1]);
        }
        O* out = c + row * g.c_stride_m + col;
        if (pair)
            store_pair(out, x, y, vector_store);
        else
            out[0] = O(x);
    }
}

// A consumer warpgroup's staged block (first row row0, column col0) to its store warp: the origin, the staging's
// writes made visible to TMA, and the warpgroup's arrival. `handoffs`: how many it has made (the barriers' phase).
template <typename State>
__device__ __forceinline__ void hand_over_staged(State& st, int wg, int row0, int col0, uint32_t& handoffs) {
    if (warpgroup::thread() == 0) {
        st.c_origin[wg][0] = row0;
        st.c_origin[wg][1] = col0;
    }
    tma::fence_shared_to_async();
    sync::arrive(st.c_staged[wg]);
    ++handoffs;
}

// A consumer warpgroup's 64 x BN rows of a tile (first row row0, column col0), plus bias, rounded into its staging
// for its store warp (store_staged_tiles); waits first for the store warp to be done with the previous tile's.
// `handoffs`: how many this warpgroup has made (the barriers' phase).
template <typename T, int BN, typename State>
__device__ __forceinline__ void stage_rows64(State& st, const kernel_params& p, int wg, const float (&d)[BN / 2],
                                             int row0, int col0, uint32_t& handoffs) {
    const T* __restrict__ bias = static_cast<const T*>(p.args.bias);
    const int64_t n = p.args.N;
    sync::wait(st.c_free[wg], handoffs & 1);
    uint8_t* stage = reinterpret_cast<uint8_t*>(st.c_stage[wg]);
    auto panel = [&](int col) { return stage + (col / 64) * 64 * 128; };
    if (bias == nullptr) {  // one branch for the tile (write_rows64)
        rt::store_swizzled<T, BN, BN>(d, 0, 0, panel);
    } else {
        // The pointer laundered, so that the compiler keeps the per-pair tests of plus_bias: knowing it non-null,
        // it issued all 256 columns' bias loads together and the kernel spilled.
        const T* laundered = bias;
        asm volatile("" : "+l"(laundered));
        rt::store_swizzled<T, BN, BN>(d, 0, 0, panel, [&](int i, float x, float y) {
            return plus_bias(laundered, col0 + wgmma::accumulator_position(i).col, n, x, y);
        });
    }
    hand_over_staged(st, wg, row0, col0, handoffs);
}

// After a consumer warpgroup's last tile: tells its store warp that no more come.
template <typename State>
__device__ __forceinline__ void stage_end(State& st, int wg, uint32_t handoffs) {
    sync::wait(st.c_free[wg], handoffs & 1);
    if (warpgroup::thread() == 0) st.c_origin[wg][0] = -1;
    sync::arrive(st.c_staged[wg]);
}

// Lane 0 of a store warp of the producer warpgroup: consumer warpgroup wg's staged rows out by TMA stores, once
// each is staged; the staging is handed back once the stores have read it.
template <typename State>
__device__ __forceinline__ void store_staged_tiles(State& st, const kernel_params& p, const CUtensorMap& map_c,
                                                   int wg) {
    sync::arrive(st.c_free[wg]);  // the staging starts out free
    for (uint32_t k = 0;; ++k) {
        sync::wait(st.c_staged[wg], k & 1);
        const int row0 = st.c_origin[wg][0], col0 = st.c_origin[wg][1];
        if (row0 < 0) break;
#pragma unroll
        for (int panel = 0; panel < State::BN / 64; ++panel) {
            const int gc = col0 + panel * 64;
            if (gc < p.args.N && row0 < p.args.M) tma::store_2d(&map_c, st.c_stage[wg][panel], gc, row0);
        }
        tma::store_commit();
        tma::store_wait_read();
        sync::arrive(st.c_free[wg]);
    }
}

// silu(c) * c2 for a packed pair of each, rounded as PyTorch rounds the two ops in 16 bits (silu's result first).
// The fast exponential and reciprocal: an IEEE division made every element a serial chain with a slow-path call
// (ptxas interleaved none of them), which kept the store warp busy for longer than a tile's products at K = 2048.
// For v -> -inf, 1 + e^-v overflows to inf and v / inf gives -0, the limit.
template <typename T>
__device__ __forceinline__ uint32_t gate_pair(uint32_t c, uint32_t c2) {
    T x[2], y[2], out[2];
    memcpy(x, &c, 4);
    memcpy(y, &c2, 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float v = to_float(x[i]);
        const float silu = to_float(T(__fdividef(v, 1.0f + __expf(-v))));
        out[i] = T(silu * to_float(y[i]));
    }
    uint32_t r;
    memcpy(&r, out, 4);
    return r;
}

// One warp: C3 = silu(C) * C2 over C's two staged 64 x 64 panels, from C2's two. Both halves were staged with the
// same swizzle within a panel, so the pairs sit at the same offsets; each lane takes every 32nd 16-byte chunk, two
// at a time (more would not fit the producer warpgroup's 40 registers).
template <typename T>
__device__ __forceinline__ void gate_staged_panels(T* c, const T* c2) {
    uint4* out = reinterpret_cast<uint4*>(c);
    const uint4* other = reinterpret_cast<const uint4*>(c2);
#pragma unroll 2
    for (int i = threadIdx.x & 31; i < 2 * 64 * 64 * int(sizeof(T)) / 16; i += 32) {
        uint4 a = out[i];
        const uint4 b = other[i];
        a.x = gate_pair<T>(a.x, b.x);
        a.y = gate_pair<T>(a.y, b.y);
        a.z = gate_pair<T>(a.z, b.z);
        a.w = gate_pair<T>(a.w, b.w);
        out[i] = a;
    }
}

// A SwiGLU store warp's receipt of consumer warpgroup wg's k-th staged block: every lane waits for it, lane 0 reads
// its origin and passes it on (racecheck flagged the other lanes' reads of it, which only the warp's convergence
// ordered before a single arrival). False once the warpgroup has no more tiles.
template <typename State>
__device__ __forceinline__ bool receive_staged(State& st, int wg, uint32_t k, int& row0, int& col0) {
    const bool leader = (threadIdx.x & 31) == 0;
    sync::wait(st.c_staged[wg], k & 1);
    row0 = __shfl_sync(0xffffffffu, leader ? st.c_origin[wg][0] : 0, 0);
    col0 = __shfl_sync(0xffffffffu, leader ? st.c_origin[wg][1] : 0, 0);
    return row0 >= 0;
}

// A store warp (all its lanes) of a SwiGLU launch, for consumer warpgroup wg: each staged 64 x 256 block is C's 128
// columns (panels 0-1) and C2's (2-3). Lane 0 stores C's panels, then C2's, as two groups; once the first group has
// read its panels the lanes write C3 over them, which lane 0 stores too before the staging is handed back.
// Every lane touches the staging, so every lane hands it back (c_free counts 32 arrivals here), after lane 0's
// last stores have read it.
template <typename T, typename State>
__device__ __forceinline__ void store_staged_gated(State& st, const kernel_params& p, const CUtensorMap& map_c,
                                                   const extra_maps& gm, int wg) {
    const bool leader = (threadIdx.x & 31) == 0;
    sync::arrive(st.c_free[wg]);  // the staging starts out free
    for (uint32_t k = 0;; ++k) {
        int row0, col0;
        if (!receive_staged(st, wg, k, row0, col0)) break;
        if (leader) {
#pragma unroll
            for (int product = 0; product < 2; ++product) {
#pragma unroll
                for (int panel = 0; panel < 2; ++panel) {
                    const int gc = col0 + panel * 64;
                    if (gc < p.args.N && row0 < p.args.M)
                        tma::store_2d(product == 0 ? &map_c : &gm.c2, st.c_stage[wg][2 * product + panel], gc, row0);
                }
                tma::store_commit();
            }
            tma::store_wait_read<1>();  // C's panels read; C2's may still be in flight
        }
        __syncwarp();
        gate_staged_panels<T>(st.c_stage[wg][0], st.c_stage[wg][2]);
        tma::fence_shared_to_async();
        __syncwarp();
        if (leader) {
#pragma unroll
            for (int panel = 0; panel < 2; ++panel) {
                const int gc = col0 + panel * 64;
                if (gc < p.args.N && row0 < p.args.M) tma::store_2d(&gm.c3, st.c_stage[wg][panel], gc, row0);
            }
            tma::store_commit();
            tma::store_wait_read();
        }
        __syncwarp();
        sync::arrive(st.c_free[wg]);
    }
    if (leader) tma::store_wait_read();  // staging outlives the reads; the grid's end flushes
}

// dh1 = dg h2 silu'(h1) and dh2 = dg silu(h1) for two adjacent columns: dg from the fp32 accumulators, h1 and h2
// packed 16-bit pairs, replaced by dh1's and dh2's; fp32 math with one rounding (silu'(x) = s (1 + x (1 - s)), s the
// logistic function; fast exponential and reciprocal as in gate_pair, with s -> 0 for x -> -inf).
template <typename T>
__device__ __forceinline__ void gate_grad_pair(float dg0, float dg1, uint32_t& h1_to_dh1, uint32_t& h2_to_dh2) {
    const float grad[2] = {dg0, dg1};
    T x[2], y[2], d1[2], d2[2];
    memcpy(x, &h1_to_dh1, 4);
    memcpy(y, &h2_to_dh2, 4);
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const float v = to_float(x[i]);
        const float s = __fdividef(1.0f, 1.0f + __expf(-v));
        d2[i] = T(grad[i] * v * s);
        d1[i] = T(grad[i] * to_float(y[i]) * (s + v * s * (1.0f - s)));
    }
    memcpy(&h1_to_dh1, d1, 4);
    memcpy(&h2_to_dh2, d2, 4);
}

// dh1 and dh2 over the staged h1 and h2 of 64 rows of a SwiGLU backward tile (staging half `half`), from those rows'
// dg in d: each 16-column slice of h1 and h2 read with ldmatrix and written back in place with stmatrix (each thread
// rewrites only what it read). The elementwise work runs in the consumer warps from the unrounded fp32 dg; done by
// one store warp per consumer from a staged bf16 dg, it held the staging for most of a tile's products
// (benchmarks/NOTES.md).
template <typename T, typename State>
__device__ __forceinline__ void gate_grad_in_place(State& st, int half, const float (&d)[64]) {
    uint8_t* h1 = reinterpret_cast<uint8_t*>(st.c_stage[half]);
    uint8_t* h2 = reinterpret_cast<uint8_t*>(st.gate_grad.h2[half]);
    rt::update_swizzled_pairs<128>(
        d, 0, [&](int col) { return h1 + (col / 64) * 64 * 128; }, [&](int col) { return h2 + (col / 64) * 64 * 128; },
        [](float dg0, float dg1, uint32_t& u, uint32_t& v) { gate_grad_pair<T>(dg0, dg1, u, v); });
}

// A consumer warpgroup's SwiGLU backward block (first row row0, column col0; its 64 rows of a shared tile, or a whole
// ping-pong tile): once its store warp has the previous block's origin and this block's h1 and h2 have landed in the
// staging (h1 where the plain kernel stages C, h2 beside it), `rewrite` writes dh1 and dh2 over them
// (gate_grad_in_place), and the block goes to the store warp. `handoffs`: the warpgroup's blocks so far.
template <typename State, typename Rewrite>
__device__ __forceinline__ void gate_grad_hand_over(State& st, int wg, int row0, int col0, uint32_t& handoffs,
                                                    Rewrite rewrite) {
    sync::wait(st.c_free[wg], handoffs & 1);
    sync::wait(st.gate_grad.h_full[wg], handoffs & 1);
    rewrite();
    hand_over_staged(st, wg, row0, col0, handoffs);
}

// Lane 0 of a store warp of a SwiGLU backward launch. Shared tiles (WHOLE_TILE false): one store warp per consumer
// warpgroup wg, for the warpgroup's 64 rows of each tile in its own staging. Ping-pong (WHOLE_TILE): the one store
// warp for both warpgroups, whose 128 x 128 tiles pass through one staging of both halves in the block's order; the
// block's i-th tile is warpgroup i % 2's, and its barriers are that warpgroup's (a parity wait tells two adjacent
// phases apart, no more: on barriers shared by both warpgroups a warpgroup could find one three phases from where it
// waited last, and a run hung so). Loads the h1 and h2 rows of the next tile (the static schedule's, which
// it walks as the consumers do) into the staging as soon as the stores of the tile before have read it, so that they
// land while the tile's products run; stores dh1 and dh2 once the consumers have written them there. c_free tells
// the consumers that the origin has been read.
template <bool WHOLE_TILE, typename State, typename TileOf>
__device__ __forceinline__ void store_gate_grad_tiles(State& st, const kernel_params& p, const CUtensorMap& map_c,
                                                      const extra_maps& gm, int wg, int cluster, int clusters,
                                                      TileOf tile_of) {
    static_assert(State::BN == 128, "two panels a tile");
    constexpr int HALVES = WHOLE_TILE ? 2 : 1;  // 64-row halves of the tile in the staging
    const int first_half = WHOLE_TILE ? 0 : wg;
    // The block's i-th tile's barriers (its consumer warpgroup's), and how many tiles that warpgroup had before it.
    auto channel = [&](uint32_t i) { return WHOLE_TILE ? int(i & 1) : wg; };
    auto uses = [&](uint32_t i) { return WHOLE_TILE ? i >> 1 : i; };
    auto& gg = st.gate_grad;
    auto load_tile = [&](uint32_t i) {  // the block's i-th tile's h1 and h2, if it has one
        const schedule::work w = p.split.item(cluster, clusters, int(i));
        if (w.tile < 0) return;
        const auto tile = tile_of(w.tile);
        const int row = tile.m * BM + first_half * 64, col = tile.n * State::BN;
        sync::barrier& full = gg.h_full[channel(i)];
        sync::arrive_expect_bytes(full, uint32_t(HALVES * (sizeof(st.c_stage[0]) + sizeof(gg.h2[0]))));
        for (int h = 0; h < HALVES; ++h)
            for (int panel = 0; panel < 2; ++panel) {
                tma::load_2d(st.c_stage[first_half + h][panel], &gm.h1, col + panel * 64, row + h * 64, full);
                tma::load_2d(gg.h2[first_half + h][panel], &gm.h2, col + panel * 64, row + h * 64, full);
            }
    };
    load_tile(0);
    for (int c = 0; c < (WHOLE_TILE ? 2 : 1); ++c) sync::arrive(st.c_free[channel(c)]);  // no origin to read yet
    for (uint32_t k = 0;; ++k) {
        const int ch = channel(k);
        sync::wait(st.c_staged[ch], uses(k) & 1);
        const int row0 = st.c_origin[ch][0], col0 = st.c_origin[ch][1];
        sync::arrive(st.c_free[ch]);
        if (row0 < 0) break;
        for (int h = 0; h < HALVES; ++h)
            for (int panel = 0; panel < 2; ++panel) {
                const int gc = col0 + panel * 64, gr = row0 + h * 64;
                if (gc < p.args.N && gr < p.args.M) {
                    tma::store_2d(&map_c, st.c_stage[first_half + h][panel], gc, gr);
                    tma::store_2d(&gm.c2, gg.h2[first_half + h][panel], gc, gr);
                }
            }
        tma::store_commit();
        tma::store_wait_read();
        load_tile(k + 1);
    }
}

// One tile's walk over the ring, keeping one wgmma group in flight: stage s is released once the group after it
// has been issued, the last once all are done. `first_waited`: the caller already waited for the first stage (it
// read the tile index there). `landed(kb)` runs once k-block kb's stage has landed, `issue(stage)` issues its
// products (one group), `settled()` once every product is done (pin the accumulators there).
template <int STAGES, typename State, typename Release, typename Landed, typename Issue, typename Settled>
__device__ __forceinline__ void walk_k_blocks(State& st, pipeline::cursor<STAGES>& at, int k_blocks, bool first_waited,
                                              Release release, Landed landed, Issue issue, Settled settled) {
    const bool warp_leader = (threadIdx.x & 31) == 0;
    int previous = -1;
    for (int kb = 0; kb < k_blocks; ++kb) {
        if (kb > 0 || !first_waited) st.ring.wait_full(at);
        landed(kb);
        wgmma::fence();
        issue(at.stage);
        wgmma::commit();
        wgmma::wait<1>();
        if (previous >= 0 && warp_leader) release(st.ring.empty[previous]);
        previous = at.stage;
        at.advance();
    }
    wgmma::wait<0>();
    settled();
    if (previous >= 0 && warp_leader) release(st.ring.empty[previous]);
}

// Consumer warpgroups: wgmma over the ring, then the epilogue of each tile.
template <typename T, typename O, major MA, major MB, int CLUSTER, int BN, fused F, typename State, typename TileOf>
__device__ __forceinline__ void consume(State& st, const kernel_params& p, const CUtensorMap& map_c, int cluster,
                                        int clusters, TileOf tile_of) {
    // A stage is free once every consumer warp of both blocks is done with it: the peer's producer writes
    // its share of B into our copy of the stage too.
    auto release = [](sync::barrier& b) {
        if constexpr (CLUSTER == 1) {
            sync::arrive(b);
        } else {
#pragma unroll
            for (uint32_t r = 0; r < CLUSTER; ++r) sync::arrive_cluster(b, r);
        }
    };
    warpgroup::increase_registers<CONSUMER_REGISTERS>();
    const int slice = warpgroup::uniform_index() - 1;  // rows [64 slice, 64 slice + 64) of the tile
    constexpr int STAGES = State::STAGES;
    pipeline::cursor<STAGES> at;
    float d[BN / 2];
    uint32_t handoffs = 0;  // tiles handed to the store warp

    const bool dynamic = p.tickets != nullptr;
    // Static: the block's next piece, worked out while the current tile's first products run (its divisions
    // sat between one tile's epilogue and the next tile's first wait).
    schedule::work next = dynamic ? schedule::work{} : p.split.item(cluster, clusters, 0);
    for (int i = 0;; ++i) {
        // Static: p.split's pieces. Dynamic: the producer names each tile in the stage that holds its first
        // k-block, and -1 when there are no more.
        schedule::work w;
        if (dynamic) {
            st.ring.wait_full(at);
            // Lane 0 alone reads the tile and hands it to its warp: it is the lane whose arrive frees the stage,
            // so the producer's next write of tile_at is ordered after every read of it (racecheck flagged the
            // other lanes' reads, ordered before that arrive only by the warp's convergence).
            const int t = __shfl_sync(0xffffffffu, (threadIdx.x & 31) == 0 ? st.tile_at[at.stage] : 0, 0);
            if (t < 0) break;
            w = {t, 0, p.k_blocks, cluster, false};
        } else {
            w = next;
            if (w.tile < 0) break;
        }
        schedule::tile_coord tile{};
        int kb = 0;
        const int k_blocks = w.k_end - w.k_begin;
        walk_k_blocks(
            st, at, k_blocks, dynamic, release,
            [&](int k) {
                kb = k;
                if (k == (k_blocks > 1 ? 1 : 0)) {
                    // The tile's coordinates (for the epilogue) and the next piece, while the first k-block's
                    // products run (outside a fence-commit window: code there makes ptxas serialise the wgmmas,
                    // C7519), pinned here, or the compiler would sink them to their uses after the walk.
                    tile = tile_of(w.tile);
                    if (!dynamic) next = p.split.item(cluster, clusters, i + 1);
                    int partial = next.partial;
                    asm volatile("" : "+r"(tile.m), "+r"(tile.n), "+r"(next.tile), "+r"(next.k_begin),
                                 "+r"(next.k_end), "+r"(next.contributors_from), "+r"(partial));
                    next.partial = partial != 0;
                }
            },
            [&](int stage) {
#pragma unroll
                for (int k16 = 0; k16 < BK / 16; ++k16)
                    wgmma::mma<BN, T>(d, st.a[stage], slice * 64, st.b[stage], 0, k16, (kb | k16) != 0);
            },
            [&] { wgmma::pin(d); });
        if (w.partial) {
            put_partial<BN>(p, cluster, slice, d);
            continue;
        }
        if (w.contributors_from < cluster) take_partials<BN>(p, w.contributors_from, cluster, slice, d);

        // A SwiGLU tile's 256 accumulator columns are 128 output columns of each product.
        constexpr bool GATED = F == fused::swiglu;
        const int64_t row0 = int64_t(tile.m) * BM + slice * 64, col0 = int64_t(tile.n) * (GATED ? BN / 2 : BN);
        if constexpr (F == fused::rope) rope_rows64<T, BN>(p.args, d, int(row0), int(col0));
        if constexpr (F == fused::swiglu_grad)
            gate_grad_hand_over(st, slice, int(row0), int(col0), handoffs,
                                [&] { gate_grad_in_place<T>(st, slice, d); });
        else if (GATED || (State::STORE_WARPS && p.tma_store))  // a SwiGLU launch always stores by TMA
            stage_rows64<T, BN>(st, p, slice, d, int(row0), int(col0), handoffs);
        else
            write_rows64<T, O, BN>(st, p, map_c, slice, d, row0, col0);
    }
    if (State::STORE_WARPS && p.tma_store)
        stage_end(st, slice, handoffs);
    else if (warpgroup::thread() == 0)
        tma::store_wait_read();  // staging outlives the reads; the grid's end flushes
}

// Ping-pong consumers: the ring's tiles (k_blocks stages each, in the producer's order) alternate between the two
// warpgroups, each multiplying a whole 128 x 128 tile (two 64-row halves sharing the B slice), so one's epilogue
// runs under the other's products. A warpgroup skips the other's k_blocks stages; since a parity wait cannot tell
// a stage's lap from two laps on, it may wait for its tile's first stage only once every earlier stage has
// landed: the warpgroups take turns, each handing the turn over (a named barrier) once it has seen its own last
// stage land. Dynamic schedule: the producer ends the stream with two markers, a -1 whose warpgroup drains the
// k_blocks stages of its slot (no bytes) and hands the turn over, and a -2 in the other's slot.
// SwiGLU's backward (static schedule): the tiles' h1 and h2 pass through one staging of the whole tile, in the
// block's order, so a warpgroup's epilogue waits for the other's tile before to be stored and its own inputs loaded
// (store_gate_grad_tiles<true>; each warpgroup hands over through barriers of its own, as with shared tiles); the
// warpgroup whose turn comes after the block's last tile tells the store warp.
template <typename T, major MA, major MB, fused F, typename State, typename TileOf>
__device__ __forceinline__ void consume_pingpong(State& st, const kernel_params& p, const CUtensorMap& map_c,
                                                 int tiles, int block, int blocks, TileOf tile_of) {
    static_assert(State::BN == 128, "ping-pong tiles are 128 x 128");
    warpgroup::increase_registers<CONSUMER_REGISTERS>();
    const int wg = warpgroup::uniform_index() - 1;
    const bool warp_leader = (threadIdx.x & 31) == 0;
    // Turn barriers: a warpgroup waits at its own (both warpgroups' threads), the other arrives there.
    const int my_turn = barrier_id::turn(wg), their_turn = barrier_id::turn(1 - wg);
    constexpr int STAGES = State::STAGES;
    pipeline::cursor<STAGES> at;
    at.skip(wg * p.k_blocks);  // warpgroup 1's first tile is the ring's second
    float d[2][64];            // rows [0, 64) and [64, 128) of the tile

    const bool dynamic = p.tickets != nullptr;
    for (int j = wg;; j += 2) {  // j: this tile's place in the block's stream
        int t = block + j * blocks;
        if (!dynamic && t >= tiles) {
            if constexpr (F == fused::swiglu_grad)
                if (j == 0 || t - blocks < tiles) stage_end(st, wg, uint32_t(j >> 1));  // the block's tiles are done
            break;
        }
        if (j > 0) sync::named_sync(my_turn, 2 * warpgroup::threads);
        // Static: the other warpgroup's next tile, if any, follows this one.
        bool hand_over = !dynamic && t + blocks < tiles;
        if (dynamic) {
            st.ring.wait_full(at);
            // Read by lane 0, the lane whose arrive frees the stage (see consume).
            t = __shfl_sync(0xffffffffu, warp_leader ? st.tile_at[at.stage] : 0, 0);
            if (t == -1) {  // drain this slot so that the producer can place the other warpgroup's marker
                for (int kb = 0; kb < p.k_blocks; ++kb) {
                    if (kb > 0) st.ring.wait_full(at);
                    if (warp_leader) sync::arrive(st.ring.empty[at.stage]);
                    at.advance();
                }
                sync::named_arrive(their_turn, 2 * warpgroup::threads);
                break;
            }
            if (t < 0) break;
            hand_over = true;  // the other warpgroup reads the next slot: a tile or a marker
        }
        const auto tile = tile_of(t);
        int kb = 0;
        walk_k_blocks(
            st, at, p.k_blocks, dynamic, [](sync::barrier& b) { sync::arrive(b); },
            [&](int k) {
                kb = k;
                if (k == p.k_blocks - 1 && hand_over) sync::named_arrive(their_turn, 2 * warpgroup::threads);
            },
            [&](int stage) {
#pragma unroll
                for (int k16 = 0; k16 < BK / 16; ++k16) {
                    wgmma::mma<128, T>(d[0], st.a[stage], 0, st.b[stage], 0, k16, (kb | k16) != 0);
                    wgmma::mma<128, T>(d[1], st.a[stage], 64, st.b[stage], 0, k16, (kb | k16) != 0);
                }
            },
            [&] {
                wgmma::pin(d[0]);
                wgmma::pin(d[1]);
            });
        at.skip(p.k_blocks);  // the other warpgroup's tile

        const int64_t row0 = int64_t(tile.m) * BM, col0 = int64_t(tile.n) * 128;
        if constexpr (F == fused::swiglu_grad) {
            uint32_t handoffs = uint32_t(j >> 1);  // this warpgroup's tiles before this one
            gate_grad_hand_over(st, wg, int(row0), int(col0), handoffs, [&] {
                gate_grad_in_place<T>(st, 0, d[0]);
                gate_grad_in_place<T>(st, 1, d[1]);
            });
        } else {
            write_rows64<T, T, 128>(st, p, map_c, wg, d[0], row0, col0);
            write_rows64<T, T, 128>(st, p, map_c, wg, d[1], row0 + 64, col0);
        }
    }
    if (warpgroup::thread() == 0) tma::store_wait_read();  // staging outlives the reads; the grid's end flushes
}

// PINGPONG: the consumers take 128 x 128 tiles in turns (BN = 128, no cluster); otherwise they share each tile.
template <typename T, major MA, major MB, int CLUSTER, int BN, bool PINGPONG, bool STORE_WARPS, fused F, typename O>
__global__ void __launch_bounds__(THREADS, 1)
    gemm_kernel(const __grid_constant__ CUtensorMap map_a, const __grid_constant__ CUtensorMap map_b,
                const __grid_constant__ CUtensorMap map_c, const __grid_constant__ extra_maps gm,
                const __grid_constant__ kernel_params p) {
    static_assert(!PINGPONG || (CLUSTER == 1 && BN == 128), "ping-pong: 128 x 128 tiles, no cluster");
    constexpr bool GATED = F == fused::swiglu, GATE_GRAD = F == fused::swiglu_grad;
    static_assert(!STORE_WARPS || GATE_GRAD || (BN == 256 && !PINGPONG), "store warps: 256-wide shared tiles");
    static_assert(!PINGPONG || F != fused::swiglu, "SwiGLU's forward shares its tiles");
    static_assert(!GATED || (STORE_WARPS && CLUSTER == 1 && MA == major::k && MB == major::k),
                  "SwiGLU: store warps, no cluster, both operands K-major");
    static_assert(!GATE_GRAD || (STORE_WARPS && CLUSTER == 1 && BN == 128 && MA == major::k),
                  "SwiGLU's backward: store warps, no cluster, 128-wide tiles, A K-major");
    static_assert(F != fused::rope || (!PINGPONG && CLUSTER == 1 && MA == major::k && MB == major::k),
                  "the rotary epilogue: shared tiles, no cluster, both operands K-major");
    static_assert(std::is_same_v<O, T> || (std::is_same_v<O, float> && F == fused::none && !PINGPONG &&
                                           !STORE_WARPS && CLUSTER == 1),
                  "fp32 output: the plain product, the consumers' epilogue, no cluster");
    using state_t = shared_state<T, MA, MB, BN, STORE_WARPS, F>;
    constexpr int STAGES = state_t::STAGES;
    extern __shared__ uint8_t raw_smem[];
    auto& st = aligned_shared<state_t>(raw_smem);

    if (threadIdx.x == 0) {
        // The producer fills; lane 0 of every consumer warp that reads a stage frees it: all of the cluster's,
        // or with ping-pong the four of the warpgroup whose tile it holds.
        st.ring.init(1, PINGPONG ? 4 : CLUSTER * CONSUMERS * 4);
        for (int wg = 0; wg < CONSUMERS; ++wg) {
            sync::init(st.c_staged[wg], warpgroup::threads);
            sync::init(st.c_free[wg], F == fused::swiglu ? 32 : 1);  // SwiGLU: every lane of the store warp
            if constexpr (GATE_GRAD) sync::init(st.gate_grad.h_full[wg], 1);
        }
        sync::fence_init();
        tma::prefetch_map(&map_a);
        tma::prefetch_map(&map_b);
        if (GATED || p.first_k_blocks < p.k_blocks) tma::prefetch_map(&gm.b2);
        if (p.first_k_blocks < p.k_blocks) tma::prefetch_map(&gm.a2);
        if constexpr (GATE_GRAD) {
            tma::prefetch_map(&gm.h1);
            tma::prefetch_map(&gm.h2);
        }
    }
    if constexpr (CLUSTER == 1)
        __syncthreads();
    else
        sync::cluster_sync();
    // Set up under the previous kernel's tail (dependent launch); from here on global memory.
    pdl::start();

    // Work comes in pairs of vertically adjacent tiles, one pair per cluster; this block takes row `rank`.
    const uint32_t rank = CLUSTER == 1 ? 0 : sync::cluster_rank();
    const int pairs = p.order.count();
    const int cluster = CLUSTER == 1 ? int(blockIdx.x) : int(sync::cluster_id());
    const int clusters = CLUSTER == 1 ? int(gridDim.x) : int(sync::cluster_count());
    auto tile_of = [&](int t) {
        auto pair = p.order(t);
        return schedule::tile_coord{pair.m * CLUSTER + int(rank), pair.n};
    };
    if (warpgroup::index() == 0) {
        // ---------------- producer ----------------
        warpgroup::decrease_registers<PRODUCER_REGISTERS>();
        if (threadIdx.x == 0) {
            pipeline::cursor<STAGES> at;
            // Dynamic: every block takes tickets until one is past the end, so a launch hands out exactly
            // pairs + grid tickets, and the holder of the last one resets the counter for the next launch.
            auto next_ticket = [&] {
                const int ticket = atomicAdd(p.tickets, 1);
                if (ticket == pairs + int(gridDim.x) - 1) atomicExch(p.tickets, 0);
                return ticket;
            };
            // k-blocks [k_begin, k_end) of tile t (its index in the order) into the ring.
            auto load_tile = [&](int t, int k_begin, int k_end) {
                const auto tile = tile_of(t);
                const int m0 = tile.m * BM, n0 = tile.n * (GATED ? BN / 2 : BN);
                for (int kb = k_begin; kb < k_end; ++kb) {
                    // A summed second product's k-blocks follow the first's, from its own maps.
                    const bool second = kb >= p.first_k_blocks;
                    const CUtensorMap* ma = second ? &gm.a2 : &map_a;
                    const CUtensorMap* mb = second ? &gm.b2 : &map_b;
                    const int k0 = (second ? kb - p.first_k_blocks : kb) * BK;
                    st.ring.wait_empty(at);
                    const int s = at.stage;
                    sync::barrier& full = st.ring.full[s];
                    if (kb == k_begin && p.tickets != nullptr) st.tile_at[s] = t;
                    sync::arrive_expect_bytes(full, state_t::stage_bytes);
                    if constexpr (MA == major::k) {
                        tma::load_2d(st.a[s].data, ma, k0, m0, full);
                    } else {
                        for (int panel = 0; panel < BM / 64; ++panel)
                            tma::load_2d(st.a[s].data + panel * 64 * BK, ma, m0 + panel * 64, k0, full);
                    }
                    constexpr uint16_t everyone = (1u << CLUSTER) - 1;
                    constexpr int b_rows = BN / CLUSTER;  // this block's share of the B tile
                    if constexpr (GATED) {  // B's 128 columns above B2's same 128
                        tma::load_2d(st.b[s].data, &map_b, k0, n0, full);
                        tma::load_2d(st.b[s].data + (BN / 2) * BK, &gm.b2, k0, n0, full);
                    } else if constexpr (CLUSTER == 1 && MB == major::k) {
                        tma::load_2d(st.b[s].data, mb, k0, n0, full);
                    } else if constexpr (CLUSTER == 1) {
                        for (int panel = 0; panel < BN / 64; ++panel)
                            tma::load_2d(st.b[s].data + panel * 64 * BK, mb, n0 + panel * 64, k0, full);
                    } else if constexpr (MB == major::k) {
                        tma::load_2d_multicast(st.b[s].data + rank * b_rows * BK, mb, k0, n0 + rank * b_rows,
                                               full, everyone);
                    } else {
                        for (int panel = 0; panel < b_rows / 64; ++panel) {
                            const int row = rank * b_rows + panel * 64;
                            tma::load_2d_multicast(st.b[s].data + row * BK, mb, n0 + row, k0, full,
                                                   everyone);
                        }
                    }
                    at.advance();
                }
            };
            if (p.tickets != nullptr) {
                for (int t = next_ticket(); t < pairs; t = next_ticket()) load_tile(t, 0, p.k_blocks);
            } else {
                for (int i = 0;; ++i) {
                    const schedule::work w = p.split.item(cluster, clusters, i);
                    if (w.tile < 0) break;
                    load_tile(w.tile, w.k_begin, w.k_end);
                }
            }
            if (p.tickets != nullptr) {  // dynamic: end of work is a stage with no bytes whose tile is -1
                if constexpr (PINGPONG) {
                    // One consumer's slot: its marker and k_blocks - 1 more empty stages, which it drains; then
                    // the other consumer's marker at the start of the next slot.
                    for (int kb = 0; kb < p.k_blocks; ++kb) {
                        st.ring.wait_empty(at);
                        if (kb == 0) st.tile_at[at.stage] = -1;
                        sync::arrive(st.ring.full[at.stage]);
                        at.advance();
                    }
                    st.ring.wait_empty(at);
                    st.tile_at[at.stage] = -2;
                    sync::arrive(st.ring.full[at.stage]);
                } else {
                    st.ring.wait_empty(at);
                    st.tile_at[at.stage] = -1;
                    sync::arrive(st.ring.full[at.stage]);
                }
            }
        } else if (GATED && (threadIdx.x / 32 == 1 || threadIdx.x / 32 == 2)) {
            if constexpr (GATED) store_staged_gated<T>(st, p, map_c, gm, int(threadIdx.x / 32) - 1);
        } else if (GATE_GRAD && (threadIdx.x == 32 || (!PINGPONG && threadIdx.x == 64))) {
            if constexpr (GATE_GRAD)
                store_gate_grad_tiles<PINGPONG>(st, p, map_c, gm, int(threadIdx.x / 32) - 1, cluster, clusters,
                                                tile_of);
        } else if (STORE_WARPS && !GATE_GRAD && p.tma_store && (threadIdx.x == 32 || threadIdx.x == 64)) {
            store_staged_tiles(st, p, map_c, int(threadIdx.x / 32) - 1);
        }
    } else if constexpr (PINGPONG) {
        consume_pingpong<T, MA, MB, F>(st, p, map_c, pairs, cluster, clusters, tile_of);
    } else {
        consume<T, O, MA, MB, CLUSTER, BN, F>(st, p, map_c, cluster, clusters, tile_of);
    }
    // No block leaves while its peer may still write into its shared memory or arrive on its barriers.
    // (Lane 0 of the producer warp arrives late: reconverge the warp first, the cluster barrier is .aligned.)
    if constexpr (CLUSTER > 1) {
        __syncwarp();
        sync::cluster_sync();
    }
}

template <typename T, major MA, major MB, int BN, bool STORE_WARPS, fused F = fused::none>
constexpr int smem_bytes_of = sizeof(shared_state<T, MA, MB, BN, STORE_WARPS, F>) + 1024;  // + alignment to 1024 bytes
static_assert(smem_bytes_of<__nv_bfloat16, major::k, major::k, 256, true> <= 227 * 1024 &&
              smem_bytes_of<__nv_bfloat16, major::k, major::k, 256, false> <= 227 * 1024 &&
              smem_bytes_of<__nv_bfloat16, major::k, major::k, 128, false> <= 227 * 1024 &&
              smem_bytes_of<__nv_bfloat16, major::k, major::mn, 128, true, fused::swiglu_grad> <= 227 * 1024,
              "shared memory per block");

// Per device, once: the kernel's shared-memory opt-in (an attribute of the kernel in each device's context) and
// the persistent grid: one block per SM, or for clusters as many as the occupancy query says fit at once.
template <typename T, major MA, major MB, int CLUSTER, int BN, bool PINGPONG, bool STORE_WARPS, fused F = fused::none,
          typename O = T>
cudaError_t prepare(int* grid_blocks) {
    static std::atomic<int> blocks[max_devices];
    const int device = current_device();
    if (device < 0) return cudaErrorInvalidDevice;
    int known = blocks[device].load(std::memory_order_acquire);
    if (known == 0) {
        auto kernel = gemm_kernel<T, MA, MB, CLUSTER, BN, PINGPONG, STORE_WARPS, F, O>;
        constexpr int smem_bytes = smem_bytes_of<T, MA, MB, BN, STORE_WARPS, F>;
        cudaError_t e = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem_bytes);
        if (e != cudaSuccess) return e;
        known = multiprocessor_count();
        if constexpr (CLUSTER > 1) {
            const launch_config query(dim3(CLUSTER * multiprocessor_count()), dim3(THREADS), smem_bytes, nullptr,
                                      CLUSTER, false);
            int fit = 0;
            e = cudaOccupancyMaxActiveClusters(&fit, kernel, &query.config);
            if (e != cudaSuccess) (void)cudaGetLastError();  // answered by the fallback below, not left for a later check
            known = CLUSTER * (e == cudaSuccess && fit > 0 ? fit : multiprocessor_count() / CLUSTER);
        }
        blocks[device].store(known, std::memory_order_release);
    }
    *grid_blocks = known;
    return cudaSuccess;
}

// Whether a static launch takes a stream-K tail: only on request. Against whole tiles in the same rotation on an
// H100 (benchmarks/NOTES.md) it was 3-6% slower at K = 2048-3072 (the tail's partial sums, 128 KB of fp32 written
// and read back per cut tile, cost more than a short tile's idle time), 8% slower with fewer tiles than blocks
// (2048 x 2048 x 8192), and at K = 8192 with 512 tiles between 2.5% faster and 12% slower from call to call; no
// automatic rule held up. Never with the dynamic schedule (whose blocks take tiles as they come, so the pieces'
// order is not known) or without a workspace.
bool split_wanted(const gemm_args& g) {
    return g.stream_k == 1 && g.partials != nullptr && g.flags != nullptr && g.tickets == nullptr;
}

// The stream-K tail's bounds (schedule::plan_split_tail): at most 4 pieces per tile where there are fewer tiles
// than blocks (each finisher adds the others' partial sums), and ranges of at least 4 k-blocks.
constexpr int SPLIT_MAX_PIECES = 4, SPLIT_MIN_K_BLOCKS = 4;

template <typename T, major MA, major MB, int CLUSTER, int BN, bool PINGPONG, bool STORE_WARPS, fused F = fused::none,
          typename O = T>
cudaError_t launch(const gemm_args& g, cudaStream_t stream) {
    constexpr bool GATED = F == fused::swiglu;
    auto kernel = gemm_kernel<T, MA, MB, CLUSTER, BN, PINGPONG, STORE_WARPS, F, O>;
    constexpr int smem_bytes = smem_bytes_of<T, MA, MB, BN, STORE_WARPS, F>;
    int resident = 0;
    if (cudaError_t e = prepare<T, MA, MB, CLUSTER, BN, PINGPONG, STORE_WARPS, F, O>(&resident); e != cudaSuccess)
        return e;
    // SwiGLU: each product's B tile is half the block's (128 columns of B, 128 of B2), and an output tile 128 wide.
    constexpr int b_box = GATED ? BN / 2 : BN / CLUSTER, out_tile_n = GATED ? BN / 2 : BN;

    const auto sw = tma::swizzle::b128;
    // A's and B's maps over K columns of A and K rows of B, for either product.
    auto operand_maps = [&](CUtensorMap* ma, CUtensorMap* mb, const void* a, const void* b, int64_t K, int64_t a_stride_m,
                            int64_t a_stride_k, int64_t b_stride_k, int64_t b_stride_n) {
        CUresult r = MA == major::k
                         ? tma::make_tensor_map_2d(ma, a, tma::element_type<T>(), 2, K, g.M, a_stride_m, BK, BM, sw)
                         : tma::make_tensor_map_2d(ma, a, tma::element_type<T>(), 2, g.M, K, a_stride_k, 64, BK, sw);
        if (r != CUDA_SUCCESS) return r;
        return MB == major::k ? tma::make_tensor_map_2d(mb, b, tma::element_type<T>(), 2, K, g.N, b_stride_n, BK, b_box, sw)
                              : tma::make_tensor_map_2d(mb, b, tma::element_type<T>(), 2, g.N, K, b_stride_k, 64, BK, sw);
    };
    CUtensorMap map_a, map_b;
    if (operand_maps(&map_a, &map_b, g.a, g.b, g.K, g.a_stride_m, g.a_stride_k, g.b_stride_k, g.b_stride_n) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    CUtensorMap map_c{};
    // C's layout in 64 x 64 boxes: the output, and SwiGLU's other outputs and (backward) inputs, which share it.
    auto panel_map = [&](CUtensorMap* map, const void* at) {
        return tma::make_tensor_map_2d(map, at, tma::element_type<T>(), 2, g.N, g.M, g.c_stride_m, 64, 64, sw);
    };
    // TMA stores write whole 16-byte chunks: with N elements off a 16-byte multiple the last chunk of a row would
    // overwrite up to 14 bytes past column N (another tensor's data in a view), so such C takes the register path.
    constexpr int per_chunk = 16 / sizeof(O);
    const bool tma_store = reinterpret_cast<uintptr_t>(g.c) % 16 == 0 && g.N % per_chunk == 0 &&
                           (g.M == 1 || g.c_stride_m % per_chunk == 0);
    if (tma_store) {  // fp32 C in 64 x 32 boxes: 128-byte rows, as the 16-bit ones
        const CUresult made =
            std::is_same_v<O, float>
                ? tma::make_tensor_map_2d(&map_c, g.c, tma::element_type<float>(), 4, g.N, g.M, g.c_stride_m, 32, 64, sw)
                : panel_map(&map_c, g.c);
        if (made != CUDA_SUCCESS) return cudaErrorInvalidValue;
    }
    extra_maps gm{};
    if constexpr (GATED) {
        if (!tma_store ||
            tma::make_tensor_map_2d(&gm.b2, g.b2, tma::element_type<T>(), 2, g.K, g.N, g.b_stride_n, BK, b_box, sw) !=
                CUDA_SUCCESS ||
            panel_map(&gm.c2, g.c2) != CUDA_SUCCESS || panel_map(&gm.c3, g.c3) != CUDA_SUCCESS)
            return cudaErrorInvalidValue;
    }
    if constexpr (F == fused::swiglu_grad) {
        if (!tma_store || panel_map(&gm.c2, g.c2) != CUDA_SUCCESS || panel_map(&gm.h1, g.h1) != CUDA_SUCCESS ||
            panel_map(&gm.h2, g.h2) != CUDA_SUCCESS)
            return cudaErrorInvalidValue;
    }
    const bool summed = F == fused::none && g.sum_a != nullptr;
    if (summed && operand_maps(&gm.a2, &gm.b2, g.sum_a, g.sum_b, g.sum_K, g.sum_a_stride_m, g.sum_a_stride_k,
                               g.sum_b_stride_k, g.sum_b_stride_n) != CUDA_SUCCESS)
        return cudaErrorInvalidValue;

    kernel_params p;
    p.tma_store = tma_store && g.epilogue != 3;  // 3: the consumers store from registers, where TMA could too
    p.args = g;
    // The schedule walks pairs of tile rows; a pair past M computes on zero-filled A and stores nothing.
    const int tiles_m = int((g.M + BM - 1) / BM);
    p.order = {(tiles_m + CLUSTER - 1) / CLUSTER, int((g.N + out_tile_n - 1) / out_tile_n),
               g.group_rows > 0 ? std::max(1, g.group_rows / CLUSTER) : GROUP_ROWS / CLUSTER};
    p.first_k_blocks = int((g.K + BK - 1) / BK);  // a ragged last k-block reads zeros past K (TMA's fill)
    p.k_blocks = p.first_k_blocks + (summed ? int((g.sum_K + BK - 1) / BK) : 0);
    p.tickets = CLUSTER == 1 ? g.tickets : nullptr;

    int clusters = std::max(1, std::min(p.order.count(), resident / CLUSTER));
    p.split = schedule::whole_tiles(p.order.count(), p.k_blocks);
    if (CLUSTER == 1 && !PINGPONG && F == fused::none && split_wanted(g)) {
        p.split = schedule::plan_split_tail(p.order.count(), p.k_blocks, resident, SPLIT_MAX_PIECES, SPLIT_MIN_K_BLOCKS);
        clusters = p.split.dp_tiles > 0 ? resident : p.split.sk_blocks;
    }
    return launch_kernel(kernel, dim3(CLUSTER * clusters), dim3(THREADS), smem_bytes, stream, CLUSTER, map_a, map_b,
                         map_c, gm, p);
}

template <typename T, int C, int BN, bool PINGPONG = false, bool STORE_WARPS = false, typename O = T>
cudaError_t dispatch_majors(const gemm_args& g, cudaStream_t stream) {
    const bool a_k = g.a_stride_k == 1, b_k = g.b_stride_k == 1;
    constexpr fused none = fused::none;
    if (a_k && b_k) return launch<T, major::k, major::k, C, BN, PINGPONG, STORE_WARPS, none, O>(g, stream);
    if (a_k) return launch<T, major::k, major::mn, C, BN, PINGPONG, STORE_WARPS, none, O>(g, stream);
    if (b_k) return launch<T, major::mn, major::k, C, BN, PINGPONG, STORE_WARPS, none, O>(g, stream);
    return launch<T, major::mn, major::mn, C, BN, PINGPONG, STORE_WARPS, none, O>(g, stream);
}

// Output tiles `tn` wide.
int64_t tiles_of(const gemm_args& g, int tn) { return ((g.M + BM - 1) / BM) * ((g.N + tn - 1) / tn); }

// The share of the persistent grid's slots (waves x SMs) that tiles fill, for tiles `tn` wide.
double wave_fill(const gemm_args& g, int tn, int sms) {
    const int64_t tiles = tiles_of(g, tn);
    const int64_t waves = (tiles + sms - 1) / sms;
    return double(tiles) / double(waves * sms);
}

int tile_n_of(const gemm_args& g) {
    if (g.tile_n == 128 || g.tile_n == 256) return g.tile_n;
    if (g.epilogue == 1) return 256;  // store warps asked for: they take 256-wide tiles
    if (split_wanted(g)) return 256;  // the stream-K tail levels the last wave of wide tiles
    const int sms = multiprocessor_count();
    // 128 wide only where 256-wide tiles leave a good part of the grid idle in their last wave and the narrower
    // ones fill it clearly better: they move a third more bytes from L2 per product.
    const double wide = wave_fill(g, 256, sms), narrow = wave_fill(g, 128, sms);
    return wide < 0.8 && narrow > wide + 0.1 ? 128 : 256;
}

// Store warps (256-wide tiles, three stages) where a block takes many tiles, or very long ones; else the consumers
// store their own rows with four stages. Measured (H100, benchmarks/NOTES.md): 8192 x 2048 x 2048 (3.9 tiles per
// block) 0.92 of cuBLAS with store warps against 0.95; 8192 x 128256 x 2048 (243) 0.945 against 0.916.
bool store_warps_for(const gemm_args& g) {
    if (g.epilogue != 0) return g.epilogue == 1;
    return tiles_of(g, 256) >= 7 * int64_t(multiprocessor_count()) || g.K >= 32768;
}

template <typename T>
cudaError_t dispatch_cluster(const gemm_args& g, cudaStream_t stream) {
    // Default: no cluster. Clusters of two with B multicast run at parity on the H100, not faster
    // (benchmarks/NOTES.md); they use 256-wide tiles only.
    if (g.cluster == 2) return dispatch_majors<T, 2, 256>(g, stream);
    // Ping-pong only on request: its 128 x 128 tiles pull a third more bytes from L2 per product than the shared
    // 128 x 256 ones, which costs more than the hidden epilogue gains (benchmarks/NOTES.md).
    if (g.pingpong == 1) return dispatch_majors<T, 1, 128, true>(g, stream);
    if (tile_n_of(g) == 128) return dispatch_majors<T, 1, 128>(g, stream);
    if (store_warps_for(g)) return dispatch_majors<T, 1, 256, false, true>(g, stream);
    return dispatch_majors<T, 1, 256>(g, stream);
}

// fp32 output (bf16 operands): the plain kernel's tile width, the consumers' epilogue.
cudaError_t dispatch_fp32_out(const gemm_args& g, cudaStream_t stream) {
    if (tile_n_of(g) == 128) return dispatch_majors<__nv_bfloat16, 1, 128, false, false, float>(g, stream);
    return dispatch_majors<__nv_bfloat16, 1, 256, false, false, float>(g, stream);
}

const char* fp32_out_unsupported(const gemm_args& g) {
    if (g.dtype != int(dtype::bf16)) return "fp32 output goes with bf16 operands only";
    if (g.rope_cos != nullptr || g.h1 != nullptr || g.b2 != nullptr)
        return "fp32 output is a plain product's (no fused epilogue)";
    if (g.cluster == 2 || g.pingpong == 1 || g.epilogue == 1 || g.skinny == 1)
        return "fp32 output runs the consumers' epilogue (no cluster, ping-pong, store warps or skinny kernel)";
    return nullptr;
}

bool aligned16(const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; }

// SwiGLU's launch: one kernel shape (store warps, 128 output columns of each product per tile), either schedule.
template <typename T>
cudaError_t dispatch_gated(const gemm_args& g, cudaStream_t stream) {
    return launch<T, major::k, major::k, 1, 256, false, true, fused::swiglu>(g, stream);
}

// SwiGLU's backward: 128-wide tiles with store warps, the static schedule; B either major. By default the consumers
// take whole tiles in turns, so that one's epilogue runs under the other's products (pingpong -1: they share each
// tile, and both wait for their epilogue with the tensor cores idle).
template <typename T, bool PINGPONG>
cudaError_t dispatch_gate_grad_tiles(const gemm_args& g, cudaStream_t stream) {
    if (g.b_stride_k == 1) return launch<T, major::k, major::k, 1, 128, PINGPONG, true, fused::swiglu_grad>(g, stream);
    return launch<T, major::k, major::mn, 1, 128, PINGPONG, true, fused::swiglu_grad>(g, stream);
}

template <typename T>
cudaError_t dispatch_gate_grad(const gemm_args& g, cudaStream_t stream) {
    return g.pingpong == -1 ? dispatch_gate_grad_tiles<T, false>(g, stream) : dispatch_gate_grad_tiles<T, true>(g, stream);
}

// The rotary epilogue: the plain kernel's tile and epilogue choice, but 256-wide tiles for 256-wide heads.
template <typename T>
cudaError_t dispatch_rope(const gemm_args& g, cudaStream_t stream) {
    if (g.rope_head_dim <= 128 && tile_n_of(g) == 128)
        return launch<T, major::k, major::k, 1, 128, false, false, fused::rope>(g, stream);
    if (store_warps_for(g)) return launch<T, major::k, major::k, 1, 256, false, true, fused::rope>(g, stream);
    return launch<T, major::k, major::k, 1, 256, false, false, fused::rope>(g, stream);
}

const char* rope_unsupported(const gemm_args& g) {
    if (g.bias != nullptr) return "the rotary epilogue takes no bias";
    if (g.a_stride_k != 1 || g.b_stride_k != 1) return "the rotary epilogue needs A and B K-major";
    const int D = g.rope_head_dim, n = g.rope_dims;
    if (D != 64 && D != 128 && D != 256) return "the rotary epilogue takes heads of 64, 128 or 256 columns";
    if (n < 16 || n > D || (n & (n - 1)) != 0)
        return "the rotary epilogue turns a power of two of columns from 16 to the head width";
    if (g.rope_cols <= 0 || g.rope_cols % D != 0 || g.rope_cols > g.N)
        return "the rotated columns must be whole heads within the output";
    if (g.rope_seq <= 0 || g.rope_stride > INT32_MAX || g.rope_seq * g.rope_stride > INT32_MAX)
        return "cos and sin must have fewer than 2^31 elements in the rows used";
    if (g.rope_fp32 && g.dtype != int(dtype::bf16)) return "fp32 cos and sin go with bf16 operands only";
    const uintptr_t pair_bytes = g.rope_fp32 ? 8 : 4;  // the tables are read a pair of columns at a time
    if (g.rope_sin == nullptr || reinterpret_cast<uintptr_t>(g.rope_cos) % pair_bytes != 0 ||
        reinterpret_cast<uintptr_t>(g.rope_sin) % pair_bytes != 0 || g.rope_stride < n || g.rope_stride % 2 != 0)
        return g.rope_fp32 ? "cos and sin (fp32): 8-byte aligned rows of at least the turned columns, an even row stride"
                           : "cos and sin: 4-byte aligned rows of at least the turned columns, an even row stride";
    if (g.cluster == 2 || g.pingpong == 1 || g.stream_k == 1 || g.skinny == 1 || (g.tile_n == 128 && D == 256))
        return "the rotary epilogue runs the plain schedule's shared tiles (no cluster, ping-pong, stream-K or "
               "skinny kernel), 256 wide for 256-wide heads";
    return nullptr;
}

const char* gate_grad_unsupported(const gemm_args& g) {
    if (g.bias != nullptr || g.b2 != nullptr || g.c3 != nullptr) return "SwiGLU's backward takes one B and no bias";
    if (g.a_stride_k != 1) return "SwiGLU's backward needs A K-major";
    if (g.c2 == nullptr || g.h2 == nullptr) return "SwiGLU's backward needs h1, h2 and both outputs";
    if (!aligned16(g.c) || !aligned16(g.c2) || !aligned16(g.h1) || !aligned16(g.h2))
        return "SwiGLU's backward: h1, h2 and the outputs must be 16-byte aligned";
    if (g.N % 8 || (g.M > 1 && g.c_stride_m % 8))
        return "SwiGLU's backward: rows must be multiples of 8 elements";
    if (g.cluster == 2 || g.tile_n == 256 || g.epilogue == 2 || g.stream_k == 1 || g.skinny == 1 || g.tickets != nullptr)
        return "SwiGLU's backward runs 128-wide tiles with store warps on the static schedule only (no cluster, "
               "stream-K, skinny kernel or dynamic schedule)";
    return nullptr;
}

const char* gated_unsupported(const gemm_args& g) {
    if (g.bias != nullptr) return "SwiGLU takes no bias";
    if (g.a_stride_k != 1 || g.b_stride_k != 1) return "SwiGLU needs A and both weights K-major";
    if (g.c2 == nullptr || g.c3 == nullptr) return "SwiGLU needs its three outputs";
    if (!aligned16(g.b2) || !aligned16(g.c) || !aligned16(g.c2) || !aligned16(g.c3))
        return "SwiGLU's weights and outputs must be 16-byte aligned";
    if (g.N % 8 || (g.M > 1 && g.c_stride_m % 8)) return "SwiGLU's output rows must be multiples of 8 elements";
    if (g.cluster == 2 || g.tile_n == 128 || g.pingpong == 1 || g.epilogue == 2 || g.stream_k == 1 || g.skinny == 1)
        return "SwiGLU runs 256-wide tiles with store warps only (no cluster, ping-pong, stream-K or skinny kernel)";
    return nullptr;
}

// A summed second product: its operands laid out like the first's (the kernel's majors are the first's).
const char* sum_unsupported(const gemm_args& g) {
    if (g.sum_b == nullptr) return "a summed second product needs its B2";
    if (g.rope_cos != nullptr || g.h1 != nullptr || g.b2 != nullptr) return "a summed second product is a plain product's";
    if (g.sum_K <= 0 || g.sum_K % 8) return "the second product's K must be a positive multiple of 8";
    if (g.sum_K > INT32_MAX / 2 || g.K + g.sum_K > INT32_MAX / 2) return "the two products' K exceed 2^30";
    if ((g.sum_a_stride_k == 1) != (g.a_stride_k == 1) || (g.sum_b_stride_k == 1) != (g.b_stride_k == 1))
        return "the second product's A2 and B2 need A's and B's majors (the unit stride on the same side)";
    if ((g.sum_a_stride_k != 1 && g.sum_a_stride_m != 1) || (g.sum_b_stride_k != 1 && g.sum_b_stride_n != 1))
        return "A2 and B2 need a unit stride";
    const int64_t a_lead = g.sum_a_stride_k == 1 ? g.sum_a_stride_m : g.sum_a_stride_k;
    const int64_t b_lead = g.sum_b_stride_k == 1 ? g.sum_b_stride_n : g.sum_b_stride_k;
    if (a_lead % 8 || b_lead % 8) return "A2's and B2's leading strides must be multiples of 8 elements";
    if (!aligned16(g.sum_a) || !aligned16(g.sum_b)) return "A2 and B2 must be 16-byte aligned";
    if (g.skinny == 1) return "the skinny GEMM takes one product";
    return nullptr;
}

}  // namespace

const char* gemm_unsupported(const gemm_args& g) {
    if (g.dtype != int(dtype::bf16) && g.dtype != int(dtype::fp16)) return "dtype must be bfloat16 or float16";
    if (g.M <= 0 || g.N <= 0 || g.K <= 0) return "M, N and K must be positive";
    if (g.M > INT32_MAX / 2 || g.N > INT32_MAX / 2 || g.K > INT32_MAX / 2) return "a dimension exceeds 2^30";
    // The schedule numbers tiles, and the dynamic one tickets a grid past them, in ints (grouped_order, split_tail):
    // 2^30 tiles of 128 x 128 are 2^44 outputs, past any GPU's memory unless C's rows overlap.
    if (tiles_of(g, 128) > INT32_MAX / 2) return "the output has 2^30 tiles or more";
    if (g.K % 8) return "K must be a multiple of 8";
    if (g.tile_n != 0 && g.tile_n != 128 && g.tile_n != 256) return "tile_n must be 0 (automatic), 128 or 256";
    if (g.tile_n == 128 && g.cluster == 2) return "clusters of two use 256-wide tiles only";
    if (g.pingpong < -1 || g.pingpong > 1) return "pingpong must be 0 (automatic), 1 (on) or -1 (off)";
    if (g.pingpong == 1 && (g.cluster == 2 || g.tile_n == 256))
        return "ping-pong tiles are 128 x 128 with no cluster";
    if (g.epilogue < 0 || g.epilogue > 3)
        return "epilogue must be 0 (automatic), 1 (store warps), 2 (consumers) or 3 (consumers, from registers)";
    if (g.epilogue == 3 && (g.h1 != nullptr || g.b2 != nullptr))
        return "SwiGLU's launches store through shared memory (epilogue 3 is not theirs)";
    if (g.epilogue == 1 && (g.cluster == 2 || g.tile_n == 128 || g.pingpong == 1))
        return "store warps take 256-wide shared tiles with no cluster and no ping-pong";
    if (g.stream_k < -1 || g.stream_k > 1) return "stream_k must be 1 (on), 0 or -1 (off)";
    if (g.stream_k == 1 && (g.cluster == 2 || g.pingpong == 1 || g.tickets != nullptr))
        return "stream-K takes the static schedule with no cluster and no ping-pong";
    if (g.stream_k == 1 && (g.partials == nullptr || g.flags == nullptr)) return "stream-K needs its workspace";
    if (g.skinny < -1 || g.skinny > 1) return "skinny must be 0 (automatic), 1 (on) or -1 (off)";
    if (g.skinny == 1)
        if (const char* why = skinny_unsupported(g)) return why;
    if (g.a_stride_k != 1 && g.a_stride_m != 1) return "A needs a unit stride along M or K";
    if (g.b_stride_k != 1 && g.b_stride_n != 1) return "B needs a unit stride along K or N";
    const int64_t a_lead = g.a_stride_k == 1 ? g.a_stride_m : g.a_stride_k;
    const int64_t b_lead = g.b_stride_k == 1 ? g.b_stride_n : g.b_stride_k;
    if (a_lead % 8 || b_lead % 8) return "leading strides must be multiples of 8 elements";
    if (!aligned16(g.a) || !aligned16(g.b)) return "A and B must be 16-byte aligned";
    if (g.sum_a != nullptr)
        if (const char* why = sum_unsupported(g)) return why;
    if (g.c_fp32)
        if (const char* why = fp32_out_unsupported(g)) return why;
    if (g.rope_cos != nullptr && (g.h1 != nullptr || g.b2 != nullptr)) return "the rotary epilogue is a plain product's";
    if (g.rope_cos != nullptr) return rope_unsupported(g);
    if (g.h1 != nullptr) return gate_grad_unsupported(g);
    if (g.b2 != nullptr) return gated_unsupported(g);
    if (g.c2 != nullptr || g.c3 != nullptr || g.h2 != nullptr || (g.sum_b != nullptr && g.sum_a == nullptr))
        return "extra outputs or inputs without their launch";
    return nullptr;
}

int64_t stream_k_workspace_floats() {
    const int blocks = gemm_resident_blocks(1);
    return blocks > 0 ? int64_t(blocks) * SLOT_FLOATS : 0;
}

int stream_k_flags() {
    const int blocks = gemm_resident_blocks(1);
    return blocks > 0 ? blocks * CONSUMERS : 0;
}

int gemm_resident_blocks(int cluster) {
    int blocks = 0;
    const cudaError_t e = cluster == 2 ? prepare<__nv_bfloat16, major::k, major::k, 2, 256, false, false>(&blocks)
                                       : prepare<__nv_bfloat16, major::k, major::k, 1, 256, false, false>(&blocks);
    return e == cudaSuccess ? blocks : -1;
}

cudaError_t launch_gemm(const gemm_args& g, cudaStream_t stream) {
    if (gemm_unsupported(g) != nullptr) return cudaErrorInvalidValue;
    if (g.h1 != nullptr)
        return g.dtype == int(dtype::bf16) ? dispatch_gate_grad<__nv_bfloat16>(g, stream)
                                           : dispatch_gate_grad<__half>(g, stream);
    if (g.b2 != nullptr)
        return g.dtype == int(dtype::bf16) ? dispatch_gated<__nv_bfloat16>(g, stream) : dispatch_gated<__half>(g, stream);
    if (g.rope_cos != nullptr)
        return g.dtype == int(dtype::bf16) ? dispatch_rope<__nv_bfloat16>(g, stream) : dispatch_rope<__half>(g, stream);
    // Few rows: the skinny kernel spreads the weight's columns and K over every SM (skinny.cu).
    if (g.skinny == 1 || (g.skinny == 0 && skinny_unsupported(g) == nullptr)) return launch_skinny(g, stream);
    if (g.c_fp32) return dispatch_fp32_out(g, stream);
    if (g.dtype == int(dtype::bf16)) return dispatch_cluster<__nv_bfloat16>(g, stream);
    return dispatch_cluster<__half>(g, stream);
}

}  // namespace tk::gemm
