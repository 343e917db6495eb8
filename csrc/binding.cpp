// The one Python binding of thunder_tk's kernels.
// Every entry point takes raw device pointers, sizes, strides and a CUDA stream handle, so the module links
// against no libtorch symbols and one build serves every supported torch. Nothing here synchronises.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

#include "kernels/attention/bwd_delta.h"
#include "kernels/attention/backward.h"
#include "kernels/attention/dq_finalize.h"
#include "kernels/attention/rope_grad.h"
#include "kernels/attention/forward.h"
#include "kernels/collectives/copy_engine.h"
#include "kernels/collectives/p2p.h"
#include "kernels/embedding/backward.h"
#include "kernels/gemm/gemm.h"
#include "kernels/loss/cross_entropy.h"
#include "kernels/norm/rms_norm.h"
#include "kernels/optim/adamw.h"
#include "kernels/optim/grad_norm.h"
#include "kernels/selftest/kittens_selftest.h"
#include "kittens/launch.h"

namespace py = pybind11;

namespace {

using strides3 = std::array<int64_t, 3>;

// tk::dtype's codes (csrc/kittens/common.cuh is device code; this file is compiled as host C++).
enum dtype_code : int { code_bf16 = 0, code_fp16 = 1, code_fp32 = 2 };

// A failed runtime call also stays the (module's own, static) runtime's last error until it is read, and the launches
// that check cudaGetLastError() after `<<<>>>` (collectives, selftests) would report it as theirs. So the failure is
// taken off there and raised here, once.
void check_launch(cudaError_t status, const char* kernel) {
    if (status == cudaSuccess) return;
    (void)cudaGetLastError();
    throw std::runtime_error(std::string("thunder_tk: launching ") + kernel + " failed: " + cudaGetErrorName(status) +
                             " (" + cudaGetErrorString(status) + ")");
}

template <typename T> const T* as_ptr(std::uintptr_t p) { return reinterpret_cast<const T*>(p); }

cudaStream_t as_stream(std::uintptr_t stream) { return reinterpret_cast<cudaStream_t>(stream); }

// How every entry point ends: the kernel's reason for declining its arguments, if any, raised with the kernel's
// name; else `launch()` (the enqueue, returning its status), whose failure is raised likewise.
template <typename Launch>
void launch_if_supported(const char* why_not, const char* kernel, Launch&& launch) {
    if (why_not != nullptr) throw std::invalid_argument(std::string("thunder_tk ") + kernel + ": " + why_not);
    check_launch(launch(), kernel);
}

// Strides as the kernels' argument structs hold them.
template <std::size_t N>
void copy_strides(int64_t (&dst)[N], const std::array<int64_t, N>& src) {
    std::copy(src.begin(), src.end(), dst);
}

void attention_bwd_delta(std::uintptr_t o, std::uintptr_t grad_o, std::uintptr_t delta, int dtype, int64_t batch,
                         int64_t heads, int64_t seq, int64_t head_dim, strides3 o_stride, strides3 grad_o_stride,
                         strides3 delta_stride, std::uintptr_t stream, int rows_per_group, bool resident_grid,
                         std::uintptr_t zero_rows) {
    tk::attention::bwd_delta_args args{};
    args.o = as_ptr<void>(o);
    args.grad_o = as_ptr<void>(grad_o);
    args.delta = reinterpret_cast<float*>(delta);
    args.dtype = dtype;
    args.batch = batch;
    args.heads = heads;
    args.seq = seq;
    args.head_dim = head_dim;
    if (rows_per_group != 0 && rows_per_group != 1 && rows_per_group != 2 && rows_per_group != 4)
        throw std::invalid_argument("rows_per_group must be 0 (automatic), 1, 2 or 4");
    args.rows_per_group = rows_per_group;
    args.resident_grid = resident_grid;
    copy_strides(args.o_stride, o_stride);
    copy_strides(args.grad_o_stride, grad_o_stride);
    copy_strides(args.delta_stride, delta_stride);
    args.zero_rows = reinterpret_cast<float*>(zero_rows);
    launch_if_supported(tk::attention::bwd_delta_unsupported(args), "attention_bwd_delta",
                        [&] { return tk::attention::launch_bwd_delta(args, as_stream(stream)); });
}

// The fields forward_args and backward_args share, set in one place so that a new shared field cannot be set
// for one direction only.
template <typename Args>
void fill_attention_common(Args& args, std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, int dtype, int64_t batch,
                           int64_t q_heads, int64_t kv_heads, int64_t q_len, int64_t kv_len, int64_t head_dim,
                           const strides3& q_stride, const strides3& k_stride, const strides3& v_stride,
                           const std::array<int64_t, 2>& lse_stride, float scale, bool causal, int window) {
    args.q = as_ptr<void>(q);
    args.k = as_ptr<void>(k);
    args.v = as_ptr<void>(v);
    args.dtype = dtype;
    args.batch = batch;
    args.q_heads = q_heads;
    args.kv_heads = kv_heads;
    args.q_len = q_len;
    args.kv_len = kv_len;
    args.head_dim = head_dim;
    copy_strides(args.q_stride, q_stride);
    copy_strides(args.k_stride, k_stride);
    copy_strides(args.v_stride, v_stride);
    copy_strides(args.lse_stride, lse_stride);
    args.scale = scale;
    args.causal = causal;
    args.window = window;
}

void attention_forward(std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t o, std::uintptr_t lse,
                       int dtype, int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t q_len, int64_t kv_len,
                       int64_t head_dim, strides3 q_stride, strides3 k_stride, strides3 v_stride, strides3 o_stride,
                       std::array<int64_t, 2> lse_stride, float scale, bool causal, std::uintptr_t stream,
                       int max_blocks, std::uintptr_t tickets, std::uintptr_t split_scratch,
                       int64_t split_scratch_floats, std::uintptr_t split_counts, int64_t split_counts_len,
                       int window) {
    tk::attention::forward_args args{};
    fill_attention_common(args, q, k, v, dtype, batch, q_heads, kv_heads, q_len, kv_len, head_dim, q_stride, k_stride,
                          v_stride, lse_stride, scale, causal, window);
    args.o = reinterpret_cast<void*>(o);
    args.lse = reinterpret_cast<float*>(lse);
    copy_strides(args.o_stride, o_stride);
    args.max_blocks = max_blocks;
    args.tickets = reinterpret_cast<int*>(tickets);
    args.split_scratch = reinterpret_cast<float*>(split_scratch);
    args.split_scratch_floats = split_scratch_floats;
    args.split_counts = reinterpret_cast<int*>(split_counts);
    args.split_counts_len = split_counts_len;
    launch_if_supported(tk::attention::forward_unsupported(args), "attention_forward",
                        [&] { return tk::attention::launch_forward(args, as_stream(stream)); });
}

void attention_dq_finalize(std::uintptr_t accum, std::uintptr_t out, int dtype, int64_t count, float scale,
                           std::uintptr_t stream, std::uintptr_t done, int64_t group_elements, uint64_t target) {
    const float* in = as_ptr<float>(accum);
    void* dst = reinterpret_cast<void*>(out);
    const tk::attention::dq_finalize_order order{as_ptr<unsigned long long>(done), group_elements, target};
    launch_if_supported(tk::attention::dq_finalize_unsupported(in, dst, dtype, count, order), "attention_dq_finalize",
                        [&] {
                            return tk::attention::launch_dq_finalize(in, dst, dtype, count, scale, as_stream(stream),
                                                                     order);
                        });
}

void attention_rope_grad(std::uintptr_t dq_accum, std::uintptr_t dq, strides3 dq_stride, int64_t q_heads, float scale,
                         std::uintptr_t dk, strides3 dk_stride, int64_t kv_heads, std::uintptr_t cos,
                         std::uintptr_t sin, bool angle_fp32, int64_t angle_stride, int dtype, int64_t batch,
                         int64_t seq, int64_t head_dim, int64_t rope_dims, std::uintptr_t stream) {
    tk::attention::rope_grad_args args{};
    args.dq_accum = as_ptr<float>(dq_accum);
    args.dq = reinterpret_cast<void*>(dq);
    copy_strides(args.dq_stride, dq_stride);
    args.q_heads = q_heads;
    args.scale = scale;
    args.dk = reinterpret_cast<void*>(dk);
    copy_strides(args.dk_stride, dk_stride);
    args.kv_heads = kv_heads;
    args.cos = as_ptr<void>(cos);
    args.sin = as_ptr<void>(sin);
    args.angle_fp32 = angle_fp32;
    args.angle_stride = angle_stride;
    args.dtype = dtype;
    args.batch = batch;
    args.seq = seq;
    args.head_dim = head_dim;
    args.rope_dims = rope_dims;
    launch_if_supported(tk::attention::rope_grad_unsupported(args), "attention_rope_grad",
                        [&] { return tk::attention::launch_rope_grad(args, as_stream(stream)); });
}

int64_t attention_backward(std::uintptr_t q, std::uintptr_t k, std::uintptr_t v, std::uintptr_t dout, std::uintptr_t lse,
                        std::uintptr_t delta, std::uintptr_t dq_accum, std::uintptr_t dk, std::uintptr_t dv, int dtype,
                        int64_t batch, int64_t q_heads, int64_t kv_heads, int64_t q_len, int64_t kv_len,
                        int64_t head_dim, strides3 q_stride, strides3 k_stride, strides3 v_stride, strides3 dout_stride,
                        strides3 dk_stride, strides3 dv_stride, std::array<int64_t, 2> lse_stride,
                        std::array<int64_t, 2> delta_stride, float scale, bool causal, std::uintptr_t stream,
                        int64_t group_split, int64_t split_from, int split_parts, std::uintptr_t split_scratch,
                        std::uintptr_t split_counts, int window, std::uintptr_t dq_done, std::uintptr_t zero_next,
                        int64_t zero_next_count) {
    tk::attention::backward_args args{};
    fill_attention_common(args, q, k, v, dtype, batch, q_heads, kv_heads, q_len, kv_len, head_dim, q_stride, k_stride,
                          v_stride, lse_stride, scale, causal, window);
    args.dout = as_ptr<void>(dout);
    args.lse = as_ptr<float>(lse);
    args.delta = as_ptr<float>(delta);
    args.dq_accum = reinterpret_cast<float*>(dq_accum);
    args.dk = reinterpret_cast<void*>(dk);
    args.dv = reinterpret_cast<void*>(dv);
    copy_strides(args.dout_stride, dout_stride);
    copy_strides(args.dk_stride, dk_stride);
    copy_strides(args.dv_stride, dv_stride);
    copy_strides(args.delta_stride, delta_stride);
    args.group_split = group_split;
    args.split_from = split_from;
    args.split_parts = split_parts;
    args.split_scratch = reinterpret_cast<float*>(split_scratch);
    args.split_counts = reinterpret_cast<int*>(split_counts);
    args.dq_done = reinterpret_cast<unsigned long long*>(dq_done);
    args.zero_next = reinterpret_cast<float*>(zero_next);
    args.zero_next_count = zero_next_count;
    launch_if_supported(tk::attention::backward_unsupported(args), "attention_backward",
                        [&] { return tk::attention::launch_backward(args, as_stream(stream)); });
    return dq_done ? tk::attention::backward_dq_steps(args) : 0;
}

tk::loss::cross_entropy_args cross_entropy_common(std::uintptr_t logits, std::uintptr_t target, int dtype, int64_t rows,
                                                 int64_t classes, int64_t logits_row_stride, int64_t ignore_index) {
    tk::loss::cross_entropy_args args{};
    args.logits = as_ptr<void>(logits);
    args.target = as_ptr<int64_t>(target);
    args.dtype = dtype;
    args.rows = rows;
    args.classes = classes;
    args.logits_row_stride = logits_row_stride;
    args.ignore_index = ignore_index;
    return args;
}

void cross_entropy_forward(std::uintptr_t logits, std::uintptr_t target, std::uintptr_t loss, std::uintptr_t lse,
                           int dtype, int64_t rows, int64_t classes, int64_t logits_row_stride, int64_t ignore_index,
                           std::uintptr_t stream) {
    auto args = cross_entropy_common(logits, target, dtype, rows, classes, logits_row_stride, ignore_index);
    args.loss = reinterpret_cast<float*>(loss);
    args.lse = reinterpret_cast<float*>(lse);
    launch_if_supported(tk::loss::cross_entropy_unsupported(args, false), "cross_entropy_forward",
                        [&] { return tk::loss::launch_cross_entropy_forward(args, as_stream(stream)); });
}

void cross_entropy_backward(std::uintptr_t logits, std::uintptr_t target, std::uintptr_t lse, std::uintptr_t grad_loss,
                            int64_t grad_loss_stride, std::uintptr_t grad, int64_t grad_row_stride, int dtype,
                            int64_t rows, int64_t classes, int64_t logits_row_stride, int64_t ignore_index,
                            std::uintptr_t stream) {
    auto args = cross_entropy_common(logits, target, dtype, rows, classes, logits_row_stride, ignore_index);
    args.lse = reinterpret_cast<float*>(lse);
    args.grad_loss = as_ptr<float>(grad_loss);
    args.grad_loss_stride = grad_loss_stride;
    args.grad = reinterpret_cast<void*>(grad);
    args.grad_row_stride = grad_row_stride;
    launch_if_supported(tk::loss::cross_entropy_unsupported(args, true), "cross_entropy_backward",
                        [&] { return tk::loss::launch_cross_entropy_backward(args, as_stream(stream)); });
}

// What every GEMM launch takes: operands A and B, output C, and their shape and strides (gemm.h).
tk::gemm::gemm_args gemm_operands(std::uintptr_t a, std::uintptr_t b, std::uintptr_t c, int dtype, int64_t M, int64_t N,
                                  int64_t K, int64_t a_stride_m, int64_t a_stride_k, int64_t b_stride_k,
                                  int64_t b_stride_n, int64_t c_stride_m) {
    tk::gemm::gemm_args g{};
    g.a = as_ptr<void>(a);
    g.b = as_ptr<void>(b);
    g.c = reinterpret_cast<void*>(c);
    g.dtype = dtype;
    g.M = M;
    g.N = N;
    g.K = K;
    g.a_stride_m = a_stride_m;
    g.a_stride_k = a_stride_k;
    g.b_stride_k = b_stride_k;
    g.b_stride_n = b_stride_n;
    g.c_stride_m = c_stride_m;
    return g;
}

// A GEMM launch `name` enqueued on `stream`, or the reason it cannot run as an error.
void launch_checked(const tk::gemm::gemm_args& g, std::uintptr_t stream, const char* name) {
    launch_if_supported(tk::gemm::gemm_unsupported(g), name,
                        [&] { return tk::gemm::launch_gemm(g, as_stream(stream)); });
}

void gemm(std::uintptr_t a, std::uintptr_t b, std::uintptr_t c, std::uintptr_t bias, int dtype, int64_t M, int64_t N,
          int64_t K, int64_t a_stride_m, int64_t a_stride_k, int64_t b_stride_k, int64_t b_stride_n, int64_t c_stride_m,
          std::uintptr_t stream, int group_rows, int cluster, std::uintptr_t tickets, int tile_n, int pingpong,
          int epilogue, int stream_k, std::uintptr_t partials, std::uintptr_t flags, int skinny, std::uintptr_t sum_a,
          std::uintptr_t sum_b, int64_t sum_K, int64_t sum_a_stride_m, int64_t sum_a_stride_k, int64_t sum_b_stride_k,
          int64_t sum_b_stride_n, bool c_fp32) {
    tk::gemm::gemm_args g = gemm_operands(a, b, c, dtype, M, N, K, a_stride_m, a_stride_k, b_stride_k, b_stride_n,
                                          c_stride_m);
    g.bias = as_ptr<void>(bias);
    if (group_rows < 0 || group_rows > 64) throw std::invalid_argument("group_rows must be 0 (automatic) to 64");
    g.group_rows = group_rows;
    if (cluster < 0 || cluster > 2) throw std::invalid_argument("cluster must be 0 (automatic), 1 or 2");
    g.cluster = cluster;
    g.tickets = reinterpret_cast<int*>(tickets);
    g.tile_n = tile_n;
    g.pingpong = pingpong;
    g.epilogue = epilogue;
    g.stream_k = stream_k;
    g.partials = reinterpret_cast<float*>(partials);
    g.flags = reinterpret_cast<int*>(flags);
    g.skinny = skinny;
    g.sum_a = as_ptr<void>(sum_a);
    g.sum_b = as_ptr<void>(sum_b);
    g.sum_K = sum_K;
    g.sum_a_stride_m = sum_a_stride_m;
    g.sum_a_stride_k = sum_a_stride_k;
    g.sum_b_stride_k = sum_b_stride_k;
    g.sum_b_stride_n = sum_b_stride_n;
    g.c_fp32 = c_fp32;
    launch_checked(g, stream, g.sum_a != nullptr ? "gemm_sum" : "gemm");
}

// SwiGLU's two products of a LLaMA-style MLP in one launch: h1 = A W1^T, h2 = A W2^T, g = silu(h1) * h2.
void gemm_swiglu(std::uintptr_t a, std::uintptr_t w1, std::uintptr_t w2, std::uintptr_t h1, std::uintptr_t h2,
                 std::uintptr_t g_out, int dtype, int64_t M, int64_t N, int64_t K, int64_t a_stride_m,
                 int64_t w_stride_n, int64_t out_stride_m, std::uintptr_t stream, std::uintptr_t tickets) {
    tk::gemm::gemm_args g = gemm_operands(a, w1, h1, dtype, M, N, K, a_stride_m, 1, 1, w_stride_n, out_stride_m);
    g.b2 = as_ptr<void>(w2);
    g.c2 = reinterpret_cast<void*>(h2);
    g.c3 = reinterpret_cast<void*>(g_out);
    g.tickets = reinterpret_cast<int*>(tickets);
    if (g.b == nullptr || g.b2 == nullptr) throw std::invalid_argument("thunder_tk gemm_swiglu: both weights are needed");
    launch_checked(g, stream, "gemm_swiglu");
}

// SwiGLU's backward through its output projection in one launch: with dg = A B (the gradient of g = silu(h1) * h2,
// never written), dh1 = dg * h2 * silu'(h1) and dh2 = dg * silu(h1).
void gemm_swiglu_grad(std::uintptr_t a, std::uintptr_t b, std::uintptr_t h1, std::uintptr_t h2, std::uintptr_t dh1,
                      std::uintptr_t dh2, int dtype, int64_t M, int64_t N, int64_t K, int64_t a_stride_m,
                      int64_t b_stride_k, int64_t b_stride_n, int64_t row_stride, std::uintptr_t stream,
                      int pingpong) {
    tk::gemm::gemm_args g = gemm_operands(a, b, dh1, dtype, M, N, K, a_stride_m, 1, b_stride_k, b_stride_n, row_stride);
    g.pingpong = pingpong;
    g.h1 = as_ptr<void>(h1);
    g.h2 = as_ptr<void>(h2);
    g.c2 = reinterpret_cast<void*>(dh2);
    if (g.h1 == nullptr) throw std::invalid_argument("thunder_tk gemm_swiglu_grad: h1 is needed");
    launch_checked(g, stream, "gemm_swiglu_grad");
}

// The embedding's dense weight gradient from the stably sorted token ids and their positions (embedding/backward.h).
void embedding_backward(std::uintptr_t grad, int64_t grad_stride, std::uintptr_t sorted, std::uintptr_t order,
                        std::uintptr_t out, int64_t tokens, int64_t rows, int64_t dim, int64_t padding_idx, int dtype,
                        std::uintptr_t stream) {
    tk::embedding::backward_args args{};
    args.grad = as_ptr<void>(grad);
    args.grad_stride = grad_stride;
    args.sorted = as_ptr<int64_t>(sorted);
    args.order = as_ptr<int64_t>(order);
    args.out = reinterpret_cast<void*>(out);
    args.tokens = tokens;
    args.rows = rows;
    args.dim = dim;
    args.padding_idx = padding_idx;
    args.dtype = dtype;
    launch_if_supported(tk::embedding::backward_unsupported(args), "embedding_backward",
                        [&] { return tk::embedding::launch_backward(args, as_stream(stream)); });
}

// A list of device addresses as the pointer array a multi-tensor kernel's arguments point to (their `int count`
// bounds its length).
template <typename T>
std::vector<T*> pointer_list(const std::vector<std::uintptr_t>& addresses, const char* kernel) {
    if (addresses.size() > static_cast<std::size_t>(1) << 30)
        throw std::invalid_argument(std::string("thunder_tk ") + kernel + ": too many tensors");
    std::vector<T*> pointers(addresses.size());
    std::transform(addresses.begin(), addresses.end(), pointers.begin(),
                   [](std::uintptr_t a) { return reinterpret_cast<T*>(a); });
    return pointers;
}

// AdamW's update over lists of tensors (optim/adamw.h): entry i of each list belongs together.
void adamw(const std::vector<std::uintptr_t>& params, const std::vector<std::uintptr_t>& grads,
           const std::vector<std::uintptr_t>& exp_avgs, const std::vector<std::uintptr_t>& exp_avg_sqs,
           const std::vector<int64_t>& numels, int dtype, double lr, double beta1, double beta2, double eps,
           double weight_decay, double step, bool maximize, std::uintptr_t clip_sq_norm, double clip_max_norm,
           std::uintptr_t stream) {
    const std::size_t n = params.size();
    if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n || numels.size() != n)
        throw std::invalid_argument("thunder_tk adamw: params, grads, exp_avgs, exp_avg_sqs and numels differ in length");
    const std::vector<void*> p = pointer_list<void>(params, "adamw"), m = pointer_list<void>(exp_avgs, "adamw"),
                             v = pointer_list<void>(exp_avg_sqs, "adamw");
    const std::vector<const void*> g = pointer_list<const void>(grads, "adamw");
    tk::optim::adamw_args args{};
    args.params = p.data();
    args.grads = g.data();
    args.exp_avgs = m.data();
    args.exp_avg_sqs = v.data();
    args.numels = numels.data();
    args.count = static_cast<int>(n);
    args.dtype = dtype;
    // As torch's fused kernel takes them: doubles rounded to float once.
    args.hyper = {static_cast<float>(lr), static_cast<float>(beta1), static_cast<float>(beta2),
                  static_cast<float>(eps), static_cast<float>(weight_decay), static_cast<float>(step), maximize,
                  as_ptr<float>(clip_sq_norm), static_cast<float>(clip_max_norm)};
    launch_if_supported(tk::optim::adamw_unsupported(args), "adamw",
                        [&] { return tk::optim::launch_adamw(args, as_stream(stream)); });
}

