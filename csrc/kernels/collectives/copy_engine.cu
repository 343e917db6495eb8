// Collectives on the copy engines (see copy_engine.h for the protocol). tests/test_copy_engine_protocol.py plays
// this protocol on the CPU for 2-16 ranks: change its chunking, slots or sequence numbers there too.
#include "kernels/collectives/copy_engine.h"

#include <cuda.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kernels/collectives/rank_sum.cuh"
#include "kittens/common.cuh"

namespace tk::collectives {
namespace {

enum flag_kind : int { ready = 0, done = 1 };
constexpr int scratch_local = 0;  // then 1 + p for link p

using stream_value_fn = CUresult (*)(CUstream, CUdeviceptr, cuuint32_t, unsigned int);

// Driver entry points looked up at run time, so the module never links libcuda.
stream_value_fn driver_fn(const char* name) {
    void* p = nullptr;
    cudaDriverEntryPointQueryResult status;
    if (cudaGetDriverEntryPointByVersion(name, &p, 12000, cudaEnableDefault, &status) != cudaSuccess ||
        status != cudaDriverEntryPointSuccess)
        return nullptr;
    return reinterpret_cast<stream_value_fn>(p);
}
stream_value_fn wait_value() {
    static stream_value_fn fn = driver_fn("cuStreamWaitValue32");
    return fn;
}
stream_value_fn write_value() {
    static stream_value_fn fn = driver_fn("cuStreamWriteValue32");
    return fn;
}

cudaError_t from_driver(CUresult r) { return r == CUDA_SUCCESS ? cudaSuccess : cudaErrorUnknown; }

// Bytes per chunk: a message goes in at least `min_chunks` chunks where each can still be `min_chunk_bytes`, so
// that one chunk's local step (the receiver's copy or sum) overlaps the next one's transfer
// instead of preceding a single transfer; never more than a slot; a multiple of 256 bytes (and of `elem`).
constexpr int64_t min_chunks = 4, min_chunk_bytes = 2 << 20;
int64_t chunk_size(int64_t bytes, int64_t slot_bytes, int64_t elem) {
    int64_t c = std::max(min_chunk_bytes, (bytes + min_chunks - 1) / min_chunks);
    c = std::min(slot_bytes, (c + 255) / 256 * 256);
    return std::max<int64_t>(elem, c / elem * elem);
}

// Reduce-scatter's sum: out[i] = scale * sum over ranks r (in rank order, fp32) of src[r][i].
struct sum_args {
    const void* src[max_ranks];
    void* out;
    int64_t n;
    int world;
    float scale;
};

constexpr int sum_threads = 512;
constexpr int sum_unroll = 4;

template <typename T>
__global__ void __launch_bounds__(sum_threads) sum_kernel(const sum_args a) {
    const T* const* src = reinterpret_cast<const T* const*>(a.src);
    T* out = static_cast<T*>(a.out);
    bool vec = (reinterpret_cast<uintptr_t>(out) & 15) == 0;
    for (int r = 0; r < a.world; ++r) vec = vec && (reinterpret_cast<uintptr_t>(src[r]) & 15) == 0;
    const int64_t stride = int64_t(gridDim.x) * sum_threads;
    const int64_t first = int64_t(blockIdx.x) * sum_threads + threadIdx.x;
    auto source = [&](int r) { return src[r]; };
    auto load = [](int, const auto* q) { return __ldcg(q); };  // staging is rewritten by peers' copies: skip L1
    int64_t done = 0;
    if (vec) {
        const int64_t n_vec = a.n / vec16_elems<T>;
        sum_rank_vectors<T, sum_unroll>(out, n_vec, first, stride, a.world, a.scale, source, load);
        done = n_vec * vec16_elems<T>;
    }
    sum_rank_elements<T>(out, done, a.n, first, stride, a.world, a.scale, source, load);
}

cudaError_t launch_sum(const sum_args& a, int dtype_code, int max_blocks, cudaStream_t s) {
    const int elem = dtype_code == static_cast<int>(dtype::fp32) ? 4 : 2;
    const int64_t per_block = int64_t(sum_threads) * sum_unroll * (16 / elem);
    const int grid = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(max_blocks, (a.n + per_block - 1) / per_block)));
    switch (static_cast<dtype>(dtype_code)) {
        case dtype::bf16: sum_kernel<__nv_bfloat16><<<grid, sum_threads, 0, s>>>(a); break;
        case dtype::fp16: sum_kernel<__half><<<grid, sum_threads, 0, s>>>(a); break;
        case dtype::fp32: sum_kernel<float><<<grid, sum_threads, 0, s>>>(a); break;
        default: return cudaErrorInvalidValue;
    }
    return cudaGetLastError();
}

