"""Claim rules against the ops layer's argument checks, on seeded random metadata (CPU only; nothing is launched).

The two sides take different inputs. A claim rule (thunder_tk.claim_rules) judges Thunder TensorProxies: shape, dtype
and device, no strides. An ops check (ops.check_*_args) takes torch tensors and insists they are CUDA tensors. Both
are given the same random metadata here: the rules through proxies on cuda:0, judged as an sm_90 GPU with the kernels
built (`_extension.planning_for`, as tests/test_claim_rules.py does), and the ops checks through FakeTensors on
"cuda" (torch's FakeTensorMode keeps metadata only, so no GPU and no memory are needed). The checks are called with
the arguments the lowering (thunder_tk/lowering.py) passes for the claimed symbol. For every case:

- if the rule accepts, the ops checks must pass. A claimed symbol is lowered onto these ops, and a check that raised
  there would fail the user's program at run time instead of leaving the symbol to another executor. Past the
  Python checks, the shape contract of the kernel's own launch check is tested too (mirrored from csrc, see
  `_attention_kernel_rejects` and the others);
- if the rule declines, its Verdict gives a reason;
- an ops check that rejects raises ValueError or TypeError with a message.

The rules may be stricter than the ops (they decline empty logits, and GEMMs under the size policy); they must
never be looser. Strides cannot be compared, since proxies have none. Instead `test_layouts_reach_the_kernels_readable`
fuzzes the ops' own layout handling: whatever the strides, the operands reach the kernel either in place or after
the copy ops makes, in a layout the kernel's argument checks accept.

Every case comes from a seed (`SEED` + the case index), and each failure message names the case's metadata.
"""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field

import pytest
import thunder
import thunder.torch as ltorch
import torch
from thunder.core import prims
from thunder.core.devices import Device
from thunder.core.dtypes import to_dtype
from thunder.core.proxies import TensorProxy
from thunder.core.trace import detached_trace
from torch._subclasses.fake_tensor import FakeTensorMode

from fuzzing import pick
from thunder_tk import _extension, claim_rules, ops
from thunder_tk.claim_rules import RULES_BY_ID
from thunder_tk.functional import attention_bwd_delta_symbol

SEED = int(os.environ.get("THUNDER_TK_FUZZ_SEED", "20261201"))
CASES = 400  # per family

HALF = (torch.bfloat16, torch.float16)


@pytest.fixture(autouse=True)
def trace_context():
    with detached_trace():
        yield


# ------------------------------------------------------------------------------------------------
# Metadata: one tensor's shape, strides and dtype, made into a proxy (the rule's side) or a FakeTensor (the ops' side)


@dataclass
class Meta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    stride: tuple[int, ...] | None = None  # None: contiguous

    def __repr__(self):
        stride = "" if self.stride is None else f" stride={self.stride}"
        return f"{str(self.dtype).removeprefix('torch.')}{list(self.shape)}{stride}"


def random_strides(rng: random.Random, shape: tuple[int, ...]) -> tuple[int, ...] | None:
    """Contiguous (None), or dense strides in a random dimension order, or that with a padded (possibly odd) innermost
    row: what views of a larger or permuted buffer look like. The ops checks must not care."""
    r = rng.random()
    if r < 0.4 or len(shape) < 2:
        return None
    order = list(range(len(shape)))
    if r < 0.7:
        rng.shuffle(order)
    stride, step = [0] * len(shape), 1
    for i, dim in enumerate(reversed(order)):
        stride[dim] = step
        extra = rng.choice((0, 0, 1, 8, 13)) if i == 0 else 0
        step *= max(shape[dim], 1) + extra
    return tuple(stride)


def proxy(m: Meta) -> TensorProxy:
    return TensorProxy(shape=m.shape, dtype=to_dtype(m.dtype), device=Device("cuda:0"))


def fake(mode: FakeTensorMode, m: Meta) -> torch.Tensor:
    with mode:
        if m.stride is None:
            return torch.empty(m.shape, dtype=m.dtype, device="cuda")
        return torch.empty_strided(m.shape, m.stride, dtype=m.dtype, device="cuda")


def judge(symbol, *args, **kwargs):
    """The rule's Verdict, or the exception it raised (a rule must not raise: Thunder calls it while building traces)."""
    rule = RULES_BY_ID[symbol.id if hasattr(symbol, "id") else symbol]
    with _extension.planning_for():  # cuda:0 judged as an sm_90 GPU, this version's kernels built
        try:
            return rule.judge(*args, **kwargs)
        except Exception as e:  # noqa: BLE001
            return e


