"""rms_norm_fusion.fold_rms_norm on CPU (stand-in kernels in float64 math): LitGPT's RMSNorm, spelled out in Thunder's
trace, becomes tk_rms_norm / tk_add_rms_norm and tk_rms_norm_backward in training and the forward alone in inference,
with gradients as accurate as the fuser's; explain has a row for each norm; switched off, unsupported or not
matching, the fuser keeps the norm and explain says why."""

import pytest
import torch

litgpt = pytest.importorskip("litgpt")

import thunder  # noqa: E402

import thunder_tk  # noqa: E402
from standins import turned_off  # noqa: E402
from thunder_tk import tk  # noqa: E402
from thunder_tk.rms_norm_fusion import RMS_NORM  # noqa: E402

NORM_ROW = "RMSNorm (recognised in the trace)"


@pytest.fixture
def build(standin_tk_build, standin_nvfuser):
    return standin_tk_build


def _model(n_layer=2, seed=0):
    cfg = litgpt.Config.from_name("Llama-3.2-1B", n_layer=n_layer, n_embd=256, n_head=4, n_query_groups=2,
                                  head_size=64, intermediate_size=512, padded_vocab_size=512, block_size=64)
    torch.manual_seed(seed)
    m = litgpt.GPT(cfg).to(torch.bfloat16)
    for p in m.parameters():
        if p.ndim == 1:  # norm weights away from 1, so that a lost weight shows
            p.data = (1 + 0.2 * torch.randn_like(p.float())).to(p.dtype)
    return m, cfg


def _float64_copy(m, cfg):
    ref = litgpt.GPT(cfg).to(torch.float64)
    ref.load_state_dict({k: v.double() for k, v in m.state_dict().items()})
    return ref


def _train_once(m, idx, g, **options):
    jm = thunder.jit(m, executors=[tk], **options)
    out = jm(idx)
    out.float().backward(g)
    return jm, out


def _rel(a, b):
    return float((a.double() - b).norm() / b.norm())


def _count(trace, name):
    return sum(b.sym.name == name for b in trace.bound_symbols)


def test_litgpt_norms_run_on_tk_forward_and_backward_as_accurately_as_the_fuser(build):
    m, cfg = _model()
    ref = _float64_copy(m, cfg)
    idx = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    g = torch.randn(2, 32, 512, generator=torch.Generator().manual_seed(2))
    r = ref(idx)
    r.backward(g.double())
    jm, out = _train_once(m, idx, g)
    fw, bw = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
    norms = 2 * cfg.n_layer + 1
    assert _count(fw, "tk_rms_norm") == 1 and _count(fw, "tk_add_rms_norm") == norms - 1  # the first has no add
    assert _count(bw, "tk_rms_norm_backward") == norms
    assert "rsqrt" not in str(fw) and "pow" not in str(bw)
    folded = {n: _rel(p.grad, q.grad) for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters())}
    out_error = _rel(out, r)

    m.zero_grad(set_to_none=True)
    jm_off, out_off = _train_once(m, idx, g, tk_disable=RMS_NORM)
    assert "rsqrt" in str(thunder.last_traces(jm_off)[-1])
    fuser = {n: _rel(p.grad, q.grad) for (n, p), (_, q) in zip(m.named_parameters(), ref.named_parameters())}
    assert out_error <= 1.5 * _rel(out_off, r) + 1e-3
    for name, error in folded.items():
        assert error <= 1.5 * fuser[name] + 2e-3, (name, error, fuser[name])

    rows = [row for row in thunder_tk.explain(jm).rows if row.symbol == NORM_ROW]
    assert len(rows) == norms and all(row.claimed_by_tk for row in rows)
    assert all("tk_rms_norm_backward" in row.backward_ran_by for row in rows)
    assert sum("residual stream's add" in row.detail for row in rows) == norms - 1


@pytest.mark.parametrize("how", ["option", "env", "build"])
def test_turned_off_the_fuser_keeps_the_norm_and_explain_says_why(build, monkeypatch, how):
    m, _ = _model(n_layer=1)
    options = turned_off(how, RMS_NORM, "rms_norm", build, monkeypatch)
    jm, _ = _train_once(m, torch.randint(0, 512, (2, 16)), torch.randn(2, 16, 512), **options)
    assert "tk_rms_norm" not in str(thunder.last_traces(jm)[-1])
    rows = [row for row in thunder_tk.explain(jm).rows if row.symbol == NORM_ROW]
    assert len(rows) == 3 and not any(row.claimed_by_tk for row in rows)
    want = "not in this build" if how == "build" else "turned off"
    assert all(want in row.reason for row in rows), [row.reason for row in rows]


