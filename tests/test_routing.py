"""Routing on real Thunder traces (CPU): what `executors=[tk]` sends where, alone and in explicit lists."""

import torch
import thunder

import thunder_tk
from thunder_tk import tk
from thunder_tk.planning import plan, trace_planned

from models import Block


def top_level_executors(trace):
    return [(b.sym.name, getattr(b.sym.executor, "name", None)) for b in trace.bound_symbols]


def run_and_compare(model, x, executors):
    jm = thunder.jit(model, executors=executors)
    out = jm(x).sum()
    out.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    ref = model(x).sum()
    ref.backward()
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for g, p in zip(grads, model.parameters()):
        torch.testing.assert_close(g, p.grad, rtol=1e-4, atol=1e-5)
    model.zero_grad()
    return jm


def test_tk_alone_uses_nvfuser_and_the_attention_executor(standin_nvfuser, standin_attention):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    jm = run_and_compare(model, x, [tk])
    fwd, bwd = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
    fwd_ex = top_level_executors(fwd)
    # Declined attention went to the attention executor, forward and backward, not to the decomposed math.
    assert ("standin_sdpa_fwd", "standin_sdpa") in fwd_ex
    assert ("standin_sdpa_bwd", "standin_sdpa") in top_level_executors(bwd)
    # Elementwise work is fused by "nvfuser"; nothing elementwise is left to eager torch.
    assert any(ex == "nvfuser" for _, ex in fwd_ex)
    for trace in (fwd, bwd):
        for b in trace.bound_symbols:
            if getattr(b.sym.executor, "name", None) == "torch":
                assert b.sym.name in ("linear", "matmul") or b.sym.name.startswith("torch_"), b.sym.name
    report = thunder_tk.explain(jm)
    (attn,) = [r for r in report.rows if r.symbol == "ltorch.scaled_dot_product_attention"]
    assert not attn.claimed_by_tk and attn.ran_by == "standin_sdpa: standin_sdpa_fwd"
    assert attn.backward_ran_by == "standin_sdpa: standin_sdpa_bwd"
    assert attn.reason in ("tensor on cpu",) or attn.reason.startswith("kernels not built")


def test_explicit_list_composes_without_double_claims(standin_nvfuser, standin_attention):
    torch.manual_seed(0)
    model, x = Block(), torch.randn(2, 16, 64)
    alone = thunder_tk.explain(run_and_compare(model, x, [tk]))
    for executors in ([tk, standin_attention, standin_nvfuser], ["tk", "standin_sdpa", "nvfuser"],
                      thunder_tk.executors()):
        jm = run_and_compare(model, x, executors)
        fwd = thunder.last_traces(jm)[-1]
        names = [ex for _, ex in top_level_executors(fwd)]
        assert "tk_torchcompile" not in names  # the listed fuser fused, tk did not
        assert "nvfuser" in names and "standin_sdpa" in names
        assert [(r.symbol, r.ran_by.split(":")[0]) for r in thunder_tk.explain(jm).rows] == [
            (r.symbol, r.ran_by.split(":")[0]) for r in alone.rows
        ]


def test_executors_amounts_to_tk_attention_and_fuser(standin_nvfuser):
    names = [ex.name for ex in thunder_tk.executors()]
    assert names[0] == "tk" and names[-1] == "nvfuser"
    assert "sdpa" in names and names.index("sdpa") < names.index("nvfuser")


def test_without_nvfuser_the_torch_compile_fuser_is_used():
    assert thunder.extend.get_executor("nvfuser") is None
    assert tk.default_fuser().name == "tk_torchcompile"
    assert [ex.name for ex in thunder_tk.executors()][-1] == "tk_torchcompile"


def test_torch_compile_fuser_fuses_the_rest_on_cuda():
    """Planned on CUDA proxies: elementwise work around a GEMM lands in tk_torchcompile regions."""

    class F(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.empty(64, 12, device="meta", dtype=torch.bfloat16))

        def forward(self, x):
            return torch.nn.functional.linear(torch.tanh(x) * 2 + 1, self.w).sin()

    planned = trace_planned(F().requires_grad_(False), [torch.empty(8, 12, device="meta", dtype=torch.bfloat16)])
    # K=12 is declined by tk, so the GEMM stays a torch call between two regions.
    fwd = top_level_executors(thunder.last_traces(planned)[-1])
    assert ("linear", "torch") in fwd
    assert sum(ex == "tk_torchcompile" for _, ex in fwd) == 2


def test_cpu_tensors_are_not_compiled():
    def f(x):
        return torch.tanh(x) * 2 + 1

    jf = thunder.jit(f, executors=[tk])
    x = torch.randn(8, 16)
    torch.testing.assert_close(jf(x), f(x))
    assert all(ex != "tk_torchcompile" for _, ex in top_level_executors(thunder.last_traces(jf)[-1]))


def test_collectives_never_enter_a_fusion_region():
    from thunder.distributed import prims as dist_prims

    for pid in dist_prims.PrimIDs:
        assert pid not in tk.private_fuser.implmap


