// Kernels that exercise single primitives of the tile library (csrc/kittens/) against torch, for the GPU unit
// tests (tests/gpu/test_kittens.py). The executor never calls them. Host-visible declarations only.
#pragma once

#include <cstdint>
#include <cuda_runtime_api.h>

namespace tk::selftest {

// One warpgroup, a 64 x cols fp32 tile (row-major, cols 64, 128 or 256) in the wgmma accumulator layout:
// out = softmax over each row; row_max and row_sum (64 each) = the row maxima and the sums of exp(x - max),
// passed through shared vectors on the way out.
cudaError_t row_softmax(const float* in, float* out, float* row_max, float* row_sum, int cols, cudaStream_t stream);

// out (64 x n, fp32) = A (64 x 64, fp32, rounded to dtype in registers and used as wgmma's register operand)
// times B^T, B an n x 64 operand (n 64, 128 or 256) stored K-major ((n, 64) row-major) or MN-major ((64, n)
// row-major), dtype bf16 or fp16, written into shared memory in TMA's swizzled layout by the threads.
cudaError_t mma_registers_a(const float* a, const void* b, float* out, int n, bool b_mn_major, int dtype,
                            cudaStream_t stream);

// dst (rows x cols, row stride `stride`, dtype fp32 or bf16) += src (a 64-row tile of 128 bytes per row,
// contiguous) at (row0, col0), by one TMA reduce-store; parts outside dst are dropped.
cudaError_t reduce_add(void* dst, const void* src, int dtype, int64_t rows, int64_t cols, int64_t stride, int row0,
                       int col0, cudaStream_t stream);

// out (64 x cols, dtype bf16 or fp16, row-major) = in (64 x cols fp32, row-major) rounded, on the way through the
// wgmma accumulator layout in registers, stmatrix (rt::store_matrices_x4) into 128-byte-swizzled 64-column panels of
// shared memory, and plain reads of those panels; cols 64, 128 or 256.
cudaError_t store_matrices(const float* in, void* out, int cols, int dtype, cudaStream_t stream);

// out (64 x cols, dtype bf16 or fp16, row-major) = in, on the way through 128-byte-swizzled 64-column panels of
// shared memory, ldmatrix into a register A fragment (rt::load_swizzled), and stores from each register's place in
// the fragment layout; cols 64 or 128.
cudaError_t load_matrices(const void* in, void* out, int cols, int dtype, cudaStream_t stream);

// out[b * threads + i] = block_sum<threads> over in[b * threads ... (b + 1) * threads), as thread i of block b
// returns it: `blocks` blocks of `threads` threads (32, 256 or 1024), each summing twice with one set of slots.
cudaError_t block_sum(const float* in, float* out, int blocks, int threads, cudaStream_t stream);

// A launch that fails: a kernel enqueued by tk::launch_kernel with 2048 threads a block (the limit is 1024), so that
// the tests can check what a failed tk launch leaves behind. Returns the launch's error; nothing runs.
cudaError_t failed_launch(cudaStream_t stream);

}  // namespace tk::selftest
