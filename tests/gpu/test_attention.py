"""The attention forward kernel (ops.attention_forward) against an fp64 math reference.

Covers short and long, equal and unequal sequence lengths, D 64, 128 and 256, grouped-query ratios 1/2/4/8, causal
(top-left mask, as torch SDPA's is_causal) and not, bf16 and fp16, a custom scale, strided views, large scores,
repeatability, outputs written in full (the caching allocator is filled with NaN first) and argument errors.
"""

import pytest
import torch

from accuracy import rel_err
from poisoning import poison_allocator
from thunder_tk import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hasattr(ops, "attention_forward"), reason="ops.attention_forward does not exist yet"),
]

# Tolerances on ||o - ref|| / ||ref||. The kernel rounds P to the input dtype for the P @ V product and o to it on
# the way out (bf16 keeps 8 mantissa bits, fp16 11); both are well inside these.
O_TOL = {torch.bfloat16: 2e-2, torch.float16: 1e-2}
# lse is fp32 from fp32 scores of the same rounded inputs: only the summation order differs.
LSE_TOL = 1e-2


def reference(q, k, v, causal=False, scale=None, window=None):
    """o and lse in float64: query head h reads kv head h // (Hq // Hkv); causal is the top-left aligned mask, with
    `window` also dropping keys j <= i - window."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[1] // k.shape[1]
    q64 = q.double()
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if causal:
        keep = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril()
        if window is not None:
            keep = keep.triu(1 - window)
        s = s.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    o = torch.exp(s - lse[..., None]) @ v64
    return o, lse


def run(q, k, v, causal=False, scale=None, window=None, **options):
    """The op on freshly poisoned memory, with the output contract checked."""
    B, Hq, Sq, D = q.shape
    poison_allocator(((B, Hq, Sq, D), q.dtype), ((B, Hq, Sq), torch.float32))
    o, lse = ops.attention_forward(q, k, v, is_causal=causal, scale=scale, window=window, **options)
    assert o.shape == q.shape and o.dtype == q.dtype and o.device == q.device
    assert o.transpose(1, 2).is_contiguous(), "o is not laid out (B, S, H, D) in memory"
    assert lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32
    assert torch.isfinite(o).all(), "o has unwritten (NaN) or overflowed elements"
    assert torch.isfinite(lse).all(), "lse has unwritten (NaN) or overflowed elements"
    return o, lse


def check(q, k, v, causal=False, scale=None, lse_tol=LSE_TOL, window=None, **options):
    o, lse = run(q, k, v, causal, scale, window, **options)
    ref_o, ref_lse = reference(q, k, v, causal, scale, window)
    err = rel_err(o, ref_o)
    assert err < O_TOL[q.dtype], f"o rel err {err}"
    lse_err = (lse.double() - ref_lse).abs().max().item()
    assert lse_err < lse_tol, f"lse abs err {lse_err}"
    return o, lse


def make(B, Hq, Hkv, Sq, Sk, D, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, Sq, D, device="cuda", dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, Sk, D, device="cuda", dtype=dtype, generator=g)
    return q, k, v


DTYPES = [torch.bfloat16, torch.float16]

# (B, Hq, Hkv, Sq, Sk, D, causal). At S = 4097 the fp64 reference holds Sq x Sk doubles per head: few heads there.
CASES = [
    (1, 1, 1, 1, 1, 64, False),
    (1, 1, 1, 1, 1, 128, True),
    (2, 4, 4, 17, 17, 64, False),
    (2, 4, 4, 17, 17, 128, True),
    (1, 8, 4, 128, 128, 128, False),  # GQA 2
    (1, 8, 2, 128, 128, 64, True),  # GQA 4
    (1, 8, 1, 1000, 1000, 128, True),  # GQA 8
    (2, 16, 2, 1000, 1000, 64, False),  # GQA 8
    (16, 16, 16, 128, 128, 128, True),  # B*H = 256: many blocks
    (8, 32, 8, 256, 256, 64, False),  # B*H = 256, GQA 4
    (1, 2, 1, 4097, 4097, 128, True),
    (1, 1, 1, 4097, 4097, 64, False),
    (1, 4, 2, 17, 1000, 128, False),  # Sq < Sk
    (3, 4, 1, 1000, 1, 64, False),  # one key: o is v, lse the one score
    (1, 2, 2, 1, 4097, 128, False),  # one query against a long cache
    (1, 4, 4, 4097, 128, 64, False),  # Sq > Sk
    (1, 2, 1, 128, 17, 128, False),
    (1, 2, 1, 2500, 2500, 64, True),  # causal D = 64: 192-row tiles (three warpgroups), a tail of 4
    (2, 4, 2, 300, 300, 64, True),  # causal D = 64 under 2048 queries: two tiles a head, the first 64 rows above row 0
    # D = 256: 64-key stages, one Q buffer, O staged apart from it.
    (1, 1, 1, 1, 1, 256, False),
    (2, 4, 4, 17, 17, 256, True),
    (1, 8, 2, 128, 128, 256, False),  # GQA 4
    (1, 8, 1, 1000, 1000, 256, True),  # GQA 8
    (16, 8, 8, 128, 128, 256, True),  # 128 tiles
    (1, 2, 1, 4097, 4097, 256, False),
    (1, 2, 2, 1, 4097, 256, False),  # one query against a long cache
    (1, 4, 4, 4097, 65, 256, False),  # Sq > Sk, a key block of one key
    (3, 4, 1, 1000, 1, 256, False),  # one key
]


def case_id(c):
    B, Hq, Hkv, Sq, Sk, D, causal = c
    return f"B{B}-H{Hq}kv{Hkv}-S{Sq}x{Sk}-D{D}" + ("-causal" if causal else "")


def assert_split_counters_zero(ring_name: str) -> None:
    """The split kernels' counters (a zeroed ring, ops._zeroed_slot) are left zero by every launch, for the next."""
    torch.cuda.synchronize()
    ring = ops._zeroed_rings[(ring_name, torch.cuda.current_device())]
    assert int(ring.abs().sum()) == 0, f"a launch left a {ring_name} counter non-zero"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_matches_fp64_reference(case, dtype):
    B, Hq, Hkv, Sq, Sk, D, causal = case
    check(*make(B, Hq, Hkv, Sq, Sk, D, dtype), causal=causal)


@pytest.mark.parametrize("schedule", ["dynamic", "static"])
@pytest.mark.parametrize("max_blocks", [1, 3])
@pytest.mark.parametrize("B,Hq,Hkv,S,D,causal", [
    (1, 2, 1, 300, 64, False),  # 3 key blocks per tile, 6 tiles
    (2, 2, 2, 257, 128, True),  # tiles of 1 to 3 key blocks, heaviest first
    (3, 4, 4, 128, 128, True),  # one key block per tile
    (1, 3, 3, 2100, 64, True),  # causal D = 64: 192-row tiles, 11 per head, up to 17 key blocks
    (2, 2, 2, 500, 64, True),  # causal D = 64: 3 tiles per head of 1 to 4 key blocks
    # Causal tiles laid out from the last row up: the first tile starts 64 rows above row 0 (an empty slice, not
    # loaded or stored); 2200 also leaves a tail of 24 rows in the last tile.
    (1, 3, 3, 2048, 64, True),
    (1, 3, 3, 2200, 64, True),
    (1, 3, 3, 300, 256, False),  # D = 256: one Q buffer handed back after each tile's last scores
    (2, 2, 1, 257, 256, True),
])
def test_persistent_grid_walks_many_tiles(B, Hq, Hkv, S, D, causal, max_blocks, schedule):
    # The forward runs one block per SM; a capped grid makes every block walk several tiles (K/V stages, Q buffers
    # and the warpgroups' turns run on across tiles) at shapes small enough for the fp64 reference.
    q, k, v = make(B, Hq, Hkv, S, S, D, torch.bfloat16, seed=3)
    poison_allocator(((B, Hq, S, D), q.dtype), ((B, Hq, S), torch.float32))
    o, lse = ops.attention_forward(q, k, v, is_causal=causal, _max_blocks=max_blocks, _schedule=schedule)
    ref_o, ref_lse = reference(q, k, v, causal)
    assert rel_err(o, ref_o) < O_TOL[q.dtype]
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL
    o_full, _ = ops.attention_forward(q, k, v, is_causal=causal)
    assert torch.equal(o, o_full), "the result depends on how tiles are spread over blocks"