// The sum of squares of every element of a list of dense tensors of one dtype (optim/grad_norm.h), into `out`.
void sq_norm(const std::vector<std::uintptr_t>& tensors, const std::vector<int64_t>& numels, int dtype,
             std::uintptr_t workspace, int64_t workspace_size, std::uintptr_t out, bool accumulate,
             std::uintptr_t stream) {
    if (numels.size() != tensors.size())
        throw std::invalid_argument("thunder_tk sq_norm: tensors and numels differ in length");
    const std::vector<const void*> t = pointer_list<const void>(tensors, "sq_norm");
    tk::optim::sq_norm_args args{};
    args.tensors = t.data();
    args.numels = numels.data();
    args.count = static_cast<int>(t.size());
    args.dtype = dtype;
    args.partials = reinterpret_cast<float*>(workspace);
    args.partials_size = workspace_size;
    args.out = reinterpret_cast<float*>(out);
    args.accumulate = accumulate;
    launch_if_supported(tk::optim::sq_norm_unsupported(args), "sq_norm",
                        [&] { return tk::optim::launch_sq_norm(args, as_stream(stream)); });
}

// RMSNorm over rows of n elements (norm/rms_norm.h), optionally after adding a residual; rstd saved in fp32.
void rms_norm_forward(std::uintptr_t x, int64_t x_stride, std::uintptr_t residual, int64_t residual_stride,
                      std::uintptr_t sum, int64_t sum_stride, std::uintptr_t weight, std::uintptr_t y, int64_t y_stride,
                      std::uintptr_t rstd, int64_t rstd_stride, int64_t rows, int64_t n, double eps, int dtype,
                      int weight_dtype, std::uintptr_t stream) {
    tk::norm::forward_args args{};
    args.x = as_ptr<void>(x);
    args.x_stride = x_stride;
    args.residual = as_ptr<void>(residual);
    args.residual_stride = residual_stride;
    args.sum = reinterpret_cast<void*>(sum);
    args.sum_stride = sum_stride;
    args.weight = as_ptr<void>(weight);
    args.y = reinterpret_cast<void*>(y);
    args.y_stride = y_stride;
    args.rstd = reinterpret_cast<float*>(rstd);
    args.rstd_stride = rstd_stride;
    args.rows = rows;
    args.n = n;
    args.eps = float(eps);
    args.dtype = dtype;
    args.weight_dtype = weight_dtype;
    launch_if_supported(tk::norm::forward_unsupported(args), "rms_norm_forward",
                        [&] { return tk::norm::launch_forward(args, as_stream(stream)); });
}

