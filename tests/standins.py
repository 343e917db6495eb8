"""Stand-ins for executors that cannot run here: nvFuser (no build for torch 2.11) and a CPU attention executor.

They behave like the real ones as far as routing is concerned, so tests can check where work goes.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn.functional as F
import thunder.torch as ltorch
from thunder.core import prims
from thunder.distributed import prims as dist_prims
from thunder.core.proxies import TensorProxy
from thunder.core.transforms import get_grad, put_grads
from thunder.executors import torch_compile
from thunder.executors.torch_compile import TorchCompileExecutor
from thunder.executors.torchex import ex as pytorch_ex
from thunder.extend import ImplInfo, OperatorExecutor


class EagerRegionFuser(TorchCompileExecutor):
    """A general fusion executor whose regions run as plain PyTorch (no compilation): stands in for nvFuser."""

    def __init__(self, name="nvfuser"):
        super().__init__(name=name)
        # Like nvFuser by default: no GEMMs (nv_enable_linear/matmul off), no attention, no collectives.
        excluded = {ltorch.linear.id, prims.PrimIDs.LINEAR, ltorch.matmul.id, prims.PrimIDs.MATMUL,
                    ltorch.scaled_dot_product_attention.id, *dist_prims.PrimIDs}
        self._implmap = {op: ImplInfo() for op in pytorch_ex.implmap if op not in excluded}

    def fuse(self, region, fusion_counter):
        with mock.patch.object(torch_compile.torch, "compile", lambda fn, **kw: fn):
            return super().fuse(region, fusion_counter)


def make_standin_attention(name="standin_sdpa") -> OperatorExecutor:
    """Claims ltorch.scaled_dot_product_attention on CPU tensors (no mask), with a forward and backward op."""
    ex = OperatorExecutor(name)

    def fwd_meta(q, k, v, is_causal, scale):
        return TensorProxy(like=q, shape=(*q.shape[:-1], v.shape[-1]))

    def fwd_impl(q, k, v, is_causal, scale):
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale)

    def bwd_meta(g, q, k, v, is_causal, scale):
        return TensorProxy(like=q), TensorProxy(like=k), TensorProxy(like=v)

    def bwd_impl(g, q, k, v, is_causal, scale):
        with torch.enable_grad():
            qkv = [t.detach().requires_grad_() for t in (q, k, v)]
            out = F.scaled_dot_product_attention(*qkv, is_causal=is_causal, scale=scale)
            return torch.autograd.grad(out, qkv, g)

    fwd = ex.register_operator(f"{name}_fwd", meta=fwd_meta, fn=fwd_impl)
    bwd = ex.register_operator(f"{name}_bwd", meta=bwd_meta, fn=bwd_impl)

    def checker(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
        return attn_mask is None and dropout_p == 0.0 and q.device.type == "cpu"

    def execution(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
        return fwd(q, k, v, is_causal, scale)

    def grad(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None):
        out = fwd(q, k, v, is_causal, scale)
        gq, gk, gv = bwd(get_grad(out), q, k, v, is_causal, scale)
        put_grads((q, k, v), (gq, gk, gv))
        return out

    ex.register_implementation(ltorch.scaled_dot_product_attention, checker=checker, execution_transform=execution,
                               grad_transform=grad)
    return ex
