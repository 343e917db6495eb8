// One block per row. The forward keeps a running (max, sum of exp) per thread over 16-byte vectors (online softmax
// normaliser), merges them across the block and finishes the row's log-sum-exp and loss; the backward streams the
// row again and writes softmax - one-hot, times the row's incoming gradient. Both are memory-bound: 16-byte loads,
// four in flight per thread; the elements before a row's first 16-byte boundary and after its last whole vector go
// one by one.
#include "cross_entropy.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace tk::loss {
namespace {

constexpr int THREADS = 512;
constexpr int UNROLL = 4;  // vectors in flight per thread
constexpr float LOG2E = 1.4426950408889634f;

template <typename T>
struct vec {
    static constexpr int n = 16 / sizeof(T);  // elements per 16-byte vector
    uint4 raw;
    __device__ __forceinline__ float at(int i) const {
        if constexpr (std::is_same_v<T, float>) {
            return reinterpret_cast<const float*>(&raw)[i];
        } else {
            return to_float(reinterpret_cast<const T*>(&raw)[i]);
        }
    }
    __device__ __forceinline__ void set(int i, float x) { reinterpret_cast<T*>(&raw)[i] = T(x); }
};

// Running softmax normaliser: the maximum so far and the sum of exp(x - max). exp(y) is taken as exp2(y log2 e) with y
// = x - max formed first, so large logits lose no accuracy to the scaling.
__device__ __forceinline__ float exp_of(float y) { return exp2f(y * LOG2E); }

struct normaliser {
    float max = -INFINITY, sum = 0.f;
    __device__ __forceinline__ void add(float x) {
        if (x > max) {
            sum = sum * exp_of(max - x) + 1.f;  // exp(-inf) = 0 for the first finite value
            max = x;
        } else if (x != -INFINITY) {  // -inf adds nothing (and -inf - -inf would be NaN); NaN carries on
            sum += exp_of(x - max);
        }
    }
    // A 16-byte vector: one rescale per vector, its maximum folded in first.
    template <typename T>
    __device__ __forceinline__ void add(const vec<T>& v) {
        float m = -INFINITY;
#pragma unroll
        for (int e = 0; e < vec<T>::n; ++e) m = fmaxf(m, v.at(e));
        if (m > max) {
            sum = max == -INFINITY ? 0.f : sum * exp_of(max - m);
            max = m;
        }
        if (max != -INFINITY) {  // exp(-inf - finite) = 0; a NaN element makes the sum NaN
#pragma unroll
            for (int e = 0; e < vec<T>::n; ++e) sum += exp_of(v.at(e) - max);
        }
    }
    __device__ __forceinline__ void merge(float other_max, float other_sum) {
        const float m = fmaxf(max, other_max);
        if (m == -INFINITY) return;  // both empty
        sum = (max == -INFINITY ? 0.f : sum * exp_of(max - m)) +
              (other_max == -INFINITY ? 0.f : other_sum * exp_of(other_max - m));
        max = m;
    }
};

template <typename T>
__device__ __forceinline__ const T* row_of(const cross_entropy_args& a, int64_t r) {
    return static_cast<const T*>(a.logits) + r * a.logits_row_stride;
}

// Elements before the row's first 16-byte boundary (at most C): they and the tail after the last whole vector go
// element by element, the rest in 16-byte vectors. (Rows of an odd vocabulary, e.g. 50257, start at every 2-byte
// offset in turn.)
template <typename T>
__device__ __forceinline__ int64_t head_of(const void* row, int64_t C) {
    return min(C, int64_t((16 - reinterpret_cast<uintptr_t>(row) % 16) % 16 / sizeof(T)));
}

// One thread's share of a row of C elements at x: whole 16-byte vectors from the first 16-byte boundary on (UNROLL
// loads in flight, then one at a time), then the `head` elements before that boundary and the tail after the last
// whole vector, element by element. vector(v, i) gets the row's i-th vector (its first class is head + i * N),
// element(value, c) the value of class c.
template <typename T, class Vector, class Element>
__device__ __forceinline__ void walk_row(const T* x, int64_t C, int64_t head, int64_t vectors, Vector vector,
                                         Element element) {
    const uint4* xv = reinterpret_cast<const uint4*>(x + head);
    int64_t i = threadIdx.x;
    for (; i + (UNROLL - 1) * THREADS < vectors; i += UNROLL * THREADS) {
        vec<T> v[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) v[u].raw = __ldcs(xv + i + u * THREADS);
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) vector(v[u], i + u * THREADS);
    }
    for (; i < vectors; i += THREADS) {
        vec<T> v;
        v.raw = __ldcs(xv + i);
        vector(v, i);
    }
    for (int64_t c = threadIdx.x; c < head; c += THREADS) element(to_float(x[c]), c);
    for (int64_t c = head + vectors * vec<T>::n + threadIdx.x; c < C; c += THREADS) element(to_float(x[c]), c);
}

