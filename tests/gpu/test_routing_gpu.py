"""`executors=[tk]` on a real sm_90 GPU: Thunder's SDPA executor and the torch.compile fuser take what tk declines."""

import pytest
import torch
import thunder

import thunder_tk
from thunder_tk import tk

from models import Block

pytestmark = pytest.mark.gpu


def test_block_trains_with_attention_on_tk_or_thunder_sdpa_and_fused_rest():
    torch.manual_seed(0)
    model = Block(256, 4).cuda().bfloat16()
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    jm = thunder.jit(model, executors=[tk])
    out = jm(x)
    seed = torch.randn_like(out)
    out.backward(seed)
    grads = [p.grad.float() for p in model.parameters()]

    ref_model = Block(256, 4).cuda()
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref = ref_model(x.float())
    ref.backward(seed.float())
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    for g, p in zip(grads, ref_model.parameters()):
        assert ((g - p.grad).norm() / p.grad.norm()).item() < 3e-2

    report = thunder_tk.explain(jm)
    (attn,) = [r for r in report.rows if r.symbol == "ltorch.scaled_dot_product_attention"]
    if "attention_backward" in thunder_tk.compiled_kernels():
        assert attn.claimed_by_tk, str(report)
        assert attn.ran_by == "tk: tk_attention_forward" and attn.backward_ran_by == "tk: tk_attention_backward"
    else:  # tk has the forward only: in training, Thunder's SDPA executor takes forward and backward
        assert not attn.claimed_by_tk and "tk has no attention backward kernel in this build" in attn.reason
        assert attn.ran_by.startswith("sdpa: ") and attn.backward_ran_by.startswith("sdpa: "), str(report)
    fwd = thunder.last_traces(jm)[-1]
    fusions = [b for b in fwd.bound_symbols if b.sym.is_fusion]
    assert fusions and all(b.sym.executor.name == "tk_torchcompile" for b in fusions)


def test_block_inference_runs_attention_on_tk():
    torch.manual_seed(0)
    model = Block(256, 4).cuda().bfloat16().requires_grad_(False)
    x = torch.randn(2, 128, 256, device="cuda", dtype=torch.bfloat16)
    jm = thunder.jit(model, executors=[tk])
    out = jm(x)
    ref_model = Block(256, 4).cuda()
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    with torch.no_grad():
        ref = ref_model(x.float())
    assert ((out.float() - ref).norm() / ref.norm()).item() < 2e-2
    report = thunder_tk.explain(jm)
    (attn,) = [r for r in report.rows if r.symbol == "ltorch.scaled_dot_product_attention"]
    assert attn.claimed_by_tk and attn.ran_by == "tk: tk_attention", str(report)
    assert ("tk_attention", "tk") in [(b.sym.name, getattr(b.sym.executor, "name", None))
                                      for b in thunder.last_traces(jm)[-1].bound_symbols]
