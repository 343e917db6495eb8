"""The fused qkv projection with LitGPT's rotary embedding in the GEMM's epilogue (ops.linear_rope): q, k and v as
views of one output, q's and k's heads roped from the fp32 accumulators. Against float64 (the projection, split and
roped by ops.rope_reference), at lengths with tails, 1 and long, D 64/128/256, grouped, multi-query and plain heads,
rotations over the whole head and part of it, tables longer than the sequence and column slices of wider ones,
bf16 and fp16, each tile path of the kernel (256 wide with the consumers' or the store warps' epilogue, 128 wide);
every output element written (poisoned memory), repeatable bit for bit, attention reading the views as it reads
copies, a LitGPT model trained through the fold, and argument errors named."""

import pytest
import torch

from accuracy import rel_err
from poisoning import poison_allocator
from thunder_tk import ops

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hasattr(ops, "linear_rope"), reason="no ops.linear_rope")]

TOL = {torch.bfloat16: 1e-2, torch.float16: 3e-3}


def rope_tables(rows, n, dtype):
    return ops.rope_tables(rows, n, dtype, "cuda")


def make(B, S, K, Hq, Hkv, D, n, dtype, extra_rows=0, seed=0, tables=None):
    """x, the weight, and cos and sin in `tables` (default: dtype)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(B, S, K, device="cuda", dtype=dtype, generator=g)
    w = (torch.randn((Hq + 2 * Hkv) * D, K, device="cuda", dtype=dtype, generator=g) / K ** 0.5).to(dtype)
    cos, sin = rope_tables(S + extra_rows, n, tables or dtype)
    return x, w, cos, sin


def run(x, w, cos, sin, Hq, Hkv, D, **knobs):
    B, S = x.shape[:2]
    poison_allocator(((B, S, (Hq + 2 * Hkv) * D), x.dtype))
    q, k, v = ops.linear_rope(x, w, cos, sin, Hq, Hkv, D, **knobs)
    assert q.shape == (B, Hq, S, D) and k.shape == v.shape == (B, Hkv, S, D)
    assert q.untyped_storage().data_ptr() == k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr()
    for t in (q, k, v):
        assert torch.isfinite(t).all(), "unwritten (NaN) elements"
    return q, k, v


def check(x, w, cos, sin, Hq, Hkv, D, **knobs):
    got = run(x, w, cos, sin, Hq, Hkv, D, **knobs)
    want = ops.linear_rope_reference(x, w, cos, sin, Hq, Hkv, D)
    for name, a, b in zip("qkv", got, want):
        err = rel_err(a, b)
        assert err < TOL[x.dtype], (name, err)
    return got


CASES = [  # B, S, K, Hq, Hkv, D, rope width, extra table rows
    (1, 1, 64, 4, 2, 64, 64, 0),
    (2, 17, 128, 4, 2, 64, 64, 5),
    (2, 300, 256, 8, 2, 64, 64, 0),
    (1, 129, 512, 4, 4, 64, 64, 7),       # plain heads
    (3, 70, 256, 8, 1, 64, 64, 0),        # one K/V head
    (2, 257, 256, 8, 2, 128, 128, 3),
    (1, 513, 1024, 32, 8, 64, 64, 0),     # Llama-3.2-1B's heads
    (2, 100, 256, 2, 1, 256, 256, 0),
    (2, 100, 256, 4, 2, 64, 32, 0),       # half the head turned
    (2, 100, 256, 4, 2, 64, 16, 0),       # a quarter
    (2, 100, 256, 4, 2, 128, 32, 0),
    (1, 64, 256, 2, 1, 256, 64, 0),
    (1, 1000, 2048, 16, 4, 64, 64, 48),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}S{c[1]}K{c[2]}h{c[3]}-{c[4]}D{c[5]}n{c[6]}" for c in CASES])
def test_matches_float64(case, dtype):
    B, S, K, Hq, Hkv, D, n, extra = case
    x, w, cos, sin = make(B, S, K, Hq, Hkv, D, n, dtype, extra)
    check(x, w, cos, sin, Hq, Hkv, D)


@pytest.mark.parametrize("case", CASES, ids=[f"B{c[0]}S{c[1]}K{c[2]}h{c[3]}-{c[4]}D{c[5]}n{c[6]}" for c in CASES])
def test_fp32_tables_with_bf16(case):
    """bf16-mixed training's tables: fp32 cos and sin read as they are (float64 reference from the same tables)."""
    B, S, K, Hq, Hkv, D, n, extra = case
    x, w, cos, sin = make(B, S, K, Hq, Hkv, D, n, torch.bfloat16, extra, tables=torch.float32)
    check(x, w, cos, sin, Hq, Hkv, D)