def test_planned_claim_of_a_kernel_with_cuda_proxies():
    """With CUDA proxies and an sm_90 plan, tk claims its kernel forward and backward (nothing runs)."""

    class UsesDelta(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.o = torch.nn.Parameter(torch.empty(2, 4, 33, 64, device="meta", dtype=torch.bfloat16))

        def forward(self, g):
            return thunder_tk.attention_bwd_delta(self.o, g).sum()

    g = torch.empty(2, 4, 33, 64, device="meta", dtype=torch.bfloat16)
    report = plan(UsesDelta(), [g])
    (row,) = report.rows
    assert row.claimed_by_tk and row.ran_by == "tk: tk_attention_bwd_delta" and row.trace == "forward"
    assert "bf16[2, 4, 33, 64]" in row.inputs
    assert report.planned


def test_declined_own_symbol_decomposes_into_the_fuser(standin_nvfuser):
    def f(o, g):
        return thunder_tk.attention_bwd_delta(o, g)

    o, g = torch.randn(2, 3, 5, 8), torch.randn(2, 3, 5, 8)
    jf = thunder.jit(f, executors=[tk])
    torch.testing.assert_close(jf(o, g), (o * g).sum(-1))
    (row,) = thunder_tk.explain(jf).rows
    assert not row.claimed_by_tk and row.ran_by.endswith("(nvfuser)")


def planned_llama(n_layer: int):
    """A small grouped-query LLaMA (8 query heads in 2 groups, width 512, MLP 1024, 256 tokens, batch 2) from LitGPT,
    traced as planned for an sm_90 GPU."""
    from litgpt import GPT, Config

    cfg = Config(n_layer=n_layer, n_head=8, n_query_groups=2, n_embd=512, block_size=256, padded_vocab_size=512,
                 vocab_size=512, bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
                 intermediate_size=1024, rotary_percentage=1.0, parallel_residual=False)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    tokens = torch.zeros(2, 256, dtype=torch.int64, device="meta")
    return trace_planned(model, [tokens])


def test_planned_litgpt_grouped_query_attention_reads_kv_unexpanded():
    """LitGPT repeats each key/value head over its query heads before attention (repeat_interleave); planned for an
    sm_90 GPU, tk's attention takes the key/value heads themselves, forward and backward, so the repeated copies are
    neither made nor saved for the backward, and dk, dv come back per key/value head: here straight into the fused
    qkv projection's gradient, LitGPT's rope backward included (pattern_fusion.attention_backward_into_qkv)."""
    jm = planned_llama(n_layer=1)
    fwd, bwd = thunder.last_traces(jm)[-1], thunder.last_backward_traces(jm)[-1]
    (f,) = [b for b in fwd.bound_symbols if b.sym.name == "tk_attention_forward"]
    (b,) = [b for b in bwd.bound_symbols if b.sym.name.startswith("tk_attention_backward")]
    for op in (f, b):
        assert tuple(op.args[0].shape) == (2, 8, 256, 64)
        assert [tuple(t.shape) for t in op.args[1:3]] == [(2, 2, 256, 64)] * 2
    assert b.sym.name == "tk_attention_backward_qkv"
    assert tuple(b.output.shape) == (2, 256, (8 + 2 * 2) * 64)  # q's, k's and v's columns of the projection
    saved = [p for p in fwd.bound_symbols[-1].flat_proxy_args if getattr(p, "ndim", 0) == 4]
    assert sum(tuple(p.shape) == (2, 8, 256, 64) for p in saved) == 2  # q and o; no repeated k or v
    # v, a view of the fused qkv projection's output, is made compact for the attention, so the backward saves
    # v's own heads, not the whole projection.
    assert not [p for p in fwd.bound_symbols[-1].flat_proxy_args if tuple(getattr(p, "shape", ())) == (2, 256, 768)]


def test_planned_litgpt_mlp_runs_swiglu_in_one_launch():
    """LitGPT's LLaMAMLP, planned for an sm_90 GPU: each layer's fc_1 and fc_2 run as one tk_swiglu_linear (which
    also writes silu(h1) * h2), the forward saves no float32 copy of the MLP's products for the backward, and the
    backward computes SwiGLU's gradient in proj's dX GEMM."""
    jm = planned_llama(n_layer=2)
    fwd = thunder.last_traces(jm)[-1]
    fused = [b for b in fwd.bound_symbols if b.sym.name == "tk_swiglu_linear"]
    assert len(fused) == 2
    for b in fused:
        assert [tuple(t.shape) for t in b.output] == [(2, 256, 1024)] * 3
    saved = [p for p in fwd.bound_symbols[-1].flat_proxy_args if tuple(getattr(p, "shape", ())) == (2, 256, 1024)]
    assert saved and all(p.dtype == thunder.bfloat16 for p in saved)
    # And each layer's backward: proj's dX GEMM with SwiGLU's gradient in one tk_matmul_swiglu_grad.
    bwd = thunder.last_backward_traces(jm)[-1]
    grads = [b for b in bwd.bound_symbols if b.sym.name == "tk_matmul_swiglu_grad"]
    assert len(grads) == 2
    for b in grads:
        assert [tuple(t.shape) for t in b.output] == [(2, 256, 1024)] * 2
