"""LitGPT's rotary embedding folded into tk's kernels on both sides of the attention, on real Thunder traces of
LitGPT models on CPU: the backward written as the fused qkv projection's gradient
(pattern_fusion.attention_backward_into_qkv) and, in the forward, the rotation in the qkv projection's epilogue
(pattern_fusion.rope_into_qkv_projection), with tk's kernels standing in (`standins.StandinBuild`) and an eager
fuser in nvFuser's place (the GPU's case: the rewrite reads the prims the fuser would take).

Where LitGPT rotates q and k with its rotate-half rope (the whole head or part of it) after splitting them from one
projection, tk_attention_backward_qkv replaces the attention backward and every op between it and the projection's
GEMMs; where the rotation is another one, the rope is too narrow for the kernel, or the feature is off, the attention
backward and the fuser's ops stay, and `explain` says why in the attention's row. Gradients match float64 eager in
every case; the probe's formula matches rope's transpose.
"""

import copy
import math

import pytest
import torch

import thunder
import thunder_tk
from standins import turned_off
from thunder_tk import ops, pattern_fusion, tk

litgpt = pytest.importorskip("litgpt")

bf16 = torch.bfloat16


def config(**kw):
    base = dict(n_layer=1, n_embd=256, n_head=4, n_query_groups=2, head_size=64, intermediate_size=512,
                padded_vocab_size=512, block_size=64)
    base.update(kw)
    return litgpt.Config.from_name("Llama-3.2-1B", **base)


def rel_err(got, want):
    return ((got.double() - want).norm() / want.norm()).item()


def train_step(model, **compile_options):
    """One forward and backward of the bf16 model under tk and of its float64 copy in eager; the jitted model."""
    torch.manual_seed(0)
    exact = copy.deepcopy(model).double()
    idx = torch.randint(0, 512, (2, 32))
    jm = thunder.jit(model, executors=[tk], **compile_options)
    out = jm(idx)
    seed = torch.randn(out.shape)
    (out.float() * seed).sum().backward()
    (exact(idx) * seed.double()).sum().backward()
    for (name, p), q in zip(model.named_parameters(), exact.parameters()):
        assert rel_err(p.grad, q.grad) < 3e-2, name
    return jm


def backward_ops(jm):
    return [b.sym.name for b in thunder.last_backward_traces(jm)[-1].bound_symbols]


def attention_row(jm):
    rows = [r for r in thunder_tk.explain(jm).rows if r.symbol == "ltorch.scaled_dot_product_attention"]
    assert len(rows) == 1
    return rows[0]


FOLDED = "gradient written as the qkv projection's, the rotary embedding's backward included"
NOT_FOLDED = "gradient not written as the qkv projection's: "


def assert_folded(jm):
    names = backward_ops(jm)
    assert names.count("tk_attention_backward_qkv") == 1 and "tk_attention_backward" not in names, names
    row = attention_row(jm)
    assert row.backward_ran_by == "tk: tk_attention_backward_qkv", row
    assert row.detail.endswith(FOLDED) and NOT_FOLDED not in row.detail, row


def forward_ops(jm):
    return [b.sym.name for b in thunder.last_traces(jm)[-1].bound_symbols]


def assert_rope_in_projection(jm, layers=1):
    """Each layer's q, k and v come from one tk_linear_rope, straight into tk's attention, and explain says so."""
    trace = thunder.last_traces(jm)[-1]
    launches = [b for b in trace.bound_symbols if b.sym.name == "tk_linear_rope"]
    assert len(launches) == layers, forward_ops(jm)
    made = {p.name for b in launches for p in b.flat_proxy_outs}
    for b in trace.bound_symbols:
        if b.sym.name in ("tk_attention_forward", "tk_attention"):
            assert {a.name for a in b.args[:3]} <= made, b
    rows = [r for r in thunder_tk.explain(jm).rows if r.ran_by == "tk: tk_linear_rope"]
    assert len(rows) == layers and all("roped in the epilogue" in r.detail for r in rows), rows


def assert_rope_not_in_projection(jm, why: str):
    """No tk_linear_rope, and `explain`'s row of the qkv projection says why: `why` is the reason's start."""
    assert "tk_linear_rope" not in forward_ops(jm)
    notes = [r.detail for r in thunder_tk.explain(jm).rows if r.detail.startswith(ROPE_NOT_IN_PROJECTION)]
    assert len(notes) == 1 and notes[0][len(ROPE_NOT_IN_PROJECTION):].startswith(why), notes


ROPE_NOT_IN_PROJECTION = "q and k not roped in the epilogue: "