// All-gather's local step: dst[j][0, n) = src[j][0, n) for each of the grid's y entries (the staged chunks and the
// rank's own), in the widest word all of an entry's addresses allow.
struct copy_args {
    const void* src[max_ranks];
    void* dst[max_ranks];
    int64_t n;  // bytes per entry
};

template <typename W>
__device__ __forceinline__ int64_t copy_words(const char* src, char* dst, int64_t n, int64_t first, int64_t stride) {
    const W* s = reinterpret_cast<const W*>(src);
    W* d = reinterpret_cast<W*>(dst);
    const int64_t words = n / int64_t(sizeof(W));
    for (int64_t base = first; base < words; base += stride * sum_unroll) {
        W w[sum_unroll];
#pragma unroll
        for (int u = 0; u < sum_unroll; ++u)
            if (base + u * stride < words) w[u] = __ldcg(s + base + u * stride);  // staging is rewritten by peers
#pragma unroll
        for (int u = 0; u < sum_unroll; ++u)
            if (base + u * stride < words) d[base + u * stride] = w[u];
    }
    return words * int64_t(sizeof(W));
}

__global__ void __launch_bounds__(sum_threads) copy_kernel(const copy_args a) {
    const char* src = static_cast<const char*>(a.src[blockIdx.y]);
    char* dst = static_cast<char*>(a.dst[blockIdx.y]);
    const int64_t stride = int64_t(gridDim.x) * sum_threads;
    const int64_t first = int64_t(blockIdx.x) * sum_threads + threadIdx.x;
    const uintptr_t align = reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst);
    int64_t done;
    if ((align & 15) == 0) done = copy_words<uint4>(src, dst, a.n, first, stride);
    else if ((align & 7) == 0) done = copy_words<uint2>(src, dst, a.n, first, stride);
    else if ((align & 3) == 0) done = copy_words<unsigned int>(src, dst, a.n, first, stride);
    else if ((align & 1) == 0) done = copy_words<unsigned short>(src, dst, a.n, first, stride);
    else done = copy_words<unsigned char>(src, dst, a.n, first, stride);
    for (int64_t i = done + first; i < a.n; i += stride) dst[i] = src[i];
}

cudaError_t launch_copy(const copy_args& a, int entries, int max_blocks, cudaStream_t s) {
    const int64_t per_block = int64_t(sum_threads) * sum_unroll * 16;
    const int64_t want = (a.n + per_block - 1) / per_block;
    const int x = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(std::max(1, max_blocks / entries), want)));
    copy_kernel<<<dim3(x, entries), sum_threads, 0, s>>>(a);
    return cudaGetLastError();
}

void check(cudaError_t e, const char* what) {
    if (e != cudaSuccess)
        throw std::runtime_error(std::string("copy_engine: ") + what + ": " + cudaGetErrorString(e));
}

#define TK_TRY(expr)                                  \
    do {                                              \
        if (cudaError_t e_ = (expr); e_ != cudaSuccess) \
            return e_;                                \
    } while (0)

}  // namespace

copy_engine::copy_engine(int world, int rank, int slots, int64_t buffer_bytes, const std::uintptr_t* buffers,
                         int reduce_blocks, bool signal_by_copy)
    : signal_by_copy_(signal_by_copy) {
    if (world < 2 || world > max_ranks) throw std::invalid_argument("copy_engine: world must be 2.." + std::to_string(max_ranks));
    if (rank < 0 || rank >= world) throw std::invalid_argument("copy_engine: rank out of range");
    if (slots < 2) throw std::invalid_argument("copy_engine: slots must be >= 2");
    if (reduce_blocks < 1) throw std::invalid_argument("copy_engine: reduce_blocks must be >= 1");
    layout_ = copy_engine_layout{world, slots, buffer_bytes};
    if (layout_.slot_bytes() < 4096)
        throw std::invalid_argument("copy_engine: buffer too small for " + std::to_string(world) + " ranks and " +
                                    std::to_string(slots) + " slots");
    if (wait_value() == nullptr || write_value() == nullptr)
        throw std::runtime_error("copy_engine: the driver has no cuStreamWaitValue32/cuStreamWriteValue32");
    rank_ = rank;
    reduce_blocks_ = reduce_blocks;
    for (int r = 0; r < world; ++r) buffers_[r] = reinterpret_cast<void*>(buffers[r]);
    check(cudaStreamCreateWithFlags(&local_, cudaStreamNonBlocking), "stream");
    for (int p = 0; p < world; ++p)
        if (p != rank) check(cudaStreamCreateWithFlags(&link_[p], cudaStreamNonBlocking), "stream");
    check(cudaEventCreateWithFlags(&forked_, cudaEventDisableTiming), "event");
    for (auto& ev : joined_) check(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), "event");
}

