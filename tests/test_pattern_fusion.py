"""The cross-entropy's gradient from its forward, and its row scaling folded into the lm_head's GEMMs
(`lowering.FORWARD_GRAD_MIN_CLASSES`, `thunder_tk.pattern_fusion.fold_row_scaling`), on real Thunder traces on CPU
with tk's GEMM and cross-entropy kernels standing in (`standins.StandinBuild`).

Wide rows in training: the forward runs tk_cross_entropy_forward_grad (D saved instead of the logits) and the backward
scales the rows of the GEMMs' small operands, never D itself. Narrow rows, the compile option, THUNDER_TK_DISABLE or a
build without the kernel keep the forward + backward kernels; a second use of the logits keeps an explicit scaling.
Gradients match float64 eager in every case.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
import thunder

import thunder_tk
from models import LlamaMLP as SwiGLU
from standins import turned_off
from thunder_tk import lowering, pattern_fusion, tk

bf16 = torch.bfloat16
HIDDEN, CLASSES = 16, 64  # the tests lower FORWARD_GRAD_MIN_CLASSES to 64


@pytest.fixture(autouse=True)
def wide_from_64(monkeypatch):
    monkeypatch.setattr(lowering, "FORWARD_GRAD_MIN_CLASSES", 64)


class LMHeadLoss(torch.nn.Module):
    """A norm, the lm_head and the loss as LitGPT's training step computes it (per-token losses, fp32 mean)."""

    def __init__(self, classes=CLASSES, reduction="none", extra_logits_term=False, bias=False):
        super().__init__()
        self.norm = torch.nn.LayerNorm(HIDDEN)
        self.lm_head = torch.nn.Linear(HIDDEN, classes, bias=bias)
        self.reduction = reduction
        self.extra_logits_term = extra_logits_term

    def forward(self, x, targets):
        logits = self.lm_head(self.norm(x))
        flat = logits.reshape(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, targets.reshape(-1), reduction=self.reduction, ignore_index=3)
        loss = loss.float().mean()
        if self.extra_logits_term:  # a second use of the logits: their gradient is no longer the loss's alone
            loss = loss + 1e-2 * logits.float().square().mean()
        return loss


def ops_of(trace):
    return [b.sym.name for b in trace.bound_symbols]


def run(model, classes=CLASSES, **compile_options):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 8, HIDDEN, generator=g).to(bf16)  # 16 tokens: the weight gradient's K
    targets = torch.randint(0, classes, (2, 8), generator=g)
    targets[0, 2] = 3  # the ignored class: a row with a zero gradient
    jm = thunder.jit(model, executors=[tk], **compile_options)
    xj = x.clone().requires_grad_()
    loss = jm(xj, targets)
    loss.backward()
    return jm, loss, xj.grad, {n: p.grad for n, p in model.named_parameters()}, x, targets


