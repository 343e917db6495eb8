"""ops.swiglu_linear (one launch for LLaMA's gated MLP products: h1 = x W1^T, h2 = x W2^T, g = silu(h1) * h2) against
float64 references, with outputs poisoned: tails in M and N, one row, several tiles a block, 3-D and strided inputs,
both schedules, both dtypes; and its errors."""

import pytest
import torch
import torch.nn.functional as F

from thunder_tk import ops

from accuracy import rel_err
from poisoning import poison_allocator

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def check(x, w1, w2, schedule=None):
    N = w1.shape[0]
    poison_allocator(((*x.shape[:-1], N), x.dtype))
    g, h1, h2 = ops.swiglu_linear(x, w1, w2, _schedule=schedule)
    for name, t in (("h1", h1), ("h2", h2), ("g", g)):
        assert t.shape == (*x.shape[:-1], N) and t.dtype == x.dtype, name
        assert torch.isfinite(t).all(), f"{name}: unwritten or non-finite outputs"
    ref1, ref2 = (x.double() @ w.double().t() for w in (w1, w2))
    assert rel_err(h1, ref1) < TOL[x.dtype]
    assert rel_err(h2, ref2) < TOL[x.dtype]
    # The gated product from the kernel's own rounded h1 and h2, as PyTorch rounds the two ops: a few ulps at most.
    gated = (F.silu(h1.double()).to(x.dtype).double() * h2.double())
    assert rel_err(g, gated) < TOL[x.dtype] / 4
    assert (g.double() - gated).abs().max() <= 2 ** -6 * gated.abs().max() + 1e-6
    # And against the whole computation in float64.
    assert rel_err(g, F.silu(ref1) * ref2) < 2 * TOL[x.dtype]
    return g, h1, h2


