"""Sizes past 2^31 elements, on a machine without a GPU: the host paths' choices and errors for them, one section
per kernel family."""

import pytest

from thunder_tk import ops

# ------------------------------------------------------------------------------------------------
# Attention

# the recording fixture, and the kernel's limit on a block's share of zeroing the next dQ accumulator
from test_ops_cpu import ZERO_SHARE_MAX, _backward_inputs, recorded_attention  # noqa: E402,F401


@pytest.mark.parametrize("floats,blocks,fits", [
    (4 * ZERO_SHARE_MAX, 1, True),
    (4 * ZERO_SHARE_MAX + 4, 1, False),  # one float4 over a block's share
    (4 * ZERO_SHARE_MAX * 3, 3, True),
    (4 * ZERO_SHARE_MAX * 3 + 4, 3, False),  # shares rounded up
    (4096 * 32 * 128 * 128, 4096 * 32, True),  # 2^31 floats over a block per head: 4096 float4s each
    (2**33, 1, False),  # 32 GiB of dQ on one block: 2^26 queries of one head (D = 128) against 128 keys
])
def test_attention_zero_ahead_share_fits_32_bits(floats, blocks, fits):
    """The backward kernel zeroes the next dQ accumulator in per-block shares of 32-bit offsets; ops asks for that only
    where every share fits (the binding refuses the rest)."""
    assert ops.zero_ahead_fits(floats, blocks, ZERO_SHARE_MAX) is fits


def test_attention_zero_share_limit_comes_from_the_kernel():
    """ops takes the limit from the compiled module, which states the kernel's own (backward_max_zero_share): INT32_MAX
    float4s less a zeroing step."""
    from thunder_tk import _extension

    ext = _extension.extension()
    if ext is None:
        pytest.skip(f"the compiled module is not loaded here: {_extension.unavailable_reason()}")
    assert ext.attention_backward_max_zero_share() == ZERO_SHARE_MAX


def test_attention_backward_zeroes_in_the_delta_pass_past_the_kernels_share(recorded_attention, monkeypatch):
    """Where a block's share of the next accumulator would not fit (a lowered limit stands in for a 32 GiB
    accumulator over a few blocks), ops.attention_backward zeroes the call's own accumulator in the delta pass and
    hands the kernel no zero_next, instead of a launch the binding refuses; the stream's turns are left as they were."""
    calls = recorded_attention.calls
    B, Hq, Hkv, S, D = 1, 2, 2, 64, 64  # two blocks of 1024 float4s each
    for limit, ahead in ((1024, True), (1023, False)):
        recorded_attention.max_zero_share = limit
        monkeypatch.setattr(ops, "_dq_accumulators", {})
        calls.clear()
        ops.attention_backward(*_backward_inputs(B, Hq, Hkv, S, D))
        (_, delta), (_, backward), _ = calls
        assert delta["zero"] == backward["dq_accum"]  # the first call: zeroed in the delta pass either way
        if ahead:
            assert backward["zero_next"] != 0 and backward["zero_next_count"] == B * Hq * S * D
        else:
            assert (backward["zero_next"], backward["zero_next_count"]) == (0, 0)
            assert ops._dq_accumulators == {}


# ------------------------------------------------------------------------------------------------
# GEMM: the kernels take M, N and K (and gemm_sum's K + K2) up to 2^30 - 1, as they number tiles and TMA coordinates in
# 32-bit ints (their element offsets are 64-bit: tests/gpu/test_large_gemm.py runs them past 2^31 elements). Past
# that, ops refuses by name before allocating an output, and the binding before launching.

import thunder  # noqa: E402
import torch  # noqa: E402
from thunder.core.devices import Device  # noqa: E402
from thunder.core.proxies import TensorProxy  # noqa: E402
from thunder.core.trace import detached_trace  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from thunder_tk import _extension  # noqa: E402
from thunder_tk.claim_rules import RULES_BY_ID  # noqa: E402
import thunder.torch as ltorch  # noqa: E402

GEMM_PAST = 1 << 30  # the least M, N or K the GEMM kernels refuse (gemm.cu: INT32_MAX / 2 at most)
GEMM_PAST_MESSAGE = r"=1073741824 past the GEMM kernels' largest dimension"


def _fake_cuda(*shape):
    """A bf16 CUDA tensor of `shape` with nothing behind it (metadata only: no GPU, no memory)."""
    with FakeTensorMode():
        return torch.empty(shape, device="cuda", dtype=torch.bfloat16)


def test_gemm_largest_dimension_is_the_kernels():
    assert ops.GEMM_MAX_DIM == GEMM_PAST - 1 == (2**31 - 1) // 2