template <typename T>
__global__ void __launch_bounds__(THREADS) forward_kernel(const __grid_constant__ cross_entropy_args a) {
    pdl::start();
    const int64_t r = blockIdx.x;
    const T* x = row_of<T>(a, r);
    const int64_t C = a.classes;
    normaliser nm;
    constexpr int N = vec<T>::n;
    const int64_t head = head_of<T>(x, C), vectors = (C - head) / N;
    walk_row<T>(
        x, C, head, vectors,
        [&](const vec<T>& v, int64_t) { nm.add(v); },
        [&](float value, int64_t) { nm.add(value); });
    const int64_t t = a.target[r];  // issued before the merge, whose waits hide its latency
    // The threads' normalisers merged: the warps' by shuffles, then the warps' results through shared memory.
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const float om = __shfl_xor_sync(0xffffffffu, nm.max, offset);
        const float os = __shfl_xor_sync(0xffffffffu, nm.sum, offset);
        nm.merge(om, os);
    }
    __shared__ float warp_max[THREADS / 32], warp_sum[THREADS / 32];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    if (lane == 0) {
        warp_max[warp] = nm.max;
        warp_sum[warp] = nm.sum;
    }
    __syncthreads();
    if (threadIdx.x != 0) return;
    normaliser total;
    for (int w = 0; w < THREADS / 32; ++w) total.merge(warp_max[w], warp_sum[w]);
    // A row of -inf gives lse -inf; a NaN anywhere gives NaN (fmaxf skips NaN, so the sum carries it).
    const float lse = total.max + logf(total.sum);
    a.lse[r] = lse;
    // A target outside [0, classes): NaN (PyTorch asserts on the device; here the row's loss says it).
    a.loss[r] = t == a.ignore_index ? 0.f : (t < 0 || t >= C) ? NAN : lse - to_float(x[t]);
}

template <typename T>
__global__ void __launch_bounds__(THREADS, 4) backward_kernel(const __grid_constant__ cross_entropy_args a) {
    pdl::start();
    const int64_t r = blockIdx.x;
    const T* x = row_of<T>(a, r);
    T* g = static_cast<T*>(a.grad) + r * a.grad_row_stride;
    const int64_t C = a.classes;
    const int64_t t = a.target[r];
    constexpr int N = vec<T>::n;
    // Vectors where the logits and gradient rows are equally far from a 16-byte boundary (contiguous rows of one
    // width always are); otherwise element by element.
    const bool vector = reinterpret_cast<uintptr_t>(x) % 16 == reinterpret_cast<uintptr_t>(g) % 16;
    const int64_t head = vector ? head_of<T>(x, C) : C, vectors = vector ? (C - head) / N : 0;
    const int64_t tail = head + vectors * N;  // first element after the vectors
    if (t == a.ignore_index) {  // an ignored row's gradient is zero
        for (int64_t i = threadIdx.x; i < vectors; i += THREADS)
            reinterpret_cast<uint4*>(g + head)[i] = make_uint4(0, 0, 0, 0);
        for (int64_t c = threadIdx.x; c < head; c += THREADS) g[c] = T(0.f);
        for (int64_t c = tail + threadIdx.x; c < C; c += THREADS) g[c] = T(0.f);
        return;
    }
    const float scale = a.grad_loss[r * a.grad_loss_stride];
    const float lse = a.lse[r];
    auto grad_of = [&](float xv, int64_t c) {
        const float p = exp_of(xv - lse);
        return scale * (c == t ? p - 1.f : p);
    };
    uint4* gv = reinterpret_cast<uint4*>(g + head);
    walk_row<T>(
        x, C, head, vectors,
        [&](const vec<T>& v, int64_t i) {
            vec<T> o;
#pragma unroll
            for (int e = 0; e < N; ++e) o.set(e, grad_of(v.at(e), head + i * N + e));
            __stcs(gv + i, o.raw);
        },
        [&](float value, int64_t c) { g[c] = T(grad_of(value, c)); });
}