# The last wave split by keys: a capped grid leaves r = tiles % grid tiles for the last wave, which the dynamic
# schedule walks as 2-4 key ranges, merged by the warpgroup that completes each tile's rows (D = 128 over at least
# 64 key blocks only). (B, Hq, Hkv, Sq, Sk, D, max_blocks, parts)
SPLIT_CASES = [
    (1, 5, 5, 1000, 8200, 128, 3, 3),  # 40 tiles, r = 1, 65 key blocks in 21 + 22 + 22
    (1, 4, 2, 300, 8193, 128, 5, 2),  # grouped, a query tail, the last key block of one key
    (1, 3, 3, 130, 9000, 128, 4, 2),  # tiles of 128 and 2 rows, r = 2
    (1, 5, 5, 100, 8300, 128, 4, 4),  # one 100-row tile per head, quarters
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", SPLIT_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}kv{c[2]}-S{c[3]}x{c[4]}-D{c[5]}-"
                                                            f"grid{c[6]}-parts{c[7]}")
def test_last_wave_split_by_keys(case, dtype):
    B, Hq, Hkv, Sq, Sk, D, max_blocks, parts = case
    ext = ops._require_kernels(torch.device("cuda", torch.cuda.current_device()))
    floats, counts = ext.attention_forward_split_plan(B, Hq, Sq, Sk, D, False, max_blocks, True)
    r = (-(-Sq // 128) * B * Hq) % max_blocks
    assert (floats, counts) == (r * parts * 128 * (D + 1), r * 2), "the case does not split as described"
    never = [(B, Hq, Sq, Sk, D, False, max_blocks, False),  # the static schedule
             (B, Hq, Sq, Sk, D, True, max_blocks, True),  # causal
             (B, Hq, Sq, Sk, 64, False, max_blocks, True),  # D = 64 (three warpgroups)
             (B, Hq, Sq, 63 * 128, D, False, max_blocks, True)]  # fewer than 64 key blocks
    for args in never:
        assert ext.attention_forward_split_plan(*args) == (0, 0), args
    q, k, v = make(B, Hq, Hkv, Sq, Sk, D, dtype, seed=13)
    poison_allocator(((B, Hq, Sq, D), dtype), ((B, Hq, Sq), torch.float32))
    o, lse = ops.attention_forward(q, k, v, _max_blocks=max_blocks)
    ref_o, ref_lse = reference(q, k, v)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    assert rel_err(o, ref_o) < O_TOL[dtype]
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL
    whole_o, whole_lse = ops.attention_forward(q, k, v, _max_blocks=max_blocks, _tail_split=False)
    torch.testing.assert_close(o, whole_o, rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(lse, whole_lse, rtol=1e-4, atol=1e-4)
    for _ in range(3):  # the parts are summed in one order whichever merges
        again_o, again_lse = ops.attention_forward(q, k, v, _max_blocks=max_blocks)
        assert torch.equal(again_o, o) and torch.equal(again_lse, lse)
    assert_split_counters_zero("attention_split")


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("scale,causal,D", [(0.3, False, 64), (1.0, True, 128), (0.5, True, 256)])
def test_custom_scale(scale, causal, D, dtype):
    q, k, v = make(2, 4, 2, 300, 300, D, dtype)
    o, lse = check(q, k, v, causal=causal, scale=scale)
    o_default, _ = ops.attention_forward(q, k, v, is_causal=causal)
    assert not torch.equal(o, o_default), "the scale argument was ignored"


@pytest.mark.parametrize("S", [1, 77, 129, 1000])
@pytest.mark.parametrize("D", [64, 128, 256])
def test_causal_odd_lengths(S, D):
    dtype = torch.bfloat16 if D >= 128 else torch.float16
    check(*make(2, 3, 3, S, S, D, dtype), causal=True)


def test_causal_first_row_is_v0():
    # Top-left mask: query 0 sees key 0 only, so o[..., 0, :] is v[..., 0, :] and lse the one score.
    q, k, v = make(1, 2, 1, 64, 64, 128, torch.bfloat16)
    o, lse = run(q, k, v, causal=True)
    ref_row = v[:, [0, 0], 0].float()
    assert (o[:, :, 0].float() - ref_row).abs().max().item() < 1e-2
    score = (q[:, :, 0].double() * k[:, [0, 0], 0].double()).sum(-1) * 128 ** -0.5
    assert (lse[:, :, 0].double() - score).abs().max().item() < 1e-3


def strided_inputs(layout, B, Hq, Hkv, S, D, dtype):
    """Non-contiguous (B, H, S, D) views with a unit last stride; returns (q, k, v, base buffers)."""
    g = torch.Generator(device="cuda").manual_seed(1)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g)

    if layout == "bshd":  # LitGPT's (B, S, H, D) storage viewed as (B, H, S, D)
        bufs = [randn(B, S, Hq, D), randn(B, S, Hkv, D), randn(B, S, Hkv, D)]
        q, k, v = (t.transpose(1, 2) for t in bufs)
    elif layout == "fused_qkv":  # one (B, S, Hq + 2 Hkv, D) buffer, split by heads
        bufs = [randn(B, S, Hq + 2 * Hkv, D)]
        qkv = bufs[0].transpose(1, 2)
        q, k, v = qkv[:, :Hq], qkv[:, Hq:Hq + Hkv], qkv[:, Hq + Hkv:]
    elif layout == "seq_slice":  # a slice of a longer sequence dim (a preallocated cache)
        bufs = [randn(B, Hq, S + 40, D), randn(B, Hkv, S + 24, D), randn(B, Hkv, S + 8, D)]
        q, k, v = bufs[0][:, :, 3:3 + S], bufs[1][:, :, :S], bufs[2][:, :, 8:]
    elif layout == "wide_rows":  # rows of 2D elements of which the first D are used
        bufs = [randn(B, Hq, S, 2 * D), randn(B, Hkv, S, 2 * D), randn(B, S, Hkv, 3 * D)]
        q, k = bufs[0][..., :D], bufs[1][..., D:]
        v = bufs[2].transpose(1, 2)[..., 2 * D:]
    else:
        raise AssertionError(layout)
    for t in (q, k, v):
        assert not t.is_contiguous() and t.stride(-1) == 1
    return q, k, v, bufs


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("layout,D", [("bshd", 128), ("fused_qkv", 64), ("seq_slice", 128), ("wide_rows", 64),
                                      ("bshd", 256), ("wide_rows", 256)])
def test_strided_views_match_contiguous_bitwise(layout, D, causal):
    q, k, v, bufs = strided_inputs(layout, 2, 8, 2, 333, D, torch.bfloat16)
    before = [b.clone() for b in bufs]
    o, lse = check(q, k, v, causal=causal)
    o_c, lse_c = ops.attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=causal)
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c), "a strided run differs from the contiguous one"
    assert all(torch.equal(b, c) for b, c in zip(bufs, before)), "the inputs were written to"


