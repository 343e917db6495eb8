"""The embedding's dense weight gradient (ops.embedding_backward): against float64 index_add, for bf16, fp16 and
fp32, few and many tokens, ids repeated many times, a padding row, ids outside the table (ignored), rows that are
not whole 16-byte vectors and strided incoming gradients, int32 ids; every output row written (poisoned memory),
repeatable bit for bit (sums in token order, no atomics), and argument errors named."""

import pytest
import torch

from accuracy import rel_err
from poisoning import poison_allocator
from thunder_tk import ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hasattr(ops, "embedding_backward"), reason="no ops.embedding_backward")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def run(grad, ids, rows, padding_idx=-1):
    poison_allocator(((rows, grad.shape[-1]), grad.dtype))
    out = ops.embedding_backward(grad, ids, rows, padding_idx)
    assert out.shape == (rows, grad.shape[-1]) and out.dtype == grad.dtype and out.is_contiguous()
    assert torch.isfinite(out).all(), "unwritten (NaN) rows"
    want = ops.embedding_backward_reference(grad, ids, rows, padding_idx)
    if want.norm() > 0:
        assert rel_err(out, want) < TOL[grad.dtype]
    else:
        assert not out.any()
    return out


CASES = [  # ids shape, rows, D, id range (None: all rows)
    ((1,), 1, 8, None),
    ((7,), 10, 64, None),
    ((2, 300), 1000, 256, None),
    ((4, 512), 32000, 2048, None),
    ((3, 100), 5000, 100, None),       # rows not whole 16-byte vectors
    ((8, 256), 50, 512, 5),            # each id repeated some 400 times
    ((2, 64), 128256, 64, None),       # a wide table, nearly all rows zero
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[0]}-{c[1]}x{c[2]}" for c in CASES])
def test_matches_float64(case, dtype):
    shape, rows, D, span = case
    g = torch.Generator(device="cuda").manual_seed(0)
    ids = torch.randint(0, span or rows, shape, device="cuda", generator=g)
    grad = torch.randn(*shape, D, device="cuda", generator=g).to(dtype)
    run(grad, ids, rows)


def test_padding_row_out_of_range_ids_int32_and_strided_grad():
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(-3, 103, (4, 200), device="cuda", generator=g)  # some below 0 and some past 99: ignored
    wide = torch.randn(4, 200, 384, device="cuda", generator=g).to(torch.bfloat16)
    grad = wide[..., 64:320]  # row stride 384 for 256 columns
    out = run(grad, ids, 100, padding_idx=7)
    assert not out[7].any()
    run(grad, ids.int(), 100, padding_idx=7)
    run(grad.transpose(0, 1), ids.transpose(0, 1), 100)  # non-contiguous ids and rows in another order


def test_no_tokens_and_no_rows():
    grad = torch.empty(0, 64, device="cuda", dtype=torch.bfloat16)
    out = ops.embedding_backward(grad, torch.empty(0, device="cuda", dtype=torch.long), 10)
    assert out.shape == (10, 64) and not out.any()
    assert ops.embedding_backward(torch.randn(3, 64, device="cuda"), torch.zeros(3, device="cuda", dtype=torch.long),
                                  0).shape == (0, 64)


def test_repeatable_bit_for_bit():
    g = torch.Generator(device="cuda").manual_seed(2)
    ids = torch.randint(0, 20, (4096,), device="cuda", generator=g)
    grad = torch.randn(4096, 1024, device="cuda", generator=g).to(torch.bfloat16)
    first = ops.embedding_backward(grad, ids, 20)
    assert all(torch.equal(first, ops.embedding_backward(grad, ids, 20)) for _ in range(3))


def test_errors_name_the_problem():
    grad = torch.randn(5, 16, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(5, device="cuda", dtype=torch.long)
    with pytest.raises(ValueError, match="one row per index"):
        ops.embedding_backward(grad, ids[:4], 10)
    with pytest.raises(ValueError, match="int64 or int32"):
        ops.embedding_backward(grad, ids.float(), 10)
    with pytest.raises(ValueError, match="dtype"):
        ops.embedding_backward(grad.double(), ids, 10)
    with pytest.raises(ValueError, match="on"):
        ops.embedding_backward(grad, ids.cpu(), 10)
    with pytest.raises(TypeError):
        ops.embedding_backward(grad, None, 10)