// Forward and gradient from one read of the logits (launch_cross_entropy_forward_grad), each row split over the
// blocks of a cluster (one block where the row fits one part): each block copies its part of the row (at most
// part_bytes) into shared memory with one bulk copy, folds it into a (max, sum of exp) pair, pushes the pair into every
// peer's shared memory, and after one cluster barrier each block has the row's log-sum-exp. It then writes softmax -
// one-hot over its part in place and stores the part with one bulk copy. The gradient is not scaled by the incoming
// one: that scales the rows of the GEMMs that read it (dX = g (D W), dW = D^T (g X)). Parts of at most 64 KB let three
// blocks share an SM, so one block's copies run while another computes (a whole row in one 1024-thread block per SM
// left the SM's loads idle while it reduced and wrote: benchmarks/NOTES.md, session 38).
constexpr int SPLIT_THREADS = 256, SPLIT_MAX_PARTS = 8;  // 8: the portable cluster size
constexpr int SPLIT_SMEM_BYTES_MAX = 200 * 1024;

template <typename T>
__global__ void __launch_bounds__(SPLIT_THREADS) forward_grad_split_kernel(const __grid_constant__ cross_entropy_args a,
                                                                          const int part_vectors) {
    extern __shared__ __align__(128) uint4 part[];
    __shared__ sync::barrier loaded;
    __shared__ float2 pairs[SPLIT_MAX_PARTS];  // (max, sum) of every block of the cluster, pushed by each
    __shared__ float warp_part[SPLIT_THREADS / 32];
    constexpr int N = vec<T>::n;
    const uint32_t parts = sync::cluster_size(), rank = sync::cluster_rank();
    const int64_t r = blockIdx.x / parts;
    const int64_t C = a.classes, first = int64_t(rank) * part_vectors * N;  // first class of this part
    const int n = int(max(int64_t(0), min(int64_t(part_vectors), (C - first) / N)));  // vectors in this part
    const T* x = row_of<T>(a, r) + first;
    if (threadIdx.x == 0) {
        sync::init(loaded, 1);
        sync::fence_init();
    }
    __syncthreads();
    pdl::start();  // set up under the previous kernel's tail; from here on global memory
    if (threadIdx.x == 0 && n > 0) {
        sync::arrive_expect_bytes(loaded, uint32_t(n) * 16);
        tma::load_bytes(part, x, uint32_t(n) * 16, loaded);
    }
    sync::cluster_arrive_relaxed();  // this block runs: peers may push into it once they have waited
    const int64_t t = a.target[r];
    const bool ignored = t == a.ignore_index, mine = t >= first && t < first + int64_t(n) * N;
    if (n > 0) sync::wait(loaded, 0);

    auto reduce = [&](float v, bool is_max) {  // over the block; every thread gets the result
#pragma unroll
        for (int o = 16; o > 0; o /= 2) {
            const float w = __shfl_xor_sync(0xffffffffu, v, o);
            v = is_max ? fmaxf(v, w) : v + w;
        }
        if (threadIdx.x % 32 == 0) warp_part[threadIdx.x / 32] = v;
        __syncthreads();
        v = warp_part[0];
#pragma unroll
        for (int w = 1; w < SPLIT_THREADS / 32; ++w) v = is_max ? fmaxf(v, warp_part[w]) : v + warp_part[w];
        __syncthreads();  // warp_part is reused by the next reduction
        return v;
    };
    float m = -INFINITY;
    for (int i = threadIdx.x; i < n; i += SPLIT_THREADS) {
        vec<T> v;
        v.raw = part[i];
#pragma unroll
        for (int e = 0; e < N; ++e) m = fmaxf(m, v.at(e));  // fmaxf skips NaN: the sum below carries it
    }
    m = reduce(m, true);
    float sum = 0.f;
    if (m != -INFINITY) {  // a part of -inf (or none) adds nothing; -inf - -inf would be NaN
        for (int i = threadIdx.x; i < n; i += SPLIT_THREADS) {
            vec<T> v;
            v.raw = part[i];
#pragma unroll
            for (int e = 0; e < N; ++e) sum += exp_of(v.at(e) - m);
        }
    }
    sum = reduce(sum, false);
    // The target's logit, read before the gradient overwrites the part.
    const float x_t = mine ? to_float(reinterpret_cast<const T*>(part)[t - first]) : 0.f;
    sync::cluster_wait();
    if (threadIdx.x < parts) sync::store_cluster(&pairs[rank], threadIdx.x, m, sum);
    sync::cluster_sync();  // every block's pair is in every block
    normaliser total;
    for (uint32_t p = 0; p < parts; ++p) total.merge(pairs[p].x, pairs[p].y);
    const float lse = total.max + logf(total.sum);  // all -inf: -inf; a NaN anywhere: NaN
    if (threadIdx.x == 0) {
        if (rank == 0) a.lse[r] = lse;
        // A target outside [0, classes): NaN (PyTorch asserts on the device; here the row's loss says it).
        if (ignored && rank == 0) a.loss[r] = 0.f;
        else if (!ignored && (t < 0 || t >= C) && rank == 0) a.loss[r] = NAN;
        else if (!ignored && mine) a.loss[r] = lse - x_t;
    }
    for (int i = threadIdx.x; i < n; i += SPLIT_THREADS) {
        vec<T> v, o;
        v.raw = part[i];
        if (ignored) {
            o.raw = make_uint4(0, 0, 0, 0);
        } else {
#pragma unroll
            for (int e = 0; e < N; ++e) {
                const float p = exp_of(v.at(e) - lse);
                o.set(e, first + int64_t(i) * N + e == t ? p - 1.f : p);
            }
        }
        part[i] = o.raw;
    }
    tma::fence_shared_to_async();
    __syncthreads();
    if (threadIdx.x == 0 && n > 0) {
        tma::store_bytes(static_cast<T*>(a.grad) + r * a.grad_row_stride + first, part, uint32_t(n) * 16);
        tma::store_commit();
        tma::store_wait_read();  // the part stays valid until the copy has read it
    }
}

