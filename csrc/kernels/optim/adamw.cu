// AdamW over many tensors in one launch. torch's fused AdamW (multi_tensor_apply) moves 8 bytes of each tensor per
// thread and iteration, in 72 launches of at most 320 blocks of 512 threads for Llama-3.2-1B's 1.5 B parameters:
// 2.7 TB/s on an H200 in bf16 (7.8 ms). Here each thread has a 16-byte load of all four tensors in flight, on a grid
// of four 256-thread blocks an SM that walks the tensors' chunks in order; the table of tensors is the kernel's
// parameter, so nothing is copied to the GPU first and a launch can be captured in a graph.
#include "adamw.h"
#include "../../kittens/kittens.cuh"
#include "../../kittens/multi_tensor.cuh"

#include <algorithm>

namespace tk::optim {
namespace {

constexpr int THREADS = 256;
constexpr int BATCH = 256;  // tensors per launch: their table is the kernel's parameter (12.4 KB of the 32 KB allowed)

struct batch {
    void* param[BATCH];
    const void* grad[BATCH];
    void* exp_avg[BATCH];
    void* exp_avg_sq[BATCH];
    chunk_index<BATCH> index;  // aligned: all four tensors of an entry start on 16-byte boundaries
    adamw_hyper h;
};

// torch's FusedAdamMathFunctor (ADAMW mode, no AMSGrad, no gradient scale) operation for operation, fma where it
// has fma, in fp32: the same bits as torch 2.11's torch.optim.AdamW(fused=True) for the same inputs (older torch
// computed parts of it in double).
struct update {
    float lr, beta1, beta2, eps, weight_decay, step_size, bias_correction2_sqrt;
    float clip_coef;  // the gradients' factor where clipping (clip)
    bool maximize, clip;

    // A gradient as the update reads it: clipped as torch's `grad.mul_(factor)` on the GPU leaves it, the product of
    // the gradient and the factor in T (clip_coef is T's already) rounded to T.
    template <typename T>
    __device__ __forceinline__ float grad(T g) const {
        return clip ? to_float(T(to_float(g) * clip_coef)) : to_float(g);
    }

    __device__ __forceinline__ void operator()(float& param, float grad, float& exp_avg, float& exp_avg_sq) const {
        if (maximize) grad = -grad;
        if (weight_decay != 0) param -= lr * weight_decay * param;
        exp_avg = fmaf(beta1, exp_avg, fmaf(-beta1, grad, grad));
        exp_avg_sq = fmaf(beta2, exp_avg_sq, fmaf(-beta2, grad * grad, grad * grad));
        const float denom = (sqrtf(exp_avg_sq) / bias_correction2_sqrt) + eps;
        param -= step_size * exp_avg / denom;
    }
};

template <typename T>
__device__ __forceinline__ void update_one(const update& u, T* p, const T* g, T* m, T* v) {
    float fp = to_float(*p), fm = to_float(*m), fv = to_float(*v);
    u(fp, u.grad(*g), fm, fv);
    *p = T(fp);
    *m = T(fm);
    *v = T(fv);
}

// Where chunk c lies: its tensor's four pointers advanced to the chunk, its element count, and whether the
// 16-byte path applies. `t` is the tensor of an earlier chunk (chunks are taken in increasing order).
template <typename T, int CHUNK>
struct chunk_ref {
    T* p;
    const T* g;
    T* m;
    T* v;
    int n;
    bool vector;