# (M, K, N): one row, tails in M and N (N = 8 of a 128-wide tile), K of one k-block and with a tail, the
# LLaMA-3.2-1B MLP's 2048 -> 8192 at 2048 tokens (several tiles a block on any Hopper part).
SHAPES = [(1, 64, 8), (17, 136, 200), (130, 72, 264), (256, 2048, 512), (1000, 520, 1032), (2048, 2048, 8192)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_matches_float64(M, K, N, dtype):
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w1, w2 = (torch.randn(N, K, device="cuda", dtype=dtype) / K ** 0.5 for _ in range(2))
    check(x, w1, w2)


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_three_d_and_strided_inputs_both_schedules(schedule):
    """x (B, S, K) as a column slice of a wider tensor (rows 8 elements apart more than K), weights as row slices of
    larger ones with their own row stride; the dynamic schedule leaves its counter zeroed."""
    K, N = 264, 392
    wide = torch.randn(3, 70, K + 8, device="cuda", dtype=torch.bfloat16)
    x = wide[..., :K]
    big1, big2 = (torch.randn(N + 16, K + 16, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(2))
    w1, w2 = big1[8:N + 8, :K], big2[:N, 8:K + 8]
    assert x.stride(-2) == K + 8 and w1.stride(0) == K + 16
    g, h1, h2 = check(x, w1, w2, schedule)
    again = ops.swiglu_linear(x.contiguous(), w1.contiguous(), w2.contiguous(), _schedule=schedule)
    for a, b in zip((g, h1, h2), again):
        assert torch.equal(a, b), "the strided and the contiguous operands give different results"
    if schedule == "dynamic":
        ring = ops._zeroed_rings[("tickets", torch.cuda.current_device())]
        torch.cuda.synchronize()
        assert int(ring.abs().sum()) == 0, "a launch left its counter non-zero"


def test_repeatable_and_large_values():
    """Run after run the same bits; silu at large magnitudes (exp overflowing for very negative h1) stays finite."""
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16) * 30
    w1, w2 = (torch.randn(640, 256, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    first = check(x, w1, w2)
    for _ in range(3):
        for a, b in zip(first, ops.swiglu_linear(x, w1, w2)):
            assert torch.equal(a, b)


def test_errors():
    x = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(16, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiples of 8"):
        ops.swiglu_linear(x[:, :60], w[:, :60], w[:, :60])
    with pytest.raises(ValueError, match="multiples of 8"):
        ops.swiglu_linear(x, w[:12], w[:12])
    with pytest.raises(ValueError, match="one shape"):
        ops.swiglu_linear(x, w, w[:8])
    with pytest.raises(ValueError, match="one dtype"):
        ops.swiglu_linear(x, w, w.half())
    with pytest.raises(ValueError, match="CUDA"):
        ops.swiglu_linear(x.cpu(), w.cpu(), w.cpu())
    g, h1, h2 = ops.swiglu_linear(x[:0], w, w)
    assert g.shape == h1.shape == h2.shape == (0, 16)


# ------------------------------------------------------------------------------------------------
# ops.matmul_swiglu_grad: SwiGLU's backward through its output projection, dg = a @ b never written.


def grad_reference(a, b, h1, h2):
    """dh1, dh2 in float64 from the exact dg (the kernel's dg is rounded once to the dtype, as the unfused GEMM's)."""
    dg = (a.double() @ b.double()).reshape(h1.shape)
    x, y = h1.double(), h2.double()
    s = torch.sigmoid(x)
    return dg * y * s * (1 + x * (1 - s)), dg * x * s


def check_grad(a, b, h1, h2, pingpong=0):
    poison_allocator((h1.shape, h1.dtype))
    dh1, dh2 = ops.matmul_swiglu_grad(a, b, h1, h2, _pingpong=pingpong)
    ref1, ref2 = grad_reference(a, b, h1, h2)
    for name, got, ref in (("dh1", dh1, ref1), ("dh2", dh2, ref2)):
        assert got.shape == h1.shape and got.dtype == h1.dtype, name
        assert torch.isfinite(got).all(), f"{name}: unwritten or non-finite outputs"
        assert rel_err(got, ref) < TOL[a.dtype], name
    return dh1, dh2


def grad_operands(M, K, N, dtype, *, weight_k_major=False):
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    # proj's weight (K_model = K rows of N): B (K, N) N-major as the backward trace reads it, or K-major
    w = torch.randn(K, N, device="cuda", dtype=dtype) / K ** 0.5
    b = w.t().contiguous().t() if weight_k_major else w
    h1 = torch.randn(M, N, device="cuda", dtype=dtype) * 2
    h2 = torch.randn(M, N, device="cuda", dtype=dtype)
    return a, b, h1, h2


# The consumer warpgroups taking whole tiles in turns through one staging (the default), or sharing each tile.
TILES = {"pingpong": 0, "shared": -1}


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("M,K,N", SHAPES)
def test_grad_matches_float64(M, K, N, dtype, tiles):
    check_grad(*grad_operands(M, K, N, dtype), pingpong=TILES[tiles])


@pytest.mark.parametrize("tiles", TILES)
@pytest.mark.parametrize("M,K,N", [(17, 136, 200), (1000, 520, 1032)])
def test_grad_weight_k_major(M, K, N, tiles):
    check_grad(*grad_operands(M, K, N, torch.bfloat16, weight_k_major=True), pingpong=TILES[tiles])


@pytest.mark.parametrize("M,K,N", [(130, 72, 264), (2048, 64, 4096), (4100, 2048, 1032)])
def test_grad_tile_modes_agree(M, K, N):
    """Whole tiles in turns and shared tiles issue the same products in the same order and the same epilogue math:
    the same bits, with one tile a block, several (each warpgroup several turns at the staging), and a tail in M
    and N."""
    a, b, h1, h2 = grad_operands(M, K, N, torch.bfloat16)
    whole = check_grad(a, b, h1, h2, pingpong=0)
    shared = check_grad(a, b, h1, h2, pingpong=-1)
    for x, y in zip(whole, shared):
        assert torch.equal(x, y)


def test_grad_three_d_strided_and_repeatable():
    """h1 and h2 (B, S, N) as LitGPT's MLP saves them, and as column slices of wider tensors (copied for the kernel);
    a (rows, K) as a slice with a wider row stride; run after run the same bits, and the same as contiguous inputs."""
    B, S, K, N = 3, 70, 264, 392
    wide = torch.randn(B * S, K + 8, device="cuda", dtype=torch.bfloat16)
    a = wide[:, :K]
    w = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    hw1, hw2 = (torch.randn(B, S, N + 8, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    h1, h2 = hw1[..., :N] * 3, hw2[..., 8:]
    first = check_grad(a, w, h1, h2)
    for _ in range(3):
        for x, y in zip(first, ops.matmul_swiglu_grad(a, w, h1, h2)):
            assert torch.equal(x, y)
    for x, y in zip(first, ops.matmul_swiglu_grad(a.contiguous(), w, h1.contiguous(), h2.contiguous())):
        assert torch.equal(x, y)


def off_boundary(t):
    """A contiguous copy of t whose storage starts 2 bytes past a 16-byte boundary (t.contiguous() would be itself)."""
    flat = torch.empty(t.numel() + 1, dtype=t.dtype, device=t.device)[1:]
    out = flat.view(t.shape).copy_(t)
    assert out.is_contiguous() and out.data_ptr() % 16 == 2
    return out


def test_unaligned_contiguous_inputs_are_copied():
    """Contiguous operands that start off a 16-byte boundary (TMA cannot read them in place) are copied to aligned
    storage by the wrappers: the same bits as the aligned operands, no error."""
    x = torch.randn(130, 72, device="cuda", dtype=torch.bfloat16)
    w1, w2 = (torch.randn(264, 72, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    for y, z in zip(ops.swiglu_linear(x, w1, w2), ops.swiglu_linear(off_boundary(x), off_boundary(w1), off_boundary(w2))):
        assert torch.equal(y, z)
    a, b, h1, h2 = grad_operands(130, 72, 264, torch.bfloat16)
    aligned = ops.matmul_swiglu_grad(a, b, h1, h2)
    for y, z in zip(aligned, ops.matmul_swiglu_grad(off_boundary(a), b, off_boundary(h1), off_boundary(h2))):
        assert torch.equal(y, z)


def test_grad_large_values():
    """silu' at large magnitudes (exp overflowing for very negative h1) stays finite and correct."""
    a, b, h1, h2 = grad_operands(512, 256, 640, torch.bfloat16)
    check_grad(a, b, h1 * 30, h2)


def test_grad_errors():
    a = torch.randn(4, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(64, 16, device="cuda", dtype=torch.bfloat16)
    h = torch.randn(4, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="multiple of 8"):
        ops.matmul_swiglu_grad(a, b[:, :12], h[:, :12], h[:, :12])
    with pytest.raises(ValueError, match="rows"):
        ops.matmul_swiglu_grad(a, b, h[:3], h[:3])
    with pytest.raises(ValueError, match="h2"):
        ops.matmul_swiglu_grad(a, b, h, h.half())
    with pytest.raises(ValueError, match="CUDA"):
        ops.matmul_swiglu_grad(a.cpu(), b.cpu(), h.cpu(), h.cpu())
    dh1, dh2 = ops.matmul_swiglu_grad(a[:0], b, h[:0], h[:0])
    assert dh1.shape == dh2.shape == (0, 16)
