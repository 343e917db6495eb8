// RMSNorm forward and backward (rms_norm.h): memory-bound passes over rows of up to 16384 elements.
//
// A group of 256 threads owns one row at a time, each thread the same 16-byte column vectors of every row it
// visits, so the weight (and, in the backward, the weight gradient's running sums) stay in its registers for the
// whole launch. Groups walk the rows over a resident grid and load their next row while they reduce the current one
// (one barrier of their own a row). The backward's weight gradient: every block's partial sums over its rows, one
// row of fp32 scratch a block, summed in block order by a second small launch. Nothing is atomic, so repeated runs
// give the same bits.
#include "rms_norm.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>

namespace tk::norm {
namespace {

constexpr int GROUP_THREADS = 256, GROUP_WARPS = GROUP_THREADS / 32, ELEMS = 8;  // 8 16-bit elements: 16 bytes
constexpr int64_t ROW_MAX = int64_t(GROUP_THREADS) * ELEMS * 8;                   // 16384, at 8 vectors a thread

// Vectors a thread holds of each row, and groups a block, for rows of n elements: the fewest vectors that cover the
// row; small rows pack several groups into a block so that a block's partial sums cover more rows.
int vectors_for(int64_t n) {
    int v = 1;
    while (int64_t(GROUP_THREADS) * ELEMS * v < n) v *= 2;
    return v;
}
constexpr int groups_for(int v) { return v >= 4 ? 1 : 4 / v; }

template <typename T> using vec = packed<T, ELEMS>;

template <typename T, int V> struct row_slice {
    vec<T> v[V];
};

// The thread's vectors of one row (zeros past n, which must be a multiple of ELEMS).
template <typename T, int V>
__device__ __forceinline__ void load_row(row_slice<T, V>& out, const T* row, int tid, int64_t n) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int64_t col = int64_t(tid + GROUP_THREADS * j) * ELEMS;
        if (col < n) out.v[j] = load_packed<T, ELEMS>(row + col);
        else *reinterpret_cast<uint4*>(&out.v[j]) = make_uint4(0, 0, 0, 0);
    }
}

template <typename T, int V>
__device__ __forceinline__ void store_row(T* row, const row_slice<T, V>& x, int tid, int64_t n) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int64_t col = int64_t(tid + GROUP_THREADS * j) * ELEMS;
        if (col < n) *reinterpret_cast<vec<T>*>(row + col) = x.v[j];
    }
}

__device__ __forceinline__ float weight_at(const void* w, int dt, int64_t i) {
    if (dt == int(dtype::bf16)) return to_float(static_cast<const __nv_bfloat16*>(w)[i]);
    if (dt == int(dtype::fp16)) return to_float(static_cast<const __half*>(w)[i]);
    return static_cast<const float*>(w)[i];
}

// The weight as fp32 in shared memory, for every group of the block (read per row: registers are for the rows).
__device__ __forceinline__ void stage_weight(float* w, const void* weight, int dt, int64_t n) {
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) w[i] = weight_at(weight, dt, i);
    __syncthreads();
}

__device__ __forceinline__ void weight_vector(float (&out)[ELEMS], const float* w, int64_t col) {
    const float4 a = *reinterpret_cast<const float4*>(w + col), b = *reinterpret_cast<const float4*>(w + col + 4);
    out[0] = a.x, out[1] = a.y, out[2] = a.z, out[3] = a.w, out[4] = b.x, out[5] = b.y, out[6] = b.z, out[7] = b.w;
}

// f(j, e, weight) for every element e of the thread's vectors j of a row that lie before n, with the weight there.
template <int V, typename F>
__device__ __forceinline__ void for_each_weighted(const float* w, int tid, int64_t n, F&& f) {
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int64_t col = int64_t(tid + GROUP_THREADS * j) * ELEMS;
        if (col >= n) continue;
        float wv[ELEMS];
        weight_vector(wv, w, col);
#pragma unroll
        for (int e = 0; e < ELEMS; ++e) f(j, e, wv[e]);
    }
}

// The sum of `v` over the group's 256 threads, in a fixed order. `slots` alternate by row parity: a thread
// writes the slot of row i + 2 only after every thread of its group passed row i + 1's barrier, so after they
// read row i's.
template <int GROUPS>
__device__ __forceinline__ float group_sum(float v, float (&slots)[2 * GROUPS][GROUP_WARPS], int group, int parity) {
    v = warp::sum(v);
    float* slot = slots[2 * group + parity];
    if ((threadIdx.x & 31) == 0) slot[(threadIdx.x / 32) % GROUP_WARPS] = v;
    if constexpr (GROUPS == 1) __syncthreads();
    else sync::named_sync(1 + group, GROUP_THREADS);  // 0 is __syncthreads'
    float total = 0.f;
#pragma unroll
    for (int k = 0; k < GROUP_WARPS; ++k) total += slot[k];
    return total;
}

