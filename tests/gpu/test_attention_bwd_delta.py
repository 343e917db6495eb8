"""The attention backward pre-pass kernel against an fp64 reference, and through Thunder."""

import pytest
import torch
import thunder

import thunder_tk
from accuracy import rel_err
from thunder_tk import _extension, ops
from thunder_tk.claim_rules import KERNELS_IN_SOURCE

pytestmark = pytest.mark.gpu

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Tolerance on ||out - ref|| / ||sum |o g| ||: the kernel reads the same rounded inputs as the reference and
# accumulates in fp32, so only the fp32 summation order differs, and a sum's rounding error scales with the sum of
# its terms' magnitudes, not with the sum (a single row whose products nearly cancel measured 2.3e-5 against |ref|).
TOL = 1e-5


def reference(o, g):
    return (o.double() * g.double()).sum(-1)


def delta_err(out, o, g):
    """||out - ref|| relative to the row sums of |o g|, the scale of the summation's rounding error."""
    scale = (o.double().abs() * g.double().abs()).sum(-1)
    return ((out.double() - reference(o, g)).norm() / scale.norm().clamp_min(1e-30)).item()


def check(o, g):
    # Poisoned output: any element the kernel fails to write stays NaN.
    out = torch.full(o.shape[:3], float("nan"), device=o.device, dtype=torch.float32)
    ops.attention_bwd_delta(o, g, out=out)
    assert torch.isfinite(out).all()
    err = delta_err(out, o, g)
    assert err < TOL, err
    return out


def test_build_reports_the_source_kernels():
    assert set(_extension.compiled_kernels()) == set(KERNELS_IN_SOURCE)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "shape",
    [(1, 1, 1, 1), (1, 1, 1, 64), (2, 3, 17, 128), (1, 16, 1000, 64), (4, 8, 4097, 128), (2, 2, 5, 96),
     (1, 3, 33, 7), (1, 2, 9, 256), (1, 1, 3, 257), (3, 1, 65, 8), (1, 1, 2, 1000)],
)
def test_matches_fp64_reference(shape, dtype):
    o = torch.randn(shape, device="cuda", dtype=dtype)
    g = torch.randn(shape, device="cuda", dtype=dtype)
    check(o, g)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_strided_views_without_copies(dtype):
    # (B, S, H, D) storage viewed as (B, H, S, D), and a slice of a fused qkv-like buffer.
    base = torch.randn(2, 300, 6, 3, 128, device="cuda", dtype=dtype)
    o = base[:, :, :, 0].transpose(1, 2)
    g = torch.randn(2, 300, 6, 128, device="cuda", dtype=dtype).transpose(1, 2)
    assert not o.is_contiguous() and o.stride(-1) == 1
    check(o, g)


@pytest.mark.parametrize("shape", [(2, 16, 2048, 128), (1, 3, 17, 64), (3, 5, 1, 64), (2, 1, 40, 128)])
def test_forward_output_layout_both_tensors(shape):
    # o and grad_o both (B, S, H, D) in memory, as LitGPT hands them (rows then go by (b, s, h) and collapse into one
    # stride); the delta written into a (B, H, S) row-padded buffer, poisoned.
    B, H, S, D = shape
    o, g = (torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2) for _ in "og")
    check(o, g)
    padded = torch.full((B, H, S + 3), float("nan"), device="cuda")
    out = padded[..., :S]
    ops.attention_bwd_delta(o, g, out=out)
    assert delta_err(out, o, g) < TOL
    assert torch.isnan(padded[..., S:]).all()


def _layout(shape, layout, dtype):
    B, H, S, D = shape
    if layout == "contiguous":
        return (torch.randn(shape, device="cuda", dtype=dtype) for _ in "og")
    heads_inner = torch.randn(B, S, H, D, device="cuda", dtype=dtype).transpose(1, 2)
    if layout == "bshd":  # both heads-inner: the rows go by (b, s, h), one stride
        return heads_inner, torch.randn(B, S, H, D, device="cuda", dtype=dtype).transpose(1, 2)
    if layout == "mixed":  # the forward's o beside a contiguous grad_o: the strided path
        return heads_inner, torch.randn(shape, device="cuda", dtype=dtype)
    padded = torch.randn(B, H, S, D + 8, device="cuda", dtype=dtype)[..., :D]  # rows D + 8 apart
    return padded, torch.randn(shape, device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["contiguous", "bshd", "mixed", "padded"])
