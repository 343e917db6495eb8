#include "rope_grad.h"
#include "../../kittens/kittens.cuh"

#include <algorithm>

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

// A thread's unit: in each row, rope_dims / 16 pairs of octets (columns 8j.. and 8j + half..), then the
// (D - rope_dims) / 8 octets that pass through.
template <typename T, typename Src, typename Angle>
__global__ void __launch_bounds__(THREADS) rope_grad_kernel(const rope_grad_args a) {
    // src and dst may be one tensor (dK in place): neither is __restrict__.
    const Src* src = static_cast<const Src*>(a.src);
    T* dst = static_cast<T*>(a.dst);
    const Angle* __restrict__ cosines = static_cast<const Angle*>(a.cos);
    const Angle* __restrict__ sines = static_cast<const Angle*>(a.sin);
    const int64_t pairs = a.rope_dims / 16, half = a.rope_dims / 2;
    const int64_t per_row = pairs + (a.head_dim - a.rope_dims) / 8;
    const int64_t units = a.batch * a.heads * a.seq * per_row;
    for (int64_t u = int64_t(blockIdx.x) * THREADS + threadIdx.x; u < units; u += int64_t(gridDim.x) * THREADS) {
        const int64_t row = u / per_row, j = u - row * per_row;
        const int64_t s = row % a.seq, bh = row / a.seq, h = bh % a.heads, b = bh / a.heads;
        const Src* in = src + b * a.src_stride[0] + h * a.src_stride[1] + s * a.src_stride[2];
        T* out = dst + b * a.dst_stride[0] + h * a.dst_stride[1] + s * a.dst_stride[2];
        if (j < pairs) {
            const int64_t c1 = 8 * j, c2 = c1 + half;
            octet x1 = load_octet(in + c1), x2 = load_octet(in + c2);
            const Angle* cos_row = cosines + s * a.angle_stride;
            const Angle* sin_row = sines + s * a.angle_stride;
            const octet cos1 = load_octet(cos_row + c1), cos2 = load_octet(cos_row + c2);
            const octet sin1 = load_octet(sin_row + c1), sin2 = load_octet(sin_row + c2);
            octet y1, y2;
#pragma unroll
            for (int i = 0; i < 8; ++i) {
                const float d1 = x1.v[i] * a.scale, d2 = x2.v[i] * a.scale;
                y1.v[i] = d1 * cos1.v[i] + d2 * sin2.v[i];
                y2.v[i] = d2 * cos2.v[i] - d1 * sin1.v[i];
            }
            store_octet(out + c1, y1);
            store_octet(out + c2, y2);
        } else {
            const int64_t c = a.rope_dims + 8 * (j - pairs);
            octet x = load_octet(in + c);
#pragma unroll
            for (int i = 0; i < 8; ++i) x.v[i] *= a.scale;
            store_octet(out + c, x);
        }
    }
}

template <typename T, typename Src>
cudaError_t launch_typed(const rope_grad_args& a, unsigned blocks, cudaStream_t stream) {
    if (a.angle_fp32)
        rope_grad_kernel<T, Src, float><<<blocks, THREADS, 0, stream>>>(a);
    else
        rope_grad_kernel<T, Src, T><<<blocks, THREADS, 0, stream>>>(a);
    return cudaGetLastError();
}

template <typename T>
cudaError_t launch_for(const rope_grad_args& a, unsigned blocks, cudaStream_t stream) {
    return a.src_fp32 ? launch_typed<T, float>(a, blocks, stream) : launch_typed<T, T>(a, blocks, stream);
}

bool rows_aligned(const int64_t (&stride)[3], int64_t elements) {
    return stride[0] % elements == 0 && stride[1] % elements == 0 && stride[2] % elements == 0;
}

}  // namespace

const char* rope_grad_unsupported(const rope_grad_args& a) {
    if (a.dtype != int(dtype::bf16) && a.dtype != int(dtype::fp16)) return "dtype must be bfloat16 or float16";
    if (a.batch < 0 || a.heads < 0 || a.seq < 0) return "batch, heads and seq must be non-negative";
    if (a.head_dim <= 0 || a.head_dim % 8) return "head_dim must be a positive multiple of 8";
    if (a.rope_dims < 0 || a.rope_dims % 16 || a.rope_dims > a.head_dim)
        return "rope_dims must be a multiple of 16 from 0 to head_dim";
    if (a.src == nullptr || a.dst == nullptr || !is_aligned(a.src, 16) || !is_aligned(a.dst, 16))
        return "src and dst must be 16-byte aligned";
    if (!a.src_fp32 && !rows_aligned(a.src_stride, 8)) return "src strides must be multiples of 8 elements";
    if (!rows_aligned(a.dst_stride, 8)) return "dst strides must be multiples of 8 elements";
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
    rope_grad_args args = a;
    if (args.src_fp32) {  // the dQ accumulator is contiguous
        args.src_stride[2] = a.head_dim;
        args.src_stride[1] = a.seq * a.head_dim;
        args.src_stride[0] = a.heads * a.seq * a.head_dim;
    }
    const int64_t per_row = a.rope_dims / 16 + (a.head_dim - a.rope_dims) / 8;
    const int64_t units = a.batch * a.heads * a.seq * per_row;
    if (units == 0) return cudaSuccess;
    const int64_t blocks = std::min<int64_t>((units + THREADS - 1) / THREADS,
                                             int64_t(multiprocessor_count()) * BLOCKS_PER_SM);
    if (a.dtype == int(dtype::bf16)) return launch_for<__nv_bfloat16>(args, unsigned(blocks), stream);
    return launch_for<__half>(args, unsigned(blocks), stream);
}

}  // namespace tk::attention
