// The GEMM for few rows (M <= 64: decoding, small batches): C = A B with A (M x K) K-major, computed transposed,
// C^T (N x M) = B^T A^T, so that B's columns fill the wgmma's 64 rows and the few tokens are its N (16, 32 or
// 64). Such a product only streams B (the weight) from memory; the persistent kernel's 128 x 256 tiles would put
// it on N / 256 SMs. Here each block takes 64 columns of C and a range of K (split-K), so the grid covers every
// SM several times over; blocks that split a column tile leave fp32 partial sums in a workspace and the last to
// arrive adds them in split order (deterministic) and stores the tile.
#include "gemm.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>

namespace tk::gemm {
namespace {

using wgmma::major;

constexpr int SK_ROWS = 64;  // columns of C per block: the wgmma's M
constexpr int SK_BK = 64;
constexpr int SK_STAGES = 6;
constexpr int SK_THREADS = warpgroup::threads + 32;  // one consumer warpgroup, one producer warp
constexpr int SK_MIN_K_BLOCKS = 4;                   // a split's shortest range of k-blocks

template <typename T, major MB, int NT>
struct skinny_state {
    wgmma::operand_tile<T, SK_ROWS, MB> w[SK_STAGES];    // B^T: 64 columns of C x 64 deep
    wgmma::operand_tile<T, NT, major::k> x[SK_STAGES];  // A: NT rows (tokens; zero past M) x 64 deep
    pipeline::ring<SK_STAGES> ring;
    int last;  // split-K: whether this block arrived last for its column tile
    static constexpr uint32_t stage_bytes = (SK_ROWS + NT) * SK_BK * sizeof(T);
};

struct skinny_params {
    gemm_args args;
    int k_blocks, splits;
};

// Block (tile, split): columns [64 tile, 64 tile + 64) of C, k-blocks [k_blocks * split / splits, ...).
__device__ __forceinline__ int split_begin(const skinny_params& p, int split) {
    return int(int64_t(p.k_blocks) * split / p.splits);
}

template <typename T, major MB, int NT>
__global__ void __launch_bounds__(SK_THREADS)
    skinny_kernel(const __grid_constant__ CUtensorMap map_w, const __grid_constant__ CUtensorMap map_x,
                  const __grid_constant__ skinny_params p) {
    using state_t = skinny_state<T, MB, NT>;
    extern __shared__ uint8_t raw_smem[];
    auto& st = aligned_shared<state_t>(raw_smem);
    const gemm_args& g = p.args;
    const int tile = int(blockIdx.x), split = int(blockIdx.y);
    const int n0 = tile * SK_ROWS, kb0 = split_begin(p, split), kb1 = split_begin(p, split + 1);
    if (threadIdx.x == 0) {
        st.ring.init(1, 4);  // lane 0 of each consumer warp frees a stage
        sync::fence_init();
        tma::prefetch_map(&map_w);
        tma::prefetch_map(&map_x);
    }
    __syncthreads();
    pdl::start();  // set up under the previous kernel's tail; from here on global memory

    if (threadIdx.x >= warpgroup::threads) {
        // ---------------- producer: lane 0 of the last warp ----------------
        if (threadIdx.x == warpgroup::threads) {
            pipeline::cursor<SK_STAGES> at;
            for (int kb = kb0; kb < kb1; ++kb) {
                const int k0 = kb * SK_BK;
                st.ring.wait_empty(at);
                sync::barrier& full = st.ring.full[at.stage];
                sync::arrive_expect_bytes(full, state_t::stage_bytes);
                if constexpr (MB == major::k)
                    tma::load_2d(st.w[at.stage].data, &map_w, k0, n0, full);
                else
                    tma::load_2d(st.w[at.stage].data, &map_w, n0, k0, full);
                tma::load_2d(st.x[at.stage].data, &map_x, k0, 0, full);
                at.advance();
            }
        }
        return;
    }

    // ---------------- consumer warpgroup ----------------
    float d[NT / 2];
    pipeline::cursor<SK_STAGES> at;
    const bool warp_leader = (threadIdx.x & 31) == 0;
    int previous = -1;
    for (int kb = kb0; kb < kb1; ++kb) {
        st.ring.wait_full(at);
        wgmma::fence();
#pragma unroll
        for (int k16 = 0; k16 < SK_BK / 16; ++k16)
            wgmma::mma<NT, T>(d, st.w[at.stage], 0, st.x[at.stage], 0, k16, (kb > kb0) | k16);
        wgmma::commit();
        wgmma::wait<1>();
        if (previous >= 0 && warp_leader) sync::arrive(st.ring.empty[previous]);
        previous = at.stage;
        at.advance();
    }
    wgmma::wait<0>();
    wgmma::pin(d);
    if (previous >= 0 && warp_leader) sync::arrive(st.ring.empty[previous]);

    if (p.splits > 1) {
        // Partial sums in fragment order, float2s 128 threads apart (a warp's access is 256 contiguous bytes).
        float2* slots = reinterpret_cast<float2*>(g.partials) + int64_t(tile) * p.splits * (SK_ROWS * NT / 2);
        auto slot = [&](int s) { return slots + int64_t(s) * (SK_ROWS * NT / 2) + warpgroup::thread(); };
        float2* mine = slot(split);
#pragma unroll
        for (int v = 0; v < NT / 4; ++v) __stcg(mine + v * warpgroup::threads, make_float2(d[2 * v], d[2 * v + 1]));
        __threadfence();
        sync::named_sync(1, warpgroup::threads);
        if (warpgroup::thread() == 0) {
            const int arrived = atomicAdd(g.flags + tile, 1);
            st.last = arrived == p.splits - 1;
            if (st.last) g.flags[tile] = 0;  // every split has arrived: the counter is free for the next launch
        }
        sync::named_sync(1, warpgroup::threads);
        if (!st.last) return;
        __threadfence();
        // Every split's sums, in split order (this block's own from registers), so results do not depend on
        // which block came last.
        float sum[NT / 2];
#pragma unroll
        for (int i = 0; i < NT / 2; ++i) sum[i] = 0.0f;
        for (int s = 0; s < p.splits; ++s) {
            const float2* from = slot(s);
#pragma unroll
            for (int v = 0; v < NT / 4; ++v) {
                const float2 x = s == split ? make_float2(d[2 * v], d[2 * v + 1]) : __ldcg(from + v * warpgroup::threads);
                sum[2 * v] += x.x;
                sum[2 * v + 1] += x.y;
            }
        }
#pragma unroll
        for (int i = 0; i < NT / 2; ++i) d[i] = sum[i];
    }

    // C[m][n0 + r] for accumulator (r, m): a column of C per accumulator row.
    T* __restrict__ c = static_cast<T*>(g.c);
    const T* __restrict__ bias = static_cast<const T*>(g.bias);
#pragma unroll
    for (int i = 0; i < NT / 2; ++i) {
        const auto pos = wgmma::accumulator_position(i);
        const int64_t n = n0 + pos.row, m = pos.col;
        if (n >= g.N || m >= g.M) continue;
        float x = d[i];
        if (bias != nullptr) x += to_float(bias[n]);
        c[m * g.c_stride_m + n] = T(x);
    }
}

template <typename T, major MB, int NT>
constexpr int skinny_smem_bytes = sizeof(skinny_state<T, MB, NT>) + 1024;
static_assert(skinny_smem_bytes<__nv_bfloat16, major::k, 64> <= 227 * 1024 / 2, "two blocks per SM");

// Splits of K for tiles of `tokens_per_tile` rows with `slots` blocks resident at once on the device (1: no split).
// At most k_blocks splits, so every split's range holds at least one k-block.
int skinny_splits(const gemm_args& g, int tokens_per_tile, int slots) {
    const int64_t tiles = (g.N + SK_ROWS - 1) / SK_ROWS, k_blocks = (g.K + SK_BK - 1) / SK_BK;
    // As many blocks as fit on the GPU at once, never more: a second, part-filled wave of blocks that each stream
    // a long slice of the weight doubled the time (4096 x 4096 at one token: 448 blocks on 396 slots).
    int64_t splits = slots / tiles;
    splits = std::min(splits, k_blocks / SK_MIN_K_BLOCKS);
    if (g.partials == nullptr || g.flags == nullptr || tiles > stream_k_flags()) return 1;
    splits = std::min(splits, stream_k_workspace_floats() / (tiles * SK_ROWS * tokens_per_tile));
    return int(std::max<int64_t>(1, splits));
}

template <typename T, major MB, int NT>
cudaError_t launch_skinny_tokens(const gemm_args& g, cudaStream_t stream) {
    auto kernel = skinny_kernel<T, MB, NT>;
    constexpr int smem = skinny_smem_bytes<T, MB, NT>;
    if (cudaError_t e = opt_in_shared_memory<skinny_kernel<T, MB, NT>>(smem); e != cudaSuccess) return e;
    CUtensorMap map_w, map_x;
    const auto sw = tma::swizzle::b128;
    const CUresult r =
        MB == major::k ? tma::make_tensor_map_2d(&map_w, g.b, tma::element_type<T>(), 2, g.K, g.N, g.b_stride_n, SK_BK, SK_ROWS, sw)
                       : tma::make_tensor_map_2d(&map_w, g.b, tma::element_type<T>(), 2, g.N, g.K, g.b_stride_k, SK_ROWS, SK_BK, sw);
    if (r != CUDA_SUCCESS) return cudaErrorInvalidValue;
    if (tma::make_tensor_map_2d(&map_x, g.a, tma::element_type<T>(), 2, g.K, g.M, g.a_stride_m, SK_BK, NT, sw) !=
        CUDA_SUCCESS)
        return cudaErrorInvalidValue;
    skinny_params p;
    p.args = g;
    p.k_blocks = int((g.K + SK_BK - 1) / SK_BK);
    const int tiles = int((g.N + SK_ROWS - 1) / SK_ROWS);
    const int slots = resident_blocks<skinny_kernel<T, MB, NT>>(SK_THREADS, smem);
    if (slots <= 0) return cudaErrorInvalidDevice;
    p.splits = skinny_splits(g, NT, slots);
    return launch_kernel(kernel, dim3(unsigned(tiles), unsigned(p.splits)), dim3(SK_THREADS), smem, stream, 1, map_w,
                         map_x, p);
}

template <typename T, major MB>
cudaError_t launch_skinny_majors(const gemm_args& g, cudaStream_t stream) {
    if (g.M <= 16) return launch_skinny_tokens<T, MB, 16>(g, stream);
    if (g.M <= 32) return launch_skinny_tokens<T, MB, 32>(g, stream);
    return launch_skinny_tokens<T, MB, 64>(g, stream);
}

template <typename T>
cudaError_t launch_skinny_type(const gemm_args& g, cudaStream_t stream) {
    return g.b_stride_k == 1 ? launch_skinny_majors<T, major::k>(g, stream) : launch_skinny_majors<T, major::mn>(g, stream);
}

}  // namespace

const char* skinny_unsupported(const gemm_args& g) {
    if (g.M > SKINNY_MAX_M) return "the skinny GEMM takes at most 64 rows";
    if (g.sum_a != nullptr) return "the skinny GEMM takes one product";
    if (g.c_fp32) return "the skinny GEMM writes C in the operands' dtype";
    if (g.a_stride_k != 1) return "the skinny GEMM reads A K-major (unit stride along K)";
    if (g.cluster == 2 || g.pingpong == 1 || g.tile_n != 0 || g.epilogue != 0 || g.stream_k == 1 || g.tickets)
        return "the skinny GEMM takes none of the persistent kernel's knobs";
    return nullptr;
}

cudaError_t launch_skinny(const gemm_args& g, cudaStream_t stream) {
    if (gemm_unsupported(g) != nullptr || skinny_unsupported(g) != nullptr) return cudaErrorInvalidValue;
    if (g.dtype == int(dtype::bf16)) return launch_skinny_type<__nv_bfloat16>(g, stream);
    return launch_skinny_type<__half>(g, stream);
}

}  // namespace tk::gemm
