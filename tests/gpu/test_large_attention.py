"""The attention kernels on tensors past 2^31 elements: q, k, v, o, dq, dk, dv just over 2^31 bf16 elements (byte
offsets past 2^32) and the fp32 dQ accumulator over 2^31 floats (8 GiB), where any index or offset taken in 32 bits
would wrap. Short sequences and many heads keep the kernels fast; the reference is fp32 math over chunks of batches,
each chunk held to test_attention.py's tolerances, with every output element written (poisoned memory first).

Forward causal and not at D 64, 128 and 256 and with a query tail; the backward likewise, with both dQ passes (the
overlapped one without a causal mask) and the dQ accumulator zeroed by the delta pass; grouped heads with the
accumulator zeroed ahead by the kernel before (both poisoned first); LitGPT's (B, S, H, D)-laid views of one qkv
projection through the forward and the backward into its gradient (ops.attention_backward_qkv, rope). Each test
skips where the GPU has too little free memory, keeps its peak at about 44 GiB or less and frees what it took, even when
it fails (a failing test's traceback would otherwise hold its tensors for the tests after it).
"""

import traceback

import pytest
import torch

from accuracy import rel_err
from gpu_memory import GIB, free_cached as _free, require_free
from poisoning import poison_allocator
from test_attention import GRAD_TOL, LSE_TOL, O_TOL
from test_attention_qkv_grad import TOL as QKV_TOL
from thunder_tk import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not hasattr(ops, "attention_backward"), reason="ops.attention_backward does not exist yet"),
]

MARGIN = 4 * GIB  # the reference's chunks, lse, delta, counters and the allocator's rounding
CHUNK_ELEMENTS = 1 << 26  # elements of a reference chunk's largest fp32 tensor (256 MiB)
DTYPE = torch.bfloat16
BYTES = 2  # of DTYPE


def _batch_for(H, S, D):
    """The least batch whose (B, H, S, D) tensor passes 2^31 elements."""
    return (1 << 31) // (H * S * D) + 1


def _require_free(nbytes):
    require_free(nbytes, MARGIN)


def _run_and_free(case, *args):
    """Runs `case(*args)`, which returns its failures (strings), then frees the GPU memory before reporting them: an
    exception's frames are let go first (kept, its traceback would hold the case's tensors)."""
    failures, error = [], None
    try:
        failures = case(*args)
    except Exception:  # reported below, as text, once the frames are gone
        error = traceback.format_exc()
    _free()
    if error is not None:
        pytest.fail(error, pytrace=False)
    assert not failures, "\n".join(failures)


