"""ops.gemm_sum: a @ b + a2 @ b2 in one launch, against a float64 reference: K and K2 with ragged last k-blocks,
M and N tails, one row, every operand major (and mixed ones, which the wrapper reads K-major), strided views,
a bias, every tile path and schedule of the persistent kernel, poisoned outputs, repeats bit for bit, errors; and
LLaMA's MLP trained through Thunder with its input gradient summed in one launch."""

import copy

import pytest
import torch
import thunder

import thunder_tk
from accuracy import operand, rel_err
from models import LlamaMLP
from thunder_tk import ops

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def check(a, b, a2, b2, bias=None, **knobs):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), device="cuda", dtype=a.dtype)
    got = ops.gemm_sum(a, b, a2, b2, bias, out=out, **knobs)
    assert got is out
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    ref = a.double() @ b.double() + a2.double() @ b2.double()
    if bias is not None:
        ref = ref + bias.double()
    err = rel_err(out, ref)
    assert err < TOL[a.dtype], err
    return out


# (M, N, K, K2): ragged k-blocks on either side (K % 64), tails in M and N, one row, one column block.
SHAPES = [(1, 8, 64, 8), (17, 40, 24, 72), (129, 264, 72, 136), (300, 504, 1000, 520), (1000, 8, 4096, 64),
          (777, 1504, 520, 1000), (2048, 2048, 2048, 1024), (4096, 2048, 1024, 1024)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_k_major", [True, False])
@pytest.mark.parametrize("b_n_major", [True, False])
@pytest.mark.parametrize("M,N,K,K2", SHAPES)
def test_matches_float64(M, N, K, K2, a_k_major, b_n_major, dtype):
    if (not a_k_major and M % 8) or (b_n_major and N % 8):
        pytest.skip("that layout's leading stride is M or N; the copy path is tested separately")
    a, a2 = operand(M, K, a_k_major, dtype), operand(M, K2, a_k_major, dtype)
    b, b2 = operand(K, N, b_n_major, dtype), operand(K2, N, b_n_major, dtype)
    check(a, b, a2, b2)


@pytest.mark.parametrize("knobs", [
    dict(_tile_n=128), dict(_tile_n=256), dict(_pingpong=1), dict(_epilogue=1), dict(_epilogue=2), dict(_cluster=2),
    dict(_schedule="dynamic"), dict(_stream_k=1), dict(_stream_k=1, _tile_n=128), dict(_group_rows=1),
], ids=lambda k: ",".join(f"{n.strip('_')}={v}" for n, v in k.items()))
@pytest.mark.parametrize("a_k_major,b_n_major", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("M,N,K,K2", [(129, 264, 72, 136), (777, 1504, 520, 1000), (4096, 4096, 512, 192)])
def test_every_tile_path(M, N, K, K2, a_k_major, b_n_major, knobs):
    dtype = torch.bfloat16
    a, a2 = operand(M, K, a_k_major, dtype), operand(M, K2, a_k_major, dtype)
    b, b2 = operand(K, N, b_n_major, dtype), operand(K2, N, b_n_major, dtype)
    check(a, b, a2, b2, **knobs)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_mixed_majors_strided_views_and_copies(dtype):
    """Mixed majors (read K-major, the others copied), views with row strides above their width, a second product
    off 16 bytes (copied), and a bias."""
    M, N, K, K2 = 300, 504, 200, 136
    big = torch.randn(M, 2 * K, device="cuda", dtype=dtype)
    a = big[:, 8:8 + K]  # a strided K-major view
    a2 = operand(M, K2, False, dtype)  # M-major
    b = operand(K, N, True, dtype)
    b2 = torch.randn(K2, N + 8, device="cuda", dtype=dtype)[:, :N]  # N-major, row stride N + 8
    bias = torch.randn(N, device="cuda", dtype=dtype)
    check(a, b, a2, b2, bias)
    check(a, b, a2, operand(K2, N, False, dtype))  # B majors differ
    odd = torch.randn(M * K2 + 1, device="cuda", dtype=dtype)[1:].view(M, K2)  # 2 bytes off 16
    check(a, b, odd, b2)


def test_degenerate_sizes_and_repeats():
    dtype = torch.bfloat16
    a, b = operand(70, 64, True, dtype), operand(64, 24, True, dtype)
    a2, b2 = operand(70, 0, True, dtype), operand(0, 24, True, dtype)
    assert torch.equal(ops.gemm_sum(a, b, a2, b2), ops.gemm(a, b))  # nothing to add
    assert torch.equal(ops.gemm_sum(a2, b2, a, b), ops.gemm(a, b))  # the first product empty
    zero = ops.gemm_sum(a2, b2, a2, b2)
    assert zero.shape == (70, 24) and not zero.any()
    assert ops.gemm_sum(a[:0], b, a2[:0], b2).shape == (0, 24)
    a, b = operand(2048, 1000, True, dtype), operand(1000, 2048, False, dtype)
    a2, b2 = operand(2048, 520, True, dtype), operand(520, 2048, False, dtype)
    first = ops.gemm_sum(a, b, a2, b2)
    for _ in range(3):
        assert torch.equal(ops.gemm_sum(a, b, a2, b2), first), "not repeatable bit for bit"


def test_errors_name_the_problem():
    dtype = torch.bfloat16
    a, b = operand(64, 64, True, dtype), operand(64, 32, True, dtype)
    with pytest.raises(ValueError, match="one shape"):
        ops.gemm_sum(a, b, operand(32, 64, True, dtype), b)
    with pytest.raises(ValueError, match="one shape"):
        ops.gemm_sum(a, b, a, operand(64, 40, True, dtype))
    with pytest.raises(ValueError, match="must be torch.bfloat16 tensors"):
        ops.gemm_sum(a, b, a.half(), b.half())
    with pytest.raises(ValueError, match="K a multiple of 8"):
        ops.gemm_sum(a, b, operand(64, 12, True, dtype), operand(12, 32, True, dtype))
    with pytest.raises(ValueError, match="shapes do not match"):
        ops.gemm_sum(a, b, a, operand(60, 32, True, dtype))
    with pytest.raises(TypeError, match="a2 and b2 must be tensors"):
        ops.gemm_sum(a, b, a, None)
    with pytest.raises(ValueError, match="skinny GEMM takes one product"):
        ops.gemm_sum(a, b, a, b, _skinny=1)


def test_mlp_input_gradient_in_one_launch(monkeypatch):
    """Through Thunder with tk: the MLP's input gradient comes from one tk_matmul_sum, and every gradient matches
    float64 eager as closely as the unsummed route's."""
    from thunder_tk import claim_rules

    monkeypatch.setattr(claim_rules, "gemm_size_policy_default", False)
    torch.manual_seed(0)
    model = LlamaMLP(512, 1376).cuda().to(torch.bfloat16)
    exact = copy.deepcopy(model).double()
    x = torch.randn(3, 301, 512, device="cuda", dtype=torch.bfloat16)
    cot = torch.randn(3, 301, 512, device="cuda", dtype=torch.bfloat16)
    errors = {}
    for disable in ("", "gemm_sum"):
        m = copy.deepcopy(model)
        jm = thunder.jit(m, executors=[thunder_tk.tk], **({"tk_disable": disable} if disable else {}))
        xj = x.clone().requires_grad_()
        jm(xj).backward(cot)
        names = [b.sym.name for b in thunder.last_backward_traces(jm)[-1].bound_symbols]
        assert names.count("tk_matmul_sum") == (0 if disable else 1), names
        xr = x.double().requires_grad_()
        exact.zero_grad()
        exact(xr).backward(cot.double())
        errors[disable] = [rel_err(xj.grad, xr.grad)] + [rel_err(p.grad, q.grad)
                                                         for p, q in zip(m.parameters(), exact.parameters())]
    assert max(errors[""]) < 2e-2, errors
    assert errors[""][0] <= errors["gemm_sum"][0] * 1.1, errors  # rounded once, not twice
