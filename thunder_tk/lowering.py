"""Thunder operators for tk's kernels, and how each claimed symbol lowers to them.

Kernel operators are registered with `meta=` (no subsymbols), so no fuser can pull them into a region.
"""

from __future__ import annotations

import thunder
import thunder.torch as ltorch
from thunder.core import prims
from thunder.core.prims import OpTags
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.distributed import prims as dist_prims

from thunder_tk import collectives, functional, ops
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
# GEMMs: linear (inference: ltorch.linear; training forward: prims.linear) and 2-D matmul (the backward
# GEMMs dX = dY W and dW = dY^T X that Thunder's linear gradient emits). No grad transform: Thunder's own
# gradient of linear produces those matmuls, which tk then claims in turn.


def _linear_meta(a: TensorProxy, w: TensorProxy, bias: TensorProxy | None) -> TensorProxy:
    return TensorProxy(like=a, shape=(*a.shape[:-1], w.shape[0]))


def _matmul_meta(a: TensorProxy, b: TensorProxy) -> TensorProxy:
    return TensorProxy(like=a, shape=(a.shape[0], b.shape[1]))


_GEMM_TAGS = (OpTags.MATMUL_OP, OpTags.DONT_AUTO_RECOMPUTE_IN_BACKWARD)
tk_linear = tk.register_operator("tk_linear", meta=_linear_meta, fn=ops.linear, tags=_GEMM_TAGS)
tk_matmul = tk.register_operator("tk_matmul", meta=_matmul_meta, fn=ops.gemm, tags=_GEMM_TAGS)

# The claimed symbols take the operators' arguments, so the operators are the execution transforms.
for _symbol_id in (ltorch.linear.id, prims.PrimIDs.LINEAR):
    tk.set_lowering(_symbol_id, execution_transform=tk_linear, grad_transform=None)
for _symbol_id in (ltorch.matmul.id, prims.PrimIDs.MATMUL):
    tk.set_lowering(_symbol_id, execution_transform=tk_matmul, grad_transform=None)


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
