"""Thunder operators for tk's kernels, and how each claimed symbol lowers to them.

Kernel operators are registered with `meta=` (no subsymbols), so no fuser can pull them into a region.
"""

from __future__ import annotations

from dataclasses import dataclass

import thunder
import thunder.torch as ltorch
import torch
from thunder.core import prims
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy, pyval
from thunder.core.transforms import get_grad, put_grad, put_grads
from thunder.distributed import prims as dist_prims

from thunder_tk import attention_masks, collectives, functional, ops
from thunder_tk.executor import tk


# ------------------------------------------------------------------------------------------------
# attention_bwd_delta


def _attention_bwd_delta_meta(o: TensorProxy, grad_o: TensorProxy) -> TensorProxy:
    return TensorProxy(like=o, shape=tuple(o.shape[:3]), dtype=thunder.float32)


tk_attention_bwd_delta = tk.register_operator(
    "tk_attention_bwd_delta", meta=_attention_bwd_delta_meta, fn=ops.attention_bwd_delta
)


def _attention_bwd_delta_lowering(o, grad_o):
    return tk_attention_bwd_delta(o, grad_o)


def _attention_bwd_delta_grad(o, grad_o):
    delta = tk_attention_bwd_delta(o, grad_o)
    g = ltorch.unsqueeze(get_grad(delta), -1)
    grad_of_o = ltorch.to(ltorch.mul(g, ltorch.to(grad_o, thunder.float32)), o.dtype)
    grad_of_grad_o = ltorch.to(ltorch.mul(g, ltorch.to(o, thunder.float32)), grad_o.dtype)
    put_grads((o, grad_o), (grad_of_o, grad_of_grad_o))
    return delta


tk.set_lowering(
    functional.attention_bwd_delta_symbol.id,
    execution_transform=_attention_bwd_delta_lowering,
    grad_transform=_attention_bwd_delta_grad,
)
tk._lookasides[functional.attention_bwd_delta] = functional.attention_bwd_delta_symbol


# ------------------------------------------------------------------------------------------------
# Attention: ltorch.scaled_dot_product_attention (the claim rule has already declined dropout, masks other than
# constant all-keep, causal or causal-window ones (attention_masks) and what the kernels cannot compute, so only q, k,
# v, is_causal, scale and the window reach the operators).
# - inference: tk_attention, the forward kernel returning o alone;
# - training: tk_attention_forward returns (o, lse), and tk_attention_backward turns the saved (q, k, v, o, lse)
#   and dO into (dq, dk, dv), dk and dv with the key/value heads. The executor uses this grad transform only
#   while the build has the backward kernel (the rule's grad_kernel); until then the attention executor that
#   takes the gradient takes the forward too.
# The kernel entry points are looked up when called, so that tests can stand in for them.


# `window`: keys a causal query sees, itself included (ops.attention_forward's; None: all up to itself).
def _attention_out_meta(q: TensorProxy, k: TensorProxy, v: TensorProxy, is_causal: bool, scale,
                        window: int | None = None) -> TensorProxy:
    return TensorProxy(like=q, shape=(*q.shape[:-1], v.shape[-1]))


def _attention_forward_meta(q: TensorProxy, k: TensorProxy, v: TensorProxy, is_causal: bool, scale,
                            window: int | None = None):
    lse = TensorProxy(like=q, shape=tuple(q.shape[:3]), dtype=thunder.float32, requires_grad=False)
    return _attention_out_meta(q, k, v, is_causal, scale), lse


def _attention_backward_meta(q, k, v, o, lse, grad_o, is_causal: bool, scale, window: int | None = None):
    return TensorProxy(like=q), TensorProxy(like=k), TensorProxy(like=v)


def _attention_impl(q, k, v, is_causal, scale, window=None):
    o, _ = ops.attention_forward(q, k, v, is_causal=is_causal, scale=scale, window=window)
    return o


def _attention_forward_impl(q, k, v, is_causal, scale, window=None):
    return ops.attention_forward(q, k, v, is_causal=is_causal, scale=scale, window=window)


def _attention_backward_impl(q, k, v, o, lse, grad_o, is_causal, scale, window=None):
    return ops.attention_backward(q, k, v, o, lse, grad_o, is_causal=is_causal, scale=scale, window=window)