void rms_norm_backward(std::uintptr_t grad, int64_t grad_stride, std::uintptr_t input, int64_t input_stride,
                       std::uintptr_t rstd, int64_t rstd_stride, std::uintptr_t weight, std::uintptr_t residual_grad,
                       int64_t residual_grad_stride, std::uintptr_t dx, int64_t dx_stride, std::uintptr_t dw,
                       std::uintptr_t partial, int64_t partial_rows, int64_t rows, int64_t n, int dtype,
                       int weight_dtype, std::uintptr_t stream) {
    tk::norm::backward_args args{};
    args.grad = as_ptr<void>(grad);
    args.grad_stride = grad_stride;
    args.input = as_ptr<void>(input);
    args.input_stride = input_stride;
    args.rstd = as_ptr<float>(rstd);
    args.rstd_stride = rstd_stride;
    args.weight = as_ptr<void>(weight);
    args.residual_grad = as_ptr<void>(residual_grad);
    args.residual_grad_stride = residual_grad_stride;
    args.dx = reinterpret_cast<void*>(dx);
    args.dx_stride = dx_stride;
    args.dw = reinterpret_cast<void*>(dw);
    args.partial = reinterpret_cast<float*>(partial);
    args.rows = rows;
    args.n = n;
    args.dtype = dtype;
    args.weight_dtype = weight_dtype;
    // The scratch is sized by the caller from rms_norm_backward_partial_rows: a smaller one would be overrun.
    const char* why_not = tk::norm::backward_unsupported(args);
    if (why_not == nullptr && partial_rows < tk::norm::backward_partial_rows(rows, n, dtype))
        why_not = "the scratch has fewer rows than rms_norm_backward_partial_rows asks for";
    launch_if_supported(why_not, "rms_norm_backward",
                        [&] { return tk::norm::launch_backward(args, as_stream(stream)); });
}

