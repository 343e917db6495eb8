"""The sharing torch.compile fuser: identical regions of a layered model compile once, and results match eager.
On CPU (inductor's C++ backend) with a fuser instance that accepts CPU tensors; the executor's own instance
fuses CUDA tensors only."""

import shutil

import pytest
import torch
import thunder
import thunder.torch as ltorch
from thunder.executors.torchex import ex as pytorch_ex
from thunder.extend import ImplInfo

import thunder_tk.fusion
from thunder_tk.fusion import SharingTorchCompileExecutor, region_key

pytestmark = pytest.mark.skipif(shutil.which("g++") is None and shutil.which("c++") is None,
                                reason="inductor's CPU backend needs a C++ compiler")


class Block(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = torch.nn.LayerNorm(width)
        self.up = torch.nn.Linear(width, 2 * width)
        self.down = torch.nn.Linear(2 * width, width)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))) * 0.5)


def _fuser(name):
    fuser = SharingTorchCompileExecutor(name=name)
    # GEMMs stay outside the regions, as in the real fuser, so each layer gets regions of its own
    fuser._implmap = {op: ImplInfo() for op in pytorch_ex.implmap
                      if not any(w in str(op).lower() for w in ("linear", "matmul"))}
    return fuser


@pytest.mark.parametrize("layers", [1, 6])
def test_identical_layers_share_compiled_regions(layers):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(Block(16) for _ in range(layers)))
    fuser = _fuser(f"test_sharing_{layers}")
    jitted = thunder.jit(model, executors=[fuser])
    x = torch.randn(3, 5, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out = jitted(x)
    ref = model(x_ref)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    out.square().sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref.square().sum().backward()
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=1e-4, atol=1e-5)
    assert fuser.regions_fused >= 2 * layers
    if layers > 1:
        # forward and backward of the middle layers repeat: far fewer functions than regions
        assert fuser.functions_compiled <= fuser.regions_fused // 2, (fuser.functions_compiled, fuser.regions_fused)


def test_region_key_tells_shapes_and_programs_apart():
    def trace_of(fn, *args):
        return thunder.trace()(fn, *args)

    a = trace_of(lambda x: ltorch.sin(x) * 2, torch.randn(4))
    b = trace_of(lambda y: ltorch.sin(y) * 2, torch.randn(4))
    c = trace_of(lambda x: ltorch.sin(x) * 3, torch.randn(4))
    d = trace_of(lambda x: ltorch.sin(x) * 2, torch.randn(5))

    def key(t):
        body = [s for s in t.bound_symbols if s.sym.name not in ("unpack_trivial", "return", "python_return")]
        return region_key(body, list(t.args), [body[-1].output])

    assert key(a) == key(b)  # same program, other names
    assert key(a) != key(c)  # another constant
    assert key(a) != key(d)  # another shape


def test_two_torch_compile_fusers_in_one_trace():
    """Thunder's torch.compile fusers all name their regions TorchCompile<n>; with Thunder's cross-entropy fuser
    and ours in one list (as in Thunder's defaults plus a stand-in fuser) both names would bind to one function
    and a region would run another's code. Ours names its own regions."""
    import thunder.executors.torch_compile as thunder_tc

    xentropy = thunder_tc.TorchCompileExecutor(name="test_xentropy",
                                               required_ops=thunder_tc.torch_compile_xentropy_ex.required_ops)
    xentropy._implmap = {op: ImplInfo() for op in thunder_tc.torch_compile_xentropy_ex._implmap}  # CPU too
    fuser = _fuser("test_sharing_pair")
    head = torch.nn.Linear(16, 40)

    def loss_fn(x, rope, targets):
        logits = head(torch.nn.functional.gelu(x * rope))
        return torch.nn.functional.cross_entropy(logits.reshape(-1, 40).float(), targets.reshape(-1))

    x, rope, targets = torch.randn(1, 6, 16), torch.randn(6, 16), torch.randint(40, (1, 6))
    jitted = thunder.jit(loss_fn, executors=[xentropy, fuser])
    torch.testing.assert_close(jitted(x, rope, targets), loss_fn(x, rope, targets))
    fusions = [(b.sym.name, b.sym.executor.name) for b in thunder.last_traces(jitted)[-1].bound_symbols
               if b.sym.is_fusion]
    assert {ex for _, ex in fusions} == {"test_xentropy", "test_sharing_pair"}, fusions
    assert len({name for name, _ in fusions}) == len(fusions), fusions