copy_engine::~copy_engine() {
    for (auto ev : joined_) if (ev) cudaEventDestroy(ev);
    if (forked_) cudaEventDestroy(forked_);
    for (auto s : link_) if (s) cudaStreamDestroy(s);
    if (local_) cudaStreamDestroy(local_);
}

uint32_t* copy_engine::flag(int rank, int kind, int source, int slot) const {
    return static_cast<uint32_t*>(buffers_[rank]) + (int64_t(kind) * layout_.world + source) * layout_.slots + slot;
}

char* copy_engine::region(int receiver, int sender, int slot) const {
    const int W = layout_.world, q = (sender - receiver - 1 + W) % W;
    return static_cast<char*>(buffers_[receiver]) + layout_.stage_offset() +
           (int64_t(q) * layout_.slots + slot) * layout_.slot_bytes();
}

// Set this rank's word `kind`[rank_][slot] in `to_rank`'s buffer to `value`, after everything before it on `s`:
// a stream write straight into the peer's mapping, or (signal_by_copy_) a local stream write and a 4-byte copy.
cudaError_t copy_engine::signal(cudaStream_t s, int scratch, uint32_t value, int to_rank, int kind, int slot) {
    if (!signal_by_copy_)
        return from_driver(write_value()(s, reinterpret_cast<CUdeviceptr>(flag(to_rank, kind, rank_, slot)), value,
                                         CU_STREAM_WRITE_VALUE_DEFAULT));
    uint32_t* word = static_cast<uint32_t*>(buffers_[rank_]) + 2ll * layout_.world * layout_.slots + scratch;
    TK_TRY(from_driver(write_value()(s, reinterpret_cast<CUdeviceptr>(word), value, CU_STREAM_WRITE_VALUE_DEFAULT)));
    return cudaMemcpyAsync(flag(to_rank, kind, rank_, slot), word, sizeof(uint32_t), cudaMemcpyDefault, s);
}

// Hold `s` until this rank's word `kind`[source][slot] has reached `value` (wrapping comparison).
cudaError_t copy_engine::wait(cudaStream_t s, int kind, int source, int slot, uint32_t value) {
    return from_driver(wait_value()(s, reinterpret_cast<CUdeviceptr>(flag(rank_, kind, source, slot)), value,
                                    CU_STREAM_WAIT_VALUE_GEQ));
}

cudaError_t copy_engine::fork(cudaStream_t caller) {
    TK_TRY(cudaEventRecord(forked_, caller));
    TK_TRY(cudaStreamWaitEvent(local_, forked_, 0));
    for (int p = 0; p < layout_.world; ++p)
        if (p != rank_) TK_TRY(cudaStreamWaitEvent(link_[p], forked_, 0));
    return cudaSuccess;
}

cudaError_t copy_engine::join(cudaStream_t caller) {
    int i = 0;
    auto join_one = [&](cudaStream_t s) -> cudaError_t {
        TK_TRY(cudaEventRecord(joined_[i], s));
        TK_TRY(cudaStreamWaitEvent(caller, joined_[i], 0));
        ++i;
        return cudaSuccess;
    };
    TK_TRY(join_one(local_));
    for (int p = 0; p < layout_.world; ++p)
        if (p != rank_) TK_TRY(join_one(link_[p]));
    return cudaSuccess;
}

// Chunk k of a message to peer p: once p has consumed what this rank pushed into the same slot `slots` chunks
// ago, copy `bytes` from `from` into this rank's region at p and raise p's ready word.
cudaError_t copy_engine::push(uint64_t k, int p, const void* from, int64_t bytes) {
    const int slot = static_cast<int>(k % layout_.slots);
    if (k >= static_cast<uint64_t>(layout_.slots))
        TK_TRY(wait(link_[p], done, p, slot, static_cast<uint32_t>(k + 1 - layout_.slots)));
    TK_TRY(cudaMemcpyAsync(region(p, rank_, slot), from, bytes, cudaMemcpyDefault, link_[p]));
    return signal(link_[p], 1 + p, static_cast<uint32_t>(k + 1), p, ready, slot);
}