def assert_not_folded(jm, why: str):
    """Not folded, and `explain` says why: `why` is the reason's start (the probe's error follows some)."""
    names = backward_ops(jm)
    assert "tk_attention_backward_qkv" not in names and names.count("tk_attention_backward") == 1, names
    row = attention_row(jm)
    assert row.backward_ran_by == "tk: tk_attention_backward"
    notes = [n for n in row.detail.split("; ") if n.startswith(NOT_FOLDED)]
    assert len(notes) == 1 and notes[0][len(NOT_FOLDED):].startswith(why), row.detail
    assert FOLDED not in row.detail and row.detail in str(thunder_tk.explain(jm))


@pytest.mark.parametrize("groups,rotary", [(2, 1.0), (4, 1.0), (1, 1.0), (2, 0.5), (4, 0.25)],
                         ids=["gqa", "mha", "mqa", "half-rope", "quarter-rope"])
def test_litgpt_rope_backward_folds_into_the_attention_backward(standin_tk_build, standin_nvfuser, groups, rotary):
    torch.manual_seed(0)
    jm = train_step(litgpt.GPT(config(n_query_groups=groups, rotary_percentage=rotary)).to(bf16))
    assert_folded(jm)
    assert_rope_in_projection(jm)
    # Nothing of the rotation, the group sum or the concatenation is left for the fuser in the backward.
    fused = [b for b in thunder.last_backward_traces(jm)[-1].bound_symbols if b.subsymbols]
    assert not any(s.sym.name in ("neg", "pad") for b in fused for s in b.subsymbols)


@pytest.mark.parametrize("fp32_out", [False, True], ids=["default", "fp32-out"])
def test_bf16_mixed_folds_the_rope_with_fp32_tables_and_fuses_swiglu(standin_tk_build, standin_nvfuser, monkeypatch,
                                                                      fp32_out):
    """bf16-mixed (fp32 weights and rope tables, the step under bf16 autocast): the qkv projection reads the fp32
    tables in its epilogue, the backward folds as at bf16-true, SwiGLU's products are one launch (the MLP's input
    cast once, `merge_repeated_casts`) and its backward one, and the gradients (fp32) match float64 eager. With
    THUNDER_TK_GEMM_FP32_OUT=1 the same, and the products cast to fp32 (every linear's weight gradient, the input
    gradients of fp32 activations, each MLP's summed input gradient) come from launches that write fp32."""
    monkeypatch.setenv(pattern_fusion.GEMM_FP32_OUT_ENV, "1" if fp32_out else "0")
    torch.manual_seed(0)
    model = litgpt.GPT(config(n_layer=2))
    exact = copy.deepcopy(model).double()
    idx = torch.randint(0, 512, (2, 32))
    jm = thunder.jit(model, executors=[tk])
    with torch.autocast("cpu", dtype=bf16):
        out = jm(idx)
    seed = torch.randn(out.shape)
    (out.float() * seed).sum().backward()
    (exact(idx) * seed.double()).sum().backward()
    for (name, p), q in zip(model.named_parameters(), exact.parameters()):
        assert p.grad.dtype == torch.float32 and rel_err(p.grad, q.grad) < 3e-2, name
    assert_rope_in_projection(jm, layers=2)
    assert forward_ops(jm).count("tk_swiglu_linear") == 2, forward_ops(jm)
    assert backward_ops(jm).count("tk_matmul_swiglu_grad") == 2
    assert backward_ops(jm).count("tk_attention_backward_qkv") == 2
    names = [b.sym.name for b in thunder.last_backward_traces(jm)[-1].bound_symbols]
    # fp32: every linear's weight gradient (five a layer and the lm_head's), the input gradients that go back to fp32
    # activations (each qkv projection's and the lm_head's: the norms' outputs), the MLPs' summed input gradients
    assert (names.count("tk_matmul_fp32"), names.count("tk_matmul_sum_fp32")) == ((14, 2) if fp32_out else (0, 0))


def test_every_layer_folds_and_the_probe_tells_cos_from_sin(standin_tk_build, standin_nvfuser, monkeypatch):
    """Two layers share the angle tables; each layer's region is handed to the probe with the tables in the opposite
    order too, and the probe must still name the cosine (a wrong pick would give wrong gradients)."""
    found = pattern_fusion._qkv_grad_region
    calls = []

    def reversed_tables(*args):
        region = found(*args)
        if not isinstance(region, str):  # a string: why there is none
            calls.append(region[2])
            region = (*region[:2], region[2][::-1], region[3]) if len(calls) % 2 else region
        return region

    monkeypatch.setattr(pattern_fusion, "_qkv_grad_region", reversed_tables)
    torch.manual_seed(0)
    jm = train_step(litgpt.GPT(config(n_layer=2)).to(bf16))
    assert len(calls) == 2
    names = backward_ops(jm)
    assert names.count("tk_attention_backward_qkv") == 2 and "tk_attention_backward" not in names, names
    for b in thunder.last_backward_traces(jm)[-1].bound_symbols:
        if b.sym.name == "tk_attention_backward_qkv":
            assert (b.args[6].name, b.args[7].name) == ("t_cos", "t_sin")