// Rows wide enough to fill a thread's registers (8 vectors) skip the next row's loads ahead.
template <int V> constexpr bool prefetch_rows = V <= 4;

template <typename T, int V, int GROUPS>
__global__ void __launch_bounds__(GROUP_THREADS* GROUPS) forward_kernel(const forward_args a) {
    __shared__ float slots[2 * GROUPS][GROUP_WARPS];
    extern __shared__ __align__(16) float w[];  // n floats
    const int group = threadIdx.x / GROUP_THREADS, tid = threadIdx.x % GROUP_THREADS;
    const int64_t step = int64_t(gridDim.x) * GROUPS, n = a.n;
    const T* x = static_cast<const T*>(a.x);
    const T* res = static_cast<const T*>(a.residual);
    pdl::start();
    stage_weight(w, a.weight, a.weight_dtype, n);
    int64_t r = int64_t(blockIdx.x) * GROUPS + group;
    row_slice<T, V> xv, rv;
    if (prefetch_rows<V> && r < a.rows) {
        load_row<T, V>(xv, x + r * a.x_stride, tid, n);
        if (res) load_row<T, V>(rv, res + r * a.residual_stride, tid, n);
    }
    for (int parity = 0; r < a.rows; r += step, parity ^= 1) {
        if (!prefetch_rows<V>) {
            load_row<T, V>(xv, x + r * a.x_stride, tid, n);
            if (res) load_row<T, V>(rv, res + r * a.residual_stride, tid, n);
        }
        // The sum is rounded to the input dtype first: the norm reads the stored residual stream.
        row_slice<T, V> sv;
        float sumsq = 0.f;
#pragma unroll
        for (int j = 0; j < V; ++j)
#pragma unroll
            for (int e = 0; e < ELEMS; ++e) {
                sv.v[j].v[e] = res ? T(to_float(xv.v[j].v[e]) + to_float(rv.v[j].v[e])) : xv.v[j].v[e];
                const float v = to_float(sv.v[j].v[e]);
                sumsq += v * v;
            }
        if (const int64_t next = r + step; prefetch_rows<V> && next < a.rows) {  // under this row's reduction
            load_row<T, V>(xv, x + next * a.x_stride, tid, n);
            if (res) load_row<T, V>(rv, res + next * a.residual_stride, tid, n);
        }
        if (res) store_row<T, V>(static_cast<T*>(a.sum) + r * a.sum_stride, sv, tid, n);
        const float rs = rsqrtf(group_sum<GROUPS>(sumsq, slots, group, parity) / float(n) + a.eps);
        if (tid == 0) a.rstd[r * a.rstd_stride] = rs;
        for_each_weighted<V>(w, tid, n, [&](int j, int e, float we) {
            sv.v[j].v[e] = T(to_float(sv.v[j].v[e]) * rs * we);
        });
        store_row<T, V>(static_cast<T*>(a.y) + r * a.y_stride, sv, tid, n);
    }
}

// Static shared memory for the groups' partial sums handed to group 0 at the end: (GROUPS - 1) rows of 2048 V.
template <int V, int GROUPS> constexpr int combine_floats = GROUPS > 1 ? (GROUPS - 1) * GROUP_THREADS * ELEMS * V : 1;

