"""Unit tests of the tile library's primitives (csrc/kittens/) on single-warpgroup kernels, against torch:
register-tile row reductions and broadcasts, shared vectors, the fp32 -> 16-bit register A operand and wgmma
with A in registers (both B majors), stmatrix and ldmatrix through swizzled panels, the TMA reduce-store and the
block-wide sum.
Outputs are poisoned with NaN first."""

import pytest
import torch

from accuracy import rel_err
from thunder_tk import _extension

pytestmark = pytest.mark.gpu

CODES = {torch.bfloat16: 0, torch.float16: 1, torch.float32: 2}


def selftest():
    return _extension.extension().selftest


def stream():
    return torch.cuda.current_stream().cuda_stream


def poisoned(*shape, dtype=torch.float32):
    return torch.full(shape, float("nan"), device="cuda", dtype=dtype)


@pytest.mark.parametrize("cols", [64, 128, 256])
def test_row_softmax_max_and_sum(cols):
    x = torch.randn(64, cols, device="cuda") * 4
    x[5] = -1e30  # a row of huge negatives still has a finite max and sum
    out, mx, sm = poisoned(64, cols), poisoned(64), poisoned(64)
    selftest().row_softmax(x.data_ptr(), out.data_ptr(), mx.data_ptr(), sm.data_ptr(), cols, stream())
    torch.cuda.synchronize()
    x64 = x.double()
    ref_max = x64.max(dim=1).values
    assert torch.equal(mx.double(), ref_max)  # a max is exact
    assert rel_err(sm, torch.exp(x64 - ref_max[:, None]).sum(1)) < 1e-5
    assert rel_err(out, torch.softmax(x64, dim=1)) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n", [64, 128, 256])
@pytest.mark.parametrize("b_mn_major", [False, True])
def test_wgmma_with_a_in_registers(dtype, n, b_mn_major):
    a = torch.randn(64, 64, device="cuda")
    b = torch.randn(n, 64, device="cuda", dtype=dtype)  # B as (n, K)
    stored = b.t().contiguous() if b_mn_major else b  # MN-major: (K, n) row-major
    out = poisoned(64, n)
    selftest().mma_registers_a(a.data_ptr(), stored.data_ptr(), out.data_ptr(), n, b_mn_major, CODES[dtype], stream())
    torch.cuda.synchronize()
    ref = a.to(dtype).double() @ b.double().t()  # A is rounded to dtype in registers
    assert torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [64, 128, 256])
def test_stmatrix_stores_the_accumulator_into_swizzled_panels(dtype, cols):
    x = torch.randn(64, cols, device="cuda") * 3
    out = poisoned(64, cols, dtype=dtype)
    selftest().store_matrices(x.data_ptr(), out.data_ptr(), cols, CODES[dtype], stream())
    torch.cuda.synchronize()
    assert torch.equal(out, x.to(dtype))  # every element where it belongs, rounded once


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("cols", [64, 128])
def test_ldmatrix_loads_swizzled_panels_as_a_register_operand(dtype, cols):
    x = torch.randn(64, cols, device="cuda").to(dtype)
    out = poisoned(64, cols, dtype=dtype)
    selftest().load_matrices(x.data_ptr(), out.data_ptr(), cols, CODES[dtype], stream())
    torch.cuda.synchronize()
    assert torch.equal(out, x)  # every element of the fragment where the layout puts it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,cols,row0,col0", [(64, 32, 0, 0), (200, 296, 70, 32), (100, 72, 61, 48)])
def test_tma_reduce_store_adds_in_place(dtype, rows, cols, row0, col0):
    element = torch.tensor([], dtype=dtype).element_size()
    width = 128 // element  # the tile is 128 bytes wide
    per16 = 16 // element
    stride = (cols + per16 + per16 - 1) // per16 * per16  # padded rows (TMA wants 16-byte strides): a strided view
    base = torch.randn(rows, stride, device="cuda", dtype=dtype)
    dst = base[:, :cols]
    before, padding = dst.clone(), base[:, cols:].clone()
    src = torch.randn(64, width, device="cuda", dtype=dtype)
    selftest().reduce_add(dst.data_ptr(), src.data_ptr(), CODES[dtype], rows, cols, stride, row0, col0, stream())
    torch.cuda.synchronize()
    expected = before.double()
    r1, c1 = min(rows, row0 + 64), min(cols, col0 + width)
    expected[row0:r1, col0:c1] += src.double()[: r1 - row0, : c1 - col0]
    tol = 1e-6 if dtype == torch.float32 else 1e-2  # one rounding of the sum in the element type
    assert (dst.double() - expected).abs().max().item() <= tol * expected.abs().max().item()
    # The box is clipped at the view's columns, not its stride (TMA clips at 16-byte chunks, so the view's
    # width is a multiple of 16 bytes here; the binding refuses any other).
    assert torch.equal(base[:, cols:], padding)
    outside = torch.ones(rows, cols, dtype=torch.bool, device="cuda")
    outside[row0:r1, col0:c1] = False
    assert torch.equal(dst[outside], before[outside])  # nothing written outside the box or the tensor


@pytest.mark.parametrize("threads", [32, 256, 1024])
def test_block_sum_gives_every_thread_the_sum_in_a_fixed_order(threads):
    blocks = 37
    x = torch.randn(blocks, threads, device="cuda") * torch.logspace(-3, 3, threads, device="cuda")
    out = poisoned(blocks, threads)
    selftest().block_sum(x.data_ptr(), out.data_ptr(), blocks, threads, stream())
    torch.cuda.synchronize()
    assert not out.isnan().any()  # NaN: a thread's second sum (slots reused) was not the first's negation
    assert torch.equal(out, out[:, :1].expand_as(out))  # every thread of a block has the same total
    ref = x.double().sum(1)
    assert ((out[:, 0].double() - ref).abs() <= 1e-5 * x.double().abs().sum(1)).all()
    again = poisoned(blocks, threads)
    selftest().block_sum(x.data_ptr(), again.data_ptr(), blocks, threads, stream())
    torch.cuda.synchronize()
    assert torch.equal(again, out)  # the same bits on every call


def test_bad_arguments_raise():
    with pytest.raises(ValueError, match="cols must be"):
        selftest().row_softmax(0, 0, 0, 0, 100, stream())
    with pytest.raises(ValueError, match="threads must be"):
        selftest().block_sum(0, 0, 1, 100, stream())
    with pytest.raises(ValueError, match="dtype must be"):
        selftest().reduce_add(0, 0, 1, 64, 64, 64, 0, 0, stream())
    with pytest.raises(ValueError, match="multiple of 16 bytes"):  # an unaligned TMA store is an illegal instruction
        selftest().reduce_add(0, 0, 2, 64, 64, 64, 0, 3, stream())
    with pytest.raises(ValueError, match="cols must span a multiple of 16 bytes"):  # would write past column 70
        selftest().reduce_add(0, 0, 2, 64, 70, 72, 0, 0, stream())