@pytest.mark.parametrize("name,a_shape,b_shape", [
    ("M", (GEMM_PAST, 64), (64, 8)),
    ("N", (8, 64), (64, GEMM_PAST)),
    ("K", (8, GEMM_PAST), (GEMM_PAST, 8)),
])
def test_gemm_refuses_a_dimension_past_the_kernels_largest(name, a_shape, b_shape):
    """ops.gemm's checks (metadata only, before the output is allocated) name the size; 8 less passes them."""
    with pytest.raises(ValueError, match=f"gemm: {name}{GEMM_PAST_MESSAGE}"):
        ops.check_gemm_args(_fake_cuda(*a_shape), _fake_cuda(*b_shape), None)
    less = [tuple(s - 8 if s == GEMM_PAST else s for s in shape) for shape in (a_shape, b_shape)]
    ops.check_gemm_args(_fake_cuda(*less[0]), _fake_cuda(*less[1]), None)


def test_gemm_sum_refuses_two_depths_past_the_kernels_largest():
    """Both products' k-blocks go through one schedule: K + K2 is bounded as K is."""
    a, b = _fake_cuda(8, GEMM_PAST // 2), _fake_cuda(GEMM_PAST // 2, 8)
    with pytest.raises(ValueError, match=r"gemm_sum: K \+ K2" + GEMM_PAST_MESSAGE):
        ops.check_gemm_sum_args(a, b, a, b)
    ops.check_gemm_sum_args(a, b, _fake_cuda(8, GEMM_PAST // 2 - 8), _fake_cuda(GEMM_PAST // 2 - 8, 8))


def test_swiglu_and_linear_rope_refuse_rows_past_the_kernels_largest():
    """SwiGLU's check, and the rotary epilogue's (which the qkv fusion asks before folding), name M = B x S."""
    w = _fake_cuda(8, 64)
    with pytest.raises(ValueError, match="swiglu_linear: M" + GEMM_PAST_MESSAGE):
        ops.check_swiglu_args(_fake_cuda(1 << 14, 1 << 16, 64), w, w)
    ops.check_swiglu_args(_fake_cuda(1 << 14, (1 << 16) - 1, 64), w, w)
    weight, cos = _fake_cuda(3 * 64, 64), _fake_cuda(1 << 16, 64)  # one head of 64 each for q, k and v
    reason = ops.linear_rope_unsupported(_fake_cuda(1 << 14, 1 << 16, 64), weight, cos, cos, 1, 1, 64)
    assert reason is not None and reason.startswith("M" + GEMM_PAST_MESSAGE), reason
    assert ops.linear_rope_unsupported(_fake_cuda(1 << 14, (1 << 16) - 1, 64), weight, cos, cos, 1, 1, 64) is None


@pytest.mark.parametrize("x_shape,w_shape", [((GEMM_PAST, 512), (1024, 512)), ((4, 512), (GEMM_PAST, 512))],
                         ids=["rows", "features"])
def test_linear_claim_declines_a_dimension_past_the_gemm_kernels_largest(x_shape, w_shape):
    with detached_trace(), _extension.planning_for():
        x, w = (TensorProxy(shape=s, dtype=thunder.bfloat16, device=Device("cuda:0")) for s in (x_shape, w_shape))
        verdict = RULES_BY_ID[ltorch.linear.id].judge(x, w)
    assert not verdict and "2^30" in verdict.reason, verdict


def _binding_gemm(ext, M, N, K, **knobs):
    """ext.gemm on made-up 16-byte aligned addresses (A K-major, B N-major, C contiguous); only its checks run."""
    return ext.gemm(a=1 << 12, b=2 << 12, c=3 << 12, bias=0, dtype=0, M=M, N=N, K=K, a_stride_m=K, a_stride_k=1,
                    b_stride_k=N, b_stride_n=1, c_stride_m=N, stream=0, **knobs)


@pytest.mark.parametrize("M,N,K,reason", [
    (GEMM_PAST, 8, 64, r"a dimension exceeds 2\^30"),
    (8, 8, GEMM_PAST, r"a dimension exceeds 2\^30"),
    (GEMM_PAST - 128, GEMM_PAST - 128, 64, r"the output has 2\^30 tiles or more"),  # 2^46 tiles: only a C of
    (1 << 29, 256 * 128, 8, r"the output has 2\^30 tiles or more"),  # overlapping rows fits in memory
])
def test_gemm_binding_refuses_sizes_its_32_bit_schedule_cannot_number(extension_without_gpu, M, N, K, reason):
    with pytest.raises(ValueError, match=reason):
        _binding_gemm(extension_without_gpu, M, N, K)


@pytest.mark.parametrize("M,N,K,knobs", [
    (65536, 128256, 8192, {}),  # lm_head logits of 64k tokens: 8.4e9 outputs, 256k tiles
    (GEMM_PAST - 1, 8, 64, {}),  # the largest M
    (1 << 29, 255 * 128, 8, {}),  # 2^30 - 2^22 tiles of 128 x 128: under the schedule's bound
    (16, (1 << 31) // 4096 + 1000, 4096, dict(skinny=1)),  # a 2.15e9-element weight on the skinny kernel
    (GEMM_PAST - 1, 8, 64, dict(c_fp32=True)),
])
def test_gemm_binding_takes_sizes_past_2_31_elements(extension_without_gpu, M, N, K, knobs):
    """Sizes the kernels take pass every check and fail only at the launch, for want of a device."""
    with pytest.raises(RuntimeError, match="launching gemm failed"):
        _binding_gemm(extension_without_gpu, M, N, K, **knobs)


# ------------------------------------------------------------------------------------------------
# Cross-entropy, the embedding's weight gradient, RMSNorm, AdamW and sq_norm: their kernels index in 64 bits
# (tests/gpu/test_large_misc.py runs them past 2^31 elements); the only size they refuse is the cross-entropy's
# rows (a block a row, or a row's parts, in a grid of at most 2^31 - 1 blocks), which the binding names.

import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

# The AdamW and sq_norm kernels' chunk table walked on the host (csrc/kittens/multi_tensor.cuh is plain C++ but for
# its qualifiers), for tensors past 2^31 and 2^32 elements and lists past 2^33: every chunk of every tensor taken
# exactly once, whole but for each tensor's last, at 64-bit starts.
_CHUNK_WALK = r"""
#define __host__
#define __device__
#define __forceinline__ inline
#include "kittens/multi_tensor.cuh"

#include <cstdio>
#include <vector>

static int failures = 0;

template <int CHUNK>
static void walk(const std::vector<int64_t>& numels, int grid) {
    static tk::chunk_index<256> index;
    index.clear();
    int64_t expected = 0;
    std::vector<std::vector<bool>> seen;
    for (int64_t n : numels) {
        index.add(n, CHUNK, true);
        expected += (n + CHUNK - 1) / CHUNK;
        seen.emplace_back(static_cast<size_t>((n + CHUNK - 1) / CHUNK), false);
    }
    if (index.chunks() != expected)
        ++failures, std::printf("FAIL: %lld chunks, not %lld\n", (long long)index.chunks(), (long long)expected);
    for (int block = 0; block < grid; ++block) {
        int t = 0;
        for (int64_t c = block; c < index.chunks(); c += grid) {
            const auto at = index.template locate<CHUNK>(c, t);
            const int64_t n = numels[t], k = at.start / CHUNK;
            const bool whole = at.start + CHUNK <= n;
            if (at.start < 0 || at.start % CHUNK || at.start >= n || at.n != (whole ? CHUNK : n - at.start) ||
                seen[t][k]) {
                if (failures++ < 10)
                    std::printf("FAIL: chunk %lld: tensor %d [%lld, +%d) of %lld\n", (long long)c, t,
                                (long long)at.start, at.n, (long long)n);
                continue;
            }
            seen[t][k] = true;
        }
    }
    for (size_t t = 0; t < seen.size(); ++t)
        for (size_t k = 0; k < seen[t].size(); ++k)
            if (!seen[t][k]) {
                if (failures++ < 10) std::printf("FAIL: tensor %zu chunk %zu never taken (grid %d)\n", t, k, grid);
                break;
            }
}

int main() {
    const std::vector<int64_t> numels = {4097, (1ll << 31) + (1 << 20) + 7, 9, (1ll << 31) + 5, (1ll << 32) + 3, 1};
    for (int grid : {1, 1056, 2048}) {
        walk<1024>(numels, grid);  // AdamW, fp32
        walk<2048>(numels, grid);  // AdamW, 16-bit
        walk<4096>(numels, grid);  // sq_norm, fp32
        walk<8192>(numels, grid);  // sq_norm, 16-bit
    }
    std::printf("12 walks, %d failures\n", failures);
    return failures == 0 ? 0 : 1;
}
"""


def test_multi_tensor_chunks_past_2_31_and_2_32_elements(tmp_path):
    """The chunk table of AdamW and sq_norm over tensors of 2^31 + 2^20 + 7, 2^31 + 5 and 2^32 + 3 elements among
    small ones (8.6e9 together): a persistent grid of 1, 1056 or 2048 blocks takes every chunk of every tensor once,
    at the right 64-bit start, for each kernel's chunk size."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    source, exe = tmp_path / "chunk_walk.cpp", tmp_path / "chunk_walk"
    source.write_text(_CHUNK_WALK)
    csrc = Path(__file__).resolve().parents[1] / "csrc"
    subprocess.run([compiler, "-std=c++17", "-O2", f"-I{csrc}", str(source), "-o", str(exe)], check=True)
    done = subprocess.run([str(exe)], capture_output=True, text=True)
    assert done.returncode == 0 and " 0 failures" in done.stdout, done.stdout + done.stderr


_ADDRESS = 1 << 20  # made up, 16-byte aligned: the argument checks run on it, and no launch reads it
_BF16, _FP32 = 0, 2


def _cross_entropy_call(ext, kernel, rows, classes):
    """One cross-entropy binding call on made-up addresses for bf16 logits (rows, classes), contiguous."""
    a = _ADDRESS
    if kernel == "cross_entropy_forward":
        return ext.cross_entropy_forward(a, a, a, a, _BF16, rows, classes, classes, -100, 0)
    if kernel == "cross_entropy_backward":
        return ext.cross_entropy_backward(a, a, a, a, 1, 2 * a, classes, _BF16, rows, classes, classes, -100, 0)
    return ext.cross_entropy_forward_grad(a, a, a, a, 2 * a, classes, _BF16, rows, classes, classes, -100, 0)


@pytest.mark.parametrize("kernel,rows,classes,reason", [
    ("cross_entropy_forward", 2**31, 2, "more than 2^31 - 1 rows"),
    ("cross_entropy_backward", 2**31, 2, "more than 2^31 - 1 rows"),
    ("cross_entropy_forward_grad", 2**31, 8, "more than 2^31 - 1 rows"),
    # 32776 bf16 classes take two 64 KB parts a row: 2^31 blocks
    ("cross_entropy_forward_grad", 2**30, 32776, "more than 2^31 - 1 blocks (rows times parts of a row)"),
])
def test_cross_entropy_binding_names_a_grid_past_2_31_blocks(extension_without_gpu, kernel, rows, classes, reason):
    """Rows (or rows times a row's parts) past the grid's 2^31 - 1 blocks: a ValueError naming the kernel and the
    limit, before anything is launched."""
    with pytest.raises(ValueError, match=re.escape(f"thunder_tk {kernel}: {reason}")):
        _cross_entropy_call(extension_without_gpu, kernel, rows, classes)


def _large_call(ext, kernel):
    """A call of `kernel`'s binding whose tensors pass 2^31 elements (made-up addresses)."""
    a = _ADDRESS
    if kernel.startswith("cross_entropy"):
        return _cross_entropy_call(ext, kernel, 2**31 - 1 if kernel == "cross_entropy_forward" else 16800, 128256)
    if kernel == "embedding_backward":  # 131072 tokens x 16800 into 128256 x 16800
        return ext.embedding_backward(a, 16800, a, a, a, 131072, 128256, 16800, -1, _BF16, 0)
    if kernel == "rms_norm_forward":  # 262208 x 8192, with a residual
        return ext.rms_norm_forward(a, 8192, a, 8192, a, 8192, a, a, 8192, a, 1, 262208, 8192, 1e-5, _BF16, _FP32, 0)
    if kernel == "rms_norm_backward":
        return ext.rms_norm_backward(a, 8192, a, 8192, a, 1, a, a, 8192, a, 8192, a, a, 4096, 262208, 8192, _BF16,
                                     _FP32, 0)
    numels = [4097, 2**31 + 2**20 + 7, 2**32 + 3]
    if kernel == "adamw":
        addresses = [a] * len(numels)
        return ext.adamw(addresses, addresses, addresses, addresses, numels, _BF16, 1e-2, 0.9, 0.999, 1e-8, 0.1, 1.0,
                         False, 0, 0.0, 0)
    size = ext.sq_norm_workspace(len(numels))
    return ext.sq_norm([a] * len(numels), numels, _BF16, a, size, a, False, 0)


@pytest.mark.parametrize("kernel", ["cross_entropy_forward", "cross_entropy_backward", "cross_entropy_forward_grad",
                                    "embedding_backward", "rms_norm_forward", "rms_norm_backward", "adamw",
                                    "sq_norm"])
def test_misc_bindings_take_tensors_past_2_31_elements(extension_without_gpu, kernel):
    """Tensors past 2^31 elements (and parameters past 2^32) pass every argument check and fail only at the launch,
    for want of a device: nothing declines them."""
    with pytest.raises(RuntimeError, match=f"launching {kernel} failed"):
        _large_call(extension_without_gpu, kernel)
