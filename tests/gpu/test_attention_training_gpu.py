"""tk's attention inside real training code on an sm_90 GPU: a LitGPT model jitted with executors=[tk] runs every
attention forward and backward on tk with gradients as good as eager PyTorch's in the same dtype, and the ops
capture into a CUDA graph (no host synchronisation in the launch path)."""

import pytest
import torch
import thunder

import thunder_tk
from accuracy import rel_err
from litgpt_training import step_as_accurately_as_eager
from thunder_tk import ops, tk

pytestmark = pytest.mark.gpu


def test_litgpt_gpt_trains_with_tk_attention_as_accurately_as_eager():
    litgpt = pytest.importorskip("litgpt")
    # Every attention of forward and backward must run on tk, as accurately as eager (litgpt_training).
    jitted, cfg = step_as_accurately_as_eager(litgpt)

    rows = [r for r in thunder_tk.explain(jitted).rows if r.symbol == "ltorch.scaled_dot_product_attention"]
    assert len(rows) == cfg.n_layer
    for row in rows:  # the backward writes the qkv projection's gradient, LitGPT's rope included
        assert row.ran_by == "tk: tk_attention_forward" and row.backward_ran_by == "tk: tk_attention_backward_qkv", row
    # LitGPT's repeated K/V heads were not made: the kernels read the 2 key/value heads (attend_grouped_kv).
    traces = (thunder.last_traces(jitted)[-1], thunder.last_backward_traces(jitted)[-1])
    ops_taking_kv = [b for t in traces for b in t.bound_symbols if b.sym.name.startswith("tk_attention_")]
    assert len(ops_taking_kv) == 2 * cfg.n_layer
    assert all(b.args[1].shape[1] == b.args[2].shape[1] == 2 for b in ops_taking_kv)


def test_forward_and_backward_replay_from_a_cuda_graph():
    def make(seed):
        g = torch.Generator(device="cuda").manual_seed(seed)
        return [torch.randn(2, 4, 333, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4)]

    q, k, v, grad = make(0)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # first launches (per-device set-up) outside the capture
        o, lse = ops.attention_forward(q, k, v, is_causal=True)
        ops.attention_backward(q, k, v, o, lse, grad, is_causal=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = ops.attention_forward(q, k, v, is_causal=True)
        dq, dk, dv = ops.attention_backward(q, k, v, o, lse, grad, is_causal=True)
    for seed in (1, 2):
        for t, new in zip((q, k, v, grad), make(seed)):
            t.copy_(new)
        graph.replay()
        o_ref, lse_ref = ops.attention_forward(q, k, v, is_causal=True)
        dq_ref, dk_ref, dv_ref = ops.attention_backward(q, k, v, o_ref, lse_ref, grad, is_causal=True)
        assert torch.equal(o, o_ref) and torch.equal(lse, lse_ref)
        assert torch.equal(dk, dk_ref) and torch.equal(dv, dv_ref)
        assert rel_err(dq, dq_ref) < 1e-2  # dQ is summed by atomic adds in varying order


def test_head_dim_256_infers_and_trains_on_tk():
    # Head dim 256 (Gemma's): inference on tk_attention, training on tk's forward and backward, each as accurate as
    # eager bf16 SDPA against float64.
    import torch.nn.functional as F

    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 4, 200, 256, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))

    def f(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    exact = [t.double().requires_grad_() for t in (q, k, v)]
    ref = f(*exact)
    with torch.no_grad():
        jitted = thunder.jit(f, executors=[tk])
        assert rel_err(jitted(q, k, v), ref) < 2e-2
    (row,) = [r for r in thunder_tk.explain(jitted).rows if r.symbol == "ltorch.scaled_dot_product_attention"]
    assert row.ran_by == "tk: tk_attention", row

    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    trained = thunder.jit(f, executors=[tk])
    out = trained(*inputs)
    seed = torch.randn_like(out)
    out.backward(seed)
    f(*eager).backward(seed)
    ref.backward(seed.double())
    assert rel_err(out, ref) < 2e-2
    for t, e, r in zip(inputs, eager, exact):
        assert rel_err(t.grad, r.grad) < 2 * rel_err(e.grad, r.grad) + 1e-3
    (row,) = [r for r in thunder_tk.explain(trained).rows if r.symbol == "ltorch.scaled_dot_product_attention"]
    assert row.ran_by == "tk: tk_attention_forward" and row.backward_ran_by == "tk: tk_attention_backward", row