template <typename T, int V, int GROUPS>
__global__ void __launch_bounds__(GROUP_THREADS* GROUPS) backward_kernel(const backward_args a) {
    __shared__ float slots[2 * GROUPS][GROUP_WARPS];
    __shared__ __align__(16) float combine[combine_floats<V, GROUPS>];
    extern __shared__ __align__(16) float w[];  // n floats
    const int group = threadIdx.x / GROUP_THREADS, tid = threadIdx.x % GROUP_THREADS;
    const int64_t step = int64_t(gridDim.x) * GROUPS, n = a.n;
    const T* dy = static_cast<const T*>(a.grad);
    const T* in = static_cast<const T*>(a.input);
    const T* dres = static_cast<const T*>(a.residual_grad);
    pdl::start();
    stage_weight(w, a.weight, a.weight_dtype, n);
    float dw[V][ELEMS] = {};
    int64_t r = int64_t(blockIdx.x) * GROUPS + group;
    row_slice<T, V> gv, sv, gn, sn;
    if (prefetch_rows<V> && r < a.rows) {
        load_row<T, V>(gn, dy + r * a.grad_stride, tid, n);
        load_row<T, V>(sn, in + r * a.input_stride, tid, n);
    }
    for (int parity = 0; r < a.rows; r += step, parity ^= 1) {
        if (prefetch_rows<V>) {
            gv = gn, sv = sn;
        } else {
            load_row<T, V>(gv, dy + r * a.grad_stride, tid, n);
            load_row<T, V>(sv, in + r * a.input_stride, tid, n);
        }
        const float rs = a.rstd[r * a.rstd_stride];
        row_slice<T, V> rv;
        if (dres) load_row<T, V>(rv, dres + r * a.residual_grad_stride, tid, n);
        if (const int64_t next = r + step; prefetch_rows<V> && next < a.rows) {  // under this row's reduction
            load_row<T, V>(gn, dy + next * a.grad_stride, tid, n);
            load_row<T, V>(sn, in + next * a.input_stride, tid, n);
        }
        float gs = 0.f;
        for_each_weighted<V>(w, tid, n, [&gs, &dw, &gv, &sv, rs](int j, int e, float we) {
            const float d = to_float(gv.v[j].v[e]), s = to_float(sv.v[j].v[e]);
            gs += d * we * s;
            dw[j][e] += s * rs * d;
        });
        // d/ds of s * rstd * w against dy: rstd g - rstd^3 s mean(g s), g = dy w.
        const float c = -rs * rs * rs * group_sum<GROUPS>(gs, slots, group, parity) / float(n);
        for_each_weighted<V>(w, tid, n, [&gv, &sv, &rv, rs, c, dres](int j, int e, float we) {
            const float d = to_float(gv.v[j].v[e]), s = to_float(sv.v[j].v[e]);
            gv.v[j].v[e] = T(rs * (d * we) + c * s + (dres ? to_float(rv.v[j].v[e]) : 0.f));
        });
        store_row<T, V>(static_cast<T*>(a.dx) + r * a.dx_stride, gv, tid, n);
    }
    // The block's weight-gradient sums: groups 1.. hand theirs to group 0, which adds them in group order.
    if constexpr (GROUPS > 1) {
        if (group > 0) {
#pragma unroll
            for (int j = 0; j < V; ++j)
#pragma unroll
                for (int e = 0; e < ELEMS; ++e)
                    combine[(group - 1) * GROUP_THREADS * ELEMS * V + (tid + GROUP_THREADS * j) * ELEMS + e] =
                        dw[j][e];
        }
        __syncthreads();
        if (group > 0) return;
#pragma unroll
        for (int j = 0; j < V; ++j)
#pragma unroll
            for (int e = 0; e < ELEMS; ++e)
                for (int k = 0; k < GROUPS - 1; ++k)
                    dw[j][e] += combine[k * GROUP_THREADS * ELEMS * V + (tid + GROUP_THREADS * j) * ELEMS + e];
    }
    float* out = a.partial + int64_t(blockIdx.x) * n;
#pragma unroll
    for (int j = 0; j < V; ++j) {
        const int64_t col = int64_t(tid + GROUP_THREADS * j) * ELEMS;
        if (col >= n) continue;
        *reinterpret_cast<float4*>(out + col) = make_float4(dw[j][0], dw[j][1], dw[j][2], dw[j][3]);
        *reinterpret_cast<float4*>(out + col + 4) = make_float4(dw[j][4], dw[j][5], dw[j][6], dw[j][7]);
    }
}

// dw = the sum of the blocks' partial rows, in block order. A block covers 128 columns (a float4 a lane); its
// eight warps take every eighth partial row and hand their sums to warp 0.
constexpr int REDUCE_THREADS = 256, REDUCE_COLUMNS = 128;