// A fused qkv projection with LitGPT's rotary embedding of q's and k's heads in its epilogue: C = A W^T, then the
// rotate-half rope (gemm.h) over columns [0, rope_cols), row r at position r % seq, from cos and sin (rows of
// angle_stride elements in the element type, or fp32 where angle_fp32).
void gemm_rope(std::uintptr_t a, std::uintptr_t w, std::uintptr_t c, std::uintptr_t cos, std::uintptr_t sin, int dtype,
               int64_t M, int64_t N, int64_t K, int64_t a_stride_m, int64_t w_stride_n, int64_t c_stride_m,
               int64_t angle_stride, int64_t seq, int64_t rope_cols, int head_dim, int rope_dims, bool angle_fp32,
               std::uintptr_t stream, int tile_n, int epilogue) {
    tk::gemm::gemm_args g = gemm_operands(a, w, c, dtype, M, N, K, a_stride_m, 1, 1, w_stride_n, c_stride_m);
    g.rope_cos = as_ptr<void>(cos);
    g.rope_sin = as_ptr<void>(sin);
    g.rope_stride = angle_stride;
    g.rope_seq = seq;
    g.rope_cols = rope_cols;
    g.rope_head_dim = head_dim;
    g.rope_dims = rope_dims;
    g.rope_fp32 = angle_fp32;
    g.tile_n = tile_n;
    g.epilogue = epilogue;
    if (g.rope_cos == nullptr) throw std::invalid_argument("thunder_tk gemm_rope: cos is needed");
    launch_checked(g, stream, "gemm_rope");
}

void cross_entropy_forward_grad(std::uintptr_t logits, std::uintptr_t target, std::uintptr_t loss, std::uintptr_t lse,
                                std::uintptr_t grad, int64_t grad_row_stride, int dtype, int64_t rows, int64_t classes,
                                int64_t logits_row_stride, int64_t ignore_index, std::uintptr_t stream,
                                int part_bytes) {
    auto args = cross_entropy_common(logits, target, dtype, rows, classes, logits_row_stride, ignore_index);
    args.loss = reinterpret_cast<float*>(loss);
    args.lse = reinterpret_cast<float*>(lse);
    args.grad = reinterpret_cast<void*>(grad);
    args.grad_row_stride = grad_row_stride;
    launch_if_supported(
        tk::loss::cross_entropy_forward_grad_unsupported(args, part_bytes), "cross_entropy_forward_grad",
        [&] { return tk::loss::launch_cross_entropy_forward_grad(args, as_stream(stream), part_bytes); });
}

// One rank's end of a peer-memory channel: the layout and peer mappings are fixed when it is made, so a launch
// only passes the tensors. Launches on one channel must run in order whatever stream they are issued on: a
// synchronous call runs on the caller's stream, an asynchronous one on the channel's stream, and each launch
// waits for the previous one (an event) when the stream changes. Work handles are indices into a ring of events.
// Under CUDA-graph capture the waits stay inside one capture (a capture may not wait for work outside it); a
// graph's replays are ordered against the channel's other launches by graph_replay.
class P2PChannel {
  public:
    static constexpr int ring = 256;

    P2PChannel(int world, int blocks, int slots, int64_t cell_bytes, int rank, std::vector<std::uintptr_t> buffers,
               std::uintptr_t error_record, int64_t timeout_ns, std::uintptr_t comm_stream, bool pairs) {
        namespace c = tk::collectives;
        if (world < 2 || world > c::max_ranks)
            throw std::invalid_argument("P2PChannel: world must be 2.." + std::to_string(c::max_ranks));
        if (static_cast<int>(buffers.size()) != world) throw std::invalid_argument("P2PChannel: one buffer per rank");
        if (rank < 0 || rank >= world) throw std::invalid_argument("P2PChannel: rank out of range");
        if (blocks < 1 || slots < 2 || cell_bytes < 16 || cell_bytes % 16)
            throw std::invalid_argument("P2PChannel: blocks >= 1, slots >= 2, cell_bytes a positive multiple of 16");
        if (pairs && (world < 3 || blocks < world - 1))
            throw std::invalid_argument("P2PChannel: pairs needs at least 3 ranks and a block per peer");
        args_.layout = c::channel_layout{world, blocks, slots, cell_bytes, pairs};
        args_.rank = rank;
        for (int r = 0; r < world; ++r) args_.buffers[r] = reinterpret_cast<void*>(buffers[r]);
        // The record lives in pinned host memory; the kernels write it through its device mapping.
        void* device_view = nullptr;
        cudaError_t e = cudaHostGetDevicePointer(&device_view, reinterpret_cast<void*>(error_record), 0);
        if (e != cudaSuccess)
            throw std::runtime_error(std::string("P2PChannel: error record is not mapped pinned memory: ") +
                                     cudaGetErrorString(e));
        args_.error = static_cast<int64_t*>(device_view);
        args_.timeout_ns = timeout_ns;
        comm_ = reinterpret_cast<cudaStream_t>(comm_stream);
        check_launch(cudaEventCreateWithFlags(&inputs_ready_, cudaEventDisableTiming), "P2PChannel event");
        for (auto& ev : done_) check_launch(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "P2PChannel event");
    }
    ~P2PChannel() {
        cudaEventDestroy(inputs_ready_);
        for (auto ev : done_) cudaEventDestroy(ev);
    }
    P2PChannel(const P2PChannel&) = delete;
    P2PChannel& operator=(const P2PChannel&) = delete;

    static py::dict layout(int world, int blocks, int slots, int64_t cell_bytes, bool pairs) {
        tk::collectives::channel_layout L{world, blocks, slots, cell_bytes, pairs};
        return py::dict(py::arg("flag_bytes") = L.flag_words() * 8, py::arg("stage_offset") = L.stage_offset(),
                        py::arg("total_bytes") = L.total_bytes());
    }

    // Attach the copy-engine path (a second symmetric buffer of copy_engine_layout); made once, collectively.
    void attach_copy_engine(int slots, int64_t buffer_bytes, std::vector<std::uintptr_t> buffers, int reduce_blocks,
                            bool signal_by_copy) {
        if (static_cast<int>(buffers.size()) != args_.layout.world)
            throw std::invalid_argument("P2PChannel.attach_copy_engine: one buffer per rank");
        copy_engine_ = std::make_unique<tk::collectives::copy_engine>(args_.layout.world, args_.rank, slots,
                                                                      buffer_bytes, buffers.data(), reduce_blocks,
                                                                      signal_by_copy);
    }

    static py::dict copy_engine_layout(int world, int slots, int64_t buffer_bytes) {
        tk::collectives::copy_engine_layout L{world, slots, buffer_bytes};
        return py::dict(py::arg("flag_bytes") = L.flag_words() * 4, py::arg("stage_offset") = L.stage_offset(),
                        py::arg("slot_bytes") = L.slot_bytes());
    }

    // `copy_engine`: move the data on the copy engines (needs attach_copy_engine); a stream under CUDA-graph capture
    // always gets the SM kernels (the copy engine's flags carry host-side sequence numbers).
    int all_gather(std::uintptr_t in, std::uintptr_t out, int64_t bytes_per_rank, int64_t chunk_bytes, int elem_bytes,
                   std::uintptr_t caller, bool async, int grid, int sender_warps, bool copy_engine) {
        check_sender_warps(sender_warps);
        if (use_copy_engine(copy_engine, caller))
            return ordered(caller, async, "all_gather (copy engine)", [&](cudaStream_t s) {
                return copy_engine_->all_gather(as_ptr<void>(in), reinterpret_cast<void*>(out), bytes_per_rank, s);
            });
        tk::collectives::all_gather_args a{args_, as_ptr<void>(in), reinterpret_cast<void*>(out), bytes_per_rank,
                                           chunk_bytes, elem_bytes, sender_warps};
        return ordered(caller, async, "all_gather",
                       [&](cudaStream_t s) { return tk::collectives::launch_all_gather(a, grid, s); });
    }