tk_attention = tk.register_operator("tk_attention", meta=_attention_out_meta, fn=_attention_impl)
tk_attention_forward = tk.register_operator(
    "tk_attention_forward", meta=_attention_forward_meta, fn=_attention_forward_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),
)
tk_attention_backward = tk.register_operator(
    "tk_attention_backward", meta=_attention_backward_meta, fn=_attention_backward_impl
)


# The attention backward written straight into the gradient of the fused qkv projection that q, k and v were split
# from, with the rotary embedding's backward in its last pass (pattern_fusion.attention_backward_into_qkv).
def _attention_backward_qkv_meta(q, k, v, o, lse, grad_o, cos, sin, is_causal: bool, scale,
                                 window: int | None = None):
    B, Hq, S, D = q.shape
    return TensorProxy(like=q, shape=(B, S, (Hq + 2 * k.shape[1]) * D))


def _attention_backward_qkv_impl(q, k, v, o, lse, grad_o, cos, sin, is_causal, scale, window=None):
    return ops.attention_backward_qkv(q, k, v, o, lse, grad_o, cos, sin, is_causal=is_causal, scale=scale,
                                      window=window)


tk_attention_backward_qkv = tk.register_operator(
    "tk_attention_backward_qkv", meta=_attention_backward_qkv_meta, fn=_attention_backward_qkv_impl
)


@dataclass(frozen=True)
class MaskRead:
    """A tag on a tk attention op's output whose traced symbol had an attn_mask: how tk computes that mask."""

    description: str


def _sdpa_flags(query, key, attn_mask, is_causal, scale
                ) -> tuple[bool, float | None, int | None, MaskRead | None]:
    """(causal, scale, window, how a mask was read). The claim rule took the mask only as a pattern of
    attention_masks."""
    scale = None if scale is None else float(pyval(scale))
    if attn_mask is None:
        return bool(pyval(is_causal)), scale, None, None
    q_len, kv_len = query.shape[2], key.shape[2]
    pattern = attention_masks.pattern_of(attn_mask, q_len, kv_len)
    if isinstance(pattern, str):
        raise AssertionError(f"tk was asked to run an attention mask it declined: {pattern}")
    return pattern.causal, scale, pattern.window, MaskRead(pattern.describe())