    __device__ __forceinline__ chunk_ref(const batch& b, int64_t c, int& t) {
        const auto at = b.index.template locate<CHUNK>(c, t);
        n = at.n;
        vector = at.aligned;
        p = static_cast<T*>(b.param[t]) + at.start;
        g = static_cast<const T*>(b.grad[t]) + at.start;
        m = static_cast<T*>(b.exp_avg[t]) + at.start;
        v = static_cast<T*>(b.exp_avg_sq[t]) + at.start;
    }
};

// A block's unit of work: one 16-byte vector of each tensor a thread.
template <typename T> constexpr int chunk_elems = THREADS * vec16_elems<T>;

template <typename T>
struct chunk_regs {
    packed<T, vec16_elems<T>> p, g, m, v;
};

template <typename T, int CHUNK>
__device__ __forceinline__ void load_chunk(const chunk_ref<T, CHUNK>& r, chunk_regs<T>& x) {
    constexpr int V = vec16_elems<T>;
    const int i = threadIdx.x;
    if (i < r.n / V) {
        x.p = load_packed<T, V>(r.p + i * V);
        x.g = load_packed<T, V>(r.g + i * V);
        x.m = load_packed<T, V>(r.m + i * V);
        x.v = load_packed<T, V>(r.v + i * V);
    }
}

template <typename T, int CHUNK>
__device__ __forceinline__ void update_chunk(const update& u, const chunk_ref<T, CHUNK>& r, chunk_regs<T>& x) {
    constexpr int V = vec16_elems<T>;
    const int vecs = r.n / V, i = threadIdx.x;
    if (i < vecs) {
#pragma unroll
        for (int j = 0; j < V; ++j) {
            float fp = to_float(x.p.v[j]), fm = to_float(x.m.v[j]), fv = to_float(x.v.v[j]);
            u(fp, u.grad(x.g.v[j]), fm, fv);
            x.p.v[j] = T(fp);
            x.m.v[j] = T(fm);
            x.v.v[j] = T(fv);
        }
        *reinterpret_cast<packed<T, V>*>(r.p + i * V) = x.p;
        *reinterpret_cast<packed<T, V>*>(r.m + i * V) = x.m;
        *reinterpret_cast<packed<T, V>*>(r.v + i * V) = x.v;
    }
    const int tail = vecs * V + i;  // the tensor's last n % V elements
    if (tail < r.n) update_one(u, r.p + tail, r.g + tail, r.m + tail, r.v + tail);
}

template <typename T, int CHUNK>
__device__ __forceinline__ void update_scalar(const update& u, const chunk_ref<T, CHUNK>& r) {
    for (int i = threadIdx.x; i < r.n; i += THREADS) update_one(u, r.p + i, r.g + i, r.m + i, r.v + i);
}

__device__ __forceinline__ update make_update(const adamw_hyper& h) {
    update u;
    u.lr = h.lr;
    u.beta1 = h.beta1;
    u.beta2 = h.beta2;
    u.eps = h.eps;
    u.weight_decay = h.weight_decay;
    u.maximize = h.maximize;
    // As torch: the bias corrections from the float step count, by powf and sqrtf.
    const float bias_correction1 = 1 - powf(h.beta1, h.step);
    u.bias_correction2_sqrt = sqrtf(1 - powf(h.beta2, h.step));
    u.step_size = h.lr / bias_correction1;
    u.clip = false;
    u.clip_coef = 1.f;
    return u;
}

// torch.nn.utils.clip_grad_norm_'s factor from the squared norm, its operations in its order: the norm, plus
// 1e-6, its reciprocal times max_norm (Python's `max_norm / tensor`), clamped to at most 1 (NaN stays NaN). Read
// after the grid before (which wrote the norm) is done.
__device__ __forceinline__ float clip_coefficient(const adamw_hyper& h) {
    const float coef = (1.f / (sqrtf(*h.clip_sq_norm) + 1e-6f)) * h.clip_max_norm;
    return coef > 1.f ? 1.f : coef;
}

// One 16-byte vector of each tensor a thread per chunk, four blocks an SM: on an H200 this moved Llama-3.2-1B's
// update at 3.6-3.9 TB/s in bf16, where two vectors a thread (116 registers, two blocks an SM) were 11-16% slower,
// the next chunk's loads issued before this one's arithmetic 5-35%, and five or six blocks an SM (spilling) 58-153%.
// CLIP: the gradients clipped by the norm (a constant, so that the kernel without clipping keeps its code).
template <typename T, bool CLIP>
__global__ void __launch_bounds__(THREADS, 4) adamw_kernel(const __grid_constant__ batch b) {
    constexpr int CHUNK = chunk_elems<T>;
    update u = make_update(b.h);
    pdl::start();
    if constexpr (CLIP) {
        u.clip = true;
        u.clip_coef = to_float(T(clip_coefficient(b.h)));  // torch's multiply takes the factor in the tensor's dtype
    }
    const int64_t chunks = b.index.chunks();
    int t = 0;
    for (int64_t c = blockIdx.x; c < chunks; c += gridDim.x) {
        const chunk_ref<T, CHUNK> r(b, c, t);
        if (r.vector) {
            chunk_regs<T> x;
            load_chunk(r, x);
            update_chunk(u, r, x);
        } else {
            update_scalar(u, r);
        }
    }
}

template <typename T, bool CLIP>
cudaError_t launch_typed(const adamw_args& a, cudaStream_t stream) {
    constexpr int CHUNK = chunk_elems<T>;
    constexpr auto kernel = adamw_kernel<T, CLIP>;
    int grid_cap = resident_blocks<kernel>(THREADS, 0);
    if (grid_cap <= 0) grid_cap = 8 * multiprocessor_count();
    batch b;
    b.h = a.hyper;
    return for_each_batch<BATCH>(a.count, cudaSuccess, [&](int first, int count) -> cudaError_t {
        b.index.clear();
        for (int i = 0; i < count; ++i) {
            const int e = first + i;
            b.param[i] = a.params[e];
            b.grad[i] = a.grads[e];
            b.exp_avg[i] = a.exp_avgs[e];
            b.exp_avg_sq[i] = a.exp_avg_sqs[e];
            b.index.add(a.numels[e], CHUNK,
                        is_aligned(a.params[e], 16) && is_aligned(a.grads[e], 16) && is_aligned(a.exp_avgs[e], 16) &&
                            is_aligned(a.exp_avg_sqs[e], 16));
        }
        const int64_t chunks = b.index.chunks();
        if (chunks == 0) return cudaSuccess;
        const unsigned grid = static_cast<unsigned>(std::min<int64_t>(chunks, grid_cap));
        return launch_kernel(kernel, dim3(grid), dim3(THREADS), 0, stream, 1, b);
    });
}

}  // namespace

const char* adamw_unsupported(const adamw_args& a) {
    if (a.dtype != int(dtype::bf16) && a.dtype != int(dtype::fp16) && a.dtype != int(dtype::fp32))
        return "dtype must be bfloat16, float16 or float32";
    if (a.count < 0) return "the tensor count must not be negative";
    if (a.count > 0 && (a.params == nullptr || a.grads == nullptr || a.exp_avgs == nullptr ||
                        a.exp_avg_sqs == nullptr || a.numels == nullptr))
        return "the tensor lists are needed";
    for (int i = 0; i < a.count; ++i) {
        if (a.numels[i] < 0) return "element counts must not be negative";
        if (a.numels[i] > 0 && (a.params[i] == nullptr || a.grads[i] == nullptr || a.exp_avgs[i] == nullptr ||
                                a.exp_avg_sqs[i] == nullptr))
            return "a tensor with elements has a null pointer";
    }
    if (!(a.hyper.step >= 1)) return "the step count must be at least 1 (it is counted before the update)";
    return nullptr;
}

cudaError_t launch_adamw(const adamw_args& a, cudaStream_t stream) {
    if (adamw_unsupported(a) != nullptr) return cudaErrorInvalidValue;
    const bool clip = a.hyper.clip_sq_norm != nullptr;
    switch (dtype(a.dtype)) {
        case dtype::bf16: return clip ? launch_typed<__nv_bfloat16, true>(a, stream)
                                      : launch_typed<__nv_bfloat16, false>(a, stream);
        case dtype::fp16: return clip ? launch_typed<__half, true>(a, stream) : launch_typed<__half, false>(a, stream);
        default: return clip ? launch_typed<float, true>(a, stream) : launch_typed<float, false>(a, stream);
    }
}

}  // namespace tk::optim