def test_output_projection_input_is_a_view():
    # LitGPT's next step after attention; a copy here was kept alive until the backward (issue 6's peak memory).
    q, k, v = make(2, 4, 4, 77, 77, 64, torch.bfloat16)
    o, _ = check(q, k, v, causal=True)
    y = o.transpose(1, 2).reshape(2, 77, 4 * 64)
    assert y.data_ptr() == o.data_ptr() and y.is_contiguous()


@pytest.mark.parametrize(
    "case,dtype",
    [((4, 16, 16, 2048, 2048, 128, False), torch.bfloat16),
     ((4, 16, 16, 2048, 2048, 64, True), torch.float16),
     ((2, 32, 4, 1500, 1500, 128, True), torch.bfloat16),
     ((2, 8, 8, 2048, 2048, 256, False), torch.bfloat16),
     ((2, 8, 2, 1500, 1500, 256, True), torch.float16)],
    ids=["full-bf16", "causal-fp16", "gqa8-causal-bf16", "d256-full-bf16", "d256-gqa4-causal-fp16"],
)
def test_repeatable_bitwise(case, dtype):
    # Many blocks on every SM: a race or an order-dependent reduction shows as a result that moves.
    B, Hq, Hkv, Sq, Sk, D, causal = case
    q, k, v = make(B, Hq, Hkv, Sq, Sk, D, dtype, seed=2)
    o, lse = run(q, k, v, causal)
    for _ in range(2):
        o2, lse2 = run(q, k, v, causal)
        assert torch.equal(o, o2) and torch.equal(lse, lse2), "results differ between identical runs"


@pytest.mark.parametrize(
    "case",
    [(3, 5, 5, 1, 1, 64, False), (1, 3, 1, 129, 129, 128, True), (2, 7, 7, 1000, 333, 64, False),
     (1, 4, 4, 4097, 4097, 128, True), (1, 3, 1, 129, 129, 256, True), (2, 5, 5, 1000, 333, 256, False)],
    ids=case_id,
)
def test_output_written_entirely(case):
    # Partial tiles at every edge (rows, keys, odd head counts); run() poisons the allocator and checks finiteness.
    B, Hq, Hkv, Sq, Sk, D, causal = case
    q, k, v = make(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, seed=3)
    o, lse = run(q, k, v, causal)
    # Zeros where nothing was written would also be finite: the values must match too.
    ref_o, ref_lse = reference(q, k, v, causal)
    assert rel_err(o, ref_o) < O_TOL[torch.bfloat16]
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL


@pytest.mark.parametrize(
    "D,causal,dtype",
    [(64, False, torch.bfloat16), (128, False, torch.bfloat16), (64, True, torch.bfloat16),
     (128, True, torch.bfloat16), (128, True, torch.float16), (256, False, torch.bfloat16),
     (256, True, torch.float16)],
)
def test_large_scores(D, causal, dtype):
    # Inputs x 30: scores of order +-1000 (exp overflows fp32 without the running max), and softmax rows are
    # nearly one-hot, so each new key block may raise the max and rescale what was accumulated.
    q, k, v = make(2, 4, 2, 700, 700, D, dtype, seed=4)
    q, k = q * 30, k * 30
    check_large_lse(q, k, v, causal)  # |lse| reaches ~4000 here