def test_rope_narrower_than_the_kernel_keeps_the_fuser(standin_tk_build, standin_nvfuser):
    """An 8-column rotation: the kernel rotates 16 columns at a time, so the rewrite is not taken."""
    torch.manual_seed(0)
    jm = train_step(litgpt.GPT(config(rotary_percentage=0.125)).to(bf16))
    assert_not_folded(jm, "the rotary embedding's width (8) must be a multiple of 16 up to the head dim (64)")
    assert_rope_not_in_projection(jm, "the rotary epilogue turns a power of two of columns from 16 to the head dim "
                                      "(64); got 8")


def test_normalized_q_and_k_keep_the_fuser(standin_tk_build, standin_nvfuser):
    """q and k normalized before the rope (LitGPT's norm_qk): the normalization's backward lies between the rope's
    and the concatenation and reads values of the region besides the gradients."""
    torch.manual_seed(0)
    jm = train_step(litgpt.GPT(config(norm_qk=True)).to(bf16))
    assert_not_folded(jm, "the rope region's ")
    assert "is read outside it, by a" in attention_row(jm).detail


def test_rope_of_48_columns_folds_backward_only(standin_tk_build, standin_nvfuser):
    """The backward's last pass turns any multiple of 16 columns; the forward's epilogue a power of two."""
    torch.manual_seed(0)
    jm = train_step(litgpt.GPT(config(rotary_percentage=0.75)).to(bf16))
    assert_folded(jm)
    assert_rope_not_in_projection(jm, "the rotary epilogue turns a power of two of columns from 16 to the head dim "
                                      "(64); got 48")


@pytest.mark.parametrize("how", ["option", "env", "build"])
def test_forward_fold_turned_off_keeps_the_fuser(standin_tk_build, standin_nvfuser, monkeypatch, how):
    options = turned_off(how, pattern_fusion.QKV_ROPE, "gemm_rope", standin_tk_build, monkeypatch)
    torch.manual_seed(0)
    jm = train_step(litgpt.GPT(config()).to(bf16), **options)
    assert "tk_linear" in forward_ops(jm)
    assert_rope_not_in_projection(jm, {"option": "turned off (tk_disable=gemm_rope)",
                                       "env": "turned off (THUNDER_TK_DISABLE=gemm_rope)",
                                       "build": "gemm_rope not in this build"}[how])
    assert_folded(jm)


def test_a_projection_with_bias_keeps_the_fuser(standin_tk_build, standin_nvfuser):
    """The epilogue adds no bias (Qwen-style attn_bias): the projection stays a tk_linear, the rope the fuser's."""
    torch.manual_seed(0)
    jm = train_step(litgpt.GPT(config(attn_bias=True)).to(bf16))
    assert_rope_not_in_projection(jm, "the projection has a bias (the epilogue adds none)")


@pytest.mark.parametrize("how", ["option", "env", "build"])
def test_turned_off_keeps_the_fuser(standin_tk_build, standin_nvfuser, monkeypatch, how):
    options = turned_off(how, pattern_fusion.QKV_GRAD, "attention_rope_grad", standin_tk_build, monkeypatch)
    torch.manual_seed(0)
    assert_not_folded(train_step(litgpt.GPT(config()).to(bf16), **options), {
        "option": "turned off (tk_disable=attention_qkv_grad)",
        "env": "turned off (THUNDER_TK_DISABLE=attention_qkv_grad)",
        "build": "attention_rope_grad not in this build"}[how])


def test_inference_says_nothing_of_the_qkv_gradient(standin_tk_build, standin_nvfuser):
    """No attention backward, no reason."""
    torch.manual_seed(0)
    jm = thunder.jit(litgpt.GPT(config()).to(bf16), executors=[tk])
    with torch.no_grad():
        jm(torch.randint(0, 512, (2, 32)))
    row = attention_row(jm)
    assert row.ran_by == "tk: tk_attention" and "qkv projection" not in row.detail, row