@pytest.mark.parametrize(
    "shape",
    # one row; a block's rows not filled; many passes of the resident grid (4 x 8 x 4097 rows); D over several
    # accesses a lane (512 bf16)
    [(1, 1, 1, 64), (2, 3, 17, 128), (4, 8, 4097, 128), (1, 16, 1000, 64), (1, 2, 9, 256), (1, 1, 3, 512),
     (3, 1, 65, 8), (2, 2, 5, 96)],
)
def test_every_row_count_and_grid_gives_the_same_bits(shape, layout, dtype):
    # A row's sum is its lanes' accesses summed over the group whatever the rows a group takes or the grid, so every
    # (rows per group, resident grid) writes the default's bits; each checked with its output and zero buffer
    # poisoned.
    o, g = _layout(shape, layout, dtype)
    default = check(o, g)
    for rows in (1, 2, 4):
        for resident in (False, True):
            out = torch.full(shape[:3], float("nan"), device="cuda")
            zero = torch.full(shape, float("nan"), device="cuda") if shape[3] % 4 == 0 else None
            ops.attention_bwd_delta(o, g, out=out, zero=zero, _tuning=(rows, resident))
            assert torch.equal(out, default), (rows, resident, delta_err(out, o, g))
            if zero is not None:
                assert torch.equal(zero, torch.zeros_like(zero)), (rows, resident)


def test_rows_from_the_environment_and_bad_rows(monkeypatch):
    o, g = _layout((2, 4, 300, 128), "mixed", torch.bfloat16)
    default = check(o, g)
    for word in ("1", "2", "4"):
        monkeypatch.setenv("THUNDER_TK_ATTN_DELTA_ROWS", word)
        assert torch.equal(ops.attention_bwd_delta(o, g), default), word
    with pytest.raises(ValueError, match="rows_per_group must be"):
        ops.attention_bwd_delta(o, g, _tuning=(3, False))


def test_misaligned_and_odd_strides_take_the_scalar_path():
    flat = torch.randn(1 + 2 * 3 * 11 * 64, device="cuda", dtype=torch.bfloat16)
    o = flat[1:].view(2, 3, 11, 64)  # base 2 bytes off 16-byte alignment
    g = torch.randn(2, 3, 11, 66, device="cuda", dtype=torch.bfloat16)[..., :64]  # row stride 66 elements
    check(o, g)


def test_non_contiguous_last_dim():
    o = torch.randn(2, 4, 33, 64, device="cuda", dtype=torch.bfloat16).transpose(-1, -2).contiguous().transpose(-1, -2)
    g = torch.randn(2, 4, 64, 33, device="cuda", dtype=torch.bfloat16).transpose(-1, -2)
    assert g.stride(-1) != 1
    check(o, g)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,strided", [((2, 3, 17, 128), False), ((1, 16, 1000, 64), True), ((3, 1, 65, 8), False),
                                           ((1, 2, 9, 4), True), ((4, 8, 4097, 128), False)])
def test_zero_buffer_cleared_in_the_same_pass(shape, strided, dtype):
    # The backward's dQ accumulator is zeroed by this pass (rows of D floats beside each row's reads), on the
    # vector and the scalar paths, whatever o's strides: every element of it, nothing of the delta changes.
    if strided:
        o = torch.randn(shape[0], shape[2], shape[1], shape[3] + 4, device="cuda", dtype=dtype)[..., :shape[3]]
        o = o.transpose(1, 2)
    else:
        o = torch.randn(shape, device="cuda", dtype=dtype)
    g = torch.randn(shape, device="cuda", dtype=dtype)
    zero = torch.full(shape, float("nan"), device="cuda")
    out = torch.full(shape[:3], float("nan"), device="cuda")
    ops.attention_bwd_delta(o, g, out=out, zero=zero)
    assert torch.equal(zero, torch.zeros_like(zero))
    assert delta_err(out, o, g) < TOL
    assert torch.equal(out, ops.attention_bwd_delta(o, g))