// Parts per row (a power of two up to SPLIT_MAX_PARTS) and 16-byte vectors per part: the fewest parts of at most
// min(part_bytes, SPLIT_SMEM_BYTES_MAX) bytes each, or SPLIT_MAX_PARTS parts of whatever size (0 parts: the row does
// not fit). The cap keeps every row up to cross_entropy_forward_grad_max_classes launchable whatever part_bytes asks.
struct split_plan {
    int parts, part_vectors;
};
split_plan plan_split(int64_t classes, int elements_per_vector, int part_bytes) {
    const int64_t vectors = classes / elements_per_vector, largest_part = std::min(part_bytes, SPLIT_SMEM_BYTES_MAX);
    int parts = 1;
    while (parts < SPLIT_MAX_PARTS && (vectors + parts - 1) / parts * 16 > largest_part) parts *= 2;
    const int64_t per_part = (vectors + parts - 1) / parts;
    if (per_part * 16 > SPLIT_SMEM_BYTES_MAX) return {0, 0};
    return {parts, int(per_part)};
}

// Checked by cross_entropy_forward_grad_unsupported: the row fits (plan.parts > 0), at most 2^31 - 1 blocks.
template <typename T>
cudaError_t launch_forward_grad(const cross_entropy_args& a, int part_bytes, cudaStream_t stream) {
    if (a.rows == 0) return cudaSuccess;
    const split_plan plan = plan_split(a.classes, vec<T>::n, part_bytes);
    if (cudaError_t e = opt_in_shared_memory<forward_grad_split_kernel<T>>(SPLIT_SMEM_BYTES_MAX); e != cudaSuccess)
        return e;
    return launch_kernel(forward_grad_split_kernel<T>, dim3(unsigned(a.rows * plan.parts)), dim3(SPLIT_THREADS),
                         size_t(plan.part_vectors) * 16, stream, unsigned(plan.parts), a, plan.part_vectors);
}

template <typename T>
cudaError_t launch(const cross_entropy_args& a, bool backward, cudaStream_t stream) {
    if (a.rows == 0) return cudaSuccess;
    const dim3 grid(unsigned(a.rows));
    return launch_kernel(backward ? backward_kernel<T> : forward_kernel<T>, grid, dim3(THREADS), 0, stream, 1, a);
}

