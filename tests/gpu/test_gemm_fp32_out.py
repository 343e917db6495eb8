"""ops.gemm and ops.gemm_sum writing fp32 (out_dtype=torch.float32, bf16 operands), against a float64 reference:
the result is rounded once from the fp32 accumulators, so its error is fp32 accumulation's (far below a bf16
rounding); tails in M, N and K, one row, every operand major, strided and unaligned outputs (the register path),
a bias, every tile path and schedule that takes fp32 output, poisoned outputs, repeats bit for bit, the knobs that
cannot take it refused by name; and LLaMA's MLP trained under bf16 autocast through Thunder with its weight
gradients and summed input gradient written in fp32 by tk's launches."""

import copy

import pytest
import torch
import thunder

import thunder_tk
from accuracy import operand, rel_err
from models import LlamaMLP
from thunder_tk import ops

pytestmark = pytest.mark.gpu

BF16 = torch.bfloat16
# fp32 accumulation over K of at most 4096: a few 1e-7 relative; a result rounded to bf16 would be ~2e-3.
TOL = 2e-5


def check(a, b, bias=None, second=None, out=None, **knobs):
    M, N = a.shape[0], b.shape[1]
    if out is None:
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.float32)
    else:
        out.fill_(float("nan"))
    if second is None:
        got = ops.gemm(a, b, bias, out=out, out_dtype=torch.float32, **knobs)
    else:
        got = ops.gemm_sum(a, b, *second, bias, out=out, out_dtype=torch.float32, **knobs)
    assert got is out and out.dtype == torch.float32
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    ref = a.double() @ b.double()
    if second is not None:
        ref = ref + second[0].double() @ second[1].double()
    if bias is not None:
        ref = ref + bias.double()
    err = rel_err(out, ref)
    assert err < TOL, err
    return out


# (M, N, K): tails in M and N (not multiples of the 128 x 128/256 tile), ragged last k-blocks, one row, one column
# block, N a multiple of 4 but not 8 (fp32 rows still 16-byte aligned: TMA stores), the step's weight-gradient sizes.
SHAPES = [(1, 8, 64), (17, 44, 24), (129, 264, 72), (300, 500, 1000), (1000, 8, 4096), (777, 1508, 520),
          (2048, 2048, 2048), (2048, 8192, 1024)]


@pytest.mark.parametrize("a_k_major", [True, False])
@pytest.mark.parametrize("b_n_major", [True, False])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matches_float64(M, N, K, a_k_major, b_n_major):
    if (not a_k_major and M % 8) or (b_n_major and N % 8):
        pytest.skip("that layout's leading stride is M or N; the copy path is tested separately")
    check(operand(M, K, a_k_major), operand(K, N, b_n_major))


@pytest.mark.parametrize("knobs", [
    dict(_tile_n=128), dict(_tile_n=256), dict(_epilogue=2), dict(_epilogue=3), dict(_epilogue=3, _tile_n=128),
    dict(_schedule="dynamic"), dict(_stream_k=1), dict(_stream_k=1, _tile_n=128), dict(_group_rows=1),
    dict(_pingpong=-1),
], ids=lambda k: ",".join(f"{n.strip('_')}={v}" for n, v in k.items()))
@pytest.mark.parametrize("a_k_major,b_n_major", [(True, True), (True, False), (False, True), (False, False)])
@pytest.mark.parametrize("M,N,K", [(129, 264, 72), (777, 1504, 520), (4096, 4096, 512)])
def test_every_tile_path(M, N, K, a_k_major, b_n_major, knobs):
    check(operand(M, K, a_k_major), operand(K, N, b_n_major), **knobs)


@pytest.mark.parametrize("knobs", [{}, dict(_tile_n=128), dict(_schedule="dynamic"), dict(_stream_k=1)],
                         ids=["auto", "tile_n=128", "dynamic", "stream_k"])
@pytest.mark.parametrize("M,N,K,K2", [(17, 40, 24, 72), (777, 1504, 520, 1000), (2048, 2048, 1024, 1024)])
def test_summed_products(M, N, K, K2, knobs):
    check(operand(M, K, True), operand(K, N, False), second=(operand(M, K2, True), operand(K2, N, False)), **knobs)


def test_bias_strided_and_unaligned_outputs():
    """A bias (bf16, added in fp32); an output view with a row stride above its width (TMA stores); outputs whose
    rows are off 16 bytes (odd N, odd row stride, an address 4 bytes off) take the register path."""
    M, N, K = 300, 504, 200
    a, b = operand(M, K, True), operand(K, N, False)
    check(a, b, torch.randn(N, device="cuda", dtype=BF16))
    check(a, b, out=torch.empty(M, N + 12, device="cuda")[:, :N])  # row stride N + 12: still 16-byte rows
    check(a, b, out=torch.empty(M, N + 1, device="cuda")[:, :N])  # odd row stride: scalar stores
    check(a, b, out=torch.empty(M * N + 1, device="cuda")[1:].view(M, N))  # 4 bytes off 16
    check(operand(M, K, True), operand(K, 6, True))  # N = 6: rows of 24 bytes


