"""Attention masks made from constants in the trace (thunder_tk.attention_masks): read as all-keep, causal or a causal
window, run on tk's kernels without the mask (CPU, with tk's kernels standing in: `standins.StandinBuild`), or handed
to the attention executor that takes the symbol as is_causal; every other mask declined with why."""

import math

import pytest
import torch
import torch.nn.functional as F
import thunder

import thunder_tk
from thunder_tk import attention_masks, tk
from thunder_tk.attention_masks import MaskPattern, classify

from test_attention_routing import SDPA, assert_close_bf16, attention_row, qkv

S = 16
bf16 = torch.bfloat16


def window_keep(q_len, kv_len, window=None):
    """True where query i keeps key j: causal, within `window` keys when given."""
    i, j = torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]
    return (j <= i) & ((j > i - window) if window else True)


# -- reading values ------------------------------------------------------------------------------


def additive(keep, dtype=torch.float32, dropped=-math.inf):
    return torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, dropped)


@pytest.mark.parametrize("values, want", [
    (torch.ones(S, S, dtype=torch.bool), MaskPattern(causal=False)),
    (torch.zeros(1, 1, S, S, dtype=bf16), MaskPattern(causal=False)),
    (torch.ones(S, dtype=torch.bool), MaskPattern(causal=False)),  # a row broadcast over the queries
    (window_keep(S, S), MaskPattern(causal=True)),
    (additive(window_keep(S, S)), MaskPattern(causal=True)),
    (additive(window_keep(S, S), bf16, torch.finfo(bf16).min), MaskPattern(causal=True)),  # LitGPT's newer masks
    (additive(window_keep(S, S), torch.float16, -math.inf).expand(2, 3, S, S), MaskPattern(causal=True)),
    (window_keep(S, S, 4), MaskPattern(causal=True, window=4)),
    (window_keep(S, S, 1), MaskPattern(causal=True, window=1)),
    (window_keep(S, S, S), MaskPattern(causal=True)),  # a window as long as the sequence is causal
    (additive(window_keep(S, S, 5)), MaskPattern(causal=True, window=5)),
], ids=["bool-ones", "zeros", "row", "bool-causal", "inf-causal", "finfo-min", "broadcast-heads", "window4", "window1",
        "window-S", "inf-window5"])
def test_mask_values_read_as_a_pattern(values, want):
    assert classify(values, S, S) == want


@pytest.mark.parametrize("values, q_len, kv_len, reason", [
    (torch.randn(S, S), S, S, "a bias, not a mask"),
    (window_keep(S, S).t().contiguous(), S, S, "neither every key nor a causal window"),
    (window_keep(S, S) & (torch.arange(S) % 2 == 0), S, S, "neither every key nor a causal window"),
    (window_keep(S, 2 * S), S, 2 * S, "causal patterns need q_len == kv_len"),
    (torch.stack([window_keep(S, S), torch.ones(S, S, dtype=torch.bool)]).unsqueeze(1), S, S, "differs between"),
    (torch.ones(3, 5, dtype=torch.bool), S, S, "does not broadcast"),
    (torch.ones(S, S, dtype=torch.int32), S, S, "dtype torch.int32"),
    (torch.ones(1, 1, 1, S, S, dtype=torch.bool), S, S, "5-D"),
], ids=["bias", "anti-causal", "strided", "rectangular", "per-batch", "shape", "int", "5-D"])
def test_other_masks_are_named(values, q_len, kv_len, reason):
    found = classify(values, q_len, kv_len)
    assert isinstance(found, str) and reason in found, found


# -- masks made in the trace ---------------------------------------------------------------------


def litgpt_window(q, window):
    """LitGPT 0.5's sliding-window mask: -inf everywhere, zeros written row by row over each window."""
    T = q.shape[2]
    mask = torch.full((T, T), float("-inf"), dtype=q.dtype, device=q.device)
    for i in range(T):
        mask[i, max(0, i - window + 1): i + 1] = 0.0
    return mask.view(1, 1, T, T)


def litgpt_bias_window(q, window):
    """LitGPT's earlier form: a causal mask plus a bias of -inf below the window."""
    T = q.shape[2]
    mask = torch.ones(T, T, dtype=q.dtype, device=q.device).triu(diagonal=1)
    mask.masked_fill_(mask.bool(), float("-inf"))
    bias = torch.ones_like(mask).tril(diagonal=-window)
    bias.masked_fill_(bias.bool(), float("-inf"))
    mask += bias
    return mask


