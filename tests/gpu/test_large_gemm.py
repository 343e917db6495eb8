"""The GEMM family on tensors past 2^31 elements (byte offsets past 2^32), where an index or offset taken in 32 bits
would wrap: outputs of M x N > 2^31 through every epilogue (store warps, the consumers' TMA stores, the register path
for rows off 16 bytes, fp32 output) and schedule (static, dynamic, stream-K tail, ping-pong, clusters of two), with
bias; transposed operands and a strided output; the input- and weight-gradient layouts with an operand past 2^31
elements; a weight past 2^31 elements through the skinny kernel (and its split of K) and the persistent one; gemm_sum,
SwiGLU's forward and backward and the rotary epilogue with outputs past 2^31; and sizes past the kernels' largest
dimension refused by name before anything is allocated.

Small K keeps the products fast. The reference is float64 math over blocks of rows, each block held to test_gemm.py's
tolerances by rel_err, and each row and each column too, so that a few misplaced tiles cannot hide in a block's norm;
every output element must be written (NaN-filled or poisoned memory first). Each test skips where the GPU has too
little free memory, keeps its peak under about 30 GiB and frees what it took, even when it fails (a failing test's
traceback would otherwise hold its tensors for the tests after it).
"""

import functools
import traceback

import pytest
import torch
import torch.nn.functional as F

from accuracy import rel_err
from gpu_memory import GIB, free_cached as _free, require_free
from poisoning import poison_allocator
from thunder_tk import ops

pytestmark = [pytest.mark.gpu]

MARGIN = 4 * GIB  # the reference's blocks, float64 copies of the small operands, the allocator's rounding
BLOCK_ELEMENTS = 1 << 25  # elements of a reference block's largest float64 tensor (256 MiB)
BF16 = torch.bfloat16
# test_gemm.py's and test_gemm_fp32_out.py's tolerances (fp32 output: fp32 accumulation's error, far below a rounding
# to bf16).
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 2e-5}
TOKENS = 32768
WIDE = 70000  # TOKENS x WIDE = 2.29e9 outputs: rows from 30678 on start past 2^31 elements
FEATURES = 65600  # TOKENS x FEATURES = 2.15e9 elements: an operand (or an fp32 output) just past 2^31


def _require_free(nbytes):
    require_free(nbytes, MARGIN)


def _frees_memory(test):
    """The test, run so that its GPU memory is given back before its outcome is reported: a failure is reported as
    text once the exception, and the frames holding the test's tensors, are let go."""

    @functools.wraps(test)
    def run(*args, **kwargs):
        error = None
        try:
            test(*args, **kwargs)
        except Exception:  # reported below, as text, once the frames are gone (a skip is not an Exception)
            error = traceback.format_exc()
        _free()
        if error is not None:
            pytest.fail(error, pytrace=False)

    return run


