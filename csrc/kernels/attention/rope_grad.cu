#include "rope_grad.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>
#include <climits>

namespace tk::attention {
namespace {

constexpr int THREADS = 256;
constexpr int BLOCKS_PER_SM = 8;

// Eight consecutive columns of a row as floats.
struct octet {
    float v[8];
};

template <typename T>
__device__ __forceinline__ octet load_octet(const T* p) {
    octet o;
    if constexpr (std::is_same_v<T, float>) {
        const float4 a = reinterpret_cast<const float4*>(p)[0], b = reinterpret_cast<const float4*>(p)[1];
        o.v[0] = a.x, o.v[1] = a.y, o.v[2] = a.z, o.v[3] = a.w, o.v[4] = b.x, o.v[5] = b.y, o.v[6] = b.z, o.v[7] = b.w;
    } else {
        const uint4 u = *reinterpret_cast<const uint4*>(p);
        const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int i = 0; i < 4; ++i) {
            const float2 f = rt::unpack2<T>(w[i]);
            o.v[2 * i] = f.x, o.v[2 * i + 1] = f.y;
        }
    }
    return o;
}

template <typename T>
__device__ __forceinline__ void store_octet(T* p, const octet& o) {
    *reinterpret_cast<uint4*>(p) = make_uint4(rt::pack2<T>(o.v[0], o.v[1]), rt::pack2<T>(o.v[2], o.v[3]),
                                              rt::pack2<T>(o.v[4], o.v[5]), rt::pack2<T>(o.v[6], o.v[7]));
}

// One unit of a row: a pair of octets (columns c1 = 8j.. and c1 + half..) rotated back, or an octet passed through.
template <typename T, typename Src, typename Angle>
__device__ __forceinline__ void unit(const Src* in, T* out, const Angle* cos_row, const Angle* sin_row, int pairs,
                                     int half, int rope_dims, int j, float scale) {
    if (j < pairs) {
        const int c1 = 8 * j, c2 = c1 + half;
        const octet x1 = load_octet(in + c1), x2 = load_octet(in + c2);
        const octet cos1 = load_octet(cos_row + c1), cos2 = load_octet(cos_row + c2);
        const octet sin1 = load_octet(sin_row + c1), sin2 = load_octet(sin_row + c2);
        octet y1, y2;
#pragma unroll
        for (int i = 0; i < 8; ++i) {
            const float d1 = x1.v[i] * scale, d2 = x2.v[i] * scale;
            y1.v[i] = d1 * cos1.v[i] + d2 * sin2.v[i];
            y2.v[i] = d2 * cos2.v[i] - d1 * sin1.v[i];
        }
        store_octet(out + c1, y1);
        store_octet(out + c2, y2);
    } else {
        const int c = rope_dims + 8 * (j - pairs);
        octet x = load_octet(in + c);
#pragma unroll
        for (int i = 0; i < 8; ++i) x.v[i] *= scale;
        store_octet(out + c, x);
    }
}

// Units: dq's rows first, then dk's, each row rope_dims / 16 pairs and (D - rope_dims) / 8 octets passed through.
// Rows go in (batch, position, head) order, so that a warp's rows share one position: their table loads are the
// same addresses, served once (in (batch, head, position) order, H200: 2.5 against 3.4 TB/s with fp32 tables at
// Llama-3-8B's shape, 3.0 against 3.2 at Llama-3.2-1B's; benchmarks/NOTES.md, session 47).
// Index: 32-bit where the units fit (its divisions are a few instructions, 64-bit ones a call).
template <typename T, typename Angle, typename Index>
__global__ void __launch_bounds__(THREADS) rope_grad_kernel(const rope_grad_args a) {
    const Angle* __restrict__ cosines = static_cast<const Angle*>(a.cos);
    const Angle* __restrict__ sines = static_cast<const Angle*>(a.sin);
    pdl::start();
    const int pairs = int(a.rope_dims / 16), half = int(a.rope_dims / 2), rope_dims = int(a.rope_dims);
    const Index per_row = Index(pairs + (a.head_dim - a.rope_dims) / 8), seq = Index(a.seq);
    const Index dq_units = Index(a.batch * a.q_heads * a.seq) * per_row;
    const Index units = dq_units + (a.dk != nullptr ? Index(a.batch * a.kv_heads * a.seq) * per_row : Index(0));
    for (Index u = Index(blockIdx.x) * THREADS + threadIdx.x; u < units; u += Index(gridDim.x) * THREADS) {
        const bool is_dq = u < dq_units;
        const Index v = is_dq ? u : u - dq_units;
        const Index row = v / per_row, heads = Index(is_dq ? a.q_heads : a.kv_heads);
        const int j = int(v - row * per_row);
        const Index h = row % heads, bs = row / heads, s = bs % seq, b = bs / seq;
        const Angle* cos_row = cosines + int64_t(s) * a.angle_stride;
        const Angle* sin_row = sines + int64_t(s) * a.angle_stride;
        if (is_dq) {
            const float* in = a.dq_accum + ((int64_t(b) * a.q_heads + int64_t(h)) * a.seq + int64_t(s)) * a.head_dim;
            T* out = static_cast<T*>(a.dq) + int64_t(b) * a.dq_stride[0] + int64_t(h) * a.dq_stride[1] +
                     int64_t(s) * a.dq_stride[2];
            unit<T>(in, out, cos_row, sin_row, pairs, half, rope_dims, j, a.scale);
        } else {  // in place: this thread reads what it then writes
            T* at = static_cast<T*>(a.dk) + int64_t(b) * a.dk_stride[0] + int64_t(h) * a.dk_stride[1] +
                    int64_t(s) * a.dk_stride[2];
            unit<T>(at, at, cos_row, sin_row, pairs, half, rope_dims, j, 1.0f);
        }
    }
}

template <typename T, typename Angle>
cudaError_t launch_typed(const rope_grad_args& a, int64_t units, unsigned blocks, cudaStream_t stream) {
    auto kernel = units < int64_t(INT_MAX) - int64_t(blocks) * THREADS ? rope_grad_kernel<T, Angle, uint32_t>
                                                                        : rope_grad_kernel<T, Angle, int64_t>;
    return launch_kernel(kernel, dim3(blocks), dim3(THREADS), 0, stream, 1, a);
}

template <typename T>
cudaError_t launch_for(const rope_grad_args& a, int64_t units, unsigned blocks, cudaStream_t stream) {
    return a.angle_fp32 ? launch_typed<T, float>(a, units, blocks, stream)
                        : launch_typed<T, T>(a, units, blocks, stream);
}

bool rows_aligned(const int64_t (&stride)[3]) {
    return stride[0] % 8 == 0 && stride[1] % 8 == 0 && stride[2] % 8 == 0;
}

}  // namespace

