"""ops.swiglu_linear (one launch for LLaMA's gated MLP products: h1 = x W1^T, h2 = x W2^T, g = silu(h1) * h2) against
float64 references, with outputs poisoned: tails in M and N, one row, several tiles a block, 3-D and strided inputs,
both schedules, both dtypes; and its errors."""

import pytest
import torch
import torch.nn.functional as F

from thunder_tk import ops

from poisoning import poison_allocator

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def rel_err(out, ref):
    return ((out.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


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