def rel_err(actual, expected):
    actual, expected = actual.double(), expected.double()
    return ((actual - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def assert_matches_reference(model, loss, x_grad, grads, x, targets):
    """Against the same module in float64."""
    ref = LMHeadLoss(model.lm_head.weight.shape[0], model.reduction, model.extra_logits_term,
                     model.lm_head.bias is not None).double()
    ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    xr = x.double().requires_grad_()
    ref_loss = ref(xr, targets)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 2e-2 * abs(ref_loss.item())
    assert rel_err(x_grad, xr.grad) < 3e-2
    for name, p in ref.named_parameters():
        assert rel_err(grads[name], p.grad) < 3e-2, name


@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
def test_wide_rows_fold_the_scaling_into_the_gemms(standin_tk_build, reduction):
    model = LMHeadLoss(reduction=reduction).to(bf16)
    jm, loss, x_grad, grads, x, targets = run(model)
    fwd = ops_of(thunder.last_traces(jm)[-1])
    bwd_trace = thunder.last_backward_traces(jm)[-1]
    bwd = ops_of(bwd_trace)
    # The logits are the lm_head's own output, read by nothing else: D is written over them.
    assert "tk_cross_entropy_forward_grad_over_logits" in fwd and "tk_cross_entropy_forward" not in fwd
    assert "tk_cross_entropy_backward" not in bwd and bwd.count("tk_matmul") == 2, bwd
    # The scaling touches only (rows, hidden) tensors: the GEMM's output and the lm_head's input, never D.
    scaled = [b for b in bwd_trace.bound_symbols if b.sym.name == "tk_scale_rows"]
    assert len(scaled) == 2 and all(tuple(b.output.shape) == (16, HIDDEN) for b in scaled), scaled
    assert_matches_reference(model, loss, x_grad, grads, x, targets)
    rows = thunder_tk.explain(jm).rows
    (row,) = [r for r in rows if r.symbol == "ltorch.cross_entropy"]
    assert row.ran_by == "tk: tk_cross_entropy_forward_grad_over_logits"
    assert row.detail == "loss and gradient from one read of the logits; the gradient written over them"
    # Both of the lm_head's backward products are reported as the GEMM launches, not as the scaling moved onto them.
    products = [(r.ran_by, r.detail) for r in rows if r.trace == "backward" and r.symbol.endswith("matmul")]
    assert sorted(products) == [("tk: tk_matmul", "the loss gradient's row scaling applied to its other operand's rows"),
                                ("tk: tk_matmul", "the loss gradient's row scaling applied to its output rows")], products


def test_narrow_rows_keep_the_backward_kernel(standin_tk_build, monkeypatch):
    monkeypatch.setattr(lowering, "FORWARD_GRAD_MIN_CLASSES", 65536)
    model = LMHeadLoss().to(bf16)
    jm, loss, x_grad, grads, x, targets = run(model)
    assert "tk_cross_entropy_backward" in ops_of(thunder.last_backward_traces(jm)[-1])
    assert_matches_reference(model, loss, x_grad, grads, x, targets)
    (row,) = [r for r in thunder_tk.explain(jm).rows if r.symbol == "ltorch.cross_entropy"]
    assert row.detail == f"gradient by the backward kernel: {CLASSES} classes, fewer than 65536", row.detail


def test_rows_off_16_bytes_keep_the_backward_kernel(standin_tk_build):
    """A vocabulary that is not a multiple of 8 (GPT-2's 50257): the kernel would not take the rows, and the op's
    fallback (both kernels, then a scaling pass) would cost more than the backward kernel."""
    model = LMHeadLoss(classes=CLASSES + 3).to(bf16)
    jm, loss, x_grad, grads, x, targets = run(model, classes=CLASSES + 3)
    assert not any(op.startswith("tk_cross_entropy_forward_grad") for op in ops_of(thunder.last_traces(jm)[-1]))
    assert "tk_cross_entropy_backward" in ops_of(thunder.last_backward_traces(jm)[-1])
    assert_matches_reference(model, loss, x_grad, grads, x, targets)
    (row,) = [r for r in thunder_tk.explain(jm).rows if r.symbol == "ltorch.cross_entropy"]
    assert row.detail == (f"gradient by the backward kernel: {CLASSES + 3} classes, not a multiple of 8 "
                          "(rows off 16-byte boundaries)"), row.detail
    assert row.detail in str(thunder_tk.explain(jm))


@pytest.mark.parametrize("how", ["option", "env", "build"])
def test_turned_off_keeps_the_backward_kernel(standin_tk_build, monkeypatch, how):
    options = {}
    if how == "option":
        options = {lowering.FORWARD_GRAD_OPTION: False}
    elif how == "env":
        monkeypatch.setenv("THUNDER_TK_DISABLE", lowering.FORWARD_GRAD_KERNEL)
    else:
        standin_tk_build.remove(lowering.FORWARD_GRAD_KERNEL)
    model = LMHeadLoss().to(bf16)
    jm, loss, x_grad, grads, x, targets = run(model, **options)
    assert not any(op.startswith("tk_cross_entropy_forward_grad") for op in ops_of(thunder.last_traces(jm)[-1]))
    assert "tk_cross_entropy_backward" in ops_of(thunder.last_backward_traces(jm)[-1])
    assert_matches_reference(model, loss, x_grad, grads, x, targets)
    (row,) = [r for r in thunder_tk.explain(jm).rows if r.symbol == "ltorch.cross_entropy"]
    assert row.detail == "gradient by the backward kernel: " + {
        "option": f"turned off ({lowering.FORWARD_GRAD_OPTION}=False)",
        "env": f"turned off (THUNDER_TK_DISABLE={lowering.FORWARD_GRAD_KERNEL})",
        "build": f"{lowering.FORWARD_GRAD_KERNEL} not in this build"}[how], row.detail


def test_logits_with_a_second_use_keep_an_explicit_scaling(standin_tk_build):
    model = LMHeadLoss(extra_logits_term=True).to(bf16)
    jm, loss, x_grad, grads, x, targets = run(model)
    bwd_trace = thunder.last_backward_traces(jm)[-1]
    scaled = [b for b in bwd_trace.bound_symbols if b.sym.name == "tk_scale_rows"]
    assert len(scaled) == 1 and tuple(scaled[0].output.shape) == (16, CLASSES)  # D itself: not folded
    fwd = ops_of(thunder.last_traces(jm)[-1])
    assert "tk_cross_entropy_forward_grad" in fwd and "tk_cross_entropy_forward_grad_over_logits" not in fwd
    assert_matches_reference(model, loss, x_grad, grads, x, targets)


def test_declined_gemm_still_folds_onto_torch_matmuls(standin_tk_build):
    standin_tk_build.remove("gemm")  # the GEMMs run on torch: the fold works on their matmuls too
    model = LMHeadLoss().to(bf16)
    jm, loss, x_grad, grads, x, targets = run(model)
    scaled = [b for b in thunder.last_backward_traces(jm)[-1].bound_symbols if b.sym.name == "tk_scale_rows"]
    assert all(tuple(b.output.shape) == (16, HIDDEN) for b in scaled), scaled
    assert_matches_reference(model, loss, x_grad, grads, x, targets)


# ------------------------------------------------------------------------------------------------
# D written over the logits (pattern_fusion.write_gradient_over_logits): only where nothing else reads them


class LMHeadLossAndLogits(LMHeadLoss):
    """Returns the logits beside the loss: the caller reads them, so they must survive the loss."""

    def forward(self, x, targets):
        logits = self.lm_head(self.norm(x))
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none",
                               ignore_index=3)
        return loss.float().mean(), logits


def test_returned_logits_are_not_overwritten(standin_tk_build):
    model = LMHeadLossAndLogits().to(bf16)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 8, HIDDEN, generator=g).to(bf16).requires_grad_()
    targets = torch.randint(0, CLASSES, (2, 8), generator=g)
    jm = thunder.jit(model, executors=[tk])
    loss, logits = jm(x, targets)
    fwd = ops_of(thunder.last_traces(jm)[-1])
    assert "tk_cross_entropy_forward_grad" in fwd and "tk_cross_entropy_forward_grad_over_logits" not in fwd
    expected = model.lm_head(model.norm(x.detach()))
    assert rel_err(logits, expected) < 1e-2  # the logits, not softmax - onehot
    (loss + 0 * logits.float().sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_callers_logits_are_not_overwritten(standin_tk_build):
    """Logits handed in by the caller (a trace input, not a GEMM's output inside it) stay as they were."""
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(16, CLASSES, generator=g).to(bf16).requires_grad_()
    targets = torch.randint(0, CLASSES, (16,), generator=g)
    before = logits.detach().clone()
    jf = thunder.jit(lambda z, t: F.cross_entropy(z, t), executors=[tk])
    loss = jf(logits, targets)
    loss.backward()
    fwd = ops_of(thunder.last_traces(jf)[-1])
    assert "tk_cross_entropy_forward_grad" in fwd and "tk_cross_entropy_forward_grad_over_logits" not in fwd
    assert torch.equal(logits.detach(), before)
    ref = logits.detach().double().requires_grad_()
    F.cross_entropy(ref, targets).backward()
    assert rel_err(logits.grad, ref.grad) < 3e-2


def test_overwriting_turned_off_by_env(standin_tk_build, monkeypatch):
    from thunder_tk import pattern_fusion

    monkeypatch.setenv("THUNDER_TK_DISABLE", pattern_fusion.OVERWRITE_LOGITS)
    model = LMHeadLoss().to(bf16)
    jm, loss, x_grad, grads, x, targets = run(model)
    fwd = ops_of(thunder.last_traces(jm)[-1])
    assert "tk_cross_entropy_forward_grad" in fwd and "tk_cross_entropy_forward_grad_over_logits" not in fwd
    assert_matches_reference(model, loss, x_grad, grads, x, targets)


def test_lm_head_bias_keeps_an_explicit_scaling(standin_tk_build):
    """The bias gradient sums the scaled gradient's rows, a use that is not a GEMM: the scaling of D stays, and D is
    still written over the logits (the GEMM's own output, read by nothing else)."""
    model = LMHeadLoss(bias=True).to(bf16)
    jm, loss, x_grad, grads, x, targets = run(model)
    assert "tk_cross_entropy_forward_grad_over_logits" in ops_of(thunder.last_traces(jm)[-1])
    scaled = [b for b in thunder.last_backward_traces(jm)[-1].bound_symbols if b.sym.name == "tk_scale_rows"]
    assert len(scaled) == 1 and tuple(scaled[0].output.shape) == (16, CLASSES)
    assert_matches_reference(model, loss, x_grad, grads, x, targets)


def test_scale_rows_computes_in_fp32():
    """ops.scale_rows (the unfolded scaling) reads t in bf16 and g in fp32 and rounds once: the same as through an
    fp32 copy of t, for any strides and a broadcast g."""
    from thunder_tk import ops

    g = torch.Generator().manual_seed(3)
    t = torch.randn(1000, 37, generator=g).to(bf16)
    scale = torch.randn(2000, generator=g)[::2] * 1e-3  # a strided incoming gradient
    expected = (t.float() * scale.unsqueeze(1)).to(bf16)
    assert torch.equal(ops.scale_rows(t, scale), expected)
    assert torch.equal(ops.scale_rows(t.t().contiguous().t(), scale), expected)
    one = torch.tensor(1 / 3).expand(1000)  # mean reduction: one value for every row
    assert torch.equal(ops.scale_rows(t, one), (t.float() * one[0]).to(bf16))
    with pytest.raises(ValueError, match="scale_rows takes"):
        ops.scale_rows(t, scale[:-1])
    assert torch.equal(ops.scale_rows(t, scale.to(bf16)), (t.float() * scale.to(bf16).float().unsqueeze(1)).to(bf16))


# ------------------------------------------------------------------------------------------------
# SwiGLU: LLaMA's MLP, silu(fc_1(x)) * fc_2(x), its two products in one tk_swiglu_linear launch.


def swiglu_ops(jm):
    fwd = thunder.last_traces(jm)[-1]
    return [b.sym.name for b in fwd.bound_symbols if b.sym.name.startswith("tk_")]


def run_swiglu(model, *, grad=True, **compile_options):
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 16, model.fc_1.in_features, generator=g).to(bf16)
    jm = thunder.jit(model, executors=[tk], **compile_options)
    ref = copy.deepcopy(model).double()  # its own parameters, so that their gradients are the reference's
    xr = x.double().requires_grad_(grad)
    expected = ref(xr)
    if not grad:
        with torch.no_grad():
            return jm, jm(x), expected, None, None
    xj = x.clone().requires_grad_()
    out = jm(xj)
    cot = torch.randn(out.shape, generator=g).to(bf16)
    out.backward(cot)
    expected.backward(cot.double())
    grads = {n: (p.grad, rp.grad) for (n, p), rp in zip(model.named_parameters(), ref.parameters())}
    return jm, out, expected, (xj.grad, xr.grad), grads