def size(rng: random.Random, hi: int, zero: float = 0.0) -> int:
    """A size in [1, hi] (0 with probability `zero`), biased to 1 and to just off multiples of 64."""
    r = rng.random()
    if r < zero:
        return 0
    if r < zero + 0.1:
        return 1
    if r < zero + 0.45:
        return max(1, min(hi, 64 * rng.randint(1, max(1, hi // 64)) + rng.choice((-1, 1, 7, -9, 33))))
    return rng.randint(1, hi)


# ------------------------------------------------------------------------------------------------
# The outcome of one case


@dataclass
class Tally:
    family: str
    accepted: int = 0
    declined: int = 0
    failures: list[str] = field(default_factory=list)

    def fail(self, case: str, what: str):
        self.failures.append(f"{self.family} {case}: {what}")

    def verify(self, *, min_accepted: float = 0.25, min_declined: float = 0.1):
        total = self.accepted + self.declined
        assert not self.failures, f"{len(self.failures)} of {total} cases disagree:\n" + "\n".join(self.failures[:15])
        # A generator whose cases all land on one side would test nothing of the other.
        assert self.accepted >= min_accepted * total, f"{self.family}: only {self.accepted} of {total} accepted"
        assert self.declined >= min_declined * total, f"{self.family}: only {self.declined} of {total} declined"


def ops_error(check) -> BaseException | None:
    """What the ops side raises (None if it passes)."""
    try:
        check()
    except Exception as e:  # noqa: BLE001 - which exception it is, is what is judged
        return e
    return None


def clear(error: BaseException) -> bool:
    """An error a user can act on: the ops checks' ValueError or TypeError, with a message."""
    return isinstance(error, (ValueError, TypeError)) and bool(str(error).strip())


def judge_and_check(tally: Tally, case: str, verdict, check, kernel_rejects=None):
    """The shared rule: declined => a reason; accepted => the ops checks pass, and the kernel's launch check
    (mirrored) would too."""
    if isinstance(verdict, BaseException):  # the rule itself raised (`judge` returns what it raises)
        tally.fail(case, f"the rule raises {type(verdict).__name__}: {verdict}")
        return
    assert isinstance(verdict, claim_rules.Verdict), verdict
    error = ops_error(check)
    if error is not None and not clear(error):
        tally.fail(case, f"the ops side raises an unclear {type(error).__name__}: {error}")
        return
    if not verdict:
        tally.declined += 1
        if not (isinstance(verdict.reason, str) and verdict.reason.strip()):
            tally.fail(case, "declined without a reason")
        return
    tally.accepted += 1
    why = None
    if error is not None:
        why = f"the rule accepts, but the ops side raises {type(error).__name__}: {error}"
    elif kernel_rejects is not None and kernel_rejects():
        why = f"the rule and the ops checks accept, but the kernel's launch check would refuse: {kernel_rejects()}"
    if why:
        tally.fail(case, why)


# ------------------------------------------------------------------------------------------------
# Attention: ltorch.scaled_dot_product_attention -> ops.attention_forward / attention_backward

def _as_f32(x: float) -> float:
    """x as the kernels get it: csrc/binding.cpp takes scale as `float`, and pybind11 narrows a Python float without a
    range check (1e300 arrives as inf, 1e-50 as 0)."""
    return float(torch.tensor(x, dtype=torch.float64).to(torch.float32))


def _attention_kernel_rejects(q: torch.Tensor, k: torch.Tensor, is_causal: bool, scale) -> str | None:
    """csrc/kernels/attention/layout.cuh shape_unsupported, for what ops.attention_forward hands the kernel (it returns
    before the launch where the output is empty)."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    if B * Hq * Sq * D == 0:
        return None
    if q.dtype not in HALF:
        return "dtype must be bfloat16 or float16"
    if D not in (64, 128, 256):
        return "head_dim must be 64, 128 or 256"
    if min(B, Hq, Hkv, Sq, Sk) < 1:
        return "batch, heads and lengths must be at least 1"
    if Hq % Hkv:
        return "q_heads must be a multiple of kv_heads"
    if is_causal and Sq != Sk:
        return "causal attention needs q_len == kv_len"
    _, kernel_scale, _ = ops._kernel_scale(q, scale)
    f32 = _as_f32(kernel_scale)
    if not (math.isfinite(f32) and f32 > 0):
        return f"scale must be positive and finite (the kernel gets {kernel_scale!r} as float32 {f32!r})"
    return None


def _float32_edge(scale) -> bool:
    """A finite, nonzero scale that float32 makes 0 or inf (the kernels' type): the rule must decline it."""
    if scale is None or not math.isfinite(scale) or scale == 0:
        return False
    f32 = _as_f32(abs(scale))
    return f32 == 0 or math.isinf(f32)


def sdpa_case(rng: random.Random):
    B = pick(rng, [(0.03, 0), (0.97, rng.randint(1, 4))])
    Hkv = pick(rng, [(0.03, 0), (0.97, rng.randint(1, 8))])
    group = rng.choice((1, 1, 2, 3, 4, 8))
    Hq = pick(rng, [(0.9, Hkv * group), (0.1, Hkv * group + rng.randint(1, 3))])
    D = pick(rng, [(0.75, rng.choice((64, 128, 256))), (0.25, rng.choice((16, 32, 80, 96, 100, 160, 512)))])
    Dk = D if rng.random() < 0.93 else rng.choice((64, 128, 96))
    Dv = Dk if rng.random() < 0.95 else rng.choice((64, 128))
    Sq = size(rng, 5000, zero=0.03)
    is_causal = rng.random() < 0.4
    Sk = Sq if (is_causal and rng.random() < 0.85) or rng.random() < 0.3 else size(rng, 5000, zero=0.03)
    dtype = pick(rng, [(0.85, rng.choice(HALF)), (0.15, rng.choice((torch.float32, torch.float64)))])
    dtypes = [dtype] * 3
    if rng.random() < 0.06:
        dtypes[rng.randrange(3)] = rng.choice(HALF + (torch.float32,))
    q_shape, k_shape, v_shape = [B, Hq, Sq, D], [B, Hkv, Sk, Dk], [B, Hkv, Sk, Dv]
    if rng.random() < 0.04:  # a batch mismatch
        rng.choice((k_shape, v_shape))[0] = B + 1
    if rng.random() < 0.04:  # key and value lengths or heads differ
        v_shape[rng.choice((1, 2))] += 1
    shapes = [q_shape, k_shape, v_shape]
    if rng.random() < 0.04:  # 3-D: (B * H, S, D)
        shapes = [[s[0] * s[1], s[2], s[3]] for s in shapes]
    metas = [Meta(tuple(s), d) for s, d in zip(shapes, dtypes)]
    for m in metas:
        m.stride = random_strides(rng, m.shape)
    scale = pick(rng, [
        (0.4, None),
        (0.4, math.exp(rng.uniform(math.log(1e-3), math.log(10.0)))),
        (0.05, -math.exp(rng.uniform(math.log(1e-3), math.log(10.0)))),
        (0.03, 0.0),
        (0.05, rng.choice((float("inf"), float("-inf"), float("nan")))),
        (0.07, rng.choice((1e300, 5e38, -1e40, 1e-50, -1e-60, 1e-44, 3e38))),  # the float32 edge (1e-44: a denormal)
    ])
    attn_mask = Meta((Sq, Sk), torch.bool) if rng.random() < 0.04 else None
    dropout_p = 0.1 if rng.random() < 0.04 else 0.0
    return metas, is_causal, scale, attn_mask, dropout_p


def test_sdpa_rule_and_attention_checks_agree():
    tally, mode, edges = Tally("sdpa"), FakeTensorMode(), 0
    for i in range(CASES):
        metas, is_causal, scale, attn_mask, dropout_p = sdpa_case(random.Random(SEED + i))
        case = f"case {i}: q, k, v = {metas}, is_causal={is_causal}, scale={scale!r}, attn_mask={attn_mask}, " \
               f"dropout_p={dropout_p}"
        proxies = [proxy(m) for m in metas]
        verdict = judge(ltorch.scaled_dot_product_attention, *proxies, None if attn_mask is None else proxy(attn_mask),
                        dropout_p, is_causal, scale=scale)
        q, k, v = (fake(mode, m) for m in metas)
        # lowering._sdpa_flags: bool(is_causal), float(scale)
        judge_and_check(tally, case, verdict, lambda: ops.check_attention_args(q, k, v, is_causal, scale),
                        kernel_rejects=lambda: _attention_kernel_rejects(q, k, is_causal, scale))
        edges += _float32_edge(scale)
    tally.verify()
    assert edges, "the generator no longer reaches the float32 edge of scale"


@pytest.mark.parametrize("scale", [1e300, -1e40, 1e-50, -1e-60, 3e38])
def test_scales_float32_cannot_hold_are_declined(scale):
    """The kernels take |scale| and |scale| log2(e) as float32: where float32 makes either 0 or inf, the rule declines
    and the ops check raises, both naming the range (once the rule accepted and the kernel's launch refused)."""
    metas = [Meta((1, 2, 16, 64), torch.bfloat16) for _ in range(3)]
    verdict = judge(ltorch.scaled_dot_product_attention, *(proxy(m) for m in metas), None, 0.0, False, scale=scale)
    assert isinstance(verdict, claim_rules.Verdict) and not verdict and "float32" in verdict.reason, verdict
    q, k, v = (fake(FakeTensorMode(), m) for m in metas)
    error = ops_error(lambda: ops.check_attention_args(q, k, v, False, scale))
    assert isinstance(error, ValueError) and "float32" in str(error), error


@pytest.mark.parametrize("scale", [1e-40, 2e38, -0.5])
def test_scales_float32_holds_are_accepted(scale):
    metas = [Meta((1, 2, 16, 64), torch.bfloat16) for _ in range(3)]
    verdict = judge(ltorch.scaled_dot_product_attention, *(proxy(m) for m in metas), None, 0.0, False, scale=scale)
    assert verdict, verdict
    q, k, v = (fake(FakeTensorMode(), m) for m in metas)
    assert ops_error(lambda: ops.check_attention_args(q, k, v, False, scale)) is None
    assert _attention_kernel_rejects(q, k, False, scale) is None


# ------------------------------------------------------------------------------------------------
# GEMMs: ltorch.linear / prims.linear -> ops.linear, ltorch.matmul / prims.matmul -> ops.gemm


def _gemm_kernel_rejects(M: int, N: int, K: int, dtype: torch.dtype) -> str | None:
    """csrc/kernels/gemm/gemm.cu gemm_unsupported, shape and dtype part, for what ops.gemm launches (it returns
    before the launch where M, N or K is 0). Strides and alignment: test_layouts_reach_the_kernels_readable."""
    if M == 0 or N == 0 or K == 0:
        return None
    if dtype not in HALF:
        return "dtype must be bfloat16 or float16"
    if max(M, N, K) > (2**31 - 1) // 2:
        return "a dimension exceeds 2^30"
    if K % 8:
        return "K must be a multiple of 8"
    return None


def gemm_dtypes(rng: random.Random, n: int) -> list[torch.dtype]:
    dtype = pick(rng, [(0.85, rng.choice(HALF)), (0.15, rng.choice((torch.float32, torch.float64, torch.int64)))])
    dtypes = [dtype] * n
    if rng.random() < 0.06:
        dtypes[rng.randrange(n)] = rng.choice(HALF + (torch.float32,))
    return dtypes


def gemm_k(rng: random.Random) -> int:
    return pick(rng, [(0.7, 8 * rng.randint(1, 512)), (0.05, 0), (0.25, rng.randint(1, 4100))])


def linear_case(rng: random.Random):
    K, N = gemm_k(rng), size(rng, 6000, zero=0.02)
    lead = tuple(size(rng, 300, zero=0.03) for _ in range(pick(rng, [(0.05, 0), (0.4, 1), (0.4, 2), (0.15, 3)])))
    dtypes = gemm_dtypes(rng, 3)
    w_shape = pick(rng, [(0.95, (N, K)), (0.03, (K,)), (0.02, (2, N, K))])
    x = Meta(lead + (K,), dtypes[0])
    w = Meta(w_shape, dtypes[1])
    bias = None
    if rng.random() < 0.4:
        bias = Meta(pick(rng, [(0.95, (w_shape[0] if len(w_shape) == 2 else N,)), (0.05, (1, N))]), dtypes[2])
    for m in (x, w):
        m.stride = random_strides(rng, m.shape)
    return x, w, bias


def matmul_case(rng: random.Random):
    M, N, K = size(rng, 6000, zero=0.02), size(rng, 6000, zero=0.02), gemm_k(rng)
    a_shape, b_shape = (M, K), (K, N)
    r = rng.random()
    if r < 0.03:
        a_shape = (2,) + a_shape  # batched
    elif r < 0.06:
        b_shape = (K,)  # matrix @ vector
    a, b = (Meta(s, d) for s, d in zip((a_shape, b_shape), gemm_dtypes(rng, 2)))
    for m in (a, b):
        m.stride = random_strides(rng, m.shape)
    return a, b


def linear_checks(x, w, bias):
    """What ops.linear checks before the kernel: its weight check, then check_gemm_args on the operands it makes
    (FakeTensors can be reshaped outside their mode)."""
    if w.ndim != 2:
        raise ValueError(f"linear expects a 2-D weight; got {w.ndim}-D")
    ops.check_gemm_args(x.reshape(math.prod(x.shape[:-1]), x.shape[-1]), w.t(), bias)


@pytest.mark.parametrize("size_policy", [False, True], ids=["size_policy_off", "size_policy_on"])
def test_linear_rules_and_gemm_checks_agree(size_policy, monkeypatch):
    # The suite turns the size policy off (conftest); with it on, more GEMMs are declined, each with its reason.
    monkeypatch.setattr(claim_rules, "gemm_size_policy_default", size_policy)
    for symbol in (ltorch.linear, prims.PrimIDs.LINEAR):
        tally, mode = Tally(f"linear ({symbol})"), FakeTensorMode()
        for i in range(CASES):
            x, w, bias = linear_case(random.Random(SEED + 10_000 + i))
            case = f"case {i}: x={x}, weight={w}, bias={bias}"
            verdict = judge(symbol, proxy(x), proxy(w), None if bias is None else proxy(bias))
            xt, wt = fake(mode, x), fake(mode, w)
            bt = None if bias is None else fake(mode, bias)
            M = math.prod(x.shape[:-1])
            judge_and_check(tally, case, verdict, lambda: linear_checks(xt, wt, bt),
                            kernel_rejects=lambda: _gemm_kernel_rejects(M, w.shape[0], x.shape[-1], x.dtype))
        tally.verify(min_accepted=0.1 if size_policy else 0.25)


@pytest.mark.parametrize("x_shape", [(4, 0), (2, 3, 0), (0,)])
def test_linear_with_no_input_features_passes_the_ops_checks(x_shape):
    """K = 0 (the output is the bias): the rule accepts it, and ops.linear flattens x to (rows, 0), not (-1, 0),
    which torch refuses."""
    x, w, bias = Meta(x_shape, torch.bfloat16), Meta((16, 0), torch.bfloat16), Meta((16,), torch.bfloat16)
    verdict = judge(ltorch.linear, proxy(x), proxy(w), proxy(bias))
    assert isinstance(verdict, claim_rules.Verdict) and verdict, verdict
    mode = FakeTensorMode()
    assert ops_error(lambda: linear_checks(fake(mode, x), fake(mode, w), fake(mode, bias))) is None


@pytest.mark.gemm_size_policy
@pytest.mark.parametrize("symbol,shapes", [(ltorch.linear, ((128, 512), (0, 512))),
                                           (prims.PrimIDs.LINEAR, ((2, 100, 1024), (0, 1024))),
                                           (ltorch.matmul, ((65, 512), (512, 0)))], ids=str)
def test_size_policy_declines_an_empty_output(symbol, shapes):
    """The size policy counts no tiles in an empty output (it divided by zero there) and leaves it to torch."""
    verdict = judge(symbol, *(proxy(Meta(s, torch.bfloat16)) for s in shapes))
    assert isinstance(verdict, claim_rules.Verdict), f"the rule raised {type(verdict).__name__}: {verdict}"
    assert not verdict and verdict.reason, verdict


@pytest.mark.parametrize("size_policy", [False, True], ids=["size_policy_off", "size_policy_on"])
def test_matmul_rules_and_gemm_checks_agree(size_policy, monkeypatch):
    monkeypatch.setattr(claim_rules, "gemm_size_policy_default", size_policy)
    for symbol in (ltorch.matmul, prims.PrimIDs.MATMUL):
        tally, mode = Tally(f"matmul ({symbol})"), FakeTensorMode()
        for i in range(CASES):
            a, b = matmul_case(random.Random(SEED + 20_000 + i))
            case = f"case {i}: a={a}, b={b}"
            verdict = judge(symbol, proxy(a), proxy(b))
            at, bt = fake(mode, a), fake(mode, b)
            judge_and_check(tally, case, verdict, lambda: ops.check_gemm_args(at, bt, None),
                            kernel_rejects=lambda: _gemm_kernel_rejects(a.shape[0], b.shape[1], a.shape[1], a.dtype))
        tally.verify(min_accepted=0.1 if size_policy else 0.25)


# ------------------------------------------------------------------------------------------------
# Cross-entropy: ltorch.cross_entropy -> ops.cross_entropy_forward / _backward (/ _forward_grad)


def _cross_entropy_kernel_rejects(logits: torch.Tensor) -> str | None:
    """csrc/kernels/loss/cross_entropy.cu cross_entropy_unsupported, shape and dtype part."""
    rows, classes = logits.shape
    if logits.dtype not in HALF + (torch.float32,):
        return "logits dtype must be bfloat16, float16 or float32"
    if classes <= 0:
        return "classes > 0"
    if rows > 0x7FFFFFFF:
        return "more than 2^31 - 1 rows"
    return None


def cross_entropy_case(rng: random.Random):
    rows = size(rng, 5000, zero=0.04)
    classes = pick(rng, [(0.04, 0), (0.3, rng.choice((1, 2, 7, 8, 9, 1000, 32000, 50257, 65537, 128256, 200000))),
                         (0.66, size(rng, 200000))])
    dtype = pick(rng, [(0.9, rng.choice(HALF + (torch.float32,))), (0.1, rng.choice((torch.float64, torch.int64)))])
    logits_shape, target_shape = (rows, classes), (rows,)
    r = rng.random()
    if r < 0.04:  # unbatched: (classes,) logits, a 0-d target
        logits_shape, target_shape = (classes,), ()
    elif r < 0.08:  # (N, C, d) logits, (N, d) targets
        logits_shape, target_shape = (rows, classes, 3), (rows, 3)
    elif r < 0.11:  # class probabilities
        target_shape = logits_shape
    target_dtype = torch.int64 if rng.random() < 0.93 else rng.choice((torch.int32, torch.float32))
    if target_shape == logits_shape:
        target_dtype = dtype
    logits = Meta(logits_shape, dtype, random_strides(rng, logits_shape))
    target = Meta(target_shape, target_dtype)
    weight = Meta((classes,), dtype) if rng.random() < 0.04 else None
    kwargs = {
        "size_average": None if rng.random() < 0.97 else True,
        "ignore_index": pick(rng, [(0.6, -100), (0.2, -1), (0.15, rng.randint(0, 100)), (0.05, 2**40)]),
        "reduce": None if rng.random() < 0.97 else False,
        "reduction": pick(rng, [(0.96, rng.choice(ops.CROSS_ENTROPY_REDUCTIONS)), (0.04, "batchmean")]),
        "label_smoothing": 0.0 if rng.random() < 0.95 else 0.1,
    }
    return logits, target, weight, kwargs


def cross_entropy_checks(logits, target, reduction):
    """What the lowering's ops calls check: ops.check_cross_entropy_args, and the reduction (ops.cross_entropy's)."""
    ops.check_cross_entropy_args(logits, target)
    if reduction not in ops.CROSS_ENTROPY_REDUCTIONS:
        raise ValueError(f"reduction must be one of {ops.CROSS_ENTROPY_REDUCTIONS}; got {reduction!r}")


def test_cross_entropy_rule_and_checks_agree():
    tally, mode = Tally("cross_entropy"), FakeTensorMode()
    for i in range(CASES):
        logits, target, weight, kwargs = cross_entropy_case(random.Random(SEED + 30_000 + i))
        case = f"case {i}: logits={logits}, target={target}, weight={weight}, {kwargs}"
        verdict = judge(ltorch.cross_entropy, proxy(logits), proxy(target), None if weight is None else proxy(weight),
                        kwargs["size_average"], kwargs["ignore_index"], kwargs["reduce"], kwargs["reduction"],
                        kwargs["label_smoothing"])
        lt, tt = fake(mode, logits), fake(mode, target)
        judge_and_check(tally, case, verdict, lambda: cross_entropy_checks(lt, tt, kwargs["reduction"]),
                        kernel_rejects=lambda: _cross_entropy_kernel_rejects(lt))
    tally.verify()


# ------------------------------------------------------------------------------------------------
# thunder_tk.attention_bwd_delta -> ops.attention_bwd_delta


def test_attention_bwd_delta_rule_and_checks_agree():
    tally, mode = Tally("attention_bwd_delta"), FakeTensorMode()
    for i in range(CASES):
        rng = random.Random(SEED + 40_000 + i)
        shape = tuple(size(rng, 300, zero=0.02) for _ in range(pick(rng, [(0.9, 4), (0.1, rng.choice((2, 3, 5)))])))
        other = shape if rng.random() < 0.9 else shape[:-1] + (shape[-1] + 1,) if shape else (1,)
        dtype = pick(rng, [(0.85, rng.choice(HALF + (torch.float32,))), (0.15, torch.float64)])
        o = Meta(shape, dtype, random_strides(rng, shape))
        g = Meta(other, dtype if rng.random() < 0.93 else rng.choice(HALF), random_strides(rng, other))
        case = f"case {i}: o={o}, grad_o={g}"
        verdict = judge(attention_bwd_delta_symbol, proxy(o), proxy(g))
        ot, gt = fake(mode, o), fake(mode, g)
        judge_and_check(tally, case, verdict, lambda: ops.check_attention_bwd_delta_args(ot, gt))
    tally.verify()


# ------------------------------------------------------------------------------------------------
# Layouts: the strides the rules never see reach the kernels readable (real CPU tensors; nothing is launched)


def _gemm_layout_readable(layout: tuple[int, int] | None, t: torch.Tensor) -> bool:
    """csrc/kernels/gemm/gemm.cu gemm_unsupported, stride part: a unit stride along one dim, the other (the leading
    stride) a multiple of 8 elements, a 16-byte aligned base."""
    if layout is None:
        return False
    s_other, s_k = layout
    lead = s_other if s_k == 1 else s_k
    return (s_k == 1 or s_other == 1) and lead % 8 == 0 and t.data_ptr() % 16 == 0


def random_view(rng: random.Random, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, str]:
    """A (shape) view of real CPU memory in a random layout: contiguous, permuted, padded rows (odd pads included),
    a misaligned start, every other element, or broadcast (stride 0) along a dim."""
    kind = rng.choice(("contiguous", "permuted", "padded", "misaligned", "step2", "broadcast"))
    n = len(shape)
    if kind == "contiguous":
        return torch.empty(shape, dtype=dtype), kind
    if kind == "broadcast":
        dim = rng.randrange(n)
        base = torch.empty(tuple(1 if d == dim else s for d, s in enumerate(shape)), dtype=dtype)
        return base.expand(shape), f"{kind}(dim {dim})"
    if kind == "step2":
        dim = rng.randrange(n)
        base = torch.empty(tuple(2 * s if d == dim else s for d, s in enumerate(shape)), dtype=dtype)
        return base[tuple(slice(None, None, 2) if d == dim else slice(None) for d in range(n))], f"{kind}(dim {dim})"
    order = list(range(n))
    if kind == "permuted":
        rng.shuffle(order)
    pad = rng.choice((1, 3, 8, 16, 24)) if kind == "padded" else 0
    stride, step = [0] * n, 1
    for i, dim in enumerate(reversed(order)):
        stride[dim] = step
        step *= shape[dim] + (pad if i == 0 else 0)
    offset = 1 if kind == "misaligned" else 0
    storage = torch.empty(step + offset + 8, dtype=dtype)
    return storage.as_strided(shape, tuple(stride), offset), f"{kind}(order {order}, pad {pad})"


def test_layouts_reach_the_kernels_readable():
    """ops.gemm reads an operand in place where `_gemm_layout` gives its strides, else copies it; the attention ops
    read q, k, v in place where `_tma_reads_in_place`, else copy. Either way the kernel must get a layout its checks
    take, and an in-place layout must describe the tensor's real strides."""
    failures, misaligned = [], 0
    for i in range(300):
        rng = random.Random(SEED + 50_000 + i)
        dtype = rng.choice(HALF)
        M, K = rng.choice((1, 2, 7, 8, 64, 77, 128, 300)), 8 * rng.randint(1, 40)
        for k_dim, shape in ((1, (M, K)), (0, (K, M))):  # A (M, K): K is dim 1; B (K, N): K is dim 0
            t, kind = random_view(rng, shape, dtype)
            case = f"case {i}: {'A' if k_dim else 'B'} {tuple(t.shape)} stride {t.stride()} ({kind}), {dtype}"
            layout = ops._gemm_layout(t, k_dim)
            if layout is not None:
                other = 1 - k_dim
                s_other, s_k = layout
                truthful = (t.stride(k_dim) == s_k or t.shape[k_dim] == 1) and \
                    (t.stride(other) == s_other or t.shape[other] == 1)
                if not _gemm_layout_readable(layout, t) or not truthful:
                    failures.append(f"{case}: read in place with layout {layout}")
                continue
            # ops.gemm's copies: A to row-major, B to K-major (N, K) storage seen as (K, N)
            copy = t.clone(memory_format=torch.contiguous_format) if k_dim else \
                t.t().clone(memory_format=torch.contiguous_format).t()
            copied = ops._gemm_layout(copy, k_dim)
            if not _gemm_layout_readable(copied, copy):
                failures.append(f"{case}: copied, and the copy's layout {copied} is not readable")
        D = rng.choice(ops.ATTENTION_HEAD_DIMS)
        shape = (rng.randint(1, 2), rng.randint(1, 3), rng.choice((1, 5, 64, 77)), D)
        t, kind = random_view(rng, shape, dtype)
        readable = ops._tma_readable(t)
        misaligned += t.is_contiguous() and t.data_ptr() % 16 != 0
        if not _attention_operand_readable(readable) or not torch.equal(readable.view(torch.int16), t.view(torch.int16)):
            failures.append(f"attention case {i}: {shape} stride {t.stride()} ({kind}), {t.data_ptr() % 16} bytes off "
                            f"16: reaches the kernel with strides {readable.stride()}, {readable.data_ptr() % 16} "
                            f"bytes off 16")
    assert not failures, "\n".join(failures[:15])
    assert misaligned, "the generator no longer reaches contiguous attention inputs off a 16-byte boundary"


def test_summed_products_reach_the_kernel_with_one_major():
    """ops.gemm_sum's operands (`_sum_operands`): whatever the strides of A and A2 (or B and B2), both reach the
    kernel readable, with the same major (the kernel's majors are the first product's), with their values, and an
    in-place layout that describes the tensor's real strides; where both can be read in place with one major, neither
    is copied."""
    failures, both_in_place, copied = [], 0, 0
    for i in range(300):
        rng = random.Random(SEED + 60_000 + i)
        dtype = rng.choice(HALF)
        M, K, K2 = rng.choice((1, 2, 8, 77, 128)), 8 * rng.randint(1, 20), 8 * rng.randint(1, 20)
        for k_dim, shapes in ((1, ((M, K), (M, K2))), (0, ((K, M), (K2, M)))):
            views = [random_view(rng, shape, dtype) for shape in shapes]
            t, t2 = (v[0] for v in views)
            case = (f"case {i}: {'A' if k_dim else 'B'} " + ", ".join(f"{tuple(v.shape)} stride {v.stride()} ({kind})"
                                                                     for v, kind in views) + f", {dtype}")
            got = ops._sum_operands(t, t2, k_dim)
            other = 1 - k_dim
            for before, after, layout in ((t, got[0], got[1]), (t2, got[2], got[3])):
                truthful = (after.stride(k_dim) == layout[1] or after.shape[k_dim] == 1) and \
                    (after.stride(other) == layout[0] or after.shape[other] == 1)
                if not _gemm_layout_readable(layout, after) or not truthful:
                    failures.append(f"{case}: reaches the kernel with layout {layout}, strides {after.stride()}")
                if not torch.equal(after.view(torch.int16), before.view(torch.int16)):
                    failures.append(f"{case}: values changed")
            if (got[1][1] == 1) != (got[3][1] == 1):
                failures.append(f"{case}: majors differ, {got[1]} and {got[3]}")
            layouts = ops._gemm_layout(t, k_dim), ops._gemm_layout(t2, k_dim)
            if None not in layouts and (layouts[0][1] == 1) == (layouts[1][1] == 1):
                both_in_place += 1
                if got[0] is not t or got[2] is not t2:
                    failures.append(f"{case}: copied though both are readable in place with one major")
            copied += got[0] is not t or got[2] is not t2
    assert not failures, "\n".join(failures[:15])
    assert both_in_place and copied, "the generator no longer reaches both outcomes"


def _attention_operand_readable(t: torch.Tensor) -> bool:
    """csrc/kernels/attention/forward.cu forward_unsupported, layout part: a 16-byte aligned base, and strides
    (layout.cuh strides_ok) positive multiples of 8 elements where the size is over 1; TMA also needs a unit last
    stride."""
    return t.stride(-1) == 1 and t.data_ptr() % 16 == 0 and \
        all(size == 1 or (stride > 0 and stride % 8 == 0) for size, stride in zip(t.shape[:-1], t.stride()[:-1]))


@pytest.mark.parametrize("offset", [1, 3, 4])
def test_a_misaligned_contiguous_attention_input_is_copied(offset):
    """A contiguous view whose start is off 16 bytes: t.contiguous() would hand it on as is, and the kernels refuse
    it; ops copies it to fresh storage."""
    shape = (1, 2, 16, 64)
    q = torch.randn(offset + math.prod(shape)).to(torch.bfloat16)[offset:].view(shape)
    assert q.is_contiguous() and q.data_ptr() % 16
    readable = ops._tma_readable(q)
    assert _attention_operand_readable(readable), "handed to the kernel misaligned"
    assert torch.equal(readable, q)