def test_zero_buffer_must_fit():
    o = torch.randn(2, 3, 17, 64, device="cuda", dtype=torch.bfloat16)
    for bad in (torch.zeros(2, 3, 17, 64, device="cuda", dtype=torch.float16),
                torch.zeros(2, 3, 18, 64, device="cuda"),
                torch.zeros(2, 3, 64, 17, device="cuda").transpose(-1, -2)):
        with pytest.raises(ValueError, match="zero must be a contiguous float32"):
            ops.attention_bwd_delta(o, o, zero=bad)
    odd = torch.randn(1, 1, 5, 6, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="zero_rows needs head_dim a multiple of 4"):
        ops.attention_bwd_delta(odd, odd, zero=torch.zeros(1, 1, 5, 6, device="cuda"))


def test_strided_output():
    o = torch.randn(3, 5, 777, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(o)
    big = torch.full((3, 777, 5, 2), float("nan"), device="cuda")
    out = big[..., 0].transpose(1, 2)  # (3, 5, 777) view with odd strides
    ops.attention_bwd_delta(o, g, out=out)
    assert delta_err(out, o, g) < TOL
    assert torch.isnan(big[..., 1]).all()  # nothing written outside the view
    with pytest.raises(ValueError, match="out must be a float32"):
        ops.attention_bwd_delta(o, g, out=out.half())


def test_empty_and_repeatable():
    o = torch.randn(2, 0, 16, 64, device="cuda", dtype=torch.bfloat16)
    assert ops.attention_bwd_delta(o, o).shape == (2, 0, 16)
    o = torch.randn(4, 8, 1000, 128, device="cuda", dtype=torch.bfloat16)
    g = torch.randn_like(o)
    first = ops.attention_bwd_delta(o, g)
    for _ in range(5):
        assert torch.equal(ops.attention_bwd_delta(o, g), first)


def test_runs_on_the_current_stream_and_in_a_graph():
    o = torch.randn(2, 8, 513, 64, device="cuda", dtype=torch.float16)
    g = torch.randn_like(o)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = ops.attention_bwd_delta(o, g)
    torch.cuda.current_stream().wait_stream(side)
    assert delta_err(out, o, g) < TOL

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        ops.attention_bwd_delta(o, g)  # warm-up outside capture
        with torch.cuda.graph(graph, stream=side):
            captured = ops.attention_bwd_delta(o, g)
    o.copy_(torch.randn_like(o))
    graph.replay()
    torch.cuda.synchronize()
    assert delta_err(captured, o, g) < TOL


def test_bad_arguments_raise_named_errors():
    o = torch.randn(2, 3, 4, 8, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="same shape"):
        ops.attention_bwd_delta(o, o[:, :, :3])
    with pytest.raises(ValueError, match="same dtype"):
        ops.attention_bwd_delta(o, o.half())
    with pytest.raises(ValueError, match="supports bfloat16"):
        ops.attention_bwd_delta(o.double(), o.double())
    with pytest.raises(ValueError, match="runs on CUDA"):
        ops.attention_bwd_delta(o.cpu(), o.cpu())


def test_thunder_claims_it_forward_and_backward():
    def f(o, g):
        return thunder_tk.attention_bwd_delta(o, g) * 2

    def f_ref(o, g):
        return ops.attention_bwd_delta_reference(o, g) * 2

    o = torch.randn(2, 4, 129, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(2, 4, 129, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    jf = thunder.jit(f, executors=[thunder_tk.tk])
    out = jf(o, g)
    ref = f_ref(o.detach().float(), g.detach().float())
    assert rel_err(out, ref.double()) < TOL
    names = [b.sym.name for b in thunder.last_traces(jf)[-1].bound_symbols]
    assert "tk_attention_bwd_delta" in names
    report = thunder_tk.explain(jf)
    (row,) = [r for r in report.rows if r.symbol == "thunder_tk.attention_bwd_delta"]
    assert row.claimed_by_tk and row.ran_by == "tk: tk_attention_bwd_delta", report

    seed = torch.randn_like(out)
    out.backward(seed)
    o2 = o.detach().float().requires_grad_()
    g2 = g.detach().float().requires_grad_()
    f_ref(o2, g2).backward(seed)
    assert rel_err(o.grad.float(), o2.grad.double()) < 1e-2
    assert rel_err(g.grad.float(), g2.grad.double()) < 1e-2