@pytest.mark.parametrize("swap", [False, True], ids=["silu-first", "silu-second"])
def test_swiglu_products_in_one_launch_in_training(standin_tk_build, swap):
    """The forward runs tk_swiglu_linear for fc_1 and fc_2 (h1 and h2 saved for the backward as before), the
    backward is unchanged, and the result and every gradient match float64 eager."""
    model = SwiGLU(swap=swap).to(bf16)
    jm, out, expected, (dx, dx_ref), grads = run_swiglu(model)
    assert swiglu_ops(jm) == ["tk_swiglu_linear", "tk_linear"]
    ran_by = [r.ran_by for r in thunder_tk.explain(jm).rows if r.trace == "forward"]
    assert ran_by == ["tk: tk_swiglu_linear"] * 2 + ["tk: tk_linear"]
    assert rel_err(out, expected) < 2e-2
    assert rel_err(dx, dx_ref) < 3e-2
    for name, (got, want) in grads.items():
        assert rel_err(got, want) < 3e-2, name
    saved = [p for p in thunder.last_traces(jm)[-1].bound_symbols[-1].flat_proxy_args
             if getattr(p, "dtype", None) is not None and p.ndim == 3]
    assert all(p.dtype == thunder.bfloat16 for p in saved), "no float32 copies of the MLP's products saved"