def _make(shape, seed, layout=None):
    """A bf16 tensor of torch.randn of `shape` (B, H, S, D), contiguous, or a (B, S, H, D)-laid view with "bshd"."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if layout == "bshd":
        B, H, S, D = shape
        return torch.randn(B, S, H, D, device="cuda", dtype=DTYPE, generator=g).transpose(1, 2)
    return torch.randn(shape, device="cuda", dtype=DTYPE, generator=g)


def _chunks(B, Hq, S, D):
    """Batch ranges whose reference fits CHUNK_ELEMENTS (scores are S x S a head, q S x D)."""
    step = max(1, CHUNK_ELEMENTS // (Hq * S * max(S, D)))
    return [(b, min(b + step, B)) for b in range(0, B, step)]


def _reference(q, k, v, causal, grad_o=None):
    """fp32 math on a chunk of batches: o and lse; with grad_o also dq, dk and dv (dk, dv summed over each key/value
    head's query heads)."""
    B, Hq, S, D = q.shape
    group, scale = Hq // k.shape[1], D ** -0.5
    q = q.float()
    k = k.float().repeat_interleave(group, 1)
    v = v.float().repeat_interleave(group, 1)
    s = q @ k.transpose(-1, -2) * scale
    if causal:
        s.masked_fill_(torch.ones(S, S, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    del s
    o = p @ v
    if grad_o is None:
        return o, lse
    g = grad_o.float()
    ds = p * (g @ v.transpose(-1, -2) - (g * o).sum(-1, keepdim=True))
    dq = ds @ k * scale

    def per_kv_head(t):
        return t.view(B, Hq // group, group, S, D).sum(2)

    dk = per_kv_head(ds.transpose(-1, -2) @ q * scale)
    dv = per_kv_head(p.transpose(-1, -2) @ g)
    return o, lse, dq, dk, dv


def _compare(label, got, want, tol, failures):
    """One chunk: every element written (finite) and ||got - want|| / ||want|| under tol."""
    if not torch.isfinite(got).all():
        failures.append(f"{label}: unwritten (NaN) or overflowed elements")
        return
    err = rel_err(got, want)
    if not err < tol:
        failures.append(f"{label}: rel err {err:.3e} (tolerance {tol})")


def _compare_lse(label, got, want, failures):
    if not torch.isfinite(got).all():
        failures.append(f"{label}: unwritten (NaN) lse")
        return
    err = (got.double() - want.double()).abs().max().item()
    if not err < LSE_TOL:
        failures.append(f"{label}: lse abs err {err:.3e} (tolerance {LSE_TOL})")


def _forward_failures(q, k, v, o, lse, causal):
    """o and lse against fp32 math, a chunk of batches at a time; stops at the first chunk that fails."""
    failures = []
    for b0, b1 in _chunks(*q.shape):
        want_o, want_lse = _reference(q[b0:b1], k[b0:b1], v[b0:b1], causal)
        _compare(f"o[{b0}:{b1}]", o[b0:b1], want_o, O_TOL[DTYPE], failures)
        _compare_lse(f"lse[{b0}:{b1}]", lse[b0:b1], want_lse, failures)
        if failures:
            break
    return failures


def _forward_case(B, Hq, Hkv, S, D, causal, layout):
    q = _make((B, Hq, S, D), 1, layout)
    k, v = _make((B, Hkv, S, D), 2, layout), _make((B, Hkv, S, D), 3, layout)
    poison_allocator(((B, Hq, S, D), DTYPE), ((B, Hq, S), torch.float32))
    o, lse = ops.attention_forward(q, k, v, is_causal=causal)
    return _forward_failures(q, k, v, o, lse, causal)


# (B, Hq, Hkv, S, D, causal, layout): B * Hq * S * D just over 2^31 (4 GiB a tensor)
FORWARD_CASES = [
    (_batch_for(32, 128, 128), 32, 32, 128, 128, False, None),
    (_batch_for(32, 128, 128), 32, 32, 128, 128, True, None),
    (_batch_for(32, 256, 64), 32, 32, 256, 64, False, None),  # D = 64: three warpgroups, 192-row tiles
    (_batch_for(32, 256, 64), 32, 32, 256, 64, True, None),  # causal: the first tile 64 rows above row 0
    (_batch_for(32, 64, 256), 32, 32, 64, 256, False, None),  # D = 256: O staged apart from Q
    (_batch_for(32, 64, 256), 32, 32, 64, 256, True, None),
    (_batch_for(32, 200, 128), 32, 32, 200, 128, True, None),  # a query and key tail (200 = 3 x 64 + 8)
    (_batch_for(32, 200, 128), 32, 32, 200, 128, False, None),
    (_batch_for(32, 128, 128), 32, 8, 128, 128, True, None),  # grouped: 4 query heads a key/value head
    (_batch_for(32, 128, 128), 32, 32, 128, 128, False, "bshd"),  # (B, S, H, D)-laid views, read in place
]


def case_id(c):
    B, Hq, Hkv, S, D, causal, layout = c
    return f"B{B}-H{Hq}kv{Hkv}-S{S}-D{D}" + ("-causal" if causal else "") + (f"-{layout}" if layout else "")


@pytest.mark.parametrize("case", FORWARD_CASES, ids=case_id)
def test_forward_past_2_31_elements(case):
    """o and lse of every head against fp32 math, where q, k, v and o hold just over 2^31 elements. Peak: q, k, v, o
    and the poisoning's second block of o's size (20 GiB without grouping)."""
    B, Hq, Hkv, S, D, causal, layout = case
    q_bytes, kv_bytes = B * Hq * S * D * BYTES, B * Hkv * S * D * BYTES
    _require_free(3 * q_bytes + 2 * kv_bytes)
    _run_and_free(_forward_case, B, Hq, Hkv, S, D, causal, layout)


def _backward_case(B, Hq, Hkv, S, D, causal, dq_zero, poison_turns):
    q = _make((B, Hq, S, D), 1)
    k, v = _make((B, Hkv, S, D), 2), _make((B, Hkv, S, D), 3)
    o, lse = ops.attention_forward(q, k, v, is_causal=causal)
    grad_o = torch.randn_like(o)  # o's (B, S, H, D) layout: the delta pass's flat rows
    floats = B * Hq * S * D
    turns = None
    if poison_turns:
        # The stream's two accumulators made now and filled with NaN: the delta pass must zero this call's, and the
        # kernel the other one (for the next call), over all of their 2^31-odd floats.
        _, _, turns = ops._dq_accumulator((B, Hq, S, D), q.device, "ahead")
        for buffer in turns.buffers:
            buffer.fill_(float("nan"))
    poison_allocator(((B, Hq, S, D), DTYPE), ((B, Hkv, S, D), DTYPE))
    dq, dk, dv = ops.attention_backward(q, k, v, o, lse, grad_o, is_causal=causal, _dq_zero=dq_zero)
    del o, lse
    failures = []
    if turns is not None:
        torch.cuda.synchronize()
        if turns.zeroed[turns.turn] != floats:
            failures.append(f"the kernel zeroed {turns.zeroed[turns.turn]} floats ahead, not {floats}")
        ahead = turns.buffers[turns.turn][:floats]
        nonzero = sum(int(torch.count_nonzero(part)) for part in ahead.split(CHUNK_ELEMENTS))
        if nonzero:
            failures.append(f"{nonzero} floats of the next dQ accumulator were not zeroed by the kernel")
        del ahead
    del turns
    ops.clear_dq_accumulators()  # the accumulators back before the reference
    for b0, b1 in _chunks(B, Hq, S, D):
        _, _, want_dq, want_dk, want_dv = _reference(q[b0:b1], k[b0:b1], v[b0:b1], causal, grad_o[b0:b1])
        for name, got, want in (("dq", dq, want_dq), ("dk", dk, want_dk), ("dv", dv, want_dv)):
            _compare(f"{name}[{b0}:{b1}]", got[b0:b1], want, GRAD_TOL[DTYPE], failures)
        if failures:
            break
    return failures


# (B, Hq, Hkv, S, D, causal): B * Hq * S * D just over 2^31; the dQ accumulator over 2^31 floats
BACKWARD_CASES = [
    (_batch_for(32, 128, 128), 32, 32, 128, 128, False),  # the overlapped dQ pass (counters per group of rows)
    (_batch_for(32, 128, 128), 32, 32, 128, 128, True),  # the plain dQ pass
    (_batch_for(32, 256, 64), 32, 32, 256, 64, True),
    (_batch_for(32, 64, 256), 32, 32, 64, 256, False),  # D = 256: 64-key blocks, dQ staged over Q and dO
    (_batch_for(32, 200, 128), 32, 32, 200, 128, True),  # query and key tails
]


@pytest.mark.parametrize("case", BACKWARD_CASES, ids=lambda c: case_id((*c, None)))
def test_backward_past_2_31_elements(case):
    """dq, dk and dv against fp32 math where every one of them, q, k, v, o and dO holds just over 2^31 elements and
    the fp32 dQ accumulator (zeroed by the delta pass, "pass") over 2^31 floats. Peak: 8 bf16 tensors, the
    accumulator and the poisoning's spare block (44 GiB)."""
    B, Hq, Hkv, S, D, causal = case
    q_bytes = B * Hq * S * D * BYTES
    _require_free(11 * q_bytes)
    _run_and_free(_backward_case, B, Hq, Hkv, S, D, causal, "pass", False)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_backward_grouped_heads_zeroed_ahead_past_2_31_elements(causal):
    """Grouped heads (4 query heads a key/value head, dK and dV summed in the kernel) with the dQ accumulators taking
    turns ("ahead"), both poisoned first: the delta pass zeroes this call's 2^31-odd floats, the kernel's writer warps
    the next call's (shares of a block at offsets past 2^31 floats), checked float by float. Peak: q, o, dO, dq,
    the accumulators (two of 8 GiB), k, v, dk, dv and the poisoning's spare block (40 GiB)."""
    B, Hq, Hkv, S, D = _batch_for(32, 128, 128), 32, 8, 128, 128
    q_bytes = B * Hq * S * D * BYTES
    _require_free(10 * q_bytes)
    _run_and_free(_backward_case, B, Hq, Hkv, S, D, causal, "ahead", True)


def _qkv_case(B, Hq, Hkv, S, D, causal):
    g = torch.Generator(device="cuda").manual_seed(5)
    qkv = torch.randn(B, S, (Hq + 2 * Hkv) * D, device="cuda", dtype=DTYPE, generator=g)
    q, k, v = ops.qkv_head_views(qkv, Hq, Hkv, D)
    poison_allocator(((B, Hq, S, D), DTYPE), ((B, Hq, S), torch.float32))
    o, lse = ops.attention_forward(q, k, v, is_causal=causal)
    grad_o = torch.randn(o.shape, device="cuda", dtype=DTYPE, generator=g)  # contiguous beside o's (B, S, H, D)
    cos, sin = ops.rope_tables(S, D, DTYPE, "cuda")
    failures = _forward_failures(q, k, v, o, lse, causal)
    if failures:
        return failures
    shape = (B, S, (Hq + 2 * Hkv) * D)
    poison_allocator((shape, DTYPE))
    qkv_grad = ops.attention_backward_qkv(q, k, v, o, lse, grad_o, cos, sin, is_causal=causal)
    del o, lse
    ops.clear_dq_accumulators()
    for b0, b1 in _chunks(B, Hq, S, D):
        _, _, dq, dk, dv = _reference(q[b0:b1], k[b0:b1], v[b0:b1], causal, grad_o[b0:b1])
        want = ops.qkv_grad_reference(dq, dk, dv, cos.float(), sin.float(), dtype=torch.float32)
        _compare(f"qkv_grad[{b0}:{b1}]", qkv_grad[b0:b1], want, QKV_TOL[DTYPE], failures)
        if failures:
            break
    return failures


def test_qkv_views_and_gradient_past_2_31_elements():
    """q, k, v as LitGPT splits them from one (B, S, (Hq + 2 Hkv) D) projection output ((B, S, H, D)-laid views, q just
    over 2^31 elements): the forward reads them in place, and attention_backward_qkv writes dk, dv and the rotated-back
    dq and dk into the projection's gradient (row offsets past 2^31 elements, the dQ accumulator over 2^31 floats).
    Peak: qkv, o, dO, the gradient, its poisoning's spare block and the accumulators (42 GiB)."""
    B, Hq, Hkv, S, D = _batch_for(32, 128, 128), 32, 8, 128, 128
    q_bytes = B * Hq * S * D * BYTES
    _require_free(int(10.5 * q_bytes))
    _run_and_free(_qkv_case, B, Hq, Hkv, S, D, True)