    int reduce_scatter(std::uintptr_t in, std::uintptr_t out, int64_t elems_per_rank, int64_t chunk_elems, int dtype,
                       bool average, std::uintptr_t caller, bool async, int grid, int sender_warps, bool copy_engine) {
        check_sender_warps(sender_warps);
        if (use_copy_engine(copy_engine, caller))
            return ordered(caller, async, "reduce_scatter (copy engine)", [&](cudaStream_t s) {
                return copy_engine_->reduce_scatter(as_ptr<void>(in), reinterpret_cast<void*>(out), elems_per_rank,
                                                    dtype, average, s);
            });
        tk::collectives::reduce_scatter_args a{args_, as_ptr<void>(in), reinterpret_cast<void*>(out), elems_per_rank,
                                               chunk_elems, dtype, average, sender_warps};
        return ordered(caller, async, "reduce_scatter",
                       [&](cudaStream_t s) { return tk::collectives::launch_reduce_scatter(a, grid, s); });
    }

    // Make `stream` wait for the asynchronous launch `handle` (a later launch reusing its event is waited for
    // instead: later, never earlier).
    void wait(int handle, std::uintptr_t stream) const {
        if (handle < 0 || handle >= ring) throw std::invalid_argument("P2PChannel.wait: bad handle");
        check_launch(cudaStreamWaitEvent(as_stream(stream), done_[handle], 0), "wait");
    }

    // A CUDA graph holding launches of this channel replays on `stream` (not capturing). Called before the replay:
    // the replay waits for the channel's last launch outside any graph. Called after it: the channel's next launch
    // waits for the replay. (Inside the graph its launches are ordered by the edges captured with them.)
    void graph_replay(std::uintptr_t stream_handle) {
        cudaStream_t stream = as_stream(stream_handle);
        if (capture_of(stream) != 0) throw std::invalid_argument("P2PChannel.graph_replay: the stream is capturing");
        if (last_stream_ != nullptr && last_stream_ != stream && last_capture_ == 0)
            wait_for_last(stream, "graph_replay");
        last_stream_ = stream;
        last_ = -1;
        last_capture_ = 0;
    }

  private:
    bool use_copy_engine(bool wanted, std::uintptr_t caller) const {
        if (!wanted) return false;
        if (!copy_engine_) throw std::invalid_argument("P2PChannel: no copy engine attached");
        return capture_status(reinterpret_cast<cudaStream_t>(caller)) == cudaStreamCaptureStatusNone;
    }

    static void check_sender_warps(int warps) {
        if (warps < 1 || warps > 15)
            throw std::invalid_argument("P2PChannel: sender_warps must be 1..15 (of a block's 16 warps)");
    }

    // The previous launch ran on another stream than `s`: make `s` wait for it. A synchronous launch records no
    // event of its own, so record one on its stream now (it also covers later work there: later, never earlier).
    void wait_for_last(cudaStream_t s, const char* what) {
        if (last_ < 0) {
            last_ = next_;
            next_ = (next_ + 1) % ring;
            check_launch(cudaEventRecord(done_[last_], last_stream_), what);
        }
        check_launch(cudaStreamWaitEvent(s, done_[last_], 0), what);
    }

    // Whether `s` is capturing (an invalidated capture counts: nothing may be launched outside it), and into which
    // capture sequence.
    static cudaStreamCaptureStatus capture_status(cudaStream_t s, unsigned long long* id = nullptr) {
        cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
        unsigned long long sequence = 0;
        check_launch(cudaStreamGetCaptureInfo(s, &status, &sequence), "capture query");
        if (id != nullptr) *id = sequence;
        return status;
    }

    // The capture sequence `s` belongs to (0: none).
    static unsigned long long capture_of(cudaStream_t s) {
        unsigned long long id = 0;
        return capture_status(s, &id) == cudaStreamCaptureStatusActive ? id : 0;
    }

    template <class Launch> int ordered(std::uintptr_t caller_handle, bool async, const char* what, Launch launch) {
        cudaStream_t caller = reinterpret_cast<cudaStream_t>(caller_handle);
        cudaStream_t s = async ? comm_ : caller;
        const unsigned long long capture = capture_of(caller);  // the channel's stream joins it below
        if (async) {
            check_launch(cudaEventRecord(inputs_ready_, caller), what);
            check_launch(cudaStreamWaitEvent(comm_, inputs_ready_, 0), what);
        }
        // Across a capture's boundary there is nothing to wait for here: a capture runs nothing, and its replays
        // are ordered by graph_replay.
        if (last_stream_ != nullptr && last_stream_ != s && last_capture_ == capture) wait_for_last(s, what);
        check_launch(launch(s), what);
        last_stream_ = s;
        last_ = -1;
        last_capture_ = capture;
        if (!async) return -1;  // the caller's stream is already ordered after it
        const int i = next_;
        next_ = (next_ + 1) % ring;
        check_launch(cudaEventRecord(done_[i], s), what);
        last_ = i;
        return i;
    }

    tk::collectives::channel_args args_{};
    std::unique_ptr<tk::collectives::copy_engine> copy_engine_;
    cudaStream_t comm_ = nullptr, last_stream_ = nullptr;
    cudaEvent_t inputs_ready_ = nullptr;
    std::array<cudaEvent_t, ring> done_{};
    int next_ = 0, last_ = -1;
    unsigned long long last_capture_ = 0;  // the capture the last launch was recorded into (0: none)
};

// The selftests' 16-bit kernels take bf16 or fp16 by tk::dtype code.
void require_16bit(int dtype) {
    if (dtype != code_bf16 && dtype != code_fp16) throw std::invalid_argument("dtype must be bfloat16 or float16");
}

}  // namespace