class RMSNormBlock(torch.nn.Module):
    """A pre-norm residual block with LitGPT's RMSNorm arithmetic (fp32 inside, the input's dtype out): its
    backward region computes the same bf16 cast twice, once for the residual stream and once for the GEMM."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(1 + 0.1 * torch.randn(width))
        self.proj = torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        xf = x.float()
        normed = xf * torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + 1e-5)
        return x + self.proj((normed * self.weight.float()).to(x.dtype))


def _repeated_expressions(trace, executor):
    """(region, expression) pairs that a region of `executor` computes more than once, and regions returning
    one proxy twice."""
    found = []
    for b in trace.bound_symbols:
        if b.sym.is_fusion and b.sym.executor is executor:
            rhs = [s.rhs for s in b.subsymbols]
            found += [(b.sym.name, str(s).split("#")[0].strip()) for i, s in enumerate(b.subsymbols) if s.rhs in rhs[:i]]
            names = [o.name for o in b.flat_outs]
            found += [(b.sym.name, f"returns {n} twice") for n in set(names) if names.count(n) > 1]
    return found


def test_regions_compute_each_expression_once(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(RMSNormBlock(32), RMSNormBlock(32)).to(torch.bfloat16)
    reference = torch.nn.Sequential(RMSNormBlock(32), RMSNormBlock(32)).to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    fuser = _fuser("test_cse")
    jitted = thunder.jit(model, executors=[fuser])
    x = torch.randn(3, 7, 32, dtype=torch.bfloat16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    out, ref = jitted(x), reference(x_ref)

    def close(a, b):  # bf16 on both sides, rounded at different points: the whole tensor's relative error
        assert float((a.float() - b.float()).norm() / b.float().norm()) < 1e-2

    close(out, ref)
    out.float().square().sum().backward()
    ref.float().square().sum().backward()
    close(x.grad, x_ref.grad)
    for p, q in zip(model.parameters(), reference.parameters()):
        close(p.grad, q.grad)
    backward = thunder.last_backward_traces(jitted)[-1]
    assert _repeated_expressions(backward, fuser) == []
    assert _repeated_expressions(thunder.last_traces(jitted)[-1], fuser) == []
    # the merge had something to do: without it the backward's regions repeat a cast
    monkeypatch.setattr(thunder_tk.fusion, "cse_within_regions", lambda trace, executor: trace)
    unmerged_fuser = _fuser("test_cse_off")
    unmerged = thunder.jit(model, executors=[unmerged_fuser])
    unmerged(x).float().square().sum().backward()
    assert _repeated_expressions(thunder.last_backward_traces(unmerged)[-1], unmerged_fuser) != []


def _planned_step(model_name: str, n_layer: int, seq: int):
    """The planned forward and backward traces (sm_90 proxies, nothing run) of a LitGPT model's training step."""
    pytest.importorskip("litgpt")
    from thunder_tk.litgpt_models import build_meta_model, load_spec
    from thunder_tk.planning import trace_planned
    from thunder_tk.pretrain import LossModule

    spec = load_spec(model_name, n_layer=n_layer, seq_len=seq, micro_batch_size=1)
    model = build_meta_model(spec, torch.bfloat16)
    with torch.device("meta"):
        x = torch.randint(spec.config.padded_vocab_size, (1, seq))
    jitted = trace_planned(LossModule(model), [x, x.clone()])
    return thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1]


def test_regions_of_views_alone_run_as_their_ops(monkeypatch):
    """A planned LitGPT step: no region of tk's fuser is made of views alone (those run as plain view calls, cheaper
    on the host than a compiled call), and every tk op is still there. With the feature off
    (THUNDER_TK_DISABLE=view_calls) such regions stay."""
    from thunder_tk.fusion import VIEW_CALLS, VIEW_OPS

    def planned():
        traces = _planned_step("Llama-3.2-1B", 2, 256)
        regions = [b for t in traces for b in t.bound_symbols if b.sym.is_fusion]
        views_alone = [b for b in regions if all(s.sym.name in VIEW_OPS for s in b.subsymbols)]
        tk_ops = [b.sym.name for t in traces for b in t.bound_symbols if b.sym.executor is not None
                  and b.sym.executor.name == "tk"]
        return regions, views_alone, tk_ops

    regions, views_alone, tk_ops = planned()
    assert regions and not views_alone
    assert "tk_attention_forward" in tk_ops and "tk_attention_backward_qkv" in tk_ops and len(tk_ops) >= 40
    monkeypatch.setenv("THUNDER_TK_DISABLE", VIEW_CALLS)
    regions_kept, views_alone, tk_ops_kept = planned()
    assert len(views_alone) >= 10 and len(regions_kept) == len(regions) + len(views_alone)
    assert tk_ops_kept == tk_ops