cudaError_t dispatch(const cross_entropy_args& a, bool backward, cudaStream_t stream) {
    if (cross_entropy_unsupported(a, backward) != nullptr) return cudaErrorInvalidValue;
    switch (dtype(a.dtype)) {
        case dtype::bf16: return launch<__nv_bfloat16>(a, backward, stream);
        case dtype::fp16: return launch<__half>(a, backward, stream);
        default: return launch<float>(a, backward, stream);
    }
}

// Elements of a dtype code per 16-byte vector.
int64_t elements_per_vector(int dtype_code) { return dtype_code == int(dtype::fp32) ? 4 : 8; }

}  // namespace

const char* cross_entropy_unsupported(const cross_entropy_args& a, bool backward) {
    if (a.dtype != int(dtype::bf16) && a.dtype != int(dtype::fp16) && a.dtype != int(dtype::fp32))
        return "logits dtype must be bfloat16, float16 or float32";
    if (a.rows < 0 || a.classes <= 0) return "rows must be >= 0 and classes > 0";
    if (a.rows > 0x7fffffff) return "more than 2^31 - 1 rows";
    if (a.rows > 0 && (a.logits == nullptr || a.target == nullptr)) return "logits and target are required";
    if (a.logits_row_stride < 0) return "logits row stride must be >= 0";  // overlapping rows (an expand) are only read
    if (!backward && a.rows > 0 && (a.loss == nullptr || a.lse == nullptr)) return "loss and lse outputs are required";
    if (backward && a.rows > 0) {
        if (a.lse == nullptr || a.grad_loss == nullptr || a.grad == nullptr) return "lse, grad_loss and grad are required";
        if (a.grad_row_stride < a.classes && a.rows > 1) return "grad rows overlap (row stride < classes)";
        if (a.grad_loss_stride < 0) return "grad_loss stride must be >= 0";
    }
    return nullptr;
}

cudaError_t launch_cross_entropy_forward(const cross_entropy_args& args, cudaStream_t stream) {
    return dispatch(args, false, stream);
}

cudaError_t launch_cross_entropy_backward(const cross_entropy_args& args, cudaStream_t stream) {
    return dispatch(args, true, stream);
}

const char* cross_entropy_forward_grad_unsupported(const cross_entropy_args& a, int part_bytes) {
    if (part_bytes <= 0) return "part_bytes (the most bytes of a row one block of the cluster holds) must be > 0";
    if (const char* why = cross_entropy_unsupported(a, false)) return why;
    if (a.rows > 0 && a.grad == nullptr) return "grad is required";
    const int64_t n = elements_per_vector(a.dtype);
    if (a.classes % n || (a.rows > 1 && (a.logits_row_stride % n || a.grad_row_stride % n)))
        return "rows of whole 16-byte vectors (classes and row strides a multiple of 16 bytes)";
    if (reinterpret_cast<uintptr_t>(a.logits) % 16 || reinterpret_cast<uintptr_t>(a.grad) % 16)
        return "logits and grad 16-byte aligned";
    // In place: each block reads its whole row (or part of it) before it writes that gradient, so grad may be the
    // logits themselves, row for row (rows that overlap would be read by one block while another writes them).
    if (a.grad == a.logits && a.rows > 1 && (a.grad_row_stride != a.logits_row_stride || a.logits_row_stride < a.classes))
        return "grad written over the logits needs the logits' row stride, with rows that do not overlap";
    if (a.classes > cross_entropy_forward_grad_max_classes(a.dtype)) return "a row too long to keep on chip";
    if (a.rows * plan_split(a.classes, int(n), part_bytes).parts > 0x7fffffff)
        return "more than 2^31 - 1 blocks (rows times parts of a row)";
    return nullptr;
}

int64_t cross_entropy_forward_grad_max_classes(int dtype_code) {
    return int64_t(SPLIT_MAX_PARTS) * (SPLIT_SMEM_BYTES_MAX / 16) * elements_per_vector(dtype_code);
}

cudaError_t launch_cross_entropy_forward_grad(const cross_entropy_args& args, cudaStream_t stream, int part_bytes) {
    if (cross_entropy_forward_grad_unsupported(args, part_bytes) != nullptr) return cudaErrorInvalidValue;
    switch (dtype(args.dtype)) {
        case dtype::bf16: return launch_forward_grad<__nv_bfloat16>(args, part_bytes, stream);
        case dtype::fp16: return launch_forward_grad<__half>(args, part_bytes, stream);
        default: return launch_forward_grad<float>(args, part_bytes, stream);
    }
}

}  // namespace tk::loss