// Tile-library unit kernels (tests/gpu/test_kittens.py): raw pointers, one warpgroup each.
void register_selftests(py::module_& m) {
    auto s = m.def_submodule("selftest", "Single-primitive kernels of the tile library, for its GPU unit tests.");
    s.def(
        "row_softmax",
        [](std::uintptr_t in, std::uintptr_t out, std::uintptr_t row_max, std::uintptr_t row_sum, int cols,
           std::uintptr_t stream) {
            if (cols != 64 && cols != 128 && cols != 256) throw std::invalid_argument("cols must be 64, 128 or 256");
            check_launch(tk::selftest::row_softmax(as_ptr<float>(in), reinterpret_cast<float*>(out),
                                                   reinterpret_cast<float*>(row_max), reinterpret_cast<float*>(row_sum),
                                                   cols, as_stream(stream)),
                         "selftest.row_softmax");
        },
        py::arg("inp"), py::arg("out"), py::arg("row_max"), py::arg("row_sum"), py::arg("cols"), py::arg("stream"));
    s.def(
        "mma_registers_a",
        [](std::uintptr_t a, std::uintptr_t b, std::uintptr_t out, int n, bool b_mn_major, int dtype,
           std::uintptr_t stream) {
            if (n != 64 && n != 128 && n != 256) throw std::invalid_argument("n must be 64, 128 or 256");
            require_16bit(dtype);
            check_launch(tk::selftest::mma_registers_a(as_ptr<float>(a), as_ptr<void>(b), reinterpret_cast<float*>(out),
                                                       n, b_mn_major, dtype, as_stream(stream)),
                         "selftest.mma_registers_a");
        },
        py::arg("a"), py::arg("b"), py::arg("out"), py::arg("n"), py::arg("b_mn_major"), py::arg("dtype"),
        py::arg("stream"));
    s.def(
        "store_matrices",
        [](std::uintptr_t in, std::uintptr_t out, int cols, int dtype, std::uintptr_t stream) {
            if (cols != 64 && cols != 128 && cols != 256) throw std::invalid_argument("cols must be 64, 128 or 256");
            require_16bit(dtype);
            check_launch(tk::selftest::store_matrices(as_ptr<float>(in), reinterpret_cast<void*>(out), cols, dtype,
                                                      as_stream(stream)),
                         "selftest.store_matrices");
        },
        py::arg("inp"), py::arg("out"), py::arg("cols"), py::arg("dtype"), py::arg("stream"));
    s.def(
        "load_matrices",
        [](std::uintptr_t in, std::uintptr_t out, int cols, int dtype, std::uintptr_t stream) {
            if (cols != 64 && cols != 128) throw std::invalid_argument("cols must be 64 or 128");
            require_16bit(dtype);
            check_launch(tk::selftest::load_matrices(as_ptr<void>(in), reinterpret_cast<void*>(out), cols, dtype,
                                                     as_stream(stream)),
                         "selftest.load_matrices");
        },
        py::arg("inp"), py::arg("out"), py::arg("cols"), py::arg("dtype"), py::arg("stream"));
    s.def(
        "reduce_add",
        [](std::uintptr_t dst, std::uintptr_t src, int dtype, int64_t rows, int64_t cols, int64_t stride, int row0,
           int col0, std::uintptr_t stream) {
            if (dtype != code_fp32 && dtype != code_bf16)
                throw std::invalid_argument("dtype must be float32 or bfloat16");
            if (col0 < 0 || row0 < 0 || (int64_t(col0) * (dtype == code_fp32 ? 4 : 2)) % 16)
                throw std::invalid_argument("col0 must be >= 0 and a multiple of 16 bytes (a TMA store's inner coordinate)");
            if ((cols * (dtype == code_fp32 ? 4 : 2)) % 16)
                throw std::invalid_argument("cols must span a multiple of 16 bytes (TMA stores clip at 16-byte chunks)");
            check_launch(tk::selftest::reduce_add(reinterpret_cast<void*>(dst), as_ptr<void>(src), dtype, rows, cols,
                                                  stride, row0, col0, as_stream(stream)),
                         "selftest.reduce_add");
        },
        py::arg("dst"), py::arg("src"), py::arg("dtype"), py::arg("rows"), py::arg("cols"), py::arg("stride"),
        py::arg("row0"), py::arg("col0"), py::arg("stream"));
    s.def(
        "block_sum",
        [](std::uintptr_t in, std::uintptr_t out, int blocks, int threads, std::uintptr_t stream) {
            if (threads != 32 && threads != 256 && threads != 1024)
                throw std::invalid_argument("threads must be 32, 256 or 1024");
            if (blocks <= 0) throw std::invalid_argument("blocks must be positive");
            check_launch(tk::selftest::block_sum(as_ptr<float>(in), reinterpret_cast<float*>(out), blocks, threads,
                                                 as_stream(stream)),
                         "selftest.block_sum");
        },
        py::arg("inp"), py::arg("out"), py::arg("blocks"), py::arg("threads"), py::arg("stream"));
    s.def(
        "failed_launch",
        [](std::uintptr_t stream) {
            check_launch(tk::selftest::failed_launch(as_stream(stream)), "selftest.failed_launch");
        },
        py::arg("stream"),
        "Launches a kernel through tk::launch_kernel with a block too large to run: raises the launch's error.");
}

