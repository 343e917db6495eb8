// C[M, N] = A[M, K] * B[K, N] (+ A2[M, K2] * B2[K2, N]) (+ bias[N]) in bf16 or fp16 with fp32 accumulation, C in
// the operands' dtype or fp32.
// Host-visible declarations only (no device code).
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::gemm {

struct gemm_args {
    const void* a;     // A(m, k) at a + m * a_stride_m + k * a_stride_k; one of the two strides is 1
    const void* b;     // B(k, n) at b + k * b_stride_k + n * b_stride_n; one of the two strides is 1
    void* c;           // C(m, n) at c + m * c_stride_m + n
    const void* bias;  // bias[n] in the element type, or null
    int dtype;         // tk::dtype: bf16 or fp16 (A, B, C and bias alike)
    int64_t M, N, K;
    int64_t a_stride_m, a_stride_k, b_stride_k, b_stride_n, c_stride_m;
    int group_rows;  // tile rows per L2 group of the persistent schedule (0: the tuned default)
    int cluster;     // blocks per cluster sharing B by multicast: 1 or 2 (0: the default)
    int tile_n;      // output tile width: 128 or 256 (0: 256 unless 128 fills the grid's last wave clearly better)
    // 1: the consumer warpgroups take 128 x 128 tiles in turns (ping-pong); -1: they share each tile; 0: automatic,
    // which is sharing for the plain product (ping-pong's smaller tiles measured 0.84-0.88x of it over the
    // benchmark's shapes) and ping-pong for SwiGLU's backward (its tiles are 128 wide either way).
    int pingpong;
    // 1: store warps write the output tiles, so the consumers go on at once (256-wide tiles, three stages); 2: the
    // consumers store their own rows (four stages); 3: the consumers store them from registers, no staging (not
    // SwiGLU's launches); 0: automatic, store warps where a block takes many tiles.
    int epilogue;
    // Dynamic tile schedule (clusters of 1 only): blocks take tiles from this zeroed counter as they get to
    // them, so blocks that start late (SMs busy with other kernels, e.g. an overlapping collective) take fewer
    // tiles instead of stretching the kernel. The kernel leaves it zeroed again. Null: each block takes every
    // grid-th tile. A counter must not be shared by launches that may run at the same time.
    int* tickets;
    // Stream-K tail (static schedule, no cluster, no ping-pong), on request: the last wave's tiles are cut into
    // k-block ranges of equal length; a block that holds a tile's earlier k-blocks leaves its fp32 sums in its slot
    // of `partials` and raises its flag, and the block holding the tile's last k-block adds them and stores the
    // tile. 1: on, 0 or -1: off (no automatic rule measured faster: gemm.cu). `partials`: stream_k_workspace_floats()
    // floats; `flags`: stream_k_flags() zeroed ints, which the kernel leaves zeroed again. Neither may be shared by
    // launches that can run at the same time.
    int stream_k;
    float* partials;
    int* flags;
    // The skinny kernel for few rows (skinny.cu): 0 automatic (M <= SKINNY_MAX_M with A K-major and none of the
    // knobs above; it splits K over the workspace above where one is given), 1 forced, -1 off.
    int skinny;
    // SwiGLU's two products in one launch (b2 non-null): C = A B and C2 = A B2 (B2 with B's strides), and
    // C3 = silu(C) * C2, each rounded to the element type as PyTorch rounds silu(c) * c2 in 16 bits. A block's B tile
    // is 128 columns of B above the same 128 of B2, so its accumulators hold both products of its 128 output
    // columns; its store warp writes C and C2 from the staging, then C3 over C's half of it. C2 and C3 have C's row
    // stride. A and B K-major, no bias, with the store warps' epilogue only (gemm_unsupported names the rest).
    const void* b2;
    void* c2;
    void* c3;
    // SwiGLU's backward (h1 non-null): with dG = A B (never written), C = dh1 = dG h2 silu'(h1) and C2 = dh2 =
    // dG silu(h1), each from dG's fp32 accumulators and rounded once; h1 and h2 are the forward's products, read by
    // TMA with C's row stride. A K-major, no bias, 128-wide tiles with store warps on the static schedule only
    // (gemm_unsupported); the consumers take whole tiles in turns unless pingpong is -1.
    const void* h1;
    const void* h2;
    // Rotary embedding in the epilogue (rope_cos non-null): LitGPT's rotate-half rope over a fused qkv projection's
    // output, from the fp32 accumulators, rounded once. Output row r is position t = r % rope_seq; columns
    // [0, rope_cols) are heads of rope_head_dim columns (q's, then k's), whose first rope_dims = 2h columns turn:
    // y[c] = x[c] cos[t][c] - x[c + h] sin[t][c] and y[c + h] = x[c + h] cos[t][c + h] + x[c] sin[t][c + h] for
    // c < h; the other columns are stored as they are. cos and sin: rows of rope_stride elements in the element
    // type, or fp32 where rope_fp32 (bf16-mixed training's tables). A and B K-major, no bias; rope_head_dim 64, 128
    // or 256 and rope_dims a power of two from 16 to it (gemm_unsupported names the rest).
    const void* rope_cos;
    const void* rope_sin;
    int64_t rope_stride, rope_seq, rope_cols;
    int rope_head_dim, rope_dims;
    bool rope_fp32;
    // A second product summed into C (sum_a non-null): C = A B + A2 B2 (+ bias), both products' k-blocks (K's, then
    // sum_K's) accumulated in one fp32 tile and rounded once, so their sum is neither written nor read back in 16
    // bits. A2 (M, sum_K) and B2 (sum_K, N) with strides of their own and A's and B's majors (the unit stride on the
    // same side). The plain product's launches only: no fused epilogue, no skinny kernel (gemm_unsupported).
    const void* sum_a;
    const void* sum_b;
    int64_t sum_K, sum_a_stride_m, sum_a_stride_k, sum_b_stride_k, sum_b_stride_n;
    // C in fp32, rounded once from the accumulators (bf16 operands; bf16-mixed training's weight gradients and
    // summed input gradients, which it would otherwise round to bf16 and widen again). The plain product (a summed
    // second one included) with the consumers' epilogue: no fused epilogue, cluster, ping-pong, store warps or
    // skinny kernel (gemm_unsupported). The bias stays in the operands' dtype.
    bool c_fp32;
};

constexpr int SKINNY_MAX_M = 64;
// Why the skinny kernel cannot take `args` (empty when it can).
const char* skinny_unsupported(const gemm_args& args);
cudaError_t launch_skinny(const gemm_args& args, cudaStream_t stream);

// Sizes of the stream-K workspace on the current device (its persistent grid); 0 on error.
int64_t stream_k_workspace_floats();
int stream_k_flags();

// Why `args` cannot run (empty when it can): strides, alignment, sizes. Checked by launch_gemm too.
const char* gemm_unsupported(const gemm_args& args);

// Enqueues on `stream`; never synchronises.
cudaError_t launch_gemm(const gemm_args& args, cudaStream_t stream);

// Blocks of the persistent grid on the current device for clusters of `cluster` (1 or 2): one per SM, or what
// the cluster occupancy query says fits at once. -1 on error. For diagnostics (benchmarks/gemm.py --cluster).
int gemm_resident_blocks(int cluster);

}  // namespace tk::gemm
