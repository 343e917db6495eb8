"""RMSNorm (ops.rms_norm / ops.rms_norm_backward) against the float64 references (ops.rms_norm_reference,
ops.rms_norm_backward_reference): the forward without and with a residual add, the backward without and with the
residual stream's gradient; rows of 8 to 16384 elements (each width of 16-byte vectors a thread: 1, 2, 4 and 8, and
the first size past each step), 1 to 8192 rows (several rows a group of the persistent grid, so the next-row
prefetch and the alternating reduction slots run), bf16 and fp16 activations with bf16, fp16 or fp32 weights; 3-D
inputs, views read in place (wide rows) and views copied (row strides off whole vectors, rows off 16 bytes, a
transposed batch), weight and rstd views; no rows; every output written (the caching allocator is filled with NaN
first), repeats bit for bit (the weight gradient's block partial sums are added in a fixed order), LitGPT's RMSNorm
arithmetic in torch fp32 (forward to within an ulp, backward by torch.autograd), and argument errors named."""

import pytest
import torch

from accuracy import rel_err
from poisoning import poison_allocator
from thunder_tk import ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hasattr(ops, "rms_norm"), reason="no ops.rms_norm")]
DEVICE = "cuda"
EPS = 1e-5  # Llama 3's norm_eps

DTYPES = [torch.bfloat16, torch.float16]
DTYPE_IDS = ["bf16", "fp16"]
WEIGHT_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
WEIGHT_IDS = ["w_bf16", "w_fp16", "w_fp32"]
# ||out - ref|| / ||ref||, by the output's dtype (y and dx: the activations'; dw: the weight's). Each output is
# rounded once from fp32; an fp32 dw differs by its fp32 sums alone.
TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-4}
RSTD_TOL = 1e-5  # fp32 rstd against float64: an fp32 sum of squares and rsqrtf
# LitGPT's fp32 arithmetic differs from the kernel's in rsqrt and in the order of the sum of squares: a few fp32
# ulps, so the rounded outputs differ by at most one ulp of the 16-bit dtype (relative spacing 2^-7, 2^-10), and
# seldom.
ULP = {torch.bfloat16: 2.0**-7, torch.float16: 2.0**-10}

# (rows, n): every vector width (n <= 2048: V = 1, four groups a block; <= 4096: V = 2, two groups; <= 8192: V = 4
# and <= 16384: V = 8, one group; the next-row prefetch for V <= 4 only), the first size past each width step
# (2056, 8200), n not a power of two (200, 1000, 5120), one row, a few rows (fewer than a block's groups, or than
# the grid's), and enough rows that groups of the persistent grid take several (8192 x 64, 8192 x 2048: Llama-3.2-1B's
# 4 x 2048 tokens, 3000 x 2056, 2000 x 5120, 1000 x 16384).
SHAPES = [(1, 8), (17, 8), (3, 64), (8192, 64), (1, 200), (17, 200), (3, 1000), (1000, 1000), (1, 2048), (17, 2048),
          (8192, 2048), (3, 2056), (3000, 2056), (17, 4096), (1000, 4096), (3, 5120), (2000, 5120), (1, 8192),
          (17, 8192), (3, 8200), (1, 16384), (17, 16384), (1000, 16384)]
SHAPE_IDS = [f"{rows}x{n}" for rows, n in SHAPES]


def generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(*shape, dtype, gen):
    return torch.randn(*shape, device=DEVICE, generator=gen).to(dtype)


def make_weight(n, dtype, gen):
    """Around 1, as a trained norm's weight (LitGPT starts it at ones), in `dtype`."""
    return (1 + 0.5 * torch.randn(n, device=DEVICE, generator=gen)).to(dtype)


