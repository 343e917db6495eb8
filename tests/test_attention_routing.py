"""Attention on real Thunder traces (CPU, with tk's attention kernels standing in: `standins.StandinBuild`).

Inference runs on tk's forward kernel; training runs on tk's forward and backward kernels when the build has
both, and otherwise on the attention executor that takes the gradient (forward and backward), with the reason
in `explain`.
"""

import pytest
import torch
import torch.nn.functional as F
import thunder

import thunder_tk
import thunder_tk.executor as tk_executor
from thunder_tk import tk

SDPA = "ltorch.scaled_dot_product_attention"
bf16 = torch.bfloat16


def ops_of(trace):
    return [(b.sym.name, getattr(b.sym.executor, "name", None)) for b in trace.bound_symbols]


def attention_row(jitted):
    (row,) = [r for r in thunder_tk.explain(jitted).rows if r.symbol == SDPA]
    return row


def qkv(B=2, Hq=4, Hkv=4, Sq=16, Sk=16, D=64, dtype=bf16, requires_grad=False):
    torch.manual_seed(0)
    q = torch.randn(B, Hq, Sq, D, dtype=dtype)
    k, v = torch.randn(B, Hkv, Sk, D, dtype=dtype), torch.randn(B, Hkv, Sk, D, dtype=dtype)
    return [t.requires_grad_(requires_grad) for t in (q, k, v)]


def reference(q, k, v, grad_o=None, **options):
    """Eager PyTorch in float32 from the same (bf16) values: output and, given grad_o, (dq, dk, dv)."""
    ref = [t.detach().float().requires_grad_(grad_o is not None) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, **options)
    if grad_o is None:
        return out, None
    out.backward(grad_o.float())
    return out, [t.grad for t in ref]


def assert_close_bf16(actual, expected):
    # bf16 outputs: an error of a few units in the last place, relative to the tensor's scale
    err = (actual.float() - expected).norm() / expected.norm().clamp_min(1e-6)
    assert err.item() < 1e-2, err.item()


# -- inference -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("hkv,is_causal,scale", [(4, False, None), (4, True, None), (1, True, 0.3), (1, False, 2.0)])
def test_inference_runs_on_tk_attention(standin_tk_build, standin_attention, D, hkv, is_causal, scale):
    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)

    q, k, v = qkv(Hkv=hkv, D=D)
    jf = thunder.jit(f, executors=[tk])
    assert_close_bf16(jf(q, k, v), reference(q, k, v, is_causal=is_causal, scale=scale)[0])
    assert ("tk_attention", "tk") in ops_of(thunder.last_traces(jf)[-1])
    row = attention_row(jf)
    assert row.claimed_by_tk and row.ran_by == "tk: tk_attention" and row.trace == "forward" and not row.reason
    assert f"bf16[2, {hkv}, 16, {D}]" in row.inputs
    assert ("is_causal=True" in row.inputs) == is_causal  # flags that differ from their defaults are shown
    assert ("scale=" in row.inputs) == (scale is not None)


def _mask(q, k, v):
    # Made from an input, so its values are not known when tracing (constant masks: test_attention_masks.py).
    keep = k.sum(-1, keepdim=True).transpose(-1, -2) > -1e30  # keeps every key, but tk cannot know that
    return F.scaled_dot_product_attention(q, k, v, attn_mask=keep)


def _dropout(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, dropout_p=0.5)


def _plain(q, k, v):
    return F.scaled_dot_product_attention(q, k, v)