def _round_trip_region(source_dtype, middle, *, also_return_input=False):
    """A trace whose two casts (source_dtype -> middle -> source_dtype) sit in one region of tk's fuser, and what
    `_as_plain_calls` makes of that region."""
    from thunder.core import dtypes, prims
    from thunder.core.symbol import BoundSymbol, Symbol
    from thunder.core.utils import consumers

    from thunder_tk import tk
    from thunder_tk.fusion import _as_plain_calls

    def f(x):
        back = prims.convert_element_type(prims.convert_element_type(x, getattr(dtypes, middle)), source_dtype)
        return (back, x) if also_return_input else back

    trace = thunder.trace(inline_trace=False)(f, torch.randn(4, dtype=thunder.torch.to_torch_dtype(source_dtype)))
    casts = [b for b in trace.bound_symbols if b.sym.name == "convert_element_type"]
    region = BoundSymbol(Symbol("region", meta=None, is_fusion=True, executor=tk.default_fuser()),
                         args=tuple(casts[0].args[:1]), kwargs={}, output=casts[1].output, subsymbols=casts)
    trace.bound_symbols = [region if b is casts[0] else b for b in trace.bound_symbols if b is not casts[1]]
    return _as_plain_calls(region, consumers(trace)), casts


@pytest.mark.parametrize("source, middle", [("bfloat16", "float32"), ("float16", "float32"), ("float32", "float64")])
def test_a_cast_to_a_wider_dtype_and_back_is_its_input(source, middle):
    from thunder.core import dtypes

    calls, casts = _round_trip_region(getattr(dtypes, source), middle)
    assert [c.sym.name for c in calls] == ["shallow_copy"]  # torch runs it as the input itself
    assert calls[0].args[0] is casts[0].args[0] and calls[0].output is casts[1].output


@pytest.mark.parametrize("source, middle", [("bfloat16", "float16"), ("float32", "bfloat16"), ("float16", "bfloat16")])
def test_a_cast_that_rounds_stays_compiled(source, middle):
    from thunder.core import dtypes

    assert _round_trip_region(getattr(dtypes, source), middle)[0] is None


def test_a_round_trip_whose_input_lives_on_stays_two_tensors():
    from thunder.core import dtypes

    assert _round_trip_region(dtypes.bfloat16, "float32", also_return_input=True)[0] is None


class RoundTrip(torch.nn.Module):
    """Two products with a cast to fp32 and back between them: a region of tk's fuser that computes nothing."""

    def __init__(self, width):
        super().__init__()
        self.a = torch.nn.Linear(width, width, bias=False)
        self.b = torch.nn.Linear(width, width, bias=False)

    def forward(self, x):
        return self.b(self.a(x).float().to(x.dtype))


def test_a_round_trip_region_runs_as_its_input():
    """Beside tk, the fuser's region that casts bf16 to fp32 and back runs as the tensor itself (torch's
    shallow_copy), and the step computes what eager does."""
    torch.manual_seed(0)
    model = RoundTrip(32).to(torch.bfloat16)
    fuser = _fuser("test_round_trip")
    jitted = thunder.jit(model, executors=[thunder_tk.tk, fuser])
    x = torch.randn(3, 32, dtype=torch.bfloat16)
    out = jitted(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=0)
    forward = thunder.last_traces(jitted)[-1]
    assert not [b for b in forward.bound_symbols if b.sym.is_fusion], forward
    assert [b.sym.name for b in forward.bound_symbols if b.sym.name == "shallow_copy"] == ["shallow_copy"]


def test_gemmas_norm_weight_gradients_skip_their_round_trip_regions(monkeypatch):
    """Gemma 3's backward (planned): tk's norm kernel writes the weight gradient in bf16, which the trace casts to
    fp32 and back, each pair a region of its own; those now run as the tensor itself (with view_calls off, they
    stay compiled regions)."""
    from thunder_tk.fusion import VIEW_CALLS

    def casts_alone():
        _, backward = _planned_step("Gemma-3-1b-it", 1, 128)
        return [b for b in backward.bound_symbols if b.sym.is_fusion
                and [s.sym.name for s in b.subsymbols] == ["convert_element_type"] * 2]

    assert not casts_alone()
    monkeypatch.setenv("THUNDER_TK_DISABLE", VIEW_CALLS)
    assert len(casts_alone()) >= 3