__global__ void __launch_bounds__(REDUCE_THREADS) reduce_kernel(const float* __restrict__ partial, int64_t parts,
                                                                int64_t n, void* dw, int dt) {
    __shared__ float4 sums[REDUCE_THREADS / 32][32];
    const int lane = threadIdx.x & 31, w = threadIdx.x / 32;
    const int64_t col = int64_t(blockIdx.x) * REDUCE_COLUMNS + lane * 4;
    float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
    pdl::start();
    if (col < n) {
#pragma unroll 4
        for (int64_t p = w; p < parts; p += REDUCE_THREADS / 32) {
            const float4 v = *reinterpret_cast<const float4*>(partial + p * n + col);
            acc.x += v.x, acc.y += v.y, acc.z += v.z, acc.w += v.w;
        }
    }
    sums[w][lane] = acc;
    __syncthreads();
    if (w != 0 || col >= n) return;
    float4 t = sums[0][lane];
    for (int k = 1; k < REDUCE_THREADS / 32; ++k) {
        const float4 v = sums[k][lane];
        t.x += v.x, t.y += v.y, t.z += v.z, t.w += v.w;
    }
    const float o[4] = {t.x, t.y, t.z, t.w};
    for (int e = 0; e < 4; ++e) {
        if (dt == int(dtype::bf16)) static_cast<__nv_bfloat16*>(dw)[col + e] = __float2bfloat16(o[e]);
        else if (dt == int(dtype::fp16)) static_cast<__half*>(dw)[col + e] = __float2half(o[e]);
        else static_cast<float*>(dw)[col + e] = o[e];
    }
}

// The resident grid for `rows` rows (at least one block, at most one group a row).
template <auto Kernel>
int grid_for(int64_t rows, int groups, int64_t n) {
    if (opt_in_shared_memory<Kernel>(int(ROW_MAX * sizeof(float))) != cudaSuccess) return 0;
    const int resident = resident_blocks<Kernel>(GROUP_THREADS * groups, int(ROW_MAX * sizeof(float)));
    if (resident <= 0) return 0;
    return int(std::max<int64_t>(1, std::min<int64_t>(resident, (rows + groups - 1) / groups)));
}

template <typename T, int V>
constexpr auto backward_kernel_for() { return backward_kernel<T, V, groups_for(V)>; }

template <typename T>
int backward_grid(int64_t rows, int64_t n) {
    switch (vectors_for(n)) {
        case 1: return grid_for<backward_kernel_for<T, 1>()>(rows, groups_for(1), n);
        case 2: return grid_for<backward_kernel_for<T, 2>()>(rows, groups_for(2), n);
        case 4: return grid_for<backward_kernel_for<T, 4>()>(rows, groups_for(4), n);
        default: return grid_for<backward_kernel_for<T, 8>()>(rows, groups_for(8), n);
    }
}

template <typename T, int V>
cudaError_t launch_forward_typed(const forward_args& a, cudaStream_t stream) {
    constexpr int G = groups_for(V);
    const int grid = grid_for<forward_kernel<T, V, G>>(a.rows, G, a.n);
    if (grid == 0) return cudaErrorInvalidDevice;
    return launch_kernel(forward_kernel<T, V, G>, dim3(grid), dim3(GROUP_THREADS * G), size_t(a.n) * sizeof(float),
                         stream, 1, a);
}

template <typename T, int V>
cudaError_t launch_backward_typed(const backward_args& a, cudaStream_t stream) {
    constexpr int G = groups_for(V);
    const int grid = grid_for<backward_kernel<T, V, G>>(a.rows, G, a.n);
    if (grid == 0) return cudaErrorInvalidDevice;
    if (cudaError_t e = launch_kernel(backward_kernel<T, V, G>, dim3(grid), dim3(GROUP_THREADS * G),
                                      size_t(a.n) * sizeof(float), stream, 1, a);
        e != cudaSuccess)
        return e;
    const unsigned blocks = unsigned((a.n + REDUCE_COLUMNS - 1) / REDUCE_COLUMNS);
    return launch_kernel(reduce_kernel, dim3(blocks), dim3(REDUCE_THREADS), 0, stream, 1, a.partial, int64_t(grid), a.n,
                         a.dw, a.weight_dtype);
}

template <typename Args, cudaError_t (*Typed1)(const Args&, cudaStream_t), cudaError_t (*Typed2)(const Args&, cudaStream_t),
          cudaError_t (*Typed4)(const Args&, cudaStream_t), cudaError_t (*Typed8)(const Args&, cudaStream_t)>
cudaError_t by_width(const Args& a, cudaStream_t stream) {
    switch (vectors_for(a.n)) {
        case 1: return Typed1(a, stream);
        case 2: return Typed2(a, stream);
        case 4: return Typed4(a, stream);
        default: return Typed8(a, stream);
    }
}

bool activation_dtype(int dt) { return dt == int(dtype::bf16) || dt == int(dtype::fp16); }
bool weight_dtype(int dt) { return activation_dtype(dt) || dt == int(dtype::fp32); }

