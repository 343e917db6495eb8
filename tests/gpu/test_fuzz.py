"""Seeded random ("fuzz") cases for the tk kernels through their public ops, against fp32/float64 references.

Three families, each drawn case by case from a seed (`SEED`, the family's offset and the case index), so a failure
reproduces by its test id alone; every assertion message names the case's parameters. THUNDER_TK_FUZZ_SEED=<int>
draws other cases.

- GEMM (ops.gemm, ops.linear): sizes with tails (M = 1, few rows or columns, just off multiples of 64/128/256), operands
  row- or column-major, sliced out of wider buffers, misaligned or broadcast (both copied or read in place as ops
  decides), a bias (also 2 bytes off), the output NaN-poisoned (also a padded or misaligned view, whose padding must
  stay untouched); both schedules.
- Attention (ops.attention_forward, ops.attention_backward): grouped heads, lengths 1 to 1500 (equal when causal), D 64,
  128 and a few 256, causal or not, default or random scale, q/k/v/grad_o contiguous, LitGPT's (B, S, H, D) views,
  one fused QKV buffer, sequence slices, wide rows, or a layout ops copies.
- Cross-entropy (ops.cross_entropy_forward / _backward / _forward_grad, ops.cross_entropy): 1 to 3000 rows, 1 to 70000
  classes, bf16/fp16/fp32, wide, misaligned, transposed and broadcast logits, ignored rows (default and custom
  ignore_index), targets outside the classes, grad_loss of any stride, every reduction.
- SwiGLU (ops.swiglu_linear, ops.matmul_swiglu_grad): sizes with tails, several tiles a block, x, the weights, a, and
  h1/h2 contiguous, row slices, misaligned or (h) 3-D; proj's weight N- or K-major; both schedules forward, both tile
  modes backward.

A few cases per family are meant to be rejected (K off a multiple of 8, head_dim 96, fp32 attention, int32
targets, ...): ops.check_*_args must reject exactly those, and the ops must then raise a clear error too. A test per
family checks that the generator's cases are mostly accepted, so a generator gone wrong cannot pass by testing only
rejections. The tolerances are those of test_gemm.py, test_attention.py and test_cross_entropy.py.

At the default seed every case passes (H100: about 15 s for the file; the SwiGLU family, added 2026-11-28 without a
GPU, has yet to run). The tests at the end pin down the bugs the
fuzzing found.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from accuracy import rel_err
from fuzzing import pick
from poisoning import poison_allocator
from test_attention import GRAD_TOL, LSE_TOL, O_TOL
from test_cross_entropy import GRAD_TOL as CE_GRAD_TOL
from test_cross_entropy import ROW_TOL, reference_grad
from test_gemm import TOL as GEMM_TOL
from test_swiglu import TOL as SWIGLU_TOL
from test_swiglu import grad_reference as swiglu_grad_reference
from thunder_tk import ops

pytestmark = pytest.mark.gpu

SEED = int(os.environ.get("THUNDER_TK_FUZZ_SEED", "20261201"))
GEMM_CASES = 80
ATTENTION_CASES = 80
CROSS_ENTROPY_CASES = 80
SWIGLU_CASES = 60
HALF = (torch.bfloat16, torch.float16)


# ------------------------------------------------------------------------------------------------
# Shared helpers


def edge_size(rng: random.Random, hi: int) -> int:
    """A size in [1, hi], biased to where kernels tile: 1, a few, just off multiples of 64, 128 and 256."""
    r = rng.random()
    if r < 0.1:
        return 1
    if r < 0.25:
        return rng.randint(2, min(hi, 70))
    if r < 0.6:
        tile = rng.choice((64, 128, 256))
        n = tile * rng.randint(1, max(1, hi // tile)) + rng.choice((-1, 1, -7, 9, tile // 2 + 1, -(tile // 2) - 3))
        return max(1, min(hi, n))
    return rng.randint(1, hi)


def case_seed(family: int, index: int) -> int:
    """The seed of case `index` of a family: distinct for every (THUNDER_TK_FUZZ_SEED, family, index)."""
    return (SEED * 1_000_003 + family * 10_007 + index) % 2**62


def meant_invalid(rng: random.Random, index: int, kinds) -> str | None:
    """What makes the case one to be rejected (None: a valid case): one case in 20, and 1 in 20 of the others."""
    wanted = rng.random() < 0.05 or index % 20 == 3
    kind = rng.choice(kinds)
    return kind if wanted else None


def describe(case) -> str:
    fields = ", ".join(f"{k}={v}" for k, v in vars(case).items() if k != "index")
    return f"[case {case.index}, THUNDER_TK_FUZZ_SEED={SEED}] {fields}"


class Maker:
    """Random (or, for the generator's bookkeeping, empty) CUDA tensors from one seeded generator."""

    def __init__(self, seed: int, dtype: torch.dtype, empty: bool = False):
        self.gen = torch.Generator(device="cuda").manual_seed(seed)
        self.dtype, self.empty = dtype, empty

    def randn(self, *shape, dtype=None, scale: float = 1.0) -> torch.Tensor:
        dtype = dtype or self.dtype
        if self.empty:
            return torch.empty(shape, device="cuda", dtype=dtype)
        return (torch.randn(shape, device="cuda", generator=self.gen) * scale).to(dtype)

    def randint(self, hi: int, shape) -> torch.Tensor:
        if self.empty:
            return torch.zeros(shape, device="cuda", dtype=torch.int64)
        return torch.randint(0, hi, shape, device="cuda", generator=self.gen)


def raised(fn) -> BaseException | None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - which one it is, is what the caller judges
        return e
    return None


def check_rejection(case, check, *calls):
    """A case meant to be rejected: `check` (ops.check_*_args) raises a clear error, and so does every op call."""
    error = raised(check)
    assert error is not None, f"the check accepts a case meant to be rejected ({case.invalid}): {describe(case)}"
    assert isinstance(error, (ValueError, TypeError, RuntimeError)) and str(error).strip(), \
        f"unclear {type(error).__name__}: {error!r}: {describe(case)}"
    for call in calls:
        got = raised(call)
        assert got is not None, f"the op runs a case its check rejects ({error}): {describe(case)}"
        assert isinstance(got, (ValueError, TypeError, RuntimeError)) and str(got).strip(), \
            f"the op raises an unclear {type(got).__name__}: {got!r}: {describe(case)}"


def check_acceptance(case, check):
    error = raised(check)
    assert error is None, f"the check rejects a case meant to be valid: {type(error).__name__}: {error}: " \
                          f"{describe(case)}"


def assert_mostly_accepted(cases, check_of):
    """The generator's intent (case.invalid) and the ops check agree on every case, and most cases are accepted."""
    accepted = 0
    for case in cases:
        error = raised(lambda: check_of(case))
        assert (error is None) == (case.invalid is None), \
            f"meant {'valid' if case.invalid is None else 'invalid: ' + case.invalid}, check: {error!r}: {describe(case)}"
        accepted += error is None
        torch.cuda.empty_cache()
    rejected = len(cases) - accepted
    assert accepted >= 0.8 * len(cases), f"only {accepted} of {len(cases)} cases accepted"
    assert rejected >= 1, "no case is meant to be rejected: the rejection path goes untested"


# ------------------------------------------------------------------------------------------------
# GEMM: ops.gemm (a (M, K) @ b (K, N) + bias) and ops.linear (x (..., K) @ weight (N, K)^T + bias)



@dataclass
class GemmCase:
    index: int
    seed: int
    api: str  # "gemm" or "linear"
    M: int
    N: int
    K: int
    lead: tuple  # linear: x's leading dims (their product is M)
    dtype: torch.dtype
    a_layout: str
    b_layout: str
    pad: int  # extra elements of a sliced operand's leading dim (a multiple of 8)
    bias: str  # "none", "contiguous", "offset" (2 bytes into a buffer)
    out: str  # gemm: "fresh", "padded" (row stride N + out_pad), "misaligned"; linear: "returned"
    out_pad: int
    schedule: str | None
    invalid: str | None


GEMM_A_LAYOUTS = [(0.3, "row"), (0.2, "col"), (0.2, "row_slice"), (0.15, "col_slice"), (0.08, "misaligned"),
                  (0.07, "broadcast")]
GEMM_B_LAYOUTS = GEMM_A_LAYOUTS
LINEAR_X_LAYOUTS = [(0.5, "row"), (0.35, "row_slice"), (0.15, "misaligned")]
LINEAR_W_LAYOUTS = [(0.45, "row"), (0.25, "row_slice"), (0.2, "col"), (0.1, "misaligned")]


def gemm_case(index: int) -> GemmCase:
    seed = case_seed(1, index)
    rng = random.Random(seed)
    shape = pick(rng, [(0.45, "any"), (0.2, "few_rows"), (0.15, "few_cols"), (0.2, "tall")])
    M = {"few_rows": rng.randint(1, 64), "tall": rng.randint(1500, 3000)}.get(shape, edge_size(rng, 3000))
    N = {"few_cols": rng.randint(1, 16), "tall": rng.randint(1, 64)}.get(shape, edge_size(rng, 3000))
    K = pick(rng, [(0.25, 8 * rng.randint(1, 16)), (0.25, 64 * rng.randint(1, 64) + rng.choice((-8, 8))),
                   (0.5, 8 * rng.randint(1, 512))])
    K = min(max(K, 8), 4096)
    api = "linear" if rng.random() < 0.3 else "gemm"
    lead = (M,)
    if api == "linear":
        lead = rng.choice(((M,), (1, M), (2, M // 2) if M % 2 == 0 else (M,), (3, M // 3) if M % 3 == 0 else (M,)))
        a_layout, b_layout = pick(rng, LINEAR_X_LAYOUTS), pick(rng, LINEAR_W_LAYOUTS)
    else:
        a_layout, b_layout = pick(rng, GEMM_A_LAYOUTS), pick(rng, GEMM_B_LAYOUTS)
    invalid = meant_invalid(rng, index, ("k_not_multiple_of_8", "float32", "mixed_dtypes", "bias_length", "bias_dtype"))
    bias = pick(rng, [(0.5, "none"), (0.35, "contiguous"), (0.15, "offset")])
    if invalid in ("bias_length", "bias_dtype"):
        bias = "contiguous"
    if invalid == "k_not_multiple_of_8":
        K += rng.randint(1, 7)
    out = "returned" if api == "linear" else pick(rng, [(0.7, "fresh"), (0.2, "padded"), (0.1, "misaligned")])
    return GemmCase(index, seed, api, M, N, K, lead, rng.choice(HALF), a_layout, b_layout, 8 * rng.randint(1, 4),
                    bias, out, rng.randint(1, 24), rng.choice((None, None, "dynamic")), invalid)


def gemm_operand(make: Maker, rows: int, cols: int, layout: str, pad: int) -> torch.Tensor:
    """A (rows, cols) operand: "row" unit stride along cols, "col" along rows (a transposed view), "*_slice" that
    sliced out of a buffer `pad` wider (8 elements in, the leading stride kept a multiple of 8), "misaligned" a
    contiguous view 2 bytes into its buffer, "broadcast" one row expanded (stride 0)."""
    if layout == "row":
        return make.randn(rows, cols)
    if layout == "col":
        return make.randn(cols, rows).t()
    if layout == "row_slice":
        return make.randn(rows, cols + pad + (-cols) % 8)[:, 8:8 + cols]
    if layout == "col_slice":
        return make.randn(cols, rows + pad + (-rows) % 8)[:, 8:8 + rows].t()
    if layout == "misaligned":
        return make.randn(1 + rows * cols)[1:].view(rows, cols)
    if layout == "broadcast":
        return make.randn(1, cols).expand(rows, cols)
    raise AssertionError(layout)


def gemm_tensors(case: GemmCase, empty: bool = False):
    """(x or a, weight or b, bias) as the case describes them."""
    make = Maker(case.seed, case.dtype, empty)
    M, N, K = case.M, case.N, case.K
    if case.api == "linear":
        if case.a_layout == "row":
            x = make.randn(*case.lead, K)
        elif case.a_layout == "row_slice":
            x = make.randn(*case.lead, K + case.pad)[..., 8:8 + K]
        else:
            x = make.randn(1 + M * K)[1:].view(*case.lead, K)
        w = gemm_operand(make, N, K, case.b_layout, case.pad)
        first, second = x, w
    else:
        first = gemm_operand(make, M, K, case.a_layout, case.pad)
        second = gemm_operand(make, K, N, case.b_layout, case.pad)
    if case.invalid == "float32":
        first, second = first.float(), second.float()
    elif case.invalid == "mixed_dtypes":
        second = second.to(torch.float16 if case.dtype == torch.bfloat16 else torch.bfloat16)
    bias = None
    if case.bias != "none":
        n = N + (1 if case.invalid == "bias_length" else 0)
        dtype = torch.float32 if case.invalid == "bias_dtype" else case.dtype
        bias = make.randn(n, dtype=dtype) if case.bias == "contiguous" else make.randn(n + 1, dtype=dtype)[1:]
    return first, second, bias


def gemm_check_of(case: GemmCase):
    first, second, bias = gemm_tensors(case, empty=True)
    if case.api == "linear":
        ops.check_gemm_args(first.reshape(-1, case.K), second.t(), bias)
    else:
        ops.check_gemm_args(first, second, bias)


def gemm_output(case: GemmCase):
    """(out, its buffer, the buffer's cells outside out) for ops.gemm's out=: NaN inside, 7 outside."""
    M, N = case.M, case.N
    if case.out == "fresh":
        buffer = torch.full((M, N), float("nan"), device="cuda", dtype=case.dtype)
        return buffer, buffer, torch.zeros_like(buffer, dtype=torch.bool)
    if case.out == "padded":
        buffer = torch.full((M, N + case.out_pad), 7.0, device="cuda", dtype=case.dtype)
        out = buffer[:, :N]
    else:  # misaligned: 2 bytes into its buffer, rows packed
        buffer = torch.full((1 + M * N + 7,), 7.0, device="cuda", dtype=case.dtype)
        out = buffer[1:1 + M * N].view(M, N)
    out.fill_(float("nan"))
    outside = torch.ones_like(buffer, dtype=torch.bool)
    (outside[:, :N] if case.out == "padded" else outside[1:1 + M * N]).fill_(False)
    return out, buffer, outside


@pytest.mark.parametrize("index", range(GEMM_CASES))
def test_gemm_fuzz(index):
    case = gemm_case(index)
    first, second, bias = gemm_tensors(case)
    if case.api == "linear":
        check = lambda: ops.check_gemm_args(first.reshape(-1, case.K), second.t(), bias)  # noqa: E731
    else:
        check = lambda: ops.check_gemm_args(first, second, bias)  # noqa: E731
    if case.invalid:
        call = (lambda: ops.linear(first, second, bias)) if case.api == "linear" else \
            (lambda: ops.gemm(first, second, bias))
        check_rejection(case, check, call)
        return
    check_acceptance(case, check)
    if case.api == "linear":
        poison_allocator(((case.M, case.N), case.dtype))
        out = ops.linear(first, second, bias)
        assert out.shape == (*case.lead, case.N) and out.dtype == case.dtype, f"{out.shape}: {describe(case)}"
        ref = F.linear(first.float(), second.float(), None if bias is None else bias.float())
    else:
        out, buffer, outside = gemm_output(case)
        before = buffer[outside].clone()
        got = ops.gemm(first, second, bias, out=out, _schedule=case.schedule)
        assert got.data_ptr() == out.data_ptr(), f"the result is not out=: {describe(case)}"
        assert torch.equal(buffer[outside], before), f"written outside out=: {describe(case)}"
        ref = first.float() @ second.float()
        if bias is not None:
            ref = ref + bias.float()
    assert torch.isfinite(out).all(), \
        f"{int((~torch.isfinite(out)).sum())} unwritten (NaN) or non-finite outputs: {describe(case)}"
    err = rel_err(out, ref)
    assert err < GEMM_TOL[case.dtype], f"relative error {err:.3g}: {describe(case)}"


def test_gemm_generator_mostly_accepted():
    assert_mostly_accepted([gemm_case(i) for i in range(GEMM_CASES)], gemm_check_of)


# ------------------------------------------------------------------------------------------------
# Attention: ops.attention_forward and ops.attention_backward against ops' float64 references

ATTENTION_BUDGET = 2e7  # B * Hq * Sq * Sk: the float64 references' score matrices stay near 160 MB


@dataclass
class AttentionCase:
    index: int
    seed: int
    B: int
    Hkv: int
    group: int
    Sq: int
    Sk: int
    D: int
    dtype: torch.dtype
    causal: bool
    scale: float | None
    layouts: tuple  # q, k, v: each "contiguous", "bshd", "seq_slice", "wide_rows", "copied"; or all "fused"
    grad_layout: str  # "like_o" (o's (B, S, H, D) storage), "contiguous", "copied"
    invalid: str | None

    @property
    def Hq(self) -> int:
        return self.Hkv * self.group + (1 if self.invalid == "heads" else 0)


ATTENTION_LAYOUTS = [(0.3, "contiguous"), (0.35, "bshd"), (0.12, "seq_slice"), (0.12, "wide_rows"), (0.11, "copied")]


def attention_case(index: int) -> AttentionCase:
    seed = case_seed(2, index)
    rng = random.Random(seed)
    B, Hkv, group = rng.randint(1, 4), rng.randint(1, 4), rng.choice((1, 2, 4, 8))
    D = 256 if rng.random() < 0.12 else rng.choice((64, 128))
    causal = rng.random() < 0.45
    Sq = edge_size(rng, 1500)
    Sk = Sq if causal or rng.random() < 0.25 else edge_size(rng, 1500)
    while B * Hkv * group * Sq * Sk > ATTENTION_BUDGET:
        if B > 1:
            B -= 1
        elif Hkv > 1:
            Hkv -= 1
        elif group > 1:
            group //= 2
        elif causal:
            Sq = Sk = max(1, int(Sq * 0.8))
        elif Sq >= Sk:
            Sq = max(1, int(Sq * 0.8))
        else:
            Sk = max(1, int(Sk * 0.8))
    scale = None if rng.random() < 0.5 else D ** -0.5 * math.exp(rng.uniform(math.log(0.2), math.log(4.0)))
    invalid = meant_invalid(rng, index, ("head_dim", "float32", "heads", "causal_lengths", "scale", "batch",
                                         "kv_shapes"))
    if invalid:  # small: only the errors matter
        Sq, Sk = min(Sq, 64), min(Sk, 64)
        if invalid == "head_dim":
            D = rng.choice((32, 80, 96, 160))
        elif invalid == "heads":
            Hkv = max(Hkv, 2)
        elif invalid == "causal_lengths":
            causal, Sk = True, Sq + rng.randint(1, 20)
        elif invalid == "scale":
            scale = rng.choice((float("inf"), float("-inf"), float("nan")))
    if Sq == Sk and rng.random() < 0.12:
        layouts = ("fused",) * 3
    else:
        layouts = tuple(pick(rng, ATTENTION_LAYOUTS) for _ in range(3))
    grad_layout = pick(rng, [(0.6, "like_o"), (0.3, "contiguous"), (0.1, "copied")])
    return AttentionCase(index, seed, B, Hkv, group, Sq, Sk, D, rng.choice(HALF), causal, scale, layouts, grad_layout,
                         invalid)


def attention_view(make: Maker, layout: str, B: int, H: int, S: int, D: int) -> torch.Tensor:
    """(B, H, S, D) in a layout: contiguous; "bshd" LitGPT's (B, S, H, D) storage seen as (B, H, S, D); "seq_slice"
    3 positions into a longer sequence; "wide_rows" the second half of rows 2 D long; "copied" with D not the
    innermost dim (ops copies it)."""
    if layout == "contiguous":
        return make.randn(B, H, S, D)
    if layout == "bshd":
        return make.randn(B, S, H, D).transpose(1, 2)
    if layout == "seq_slice":
        return make.randn(B, H, S + 11, D)[:, :, 3:3 + S]
    if layout == "wide_rows":
        return make.randn(B, H, S, 2 * D)[..., D:]
    if layout == "copied":
        return make.randn(B, H, D, S).transpose(-1, -2)
    raise AssertionError(layout)


def attention_tensors(case: AttentionCase, empty: bool = False):
    make = Maker(case.seed, torch.float32 if case.invalid == "float32" else case.dtype, empty)
    B, Hq, Hkv, Sq, Sk, D = case.B, case.Hq, case.Hkv, case.Sq, case.Sk, case.D
    if case.layouts[0] == "fused":  # one (B, S, Hq + 2 Hkv, D) projection output, split by heads
        qkv = make.randn(B, Sq, Hq + 2 * Hkv, D).transpose(1, 2)
        q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    else:
        q = attention_view(make, case.layouts[0], B, Hq, Sq, D)
        k = attention_view(make, case.layouts[1], B, Hkv, Sk, D)
        v = attention_view(make, case.layouts[2], B, Hkv, Sk, D)
    if case.invalid == "batch":
        k, v = (make.randn(B + 1, Hkv, Sk, D) for _ in "kv")
    elif case.invalid == "kv_shapes":
        v = make.randn(B, Hkv, Sk + 1, D)
    return q, k, v


def attention_grad(make: Maker, case: AttentionCase) -> torch.Tensor:
    """grad_o: laid out like o ((B, S, H, D) storage, what LitGPT's backward hands over), contiguous, or copied."""
    if case.grad_layout == "like_o":
        return make.randn(case.B, case.Sq, case.Hq, case.D).transpose(1, 2)
    return attention_view(make, case.grad_layout, case.B, case.Hq, case.Sq, case.D)


def uncancelled_norms(q, k, v, g, causal, scale) -> tuple[float, float]:
    """Norms (float64) of what dq and dk would be without the softmax's cancellation, scale (P o dP) K and
    scale (P o dP)^T Q (dk summed over each group): the size their terms have. Where one key is visible (Sk = 1) dq
    and dk are 0 in exact math, the kernel's rounding of dP - delta leaves noise of about 1e-6 of this, and their
    error is taken relative to 1e-3 of it instead of to a reference norm of 0."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    scale = D ** -0.5 if scale is None else scale
    k64, v64 = (t.double().repeat_interleave(Hq // Hkv, dim=1) for t in (k, v))
    s = (q.double() @ k64.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(Sq, Sk, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    pdp = torch.softmax(s, dim=-1) * (g.double() @ v64.transpose(-1, -2))
    dq = (pdp @ k64) * scale
    dk = ((pdp.transpose(-1, -2) @ q.double()) * scale).view(B, Hkv, Hq // Hkv, Sk, D).sum(2)
    return dq.norm().item(), dk.norm().item()


def check_attention_grads(grads, refs, inputs, g, causal, scale, context: str) -> None:
    """dq, dk, dv against the reference: each in its input's shape and dtype, written in full and finite, and within
    GRAD_TOL by relative error with test_attention.py's floor, 1e-3 sqrt(numel), or 1e-3 of the terms' size
    (uncancelled_norms)."""
    q, k, v = inputs
    uncancelled = (*uncancelled_norms(q, k, v, g, causal, scale), 0.0)
    for name, got, ref, like, size in zip(("dq", "dk", "dv"), grads, refs, inputs, uncancelled):
        assert got.shape == like.shape and got.dtype == like.dtype, f"{name} {got.shape} {got.dtype}: {context}"
        assert torch.isfinite(got).all(), \
            f"{name} has unwritten (NaN) or non-finite rows {(~torch.isfinite(got).all(-1)).nonzero().tolist()}: {context}"
        err = rel_err(got, ref, floor=1e-3 * max(got.numel() ** 0.5, size))
        assert err < GRAD_TOL[like.dtype], f"{name} relative error {err:.3g}: {context}"


def attention_check_of(case: AttentionCase):
    q, k, v = attention_tensors(case, empty=True)
    ops.check_attention_args(q, k, v, case.causal, case.scale)


@pytest.mark.parametrize("index", range(ATTENTION_CASES))
def test_attention_fuzz(index):
    case = attention_case(index)
    q, k, v = attention_tensors(case)
    check = lambda: ops.check_attention_args(q, k, v, case.causal, case.scale)  # noqa: E731
    B, Hq, Sq, D = q.shape
    if case.invalid:
        o = torch.zeros(q.shape, device="cuda", dtype=q.dtype)
        lse = torch.zeros(q.shape[:3], device="cuda")
        check_rejection(case, check,
                        lambda: ops.attention_forward(q, k, v, is_causal=case.causal, scale=case.scale),
                        lambda: ops.attention_backward(q, k, v, o, lse, o, is_causal=case.causal, scale=case.scale))
        return
    check_acceptance(case, check)
    before = [t.clone() for t in (q, k, v)]

    poison_allocator(((B, Sq, Hq, D), q.dtype), ((B, Hq, Sq + 3), torch.float32))
    o, lse = ops.attention_forward(q, k, v, is_causal=case.causal, scale=case.scale)
    assert o.shape == q.shape and o.dtype == q.dtype and lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32, \
        f"o {o.shape} {o.dtype}, lse {lse.shape} {lse.dtype}: {describe(case)}"
    assert torch.isfinite(o).all(), f"o has unwritten (NaN) or non-finite elements: {describe(case)}"
    assert torch.isfinite(lse).all(), f"lse has unwritten (NaN) or non-finite elements: {describe(case)}"
    ref_o, ref_lse = ops.attention_forward_reference(q, k, v, is_causal=case.causal, scale=case.scale)
    err = rel_err(o, ref_o)
    assert err < O_TOL[case.dtype], f"o relative error {err:.3g}: {describe(case)}"
    lse_err = (lse.double() - ref_lse).abs().max().item()
    lse_tol = LSE_TOL + 1e-5 * ref_lse.abs().max().item()
    assert lse_err < lse_tol, f"lse error {lse_err:.3g} (tolerance {lse_tol:.3g}): {describe(case)}"
    del ref_o, ref_lse

    g = attention_grad(Maker(case.seed + 1, case.dtype), case)
    poison_allocator((tuple(q.shape), q.dtype), (tuple(k.shape), k.dtype))
    grads = ops.attention_backward(q, k, v, o, lse, g, is_causal=case.causal, scale=case.scale)
    refs = ops.attention_backward_reference(q, k, v, o, lse, g, is_causal=case.causal, scale=case.scale)
    check_attention_grads(grads, refs, (q, k, v), g, case.causal, case.scale, describe(case))
    assert all(torch.equal(t, b) for t, b in zip((q, k, v), before)), f"the inputs were written to: {describe(case)}"


def test_attention_generator_mostly_accepted():
    assert_mostly_accepted([attention_case(i) for i in range(ATTENTION_CASES)], attention_check_of)


# ------------------------------------------------------------------------------------------------
# Cross-entropy: ops.cross_entropy_forward / _backward / _forward_grad and ops.cross_entropy against float64

REDUCED_TOL = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}  # ops.cross_entropy, rtol and atol
CE_BUDGET = 16_000_000  # rows * classes


@dataclass
class CrossEntropyCase:
    index: int
    seed: int
    rows: int
    classes: int
    dtype: torch.dtype
    logit_scale: float
    layout: str  # "contiguous", "wide" (row stride classes + pad), "misaligned", "transposed", "broadcast"
    pad: int
    ignore_index: int
    ignored: float  # fraction of rows set to ignore_index
    out_of_range: bool  # one or two targets outside [0, classes) (NaN loss)
    grad_loss: str  # "per_row", "scalar" (an expanded mean gradient, stride 0), "strided"
    reduction: str
    forward_grad: str  # "no", "yes", "overwrite"
    invalid: str | None


def cross_entropy_case(index: int) -> CrossEntropyCase:
    seed = case_seed(3, index)
    rng = random.Random(seed)
    classes = pick(rng, [(0.15, rng.choice((1, 2, 3, 7, 8, 9, 15, 16, 17))),
                         (0.25, rng.choice((1000, 4097, 32000, 50257, 65535, 65536, 65537, 69999, 70000))),
                         (0.6, edge_size(rng, 70000))])
    rows = max(1, min(edge_size(rng, 3000), CE_BUDGET // classes))
    ignore_index = pick(rng, [(0.6, -100), (0.2, -1), (0.2, rng.randrange(classes))])
    invalid = meant_invalid(rng, index, ("int32_target", "float64", "three_dims", "target_rows", "no_classes"))
    layout = pick(rng, [(0.55, "contiguous"), (0.2, "wide"), (0.1, "misaligned"), (0.1, "transposed"),
                        (0.05, "broadcast")])
    forward_grad = pick(rng, [(0.65, "no"), (0.25, "yes"), (0.1, "overwrite")])
    return CrossEntropyCase(
        index, seed, rows, classes, rng.choice(HALF + (torch.float32,)), rng.choice((1.0, 4.0, 10.0)), layout,
        rng.randint(1, 40), ignore_index, pick(rng, [(0.4, 0.0), (0.3, 0.1), (0.2, 0.5), (0.1, 1.0)]),
        rng.random() < 0.12, pick(rng, [(0.5, "per_row"), (0.3, "scalar"), (0.2, "strided")]),
        rng.choice(ops.CROSS_ENTROPY_REDUCTIONS), "no" if layout == "broadcast" and forward_grad == "overwrite"
        else forward_grad, invalid)


def cross_entropy_tensors(case: CrossEntropyCase, empty: bool = False):
    """(logits, target, grad_loss) as the case describes them."""
    make = Maker(case.seed, case.dtype, empty)
    rows, classes, s = case.rows, case.classes, case.logit_scale
    if case.layout == "contiguous":
        logits = make.randn(rows, classes, scale=s)
    elif case.layout == "wide":
        logits = make.randn(rows, classes + case.pad, scale=s)[:, :classes]
    elif case.layout == "misaligned":
        logits = make.randn(1 + rows * classes, scale=s)[1:].view(rows, classes)
    elif case.layout == "transposed":
        logits = make.randn(classes, rows, scale=s).t()
    else:
        logits = make.randn(1, classes, scale=s).expand(rows, classes)
    target = make.randint(classes, (rows,))
    if not empty:
        g = random.Random(case.seed)
        ignored = [r for r in range(rows) if g.random() < case.ignored]
        target[ignored] = case.ignore_index
        if case.out_of_range:
            for r in g.sample(range(rows), min(rows, 2)):
                target[r] = g.choice([x for x in (classes, classes + 5, -5, 10**12) if x != case.ignore_index])
    if case.grad_loss == "per_row":
        grad_loss = make.randn(rows, dtype=torch.float32)
    elif case.grad_loss == "scalar":
        grad_loss = torch.full((), 0.37, device="cuda").expand(rows)
    else:
        grad_loss = make.randn(2 * rows, dtype=torch.float32)[::2]
    if case.invalid == "int32_target":
        target = target.int()
    elif case.invalid == "float64":
        logits = logits.double()
    elif case.invalid == "three_dims":
        logits = logits.unsqueeze(-1)
    elif case.invalid == "target_rows":
        target = torch.cat([target, target[:1]])
    elif case.invalid == "no_classes":
        logits = logits[:, :0]
    return logits, target, grad_loss


def cross_entropy_check_of(case: CrossEntropyCase):
    logits, target, _ = cross_entropy_tensors(case, empty=True)
    ops.check_cross_entropy_args(logits, target)


def check_rows(case, loss, lse, ref_loss, ref_lse, bad, ignored, what):
    assert loss.shape == lse.shape == (case.rows,) and loss.dtype == lse.dtype == torch.float32, \
        f"{what}: loss {loss.shape} {loss.dtype}, lse {lse.shape}: {describe(case)}"
    assert torch.isfinite(lse).all(), f"{what}: lse has unwritten (NaN) or non-finite rows: {describe(case)}"
    assert torch.isnan(loss[bad]).all(), f"{what}: a target outside the classes must give NaN: {describe(case)}"
    assert torch.isfinite(loss[~bad]).all(), f"{what}: loss has unwritten or non-finite rows: {describe(case)}"
    assert (loss[ignored] == 0).all(), f"{what}: an ignored row's loss must be 0: {describe(case)}"
    scale = 1 + ref_lse.abs()
    lse_err = ((lse.double() - ref_lse).abs() / scale).max().item()
    loss_err = ((loss.double() - ref_loss).abs() / scale)[~bad].max().item() if (~bad).any() else 0.0
    assert lse_err < ROW_TOL and loss_err < ROW_TOL, f"{what}: lse error {lse_err:.3g}, loss error {loss_err:.3g}: " \
                                                     f"{describe(case)}"


def check_grad(case, grad, logits, target, grad_loss, bad, ignored, what):
    assert grad.shape == logits.shape and grad.dtype == logits.dtype, f"{what}: {grad.shape} {grad.dtype}: " \
                                                                       f"{describe(case)}"
    assert torch.isfinite(grad[~bad]).all(), f"{what}: unwritten (NaN) or non-finite gradient: {describe(case)}"
    assert (grad[ignored] == 0).all(), f"{what}: an ignored row's gradient must be zero: {describe(case)}"
    keep = ~bad  # the gradient of a row whose target is outside the classes is not specified
    if case.classes == 1:  # softmax 1, one-hot 1: exactly 0, no relative error to take
        bound = 1e-6 * grad_loss.double().abs().unsqueeze(1)
        assert (grad[keep].double().abs() <= bound[keep]).all(), f"{what}: one class, gradient {grad}: " \
                                                                 f"{describe(case)}"
        return
    ref = reference_grad(logits, target, grad_loss, case.ignore_index)
    err = rel_err(grad[keep], ref[keep])
    assert err < CE_GRAD_TOL[case.dtype], f"{what}: gradient relative error {err:.3g}: {describe(case)}"


@pytest.mark.parametrize("index", range(CROSS_ENTROPY_CASES))
def test_cross_entropy_fuzz(index):
    case = cross_entropy_case(index)
    logits, target, grad_loss = cross_entropy_tensors(case)
    check = lambda: ops.check_cross_entropy_args(logits, target)  # noqa: E731
    if case.invalid:
        lse = torch.zeros(logits.shape[0], device="cuda")
        check_rejection(case, check,
                        lambda: ops.cross_entropy_forward(logits, target, case.ignore_index),
                        lambda: ops.cross_entropy_backward(logits, target, lse, lse, case.ignore_index),
                        lambda: ops.cross_entropy(logits, target, ignore_index=case.ignore_index))
        return
    check_acceptance(case, check)
    ignored = target == case.ignore_index
    bad = ~ignored & ((target < 0) | (target >= case.classes))
    ref_loss, ref_lse = ops.cross_entropy_reference(logits, target, case.ignore_index)
    before = logits.clone()

    poison_allocator(((case.rows,), torch.float32))
    loss, lse = ops.cross_entropy_forward(logits, target, case.ignore_index)
    check_rows(case, loss, lse, ref_loss, ref_lse, bad, ignored, "forward")
    poison_allocator((tuple(logits.shape), logits.dtype))
    grad = ops.cross_entropy_backward(logits, target, lse, grad_loss, case.ignore_index)
    assert grad.is_contiguous(), f"backward: the gradient is not contiguous: {describe(case)}"
    check_grad(case, grad, logits, target, grad_loss, bad, ignored, "backward")

    if case.forward_grad != "no":
        ones = torch.ones(case.rows, device="cuda")
        if case.forward_grad == "overwrite":  # written over a copy of the logits with padded rows; padding kept
            store = torch.full((case.rows, case.classes + case.pad), 7.0, device="cuda", dtype=case.dtype)
            work = store[:, :case.classes]
            work.copy_(logits)
            loss2, lse2, grad2 = ops.cross_entropy_forward_grad(work, target, case.ignore_index, overwrite=True)
            assert grad2.data_ptr() == work.data_ptr(), f"overwrite: not written over the logits: {describe(case)}"
            assert (store[:, case.classes:] == 7).all(), f"overwrite: padding written: {describe(case)}"
        else:
            poison_allocator((tuple(logits.shape), logits.dtype))
            loss2, lse2, grad2 = ops.cross_entropy_forward_grad(logits, target, case.ignore_index)
        check_rows(case, loss2, lse2, ref_loss, ref_lse, bad, ignored, f"forward_grad ({case.forward_grad})")
        check_grad(case, grad2, logits, target, ones, bad, ignored, f"forward_grad ({case.forward_grad})")

    if not bad.any():  # PyTorch asserts on targets outside the classes
        out = ops.cross_entropy(logits, target, ignore_index=case.ignore_index, reduction=case.reduction)
        ref = F.cross_entropy(logits.double(), target, ignore_index=case.ignore_index, reduction=case.reduction)
        assert out.dtype == case.dtype and out.shape == ref.shape, f"{out.dtype} {out.shape}: {describe(case)}"
        fits = ref.abs() < 0.99 * torch.finfo(case.dtype).max  # a sum past fp16's range is inf either way
        tol = REDUCED_TOL[case.dtype]
        torch.testing.assert_close(out.double()[fits], ref.to(case.dtype).double()[fits], rtol=tol, atol=tol,
                                   equal_nan=True, msg=lambda m: f"ops.cross_entropy: {m}: {describe(case)}")
    assert torch.equal(logits, before), f"the logits were written to: {describe(case)}"


def test_cross_entropy_generator_mostly_accepted():
    assert_mostly_accepted([cross_entropy_case(i) for i in range(CROSS_ENTROPY_CASES)], cross_entropy_check_of)


# ------------------------------------------------------------------------------------------------
# SwiGLU: ops.swiglu_linear (g, h1, h2 from x (..., K) and two (N, K) weights) and ops.matmul_swiglu_grad (dh1, dh2
# from a (M, K), proj's weight b (K, N) and h1, h2 (..., N)), against float64 references


@dataclass
class SwigluCase:
    index: int
    seed: int
    api: str  # "forward" or "backward"
    M: int
    N: int
    K: int
    lead: tuple  # x's (forward) or h1/h2's (backward) leading dims (their product is M)
    dtype: torch.dtype
    x_layout: str  # x (forward) or a (backward): "row", "row_slice", "misaligned"
    w_layout: str  # forward: the weights as x; backward: b "n_major" (as the trace reads proj's) or "k_major"
    h_layout: str  # backward: h1 and h2 "row", "row_slice" (columns of wider rows), "misaligned"
    variant: int  # forward: 1 the dynamic schedule; backward: the tile mode (_pingpong 0 in turns, -1 shared)
    invalid: str | None


def swiglu_case(index: int) -> SwigluCase:
    seed = case_seed(4, index)
    rng = random.Random(seed)
    api = rng.choice(("forward", "backward"))
    M = edge_size(rng, 2500)
    N = pick(rng, [(0.3, 8 * rng.randint(1, 16)), (0.7, 8 * max(1, round(edge_size(rng, 2100) / 8)))])
    K = pick(rng, [(0.3, 8 * rng.randint(1, 16)), (0.3, 64 * rng.randint(1, 24) + rng.choice((-8, 8))),
                   (0.4, 8 * rng.randint(1, 256))])
    K = min(max(K, 8), 2048)
    lead = rng.choice(((M,), (1, M), (2, M // 2) if M % 2 == 0 else (M,), (3, M // 3) if M % 3 == 0 else (M,)))
    layouts = [(0.5, "row"), (0.3, "row_slice"), (0.2, "misaligned")]
    x_layout = pick(rng, layouts)
    w_layout = pick(rng, layouts) if api == "forward" else pick(rng, [(0.7, "n_major"), (0.3, "k_major")])
    h_layout = pick(rng, layouts)
    variant = rng.choice((0, 1)) if api == "forward" else rng.choice((0, -1))
    invalid = meant_invalid(rng, index, ("k_not_multiple_of_8", "n_not_multiple_of_8", "float32", "shapes_differ"))
    if invalid == "k_not_multiple_of_8":
        K += rng.randint(1, 7)
    if invalid == "n_not_multiple_of_8":
        N += rng.randint(1, 7)
    return SwigluCase(index, seed, api, M, N, K, lead, rng.choice(HALF), x_layout, w_layout, h_layout, variant,
                      invalid)


def swiglu_rows(make: Maker, rows: int, cols: int, layout: str) -> torch.Tensor:
    """A (rows, cols) operand with unit column stride: contiguous, a slice of wider rows, or 2 bytes off."""
    if layout == "row":
        return make.randn(rows, cols)
    if layout == "row_slice":
        return make.randn(rows, cols + 24)[:, 8:8 + cols]
    if layout == "misaligned":
        return make.randn(1 + rows * cols)[1:].view(rows, cols)
    raise AssertionError(layout)


def swiglu_tensors(case: SwigluCase, empty: bool = False):
    """Forward: (x, w1, w2); backward: (a, b, h1, h2), as the case describes them."""
    make = Maker(case.seed, torch.float32 if case.invalid == "float32" else case.dtype, empty)
    M, N, K = case.M, case.N, case.K
    if case.api == "forward":
        x = swiglu_rows(make, M, K, case.x_layout).view(*case.lead, K)  # splitting rows keeps any row stride
        w1 = swiglu_rows(make, N, K, case.w_layout)
        w2 = swiglu_rows(make, N + (8 if case.invalid == "shapes_differ" else 0), K, case.w_layout)
        return x, w1, w2
    a = swiglu_rows(make, M, K, case.x_layout)
    b = make.randn(K, N, scale=K ** -0.5)
    if case.w_layout == "k_major":
        b = b.t().contiguous().t()
    h1, h2 = (swiglu_rows(make, M, N, case.h_layout).view(*case.lead, N) for _ in range(2))
    if case.invalid == "shapes_differ":
        h2 = h2[..., : N - 8] if N > 8 else h2[:0]
    return a, b, h1, h2


def swiglu_check_of(case: SwigluCase):
    tensors = swiglu_tensors(case, empty=True)
    if case.api == "forward":
        ops.check_swiglu_args(*tensors)
    else:
        ops.check_swiglu_grad_args(*tensors)


@pytest.mark.parametrize("index", range(SWIGLU_CASES))
def test_swiglu_fuzz(index):
    case = swiglu_case(index)
    tensors = swiglu_tensors(case)
    check = (lambda: ops.check_swiglu_args(*tensors)) if case.api == "forward" else \
        (lambda: ops.check_swiglu_grad_args(*tensors))  # noqa: E731
    if case.api == "forward":
        call = lambda: ops.swiglu_linear(*tensors, _schedule="dynamic" if case.variant else None)  # noqa: E731
    else:
        call = lambda: ops.matmul_swiglu_grad(*tensors, _pingpong=case.variant)  # noqa: E731
    if case.invalid:
        check_rejection(case, check, call)
        return
    check_acceptance(case, check)
    tol = SWIGLU_TOL[case.dtype]
    if case.api == "forward":
        x, w1, w2 = tensors
        poison_allocator(((*x.shape[:-1], case.N), case.dtype))
        g, h1, h2 = call()
        ref1, ref2 = (x.double() @ w.double().t() for w in (w1, w2))
        gated = F.silu(h1.double()).to(case.dtype).double() * h2.double()
        for name, got, ref, bound in (("h1", h1, ref1, tol), ("h2", h2, ref2, tol), ("g", g, gated, tol / 4)):
            assert got.shape == (*x.shape[:-1], case.N) and got.dtype == case.dtype, f"{name}: {describe(case)}"
            assert torch.isfinite(got).all(), f"{name}: unwritten (NaN) or non-finite outputs: {describe(case)}"
            err = rel_err(got, ref)
            assert err < bound, f"{name} relative error {err:.3g}: {describe(case)}"
    else:
        a, b, h1, h2 = tensors
        poison_allocator((h1.shape, case.dtype))
        dh1, dh2 = call()
        ref1, ref2 = swiglu_grad_reference(a, b, h1, h2)
        for name, got, ref in (("dh1", dh1, ref1), ("dh2", dh2, ref2)):
            assert got.shape == h1.shape and got.dtype == case.dtype, f"{name}: {describe(case)}"
            assert torch.isfinite(got).all(), f"{name}: unwritten (NaN) or non-finite outputs: {describe(case)}"
            err = rel_err(got, ref)
            assert err < tol, f"{name} relative error {err:.3g}: {describe(case)}"


def test_swiglu_generator_mostly_accepted():
    assert_mostly_accepted([swiglu_case(i) for i in range(SWIGLU_CASES)], swiglu_check_of)


# ------------------------------------------------------------------------------------------------
# Bugs the fuzzing found (2026-11-25): on the GPU (the backward's NaN rows, from test_attention_fuzz at other seeds) and
# through the CPU consistency test (tests/test_claim_fuzz_cpu.py; cases the checks accepted and the op then failed).
# The backward's NaN rows were the kernel's (its padding keys' P is 0 now); the others are fixed in ops and the claim
# rules. The tests below check the fixed behaviour.


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("dtype,row_lse", [(torch.float16, -12.0), (torch.bfloat16, -95.0)], ids=["fp16", "bf16"])
def test_backward_rows_with_a_very_negative_lse_stay_finite(dtype, row_lse, D):
    """One key (the rest of its block zero-filled); query row 0 scores it row_lse (its lse), and delta is large
    (about 4000). The padding keys' P was exp(-lse), not 0, and dS = -P delta overflowed 16 bits: NaN in that dq row
    (found by test_attention_fuzz at THUNDER_TK_FUZZ_SEED=10, case 46)."""
    Sq = 4
    make = Maker(8, dtype)
    q, k, v = make.randn(1, 1, Sq, D), make.randn(1, 1, 1, D), make.randn(1, 1, 1, D, scale=4.0)
    key = k.float()[0, 0, 0]
    q[0, 0, 0] = (key * (row_lse / D ** -0.5 / float(key @ key))).to(dtype)
    o, lse = ops.attention_forward(q, k, v)
    if not (abs(lse[0, 0, 0].item() - row_lse) < 1.0 and torch.isfinite(o).all()):
        raise RuntimeError(f"the case is not set up as meant: lse {lse.flatten().tolist()}")
    g = (v.float().expand(1, 1, Sq, D) * 4).to(dtype).contiguous()  # delta = 4 |v|^2
    grads = ops.attention_backward(q, k, v, o, lse, g)
    refs = ops.attention_backward_reference(q, k, v, o, lse, g)
    check_attention_grads(grads, refs, (q, k, v), g, False, None, f"D = {D}, {dtype}, lse {row_lse}")


@pytest.mark.parametrize("offset", [1, 4])
def test_misaligned_contiguous_attention_inputs_run(offset):
    """A contiguous q whose start is off 16 bytes: ops copies it (t.contiguous() had handed it on as is, and the
    kernel's launch refused it), forward and backward."""
    shape = (1, 2, 40, 64)
    make = Maker(5, torch.bfloat16)
    q = make.randn(offset + math.prod(shape))[offset:].view(shape)
    k, v = make.randn(*shape), make.randn(*shape)
    assert q.is_contiguous() and q.data_ptr() % 16
    o, lse = ops.attention_forward(q, k, v)
    ref_o, _ = ops.attention_forward_reference(q, k, v)
    assert rel_err(o, ref_o) < O_TOL[torch.bfloat16]
    g = make.randn(offset + math.prod(shape))[offset:].view(shape)
    dq, dk, dv = ops.attention_backward(q, k, v, o, lse, g)
    q2, g2 = q.clone(), g.clone()
    o2, lse2 = ops.attention_forward(q2, k, v)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    dq2, dk2, dv2 = ops.attention_backward(q2, k, v, o2, lse2, g2)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)  # dq: its reduce-adds' order may differ
    assert torch.isfinite(dq).all()


@pytest.mark.parametrize("scale", [1e300, -1e40, 1e-50, 3e38])
def test_scales_float32_cannot_hold_are_refused_by_name(scale):
    """The kernels take |scale| and |scale| log2(e) as float32: the check names the range before any launch (the
    kernel's own launch check had refused them, after the claim rule accepted)."""
    make = Maker(6, torch.bfloat16)
    q, k, v = (make.randn(1, 2, 40, 64) for _ in "qkv")
    error = raised(lambda: ops.check_attention_args(q, k, v, False, scale))
    assert isinstance(error, ValueError) and "float32" in str(error), error
    with pytest.raises(ValueError, match="float32"):
        ops.attention_forward(q, k, v, scale=scale)


def test_linear_without_input_features_runs():
    """K = 0: the output is the bias (ops.linear flattens x to (rows, 0), not (-1, 0), which torch refuses)."""
    make = Maker(7, torch.bfloat16)
    for lead in ((4,), (2, 3)):
        x, w, bias = make.randn(*lead, 0), make.randn(16, 0), make.randn(16)
        assert torch.equal(ops.linear(x, w, bias), bias.expand(*lead, 16))
