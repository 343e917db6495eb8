"""Fusion regions compiled by inductor and called without dynamo (thunder_tk.direct_regions): one version per input
strides, grad and autocast off inside, the function's own failures raised, and the fuser using them beside tk only.
On CPU (inductor's C++ backend)."""

import shutil

import pytest
import torch
import thunder

import thunder_tk
from thunder_tk.direct_regions import DirectRegion, can_call_directly

from test_fusion import Block, _fuser

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="inductor's CPU backend needs a C++ compiler")


def _region(a, b):
    return [torch.relu(a * 2 + b), a.sum(-1)]


def test_a_version_per_input_strides():
    """Inductor's code is compiled for the strides it saw: a call with other strides (same shapes) compiles a
    version of its own, and each later call runs the version of its strides."""
    region = DirectRegion(_region)
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    a_t = torch.randn(16, 8).t()  # same shape, column-major
    for x, versions in ((a, 1), (a_t, 2), (a, 2), (a_t, 2)):
        out = region(x, b)
        for got, want in zip(out, _region(x, b)):
            torch.testing.assert_close(got, want)
        assert region.compiled == versions


def test_with_size_asserts_off_each_call_picks_its_version():
    from torch._inductor import config

    region = DirectRegion(_region)
    b = torch.randn(8, 16)
    with config.patch(size_asserts=False):
        for x in (torch.randn(8, 16), torch.randn(16, 8).t()):
            torch.testing.assert_close(region(x, b)[0], _region(x, b)[0])
    assert region.compiled == 2


def test_the_functions_own_assertion_is_raised():
    """Only a failed input check of a version compiled for other strides compiles again; an AssertionError at the
    strides of the one version is raised as it came."""
    region = DirectRegion(_region)
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    region(a, b)

    def failing(*args):
        raise AssertionError("inside the region")

    region._first = region._versions[next(iter(region._versions))] = failing
    with pytest.raises(AssertionError, match="inside the region"):
        region(a, b)
    assert region.compiled == 1


def test_grad_and_autocast_are_off_inside_and_restored():
    """As Thunder's regions: no autograd graph and no autocast inside; the caller's modes afterwards."""
    region = DirectRegion(lambda a, b: [a @ b])
    a, b = torch.randn(4, 8, requires_grad=True), torch.randn(8, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        (out,) = region(a, b)
        assert torch.is_autocast_enabled("cpu") and torch.is_grad_enabled()
    assert out.dtype == torch.float32 and not out.requires_grad
    torch.testing.assert_close(out, a.detach() @ b)


def test_tk_s_fuser_calls_regions_directly_and_matches_the_compiled_ones(monkeypatch):
    """Beside tk every all-tensor region is a DirectRegion; outputs and gradients equal those of the same fuser with
    the feature off (torch.compile regions), and the fuser without tk in the list keeps torch.compile."""

    def run(executors):
        torch.manual_seed(0)
        model = Block(16)
        jitted = thunder.jit(model, executors=executors)
        x = torch.randn(3, 5, 16)
        out = jitted(x)
        out.square().sum().backward()
        calls = [b._call_ctx[b.sym.name] for t in (thunder.last_traces(jitted)[-1],
                                                    thunder.last_backward_traces(jitted)[-1])
                 for b in t.bound_symbols if b.sym.is_fusion and b._call_ctx]
        return out, [p.grad for p in model.parameters()], calls

    out, grads, calls = run([thunder_tk.tk, _fuser("test_direct_on")])
    assert calls and all(isinstance(c, DirectRegion) for c in calls)
    monkeypatch.setenv("THUNDER_TK_DISABLE", "direct_regions")
    out_off, grads_off, calls_off = run([thunder_tk.tk, _fuser("test_direct_off")])
    assert calls_off and not any(isinstance(c, DirectRegion) for c in calls_off)
    torch.testing.assert_close(out, out_off, rtol=0, atol=0)
    for g, h in zip(grads, grads_off):
        torch.testing.assert_close(g, h, rtol=1e-6, atol=1e-7)
    monkeypatch.delenv("THUNDER_TK_DISABLE")
    *_, baseline_calls = run([_fuser("test_direct_baseline")])
    assert baseline_calls and not any(isinstance(c, DirectRegion) for c in baseline_calls)


def test_a_region_with_a_number_keeps_torch_compile():
    trace = thunder.trace()(lambda x, s: x * s, torch.randn(4), 2.0)
    x, s = trace.args
    out = next(b for b in trace.bound_symbols if b.sym.name == "mul").output
    assert can_call_directly([x], [out])
    assert not can_call_directly([x, s], [out])


def test_a_region_this_path_cannot_compile_falls_back_to_torch_compile(monkeypatch):
    """What make_fx or inductor's direct compile cannot take runs through torch.compile, with a warning and the
    reason kept; its results are the function's."""
    import torch.fx.experimental.proxy_tensor as proxy_tensor

    def refuse(*args, **kwargs):
        raise RuntimeError("no tracing here")

    monkeypatch.setattr(proxy_tensor, "make_fx", refuse)
    region = DirectRegion(_region)
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    with pytest.warns(UserWarning, match="no tracing here"):
        out = region(a, b)
    assert region.fallback_reason == "RuntimeError: no tracing here" and region.compiled == 0
    for x in (a, torch.randn(16, 8).t()):  # torch.compile's guards take other strides
        for got, want in zip(region(x, b), _region(x, b)):
            torch.testing.assert_close(got, want)
    torch.testing.assert_close(out[0], _region(a, b)[0])
