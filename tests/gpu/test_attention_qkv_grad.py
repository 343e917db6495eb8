"""The attention backward written as the fused qkv projection's gradient (ops.attention_backward_qkv): dk and dv
stored by the backward kernel into their columns, dq scaled, rotated back through the rotate-half rotary embedding
and stored into its columns in one pass, dk rotated back in place. Against float64 (the math reference's gradients
rotated back and concatenated), at lengths with tails, 1 and long, D 64/128/256, grouped, multi-query and plain
heads, rotations over the whole head, part of it and none of it, fp32 and 16-bit angle tables longer than the
sequence, group and last-wave splits, bf16 and fp16; every output element written (poisoned memory), repeatable
bit for bit, and argument errors named."""

import pytest
import torch

from accuracy import rel_err
from poisoning import poison_allocator
from thunder_tk import ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hasattr(ops, "attention_backward_qkv"), reason="no ops.attention_backward_qkv")]

TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}


def rope_tables(rows, n, dtype):
    return ops.rope_tables(rows, n, dtype, "cuda")


def make(B, Hq, Hkv, S, D, dtype, causal, seed=0, window=None):
    """q, k, v as LitGPT splits them from one (B, S, (Hq + 2 Hkv) D) projection output, o and lse of the forward,
    and a gradient of o."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    qkv = torch.randn(B, S, (Hq + 2 * Hkv) * D, device="cuda", dtype=dtype, generator=g)
    q, k, v = ops.qkv_head_views(qkv, Hq, Hkv, D)
    o, lse = ops.attention_forward(q, k, v, is_causal=causal, window=window)
    grad_o = torch.randn(o.shape, device="cuda", dtype=dtype, generator=g)
    return q, k, v, o, lse, grad_o


def reference(q, k, v, o, lse, grad_o, cos, sin, causal, scale=None, window=None):
    dq, dk, dv = ops.attention_backward_reference(q, k, v, o, lse, grad_o, is_causal=causal, scale=scale,
                                                  window=window)
    return ops.qkv_grad_reference(dq, dk, dv, cos.double(), sin.double())


def run(q, k, v, o, lse, grad_o, cos, sin, causal, **kw):
    B, Hq, S, D = q.shape
    shape = (B, S, (Hq + 2 * k.shape[1]) * D)
    poison_allocator((shape, q.dtype))
    out = ops.attention_backward_qkv(q, k, v, o, lse, grad_o, cos, sin, is_causal=causal, **kw)
    assert out.shape == shape and out.dtype == q.dtype and out.is_contiguous()
    assert torch.isfinite(out).all(), "the gradient has unwritten (NaN) elements"
    return out


CASES = [  # B, Hq, Hkv, S, D, causal, rope width, extra table rows
    (2, 4, 2, 1, 64, True, 64, 0),
    (1, 8, 2, 17, 64, True, 64, 5),
    (2, 4, 4, 300, 128, True, 128, 0),
    (1, 8, 1, 1000, 64, False, 32, 24),
    (1, 4, 2, 129, 128, True, 16, 1),
    (2, 8, 2, 513, 64, False, 0, 0),
    (1, 2, 1, 70, 256, False, 64, 3),
    (1, 4, 2, 257, 256, True, 256, 0),
    (4, 32, 8, 256, 64, True, 64, 1792),  # Llama-3.2-1B's heads, a 2048-row cache
]


def case_id(c):
    return f"B{c[0]}-H{c[1]}kv{c[2]}-S{c[3]}-D{c[4]}-{'causal' if c[5] else 'full'}-rope{c[6]}+{c[7]}"


@pytest.mark.parametrize("angles", ["same", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_fp64_reference(case, dtype, angles):
    B, Hq, Hkv, S, D, causal, n, extra = case
    q, k, v, o, lse, grad_o = make(B, Hq, Hkv, S, D, dtype, causal)
    cos, sin = rope_tables(S + extra, n, torch.float32 if angles == "fp32" else dtype)
    got = run(q, k, v, o, lse, grad_o, cos, sin, causal)
    want = reference(q, k, v, o, lse, grad_o, cos, sin, causal)
    # No worse than the kernel's own (dq, dk, dv) rotated back in float64: the fold adds one rounding of dk at most.
    plain = ops.qkv_grad_reference(*ops.attention_backward(q, k, v, o, lse, grad_o, is_causal=causal), cos.double(),
                                   sin.double())
    assert rel_err(got, want) < TOL[dtype]
    assert rel_err(got, want) < 1.5 * rel_err(plain, want) + 2e-3


@pytest.mark.parametrize("split", [{"_group_split": 2}, {"_group_split": 4}, {"_tail_split": (1, 2)}],
                         ids=["group2", "group4", "tail"])
def test_splits_sum_into_the_columns(split):
    """Grouped heads walked in parts (summed into the strided dk, dv columns) and a last wave split by queries."""
    causal = "_tail_split" not in split
    q, k, v, o, lse, grad_o = make(1, 8, 2, 300, 64, torch.bfloat16, causal, seed=3)
    cos, sin = rope_tables(300, 64, torch.bfloat16)
    got = run(q, k, v, o, lse, grad_o, cos, sin, causal, **split)
    want = reference(q, k, v, o, lse, grad_o, cos, sin, causal)
    assert rel_err(got, want) < TOL[torch.bfloat16]


@pytest.mark.parametrize("B,Hq,Hkv,S,D,W,split", [(2, 8, 2, 300, 64, 7, 0), (1, 4, 2, 1000, 128, 129, 2),
                                                 (1, 4, 1, 257, 256, 64, 0)])
def test_sliding_window(B, Hq, Hkv, S, D, W, split):
    """A causal sliding window (keys i - W < j <= i), as the forward computed it, grouped heads whole or in parts."""
    q, k, v, o, lse, grad_o = make(B, Hq, Hkv, S, D, torch.bfloat16, True, seed=9, window=W)
    cos, sin = rope_tables(S, D, torch.bfloat16)
    got = run(q, k, v, o, lse, grad_o, cos, sin, True, window=W, _group_split=split)
    want = reference(q, k, v, o, lse, grad_o, cos, sin, True, window=W)
    assert rel_err(got, want) < TOL[torch.bfloat16]


def test_custom_scale_and_strided_tables():
    """A scale other than 1/sqrt(D), and cos, sin as column slices of wider tables (rows 16-byte aligned)."""
    q, k, v, o, lse, grad_o = make(2, 4, 2, 77, 128, torch.bfloat16, True, seed=5)
    o, lse = ops.attention_forward(q, k, v, is_causal=True, scale=0.3)
    wide_cos, wide_sin = (torch.cat((t, torch.zeros_like(t)), 1) for t in rope_tables(80, 64, torch.bfloat16))
    cos, sin = wide_cos[:, :64], wide_sin[:, :64]
    assert not cos.is_contiguous()
    got = run(q, k, v, o, lse, grad_o, cos, sin, True, scale=0.3)
    want = reference(q, k, v, o, lse, grad_o, cos, sin, True, scale=0.3)
    assert rel_err(got, want) < TOL[torch.bfloat16]


def test_repeatable_bitwise():
    q, k, v, o, lse, grad_o = make(2, 8, 2, 700, 64, torch.bfloat16, True, seed=7)
    cos, sin = rope_tables(700, 64, torch.bfloat16)
    first = run(q, k, v, o, lse, grad_o, cos, sin, True)
    second = run(q, k, v, o, lse, grad_o, cos, sin, True)
    assert torch.equal(first, second)


def test_argument_errors_are_named():
    q, k, v, o, lse, grad_o = make(1, 4, 2, 64, 64, torch.bfloat16, True)
    cos, sin = rope_tables(64, 64, torch.bfloat16)
    bad = {
        "width": (cos[:, :8], sin[:, :8], "multiple of 16"),
        "rows": (cos[:10], sin[:10], "positions"),
        "dtype": (cos.half(), sin.half(), "float32 or"),
        "mixed": (cos, sin.float(), "float32 or"),
        "shape": (cos, sin[:, :32], "alike"),
    }
    for name, (c, s, words) in bad.items():
        with pytest.raises(ValueError, match=words):
            ops.attention_backward_qkv(q, k, v, o, lse, grad_o, c, s, is_causal=True)
    with pytest.raises(ValueError, match="query and key lengths"):
        q2 = torch.randn(1, 4, 32, 64, device="cuda", dtype=torch.bfloat16)
        o2, lse2 = ops.attention_forward(q2, k, v)
        ops.attention_backward_qkv(q2, k, v, o2, lse2, torch.randn_like(o2), cos, sin)