def _sdpa_lowering(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    is_causal, scale, window, read = _sdpa_flags(query, key, attn_mask, is_causal, scale)
    o = tk_attention(query, key, value, is_causal, scale, window)
    if read is not None:
        o.tags.add(read)
    return o


def _sdpa_grad(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
    is_causal, scale, window, read = _sdpa_flags(query, key, attn_mask, is_causal, scale)
    o, lse = tk_attention_forward(query, key, value, is_causal, scale, window)
    if read is not None:
        o.tags.add(read)
    grads = tk_attention_backward(query, key, value, o, lse, get_grad(o), is_causal, scale, window)
    put_grads((query, key, value), grads)
    return o


tk.set_lowering(ltorch.scaled_dot_product_attention.id, execution_transform=_sdpa_lowering,
                grad_transform=_sdpa_grad)


# ------------------------------------------------------------------------------------------------
# GEMMs: linear (inference: ltorch.linear; training forward: prims.linear) and 2-D matmul (the backward
# GEMMs dX = dY W and dW = dY^T X that Thunder's linear gradient emits). No grad transform: Thunder's own
# gradient of linear produces those matmuls, which tk then claims in turn.


def _linear_meta(a: TensorProxy, w: TensorProxy, bias: TensorProxy | None) -> TensorProxy:
    return TensorProxy(like=a, shape=(*a.shape[:-1], w.shape[0]))


def _matmul_meta(a: TensorProxy, b: TensorProxy) -> TensorProxy:
    return TensorProxy(like=a, shape=(a.shape[0], b.shape[1]))


_GEMM_TAGS = (OpTags.MATMUL_OP, OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD)


# Looked up at call time (not bound at registration), so a replaced ops.gemm / ops.linear is the one that runs.
def _linear_impl(a, w, bias):
    return ops.linear(a, w, bias)


def _matmul_impl(a, b):
    return ops.gemm(a, b)


tk_linear = tk.register_operator("tk_linear", meta=_linear_meta, fn=_linear_impl, tags=_GEMM_TAGS)
tk_matmul = tk.register_operator("tk_matmul", meta=_matmul_meta, fn=_matmul_impl, tags=_GEMM_TAGS)


# Two products of one shape summed in one launch (a @ b + a2 @ b2, one fp32 accumulator); only
# pattern_fusion.sum_products puts it in a trace (for two tk_matmul whose results meet only in an add).
def _matmul_sum_meta(a: TensorProxy, b: TensorProxy, a2: TensorProxy, b2: TensorProxy) -> TensorProxy:
    return _matmul_meta(a, b)


def _matmul_sum_impl(a, b, a2, b2):
    return ops.gemm_sum(a, b, a2, b2)


tk_matmul_sum = tk.register_operator("tk_matmul_sum", meta=_matmul_sum_meta,
                                     fn=_matmul_sum_impl, tags=_GEMM_TAGS)


# The same products written in fp32 from the accumulators (bf16 operands); only pattern_fusion.widen_products puts
# them in a trace, for a bf16 product whose one reader casts it to fp32 (bf16-mixed training's weight gradients) or
# two whose fp32 casts meet in an add (the MLP input gradient under autocast).
def _matmul_fp32_meta(a: TensorProxy, b: TensorProxy) -> TensorProxy:
    return TensorProxy(like=a, shape=(a.shape[0], b.shape[1]), dtype=thunder.float32)


def _matmul_fp32_impl(a, b):
    return ops.gemm(a, b, out_dtype=torch.float32)


def _matmul_sum_fp32_meta(a: TensorProxy, b: TensorProxy, a2: TensorProxy, b2: TensorProxy) -> TensorProxy:
    return _matmul_fp32_meta(a, b)


def _matmul_sum_fp32_impl(a, b, a2, b2):
    return ops.gemm_sum(a, b, a2, b2, out_dtype=torch.float32)


tk_matmul_fp32 = tk.register_operator("tk_matmul_fp32", meta=_matmul_fp32_meta, fn=_matmul_fp32_impl,
                                      tags=_GEMM_TAGS)
tk_matmul_sum_fp32 = tk.register_operator("tk_matmul_sum_fp32", meta=_matmul_sum_fp32_meta,
                                          fn=_matmul_sum_fp32_impl, tags=_GEMM_TAGS)


# SwiGLU's two products and silu(h1) * h2 in one launch; only pattern_fusion.fuse_swiglu puts it in a trace (for two
# tk_linear of one input whose outputs meet in silu(h1) * h2), so it has no lowering of its own.
def _swiglu_linear_meta(x: TensorProxy, w1: TensorProxy, w2: TensorProxy):
    shape = (*x.shape[:-1], w1.shape[0])
    return tuple(TensorProxy(like=x, shape=shape) for _ in range(3))


def _swiglu_linear_impl(x, w1, w2):
    return ops.swiglu_linear(x, w1, w2)


tk_swiglu_linear = tk.register_operator("tk_swiglu_linear", meta=_swiglu_linear_meta, fn=_swiglu_linear_impl,
                                        tags=_GEMM_TAGS)

# SwiGLU's backward through its output projection in one launch: dh1 and dh2 from the incoming gradient's rows a, the
# projection's weight b (dg = a @ b is never written) and the forward's h1 and h2; only
# pattern_fusion.fuse_swiglu_grad puts it in a trace.
def _matmul_swiglu_grad_meta(a: TensorProxy, b: TensorProxy, h1: TensorProxy, h2: TensorProxy):
    return TensorProxy(like=h1), TensorProxy(like=h2)


def _matmul_swiglu_grad_impl(a, b, h1, h2):
    return ops.matmul_swiglu_grad(a, b, h1, h2)


tk_matmul_swiglu_grad = tk.register_operator("tk_matmul_swiglu_grad", meta=_matmul_swiglu_grad_meta,
                                             fn=_matmul_swiglu_grad_impl, tags=_GEMM_TAGS)

# q, k and v from the fused qkv projection with the rotary embedding in its epilogue, as views of its one output;
# only pattern_fusion.rope_into_qkv_projection puts it in a trace (for a tk_linear whose output LitGPT splits into
# heads and ropes before tk's attention).
def _linear_rope_meta(x: TensorProxy, w: TensorProxy, cos: TensorProxy, sin: TensorProxy, q_heads: int,
                      kv_heads: int, head_dim: int):
    B, S = x.shape[0], x.shape[1]
    return tuple(TensorProxy(like=x, shape=(B, h, S, head_dim)) for h in (q_heads, kv_heads, kv_heads))


def _linear_rope_impl(x, w, cos, sin, q_heads, kv_heads, head_dim):
    return ops.linear_rope(x, w, cos, sin, q_heads, kv_heads, head_dim)


tk_linear_rope = tk.register_operator("tk_linear_rope", meta=_linear_rope_meta, fn=_linear_rope_impl,
                                      tags=_GEMM_TAGS)

# The claimed symbols take the operators' arguments, so the operators are the execution transforms.
for _symbol_id in (ltorch.linear.id, prims.PrimIDs.LINEAR):
    tk.set_lowering(_symbol_id, execution_transform=tk_linear, grad_transform=None)
for _symbol_id in (ltorch.matmul.id, prims.PrimIDs.MATMUL):
    tk.set_lowering(_symbol_id, execution_transform=tk_matmul, grad_transform=None)


# ------------------------------------------------------------------------------------------------
# Cross-entropy: ltorch.cross_entropy (the claim rule has declined weights, label smoothing and anything but 2-D
# logits with int64 class indices).
# - inference: tk_cross_entropy_forward's per-row losses, reduced as PyTorch does;
# - training: the same forward also returns each row's log-sum-exp, and tk_cross_entropy_backward turns the saved
#   (logits, target, lse) and the per-row incoming gradient into the logits' gradient in their dtype.


def _cross_entropy_forward_meta(a: TensorProxy, target: TensorProxy, ignore_index: int):
    rows = TensorProxy(like=a, shape=(a.shape[0],), dtype=thunder.float32)
    lse = TensorProxy(like=a, shape=(a.shape[0],), dtype=thunder.float32, requires_grad=False)
    return rows, lse


def _cross_entropy_backward_meta(a, target, lse, grad_rows, ignore_index: int):
    return TensorProxy(like=a)


def _cross_entropy_forward_impl(a, target, ignore_index):
    return ops.cross_entropy_forward(a, target, ignore_index)


def _cross_entropy_backward_impl(a, target, lse, grad_rows, ignore_index):
    return ops.cross_entropy_backward(a, target, lse, grad_rows, ignore_index)


tk_cross_entropy_forward = tk.register_operator(
    "tk_cross_entropy_forward", meta=_cross_entropy_forward_meta, fn=_cross_entropy_forward_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),
)
tk_cross_entropy_backward = tk.register_operator(
    "tk_cross_entropy_backward", meta=_cross_entropy_backward_meta, fn=_cross_entropy_backward_impl
)


# Wide rows in training (FORWARD_GRAD_MIN_CLASSES classes or more, 16-bit logits): the forward also writes
# D = softmax - onehot from its one read of the logits (tk_cross_entropy_forward_grad), D is saved instead of the
# logits, and the backward only scales D's rows by the incoming gradient (tk_scale_rows), which
# `pattern_fusion.fold_row_scaling` moves onto the rows of the GEMMs that read it (dX = g (D W), dW = D^T (g X)).
# From 32000 classes (Llama-2's and TinyLlama's vocabulary) the kernel, each row split over a cluster, beats the
# forward + backward kernels (H200, 8192 x 32000: 0.340 against 0.465 ms; benchmarks/NOTES.md); narrower rows keep
# those two, as rows of 32000 did while one block held each row (0.56 ms).
FORWARD_GRAD_KERNEL = "cross_entropy_forward_grad"
FORWARD_GRAD_MIN_CLASSES = 32000
FORWARD_GRAD_OPTION = "tk_cross_entropy_forward_grad"
"""Compile option: False keeps the forward + backward kernels at any width (`thunder.jit(..., <option>=False)`)."""


def _cross_entropy_forward_grad_meta(a: TensorProxy, target: TensorProxy, ignore_index: int):
    rows, lse = _cross_entropy_forward_meta(a, target, ignore_index)
    return rows, lse, TensorProxy(like=a, requires_grad=False)


def _cross_entropy_forward_grad_impl(a, target, ignore_index):
    return ops.cross_entropy_forward_grad(a, target, ignore_index)


tk_cross_entropy_forward_grad = tk.register_operator(
    "tk_cross_entropy_forward_grad", meta=_cross_entropy_forward_grad_meta, fn=_cross_entropy_forward_grad_impl,
    tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),
)