def test_swiglu_in_inference(standin_tk_build):
    jm, out, expected, _, _ = run_swiglu(SwiGLU().to(bf16), grad=False)
    assert swiglu_ops(jm) == ["tk_swiglu_linear", "tk_linear"]
    assert rel_err(out, expected) < 2e-2


def swiglu_notes(jm):
    """explain's detail on the forward's linear rows that tk ran apart where SwiGLU's launch could not be used."""
    return [r.detail for r in thunder_tk.explain(jm).rows
            if r.trace == "forward" and r.detail.startswith("SwiGLU's products not in one launch: ")]


@pytest.mark.parametrize("how", ["option", "env", "build"])
def test_swiglu_turned_off_keeps_two_gemms(standin_tk_build, monkeypatch, how):
    options = turned_off(how, pattern_fusion.SWIGLU, "gemm_swiglu", standin_tk_build, monkeypatch)
    jm, out, expected, _, _ = run_swiglu(SwiGLU().to(bf16), **options)
    assert swiglu_ops(jm).count("tk_linear") == 3 and "tk_swiglu_linear" not in swiglu_ops(jm)
    assert rel_err(out, expected) < 2e-2
    why = "gemm_swiglu not in this build" if how == "build" else "turned off ("
    notes = swiglu_notes(jm)
    assert len(notes) == 2 and all(why in n for n in notes), notes  # on fc_1's row and fc_2's