def rising_scores(B, H, S, D, rise, dtype, seed, rising_rows):
    """q, k, v with small random scores, plus, in the query rows where rising_rows(row index) holds, a score that
    sits `rise` (base 2, at the default scale) higher in each key block (the kernel's: 128 keys, 64 at D = 256)
    than in the block before."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, H, S, D, device="cuda", generator=g) * 0.05
    k = torch.randn(B, H, S, D, device="cuda", generator=g) * 0.05
    v = torch.randn(B, H, S, D, device="cuda", generator=g)
    q[..., 0] = rising_rows(torch.arange(S, device="cuda")).float()
    block = torch.arange(S, device="cuda") // (64 if D == 256 else 128)
    k[..., 0] = block * rise / (D ** -0.5 * 1.4426950408889634)  # base-2 score of a key: about its block times rise
    return q.to(dtype), k.to(dtype), v.to(dtype)


def check_large_lse(q, k, v, causal=False, window=None):
    # |lse| reaches the thousands with large scores, where an fp32 ulp is ~1e-4 and the scores' fp32 sums carry error
    # of a few 1e-4: allow the absolute lse tolerance plus a relative 1e-5.
    ref_lse = reference(q, k, v, causal, window=window)[1]
    check(q, k, v, causal=causal, lse_tol=LSE_TOL + 1e-5 * ref_lse.abs().max().item(), window=window)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("rise", [3.0, 7.5, 8.5, 12.0])
@pytest.mark.parametrize("D,causal", [(64, False), (128, False), (128, True), (256, False), (256, True)])
def test_running_max_rising_block_by_block(D, causal, rise, dtype):
    # Every 128-key block's scores sit `rise` (base 2) above the block before, below, near and above the 8 by which
    # the kernel lets a block pass the maximum it keeps before it moves it and rescales o (lazy rescaling): so the
    # maximum is kept on some blocks, with exponents up to 2^8, and moved on others, and the last block dominates.
    # Queries vary a little per row; 1000 keys end in a part-filled block.
    q, k, v = rising_scores(1, 4, 1000, D, rise, dtype, seed=11, rising_rows=lambda rows: rows >= 0)
    check_large_lse(q, k, v, causal)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("rise", [2.0, 3.5, 9.0, 200.0])
@pytest.mark.parametrize("D,S,causal", [(64, 1000, False), (64, 2100, True), (128, 1000, False), (128, 700, True),
                                         (256, 1000, False), (256, 700, True)])
def test_running_max_rising_in_one_warp_of_rows(D, S, causal, rise, dtype):
    # Only the second warp's 16 rows of each 64-row slice see scores rising by `rise` (base 2) per key block; the
    # other rows' scores stay small. The kernel takes each block against the maximum it keeps and checks the
    # exponents' partial sums per warp. Rise 2: they pass; 3.5: they fail but no exponent passes 2^8 (kept as is);
    # 9: the warp's rows move to the block's maxima, taken from the exponents; 200: the exponents overflow fp32 and
    # that warp alone scores its block again, while the other warps of its warpgroup keep their first pass.
    q, k, v = rising_scores(1, 3, S, D, rise, dtype, seed=12, rising_rows=lambda rows: (rows % 64) // 16 == 1)
    if dtype == torch.float16 and rise == 200.0:
        k = k.clamp(-60000, 60000)  # fp16's range; the scores still jump by far more than 2^128 between blocks
    check_large_lse(q, k, v, causal)


def test_large_positive_offset():
    # All scores large and positive with a tiny spread: lse ~ offset + log(Sk), softmax nearly uniform.
    q, k, v = make(1, 4, 4, 300, 500, 64, torch.bfloat16, seed=5)
    q = (q * 0.05 + 4).to(torch.bfloat16)
    k = (k * 0.05 + 4).to(torch.bfloat16)
    check_large_lse(q, k, v)


def test_runs_on_the_current_stream():
    q, k, v = make(2, 8, 2, 513, 513, 64, torch.float16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        o, lse = ops.attention_forward(q, k, v, is_causal=True)
    torch.cuda.current_stream().wait_stream(side)
    ref_o, ref_lse = reference(q, k, v, True)
    assert rel_err(o, ref_o) < O_TOL[torch.float16]
    assert (lse.double() - ref_lse).abs().max().item() < LSE_TOL


def test_reference_matches_torch_sdpa():
    # The reference itself, against torch's math SDPA in fp64 (GQA through enable_gqa), so a failure above is
    # the kernel's.
    q, k, v = make(2, 8, 2, 65, 65, 64, torch.bfloat16)
    for causal in (False, True):
        o, _ = reference(q, k, v, causal)
        sdpa = torch.nn.functional.scaled_dot_product_attention(
            q.double(), k.double(), v.double(), is_causal=causal, enable_gqa=True)
        assert rel_err(sdpa, o) < 1e-12


def _bad(name):
    q, k, v = make(2, 4, 2, 32, 32, 64, torch.bfloat16)
    if name == "head_dim_96":
        return make(2, 4, 2, 32, 32, 96, torch.bfloat16)
    if name == "float32":
        return q.float(), k.float(), v.float()
    if name == "mixed_dtype":
        return q, k.half(), v.half()
    if name == "heads_not_multiple":
        return make(2, 6, 4, 32, 32, 64, torch.bfloat16)
    if name == "batch_mismatch":
        return q, k[:1], v[:1]
    if name == "kv_mismatch":
        return q, k, v[:, :, :16]
    if name == "scale_not_finite":
        return q, k, v
    if name == "cpu":
        return q.cpu(), k.cpu(), v.cpu()
    if name == "three_dims":
        return q[0], k[0], v[0]
    raise AssertionError(name)


BAD_ARGUMENTS = {  # name -> a loose pattern the error message must contain
    "head_dim_96": r"head dim|head_dim|head size|\b96\b",
    "float32": r"dtype|float32",
    "mixed_dtype": r"dtype",
    "heads_not_multiple": r"heads|Hq|Hkv|multiple",
    "batch_mismatch": r"batch|shape",
    "kv_mismatch": r"shape|same|length",
    "scale_not_finite": r"scale",
    "cpu": r"cuda|CUDA|device",
    "three_dims": r"dim|4-D|4D|shape|\(B, H",
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_raise_named_errors(name):
    q, k, v = _bad(name)
    with pytest.raises((ValueError, TypeError), match=BAD_ARGUMENTS[name]):
        ops.attention_forward(q, k, v, scale=float("inf") if name == "scale_not_finite" else None)


def test_layouts_tma_cannot_read_are_copied():
    """A last dim that is not contiguous, or a stride off 16 bytes, is copied first: the result is still right."""
    q, k, v = make(2, 4, 2, 33, 40, 64, torch.bfloat16)
    v_t = v.transpose(-1, -2).contiguous().transpose(-1, -2)  # last-dim stride 40
    wide = torch.randn(2, 2, 40, 68, device="cuda", dtype=torch.bfloat16)  # rows 136 bytes apart
    wide[..., :64] = k
    check(q, wide[..., :64], v_t)


@pytest.mark.parametrize("scale", [-0.2, 0.0])
def test_negative_and_zero_scale(scale):
    """The kernel wants scale > 0; the op folds a negative one into q and treats 0 as uniform weights."""
    q, k, v = make(1, 2, 1, 70, 90, 64, torch.bfloat16)
    check(q, k, v, causal=False, scale=scale)


# ------------------------------------------------------------------------------------------------
# Backward: ops.attention_backward against float64 autograd of the reference

# ||grad - ref|| / ||ref||: the kernel rounds P and dS to the input dtype for its products (as FlashAttention does)
# and dq/dk/dv on the way out.
GRAD_TOL = {torch.bfloat16: 3e-2, torch.float16: 1e-2}

BACKWARD_CASES = [
    (1, 1, 1, 1, 1, 64, False),
    (1, 2, 2, 17, 17, 128, True),
    (2, 4, 4, 130, 130, 64, True),
    (1, 8, 2, 128, 128, 128, False),  # GQA 4: dk/dv summed over 4 query heads in-kernel
    (1, 8, 1, 1000, 1000, 64, True),  # GQA 8
    (2, 4, 2, 300, 300, 128, True),
    (1, 4, 4, 17, 1000, 128, False),  # Sq < Sk
    (1, 2, 1, 1000, 77, 64, False),  # Sq > Sk, key tail
    (1, 2, 2, 1, 300, 128, False),
    (1, 1, 1, 2049, 2049, 128, True),
    # D = 256: blocks of 64 keys, the two warpgroups splitting D.
    (1, 1, 1, 1, 1, 256, False),
    (1, 2, 2, 17, 17, 256, True),
    (2, 4, 4, 130, 130, 256, True),
    (1, 8, 2, 128, 128, 256, False),  # GQA 4
    (1, 8, 1, 500, 500, 256, True),  # GQA 8
    (1, 4, 4, 17, 1000, 256, False),  # Sq < Sk
    (1, 2, 1, 1000, 77, 256, False),  # Sq > Sk, a key tail
    (1, 1, 1, 2049, 2049, 256, True),
]


def backward_check(q, k, v, causal=False, scale=None, group_split=0, tail_split=True, window=None, dq_finalize=None):
    o, lse = ops.attention_forward(q, k, v, is_causal=causal, scale=scale, window=window)
    g = torch.randn_like(o)
    poison_allocator((tuple(q.shape), q.dtype), (tuple(k.shape), k.dtype))
    dq, dk, dv = ops.attention_backward(q, k, v, o, lse, g, is_causal=causal, scale=scale, window=window,
                                        _group_split=group_split, _tail_split=tail_split, _dq_finalize=dq_finalize)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dk.dtype == dv.dtype == q.dtype
    refs = ops.attention_backward_reference(q, k, v, o, lse, g, is_causal=causal, scale=scale, window=window)
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), refs):
        assert torch.isfinite(got).all(), f"{name} has unwritten (NaN) or overflowed elements"
        # Relative to the reference's norm, with a floor: with one key dq and dk are exactly 0 in exact math,
        # and the kernel's dP - delta leaves rounding noise of the input dtype there.
        err = ((got.double() - ref).norm() / ref.norm().clamp_min(1e-3 * got.numel() ** 0.5)).item()
        assert err < GRAD_TOL[q.dtype], f"{name} rel err {err}"
    return (dq, dk, dv), g, (o, lse)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", BACKWARD_CASES, ids=case_id)
def test_backward_matches_fp64_autograd(case, dtype):
    B, Hq, Hkv, Sq, Sk, D, causal = case
    backward_check(*make(B, Hq, Hkv, Sq, Sk, D, dtype, seed=3), causal=causal)


GROUPED_CASES = [c for c in BACKWARD_CASES if c[2] < c[1]] + [
    (4, 8, 2, 1024, 1024, 64, True),  # 64 blocks grouped: chunks doubled to hold a wave of blocks
    (2, 16, 2, 2048, 2048, 128, True),
    (3, 6, 3, 777, 777, 128, False),
    (2, 8, 2, 1024, 1024, 256, True),
]


@pytest.mark.parametrize("parts", ["whole", "halves", "single heads"])
@pytest.mark.parametrize("case", GROUPED_CASES, ids=case_id)
def test_backward_grouped_heads_summed_in_kernel_or_over_parts(case, parts):
    """Grouped K/V: dK, dV summed over the group by one block (fp32, in-kernel), or the group walked in parts by
    several blocks and the parts' dK, dV summed after the kernel (what ops picks where the grid would be too small
    for the GPU, backward_group_split); both against float64."""
    B, Hq, Hkv, Sq, Sk, D, causal = case
    G = Hq // Hkv
    split = {"whole": 1, "halves": 2, "single heads": G}[parts]
    if G % split:
        pytest.skip(f"{G} heads a group do not halve")
    backward_check(*make(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, seed=7), causal=causal, group_split=split)


# B, Hq, Hkv, Sq, Sk, D, split_from, parts: units are B * Hkv * ceil(Sk / 128), a unit's steps Hq / Hkv * ceil(Sq / 64).
TAIL_SPLIT_CASES = [
    (1, 2, 2, 1000, 300, 128, 0, 3),  # every unit in thirds of 16 steps; a key tail (300 = 2 x 128 + 44), a query tail
    (2, 4, 2, 640, 256, 64, 5, 2),  # GQA 2: a unit's 20 steps span its group's two heads; the last 3 of 8 units halved
    (1, 8, 1, 200, 1000, 128, 3, 4),  # MQA 8: 32 steps a unit over 8 heads, in quarters; the last 5 of 8 units
    (1, 3, 3, 1000, 1100, 128, 20, 7),  # the last 7 of 27 units in sevenths of 16 steps (2-3 each); key and query tails
    (1, 17, 17, 1000, 512, 128, 0, 3),  # all 68 units in thirds: 204 parts, more than one round on a 132-SM GPU
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", TAIL_SPLIT_CASES, ids=lambda c: f"B{c[0]}-H{c[1]}kv{c[2]}-S{c[3]}x{c[4]}-D{c[5]}-"
                                                                 f"from{c[6]}-parts{c[7]}")
def test_backward_last_wave_split_by_queries(case, dtype):
    """Units walked in query ranges by several blocks, whose fp32 dK, dV the last part sums in part order: against
    float64, against the units walked whole, repeatable bitwise, and the counters left zero."""
    B, Hq, Hkv, Sq, Sk, D, split_from, parts = case
    q, k, v = make(B, Hq, Hkv, Sq, Sk, D, dtype, seed=11)
    (dq, dk, dv), g, (o, lse) = backward_check(q, k, v, tail_split=(split_from, parts))
    whole = ops.attention_backward(q, k, v, o, lse, g, _tail_split=False)
    for got, ref in zip((dq, dk, dv), whole):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
    units = B * Hkv * -(-Sk // 128)
    scratch = ((units - split_from) * parts * 2 * 128 * D,)
    for _ in range(3):  # dq is added by every key block in any order; dk and dv are summed in one order
        poison_allocator((scratch, torch.float32))  # a part read before it is written would bring NaN in
        _, again_dk, again_dv = ops.attention_backward(q, k, v, o, lse, g, _tail_split=(split_from, parts))
        assert torch.equal(again_dk, dk) and torch.equal(again_dv, dv)
    assert_split_counters_zero("attention_bwd_split")


def test_backward_last_wave_split_is_checked():
    q, k, v = make(1, 2, 2, 256, 256, 64, torch.bfloat16, seed=1)
    o, lse = ops.attention_forward(q, k, v)
    g = torch.randn_like(o)
    for bad, match in (((0, 9), "split_parts"), ((4, 2), "split_from"), ((-1, 2), "split_from"),
                       ((1, 2, 3), "_tail_split"), ("yes", "_tail_split")):
        with pytest.raises(ValueError, match=match):
            ops.attention_backward(q, k, v, o, lse, g, _tail_split=bad)
    o, lse = ops.attention_forward(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match="non-causal"):
        ops.attention_backward(q, k, v, o, lse, g, is_causal=True, _tail_split=(0, 2))
    q, k, v = make(1, 2, 2, 256, 256, 256, torch.bfloat16, seed=1)
    o, lse = ops.attention_forward(q, k, v)
    with pytest.raises(ValueError, match="not taken at head_dim 256"):
        ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), _tail_split=(0, 2))


def test_backward_group_split_is_checked():
    q, k, v = make(1, 4, 2, 64, 64, 64, torch.bfloat16, seed=1)
    o, lse = ops.attention_forward(q, k, v)
    for bad in (3, -1):
        with pytest.raises(ValueError, match="_group_split"):
            ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), _group_split=bad)


@pytest.mark.parametrize("B,H,S,D", [(3, 6, 2048, 128), (2, 8, 4097, 64), (1, 5, 2048, 256)])
def test_causal_head_chunks_with_a_partial_last_chunk(B, H, S, D):
    # Causal tiles go heaviest first within chunks of heads sized to L2 (16 MiB of shared bytes): at S = 2048,
    # D = 128 the forward's chunks hold 16 heads and the backward's 8 (18 heads: a last chunk of 2); at S = 4097,
    # D = 64, 15 and 7 (16 heads: last chunks of 1 and 2).
    q, k, v = make(B, H, H, S, S, D, torch.bfloat16, seed=5)
    check(q, k, v, causal=True)
    o_static, _ = ops.attention_forward(q, k, v, is_causal=True, _schedule="static")
    o_dynamic, _ = ops.attention_forward(q, k, v, is_causal=True)
    assert torch.equal(o_static, o_dynamic), "the result depends on the tile schedule"
    backward_check(q, k, v, causal=True)


def test_backward_reads_lse_rows_tma_cannot_read_from_a_copy():
    # The backward loads lse and delta rows by TMA, which needs each row 16-byte aligned: the forward pads its lse
    # rows in memory (S = 77: rows 80 floats apart); a packed lse (rows 308 bytes apart) or a sliced one is copied
    # first, with the same result.
    q, k, v = make(2, 4, 2, 77, 77, 128, torch.bfloat16, seed=6)
    o, lse = ops.attention_forward(q, k, v, is_causal=True)
    assert lse.stride() == (4 * 80, 80, 1) and lse.data_ptr() % 16 == 0
    g = torch.randn_like(o)
    dq, dk, dv = ops.attention_backward(q, k, v, o, lse, g, is_causal=True)
    wide = torch.full((2, 4, 78), float("nan"), device="cuda")
    wide[..., 1:] = lse
    for other in (lse.contiguous(), wide[..., 1:]):
        dq2, dk2, dv2 = ops.attention_backward(q, k, v, o, other, g, is_causal=True)
        assert torch.equal(dk, dk2) and torch.equal(dv, dv2)
        assert rel_err(dq2, dq.double()) < 1e-2


@pytest.mark.parametrize("D", [64, 256])
@pytest.mark.parametrize("scale", [0.3, -0.2])
def test_backward_custom_scale(scale, D):
    backward_check(*make(1, 4, 2, 150, 150, D, torch.bfloat16, seed=4), causal=True, scale=scale)


@pytest.mark.parametrize("D", [128, 256])
def test_backward_strided_views_and_repeatability(D):
    """LitGPT's (B, S, H, D) views read in place; dk and dv are bitwise repeatable (no atomics), dq is summed by
    atomic adds in varying order, so it may differ in the last bits only."""
    B, S, Hq, Hkv = 2, 200, 4, 2
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    v = torch.randn(B, S, Hkv, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    (dq, dk, dv), g, (o, lse) = backward_check(q, k, v, causal=True)
    for _ in range(2):
        dq2, dk2, dv2 = ops.attention_backward(q, k, v, o, lse, g, is_causal=True)
        assert torch.equal(dk, dk2) and torch.equal(dv, dv2)
        assert rel_err(dq2, dq.double()) < 1e-2


def test_backward_through_autograd_matches_sdpa():
    """End to end against torch's own SDPA backward in the same dtype (the error budget users see)."""
    q, k, v = (t.requires_grad_() for t in make(2, 8, 8, 512, 512, 128, torch.bfloat16, seed=5))
    o, lse = ops.attention_forward(q, k, v, is_causal=True)
    g = torch.randn_like(o)
    ours = ops.attention_backward(q, k, v, o, lse, g, is_causal=True)
    ref = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True), (q, k, v), g)
    exact = ops.attention_backward_reference(q, k, v, o, lse, g, is_causal=True)
    for got, theirs, truth in zip(ours, ref, exact):
        assert rel_err(got, truth) < 2 * rel_err(theirs, truth) + 1e-3


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dq_finalize_scales_and_rounds_like_torch(dtype):
    # The backward's last pass: dq = scale * dq_accum rounded to the input dtype, bitwise what torch's two steps
    # give (an fp32 product, then round to nearest even), overflow to inf included for fp16.
    ext = ops._require_kernels(torch.device("cuda"))
    accum = torch.randn(3, 5, 77, 64, device="cuda") * 100
    accum[0, 0, 0, :8] = torch.tensor([7e4, -7e4, 1e-30, 0.0, -0.0, 3.0, float("inf"), float("nan")])
    out = torch.full(accum.shape, float("nan"), dtype=dtype, device="cuda")
    ext.attention_dq_finalize(accum.data_ptr(), out.data_ptr(), ops._DTYPE_CODES[dtype], accum.numel(), -0.125,
                              ops._stream_handle(accum.device))
    expected = (accum * -0.125).to(dtype)
    assert torch.equal(out.isnan(), expected.isnan())  # NaN stays NaN (its payload may differ)
    keep = ~expected.isnan()
    assert torch.equal(out[keep].view(torch.int16), expected[keep].view(torch.int16))
    with pytest.raises(ValueError, match="multiple of 8"):
        ext.attention_dq_finalize(accum.data_ptr(), out.data_ptr(), ops._DTYPE_CODES[dtype], 12, 1.0,
                                  ops._stream_handle(accum.device))
    with pytest.raises(ValueError, match="aligned"):
        ext.attention_dq_finalize(accum.data_ptr() + 4, out.data_ptr(), ops._DTYPE_CODES[dtype], 8, 1.0,
                                  ops._stream_handle(accum.device))