const char* rope_grad_unsupported(const rope_grad_args& a) {
    if (a.dtype != int(dtype::bf16) && a.dtype != int(dtype::fp16)) return "dtype must be bfloat16 or float16";
    if (a.batch < 0 || a.q_heads < 0 || a.kv_heads < 0 || a.seq < 0) return "sizes must be non-negative";
    if (a.head_dim <= 0 || a.head_dim % 8) return "head_dim must be a positive multiple of 8";
    if (a.rope_dims < 0 || a.rope_dims % 16 || a.rope_dims > a.head_dim)
        return "rope_dims must be a multiple of 16 from 0 to head_dim";
    if (a.dq_accum == nullptr || a.dq == nullptr || !is_aligned(a.dq_accum, 16) || !is_aligned(a.dq, 16))
        return "dq_accum and dq must be 16-byte aligned";
    if (!rows_aligned(a.dq_stride)) return "dq's strides must be multiples of 8 elements";
    if (a.dk != nullptr && (!is_aligned(a.dk, 16) || !rows_aligned(a.dk_stride)))
        return "dk must be 16-byte aligned with strides of multiples of 8 elements";
    if (a.rope_dims > 0) {
        if (a.cos == nullptr || a.sin == nullptr || !is_aligned(a.cos, 16) || !is_aligned(a.sin, 16))
            return "cos and sin must be 16-byte aligned";
        if (a.angle_stride < a.rope_dims || a.angle_stride % (a.angle_fp32 ? 4 : 8))
            return "the rows of cos and sin must hold rope_dims values and start on 16 bytes";
    }
    return nullptr;
}

cudaError_t launch_rope_grad(const rope_grad_args& a, cudaStream_t stream) {
    if (rope_grad_unsupported(a) != nullptr) return cudaErrorInvalidValue;
    const int64_t per_row = a.rope_dims / 16 + (a.head_dim - a.rope_dims) / 8;
    const int64_t units = a.batch * (a.q_heads + (a.dk != nullptr ? a.kv_heads : 0)) * a.seq * per_row;
    if (units == 0) return cudaSuccess;
    const int64_t blocks = std::min<int64_t>((units + THREADS - 1) / THREADS,
                                             int64_t(multiprocessor_count()) * BLOCKS_PER_SM);
    if (a.dtype == int(dtype::bf16)) return launch_for<__nv_bfloat16>(a, units, unsigned(blocks), stream);
    return launch_for<__half>(a, units, unsigned(blocks), stream);
}

}  // namespace tk::attention
