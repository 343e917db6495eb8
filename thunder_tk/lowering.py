"""Thunder operators for tk's kernels, and how each claimed symbol lowers to them.

Kernel operators are registered with `meta=` (no subsymbols), so no fuser can pull them into a region.
"""

from __future__ import annotations

import thunder
import thunder.torch as ltorch
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads

from thunder_tk import functional, ops
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
