"""User-facing functions that thunder_tk adds to Thunder's vocabulary.

Called eagerly they run the kernel where it can run and an fp32 reference elsewhere. Inside
``thunder.jit(..., executors=[tk])`` they become one trace symbol that tk's claim rule routes to the kernel;
where the rule declines, Thunder decomposes the symbol into ordinary ops that the fuser handles.
"""

from __future__ import annotations

import torch
import thunder
import thunder.torch as ltorch
from thunder.core.symbol import Symbol

from thunder_tk import _extension, ops


def attention_bwd_delta(o: torch.Tensor, grad_o: torch.Tensor) -> torch.Tensor:
    """Row-wise ``sum(grad_o * o, -1)`` in fp32 for (B, H, S, D) tensors: the attention backward pre-pass.

    Eagerly, inputs that need a gradient take the differentiable reference; under ``thunder.jit`` tk's
    kernel serves both cases (its gradient is part of the claim).
    """
    needs_grad = torch.is_grad_enabled() and (o.requires_grad or grad_o.requires_grad)
    if (
        not needs_grad
        and o.device.type == "cuda"
        and _extension.extension() is not None
        and _extension.device_capability(o.device.index) == _extension.SUPPORTED_CAPABILITY
    ):
        return ops.attention_bwd_delta(o, grad_o)
    return ops.attention_bwd_delta_reference(o, grad_o)


def _attention_bwd_delta_decomposition(o, grad_o):
    return ltorch.sum(ltorch.mul(ltorch.to(grad_o, thunder.float32), ltorch.to(o, thunder.float32)), -1)


attention_bwd_delta_symbol = Symbol(
    name="attention_bwd_delta",
    id="thunder_tk.attention_bwd_delta",
    meta=_attention_bwd_delta_decomposition,
    is_prim=False,
)