MASKS = {
    "bool-tril": (lambda q: torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).tril(), "causal"),
    "arange": (lambda q: torch.arange(q.shape[2])[:, None] >= torch.arange(q.shape[2])[None, :], "causal"),
    "finfo-min": (lambda q: torch.zeros(q.shape[2], q.shape[2], dtype=q.dtype).masked_fill(
        torch.ones(q.shape[2], q.shape[2], dtype=torch.bool).triu(1), torch.finfo(q.dtype).min), "causal"),
    "litgpt-window-loop": (lambda q: litgpt_window(q, 64), "causal"),  # Phi-4-mini's window, longer than S
    "litgpt-bias-window": (lambda q: litgpt_bias_window(q, S), "causal"),
    "litgpt-window-5": (lambda q: litgpt_window(q, 5), "causal within a window of 5 keys"),  # Mistral at T > 4096
    "litgpt-bias-window-3": (lambda q: litgpt_bias_window(q, 3), "causal within a window of 3 keys"),
    "zeros": (lambda q: torch.zeros(1, q.shape[1], q.shape[2], q.shape[2], dtype=q.dtype), "keeps every key"),
}


def _sdpa_with(make_mask):
    def fn(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=make_mask(q))
    return fn


def _square_tensors_made(trace) -> list[str]:
    """Ops of the trace whose result is S x S (a mask, or scores): none where tk reads the mask as a pattern."""
    return [b.sym.name for b in trace.bound_symbols for p in b.flat_proxy_outs
            if isinstance(p, thunder.core.proxies.TensorProxy) and tuple(p.shape[-2:]) == (S, S)]


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
@pytest.mark.parametrize("name", list(MASKS))
def test_a_constant_mask_runs_on_tk_as_its_pattern(standin_tk_build, standin_attention, name, training):
    make_mask, read = MASKS[name]
    q, k, v = qkv(Hkv=1, requires_grad=training)  # Thunder 0.2.6 traces Hkv == Hq or 1 only
    fn = _sdpa_with(make_mask)
    jf = thunder.jit(fn, executors=[tk])
    out = jf(q, k, v)
    mask = make_mask(q.detach())
    ref = [t.detach().double().requires_grad_(training) for t in (q, k, v)]
    want = F.scaled_dot_product_attention(ref[0], ref[1].expand_as(ref[0]), ref[2].expand_as(ref[0]),
                                          attn_mask=mask if mask.dtype == torch.bool else mask.double())
    assert_close_bf16(out, want)
    if training:
        grad_o = torch.randn_like(out)
        out.backward(grad_o)
        want.backward(grad_o.double())
        for t, r in zip((q, k, v), ref):
            assert_close_bf16(t.grad, r.grad)
    row = attention_row(jf)
    assert row.claimed_by_tk and not row.reason, row.reason
    assert read in row.detail, row.detail
    assert row.ran_by.startswith("tk: tk_attention")
    # The mask's ops went with the mask: nothing S x S is made in the forward (nor the backward).
    traces = [thunder.last_traces(jf)[-1]] + ([thunder.last_backward_traces(jf)[-1]] if training else [])
    for trace in traces:
        assert _square_tensors_made(trace) == []


def test_every_layers_mask_is_evaluated_once(standin_tk_build, standin_attention, monkeypatch):
    """Identical ops (each layer building the same mask) are run once, not once a layer."""
    runs = []
    evaluate = attention_masks._evaluate
    monkeypatch.setattr(attention_masks, "_evaluate", lambda *a: runs.append(1) or evaluate(*a))
    monkeypatch.setattr(attention_masks, "_evaluated", {})

    def fn(q, k, v):
        for _ in range(3):
            q = F.scaled_dot_product_attention(q, k, v, attn_mask=litgpt_window(q, S + 3))
        return q

    q, k, v = qkv(requires_grad=True)
    jf = thunder.jit(fn, executors=[tk])
    jf(q, k, v).sum().backward()
    rows = [r for r in thunder_tk.explain(jf).rows if r.symbol == SDPA]
    assert len(rows) == 3 and all(r.claimed_by_tk for r in rows)
    # Once per distinct program: Thunder may list a multi-alias update's tensors in another order for another layer.
    assert len(runs) < 3, len(runs)


def test_a_window_mask_goes_to_the_fallback_as_a_mask_where_tk_declines(standin_tk_build, standin_attention):
    """Head dim 96 with a window shorter than the sequence: only a mask says that, so it stays (the stand-in takes no
    masks: Thunder's decomposition runs it)."""
    q, k, v = qkv(D=96)
    jf = thunder.jit(_sdpa_with(lambda q: litgpt_window(q, 4)), executors=[tk])
    out = jf(q, k, v)
    assert_close_bf16(out, F.scaled_dot_product_attention(*(t.float() for t in (q, k, v)),
                                                         attn_mask=window_keep(S, S, 4)))
    row = attention_row(jf)
    assert not row.claimed_by_tk and "head_dim 96" in row.reason and "runs it with" not in row.reason, row.reason