@pytest.mark.parametrize("tables", [torch.bfloat16, torch.float32], ids=["bf16-tables", "fp32-tables"])
@pytest.mark.parametrize("tile_n,epilogue", [(256, 2), (256, 1), (128, 0)],
                         ids=["256-consumers", "256-store-warps", "128"])
@pytest.mark.parametrize("D", [64, 128])
def test_every_tile_path(tile_n, epilogue, D, tables):
    """Many tiles and rows that are not whole tiles, through each epilogue the launch can take."""
    x, w, cos, sin = make(3, 700, 512, 4096 // D // 2, 4096 // D // 8, D, D, torch.bfloat16, tables=tables)
    Hq, Hkv = 4096 // D // 2, 4096 // D // 8
    check(x, w, cos, sin, Hq, Hkv, D, _tile_n=tile_n, _epilogue=epilogue)


def test_fp32_tables_sliced_or_off_their_pair_alignment():
    """fp32 column slices of a wider table read in place (8-byte aligned rows); a slice starting at an odd column
    (rows off 8 bytes) is copied first; fp32 tables of a 256-wide head."""
    x, w, _, _ = make(2, 96, 256, 4, 2, 64, 32, torch.bfloat16)
    wide_cos, wide_sin = rope_tables(200, 66, torch.float32)
    check(x, w, wide_cos[:, :32], wide_sin[:, :32], 4, 2, 64)
    check(x, w, wide_cos[:, 1:33], wide_sin[:, 1:33], 4, 2, 64)
    x2, w2, c2, s2 = make(1, 77, 128, 2, 1, 256, 256, torch.bfloat16, tables=torch.float32)
    check(x2, w2, c2, s2, 2, 1, 256)


def test_sliced_and_strided_tables_and_a_strided_input():
    x, w, cos, sin = make(2, 96, 256, 4, 2, 64, 32, torch.bfloat16)
    wide_cos, wide_sin = rope_tables(200, 64, torch.bfloat16)
    # Column slices of a wider table (row stride 64 for 32 columns), and tables with different strides (copied).
    check(x, w, wide_cos[:, :32], wide_sin[:, :32], 4, 2, 64)
    check(x, w, cos, wide_sin[:96, :32], 4, 2, 64)
    # x a strided view: copied to rows the kernel reads.
    xs = torch.randn(2, 96, 512, device="cuda", dtype=torch.bfloat16)[..., ::2]
    check(xs, w, cos, sin, 4, 2, 64)


def test_repeatable_and_like_the_unfused_rope():
    x, w, cos, sin = make(2, 333, 512, 8, 2, 64, 64, torch.bfloat16)
    first = [t.clone() for t in run(x, w, cos, sin, 8, 2, 64)]
    again = run(x, w, cos, sin, 8, 2, 64)
    assert all(torch.equal(a, b) for a, b in zip(first, again))
    # The unfused path rounds the projection, then each product and the sum (LitGPT in bf16): within its error.
    q, k, v = ops.qkv_head_views(ops.linear(x, w), 8, 2, 64)
    unfused = (ops.rope_reference(q, cos, sin), ops.rope_reference(k, cos, sin), v)
    for a, b in zip(first, unfused):
        assert rel_err(a, b.double()) < 1e-2
    assert torch.equal(first[2], v)  # v is the plain product, bit for bit


def test_attention_reads_the_views_as_it_reads_copies():
    x, w, cos, sin = make(2, 300, 256, 8, 2, 64, 64, torch.bfloat16)
    q, k, v = ops.linear_rope(x, w, cos, sin, 8, 2, 64)
    o, lse = ops.attention_forward(q, k, v, is_causal=True)
    o2, lse2 = ops.attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_empty_and_k_zero():
    x, w, cos, sin = make(0, 5, 64, 4, 2, 64, 64, torch.bfloat16)
    assert all(t.numel() == 0 for t in ops.linear_rope(x, w, cos, sin, 4, 2, 64))
    x = torch.empty(1, 5, 0, device="cuda", dtype=torch.bfloat16)
    w = torch.empty(512, 0, device="cuda", dtype=torch.bfloat16)
    assert all(bool((t == 0).all()) for t in ops.linear_rope(x, w, cos, sin, 4, 2, 64))


def test_errors_name_the_problem():
    x, w, cos, sin = make(1, 16, 64, 4, 2, 64, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="heads of 64, 128, 256"):
        ops.linear_rope(x, torch.zeros(8 * 96, 64, device="cuda", dtype=torch.bfloat16), cos, sin, 4, 2, 96)
    c48, s48 = rope_tables(16, 48, torch.bfloat16)
    with pytest.raises(ValueError, match="power of two"):
        ops.linear_rope(x, w, c48, s48, 4, 2, 64)
    with pytest.raises(ValueError, match="positions"):
        ops.linear_rope(x, w, cos[:8], sin[:8], 4, 2, 64)
    with pytest.raises(ValueError, match="cos and sin must both be"):
        ops.linear_rope(x, w, cos.float(), sin, 4, 2, 64)
    xh, wh, ch, sh = make(1, 16, 64, 4, 2, 64, 64, torch.float16)
    with pytest.raises(ValueError, match="cos and sin must both be torch.float16 with torch.float16 x"):
        ops.linear_rope(xh, wh, ch.float(), sh.float(), 4, 2, 64)
    with pytest.raises(ValueError, match="one 16-bit dtype"):
        ops.linear_rope(x, w.half(), cos, sin, 4, 2, 64)
    with pytest.raises(ValueError, match="weight expected"):
        ops.linear_rope(x, w[:-64], cos, sin, 4, 2, 64)
    with pytest.raises(ValueError, match="256-wide heads"):
        x2, w2, c2, s2 = make(1, 16, 64, 2, 1, 256, 256, torch.bfloat16)
        ops.linear_rope(x2, w2, c2, s2, 2, 1, 256, _tile_n=128)
    with pytest.raises(TypeError):
        ops.linear_rope(x, w, None, sin, 4, 2, 64)


@pytest.mark.parametrize("mixed", [False, True], ids=["bf16-true", "bf16-mixed"])
def test_litgpt_model_trains_through_the_fold(monkeypatch, mixed):
    """A LitGPT model with the qkv projection on tk (the GEMM size policy off, so that small projections are tk's):
    its forward runs tk_linear_rope into tk's attention, and output and gradients are as good as eager's. At
    bf16-mixed (fp32 weights and rope tables, under autocast) too, with SwiGLU's launches, which read one cast of the
    MLP's input."""
    litgpt = pytest.importorskip("litgpt")
    import thunder

    import thunder_tk
    from litgpt_training import step_as_accurately_as_eager
    from thunder_tk import claim_rules

    monkeypatch.setattr(claim_rules, "gemm_size_policy_default", False)
    jitted, cfg = step_as_accurately_as_eager(litgpt, mixed=mixed)
    names = [b.sym.name for b in thunder.last_traces(jitted)[-1].bound_symbols]
    assert names.count("tk_linear_rope") == cfg.n_layer, names
    assert names.count("tk_swiglu_linear") == cfg.n_layer, names
    backward = [b.sym.name for b in thunder.last_backward_traces(jitted)[-1].bound_symbols]
    assert backward.count("tk_matmul_swiglu_grad") == cfg.n_layer, backward
    rows = [r for r in thunder_tk.explain(jitted).rows if r.ran_by == "tk: tk_linear_rope"]
    assert len(rows) == cfg.n_layer and all("roped in the epilogue" in r.detail for r in rows)