def _cross_entropy_forward_grad_over_logits_impl(a, target, ignore_index):
    return ops.cross_entropy_forward_grad(a, target, ignore_index, overwrite=True)


# The same with D written over the logits; only `pattern_fusion.write_gradient_over_logits` puts it in a trace, where
# the logits are a GEMM's fresh output read by nothing else.
tk_cross_entropy_forward_grad_over_logits = tk.register_operator(
    "tk_cross_entropy_forward_grad_over_logits", meta=_cross_entropy_forward_grad_meta,
    fn=_cross_entropy_forward_grad_over_logits_impl, tags=(OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,),
)


def _scale_rows_meta(t: TensorProxy, g: TensorProxy) -> TensorProxy:
    return TensorProxy(like=t)


def _scale_rows_impl(t, g):
    return ops.scale_rows(t, g)


tk_scale_rows = tk.register_operator("tk_scale_rows", meta=_scale_rows_meta, fn=_scale_rows_impl)


def forward_grad_declined(a, *, option=None, disabled=frozenset(), built: bool = True) -> str | None:
    """Why the cross-entropy of logits `a` (metadata) takes the backward kernel in training rather than the gradient
    from its forward's read; None when it takes the forward's. `option`: the compile option's value, `disabled`:
    THUNDER_TK_DISABLE's names, `built`: whether the kernel is in the build."""
    classes = a.shape[1]
    if classes < FORWARD_GRAD_MIN_CLASSES:
        return f"{classes} classes, fewer than {FORWARD_GRAD_MIN_CLASSES}"
    # Rows of whole 16-byte vectors (the kernel's condition, where the logits are a GEMM's contiguous output): an
    # odd vocabulary (GPT-2's 50257) would take the two kernels inside the op and then a scaling pass.
    if classes % 8:
        return f"{classes} classes, not a multiple of 8 (rows off 16-byte boundaries)"
    if a.dtype not in (thunder.bfloat16, thunder.float16):
        return f"{a.dtype} logits (16-bit only)"
    if option is False:
        return f"turned off ({FORWARD_GRAD_OPTION}=False)"
    if FORWARD_GRAD_KERNEL in disabled:
        return f"turned off (THUNDER_TK_DISABLE={FORWARD_GRAD_KERNEL})"
    if not built:
        return f"{FORWARD_GRAD_KERNEL} not in this build"
    return None