# ------------------------------------------------------------------------------------------------
# dQ finalized beside the backward's last wave (_dq_finalize="overlap", THUNDER_TK_DQ_FINALIZE): the kernel counts
# each group of dQ rows in once its blocks' reduce-adds are complete, and the pass, launched dependent on it, rounds a
# group only when its counter is full. A group read early would round a partial sum: wrong against float64.


def dq_steps_reference(Sq, Sk, D, G, causal, window=None):
    """What every counter reaches: a query head's 64-row tiles that see each key block (128 keys, 64 at D = 256),
    summed over the key blocks, times the G query heads of a group."""
    keys, q_tiles = (64 if D == 256 else 128), -(-Sq // 64)
    steps = 0
    for t in range(-(-Sk // keys)):
        first = t * keys // 64 if causal else 0
        end = q_tiles if not (window and window < Sk) else min(q_tiles, (t * keys + keys - 2 + window) // 64 + 1)
        steps += end - first
    return G * steps


OVERLAP_CASES = BACKWARD_CASES + [
    (8, 16, 16, 512, 512, 128, False),  # 512 units: several waves, so the pass starts under the last one
    (2, 16, 4, 1024, 1024, 64, True),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", OVERLAP_CASES, ids=case_id)
def test_backward_with_overlapped_dq_finalize(case, dtype):
    B, Hq, Hkv, Sq, Sk, D, causal = case
    q, k, v = make(B, Hq, Hkv, Sq, Sk, D, dtype, seed=5)
    # Groups whole (a split's sums would come between the kernel and the pass, which then runs after both).
    (dq, dk, dv), g, (o, lse) = backward_check(q, k, v, causal=causal, group_split=1, dq_finalize="overlap")
    plain = ops.attention_backward(q, k, v, o, lse, g, is_causal=causal, _group_split=1, _dq_finalize="pass")
    for got, ref in zip((dq, dk, dv), plain):  # the same sums; dQ's reduce-adds in another order
        torch.testing.assert_close(got, ref, rtol=1e-2, atol=1e-2)


def test_overlap_asked_for_a_split_group_takes_the_pass_after_the_sums():
    backward_check(*make(1, 8, 2, 300, 300, 128, torch.bfloat16, seed=29), causal=True, group_split=2,
                   dq_finalize="overlap")


@pytest.mark.parametrize("case", [(1, 2, 2, 1000, 300, 128, 0, 3), (1, 8, 1, 200, 1000, 128, 3, 4)],
                         ids=lambda c: f"B{c[0]}-H{c[1]}kv{c[2]}-S{c[3]}x{c[4]}-from{c[6]}-parts{c[7]}")
def test_overlapped_dq_finalize_counts_the_parts_of_split_units(case):
    """Parts of a split unit each count their own steps; the group's counter still ends at the unit's."""
    B, Hq, Hkv, Sq, Sk, D, split_from, parts = case
    backward_check(*make(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, seed=13), group_split=1,
                   tail_split=(split_from, parts), dq_finalize="overlap")


# (B, Hq, Hkv, S, D, W) as WINDOW_CASES below.
@pytest.mark.parametrize("case", [(1, 2, 1, 17, 64, 1), (2, 4, 2, 128, 64, 7), (1, 4, 4, 128, 128, 127),
                                  (1, 4, 2, 128, 256, 64), (1, 4, 2, 300, 128, 129), (1, 4, 1, 1000, 128, 64)],
                         ids=lambda c: f"B{c[0]}-H{c[1]}kv{c[2]}-S{c[3]}-D{c[4]}-W{c[5]}")
def test_overlapped_dq_finalize_with_a_window(case):
    B, Hq, Hkv, S, D, W = case
    backward_check(*make(B, Hq, Hkv, S, S, D, torch.bfloat16, seed=17), causal=True, window=W, group_split=1,
                   dq_finalize="overlap")


@pytest.mark.parametrize("case", [(1, 8, 2, 300, 300, 128, True, None), (2, 4, 4, 1000, 1000, 64, False, None),
                                  (1, 4, 2, 300, 300, 256, True, None), (1, 4, 2, 1000, 1000, 128, True, 129)],
                         ids=lambda c: f"B{c[0]}-H{c[1]}kv{c[2]}-S{c[3]}-D{c[5]}-{'causal' if c[6] else 'full'}-W{c[7]}")
def test_the_backward_fills_every_dq_counter_to_its_steps(case):
    """The counters after the kernel: each at the steps the binding returns, which are the kernel's own walk."""
    B, Hq, Hkv, Sq, Sk, D, causal, window = case
    q, k, v = make(B, Hq, Hkv, Sq, Sk, D, torch.bfloat16, seed=19)
    o, lse = ops.attention_forward(q, k, v, is_causal=causal, window=window)
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    _, _, _, order = ops._backward_into(q, k, v, o, lse, torch.randn_like(o), dk, dv, causal, None, 1, False,
                                        window, count_dq=True)
    torch.cuda.synchronize()
    assert order.target == dq_steps_reference(Sq, Sk, D, Hq // Hkv, causal, window)
    assert order.group_elements == (Hq // Hkv) * Sq * D
    assert order.counters.tolist() == [order.target] * (B * Hkv)


def test_overlapped_dq_finalize_in_order_launch_and_in_a_cuda_graph():
    """Plain launch order (the pass then waits for the whole kernel), and a captured graph replayed on new inputs."""
    q, k, v = make(2, 8, 2, 1000, 1000, 128, torch.bfloat16, seed=23)
    o, lse = ops.attention_forward(q, k, v, is_causal=True)
    g = torch.randn_like(o)
    run = lambda mode: ops.attention_backward(q, k, v, o, lse, g, is_causal=True, _group_split=1,  # noqa: E731
                                              _dq_finalize=mode)
    want = run("pass")
    with ops.dependent_launches(False):
        got = run("overlap")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run("overlap")  # warm-up
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run("overlap")
    g.copy_(torch.randn_like(g))
    graph.replay()
    want = run("pass")
    for a, b in zip(captured, want):
        torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)


def test_overlapped_dq_finalize_checks():
    ext = ops._require_kernels(torch.device("cuda"))
    accum = torch.randn(2, 4, 64, 64, device="cuda")
    out = torch.empty(accum.shape, dtype=torch.bfloat16, device="cuda")
    done = torch.zeros(2, dtype=torch.int64, device="cuda")
    call = lambda group, counters=done: ext.attention_dq_finalize(  # noqa: E731
        accum.data_ptr(), out.data_ptr(), ops._DTYPE_CODES[torch.bfloat16], accum.numel(), 1.0,
        ops._stream_handle(accum.device), counters.data_ptr(), group, 0)
    for bad in (0, 12, 3 * 64 * 64):
        with pytest.raises(ValueError, match="group_elements"):
            call(bad)
    with pytest.raises(ValueError, match="8-byte aligned"):
        ext.attention_dq_finalize(accum.data_ptr(), out.data_ptr(), ops._DTYPE_CODES[torch.bfloat16], accum.numel(),
                                  1.0, ops._stream_handle(accum.device), done.data_ptr() + 4, 4 * 64 * 64, 0)
    call(4 * 64 * 64)  # target 0: every group complete at once
    assert torch.equal(out, accum.to(torch.bfloat16))
    with pytest.raises(ValueError, match="THUNDER_TK_DQ_FINALIZE"):
        ops.dq_finalize_mode("later")


# ------------------------------------------------------------------------------------------------
# The dQ accumulator zeroed ahead (dq_zero_mode "ahead", the default): two accumulators per device and stream take
# turns, each backward kernel zeroing the next call's, and the delta pass zeroes only what no kernel did.

def _stream_turns():
    return ops._dq_accumulators.get((torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream))


# (B, Hq, Hkv, Sq, Sk, D, causal, tail_split, group_split): one after the other on one stream; shapes grow, shrink
# and repeat, and the grids (split units, split groups, D = 256's 64-key blocks) that share out the zeroing differ.
ZERO_AHEAD_SEQUENCE = [
    (1, 4, 2, 300, 300, 128, True, True, 0),
    (1, 4, 2, 300, 300, 128, True, True, 0),  # the first call's kernel zeroed this one's accumulator
    (2, 8, 4, 1000, 1000, 64, False, True, 0),  # larger: new accumulators, the delta pass zeroes
    (1, 2, 2, 17, 17, 64, False, True, 0),  # smaller: a prefix of the zeroed one
    (1, 3, 3, 1000, 1100, 128, False, (20, 7), 0),  # 160 blocks of split parts share out the zeroing
    (1, 3, 3, 1000, 1100, 128, False, (20, 7), 0),
    (1, 8, 2, 300, 300, 128, True, True, 2),  # a split group: its sums come between the kernel and the dQ pass
    (1, 8, 1, 500, 500, 256, True, True, 0),
    (1, 8, 1, 500, 500, 256, True, True, 0),
    (1, 1, 1, 1, 1, 64, False, True, 0),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
def test_dq_accumulator_zeroed_ahead_by_the_kernel_before(dtype):
    """Before each call the next accumulator is poisoned with NaN; after it, the call's kernel must have zeroed it
    (as far as its own shape), and the next call, which takes it without zeroing, must still match float64."""
    ops.clear_dq_accumulators()
    for B, Hq, Hkv, Sq, Sk, D, causal, tail_split, group_split in ZERO_AHEAD_SEQUENCE:
        q, k, v = make(B, Hq, Hkv, Sq, Sk, D, dtype, seed=Sq + D)
        if (turns := _stream_turns()) is not None:
            turns.next.fill_(float("nan"))
        backward_check(q, k, v, causal=causal, tail_split=tail_split, group_split=group_split)
        turns = _stream_turns()
        torch.cuda.synchronize()
        zeroed = turns.zeroed[turns.turn]
        assert zeroed == B * Hq * Sq * D
        assert torch.equal(turns.buffers[turns.turn][:zeroed], torch.zeros(zeroed, device="cuda"))


def test_dq_accumulators_are_per_stream_and_pass_mode_takes_none():
    q, k, v = make(2, 4, 2, 700, 700, 128, torch.bfloat16, seed=31)
    o, lse = ops.attention_forward(q, k, v)
    g = torch.randn_like(o)
    want = ops.attention_backward_reference(q, k, v, o, lse, g)
    ops.clear_dq_accumulators()
    ops.attention_backward(q, k, v, o, lse, g, _dq_zero="pass")
    assert _stream_turns() is None
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = []
    for i in range(6):  # alternating streams: each keeps its own turns, each call ordered after its stream's last
        with torch.cuda.stream(streams[i % 2]):
            results.append(ops.attention_backward(q, k, v, o, lse, g))
    for s in streams:
        torch.cuda.current_stream().wait_stream(s)
    assert sum(key[1] in (s.cuda_stream for s in streams) for key in ops._dq_accumulators) == 2
    for got in results:
        for name, a, b in zip("dq dk dv".split(), got, want):
            assert rel_err(a, b) < GRAD_TOL[torch.bfloat16], name


def test_dq_zeroing_ahead_checks(monkeypatch):
    """The binding names a zero_next it cannot take; a call it refused leaves the turns as they were, so the next
    call zeroes in its delta pass and is right."""
    q, k, v = make(1, 2, 2, 200, 200, 64, torch.bfloat16, seed=37)
    ops.clear_dq_accumulators()
    ops.attention_backward(*backward_inputs(q, k, v))
    turns = _stream_turns()
    before = (turns.turn, list(turns.zeroed))
    monkeypatch.setattr(ops._DqAccumulators, "next", property(lambda self: self.buffers[self.turn]))
    with pytest.raises(ValueError, match="must not overlap dq_accum"):
        ops.attention_backward(*backward_inputs(q, k, v))
    monkeypatch.setattr(ops._DqAccumulators, "next", property(lambda self: self.buffers[1 - self.turn][1:]))
    with pytest.raises(ValueError, match="zero_next must be 16-byte aligned"):
        ops.attention_backward(*backward_inputs(q, k, v))
    monkeypatch.undo()
    assert turns.turn == before[0] and turns.zeroed[turns.turn] == 0  # taken, so no longer known zero
    turns.buffers[turns.turn].fill_(float("nan"))
    backward_check(q, k, v)
    with pytest.raises(ValueError, match="THUNDER_TK_DQ_ZERO"):
        ops.dq_zero_mode("sometimes")


def backward_inputs(q, k, v):
    o, lse = ops.attention_forward(q, k, v)
    return q, k, v, o, lse, torch.randn_like(o)


# ------------------------------------------------------------------------------------------------
# Causal sliding window (window=W): query i keeps keys i - W < j <= i. The forward visits only the key blocks of its
# rows' windows, and rows can meet blocks (even a tile's first) where all their keys are masked; the backward walks
# only the query tiles that keep some of a block's keys.

# (B, Hq, Hkv, S, D, W) with W < S: W of 1 (each row its own key), under, at and over a key block (128; 64 at
# D = 256) and a 64-row slice, tails in S, GQA.
WINDOW_CASES = [
    (1, 2, 1, 17, 64, 1),
    (2, 2, 2, 17, 256, 7),
    (2, 4, 2, 128, 64, 7),
    (1, 4, 4, 128, 128, 127),
    (1, 4, 2, 128, 256, 64),
    (2, 4, 2, 300, 64, 1),
    (1, 4, 2, 300, 128, 129),
    (1, 2, 2, 300, 256, 200),
    (1, 8, 2, 1000, 64, 128),
    (1, 4, 1, 1000, 128, 64),
    (1, 4, 2, 1000, 256, 512),
    (1, 4, 4, 1000, 128, 7),
    (1, 2, 2, 2049, 64, 200),
    (1, 2, 1, 2049, 128, 512),
    (1, 2, 2, 2049, 256, 129),
    (1, 2, 1, 2049, 128, 1),
]


def window_id(c):
    B, Hq, Hkv, S, D, W = c
    return f"B{B}-H{Hq}kv{Hkv}-S{S}-D{D}-W{W}"


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", WINDOW_CASES, ids=window_id)
def test_window_matches_fp64_reference(case, dtype):
    B, Hq, Hkv, S, D, W = case
    check(*make(B, Hq, Hkv, S, S, D, dtype, seed=21), causal=True, window=W)


# A subset for the backward (the fp64 autograd reference is the slow part).
WINDOW_BACKWARD_CASES = [WINDOW_CASES[i] for i in (0, 1, 2, 3, 4, 6, 7, 8, 10, 11, 14, 15)]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("case", WINDOW_BACKWARD_CASES, ids=window_id)
def test_window_backward_matches_fp64_autograd(case, dtype):
    B, Hq, Hkv, S, D, W = case
    backward_check(*make(B, Hq, Hkv, S, S, D, dtype, seed=22), causal=True, window=W)


@pytest.mark.parametrize("S,W,D", [(1, 1, 64), (17, 17, 128), (17, 512, 256), (128, 128, 64), (128, 200, 128),
                                   (300, 512, 256), (1000, 1000, 64), (2049, 4096, 128)])
def test_window_covering_every_key_is_plain_causal_bitwise(S, W, D):
    """A window of S keys or more keeps every causal key: the same launch as plain causal, bit for bit (dq is summed
    by reduce-adds in varying order, so it only has to be close)."""
    q, k, v = make(1, 4, 2, S, S, D, torch.bfloat16, seed=23)
    o, lse = run(q, k, v, True, window=W)
    o_c, lse_c = run(q, k, v, True)
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c)
    g = torch.randn_like(o)
    dq, dk, dv = ops.attention_backward(q, k, v, o, lse, g, is_causal=True, window=W)
    dq_c, dk_c, dv_c = ops.attention_backward(q, k, v, o, lse, g, is_causal=True)
    assert torch.equal(dk, dk_c) and torch.equal(dv, dv_c)
    assert rel_err(dq, dq_c.double()) < 1e-2


@pytest.mark.parametrize("schedule", ["dynamic", "static"])
@pytest.mark.parametrize("max_blocks", [1, 3])
@pytest.mark.parametrize("B,Hq,Hkv,S,D,W", [
    (1, 3, 3, 2100, 64, 200),  # 192-row tiles: first key blocks from 0 up to 15, 2-4 blocks each
    (2, 2, 1, 1000, 128, 64),  # 128-row tiles, most rows' windows starting in the tile's second block
    (1, 2, 2, 700, 256, 129),  # 64-key blocks
])
def test_window_persistent_grid_walks_many_tiles_repeatably(B, Hq, Hkv, S, D, W, max_blocks, schedule):
    q, k, v = make(B, Hq, Hkv, S, S, D, torch.bfloat16, seed=24)
    o, lse = check(q, k, v, causal=True, window=W, _max_blocks=max_blocks, _schedule=schedule)
    o2, lse2 = run(q, k, v, True, window=W, _max_blocks=max_blocks, _schedule=schedule)
    assert torch.equal(o, o2) and torch.equal(lse, lse2), "results differ between identical runs"
    o_full_grid, _ = ops.attention_forward(q, k, v, is_causal=True, window=W)
    assert torch.equal(o, o_full_grid), "the result depends on the grid"


@pytest.mark.parametrize("D", [64, 128, 256])
@pytest.mark.parametrize("offset", [-5.0, 5.0])
@pytest.mark.parametrize("W", [7, 100])
def test_window_rows_without_keys_far_from_zero(W, offset, D):
    """Scores of about +-1000 (base 2) everywhere: a row whose keys have not begun by a block (its running max still
    -inf) must not take that block's exponents against 0, where they underflow (l = 0) or overflow."""
    q, k, v = make(1, 2, 1, 600, 600, D, torch.bfloat16, seed=25)
    q = (q * 0.1 + offset).to(torch.bfloat16)
    k = (k * 0.1 + 5.0).to(torch.bfloat16)
    o, lse = ops.attention_forward(q, k, v, is_causal=True, window=W)
    check_large_lse(q, k, v, causal=True, window=W)
    # The backward's masked keys score far from lse too (exp2 of them can be inf): their P must be exactly 0. dq and
    # dk are sums of dS times the common offset of k or q, whose rounding the offset magnifies: only finite here;
    # dv = P^T dO has no such cancellation.
    g = torch.randn_like(o)
    dq, dk, dv = ops.attention_backward(q, k, v, o, lse, g, is_causal=True, window=W)
    assert all(torch.isfinite(t).all() for t in (dq, dk, dv))
    ref_dv = ops.attention_backward_reference(q, k, v, o, lse, g, is_causal=True, window=W)[2]
    assert rel_err(dv, ref_dv) < GRAD_TOL[torch.bfloat16]


@pytest.mark.parametrize("parts", ["whole", "single heads"])
@pytest.mark.parametrize("case", [(2, 8, 2, 1000, 128, 200), (1, 8, 1, 700, 64, 64), (1, 4, 2, 500, 256, 129)],
                         ids=window_id)
def test_window_backward_grouped_heads(case, parts):
    B, Hq, Hkv, S, D, W = case
    split = {"whole": 1, "single heads": Hq // Hkv}[parts]
    backward_check(*make(B, Hq, Hkv, S, S, D, torch.bfloat16, seed=26), causal=True, window=W, group_split=split)


@pytest.mark.parametrize("layout,D,W", [("bshd", 128, 100), ("fused_qkv", 64, 7), ("wide_rows", 256, 129)])
def test_window_strided_views_match_contiguous(layout, D, W):
    """Forward bitwise as on contiguous copies; backward against fp64 and dk, dv bitwise repeatable."""
    q, k, v, bufs = strided_inputs(layout, 2, 8, 2, 333, D, torch.bfloat16)
    o, lse = check(q, k, v, causal=True, window=W)
    o_c, lse_c = ops.attention_forward(q.contiguous(), k.contiguous(), v.contiguous(), is_causal=True, window=W)
    assert torch.equal(o, o_c) and torch.equal(lse, lse_c), "a strided run differs from the contiguous one"
    (dq, dk, dv), g, (o, lse) = backward_check(q, k, v, causal=True, window=W)
    dq2, dk2, dv2 = ops.attention_backward(q, k, v, o, lse, g, is_causal=True, window=W)
    assert torch.equal(dk, dk2) and torch.equal(dv, dv2)
    assert rel_err(dq2, dq.double()) < 1e-2


@pytest.mark.parametrize("window,causal,match", [(0, True, "at least 1"), (-3, True, "at least 1"),
                                                 (8, False, "is_causal"), (2.5, True, "int"), (True, True, "int")])
def test_window_bad_arguments_raise_named_errors(window, causal, match):
    q, k, v = make(1, 2, 2, 32, 32, 64, torch.bfloat16)
    with pytest.raises(ValueError, match=match):
        ops.attention_forward(q, k, v, is_causal=causal, window=window)
    o, lse = ops.attention_forward(q, k, v, is_causal=True)
    with pytest.raises(ValueError, match=match):
        ops.attention_backward(q, k, v, o, lse, torch.randn_like(o), is_causal=causal, window=window)
