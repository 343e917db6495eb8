"""Cross-entropy on real Thunder traces (CPU, with tk's cross-entropy kernels standing in: `standins.StandinBuild`).

tk claims ltorch.cross_entropy for 2-D logits (bf16, fp16, fp32) with int64 class indices, no class weights and no
label smoothing: inference runs tk_cross_entropy_forward (then PyTorch's reduction of the row losses), training
runs it with tk_cross_entropy_backward for the logits' gradient. Anything else is declined with its reason in
`explain`, and Thunder runs its decomposition (log_softmax + nll_loss).

The GEMM producing the logits in the training tests must not go to tk (the stand-in build has no CPU GEMM), so
those tests take "gemm" out of the build.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
import thunder

import thunder_tk
from thunder_tk import tk

LOSS = "ltorch.cross_entropy"
bf16, fp32 = torch.bfloat16, torch.float32
N, K, C = 12, 16, 37  # rows, hidden size of the training tests' logits = x @ w, classes
# Relative tolerance of a result in its dtype against float64: a few units in the last place.
TOL = {bf16: 1e-2, fp32: 1e-5}
SHORT = {bf16: "bf16", fp32: "f32"}  # as explain shows a tensor's dtype


def ops_of(trace):
    return [(b.sym.name, getattr(b.sym.executor, "name", None)) for b in trace.bound_symbols]


def loss_row(jitted):
    (row,) = [r for r in thunder_tk.explain(jitted).rows if r.symbol == LOSS]
    return row


def targets(ignore_index=-100, rows=N, classes=C, seed=0):
    """Class indices with rows 1, 4 and 7 set to `ignore_index` (and, where it is a class, every row that drew it)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.randint(0, classes, (rows,), generator=g)
    t[[1, 4, 7]] = ignore_index
    return t


def logits_like(dtype, rows=N, classes=C, seed=0):
    g = torch.Generator().manual_seed(seed + 1)
    return (torch.randn(rows, classes, generator=g) * 3).to(dtype)


def ignore_kwargs(ignore_index):
    return {} if ignore_index == -100 else {"ignore_index": ignore_index}


