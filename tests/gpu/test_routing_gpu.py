"""`executors=[tk]` on a real sm_90 GPU: Thunder's SDPA executor and the torch.compile fuser take what tk declines."""

import pytest
import torch
import thunder

import thunder_tk
from thunder_tk import tk

from models import Block

pytestmark = pytest.mark.gpu


def test_block_trains_with_attention_on_thunder_sdpa_and_fused_rest():
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
    assert not attn.claimed_by_tk and "tk has no attention kernel yet" in attn.reason
    assert attn.ran_by.startswith("sdpa: ") and attn.backward_ran_by.startswith("sdpa: "), str(report)
    fwd = thunder.last_traces(jm)[-1]
    fusions = [b for b in fwd.bound_symbols if b.sym.is_fusion]
    assert fusions and all(b.sym.executor.name == "tk_torchcompile" for b in fusions)