// Hold the local stream until every peer's chunk k has arrived.
cudaError_t copy_engine::await_peers(uint64_t k) {
    for (int r = 0; r < layout_.world; ++r)
        if (r != rank_)
            TK_TRY(wait(local_, ready, r, static_cast<int>(k % layout_.slots), static_cast<uint32_t>(k + 1)));
    return cudaSuccess;
}

// After the local stream's work on chunk k: tell every sender its slot is free again.
cudaError_t copy_engine::release(uint64_t k) {
    for (int p = 0; p < layout_.world; ++p)
        if (p != rank_)
            TK_TRY(signal(local_, scratch_local, static_cast<uint32_t>(k + 1), p, done,
                          static_cast<int>(k % layout_.slots)));
    return cudaSuccess;
}

// The chunk loop both ops share, over a message of `units` of `unit_bytes` each (all-gather: bytes of one rank's
// part; reduce-scatter: elements of the part each rank reduces): per chunk, push each peer its piece
// (`peer_piece(p, offset)`), hold the local stream until the peers' pieces are in, run `local_step(slot, offset,
// length)` there and free the slots. One chunk count for both ops, so neither reuses a slot the other still fills.
template <typename PeerPiece, typename LocalStep>
cudaError_t copy_engine::for_each_chunk(int64_t units, int64_t unit_bytes, cudaStream_t stream, PeerPiece peer_piece,
                                        LocalStep local_step) {
    const int64_t C = chunk_size(units * unit_bytes, layout_.slot_bytes(), unit_bytes) / unit_bytes;
    const int64_t chunks = (units + C - 1) / C;
    TK_TRY(fork(stream));
    for (int64_t i = 0; i < chunks; ++i) {
        const uint64_t k = chunks_ + i;
        const int64_t off = i * C, len = std::min(C, units - off);
        for (int p = 0; p < layout_.world; ++p)
            if (p != rank_) TK_TRY(push(k, p, peer_piece(p, off), len * unit_bytes));
        TK_TRY(await_peers(k));
        TK_TRY(local_step(static_cast<int>(k % layout_.slots), off, len));
        TK_TRY(release(k));
    }
    chunks_ += chunks;
    return join(stream);
}

cudaError_t copy_engine::all_gather(const void* in, void* out, int64_t bytes_per_rank, cudaStream_t stream) {
    if (bytes_per_rank <= 0) return bytes_per_rank == 0 ? cudaSuccess : cudaErrorInvalidValue;
    const char* src = static_cast<const char*>(in);
    char* dst = static_cast<char*>(out);
    auto piece = [&](int, int64_t off) { return src + off; };  // every peer gets this rank's part
    auto copy_out = [&](int slot, int64_t off, int64_t len) {
        copy_args a{};
        for (int r = 0; r < layout_.world; ++r) {  // the peers' staged chunks and this rank's own, each to its place
            a.src[r] = r == rank_ ? static_cast<const void*>(src + off) : region(rank_, r, slot);
            a.dst[r] = dst + r * bytes_per_rank + off;
        }
        a.n = len;
        return launch_copy(a, layout_.world, reduce_blocks_, local_);
    };
    return for_each_chunk(bytes_per_rank, 1, stream, piece, copy_out);
}

cudaError_t copy_engine::reduce_scatter(const void* in, void* out, int64_t elems_per_rank, int dtype_code,
                                        bool average, cudaStream_t stream) {
    if (elems_per_rank <= 0) return elems_per_rank == 0 ? cudaSuccess : cudaErrorInvalidValue;
    if (dtype_code < 0 || dtype_code > 2) return cudaErrorInvalidValue;
    const int64_t es = dtype_code == static_cast<int>(dtype::fp32) ? 4 : 2;
    const char* src = static_cast<const char*>(in);
    char* dst = static_cast<char*>(out);
    // Rank r's part of the input, from element `off` of it: the piece r reduces.
    auto part = [&](int r, int64_t off) { return src + (r * elems_per_rank + off) * es; };
    auto sum = [&](int slot, int64_t off, int64_t len) {
        sum_args a{};
        for (int r = 0; r < layout_.world; ++r)
            a.src[r] = r == rank_ ? static_cast<const void*>(part(r, off)) : region(rank_, r, slot);
        a.out = dst + off * es;
        a.n = len;
        a.world = layout_.world;
        a.scale = average ? 1.0f / layout_.world : 1.0f;
        return launch_sum(a, dtype_code, reduce_blocks_, local_);
    };
    return for_each_chunk(elems_per_rank, es, stream, part, sum);
}

}  // namespace tk::collectives