@pytest.mark.parametrize("training", [False, True], ids=["inference", "training"])
def test_a_recognised_mask_goes_to_the_fallback_as_is_causal(standin_tk_build, standin_attention, training):
    """Head dim 96: tk declines, and the attention executor that takes the symbol gets is_causal instead of the mask
    (the stand-in takes no masks at all: without this the attention would be decomposed)."""
    q, k, v = qkv(D=96, requires_grad=training)
    fn = _sdpa_with(lambda q: litgpt_window(q, 100))
    jf = thunder.jit(fn, executors=[tk])
    out = jf(q, k, v)
    want, _ = _float_causal(q, k, v)
    assert_close_bf16(out, want)
    if training:
        grad_o = torch.randn_like(out)
        out.backward(grad_o)
        _, want_grads = _float_causal(q, k, v, grad_o)
        for t, w in zip((q, k, v), want_grads):
            assert_close_bf16(t.grad, w)
    row = attention_row(jf)
    assert not row.claimed_by_tk
    assert "head_dim 96" in row.reason and "standin_sdpa runs it with attn_mask read as causal" in row.reason
    assert row.ran_by.startswith("standin_sdpa"), row.ran_by


def _float_causal(q, k, v, grad_o=None):
    ref = [t.detach().float().requires_grad_(grad_o is not None) for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True)
    if grad_o is None:
        return out, None
    out.backward(grad_o.float())
    return out, [t.grad for t in ref]


def test_a_mask_held_by_the_module_is_an_input(standin_tk_build, standin_attention):
    """LitGPT's KV-cache generation reads its mask from a buffer: its values are the caller's, not the trace's."""

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", window_keep(S, S), persistent=False)

        def forward(self, q, k, v):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.mask)

    q, k, v = qkv()
    jm = thunder.jit(Attention(), executors=[tk])
    assert_close_bf16(jm(q, k, v), _float_causal(q, k, v)[0])
    row = attention_row(jm)
    assert not row.claimed_by_tk and "an input of the traced function" in row.reason, row.reason


@pytest.mark.parametrize("make_mask, reason", [
    (lambda q: torch.randn(q.shape[2], q.shape[2]) > 0, "which tk does not evaluate"),
    (lambda q: q[0, 0, :, :1] @ q[0, 0, :, :1].t() > -1e30, "an input of the traced function"),
], ids=["random", "from-q"])
def test_masks_tk_cannot_evaluate_are_declined_with_why(standin_tk_build, standin_attention, make_mask, reason):
    q, k, v = qkv()
    jf = thunder.jit(_sdpa_with(make_mask), executors=[tk])
    jf(q, k, v)
    row = attention_row(jf)
    assert not row.claimed_by_tk and reason in row.reason, row.reason


def test_a_mask_above_the_size_limit_is_not_evaluated(standin_tk_build, standin_attention, monkeypatch):
    monkeypatch.setattr(attention_masks, "MAX_MASK_ELEMENTS", S * S - 1)
    monkeypatch.setattr(attention_masks, "_evaluated", {})
    q, k, v = qkv()
    jf = thunder.jit(_sdpa_with(MASKS["bool-tril"][0]), executors=[tk])
    jf(q, k, v)
    row = attention_row(jf)
    assert not row.claimed_by_tk and f"more than tk inspects ({S * S - 1})" in row.reason, row.reason


def test_a_mask_made_by_many_ops_says_how_to_make_it_in_a_few(standin_tk_build, standin_attention):
    """LitGPT's per-position loop at 80 positions: tk reads the window, and explain names the cheaper way to build
    it (thunder.jit spends minutes tracing that loop at 2048). The same mask from litgpt_models.sliding_window_mask
    gets no such word."""
    from thunder_tk.litgpt_models import sliding_window_mask

    q, k, v = qkv(B=1, Hkv=1, Sq=80, Sk=80)
    details = []
    for make_mask in (lambda q: litgpt_window(q, 8), lambda q: sliding_window_mask(q.shape[2], 8, q.dtype, q.device)):
        jf = thunder.jit(_sdpa_with(make_mask), executors=[tk])
        jf(q, k, v)
        row = attention_row(jf)
        assert row.claimed_by_tk, row.reason
        details.append(row.detail)
    loop, vectorized = details
    assert "causal within a window of 8 keys, from " in loop and "vectorize_window_masks(model)" in loop, loop
    assert "causal within a window of 8 keys" in vectorized and "traced ops" not in vectorized, vectorized