def _causal(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


@pytest.mark.parametrize(
    "fn, shapes, dtype, reason, fallback",
    [
        (_mask, {}, bf16, "attn_mask is computed from k", None),  # the stand-in executor takes no masks: decomposed
        (_dropout, {}, bf16, "dropout_p=0.5 > 0", None),
        (_plain, {"D": 96}, bf16, "head_dim 96 not in {64, 128, 256}", "standin_sdpa"),
        (_causal, {"Sq": 8, "Sk": 16}, bf16, "causal with Sq=8 != Sk=16", "standin_sdpa"),
        (_plain, {}, torch.float32, "dtype float32 not in {bfloat16, float16}", "standin_sdpa"),
        (_plain, {"Sk": 0}, bf16, "key/value length is 0", "standin_sdpa"),
    ],
    ids=["attn_mask", "dropout", "D96", "causal_Sq_ne_Sk", "fp32", "Sk0"],
)
def test_declined_attention_falls_back_with_its_reason(standin_tk_build, standin_attention, fn, shapes, dtype,
                                                       reason, fallback):
    q, k, v = qkv(dtype=dtype, **shapes)
    jf = thunder.jit(fn, executors=[tk])
    out = jf(q, k, v)
    if fn is not _dropout:
        torch.testing.assert_close(out, fn(q, k, v), equal_nan=True, atol=2e-2, rtol=2e-2)
    row = attention_row(jf)
    assert not row.claimed_by_tk and reason in row.reason, row.reason
    if fallback is not None:
        assert row.ran_by == f"{fallback}: {fallback}_fwd"
    assert all(ex != "tk" for _, ex in ops_of(thunder.last_traces(jf)[-1]))


# -- training ------------------------------------------------------------------------------------------


def run_training(fn, inputs, executors):
    jf = thunder.jit(fn, executors=executors)
    out = jf(*inputs)
    grad_o = torch.randn_like(out)
    out.backward(grad_o)
    return jf, out, grad_o


@pytest.mark.parametrize("hkv,is_causal", [(4, True), (1, False)])
def test_training_without_backward_kernel_goes_to_the_attention_executor(standin_tk_build, standin_attention,
                                                                         hkv, is_causal):
    standin_tk_build.remove("attention_backward")
    inputs = qkv(Hkv=hkv, requires_grad=True)
    jf, out, grad_o = run_training(lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=is_causal),
                                   inputs, [tk])
    ref_out, ref_grads = reference(*inputs, grad_o, is_causal=is_causal)
    assert_close_bf16(out, ref_out)
    for t, g in zip(inputs, ref_grads):
        assert_close_bf16(t.grad, g)
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert ("standin_sdpa_fwd", "standin_sdpa") in ops_of(fwd)
    assert ("standin_sdpa_bwd", "standin_sdpa") in ops_of(bwd)
    assert all(ex != "tk" for _, ex in ops_of(fwd) + ops_of(bwd))
    row = attention_row(jf)
    assert not row.claimed_by_tk
    assert row.reason == ("tk has no attention backward kernel in this build (attention_backward); "
                          "standin_sdpa takes forward and backward")
    assert row.ran_by == "standin_sdpa: standin_sdpa_fwd" and row.backward_ran_by == "standin_sdpa: standin_sdpa_bwd"


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("hkv,is_causal,scale", [(4, True, None), (1, False, None), (2, True, 0.25)])
def test_training_with_backward_kernel_runs_tk_forward_and_backward(standin_tk_build, standin_attention,
                                                                    hkv, is_causal, scale, D):
    standin_tk_build.add("attention_backward")

    def f(q, k, v):
        # Thunder 0.2.6 traces Hkv == Hq or Hkv == 1 only (its sdpa broadcasts heads, it has no enable_gqa),
        # so grouped heads come in expanded by the caller here; Hkv == 1 reaches the kernel as is.
        if 1 < k.shape[1] < q.shape[1]:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)

    inputs = qkv(Hkv=hkv, D=D, requires_grad=True)
    jf, out, grad_o = run_training(f, inputs, [tk])
    expanded = [t.repeat_interleave(4 // t.shape[1], dim=1) if 1 < t.shape[1] < 4 else t for t in inputs]
    ref_out, ref_grads = reference(*expanded, grad_o, is_causal=is_causal, scale=scale)
    if hkv == 2:  # the reference's grads are per expanded head: sum them back
        ref_grads[1:] = [g.view(2, 2, 2, 16, D).sum(2) for g in ref_grads[1:]]
    assert_close_bf16(out, ref_out)
    for t, g in zip(inputs, ref_grads):
        assert t.grad.shape == t.shape and t.grad.dtype == bf16
        assert_close_bf16(t.grad, g)
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert ("tk_attention_forward", "tk") in ops_of(fwd)
    assert ("tk_attention_backward", "tk") in ops_of(bwd)
    assert all(not name.startswith("standin_sdpa") for name, _ in ops_of(fwd) + ops_of(bwd))
    row = attention_row(jf)
    assert row.claimed_by_tk and not row.reason
    assert row.ran_by == "tk: tk_attention_forward" and row.backward_ran_by == "tk: tk_attention_backward"


def test_training_in_an_explicit_list_goes_to_the_listed_attention_executor(standin_tk_build, standin_attention):
    standin_tk_build.remove("attention_backward")
    inputs = qkv(requires_grad=True)
    jf, out, grad_o = run_training(_causal, inputs, [tk, standin_attention])
    ref_out, ref_grads = reference(*inputs, grad_o, is_causal=True)
    for t, g in zip(inputs, ref_grads):
        assert_close_bf16(t.grad, g)
    row = attention_row(jf)
    assert not row.claimed_by_tk and row.reason.endswith("standin_sdpa takes forward and backward")
    assert row.ran_by == "standin_sdpa: standin_sdpa_fwd" and row.backward_ran_by == "standin_sdpa: standin_sdpa_bwd"


def test_training_with_no_attention_executor_differentiates_the_decomposition(standin_tk_build, monkeypatch):
    standin_tk_build.remove("attention_backward")
    monkeypatch.setattr(tk_executor, "ATTENTION_FALLBACKS", ())
    inputs = qkv(requires_grad=True)
    jf, out, grad_o = run_training(_causal, inputs, [tk])
    ref_out, ref_grads = reference(*inputs, grad_o, is_causal=True)
    assert_close_bf16(out, ref_out)
    for t, g in zip(inputs, ref_grads):
        assert_close_bf16(t.grad, g)
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert all(ex != "tk" for _, ex in ops_of(fwd) + ops_of(bwd))
    row = attention_row(jf)
    assert not row.claimed_by_tk
    assert row.reason == ("tk has no attention backward kernel in this build (attention_backward); no executor "
                          "takes its gradient, so Thunder differentiates its decomposition")


def test_model_under_no_grad_runs_tk_forward_and_with_grad_the_fallback(standin_tk_build, standin_attention):
    """A model whose parameters need gradients: called under no_grad it is an inference trace (tk's forward);
    called with grad enabled it is a training trace, where (Thunder 0.2.6 differentiating every floating-point
    symbol) the attention goes with its gradient to the fallback while the build lacks the backward kernel."""
    standin_tk_build.remove("attention_backward")

    class Attend(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.q = torch.nn.Parameter(qkv()[0])

        def forward(self, k, v):
            return _causal(self.q, k, v)

    model, (_, k, v) = Attend(), qkv()
    jm = thunder.jit(model, executors=[tk])
    with torch.no_grad():
        out = jm(k, v)
    assert not out.requires_grad
    assert_close_bf16(out, reference(model.q, k, v, is_causal=True)[0])
    row = attention_row(jm)
    assert row.claimed_by_tk and row.ran_by == "tk: tk_attention" and not row.backward_ran_by

    jm(k, v).float().sum().backward()
    assert model.q.grad is not None
    row = attention_row(jm)
    assert not row.claimed_by_tk and row.ran_by == "standin_sdpa: standin_sdpa_fwd"


def test_rebuilt_with_backward_kernel_a_new_jit_uses_it(standin_tk_build, standin_attention):
    """Thunder keeps no forward/backward split across builds: the route is judged per compilation."""
    inputs = qkv(requires_grad=True)
    standin_tk_build.remove("attention_backward")
    assert not attention_row(run_training(_causal, inputs, [tk])[0]).claimed_by_tk
    standin_tk_build.add("attention_backward")
    assert attention_row(run_training(_causal, inputs, [tk])[0]).claimed_by_tk


# -- grouped K/V repeated by the caller (LitGPT's repeat_interleave) ---------------------------------------------


def _repeated(is_causal=True, extra_use=False):
    def f(q, k, v):
        group = q.shape[1] // k.shape[1]
        k, v = (t.repeat_interleave(group, dim=1) for t in (k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal)
        if extra_use:  # the repeated K read elsewhere too: its gradient is no longer the group sum alone
            o = o + 0.01 * k.float().sin().to(o.dtype)
        return o
    return f


def _tk_op(trace, name):
    (b,) = [b for b in trace.bound_symbols if b.sym.name == name]
    return b


def _reference_grouped(inputs, grad_o, f):
    ref = [t.detach().double().requires_grad_() for t in inputs]
    out = f(*ref)
    out.backward(grad_o.double())
    return out, [t.grad for t in ref]


@pytest.mark.parametrize("B,hkv,is_causal", [(2, 2, True), (1, 2, False), (1, 1, True), (3, 1, False)])
def test_training_reads_repeated_kv_grouped(standin_tk_build, standin_attention, B, hkv, is_causal):
    """k.repeat_interleave(G, dim=1) before attention: tk's forward and backward take the Hkv heads themselves
    (nothing of Hq heads is made or saved for K and V), dk and dv come back summed over the group by the kernel."""
    standin_tk_build.add("attention_backward")
    inputs = qkv(B=B, Hkv=hkv, requires_grad=True)
    f = _repeated(is_causal)
    jf, out, grad_o = run_training(f, inputs, [tk])
    ref_out, ref_grads = _reference_grouped(inputs, grad_o, f)
    assert_close_bf16(out, ref_out.float())
    for t, g in zip(inputs, ref_grads):
        assert t.grad.shape == t.shape and t.grad.dtype == bf16
        assert_close_bf16(t.grad, g.float())
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    for op in (_tk_op(fwd, "tk_attention_forward"), _tk_op(bwd, "tk_attention_backward")):
        assert [tuple(a.shape) for a in op.args[1:3]] == [(B, hkv, 16, 64)] * 2
    assert [tuple(g.shape) for g in _tk_op(bwd, "tk_attention_backward").output[1:]] == [(B, hkv, 16, 64)] * 2
    expanded = (B, hkv, 4 // hkv, 16, 64)
    assert not [p for tr in (fwd, bwd) for b in tr.bound_symbols for p in b.flat_proxy_outs
                if tuple(getattr(p, "shape", ())) == expanded]
    row = attention_row(jf)
    assert row.claimed_by_tk and row.ran_by == "tk: tk_attention_forward"
    assert row.detail == f"K/V read with their {hkv} heads for 4 query heads"
    assert row.detail in str(thunder_tk.explain(jf))


@pytest.mark.parametrize("case", ["disabled", "extra_use"])
def test_repeated_kv_kept_where_the_rewrite_does_not_apply(standin_tk_build, standin_attention, case):
    """Turned off (tk_disable), or the repeated K read by something else as well: the attention takes the Hq heads
    as traced, and the gradients are still right."""
    standin_tk_build.add("attention_backward")
    inputs = qkv(Hkv=2, requires_grad=True)
    f = _repeated(extra_use=case == "extra_use")
    options = {"tk_disable": "attention_grouped_kv"} if case == "disabled" else {}
    jf = thunder.jit(f, executors=[tk], **options)
    out = jf(*inputs)
    grad_o = torch.randn_like(out)
    out.backward(grad_o)
    ref_out, ref_grads = _reference_grouped(inputs, grad_o, f)
    assert_close_bf16(out, ref_out.float())
    for t, g in zip(inputs, ref_grads):
        assert_close_bf16(t.grad, g.float())
    fwd, bwd = thunder.last_traces(jf)[-1], thunder.last_backward_traces(jf)[-1]
    assert _tk_op(fwd, "tk_attention_forward").args[1].shape[1] == 4
    assert _tk_op(bwd, "tk_attention_backward").args[1].shape[1] == 4
    assert attention_row(jf).detail == ""


def test_inference_reads_repeated_kv_grouped(standin_tk_build, standin_attention):
    inputs = qkv(Hkv=1)
    f = _repeated(is_causal=False)
    jf = thunder.jit(f, executors=[tk])
    out = jf(*inputs)
    assert_close_bf16(out, _reference_grouped(inputs, torch.zeros(2, 4, 16, 64), f)[0].float())
    assert _tk_op(thunder.last_traces(jf)[-1], "tk_attention").args[1].shape[1] == 1


# -- a fallback's own shape limits ---------------------------------------------------------------------


@pytest.fixture
def masked_attention(monkeypatch):
    """A CPU attention executor that takes masks, standing where tk looks for cuDNN/SDPA, with Thunder's `sdpa`
    shape limits (FALLBACK_SHAPE_LIMITS): its checker accepts what its memory-efficient kernel then fails on."""
    from thunder.core.proxies import TensorProxy
    from thunder.core.transforms import get_grad, put_grads
    from thunder.extend import OperatorExecutor, deregister_executor, register_executor
    import thunder.torch as ltorch

    ex = OperatorExecutor("masked_sdpa")

    def run(q, k, v, mask, grad_o=None):
        inputs = [t.detach().requires_grad_(grad_o is not None) for t in (q, k, v)]
        with torch.enable_grad():
            out = F.scaled_dot_product_attention(*inputs, attn_mask=mask)
            return out if grad_o is None else torch.autograd.grad(out, inputs, grad_o)

    fwd = ex.register_operator("masked_sdpa_fwd", meta=lambda q, k, v, mask: TensorProxy(like=q),
                               fn=lambda q, k, v, mask: run(q, k, v, mask))
    bwd = ex.register_operator("masked_sdpa_bwd", fn=lambda g, q, k, v, mask: run(q, k, v, mask, g),
                               meta=lambda g, q, k, v, mask: tuple(TensorProxy(like=t) for t in (q, k, v)))

    def checker(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
        return dropout_p == 0.0 and not is_causal and scale is None

    def execution(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
        return fwd(q, k, v, attn_mask)

    def grad(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
        out = fwd(q, k, v, attn_mask)
        put_grads((q, k, v), bwd(get_grad(out), q, k, v, attn_mask))
        return out

    ex.register_implementation(ltorch.scaled_dot_product_attention, checker=checker, execution_transform=execution,
                               grad_transform=grad)
    register_executor(ex)
    monkeypatch.setattr(tk_executor, "ATTENTION_FALLBACKS", (ex.name,))
    monkeypatch.setitem(tk_executor.FALLBACK_SHAPE_LIMITS, ex.name, tk_executor.FALLBACK_SHAPE_LIMITS["sdpa"])
    yield ex
    deregister_executor(ex)


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("mask_batch", [1, 2])
def test_a_mask_sdpa_cannot_take_goes_to_the_decomposition_and_explain_says_why(standin_tk_build, masked_attention,
                                                                               training, mask_batch):
    """A mask broadcast over the batch (LitGPT's sliding window: (1, 1, S, S)) passes Thunder's sdpa checker and
    then fails its memory-efficient kernel's trace-time check: tk hands it to the decomposition instead."""
    q, k, v = qkv(B=2, requires_grad=training)
    mask = torch.rand(mask_batch, 1, 16, 16, generator=torch.Generator().manual_seed(3)) > 0.3
    mask |= torch.eye(16, dtype=torch.bool)  # no row fully masked

    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)

    jf = thunder.jit(fn, executors=[tk])
    out = jf(q, k, v)
    grad_o = torch.randn_like(out)
    want, want_grads = reference(q, k, v, grad_o if training else None, attn_mask=mask)
    assert_close_bf16(out, want)
    if training:
        out.backward(grad_o)
        for t, w in zip((q, k, v), want_grads):
            assert_close_bf16(t.grad, w)
    row = attention_row(jf)
    assert not row.claimed_by_tk and "attn_mask is an input of the traced function" in row.reason, row.reason
    if mask_batch == 1:
        assert "masked_sdpa not used: its memory-efficient kernel needs one batch size for q, k, v and the mask " \
               "(got 2, 2, 2, 1)" in row.reason, row.reason
        assert "masked_sdpa" not in row.ran_by
    else:
        assert row.ran_by == "masked_sdpa: masked_sdpa_fwd", row.ran_by