PYBIND11_MODULE(_C, m) {
    m.doc() = "thunder_tk CUDA kernels (sm_90a). Called through thunder_tk.ops, which validates arguments.";

    m.def("kernels", [] { return std::vector<std::string>{"adamw", "all_gather", "attention_backward", "attention_bwd_delta", "attention_forward", "attention_rope_grad", "cross_entropy_backward", "cross_entropy_forward", "cross_entropy_forward_grad", "embedding_backward", "gemm", "gemm_fp32", "gemm_rope", "gemm_sum", "gemm_swiglu", "gemm_swiglu_grad", "reduce_scatter", "rms_norm", "sq_norm"}; },
          "Names of the kernels compiled into this build.");
    m.def("cuda_runtime_version", [] {
        int v = 0;
        cudaRuntimeGetVersion(&v);
        return v;
    });
    m.def("set_dependent_launch", &tk::set_dependent_launch, py::arg("enabled"),
          "Launch tk's kernels programmatically dependent on the kernel before them (set-up overlapped with its "
          "tail) or in plain stream order.");
    m.def("dependent_launch", &tk::dependent_launch, "Whether tk's kernels launch programmatically dependent.");
    m.attr("target_arch") = "sm_90a";
    m.attr("dtype_codes") =
        py::dict(py::arg("bfloat16") = int(code_bf16), py::arg("float16") = int(code_fp16), py::arg("float32") = int(code_fp32));

    m.def("attention_bwd_delta", &attention_bwd_delta, py::arg("o"), py::arg("grad_o"), py::arg("delta"),
          py::arg("dtype"), py::arg("batch"), py::arg("heads"), py::arg("seq"), py::arg("head_dim"),
          py::arg("o_stride"), py::arg("grad_o_stride"), py::arg("delta_stride"), py::arg("stream"),
          py::arg("rows_per_group") = 0, py::arg("resident_grid") = true, py::arg("zero_rows") = 0,
          "delta[b,h,s] = sum_d grad_o[b,h,s,d] * o[b,h,s,d] in fp32, enqueued on `stream`; zero_rows (optional): a "
          "contiguous fp32 (B, H, S, head_dim) buffer set to zero in the same pass.");
    m.def("attention_dq_finalize", &attention_dq_finalize, py::arg("accum"), py::arg("out"), py::arg("dtype"),
          py::arg("count"), py::arg("scale"), py::arg("stream"), py::arg("done") = 0, py::arg("group_elements") = 0,
          py::arg("target") = 0,
          "out = scale * accum (fp32, contiguous) rounded to bf16/fp16, `count` elements (a multiple of 8); "
          "the attention backward's last step, enqueued on `stream`. With `done` (the backward's dq_done): each "
          "group of group_elements once its counter reaches `target`, beside the backward's last blocks.");
    m.def("attention_rope_grad", &attention_rope_grad, py::arg("dq_accum"), py::arg("dq"), py::arg("dq_stride"),
          py::arg("q_heads"), py::arg("scale"), py::arg("dk"), py::arg("dk_stride"), py::arg("kv_heads"),
          py::arg("cos"), py::arg("sin"), py::arg("angle_fp32"), py::arg("angle_stride"), py::arg("dtype"),
          py::arg("batch"), py::arg("seq"), py::arg("head_dim"), py::arg("rope_dims"), py::arg("stream"),
          "The attention backward's last pass for roped q and k, in one launch: dq = scale * dq_accum (fp32, "
          "contiguous) and dk (in place; 0: none) rotated back by the rotate-half rope over each head's first "
          "rope_dims columns, rows (B, H, S) at the given strides. Enqueued on `stream`.");
    m.def("attention_forward", &attention_forward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("o"),
          py::arg("lse"), py::arg("dtype"), py::arg("batch"), py::arg("q_heads"), py::arg("kv_heads"), py::arg("q_len"),
          py::arg("kv_len"), py::arg("head_dim"), py::arg("q_stride"), py::arg("k_stride"), py::arg("v_stride"),
          py::arg("o_stride"), py::arg("lse_stride"), py::arg("scale"), py::arg("causal"), py::arg("stream"),
          py::arg("max_blocks") = 0, py::arg("tickets") = 0, py::arg("split_scratch") = 0,
          py::arg("split_scratch_floats") = 0, py::arg("split_counts") = 0, py::arg("split_counts_len") = 0,
          py::arg("window") = 0,
          "o = softmax(scale q k^T (causal mask)) v and lse (fp32, natural log) per query row, (B, H, S, D) tensors "
          "with strides (batch, head, sequence) in elements; enqueued on `stream`. With the dynamic schedule "
          "(tickets) and scratch and counters as attention_forward_split_plan asks, the last wave's tiles are split "
          "by keys. window > 0 (causal only): a sliding window, query i keeps keys i - window < j <= i.");
    m.def(
        "attention_forward_split_plan",
        [](int64_t batch, int64_t q_heads, int64_t q_len, int64_t kv_len, int64_t head_dim, bool causal,
           int max_blocks, bool dynamic) {
            tk::attention::forward_args args{};  // sizes only: the plan reads no tensor
            fill_attention_common(args, 0, 0, 0, 0, batch, q_heads, q_heads, q_len, kv_len, head_dim, {}, {}, {}, {},
                                  1.0f, causal, 0);  // a window needs causal, which is never split
            args.max_blocks = max_blocks;
            const auto needs = tk::attention::forward_split_plan(args, dynamic);
            return std::make_pair(needs.scratch_floats, needs.counts);
        },
        py::arg("batch"), py::arg("q_heads"), py::arg("q_len"), py::arg("kv_len"), py::arg("head_dim"),
        py::arg("causal"), py::arg("max_blocks"), py::arg("dynamic"),
        "(fp32 scratch floats, zeroed int32 counters) that attention_forward needs to split its last wave's tiles "
        "by keys on the current device, (0, 0) where it does not split.");
    m.def("attention_backward", &attention_backward, py::arg("q"), py::arg("k"), py::arg("v"), py::arg("dout"),
          py::arg("lse"), py::arg("delta"), py::arg("dq_accum"), py::arg("dk"), py::arg("dv"), py::arg("dtype"),
          py::arg("batch"), py::arg("q_heads"), py::arg("kv_heads"), py::arg("q_len"), py::arg("kv_len"),
          py::arg("head_dim"), py::arg("q_stride"), py::arg("k_stride"), py::arg("v_stride"), py::arg("dout_stride"),
          py::arg("dk_stride"), py::arg("dv_stride"), py::arg("lse_stride"), py::arg("delta_stride"), py::arg("scale"),
          py::arg("causal"), py::arg("stream"), py::arg("group_split") = 1, py::arg("split_from") = 0,
          py::arg("split_parts") = 0, py::arg("split_scratch") = 0, py::arg("split_counts") = 0, py::arg("window") = 0,
          py::arg("dq_done") = 0, py::arg("zero_next") = 0, py::arg("zero_next_count") = 0,
          "dK, dV (input dtype, summed over each key/value head's query heads, or over each of group_split parts of "
          "them) and dS K added into the zeroed fp32 dq_accum, from the forward's lse and delta = rowsum(dO O); "
          "units (128 keys of a head) from split_from on walked in split_parts query ranges and merged (fp32 "
          "split_scratch, zeroed split_counts left zero); window > 0 (causal only): the forward's sliding window; "
          "dq_done (optional, zeroed uint64, batch * kv_heads * group_split): each block adds its steps to its dQ "
          "rows' counter once its reduce-adds are complete. Enqueued on `stream`; returns the steps every counter "
          "reaches (0 without dq_done), attention_dq_finalize's target. zero_next (optional, fp32, "
          "zero_next_count a multiple of 4, apart from dq_accum): set to zero by the launch, for the next one.");
    m.def("attention_backward_max_zero_share", &tk::attention::backward_max_zero_share,
          "The most float4s of zero_next one attention_backward block zeroes (32-bit offsets); a zero_next_count "
          "whose share over the launch's blocks is larger is refused.");
    m.def("cross_entropy_forward", &cross_entropy_forward, py::arg("logits"), py::arg("target"), py::arg("loss"),
          py::arg("lse"), py::arg("dtype"), py::arg("rows"), py::arg("classes"), py::arg("logits_row_stride"),
          py::arg("ignore_index"), py::arg("stream"),
          "Per row of (rows, classes) logits: loss = lse - logit[target] (0 where target == ignore_index, NaN for a "
          "target outside [0, classes)) and lse, both fp32 (rows,); enqueued on `stream`.");
    m.def("cross_entropy_backward", &cross_entropy_backward, py::arg("logits"), py::arg("target"), py::arg("lse"),
          py::arg("grad_loss"), py::arg("grad_loss_stride"), py::arg("grad"), py::arg("grad_row_stride"),
          py::arg("dtype"), py::arg("rows"), py::arg("classes"), py::arg("logits_row_stride"), py::arg("ignore_index"),
          py::arg("stream"),
          "grad[r, c] = grad_loss[r] * (softmax[r, c] - (c == target[r])), zero rows where target == ignore_index; "
          "enqueued on `stream`.");
    m.def("cross_entropy_forward_grad", &cross_entropy_forward_grad, py::arg("logits"), py::arg("target"),
          py::arg("loss"), py::arg("lse"), py::arg("grad"), py::arg("grad_row_stride"), py::arg("dtype"),
          py::arg("rows"), py::arg("classes"), py::arg("logits_row_stride"), py::arg("ignore_index"), py::arg("stream"),
          py::arg("part_bytes") = tk::loss::CROSS_ENTROPY_PART_BYTES,
          "cross_entropy_forward's loss and lse and grad = softmax - onehot(target) (unscaled; zero rows where "
          "ignored) from one read of the logits, each row kept on chip: split over a cluster's blocks in the fewest "
          "parts of at most part_bytes (> 0; capped at 200 KB); enqueued on `stream`.");
    m.def("cross_entropy_forward_grad_max_classes", &tk::loss::cross_entropy_forward_grad_max_classes,
          py::arg("dtype"), "The widest row cross_entropy_forward_grad keeps on chip for logits of `dtype`.");
    m.def("gemm_resident_blocks",
          [](int cluster) {
              if (cluster != 1 && cluster != 2) throw std::invalid_argument("cluster must be 1 or 2");
              return tk::gemm::gemm_resident_blocks(cluster);
          },
          py::arg("cluster"),
          "Blocks of the GEMM's persistent grid on the current device for clusters of `cluster` (1 or 2).");
    m.def("gemm", &gemm, py::arg("a"), py::arg("b"), py::arg("c"), py::arg("bias"), py::arg("dtype"), py::arg("M"),
          py::arg("N"), py::arg("K"), py::arg("a_stride_m"), py::arg("a_stride_k"), py::arg("b_stride_k"),
          py::arg("b_stride_n"), py::arg("c_stride_m"), py::arg("stream"), py::arg("group_rows") = 0, py::arg("cluster") = 0,
          py::arg("tickets") = 0, py::arg("tile_n") = 0, py::arg("pingpong") = 0, py::arg("epilogue") = 0,
          py::arg("stream_k") = 0, py::arg("partials") = 0, py::arg("flags") = 0, py::arg("skinny") = 0,
          py::arg("sum_a") = 0, py::arg("sum_b") = 0, py::arg("sum_K") = 0, py::arg("sum_a_stride_m") = 0,
          py::arg("sum_a_stride_k") = 0, py::arg("sum_b_stride_k") = 0, py::arg("sum_b_stride_n") = 0,
          py::arg("c_fp32") = false,
          "C = A B (+ bias), bf16/fp16 with fp32 accumulation, enqueued on `stream`; `c_fp32`: C in fp32 (bf16 "
          "operands, the plain kernel with the consumers' epilogue); `tickets`: a zeroed int32 "
          "counter for the dynamic tile schedule (0: static); `tile_n`: output tile width 128 or 256 (0: chosen by "
          "how well each fills the persistent grid's last wave); `pingpong`: 1 the two consumer warpgroups take "
          "128 x 128 tiles in turns, -1 they share each tile, 0 automatic; `epilogue`: 1 store warps write the output "
          "tiles, 2 the consumers do, 3 the consumers from registers (no staging), 0 automatic; `stream_k`: 1 the "
          "grid's last wave cut into k-block ranges, with "
          "`partials` (fp32) and `flags` (zeroed int32) of gemm_stream_k_workspace()'s sizes, not shared with a "
          "launch that may run at the same time; 0 or -1 whole tiles only; `skinny`: 1 the kernel for few rows (at "
          "most 64, A K-major), which splits K over `partials` and `flags` where given, -1 never, 0 where it "
          "applies. With `sum_a` and `sum_b`: C = A B + A2 B2 (A2 (M, sum_K), B2 (sum_K, N) with their own strides "
          "and A's and B's majors), both products in one fp32 accumulator, rounded once (kernel gemm_sum).");
    m.def("gemm_swiglu", &gemm_swiglu, py::arg("a"), py::arg("w1"), py::arg("w2"), py::arg("h1"), py::arg("h2"),
          py::arg("g"), py::arg("dtype"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("a_stride_m"),
          py::arg("w_stride_n"), py::arg("out_stride_m"), py::arg("stream"), py::arg("tickets") = 0,
          "SwiGLU's products in one launch: h1 = A W1^T, h2 = A W2^T and g = silu(h1) * h2 (each rounded to the "
          "element type), A (M, K) and the weights (N, K) K-major, the outputs (M, N) with one row stride; "
          "enqueued on `stream`; `tickets` as gemm's.");
    m.def("gemm_swiglu_grad", &gemm_swiglu_grad, py::arg("a"), py::arg("b"), py::arg("h1"), py::arg("h2"),
          py::arg("dh1"), py::arg("dh2"), py::arg("dtype"), py::arg("M"), py::arg("N"), py::arg("K"),
          py::arg("a_stride_m"), py::arg("b_stride_k"), py::arg("b_stride_n"), py::arg("row_stride"),
          py::arg("stream"), py::arg("pingpong") = 0,
          "SwiGLU's backward through its output projection: with dg = A B (A (M, K) K-major, B (K, N) with one unit "
          "stride; dg never written), dh1 = dg * h2 * silu'(h1) and dh2 = dg * silu(h1), each rounded once to the "
          "element type; h1, h2, dh1 and dh2 (M, N) with one row stride; enqueued on `stream`. `pingpong`: 0 or 1 "
          "the consumer warpgroups take whole 128 x 128 tiles in turns, -1 they share each tile.");
    m.def("embedding_backward", &embedding_backward, py::arg("grad"), py::arg("grad_stride"), py::arg("sorted"),
          py::arg("order"), py::arg("out"), py::arg("tokens"), py::arg("rows"), py::arg("dim"), py::arg("padding_idx"),
          py::arg("dtype"), py::arg("stream"),
          "The embedding's weight gradient (rows, dim): each row the fp32 sum, in position order, of the gradient "
          "rows (tokens, dim; row stride grad_stride) of the tokens that name it, from their ids sorted stably "
          "(int64) and the sort's permutation (int64); the padding_idx row (negative: none) and rows no token names "
          "zero; enqueued on `stream`.");
    m.def("adamw", &adamw, py::arg("params"), py::arg("grads"), py::arg("exp_avgs"), py::arg("exp_avg_sqs"),
          py::arg("numels"), py::arg("dtype"), py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("weight_decay"), py::arg("step"), py::arg("maximize"), py::arg("clip_sq_norm"),
          py::arg("clip_max_norm"), py::arg("stream"),
          "AdamW (decoupled weight decay, no AMSGrad) in place over lists of dense tensors of one dtype, entry i of "
          "each list the same size and layout: torch's fused AdamW's arithmetic in fp32; `step` counted before the "
          "update (1 on the first); enqueued on `stream`, 256 entries a launch. A non-zero `clip_sq_norm` (one fp32 "
          "on the device, sq_norm's) clips the gradients by that norm and `clip_max_norm` first, as "
          "torch.nn.utils.clip_grad_norm_ does, without writing them.");
    m.def("sq_norm", &sq_norm, py::arg("tensors"), py::arg("numels"), py::arg("dtype"), py::arg("workspace"),
          py::arg("workspace_size"), py::arg("out"), py::arg("accumulate"), py::arg("stream"),
          "The sum of squares of every element of a list of dense tensors of one dtype, in fp32, written to `out` "
          "(one fp32 on the device; added to it where `accumulate`); `workspace` holds sq_norm_workspace(count) "
          "fp32. The same bits on every call on one GPU; enqueued on `stream`.");
    m.def("sq_norm_workspace", &tk::optim::sq_norm_workspace, py::arg("count"),
          "fp32 elements of workspace that sq_norm over `count` tensors needs.");
    m.def("rms_norm_forward", &rms_norm_forward, py::arg("x"), py::arg("x_stride"), py::arg("residual"),
          py::arg("residual_stride"), py::arg("sum"), py::arg("sum_stride"), py::arg("weight"), py::arg("y"),
          py::arg("y_stride"), py::arg("rstd"), py::arg("rstd_stride"), py::arg("rows"), py::arg("n"), py::arg("eps"),
          py::arg("dtype"), py::arg("weight_dtype"), py::arg("stream"),
          "RMSNorm of (rows, n) rows: s = x (+ residual, rounded; written to sum), rstd = 1 / sqrt(mean(s^2) + eps) "
          "(fp32, rstd_stride apart), y = s * rstd * weight; fp32 arithmetic, each output rounded once; residual 0: "
          "none; enqueued on `stream`.");
    m.def("rms_norm_backward", &rms_norm_backward, py::arg("grad"), py::arg("grad_stride"), py::arg("input"),
          py::arg("input_stride"), py::arg("rstd"), py::arg("rstd_stride"), py::arg("weight"),
          py::arg("residual_grad"), py::arg("residual_grad_stride"), py::arg("dx"), py::arg("dx_stride"),
          py::arg("dw"), py::arg("partial"), py::arg("partial_rows"), py::arg("rows"), py::arg("n"),
          py::arg("dtype"), py::arg("weight_dtype"), py::arg("stream"),
          "RMSNorm's backward: dx = rstd g - rstd^3 s mean(g s) (+ residual_grad; 0: none), g = grad * weight, and "
          "dw = the sum over rows of grad * s * rstd in the weight's dtype, from block partial sums in fp32 scratch "
          "(partial_rows x n, rms_norm_backward_partial_rows) added in a fixed order; enqueued on `stream`.");
    m.def("rms_norm_backward_partial_rows", &tk::norm::backward_partial_rows, py::arg("rows"), py::arg("n"),
          py::arg("dtype"),
          "Rows of fp32 scratch rms_norm_backward needs on the current device (0 where the shape is unsupported).");
    m.def("gemm_rope", &gemm_rope, py::arg("a"), py::arg("w"), py::arg("c"), py::arg("cos"), py::arg("sin"),
          py::arg("dtype"), py::arg("M"), py::arg("N"), py::arg("K"), py::arg("a_stride_m"), py::arg("w_stride_n"),
          py::arg("c_stride_m"), py::arg("angle_stride"), py::arg("seq"), py::arg("rope_cols"), py::arg("head_dim"),
          py::arg("rope_dims"), py::arg("angle_fp32"), py::arg("stream"), py::arg("tile_n") = 0,
          py::arg("epilogue") = 0,
          "C = A W^T (A (M, K) and W (N, K) K-major) with LitGPT's rotate-half rotary embedding applied to columns "
          "[0, rope_cols) (heads of head_dim columns, the first rope_dims of each turned; row r at position r % seq) "
          "from the fp32 accumulators, rounded once; cos and sin in the element type (fp32 where angle_fp32) with "
          "rows of angle_stride elements; enqueued on `stream`; `tile_n` and `epilogue` as gemm's.");
    m.def("gemm_stream_k_workspace",
          [] {
              const int64_t floats = tk::gemm::stream_k_workspace_floats();
              const int flags = tk::gemm::stream_k_flags();
              if (floats <= 0 || flags <= 0) throw std::runtime_error("thunder_tk: no CUDA device for the GEMM");
              return std::make_pair(floats, flags);
          },
          "(fp32 partial sums, int32 flags) that a GEMM launch's stream-K workspace holds on the current device.");

    // Module-local: a second build of this module loaded beside it (benchmarks/ab_inprocess.py) registers its own.
    py::class_<P2PChannel>(m, "P2PChannel", py::module_local(),
                           "One rank's end of a peer-memory channel (thunder_tk.collectives sets it up).")
        .def(py::init<int, int, int, int64_t, int, std::vector<std::uintptr_t>, std::uintptr_t, int64_t,
                      std::uintptr_t, bool>(),
             py::arg("world"), py::arg("blocks"), py::arg("slots"), py::arg("cell_bytes"), py::arg("rank"),
             py::arg("buffers"), py::arg("error_record"), py::arg("timeout_ns"), py::arg("comm_stream"),
             py::arg("pairs") = false)
        .def_static("layout", &P2PChannel::layout, py::arg("world"), py::arg("blocks"), py::arg("slots"),
                    py::arg("cell_bytes"), py::arg("pairs") = false, "Byte sizes of one rank's symmetric buffer.")
        .def("all_gather", &P2PChannel::all_gather, py::arg("inp"), py::arg("out"), py::arg("bytes_per_rank"),
             py::arg("chunk_bytes"), py::arg("elem_bytes"), py::arg("caller_stream"), py::arg("async_op"),
             py::arg("grid") = 0, py::arg("sender_warps") = 8, py::arg("copy_engine") = false,
             "Returns a handle for wait(). sender_warps: of a block's 16 warps, how many send. copy_engine: move "
             "the data on the copy engines (attach_copy_engine first).")
        .def("reduce_scatter", &P2PChannel::reduce_scatter, py::arg("inp"), py::arg("out"), py::arg("elems_per_rank"),
             py::arg("chunk_elems"), py::arg("dtype"), py::arg("average"), py::arg("caller_stream"),
             py::arg("async_op"), py::arg("grid") = 0, py::arg("sender_warps") = 8, py::arg("copy_engine") = false,
             "Returns a handle for wait(). sender_warps: of a block's 16 warps, how many send (the rest reduce). "
             "copy_engine: move the data on the copy engines (attach_copy_engine first).")
        .def("attach_copy_engine", &P2PChannel::attach_copy_engine, py::arg("slots"), py::arg("buffer_bytes"),
             py::arg("buffers"), py::arg("reduce_blocks"), py::arg("signal_by_copy") = false,
             "Set up the copy-engine path on a second symmetric buffer (every rank, before its first use).")
        .def_static("copy_engine_layout", &P2PChannel::copy_engine_layout, py::arg("world"), py::arg("slots"),
                    py::arg("buffer_bytes"), "Byte offsets of the copy-engine buffer's flags and slot sizes.")
        .def("wait", &P2PChannel::wait, py::arg("handle"), py::arg("stream"))
        .def("graph_replay", &P2PChannel::graph_replay, py::arg("stream"));

    register_selftests(m);
}