def rel_err(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_close(actual, expected, dtype):
    assert actual.shape == expected.shape, (actual.shape, expected.shape)
    torch.testing.assert_close(actual.double(), expected.double(), rtol=TOL[dtype], atol=TOL[dtype])


# -- inference -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("ignore_index", [-100, -1, 5], ids=["default_ignore", "ignore_-1", "ignore_class_5"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [bf16, fp32], ids=["bf16", "fp32"])
def test_inference_runs_on_tk_cross_entropy(standin_tk_build, dtype, reduction, ignore_index):
    options = {"reduction": reduction, **ignore_kwargs(ignore_index)}

    def f(logits, target):
        return F.cross_entropy(logits, target, **options)

    logits, target = logits_like(dtype), targets(ignore_index)
    jf = thunder.jit(f, executors=[tk])
    out = jf(logits, target)
    eager = f(logits, target)
    assert out.dtype == eager.dtype == dtype and out.shape == eager.shape
    assert_close(out, f(logits.double(), target), dtype)
    if reduction == "none":
        assert (out[target == ignore_index] == 0).all()

    assert ("tk_cross_entropy_forward", "tk") in ops_of(thunder.last_traces(jf)[-1])
    row = loss_row(jf)
    assert row.claimed_by_tk and row.trace == "forward" and not row.reason and not row.backward_ran_by
    assert row.inputs.startswith(f"{SHORT[dtype]}[{N}, {C}], i64[{N}]"), row.inputs
    assert ("reduction=" in row.inputs) == (reduction != "mean")  # arguments that differ from their defaults
    assert ("ignore_index=" in row.inputs) == (ignore_index != -100)


def test_inference_explain_names_the_tk_forward_op(standin_tk_build):
    jf = thunder.jit(lambda a, t: F.cross_entropy(a, t), executors=[tk])
    jf(logits_like(bf16), targets())
    assert loss_row(jf).ran_by == "tk: tk_cross_entropy_forward"


def test_all_rows_ignored(standin_tk_build):
    """Mean over no rows is NaN (0 / 0) as in PyTorch; sum and none are 0."""
    logits, target = logits_like(fp32), torch.full((N,), -100)
    for reduction in ("mean", "sum", "none"):
        jf = thunder.jit(lambda a, t: F.cross_entropy(a, t, reduction=reduction), executors=[tk])
        out = jf(logits, target)
        torch.testing.assert_close(out, F.cross_entropy(logits, target, reduction=reduction), equal_nan=True)
        assert loss_row(jf).claimed_by_tk


# -- training ------------------------------------------------------------------------------------------


def training_inputs(dtype, ignore_index=-100, seed=0):
    g = torch.Generator().manual_seed(seed + 2)
    x = torch.randn(N, K, generator=g).to(dtype).requires_grad_()
    w = (torch.randn(K, C, generator=g) * 0.7).to(dtype).requires_grad_()
    return x, w, targets(ignore_index, seed=seed)


def reference_training(x, w, target, grad_out, **options):
    """Loss and (dx, dw) with the logits' GEMM as eager runs it (in the inputs' dtype, so both sides see the same
    logits) and everything after it in float64."""
    logits = (x.detach() @ w.detach()).double().requires_grad_()
    loss = F.cross_entropy(logits, target, **options)
    loss.backward(grad_out.double())
    return loss, (logits.grad @ w.detach().double().t(), x.detach().double().t() @ logits.grad)


@pytest.mark.parametrize("ignore_index", [-100, 5], ids=["default_ignore", "ignore_class_5"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [bf16, fp32], ids=["bf16", "fp32"])
def test_training_runs_tk_forward_and_backward(standin_tk_build, dtype, reduction, ignore_index):
    standin_tk_build.remove("gemm")
    options = {"reduction": reduction, **ignore_kwargs(ignore_index)}

    def f(x, w, target):
        return F.cross_entropy(x @ w, target, **options)

    x, w, target = training_inputs(dtype, ignore_index)
    jf = thunder.jit(f, executors=[tk])
    out = jf(x, w, target)
    g = torch.Generator().manual_seed(7)
    grad_out = torch.randn(out.shape, generator=g).to(dtype) if reduction == "none" else torch.tensor(0.7, dtype=dtype)
    out.backward(grad_out)

    ref_loss, ref_grads = reference_training(x, w, target, grad_out, **options)
    assert out.dtype == dtype
    assert_close(out, ref_loss, dtype)
    for t, ref in zip((x, w), ref_grads):
        assert t.grad.shape == t.shape and t.grad.dtype == dtype
        assert rel_err(t.grad, ref) < TOL[dtype], rel_err(t.grad, ref)

    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert ("tk_cross_entropy_forward", "tk") in ops_of(fwd)
    assert ("tk_cross_entropy_backward", "tk") in ops_of(bwd)
    row = loss_row(jf)
    assert row.claimed_by_tk and not row.reason
    assert row.ran_by == "tk: tk_cross_entropy_forward" and row.backward_ran_by == "tk: tk_cross_entropy_backward"


def test_training_with_logits_as_the_leaf(standin_tk_build):
    """The logits themselves need the gradient (no GEMM before the loss); the gradient is the logits' dtype."""
    logits = logits_like(bf16).requires_grad_()
    target = targets()
    jf = thunder.jit(lambda a, t: F.cross_entropy(a, t), executors=[tk])
    jf(logits, target).backward()
    ref = logits.detach().double().requires_grad_()
    F.cross_entropy(ref, target).backward()
    assert logits.grad.dtype == bf16
    assert rel_err(logits.grad, ref.grad) < TOL[bf16]
    assert (logits.grad[target == -100] == 0).all()
    assert ("tk_cross_entropy_backward", "tk") in ops_of(thunder.last_backward_traces(jf)[-1])


def test_training_all_rows_ignored_has_zero_gradient(standin_tk_build):
    logits = logits_like(fp32).requires_grad_()
    target = torch.full((N,), -100)
    jf = thunder.jit(lambda a, t: F.cross_entropy(a, t), executors=[tk])
    out = jf(logits, target)
    out.backward()
    assert torch.isnan(out)
    assert torch.equal(logits.grad, torch.zeros_like(logits))
    assert loss_row(jf).backward_ran_by == "tk: tk_cross_entropy_backward"


class Classifier(torch.nn.Module):
    def __init__(self, features=K, classes=C, dtype=bf16):
        super().__init__()
        self.proj = torch.nn.Linear(features, classes, dtype=dtype)

    def forward(self, x, target):
        return F.cross_entropy(self.proj(x), target)


def test_model_trains_a_step_with_tk_loss(standin_tk_build):
    standin_tk_build.remove("gemm")
    torch.manual_seed(0)
    model = Classifier()
    ref_model = copy.deepcopy(model).double()
    x, target = torch.randn(N, K, dtype=bf16), targets()
    jm = thunder.jit(model, executors=[tk])

    with torch.no_grad():  # an inference trace: tk's forward alone
        out = jm(x, target)
    assert not out.requires_grad
    row = loss_row(jm)
    assert row.claimed_by_tk and not row.backward_ran_by
    assert ("tk_cross_entropy_forward", "tk") in ops_of(thunder.last_traces(jm)[-1])

    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    ref_opt = torch.optim.SGD(ref_model.parameters(), lr=0.5)
    losses = []
    for _ in range(2):
        loss = jm(x, target)
        ref_loss = ref_model(x.double(), target)
        losses.append(loss.item())
        assert loss.dtype == bf16
        assert_close(loss, ref_loss, bf16)
        opt.zero_grad()
        ref_opt.zero_grad()
        loss.backward()
        ref_loss.backward()
        for p, ref_p in zip(model.parameters(), ref_model.parameters()):
            assert p.grad.dtype == bf16
            # bf16 logits and bf16 gradients against float64 all through: a little above one rounding
            assert rel_err(p.grad, ref_p.grad) < 2e-2, rel_err(p.grad, ref_p.grad)
        opt.step()
        ref_opt.step()
    assert losses[1] < losses[0]
    row = loss_row(jm)
    assert row.claimed_by_tk
    assert row.ran_by == "tk: tk_cross_entropy_forward" and row.backward_ran_by == "tk: tk_cross_entropy_backward"
    assert ("tk_cross_entropy_backward", "tk") in ops_of(thunder.last_backward_traces(jm)[-1])


def test_training_without_backward_kernel_differentiates_the_decomposition(standin_tk_build):
    standin_tk_build.remove("cross_entropy_backward")
    logits, target = logits_like(bf16).requires_grad_(), targets()
    jf = thunder.jit(lambda a, t: F.cross_entropy(a, t), executors=[tk])
    jf(logits, target).backward()
    ref = logits.detach().double().requires_grad_()
    F.cross_entropy(ref, target).backward()
    assert rel_err(logits.grad, ref.grad) < TOL[bf16]
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert all(ex != "tk" for _, ex in ops_of(fwd) + ops_of(bwd))
    row = loss_row(jf)
    assert not row.claimed_by_tk
    assert row.reason == ("tk has no loss backward kernel in this build (cross_entropy_backward); no executor takes "
                          "its gradient, so Thunder differentiates its decomposition")

    with torch.no_grad():  # inference needs the forward kernel only
        jf2 = thunder.jit(lambda a, t: F.cross_entropy(a, t), executors=[tk])
        jf2(logits, target)
    assert loss_row(jf2).claimed_by_tk


# -- declines ------------------------------------------------------------------------------------------


def _weighted(a, t, w):
    return F.cross_entropy(a, t, weight=w)


def _smoothed(a, t):
    return F.cross_entropy(a, t, label_smoothing=0.1)


def _plain(a, t):
    return F.cross_entropy(a, t)


def _int32_target(a, t):
    return F.cross_entropy(a, t.int())


def _declined_inputs(case):
    logits, target = logits_like(bf16), targets()
    if case == "weight":
        return logits, target, torch.rand(C, generator=torch.Generator().manual_seed(3)).to(bf16)
    if case == "3d":  # (N, C, d) logits, (N, d) targets: the classes are dim 1
        return torch.randn(N, C, 3, dtype=bf16), torch.randint(0, C, (N, 3))
    if case == "probabilities":  # class probabilities, the logits' shape
        return logits, torch.softmax(torch.randn(N, C), dim=1).to(bf16)
    if case == "1d":
        return logits[0], target[0]
    if case == "empty":
        return torch.randn(0, C, dtype=bf16), torch.zeros(0, dtype=torch.int64)
    return logits, target


@pytest.mark.parametrize(
    "case, fn, reason",
    [
        ("weight", _weighted, "class weights are given"),
        ("label_smoothing", _smoothed, "label_smoothing=0.1 (only 0 is supported)"),
        ("3d", _plain, "logits are 3-D; only (rows, classes) is claimed"),
        ("probabilities", _plain, f"target of shape ({N}, {C}) is not one class index per row (probability targets"),
        ("1d", _plain, "logits are 1-D"),
        ("empty", _plain, f"empty logits (0, {C})"),
    ],
    ids=["weight", "label_smoothing", "3d", "probabilities", "1d", "empty"],
)
def test_declined_cross_entropy_runs_the_decomposition_with_its_reason(standin_tk_build, request, case, fn, reason):
    if case == "empty":
        # Thunder's decomposition of an empty loss is a bare `full`, which tk's private torch.compile fuser would
        # compile (seconds on CPU); the eager stand-in fuser keeps the test fast.
        request.getfixturevalue("standin_nvfuser")
    inputs = _declined_inputs(case)
    jf = thunder.jit(fn, executors=[tk])
    out = jf(*inputs)
    torch.testing.assert_close(out.double(), fn(*(t.double() if t.is_floating_point() else t for t in inputs)),
                               rtol=3e-2, atol=3e-2, equal_nan=True)
    row = loss_row(jf)
    assert not row.claimed_by_tk and reason in row.reason, row.reason
    assert all(ex != "tk" for _, ex in ops_of(thunder.last_traces(jf)[-1]))


def test_int32_target_is_declined(standin_tk_build):
    # The value cannot be checked on CPU: PyTorch's nll_loss (eager, and the torch op that Thunder's decomposition
    # calls) takes int64 class indices only, so both raise. The route is judged while tracing, before that.
    logits, target = logits_like(bf16), targets().int()
    with pytest.raises(RuntimeError, match="Long"):
        F.cross_entropy(logits, target)
    jf = thunder.jit(lambda a, t: F.cross_entropy(a, t), executors=[tk])
    with pytest.raises(RuntimeError, match="Long"):
        jf(logits, target)
    row = loss_row(jf)
    assert not row.claimed_by_tk and row.reason == "target dtype int32 is not int64"
    assert f"i32[{N}]" in row.inputs


@pytest.mark.parametrize("disabled", ["loss", "ltorch.cross_entropy", "gemm,loss"])
@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_disabled_by_env(standin_tk_build, monkeypatch, disabled, training):
    monkeypatch.setenv("THUNDER_TK_DISABLE", disabled)
    logits, target = logits_like(bf16).requires_grad_(training), targets()
    jf = thunder.jit(_plain, executors=[tk])
    out = jf(logits, target)
    ref = logits.detach().double().requires_grad_(training)
    assert_close(out, F.cross_entropy(ref, target), bf16)
    if training:
        out.backward()
        F.cross_entropy(ref, target).backward()
        assert rel_err(logits.grad, ref.grad) < TOL[bf16]
        assert all(ex != "tk" for _, ex in ops_of(thunder.last_backward_traces(jf)[-1]))
    assert all(ex != "tk" for _, ex in ops_of(thunder.last_traces(jf)[-1]))
    row = loss_row(jf)
    assert not row.claimed_by_tk and row.reason == "disabled by THUNDER_TK_DISABLE"


def test_disabling_another_family_keeps_the_loss_on_tk(standin_tk_build, monkeypatch):
    monkeypatch.setenv("THUNDER_TK_DISABLE", "attention,gemm")
    jf = thunder.jit(_plain, executors=[tk])
    jf(logits_like(bf16), targets())
    assert loss_row(jf).claimed_by_tk


@pytest.mark.parametrize("option", ["loss", ["gemm", "ltorch.cross_entropy"]], ids=["string", "list"])
def test_disabled_by_compile_option(standin_tk_build, option):
    """tk_disable turns rules off for one jitted function; another jitted without it keeps them."""
    logits, target = logits_like(bf16), targets()
    off = thunder.jit(_plain, executors=[tk], tk_disable=option)
    assert_close(off(logits, target), F.cross_entropy(logits.double(), target), bf16)
    row = loss_row(off)
    assert not row.claimed_by_tk and row.reason == "disabled by the tk_disable compile option"
    on = thunder.jit(_plain, executors=[tk])
    on(logits, target)
    assert loss_row(on).claimed_by_tk


def test_compile_option_refuses_unknown_names(standin_tk_build):
    from thunder_tk import claim_rules, lowering, pattern_fusion

    assert {lowering.FORWARD_GRAD_KERNEL, pattern_fusion.OVERWRITE_LOGITS} <= claim_rules.DISABLE_FEATURES
    jf = thunder.jit(_plain, executors=[tk], tk_disable="gemms")
    with pytest.raises(ValueError, match=r"tk_disable: unknown name\(s\) \['gemms'\]"):
        jf(logits_like(bf16), targets())