def test_degenerate_sizes_and_repeats():
    a, b = operand(70, 64, True), operand(64, 24, True)
    assert ops.gemm(a[:0], b, out_dtype=torch.float32).shape == (0, 24)
    empty = ops.gemm(operand(70, 0, True), operand(0, 24, True), out_dtype=torch.float32)
    assert empty.dtype == torch.float32 and not empty.any()
    a, b = operand(2048, 1000, True), operand(1000, 2048, False)
    first = ops.gemm(a, b, out_dtype=torch.float32)
    for _ in range(3):
        assert torch.equal(ops.gemm(a, b, out_dtype=torch.float32), first), "not repeatable bit for bit"
    # the same products as the 16-bit output, before its rounding; stored from registers, the same bits
    assert torch.equal(first.to(BF16), ops.gemm(a, b))
    assert torch.equal(ops.gemm(a, b, out_dtype=torch.float32, _epilogue=3), first)


def test_errors_name_the_problem():
    a, b = operand(256, 64, True), operand(64, 256, True)
    with pytest.raises(ValueError, match="float32 with bfloat16 operands"):
        ops.gemm(a.half(), b.half(), out_dtype=torch.float32)
    with pytest.raises(ValueError, match="float32 with bfloat16 operands"):
        ops.gemm(a, b, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="must be a torch.float32"):
        ops.gemm(a, b, out=torch.empty(256, 256, device="cuda", dtype=BF16), out_dtype=torch.float32)
    for knobs in (dict(_cluster=2), dict(_pingpong=1), dict(_epilogue=1)):
        with pytest.raises(ValueError, match="fp32 output runs the consumers' epilogue"):
            ops.gemm(a, b, out_dtype=torch.float32, **knobs)
    with pytest.raises(ValueError, match="skinny GEMM writes C in the operands' dtype"):
        ops.gemm(a[:16], b, out_dtype=torch.float32, _skinny=1)
    small = ops.gemm(a[:16], b, out_dtype=torch.float32)  # few rows: the persistent kernel, not the skinny one
    assert rel_err(small, a[:16].double() @ b.double()) < TOL


def test_mlp_under_autocast_writes_its_gradients_in_fp32(monkeypatch):
    """bf16-mixed through Thunder with tk and THUNDER_TK_GEMM_FP32_OUT=1: fp32 weights, the forward under bf16
    autocast. The three weight gradients come from tk_matmul_fp32 and the input gradient (fc_1's and fc_2's, summed)
    from one tk_matmul_sum_fp32; no cast of a product is left, every gradient is fp32 and at least as close to
    float64 as with `gemm_fp32_out` off."""
    from thunder_tk import claim_rules, pattern_fusion

    monkeypatch.setattr(claim_rules, "gemm_size_policy_default", False)
    monkeypatch.setenv(pattern_fusion.GEMM_FP32_OUT_ENV, "1")  # off by default (slower in the step, see there)
    torch.manual_seed(0)
    model = LlamaMLP(512, 1376).cuda()
    exact = copy.deepcopy(model).double()
    # 912 tokens: the weight gradients' K, a multiple of 8 as tk's GEMM needs (not of the 64-deep k-blocks)
    x = torch.randn(3, 304, 512, device="cuda")
    cot = torch.randn(3, 304, 512, device="cuda", dtype=BF16)
    xr = x.double().requires_grad_()
    exact(xr).backward(cot.double())
    errors = {}
    for disable in ("", "gemm_fp32_out"):
        m = copy.deepcopy(model)
        jm = thunder.jit(m, executors=[thunder_tk.tk], **({"tk_disable": disable} if disable else {}))
        xj = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=BF16):
            out = jm(xj)
        out.backward(cot)
        names = [b.sym.name for b in thunder.last_backward_traces(jm)[-1].bound_symbols]
        if disable:
            assert "tk_matmul_fp32" not in names and "tk_matmul_sum_fp32" not in names, names
        else:
            assert names.count("tk_matmul_fp32") == 3 and names.count("tk_matmul_sum_fp32") == 1, names
        assert xj.grad.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in m.parameters())
        errors[disable] = [rel_err(xj.grad, xr.grad)] + [rel_err(p.grad, q.grad)
                                                         for p, q in zip(m.parameters(), exact.parameters())]
    assert max(errors[""]) < 2e-2, errors
    assert all(w <= o * 1.1 for w, o in zip(errors[""], errors["gemm_fp32_out"])), errors  # rounded once