// One (rows, n) operand: 16-byte aligned, rows a whole number of 16-byte vectors apart and not overlapping.
const char* rows_problem(const void* p, int64_t stride, int64_t rows, int64_t n) {
    if (p == nullptr) return "a row operand is missing";
    if (!is_aligned(p, 16)) return "every row operand must start on a 16-byte boundary";
    if (rows > 1 && (stride % ELEMS != 0 || stride < n))
        return "row strides must be multiples of 8 elements and at least n (rows may not overlap)";
    return nullptr;
}

const char* shape_problem(int64_t rows, int64_t n, int dt, int wdt) {
    if (!activation_dtype(dt)) return "the activations must be bfloat16 or float16";
    if (!weight_dtype(wdt)) return "the weight must be bfloat16, float16 or float32";
    if (rows < 0) return "rows must not be negative";
    if (n <= 0 || n % ELEMS != 0) return "the normalized size must be a positive multiple of 8";
    if (n > ROW_MAX) return "the normalized size must be at most 16384";
    return nullptr;
}

}  // namespace

const char* forward_unsupported(const forward_args& a) {
    if (const char* why = shape_problem(a.rows, a.n, a.dtype, a.weight_dtype)) return why;
    if (a.weight == nullptr) return "the weight is missing";
    if (a.rows == 0) return nullptr;
    if (a.rstd == nullptr) return "rstd is missing";
    if (const char* why = rows_problem(a.x, a.x_stride, a.rows, a.n)) return why;
    if (const char* why = rows_problem(a.y, a.y_stride, a.rows, a.n)) return why;
    if (a.residual != nullptr) {
        if (const char* why = rows_problem(a.residual, a.residual_stride, a.rows, a.n)) return why;
        if (const char* why = rows_problem(a.sum, a.sum_stride, a.rows, a.n)) return why;
    }
    return nullptr;
}

const char* backward_unsupported(const backward_args& a) {
    if (const char* why = shape_problem(a.rows, a.n, a.dtype, a.weight_dtype)) return why;
    if (a.weight == nullptr || a.dw == nullptr) return "the weight and its gradient are needed";
    if (a.partial == nullptr || !is_aligned(a.partial, 16)) return "the fp32 scratch must be given, 16-byte aligned";
    if (a.rows == 0) return nullptr;
    if (a.rstd == nullptr) return "rstd is missing";
    if (const char* why = rows_problem(a.grad, a.grad_stride, a.rows, a.n)) return why;
    if (const char* why = rows_problem(a.input, a.input_stride, a.rows, a.n)) return why;
    if (const char* why = rows_problem(a.dx, a.dx_stride, a.rows, a.n)) return why;
    if (a.residual_grad != nullptr) {
        if (const char* why = rows_problem(a.residual_grad, a.residual_grad_stride, a.rows, a.n)) return why;
    }
    return nullptr;
}

int64_t backward_partial_rows(int64_t rows, int64_t n, int dt) {
    if (shape_problem(rows, n, dt, int(dtype::fp32)) != nullptr) return 0;
    return dt == int(dtype::bf16) ? backward_grid<__nv_bfloat16>(rows, n) : backward_grid<__half>(rows, n);
}

cudaError_t launch_forward(const forward_args& a, cudaStream_t stream) {
    if (forward_unsupported(a) != nullptr) return cudaErrorInvalidValue;
    if (a.rows == 0) return cudaSuccess;
    if (a.dtype == int(dtype::bf16))
        return by_width<forward_args, launch_forward_typed<__nv_bfloat16, 1>, launch_forward_typed<__nv_bfloat16, 2>,
                        launch_forward_typed<__nv_bfloat16, 4>, launch_forward_typed<__nv_bfloat16, 8>>(a, stream);
    return by_width<forward_args, launch_forward_typed<__half, 1>, launch_forward_typed<__half, 2>,
                    launch_forward_typed<__half, 4>, launch_forward_typed<__half, 8>>(a, stream);
}

cudaError_t launch_backward(const backward_args& a, cudaStream_t stream) {
    if (backward_unsupported(a) != nullptr) return cudaErrorInvalidValue;
    if (a.dtype == int(dtype::bf16))
        return by_width<backward_args, launch_backward_typed<__nv_bfloat16, 1>,
                        launch_backward_typed<__nv_bfloat16, 2>, launch_backward_typed<__nv_bfloat16, 4>,
                        launch_backward_typed<__nv_bfloat16, 8>>(a, stream);
    return by_width<backward_args, launch_backward_typed<__half, 1>, launch_backward_typed<__half, 2>,
                    launch_backward_typed<__half, 4>, launch_backward_typed<__half, 8>>(a, stream);
}

}  // namespace tk::norm