class OtherRotation(torch.nn.Module):
    """LitGPT's split of one qkv projection, then a rotation that is not the rotate-half rope: the same ops with the
    sine's sign flipped (the inverse rotation), or LitGPT's interleaved rope. The probe must tell it apart. Or the
    rope, then q divided by 2 (an op outside the rope region reads dq)."""

    def __init__(self, kind):
        super().__init__()
        self.kind, self.heads, self.groups, self.D = kind, 4, 2, 64
        self.qkv = torch.nn.Linear(256, (4 + 2 * 2) * 64, bias=False)
        self.proj = torch.nn.Linear(256, 256, bias=False)
        pos = torch.arange(32, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, 64, 2) / 64)
        self.register_buffer("cos", pos.cos().repeat(1, 2).to(bf16))
        self.register_buffer("sin", pos.sin().repeat(1, 2).to(bf16))

    def rotate(self, x):
        if self.kind == "interleaved":
            return litgpt.model.apply_rope_interleave(x, self.cos[None], self.sin[None])
        x1, x2 = x[..., :32], x[..., 32:]
        rotated = torch.cat((-x2, x1), -1) * self.sin
        # "scaled": LitGPT's rope itself (what differs is the division after it); else its inverse
        return (x * self.cos) + rotated if self.kind == "scaled" else (x * self.cos) - rotated

    def forward(self, x):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split((256, 128, 128), dim=-1)
        q = q.view(B, T, 4, 64).transpose(1, 2)
        k = k.view(B, T, 2, 64).transpose(1, 2)
        v = v.view(B, T, 2, 64).transpose(1, 2)
        q, k = self.rotate(q), self.rotate(k)
        if self.kind == "scaled":
            q = q / 2
        k, v = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, 256))


PROBE_DIFFERS = "the rope region's result on the probe differs from the rotate-half rope's backward (relative error "


@pytest.mark.parametrize("kind,why,forward_why", [
    ("inverse", PROBE_DIFFERS, "the rope region's result on the probe differs from the rotate-half rope"),
    ("interleaved", PROBE_DIFFERS, "the rope region's result on the probe differs from the rotate-half rope"),
    ("scaled", "dq is read outside the rope region", "q, k and v are not all made from the projection")])
def test_other_rotations_are_not_taken_for_rope(standin_tk_build, standin_nvfuser, kind, why, forward_why):
    torch.manual_seed(0)
    model = OtherRotation(kind).to(bf16)
    exact = copy.deepcopy(model).double()
    x = torch.randn(2, 32, 256)
    jm = thunder.jit(model, executors=[tk])
    xj = x.to(bf16).requires_grad_()
    xe = x.double().requires_grad_()
    out = jm(xj)
    seed = torch.randn(out.shape)
    (out.float() * seed).sum().backward()
    (exact(xe) * seed.double()).sum().backward()
    assert_not_folded(jm, why)
    assert_rope_not_in_projection(jm, forward_why)
    assert rel_err(xj.grad, xe.grad) < 3e-2
    assert rel_err(model.qkv.weight.grad, exact.qkv.weight.grad) < 3e-2


def test_the_probes_formula_is_ropes_transpose():
    """<rope(x), g> = <x, rope^T(g)>: ops.qkv_grad_reference rotates back what ops.rope_reference rotates (a
    partial rope, a table longer than the sequence), so the kernel, checked against it, computes rope's gradient."""
    g = torch.Generator().manual_seed(11)
    x, gr = (torch.randn(1, 2, 33, 64, dtype=torch.float64, generator=g) for _ in range(2))
    pos = torch.arange(40, dtype=torch.float64)[:, None] / 10000 ** (torch.arange(0, 48, 2) / 48)
    cos, sin = pos.cos().repeat(1, 2), pos.sin().repeat(1, 2)
    lhs = (ops.rope_reference(x, cos, sin) * gr).sum()
    back = ops.qkv_grad_reference(gr, gr[:, :0], gr[:, :0], cos, sin)  # (B, S, 2 * 64): q's columns only
    rhs = (x.transpose(1, 2).reshape(1, 33, -1) * back).sum()
    assert math.isclose(lhs.item(), rhs.item(), rel_tol=1e-5)  # rope_reference computes in float32


def test_qkv_head_views_split_the_columns_as_litgpt_does():
    """ops.qkv_head_views: q, k, v as (B, H, S, D) views of the fused projection's columns, q's heads first; the
    reference's gradient laid out the same way puts each gradient back in its own columns."""
    qkv = torch.arange(2 * 3 * (4 + 2 * 2) * 16, dtype=torch.float64).reshape(2, 3, -1)
    q, k, v = ops.qkv_head_views(qkv, 4, 2, 16)
    assert [tuple(t.shape) for t in (q, k, v)] == [(2, 4, 3, 16), (2, 2, 3, 16), (2, 2, 3, 16)]
    assert all(t.data_ptr() >= qkv.data_ptr() and t.stride(-1) == 1 for t in (q, k, v))  # views, no copies
    assert torch.equal(q[1, 3, 2], qkv[1, 2, 48:64]) and torch.equal(v[0, 1, 0], qkv[0, 0, 112:128])
    zeros = torch.zeros(1, 16)
    back = ops.qkv_grad_reference(q, k, v, zeros[:, :0], zeros[:, :0], dtype=None)  # no rotation: the columns back
    assert back.dtype == torch.float64 and torch.equal(back, qkv)