@pytest.mark.parametrize("model, why", [
    pytest.param(lambda: SwiGLU(bias=True), "a product has a bias", id="fc_2-bias"),
    pytest.param(lambda: SwiGLU(hidden=100), "the MLP width (100) and K (64) must be multiples of 8",
                 id="hidden-not-multiple-of-8"),
])
def test_swiglu_left_apart_where_the_launch_cannot_take_it(standin_tk_build, model, why):
    jm, out, expected, _, _ = run_swiglu(model().to(bf16))
    assert "tk_swiglu_linear" not in swiglu_ops(jm)
    assert rel_err(out, expected) < 2e-2
    notes = swiglu_notes(jm)
    assert len(notes) == 2 and all(why in n for n in notes), notes


def casts_of(trace, dtype=thunder.bfloat16):
    """The (input name, ...) of each top-level cast to `dtype` in a trace, fused regions' casts included."""
    def walk(bsyms):
        for b in bsyms:
            if b.sym.name == "convert_element_type" and b.args[1] == dtype:
                yield b.args[0].name
            yield from walk(b.subsymbols) if b.sym.is_fusion else ()
    return list(walk(trace.bound_symbols))


@pytest.mark.parametrize("merge", [True, False], ids=["merged", "cast_merge-off"])
def test_swiglu_under_autocast_reads_one_cast_of_x(standin_tk_build, request, merge):
    """bf16-mixed (LitGPT's default precision): fp32 parameters, the forward under autocast, which casts x for fc_1
    and again for fc_2. The two casts are merged (`merge_repeated_casts`), so the products are one
    tk_swiglu_linear launch and its backward one tk_matmul_swiglu_grad, x is cast (and saved) once, and the
    gradients (fp32, like the parameters) match float64 eager. With `cast_merge` off the two casts stay and so do
    the three GEMMs."""
    request.getfixturevalue("standin_nvfuser")
    model = SwiGLU()
    g = torch.Generator().manual_seed(5)
    x = torch.randn(2, 16, model.fc_1.in_features, generator=g)
    jm = thunder.jit(model, executors=[tk], **({} if merge else {"tk_disable": "cast_merge"}))
    ref = copy.deepcopy(model).double()
    xj, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    with torch.autocast("cpu", dtype=bf16):
        out = jm(xj)
    expected = ref(xr)
    cot = torch.randn(out.shape, generator=g)
    out.backward(cot.to(out.dtype))
    expected.backward(cot.double())
    fwd = thunder.last_traces(jm)[-1]
    if merge:
        assert swiglu_ops(jm) == ["tk_swiglu_linear", "tk_linear"]
        assert "tk_matmul_swiglu_grad" in backward_ops(jm)
    else:
        assert swiglu_ops(jm).count("tk_linear") == 3
        assert swiglu_notes(jm) == ["SwiGLU's products not in one launch: fc_1 and fc_2 read two casts of one tensor "
                                    "(cast_merge turned off)"] * 2
    x_casts = [name for name in casts_of(fwd) if name == fwd.args[0].name]
    assert len(x_casts) == (1 if merge else 2), casts_of(fwd)
    assert rel_err(out, expected) < 3e-2
    assert rel_err(xj.grad, xr.grad) < 3e-2
    for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and rel_err(p.grad, rp.grad) < 3e-2, name


@pytest.mark.parametrize("how", ["on", "default", "option", "env", "build"])
def test_products_cast_to_fp32_are_written_in_fp32(standin_tk_build, request, monkeypatch, how):
    """bf16-mixed: each weight gradient is a bf16 product cast to the fp32 parameter's dtype, and fc_1's and fc_2's
    input gradients are cast to fp32 and added. With THUNDER_TK_GEMM_FP32_OUT=1, `widen_products` has their launches
    write fp32 (tk_matmul_fp32 for the three weight gradients, one tk_matmul_sum_fp32 for the input gradient), so no
    cast of a product is left and the gradients match float64 eager. By default, and turned off (option,
    THUNDER_TK_DISABLE, a build without gemm_fp32): the bf16 launches and the casts stay."""
    request.getfixturevalue("standin_nvfuser")
    if how != "default":
        monkeypatch.setenv(pattern_fusion.GEMM_FP32_OUT_ENV, "1")
    options = {} if how in ("on", "default") else turned_off(how, pattern_fusion.GEMM_FP32_OUT, "gemm_fp32",
                                                              standin_tk_build, monkeypatch)
    model = SwiGLU()
    g = torch.Generator().manual_seed(7)
    x = torch.randn(2, 16, model.fc_1.in_features, generator=g)
    jm = thunder.jit(model, executors=[tk], **options)
    ref = copy.deepcopy(model).double()
    xj, xr = x.clone().requires_grad_(), x.double().requires_grad_()
    with torch.autocast("cpu", dtype=bf16):
        out = jm(xj)
    cot = torch.randn(out.shape, generator=g)
    out.backward(cot.to(out.dtype))
    ref(xr).backward(cot.double())
    ops_run = backward_ops(jm)
    bwd = thunder.last_backward_traces(jm)[-1]
    widened = [b.output for b in bwd.bound_symbols if b.sym.name in ("tk_matmul_fp32", "tk_matmul_sum_fp32")]
    if how == "on":
        assert ops_run.count("tk_matmul_fp32") == 3 and ops_run.count("tk_matmul_sum_fp32") == 1, ops_run
        assert "tk_matmul" not in ops_run and "tk_matmul_sum" not in ops_run, ops_run
        assert all(p.dtype == thunder.float32 for p in widened)
        assert casts_of(bwd, thunder.float32) == [], casts_of(bwd, thunder.float32)
    else:
        assert not widened and ops_run.count("tk_matmul") == 5, ops_run  # fc_1's and fc_2's dX apart (fp32 add)
        assert len(casts_of(bwd, thunder.float32)) >= 4  # three weight gradients and the input gradient's two
    ran_by = [r.ran_by for r in thunder_tk.explain(jm).rows if r.trace == "backward"]
    assert ("tk: tk_matmul_fp32" in ran_by) == (how == "on"), ran_by
    assert rel_err(xj.grad, xr.grad) < 3e-2
    for (name, p), rp in zip(model.named_parameters(), ref.parameters()):
        assert p.grad.dtype == torch.float32 and rel_err(p.grad, rp.grad) < 3e-2, name