def forward(x, weight, residual=None, eps=EPS):
    """ops.rms_norm into poisoned memory, checked against rms_norm_reference: (y, rstd, s), s = x without residual."""
    lead, n = tuple(x.shape[:-1]), x.shape[-1]
    specs = [((*lead, n), x.dtype), ((*lead, 1), torch.float32)]
    poison_allocator(*specs)
    out = ops.rms_norm(x, weight, eps, residual)
    assert len(out) == (2 if residual is None else 3)
    y, rstd, s = out if residual is not None else (*out, x)
    assert y.shape == x.shape and y.dtype == x.dtype and y.is_contiguous()
    assert rstd.shape == (*lead, 1) and rstd.dtype == torch.float32
    assert torch.isfinite(y).all() and torch.isfinite(rstd).all(), "unwritten (NaN) outputs"
    want_y, want_rstd, want_s = ops.rms_norm_reference(x, weight, eps, residual)
    if residual is not None:
        assert s.shape == x.shape and s.dtype == x.dtype and s.is_contiguous()
        assert torch.equal(s, want_s), "s is not (x.float() + residual.float()) rounded to the input dtype"
    err = rel_err(rstd, want_rstd)
    assert err < RSTD_TOL, f"rstd: {err:.3g}"
    err = rel_err(y, want_y)
    assert err < TOL[x.dtype], f"y: {err:.3g}"
    return y, rstd, s


def backward(grad, s, rstd, weight, residual_grad=None):
    """ops.rms_norm_backward into poisoned memory (the weight gradient's partial sums too), checked against
    rms_norm_backward_reference (from the same fp32 rstd): (dx, dw)."""
    n = s.shape[-1]
    poison_allocator((tuple(s.shape), s.dtype), ((n,), weight.dtype))
    dx, dw = ops.rms_norm_backward(grad, s, rstd, weight, residual_grad)
    assert dx.shape == s.shape and dx.dtype == s.dtype and dx.is_contiguous()
    assert dw.shape == (n,) and dw.dtype == weight.dtype
    assert torch.isfinite(dx).all() and torch.isfinite(dw).all(), "unwritten (NaN) outputs"
    want_dx, want_dw = ops.rms_norm_backward_reference(grad, s, rstd, weight, residual_grad)
    err = rel_err(dx, want_dx)
    assert err < TOL[s.dtype], f"dx: {err:.3g}"
    err = rel_err(dw, want_dw)
    assert err < TOL[weight.dtype], f"dw: {err:.3g}"
    return dx, dw


def forward_and_backward(x, weight, residual, grad, residual_grad):
    """Both forwards and both backwards, each checked: ((y, rstd), (y, rstd, s), (dx, dw), (dx, dw))."""
    plain = forward(x, weight)[:2]
    added = forward(x, weight, residual)
    grads = backward(grad, x, plain[1], weight)
    grads_added = backward(grad, added[2], added[1], weight, residual_grad)
    return plain, added, grads, grads_added


def operands(rows, n, dtype, wdtype, seed):
    """x, residual, grad, residual_grad (rows, n) N(0, 1) in `dtype`, and a weight in `wdtype`."""
    g = generator(seed)
    x, r, dy, dres = (randn(rows, n, dtype=dtype, gen=g) for _ in range(4))
    return x, r, dy, dres, make_weight(n, wdtype, g)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,n", SHAPES, ids=SHAPE_IDS)
def test_matches_float64(rows, n, dtype):
    x, r, dy, dres, w = operands(rows, n, dtype, dtype, seed=rows * 100003 + n)
    forward_and_backward(x, w, r, dy, dres)