def test_inference_keeps_the_fusers_norm_and_its_result(build):
    """Inference traces hold the norm as ltorch ops (mean, broadcasting mul, to), which the fold does not read yet:
    the fuser runs it, with the right result."""
    m, cfg = _model(n_layer=1)
    ref = _float64_copy(m, cfg)
    idx = torch.randint(0, 512, (2, 16))
    jm = thunder.jit(m, executors=[tk])
    with torch.no_grad():
        out = jm(idx)
        assert _rel(out, ref(idx)) < 1e-2
    fw = thunder.last_traces(jm)[-1]
    assert _count(fw, "tk_rms_norm") + _count(fw, "tk_add_rms_norm") == 0


def test_unit_offset_weight_folds_and_matches(build):
    """Gemma's RMSNorm (add_unit_offset: the weight is 1 + w): the norm reads the sum, whose gradient is w's."""
    norm = litgpt.model.RMSNorm(64, add_unit_offset=True).to(torch.bfloat16)
    norm.weight.data = (0.3 * torch.randn(64)).to(torch.bfloat16)
    x = torch.randn(3, 5, 64).to(torch.bfloat16).requires_grad_()
    jn = thunder.jit(norm, executors=[tk])
    y = jn(x)
    g = torch.randn(3, 5, 64)
    y.float().backward(g)
    assert _count(thunder.last_backward_traces(jn)[-1], "tk_rms_norm_backward") == 1
    x64, w64 = x.detach().double().requires_grad_(), norm.weight.detach().double().requires_grad_()
    y64 = x64 * torch.rsqrt(x64.square().mean(-1, keepdim=True) + norm.eps) * (1 + w64)
    y64.backward(g.double())
    assert _rel(y, y64) < 1e-2 and _rel(x.grad, x64.grad) < 1e-2 and _rel(norm.weight.grad, w64.grad) < 1e-2


@pytest.mark.parametrize("size, dtype, why", [(100, torch.bfloat16, "not a positive multiple of 8"),
                                               (64, torch.float32, "not in {bfloat16, float16}")])
def test_unsupported_norms_stay_with_the_fuser_and_say_why(build, size, dtype, why):
    norm = litgpt.model.RMSNorm(size).to(dtype)
    x = torch.randn(2, 3, size, dtype=dtype, requires_grad=True)
    jn = thunder.jit(norm, executors=[tk])
    jn(x).float().sum().backward()
    assert "tk_rms_norm" not in str(thunder.last_traces(jn)[-1])
    (row,) = [row for row in thunder_tk.explain(jn).rows if row.symbol == NORM_ROW]
    assert not row.claimed_by_tk and why in row.reason
    short = {torch.bfloat16: "bf16", torch.float32: "f32"}[dtype]
    assert row.inputs == f"{short}[2, 3, {size}], {short}[{size}]"  # the norm's x and weight, as a claimed row's


def test_a_norm_whose_values_are_read_elsewhere_is_left_alone(build):
    """rstd returned beside the output: the norm's internal value has a reader outside its forward and backward."""

    class NormAndScale(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(64))

        def forward(self, x):
            xf = x.float()
            rstd = torch.rsqrt(torch.mean(xf * xf, dim=-1, keepdim=True) + 1e-6)
            return (xf * rstd * self.weight.float()).to(x.dtype), rstd

    mod = NormAndScale().to(torch.bfloat16)
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    jn = thunder.jit(mod, executors=[tk])
    y, rstd = jn(x)
    assert "tk_rms_norm" not in str(thunder.last_traces(jn)[-1])
    (row,) = [row for row in thunder_tk.explain(jn).rows if row.symbol == NORM_ROW]
    assert not row.claimed_by_tk and "read by something else" in row.reason


def test_one_probe_per_kind_of_norm(build, monkeypatch):
    """A model's norms come in three kinds (the first without the residual add, the middle ones, the last without
    the residual's gradient): each kind is probed once, however many layers."""
    from thunder_tk import rms_norm_fusion

    probes = []
    confirmed = rms_norm_fusion._confirmed
    monkeypatch.setattr(rms_norm_fusion, "_confirmed", lambda *a: probes.append(1) or confirmed(*a))
    m, cfg = _model(n_layer=3)
    jm, _ = _train_once(m, torch.randint(0, 512, (2, 16)), torch.randn(2, 16, 512))
    assert _count(thunder.last_backward_traces(jm)[-1], "tk_rms_norm_backward") == 2 * cfg.n_layer + 1
    assert len(probes) == 3