def _forward_grad_wanted(a) -> bool:
    from thunder.core.compile_data import get_compile_option

    from thunder_tk import _extension, claim_rules

    option = get_compile_option(FORWARD_GRAD_OPTION, "the cross-entropy's gradient from its forward's read")
    return forward_grad_declined(a, option=option, disabled=claim_rules.disabled_names(),
                                 built=_extension.kernel_in_build(FORWARD_GRAD_KERNEL)) is None


def _valid_rows(target, ignore_index: int):
    return ltorch.sum(ltorch.to(ltorch.ne(target, ignore_index), thunder.float32))


def _reduce_rows(a, rows, valid_rows, reduction: str):
    """PyTorch's reduction of the per-row losses; `valid_rows` (the rows not ignored) is used by "mean" only."""
    if reduction == "none":
        return ltorch.to(rows, a.dtype)
    total = ltorch.sum(rows)
    if reduction == "sum":
        return ltorch.to(total, a.dtype)
    return ltorch.to(ltorch.true_divide(total, valid_rows), a.dtype)


def _cross_entropy_lowering(a, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                            reduction="mean", label_smoothing=0.0):
    ignore_index, reduction = int(pyval(ignore_index)), pyval(reduction)
    rows, _ = tk_cross_entropy_forward(a, target, ignore_index)
    valid_rows = _valid_rows(target, ignore_index) if reduction == "mean" else None
    return _reduce_rows(a, rows, valid_rows, reduction)


def _cross_entropy_grad(a, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                        reduction="mean", label_smoothing=0.0):
    ignore_index, reduction = int(pyval(ignore_index)), pyval(reduction)
    forward_grad = _forward_grad_wanted(a)
    if forward_grad:
        rows, _, d = tk_cross_entropy_forward_grad(a, target, ignore_index)
    else:
        rows, lse = tk_cross_entropy_forward(a, target, ignore_index)
    valid_rows = _valid_rows(target, ignore_index) if reduction == "mean" else None  # counted once, used twice
    loss = _reduce_rows(a, rows, valid_rows, reduction)
    g = ltorch.to(get_grad(loss), thunder.float32)
    if reduction == "mean":
        g = ltorch.true_divide(g, valid_rows)
    if reduction != "none":
        g = ltorch.expand(g, (a.shape[0],))
    put_grad(a, tk_scale_rows(d, g) if forward_grad else tk_cross_entropy_backward(a, target, lse, g, ignore_index))
    return loss


tk.set_lowering(ltorch.cross_entropy.id, execution_transform=_cross_entropy_lowering,
                grad_transform=_cross_entropy_grad)