def test_bf16_training_casts_nothing_to_fp32(standin_tk_build, monkeypatch):
    """bf16-true: the MLP's products stay bf16 launches; nothing is widened."""
    monkeypatch.setenv(pattern_fusion.GEMM_FP32_OUT_ENV, "1")
    jm, out, expected, (dx, dx_ref), grads = run_swiglu(SwiGLU().to(bf16))
    assert "tk_matmul_fp32" not in backward_ops(jm) and "tk_matmul_sum_fp32" not in backward_ops(jm)


# SwiGLU's backward: the output projection's dX GEMM and the ~20 elementwise ops of silu(h1) * h2's gradient in one
# tk_matmul_swiglu_grad launch.


def backward_ops(jm):
    return [b.sym.name for b in thunder.last_backward_traces(jm)[-1].bound_symbols
            if b.sym.name.startswith("tk_") or b.sym.name in ("silu", "exp", "neg", "sigmoid")]


@pytest.mark.parametrize("fuser", [False, True], ids=["no-fuser", "fuser"])
@pytest.mark.parametrize("swap", [False, True], ids=["silu-first", "silu-second"])
def test_swiglu_backward_in_the_projection_gemm(standin_tk_build, request, swap, fuser):
    """One tk_matmul_swiglu_grad replaces proj's dX product and the whole elementwise gradient (nothing recomputes
    silu or exponentials any more), the weight gradients read its dh1 and dh2, and every gradient matches float64
    eager with the model's own float64 copy. With a fuser in the executors (the GPU's case) tk's rewrites see the
    joint trace's prims and ltorch ops; without one, the backward trace's torch ops."""
    if fuser:
        request.getfixturevalue("standin_nvfuser")
    jm, out, expected, (dx, dx_ref), grads = run_swiglu(SwiGLU(swap=swap).to(bf16))
    ops_run = backward_ops(jm)
    assert ops_run.count("tk_matmul_swiglu_grad") == 1, ops_run
    assert not {"silu", "exp", "neg", "sigmoid"} & set(ops_run), ops_run
    assert ops_run.count("tk_matmul") == 3  # proj's dW, fc_1's and fc_2's dW
    assert ops_run.count("tk_matmul_sum") == 1  # fc_1's and fc_2's dX, summed (sum_products)
    ran_by = sorted(r.ran_by for r in thunder_tk.explain(jm).rows if r.trace == "backward")
    assert "tk: tk_matmul_swiglu_grad" in ran_by and not any("decomposed" in r for r in ran_by), ran_by
    assert rel_err(dx, dx_ref) < 3e-2
    for name, (got, want) in grads.items():
        assert rel_err(got, want) < 3e-2, name


@pytest.mark.parametrize("how", ["option", "env", "build"])
def test_swiglu_backward_turned_off_keeps_the_elementwise_ops(standin_tk_build, monkeypatch, how):
    options = turned_off(how, pattern_fusion.SWIGLU_GRAD, "gemm_swiglu_grad", standin_tk_build, monkeypatch)
    jm, out, expected, (dx, dx_ref), grads = run_swiglu(SwiGLU().to(bf16), **options)
    ops_run = backward_ops(jm)
    assert "tk_matmul_swiglu_grad" not in ops_run and "silu" in ops_run
    assert ops_run.count("tk_matmul") == 4 and ops_run.count("tk_matmul_sum") == 1
    assert rel_err(dx, dx_ref) < 3e-2
    assert swiglu_ops(jm) == ["tk_swiglu_linear", "tk_linear"]  # the forward's fusion is its own switch