@pytest.mark.parametrize("wdtype", WEIGHT_DTYPES, ids=WEIGHT_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_weight_dtype_independent_of_the_activations(dtype, wdtype):
    """Any weight dtype with either activation dtype, one shape of each vector width; dw in the weight's dtype."""
    for rows, n in [(17, 200), (8192, 2048), (1000, 2056), (3, 5120), (17, 16384)]:
        x, r, dy, dres, w = operands(rows, n, dtype, wdtype, seed=n)
        forward_and_backward(x, w, r, dy, dres)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_3d_inputs_and_views(dtype):
    """(B, T, n) inputs, read in place (rows a whole number of vectors apart, 16-byte aligned) or copied by ops (row
    strides off whole vectors, rows off 16 bytes, a transposed batch), weights strided (copied) or off 16 bytes (read
    in place, 16-bit and fp32), and rstd as a strided view or flat: every output bit for bit as from contiguous
    operands (rows are independent and the weight gradient's partial sums depend on the rows' count alone)."""
    B, T, n = 2, 37, 1000
    g = generator(7)
    x, r, dy, dres = (randn(B, T, n, dtype=dtype, gen=g) for _ in range(4))
    w = make_weight(n, dtype, g)
    (y, rstd), (ya, rstda, s), (dx, dw), (dxa, dwa) = forward_and_backward(x, w, r, dy, dres)
    assert rstd.shape == (B, T, 1) and rstda.shape == (B, T, 1)

    def widened(t, before, after):
        """t as a view into wider rows: `before` elements ahead of each row, `after` behind it."""
        wide = torch.full((*t.shape[:-1], before + n + after), float("nan"), device=DEVICE, dtype=t.dtype)
        wide[..., before:before + n] = t
        return wide[..., before:before + n]

    def transposed(t):
        """t as a (B, T, n) view of (T, B, n) storage: rows not one stride apart (ops copies)."""
        return t.transpose(0, 1).contiguous().transpose(0, 1)

    views = {
        "wide rows, aligned": lambda t: widened(t, 16, 48),  # row stride n + 64, rows 32 bytes in
        "wide rows of another stride": lambda t: widened(t, 8, 0),  # row stride n + 8, rows 16 bytes in
        "row stride off whole vectors": lambda t: widened(t, 0, 4),  # row stride n + 4: copied
        "rows off 16 bytes": lambda t: widened(t, 4, 12),  # 8 bytes in, row stride n + 16: copied
        "transposed batch": transposed,
    }
    for name, view in views.items():
        xv, rv, dyv, dresv = (view(t) for t in (x, r, dy, dres))
        assert torch.equal(xv, x), name
        got = forward(xv, w)
        assert all(torch.equal(a, b) for a, b in zip(got, (y, rstd))), name
        got = forward(xv, w, rv)
        assert all(torch.equal(a, b) for a, b in zip(got, (ya, rstda, s))), name
        got = backward(dyv, xv, rstd, w)
        assert all(torch.equal(a, b) for a, b in zip(got, (dx, dw))), name
        got = backward(dyv, view(s), rstda, w, dresv)
        assert all(torch.equal(a, b) for a, b in zip(got, (dxa, dwa))), name

    # The weight as a strided view (ops copies it), and 2 bytes off 16 (read in place: element by element).
    w_off = torch.empty(n + 1, device=DEVICE, dtype=dtype)[1:]
    w_off.copy_(w)
    for wv in (torch.stack([w, w], dim=1)[:, 0], w_off):
        assert torch.equal(wv, w) and (wv.stride(0) != 1 or wv.data_ptr() % 16 == 2)
        got = forward(x, wv, r)
        assert all(torch.equal(a, b) for a, b in zip(got, (ya, rstda, s)))
        got = backward(dy, s, rstda, wv, dres)
        assert all(torch.equal(a, b) for a, b in zip(got, (dxa, dwa)))
    w32 = make_weight(n, torch.float32, g)
    w32_off = torch.empty(n + 1, device=DEVICE)[1:]
    w32_off.copy_(w32)
    assert w32_off.data_ptr() % 16 == 4
    want = forward(x, w32, r)
    got = forward(x, w32_off, r)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert all(torch.equal(a, b) for a, b in zip(backward(dy, s, rstda, w32_off, dres),
                                                   backward(dy, s, rstda, w32, dres)))

    # rstd as a strided view of a wider fp32 tensor, and flat (one value per row is all that is asked).
    wide_rstd = torch.full((B, T, 3), float("nan"), device=DEVICE)
    wide_rstd[..., 1:2] = rstda
    for rv in (wide_rstd[..., 1:2], rstda.reshape(-1)):
        got = backward(dy, s, rv, w, dres)
        assert all(torch.equal(a, b) for a, b in zip(got, (dxa, dwa)))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_contiguous_rows_off_16_bytes_are_copied(dtype):
    """Contiguous operands that start 2 bytes off a 16-byte boundary (a slice of a flat buffer): ops must copy them
    (torch's .contiguous() hands such a tensor back as it is), with the same results as aligned ones."""
    rows, n = 300, 2048
    x, r, dy, dres, w = operands(rows, n, dtype, dtype, seed=11)

    def off(t):
        flat = torch.empty(t.numel() + 1, device=DEVICE, dtype=t.dtype)
        v = flat[1:].view(t.shape)
        v.copy_(t)
        assert v.is_contiguous() and v.data_ptr() % 16 == 2
        return v

    (y, rstd), (ya, rstda, s), (dx, dw), (dxa, dwa) = forward_and_backward(x, w, r, dy, dres)
    assert all(torch.equal(a, b) for a, b in zip(forward(off(x), w), (y, rstd)))
    assert all(torch.equal(a, b) for a, b in zip(forward(off(x), w, off(r)), (ya, rstda, s)))
    assert all(torch.equal(a, b) for a, b in zip(backward(off(dy), off(x), rstd, w), (dx, dw)))
    assert all(torch.equal(a, b) for a, b in zip(backward(off(dy), off(s), rstda, w, off(dres)), (dxa, dwa)))


@pytest.mark.parametrize("wdtype", WEIGHT_DTYPES, ids=WEIGHT_IDS)
def test_no_rows(wdtype):
    """An empty leading dimension: empty outputs of the right shapes; the backward's dw all zero (written, from
    poisoned memory, by the one block's zero partial sums)."""
    for lead in [(0,), (2, 0), (0, 3)]:
        for n in (64, 2056, 16384):
            x = torch.empty(*lead, n, device=DEVICE, dtype=torch.bfloat16)
            w = torch.ones(n, device=DEVICE, dtype=wdtype)
            y, rstd = ops.rms_norm(x, w, EPS)
            assert y.shape == x.shape and y.dtype == x.dtype and rstd.shape == (*lead, 1)
            assert rstd.dtype == torch.float32
            y, rstd, s = ops.rms_norm(x, w, EPS, x)
            assert y.shape == s.shape == x.shape and rstd.shape == (*lead, 1)
            for residual_grad in (None, x):
                poison_allocator(((n,), wdtype))
                dx, dw = ops.rms_norm_backward(x, x, rstd, w, residual_grad)
                assert dx.shape == x.shape and dx.dtype == x.dtype
                assert dw.shape == (n,) and dw.dtype == wdtype
                assert not dw.any(), "dw of no rows is not all zero (or not written)"


def test_repeatable_bit_for_bit():
    """Forward and backward twice more: the same bits (rows are independent; dw's block partial sums are added by a
    second launch in block order, no atomics)."""
    for rows, n, dtype, wdtype in [(8192, 2048, torch.bfloat16, torch.bfloat16),
                                   (8192, 64, torch.float16, torch.float16),
                                   (3000, 2056, torch.bfloat16, torch.float32),
                                   (2000, 5120, torch.float16, torch.bfloat16),
                                   (1000, 16384, torch.bfloat16, torch.float32)]:
        x, r, dy, dres, w = operands(rows, n, dtype, wdtype, seed=3)
        first = ops.rms_norm(x, w, EPS, r)
        y, rstd, s = first
        back = ops.rms_norm_backward(dy, s, rstd, w, dres)
        plain = ops.rms_norm_backward(dy, x, rstd, w)
        for _ in range(2):
            assert all(torch.equal(a, b) for a, b in zip(ops.rms_norm(x, w, EPS, r), first)), (rows, n)
            assert all(torch.equal(a, b) for a, b in zip(ops.rms_norm_backward(dy, s, rstd, w, dres), back)), (rows, n)
            assert all(torch.equal(a, b) for a, b in zip(ops.rms_norm_backward(dy, x, rstd, w), plain)), (rows, n)


def litgpt_rms_norm(x, weight, eps):
    """LitGPT's RMSNorm.forward (litgpt/model.py, no unit offset): fp32 inside, rounded to the input's dtype."""
    dtype = x.dtype
    x = x.float()
    norm_x = torch.mean(x * x, dim=-1, keepdim=True)
    x_normed = x * torch.rsqrt(norm_x + eps)
    return (x_normed * weight.float()).to(dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,n", [(17, 200), (8192, 2048), (1000, 2056), (3, 5120), (17, 16384)],
                         ids=["17x200", "8192x2048", "1000x2056", "3x5120", "17x16384"])
def test_matches_litgpt_in_fp32(rows, n, dtype):
    """A pre-norm block's residual add and LitGPT's RMSNorm in torch (fp32 inside): s bit for bit, y to within an
    ulp of the 16-bit dtype (nearly all bits equal); the backward against torch.autograd of the same fp32 arithmetic
    (the weight in fp32, the residual stream's gradient added)."""
    x, r, dy, dres, w = operands(rows, n, dtype, dtype, seed=5)
    s_torch = x + r  # 16-bit add: fp32 arithmetic, rounded once
    want_y = litgpt_rms_norm(s_torch, w, EPS)
    y, rstd, s = ops.rms_norm(x, w, EPS, r)
    assert torch.equal(s, s_torch)
    diff = (y.float() - want_y.float()).abs()
    assert (diff <= ULP[dtype] * want_y.float().abs() + 1e-6).all(), f"y off LitGPT by up to {diff.max().item():.3g}"
    assert (y != want_y).float().mean().item() < 0.01, "y differs from LitGPT's in more than 1% of its elements"
    y_plain, _ = ops.rms_norm(x, w, EPS)
    assert ((y_plain.float() - litgpt_rms_norm(x, w, EPS).float()).abs()
            <= ULP[dtype] * litgpt_rms_norm(x, w, EPS).float().abs() + 1e-6).all()

    sf = s_torch.float().requires_grad_()
    wf = w.float().requires_grad_()
    want_ds, want_dw = torch.autograd.grad(litgpt_rms_norm(sf, wf, EPS), (sf, wf), dy.float())
    dx, dw = ops.rms_norm_backward(dy, s, rstd, w, dres)
    err = rel_err(dx, want_ds + dres.float())
    assert err < TOL[dtype], f"dx against autograd: {err:.3g}"
    err = rel_err(dw, want_dw)
    assert err < TOL[w.dtype], f"dw against autograd: {err:.3g}"
    dx, dw = ops.rms_norm_backward(dy, s, rstd, w)
    assert rel_err(dx, want_ds) < TOL[dtype] and rel_err(dw, want_dw) < TOL[w.dtype]


def test_errors_name_the_problem():
    g = generator(0)
    x = randn(4, 64, dtype=torch.bfloat16, gen=g)
    w = make_weight(64, torch.bfloat16, g)
    with pytest.raises(ValueError, match="one value per element of the last dimension"):
        ops.rms_norm(x, w[:32], EPS)
    with pytest.raises(ValueError, match="one value per element of the last dimension"):
        ops.rms_norm(x, w.view(1, 64), EPS)
    with pytest.raises(ValueError, match="not a positive multiple of 8"):
        ops.rms_norm(x[:, :12], w[:12], EPS)
    wide = randn(2, 16392, dtype=torch.bfloat16, gen=g)
    with pytest.raises(ValueError, match="above 16384"):
        ops.rms_norm(wide, torch.ones(16392, device=DEVICE, dtype=torch.bfloat16), EPS)
    with pytest.raises(ValueError, match="input dtype torch.float32"):
        ops.rms_norm(x.float(), w, EPS)
    with pytest.raises(ValueError, match="weight dtype torch.float64"):
        ops.rms_norm(x, w.double(), EPS)
    with pytest.raises(ValueError, match="without a weight"):
        ops.rms_norm(x, None, EPS)
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(x, w, EPS, x[:3])
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm(x, w, EPS, x.half())
    with pytest.raises(ValueError, match="tensors on"):
        ops.rms_norm(x, w.cpu(), EPS)

    y, rstd = ops.rms_norm(x, w, EPS)
    with pytest.raises(ValueError, match="grad .* is not shaped like the input"):
        ops.rms_norm_backward(x[:3], x, rstd, w)
    with pytest.raises(ValueError, match="grad .* is not shaped like the input"):
        ops.rms_norm_backward(x.half(), x, rstd, w)
    with pytest.raises(ValueError, match="rstd must be float32 with one value per row"):
        ops.rms_norm_backward(x, x, rstd[:3], w)
    with pytest.raises(ValueError, match="rstd must be float32 with one value per row"):
        ops.rms_norm_backward(x, x, rstd.double(), w)
    with pytest.raises(ValueError, match="residual"):
        ops.rms_norm_backward(x, x, rstd, w, x[:, :32])
    with pytest.raises(ValueError, match="input dtype torch.float32"):
        ops.rms_norm_backward(x.float(), x.float(), rstd, w)
    with pytest.raises(ValueError, match="one value per element of the last dimension"):
        ops.rms_norm_backward(x, x, rstd, w[:32])
    with pytest.raises(ValueError, match="not a positive multiple of 8"):
        ops.rms_norm_backward(x[:, :12], x[:, :12], rstd, w[:12])
    with pytest.raises(ValueError, match="tensors on"):
        ops.rms_norm_backward(x, x, rstd.cpu(), w)