# ------------------------------------------------------------------------------------------------
# Collectives (FSDP's parameter all-gather and gradient reduce-scatter). An async call returns
# (Work, tensor), the form Thunder's torch `wait` completes, so `wait` stays with the torch executor and
# Thunder's wait-sorting pass still moves it after the compute it can overlap.


def _all_gather_impl(a, group, do_async, dim=None):
    return collectives.all_gather(a, group, async_op=bool(do_async))


def _reduce_scatter_impl(a, op, group, do_async, dim=None):
    return collectives.reduce_scatter(a, "avg" if op.name == "AVG" else "sum", group, async_op=bool(do_async))


tk_all_gather = tk.register_operator("tk_all_gather", meta=dist_prims.all_gather.meta, fn=_all_gather_impl)
tk_reduce_scatter = tk.register_operator(
    "tk_reduce_scatter", meta=dist_prims.reduce_scatter.meta, fn=_reduce_scatter_impl
)
tk.set_lowering(dist_prims.PrimIDs.ALL_GATHER, execution_transform=tk_all_gather, grad_transform=None)
tk.set_lowering(dist_prims.PrimIDs.REDUCE_SCATTER, execution_transform=tk_reduce_scatter, grad_transform=None)


# ------------------------------------------------------------------------------------------------
# The embedding's weight gradient (Thunder's gradient of the lookup emits ltorch.embedding_backward).


def _embedding_backward_meta(grad, indices, num_weights, padding_idx):
    return TensorProxy(like=grad, shape=(int(num_weights), grad.shape[-1]))


def _embedding_backward_impl(grad, indices, num_weights, padding_idx):
    return ops.embedding_backward(grad, indices, num_weights, padding_idx)


tk_embedding_backward = tk.register_operator("tk_embedding_backward", meta=_embedding_backward_meta,
                                             fn=_embedding_backward_impl)


def _embedding_backward_lowering(grad, indices, num_weights, padding_idx, scale_grad_by_freq, sparse):
    return tk_embedding_backward(grad, indices, int(pyval(num_weights)), int(pyval(padding_idx)))


tk.set_lowering(ltorch.embedding_backward.id, execution_transform=_embedding_backward_lowering, grad_transform=None)


# ------------------------------------------------------------------------------------------------
# RMSNorm, forward and backward. Only rms_norm_fusion.fold_rms_norm puts these in a trace: LitGPT's RMSNorm is
# spelled out in elementwise ops and sums there (no symbol to claim), which that pass recognises and confirms.
# Not recomputed in the backward: s and rstd are what the backward reads.
_NORM_TAGS = (OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD,)


def _rstd_like(x: TensorProxy) -> TensorProxy:
    return TensorProxy(like=x, shape=(*x.shape[:-1], 1), dtype=thunder.float32)


def _rms_norm_meta(x: TensorProxy, weight: TensorProxy, eps: float):
    return TensorProxy(like=x), _rstd_like(x)


def _rms_norm_impl(x, weight, eps):
    return ops.rms_norm(x, weight, eps)


def _add_rms_norm_meta(x: TensorProxy, residual: TensorProxy, weight: TensorProxy, eps: float):
    return TensorProxy(like=x), _rstd_like(x), TensorProxy(like=x)


def _add_rms_norm_impl(x, residual, weight, eps):
    return ops.rms_norm(x, weight, eps, residual=residual)


def _rms_norm_backward_meta(grad, s, rstd, weight, residual_grad):
    return TensorProxy(like=s), TensorProxy(like=weight)


def _rms_norm_backward_impl(grad, s, rstd, weight, residual_grad):
    return ops.rms_norm_backward(grad, s, rstd, weight, residual_grad)


tk_rms_norm = tk.register_operator("tk_rms_norm", meta=_rms_norm_meta, fn=_rms_norm_impl, tags=_NORM_TAGS)
# (y, rstd, s): the residual add (x + residual, rounded) in the same pass, s being the norm's input.
tk_add_rms_norm = tk.register_operator("tk_add_rms_norm", meta=_add_rms_norm_meta, fn=_add_rms_norm_impl,
                                       tags=_NORM_TAGS)
# (dx, dw): residual_grad (None or the gradient reaching s by the residual path) added to dx before rounding.
tk_rms_norm_backward = tk.register_operator("tk_rms_norm_backward", meta=_rms_norm_backward_meta,
                                            fn=_rms_norm_backward_impl)