@pytest.mark.parametrize("fuser", [False, True], ids=["no-fuser", "fuser"])
@pytest.mark.parametrize("act", [torch.sigmoid, F.gelu], ids=["glu-sigmoid", "geglu"])
def test_other_gates_are_not_taken_for_swiglu(standin_tk_build, request, act, fuser):
    """GLU and GEGLU backwards have the same shape (dg, h1, h2 to two gradients by elementwise ops), so only the probe
    tells them apart: they must stay with the fuser, with correct gradients."""
    if fuser:
        request.getfixturevalue("standin_nvfuser")
    jm, out, expected, (dx, dx_ref), grads = run_swiglu(SwiGLU(act=act).to(bf16))
    assert "tk_matmul_swiglu_grad" not in backward_ops(jm)
    assert rel_err(dx, dx_ref) < 3e-2
    for name, (got, want) in grads.items():
        assert rel_err(got, want) < 3e-2, name


def test_swiglu_backward_probe_tells_the_roles_apart():
    """The probe on a hand-written region: h1 and h2 given in either order, and the outputs in either order, come back
    as (h1, h2, dh1, dh2); a region computing dg * silu(h1) twice matches nothing."""
    def region_of(fn):  # the torch executor's ops, as the backward trace has them
        jfn = thunder.jit(fn, executors=[])
        jfn(*(torch.randn(4, 16, dtype=bf16) for _ in range(3)))
        trace = thunder.last_traces(jfn)[-1]
        bsyms = [b for b in trace.bound_symbols if b.sym.name in pattern_fusion._GATE_GRAD_OPS]
        dg, h1, h2 = trace.args
        outs = list(trace.output)
        return bsyms, dg, h1, h2, outs

    def grads(dg, h1, h2):
        s = torch.sigmoid(h1.float())
        return ((dg.float() * h2.float() * s * (1 + h1.float() * (1 - s))).to(bf16),
                (dg.float() * h1.float() * s).to(bf16))

    bsyms, dg, h1, h2, outs = region_of(grads)
    region = set(range(len(bsyms)))
    for inputs in ([h1, h2], [h2, h1]):
        for outputs in (outs, outs[::-1]):
            roles = pattern_fusion._gate_grad_roles(bsyms, region, dg, inputs, outputs)
            assert roles is not None
            assert [p.name for p in roles] == [h1.name, h2.name, outs[0].name, outs[1].name]
    bsyms, dg, h1, h2, outs = region_of(lambda dg, h1, h2: (grads(dg, h1, h2)[1], grads(dg, h1, h2)[1]))
    assert pattern_fusion._gate_grad_roles(bsyms, set(range(len(bsyms))), dg, [h1, h2], outs) is None


def test_swiglu_backward_left_apart_above_the_measured_width(standin_tk_build, monkeypatch):
    """MLPs wider than SWIGLU_GRAD_MAX_N keep tk's dX GEMM and the fuser's kernel (their launch measured slower)."""
    monkeypatch.setattr(pattern_fusion, "SWIGLU_GRAD_MAX_N", 64)  # the model's MLP is 128 wide
    jm, out, expected, (dx, dx_ref), grads = run_swiglu(SwiGLU().to(bf16))
    assert "tk_matmul_swiglu_grad" not in backward_ops(jm)
    assert rel_err(dx, dx_ref) < 3e-2


# ------------------------------------------------------------------------------------------------
# Two products that meet in an add, in one tk_matmul_sum launch (sum_products): LLaMA's MLP input gradient.


def run_sum(fn, *, shapes=((24, 32), (32, 40), (24, 16), (16, 40)), **compile_options):
    g = torch.Generator().manual_seed(5)
    args = [torch.randn(s, generator=g).to(bf16) for s in shapes]
    jm = thunder.jit(fn, executors=[tk], **compile_options)
    return jm, jm(*args), [a.double() for a in args]


def forward_tk_ops(jm):
    return [b.sym.name for b in thunder.last_traces(jm)[-1].bound_symbols if b.sym.name.startswith("tk_")]