def _randn(*shape, seed, dtype=BF16, scale=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    t = torch.randn(shape, device="cuda", dtype=dtype, generator=g)
    return t if scale is None else t.mul_(scale)


def _nan(*shape, dtype=BF16):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


def _check_rows(what, got, reference, tol, depth=1, rows_per_block=None):
    """got (M, N) against reference(lo, hi), rows [lo, hi) in float64, a block of rows at a time (BLOCK_ELEMENTS over
    the wider of N and `depth`, the reference operands' row length): no element unwritten (NaN), and each block, each
    row and each column within `tol` (relative Frobenius error)."""
    M, N = got.shape
    step = rows_per_block or max(1, BLOCK_ELEMENTS // max(N, depth))
    column_err = torch.zeros(N, dtype=torch.float64, device="cuda")
    column_ref = torch.zeros_like(column_err)
    for lo in range(0, M, step):
        hi = min(lo + step, M)
        part = got[lo:hi]
        assert not torch.isnan(part).any(), f"{what}: unwritten (NaN) elements in rows [{lo}, {hi})"
        ref = reference(lo, hi)
        err = rel_err(part, ref)
        assert err < tol, f"{what}: rows [{lo}, {hi}) off by {err:.2e}"
        sq_err = (part.double() - ref).square_()
        sq_ref = ref.square_()
        rows = (sq_err.sum(1) / sq_ref.sum(1).clamp_min(1e-300)).sqrt_()
        worst = int(rows.argmax())
        assert rows[worst] < tol, f"{what}: row {lo + worst} off by {rows[worst]:.2e}"
        column_err += sq_err.sum(0)
        column_ref += sq_ref.sum(0)
        del part, ref, sq_err, sq_ref
    columns = (column_err / column_ref.clamp_min(1e-300)).sqrt_()
    worst = int(columns.argmax())
    assert columns[worst] < tol, f"{what}: column {worst} off by {columns[worst]:.2e}"


# ------------------------------------------------------------------------------------------------
# The plain product: outputs past 2^31 elements

FORWARD_CASES = {  # name: (dtype, gemm's knobs)
    "auto": (BF16, {}),  # store warps: a block takes hundreds of 256-wide tiles
    "fp16": (torch.float16, {}),
    "consumer_stores": (BF16, dict(_epilogue=2)),
    "register_stores": (BF16, dict(_epilogue=3)),
    "narrow_tiles": (BF16, dict(_tile_n=128)),
    "dynamic": (BF16, dict(_schedule="dynamic")),
    "stream_k": (BF16, dict(_stream_k=1, _schedule="static")),
    "pingpong": (BF16, dict(_pingpong=1)),
    "cluster": (BF16, dict(_cluster=2)),
}


@pytest.mark.parametrize("case", FORWARD_CASES)
@_frees_memory
def test_forward_output_past_2_31_with_bias(case):
    """Y = X W^T + bias in the linear's layout (both operands K-major) with a 32768 x 70000 output (2.29e9 elements),
    through every tile path and schedule; K = 328 ends on a part-filled k-block and has the stream-K tail cut tiles,
    whose finishers are the last tiles of the order, past 2^31. About 4.3 GiB, a few seconds."""
    dtype, knobs = FORWARD_CASES[case]
    M, N, K = TOKENS, WIDE, 328
    _require_free(M * N * 2)
    x, w = _randn(M, K, seed=0, dtype=dtype), _randn(N, K, seed=1, dtype=dtype, scale=K ** -0.5)
    bias = _randn(N, seed=2, dtype=dtype)
    out = _nan(M, N, dtype=dtype)
    assert ops.gemm(x, w.t(), bias, out=out, **knobs) is out
    w64, bias64 = w.double().t(), bias.double()
    _check_rows("Y", out, lambda lo, hi: x[lo:hi].double() @ w64 + bias64, TOL[dtype], depth=K)


@_frees_memory
def test_forward_through_transposed_operands_into_a_strided_output():
    """The same size with X read M-major (a transposed view of a (K, M) tensor), W^T N-major ((K, N) rows) and C a
    column slice of a wider NaN buffer (row stride N + 64: its last rows lie 2.29e9 elements in); the columns beside C
    stay NaN. About 4.3 GiB."""
    M, N, K = TOKENS, WIDE, 128
    _require_free(M * (N + 64) * 2)
    x = _randn(K, M, seed=3).t()
    b = _randn(K, N, seed=4, scale=K ** -0.5)
    bias = _randn(N, seed=5)
    wide = _nan(M, N + 64)
    out = wide[:, 32:32 + N]
    ops.gemm(x, b, bias, out=out)
    b64, bias64 = b.double(), bias.double()
    _check_rows("Y", out, lambda lo, hi: x[lo:hi].double() @ b64 + bias64, TOL[BF16], depth=K)
    assert torch.isnan(wide[:, :32]).all() and torch.isnan(wide[:, 32 + N:]).all(), "written beside C"


REGISTER_CASES = {  # name: (N, C's layout, C's dtype)
    "odd_columns": (WIDE + 1, "contiguous", BF16),  # pairs of columns split across rows
    "unaligned_view": (WIDE, "2_bytes_off", BF16),  # C 2 bytes off 16: no TMA stores, no paired stores
    "fp32_odd_columns": (FEATURES + 1, "contiguous", torch.float32),
}


@pytest.mark.parametrize("case", REGISTER_CASES)
@_frees_memory
def test_register_epilogue_output_past_2_31(case):
    """C rows off 16 bytes take the consumers' stores from registers (TMA would overwrite past a row): odd N, C a view
    2 bytes off 16 (the columns beside it stay NaN), and fp32 C with odd N (8.6 GB: byte offsets past 2^33), each
    with bias and its row offsets past 2^31 elements. At most 8 GiB."""
    N, layout, dtype = REGISTER_CASES[case]
    M, K = TOKENS, 64
    size = torch.finfo(dtype).bits // 8
    _require_free(M * (N + 8) * size)
    x, w = _randn(M, K, seed=6), _randn(N, K, seed=7, scale=K ** -0.5)
    bias = _randn(N, seed=8)
    if layout == "2_bytes_off":
        wide = _nan(M, N + 8, dtype=dtype)
        out = wide[:, 1:1 + N]
    else:
        wide = out = _nan(M, N, dtype=dtype)
    ops.gemm(x, w.t(), bias, out=out, out_dtype=dtype)
    w64, bias64 = w.double().t(), bias.double()
    _check_rows("Y", out, lambda lo, hi: x[lo:hi].double() @ w64 + bias64, TOL[dtype], depth=K)
    if layout == "2_bytes_off":
        assert torch.isnan(wide[:, 0]).all() and torch.isnan(wide[:, 1 + N:]).all(), "written beside C"


FP32_CASES = {"auto": {}, "narrow_tiles": dict(_tile_n=128), "stream_k": dict(_stream_k=1, _schedule="static")}


@pytest.mark.parametrize("case", FP32_CASES)
@_frees_memory
def test_fp32_output_past_2_31(case):
    """fp32 C of 32768 x 65600 (2.15e9 floats, 8.6 GB) by TMA stores of 64 x 32 boxes, with bias: element offsets past
    2^31 and byte offsets past 2^33. About 8 GiB."""
    M, N, K = TOKENS, FEATURES, 128
    _require_free(M * N * 4)
    x, w = _randn(M, K, seed=9), _randn(N, K, seed=10, scale=K ** -0.5)
    bias = _randn(N, seed=11)
    out = _nan(M, N, dtype=torch.float32)
    ops.gemm(x, w.t(), bias, out=out, out_dtype=torch.float32, **FP32_CASES[case])
    w64, bias64 = w.double().t(), bias.double()
    _check_rows("Y", out, lambda lo, hi: x[lo:hi].double() @ w64 + bias64, TOL[torch.float32], depth=K)


# ------------------------------------------------------------------------------------------------
# Operands past 2^31 elements

# fp32 sums over 32768 products drift further than test_gemm_fp32_out.py's depths of at most 4096; still 20 times
# below a rounding to bf16.
DEEP_FP32_TOL = 1e-4


@pytest.mark.parametrize("grad", ["input", "weight", "weight_fp32"])
@_frees_memory
def test_gradient_layouts_with_an_operand_past_2_31(grad):
    """A linear's backward with dY of 32768 tokens x 65600 features (2.15e9 elements) as the operand past 2^31:
    dX = dY W (A K-major over K = 65600, B N-major), dW = dY^T X (A M-major, dY's transposed view; B N-major), and dW
    in fp32 (bf16-mixed training's weight gradients). About 4 GiB."""
    T, F_out, F_in = TOKENS, FEATURES, 256
    _require_free(T * F_out * 2)
    dy = _randn(T, F_out, seed=12)
    if grad == "input":
        w = _randn(F_out, F_in, seed=13, scale=F_out ** -0.5)
        out = _nan(T, F_in)
        ops.gemm(dy, w, out=out)
        w64 = w.double()
        _check_rows("dX", out, lambda lo, hi: dy[lo:hi].double() @ w64, TOL[BF16], depth=F_out)
    else:
        dtype = torch.float32 if grad == "weight_fp32" else BF16
        x = _randn(T, F_in, seed=14, scale=T ** -0.5)
        out = _nan(F_out, F_in, dtype=dtype)
        ops.gemm(dy.t(), x, out=out, out_dtype=dtype)
        x64 = x.double()
        tol = DEEP_FP32_TOL if dtype == torch.float32 else TOL[dtype]
        _check_rows("dW", out, lambda lo, hi: dy[:, lo:hi].t().double() @ x64, tol, depth=T)


WEIGHT_ROWS = (1 << 31) // 4096 + 1000  # 525288 rows of 4096: 2.15e9 elements


@pytest.mark.parametrize("weight_layout", ["rows", "columns"])
@pytest.mark.parametrize("M", [16, 64, 200])
@_frees_memory
def test_weight_past_2_31(M, weight_layout):
    """A 525288 x 4096 weight (2.15e9 elements) against few tokens, with bias: the skinny kernel (M <= 64, forced) with
    the weight read K-major ((N, K) rows, the linear's) or N-major ((K, N) rows), and 200 tokens on the persistent
    kernel. Checked by weight rows (C's columns), so that the reference's blocks stay small. About 4 GiB."""
    N, K = WEIGHT_ROWS, 4096
    _require_free(N * K * 2)
    x = _randn(M, K, seed=15)
    if weight_layout == "rows":
        b = _randn(N, K, seed=16, scale=K ** -0.5).t()
    else:
        b = _randn(K, N, seed=16, scale=K ** -0.5)
    bias = _randn(N, seed=17)
    out = _nan(M, N)
    ops.gemm(x, b, bias, out=out, _skinny=1 if M <= ops.SKINNY_MAX_M else -1)
    x64t, bias64 = x.double().t(), bias.double()
    _check_rows("Y^T", out.t(), lambda lo, hi: b[:, lo:hi].t().double() @ x64t + bias64[lo:hi, None], TOL[BF16],
                depth=K)


@_frees_memory
def test_skinny_split_k_with_a_weight_past_2_31():
    """16 tokens against an 8192 x 262152 weight (2.15e9 elements): 128 column tiles leave the skinny kernel room to
    split K over the SMs, so blocks hand fp32 partial sums of 262152-deep ranges through the workspace. About 4 GiB."""
    M, N, K = 16, 8192, 262152
    _require_free(N * K * 2)
    x = _randn(M, K, seed=18)
    w = _randn(N, K, seed=19, scale=K ** -0.5)
    out = _nan(M, N)
    ops.gemm(x, w.t(), out=out, _skinny=1)
    x64t = x.double().t()
    _check_rows("Y^T", out.t(), lambda lo, hi: w[lo:hi].double() @ x64t, TOL[BF16], depth=K)


# ------------------------------------------------------------------------------------------------
# The fused launches

@pytest.mark.parametrize("case", ["output", "operands"])
@_frees_memory
def test_gemm_sum_past_2_31(case):
    """C = A B + A2 B2 in one launch: a 32768 x 70000 output (K = 128 and a ragged K2 = 72, with bias), and LLaMA's
    MLP input gradient dh1 W1 + dh2 W2 with dh1 and dh2 of 32768 x 65600 (2.15e9 elements each). At most 8 GiB."""
    if case == "output":
        M, N, K, K2 = TOKENS, WIDE, 128, 72
        need = M * N * 2
    else:
        M, N, K, K2 = TOKENS, 256, FEATURES, FEATURES
        need = 2 * M * K * 2
    _require_free(need)
    a, a2 = _randn(M, K, seed=20), _randn(M, K2, seed=21)
    b, b2 = _randn(K, N, seed=22, scale=K ** -0.5), _randn(K2, N, seed=23, scale=K2 ** -0.5)
    bias = _randn(N, seed=24) if case == "output" else None
    out = _nan(M, N)
    ops.gemm_sum(a, b, a2, b2, bias, out=out)
    b64, b2_64 = b.double(), b2.double()
    bias64 = None if bias is None else bias.double()

    def reference(lo, hi):
        r = a[lo:hi].double() @ b64 + a2[lo:hi].double() @ b2_64
        return r if bias64 is None else r + bias64

    _check_rows("C", out, reference, TOL[BF16], depth=max(K, K2))


@_frees_memory
def test_swiglu_outputs_past_2_31():
    """SwiGLU's one launch writing h1, h2 and g of 32768 x 65600 (2.15e9 elements each) into poisoned memory; g
    against silu(h1) * h2 from the kernel's own h1 and h2, rounded as PyTorch rounds it (test_swiglu.py). About
    24 GiB at the poisoning's peak (two blocks of each output)."""
    M, N, K = TOKENS, FEATURES, 64
    _require_free(6 * M * N * 2)
    x = _randn(M, K, seed=25)
    w1, w2 = _randn(N, K, seed=26, scale=K ** -0.5), _randn(N, K, seed=27, scale=K ** -0.5)
    poison_allocator(*[((M, N), BF16)] * 3)
    g, h1, h2 = ops.swiglu_linear(x, w1, w2)
    w1_64, w2_64 = w1.double().t(), w2.double().t()
    _check_rows("h1", h1, lambda lo, hi: x[lo:hi].double() @ w1_64, TOL[BF16], depth=K)
    _check_rows("h2", h2, lambda lo, hi: x[lo:hi].double() @ w2_64, TOL[BF16], depth=K)
    _check_rows("g", g, lambda lo, hi: F.silu(h1[lo:hi].double()).to(BF16).double() * h2[lo:hi].double(), TOL[BF16])


@pytest.mark.parametrize("tiles", {"pingpong": 0, "shared": -1})
@_frees_memory
def test_swiglu_backward_past_2_31(tiles):
    """SwiGLU's backward launch reading h1 and h2 and writing dh1 and dh2 of 32768 x 65600 (2.15e9 elements each) by
    TMA into poisoned memory, its consumers taking whole tiles in turns or sharing each; against float64 from the
    exact dg (test_swiglu.py's reference). About 24 GiB at the poisoning's peak."""
    M, N, K = TOKENS, FEATURES, 64
    _require_free(6 * M * N * 2)
    a = _randn(M, K, seed=28)
    b = _randn(K, N, seed=29, scale=K ** -0.5)
    h1, h2 = _randn(M, N, seed=30, scale=2.0), _randn(M, N, seed=31)
    poison_allocator(((M, N), BF16), ((M, N), BF16))
    dh1, dh2 = ops.matmul_swiglu_grad(a, b, h1, h2, _pingpong={"pingpong": 0, "shared": -1}[tiles])
    b64 = b.double()

    def reference(second):
        def rows(lo, hi):
            dg = a[lo:hi].double() @ b64
            x, y = h1[lo:hi].double(), h2[lo:hi].double()
            s = torch.sigmoid(x)
            return dg * x * s if second else dg * y * s * (1 + x * (1 - s))
        return rows

    _check_rows("dh1", dh1, reference(False), TOL[BF16], depth=K)
    _check_rows("dh2", dh2, reference(True), TOL[BF16], depth=K)


@_frees_memory
def test_rotary_epilogue_output_past_2_31():
    """The fused qkv projection with the rotary epilogue writing 96 sequences of 4096 tokens x (32 + 2 x 8) heads of
    128 (2.42e9 elements) into poisoned memory, every head's 128 columns turned; checked a sequence at a time against
    ops.linear_rope_reference laid back into the projection's columns. About 9 GiB at the poisoning's peak."""
    B, S, K, Hq, Hkv, D = 96, 4096, 64, 32, 8, 128
    N = (Hq + 2 * Hkv) * D
    _require_free(2 * B * S * N * 2)
    x = _randn(B, S, K, seed=32)
    w = _randn(N, K, seed=33, scale=K ** -0.5)
    cos, sin = ops.rope_tables(S, D, BF16, "cuda")
    poison_allocator(((B, S, N), BF16))
    q, k, v = ops.linear_rope(x, w, cos, sin, Hq, Hkv, D)
    qkv = q.as_strided((B * S, N), (N, 1), 0)  # the one output q, k and v are views of

    def reference(lo, hi):
        parts = ops.linear_rope_reference(x[lo // S:hi // S], w, cos, sin, Hq, Hkv, D)
        return torch.cat([t.transpose(1, 2).flatten(2) for t in parts], dim=-1).flatten(0, 1)

    _check_rows("qkv", qkv, reference, TOL[BF16], rows_per_block=S)


# ------------------------------------------------------------------------------------------------
# Past the kernels' largest dimension: refused by name, nothing allocated or launched

def test_a_dimension_past_the_kernels_largest_is_refused_by_name():
    """M, N or K of 2^30 (stride-0 views: no memory behind them), and K + K2 of 2^30 for gemm_sum, are refused by ops
    before any output is allocated (16 GiB and more here), and by the binding before any launch."""
    big = 1 << 30
    row = torch.zeros(1, 64, device="cuda", dtype=BF16)
    w = torch.zeros(64, 8, device="cuda", dtype=BF16)
    column = torch.zeros(8, 1, device="cuda", dtype=BF16)
    head = torch.zeros(3 * 64, 64, device="cuda", dtype=BF16)  # one head of 64 each for q, k and v
    cos = torch.zeros(1 << 16, 64, device="cuda", dtype=BF16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    past = r"=1073741824 past the GEMM kernels' largest dimension"
    with pytest.raises(ValueError, match="gemm: M" + past):
        ops.gemm(row.expand(big, 64), w)
    with pytest.raises(ValueError, match="gemm: N" + past):
        ops.gemm(row, w[:, :1].expand(64, big))
    with pytest.raises(ValueError, match="gemm: K" + past):
        ops.gemm(column.expand(8, big), row[:, :8].expand(big, 8))
    half = column.expand(8, big // 2)
    with pytest.raises(ValueError, match=r"gemm_sum: K \+ K2" + past):
        ops.gemm_sum(half, row[:, :8].expand(big // 2, 8), half, row[:, :8].expand(big // 2, 8))
    with pytest.raises(ValueError, match="swiglu_linear: M" + past):
        ops.swiglu_linear(row.expand(big, 64), w.t(), w.t())
    with pytest.raises(ValueError, match="linear_rope: M" + past):
        ops.linear_rope(row[None].expand(1 << 14, 1 << 16, 64), head, cos, cos, 1, 1, 64)
    assert torch.cuda.memory_allocated() == before, "allocated before refusing"
    ext = ops._require_kernels(row.device)
    with pytest.raises(ValueError, match=r"thunder_tk gemm: a dimension exceeds 2\^30"):
        ext.gemm(a=row.data_ptr(), b=w.data_ptr(), c=w.data_ptr(), bias=0, dtype=0, M=big, N=8, K=64, a_stride_m=0,
                 a_stride_k=1, b_stride_k=8, b_stride_n=1, c_stride_m=8,
                 stream=torch.cuda.current_stream().cuda_stream)