@pytest.mark.parametrize("fuser", [False, True], ids=["no-fuser", "fuser"])
def test_products_that_meet_in_an_add_run_as_one_launch(standin_tk_build, request, fuser):
    """a @ b + c @ d is one tk_matmul_sum (the add gone too), its result float64's rounded once; explain names the
    launch for both products."""
    if fuser:
        request.getfixturevalue("standin_nvfuser")
    jm, out, (a, b, c, d) = run_sum(lambda a, b, c, d: a @ b + c @ d)
    assert forward_tk_ops(jm) == ["tk_matmul_sum"]
    assert not any(b.sym.name == "add" for b in thunder.last_traces(jm)[-1].bound_symbols)
    assert torch.equal(out, (a @ b + c @ d).to(bf16))
    rows = [r for r in thunder_tk.explain(jm).rows if r.symbol == "ltorch.matmul"]
    assert [r.ran_by for r in rows] == ["tk: tk_matmul_sum"] * 2, rows
    assert all(r.detail.startswith("summed with the other product of an add in one launch") for r in rows), rows


def test_products_reshaped_before_the_add_run_as_one_launch(standin_tk_build):
    """Each product through one reshape or view to the add's shape (as Thunder writes a linear's input gradient):
    one launch, the add a reshape of its result."""
    jm, out, (a, b, c, d) = run_sum(lambda a, b, c, d: (a @ b).reshape(6, 4, 40) + (c @ d).view(6, 4, 40))
    assert forward_tk_ops(jm) == ["tk_matmul_sum"]
    assert torch.equal(out, (a @ b + c @ d).to(bf16).reshape(6, 4, 40))


@pytest.mark.parametrize("fn", [
    pytest.param(lambda a, b, c, d: torch.add(a @ b, c @ d, alpha=2), id="alpha"),
    pytest.param(lambda a, b, c, d: a @ b - c @ d, id="difference"),
    pytest.param(lambda a, b, c, d: (lambda p: (p + c @ d, p))(a @ b), id="product-read-elsewhere"),
    pytest.param(lambda a, b, c, d: (a @ b).float() + c @ d, id="promoted"),
    pytest.param(lambda a, b, c, d: a @ b + (c @ d)[:1], id="broadcast"),
])
def test_sums_the_launch_cannot_stand_for_stay_apart(standin_tk_build, fn):
    """Scaled, subtracted, promoted or broadcast operands, or a product also read elsewhere: two launches and the
    add, with results as eager's."""
    jm, out, args = run_sum(fn)
    assert "tk_matmul_sum" not in forward_tk_ops(jm)
    want = fn(*args)
    for got, ref in zip(out if isinstance(out, tuple) else (out,), want if isinstance(want, tuple) else (want,)):
        assert rel_err(got, ref) < 1e-2


@pytest.mark.parametrize("how", ["option", "env", "build"])
def test_sum_turned_off_keeps_two_launches(standin_tk_build, monkeypatch, how):
    options = turned_off(how, pattern_fusion.GEMM_SUM, "gemm_sum", standin_tk_build, monkeypatch)
    jm, out, (a, b, c, d) = run_sum(lambda a, b, c, d: a @ b + c @ d, **options)
    assert forward_tk_ops(jm) == ["tk_matmul", "tk_matmul"]
    assert rel_err(out, a @ b + c @ d) < 1e-2


@pytest.mark.parametrize("fuser", [False, True], ids=["no-fuser", "fuser"])
def test_mlp_input_gradient_is_one_launch(standin_tk_build, request, fuser):
    """LLaMA's MLP: fc_1's and fc_2's dX (through their reshapes to the input's shape) come from one
    tk_matmul_sum, explain says so on both linears' rows, and x's gradient matches float64 eager."""
    if fuser:
        request.getfixturevalue("standin_nvfuser")
    jm, out, expected, (dx, dx_ref), grads = run_swiglu(SwiGLU().to(bf16))
    assert backward_ops(jm).count("tk_matmul_sum") == 1
    summed = [r for r in thunder_tk.explain(jm).rows if r.trace == "backward" and r.ran_by == "tk: tk_matmul_sum"]
    assert len(summed) == 2, thunder_tk.explain(jm)
    assert rel_err(dx, dx_ref) < 3e-2


def test_fp32_output_switch_names_a_bad_value(standin_tk_build, monkeypatch):
    monkeypatch.setenv(pattern_fusion.GEMM_FP32_OUT_ENV, "yes")
    with pytest.raises(ValueError, match="THUNDER_TK_GEMM_FP32_OUT='yes': expected 0 or 1"):
        run_swiglu(SwiGLU().to(bf16))


def test_rewritten_traces_say_which_rewrite_made_them():
    """A rewrite's trace is labelled after dead-code removal (which labels its own), as a comment that prints as
    Python."""
    from thunder.core.trace import from_trace

    jf = thunder.jit(lambda x: (x * 2).sin())
    jf(torch.randn(3))
    trace = thunder.last_traces(jf)[-1]
    source = str(pattern_fusion._rewritten(from_trace(trace), list(trace.bound_symbols), "tk: a test rewrite"))
    assert source.splitlines()[0] == "# Constructed by tk: a test rewrite"
    compile(source, "trace", "exec")
