"""Stand-ins for executors that cannot run here: nvFuser (no build for torch 2.11), a CPU attention executor, and
tk's attention and cross-entropy kernels in float64 math on CPU (`StandinBuild`).

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


# ------------------------------------------------------------------------------------------------
# tk's attention kernels on CPU


def attention_forward_standin(q, k, v, *, is_causal=False, scale=None, window=None):
    """ops.attention_forward's contract in float64 math on any device: o in the input dtype, lse float32."""
    from thunder_tk import ops

    assert q.dtype in (torch.bfloat16, torch.float16) and q.dtype == k.dtype == v.dtype, (q.dtype, k.dtype, v.dtype)
    assert q.shape[1] % k.shape[1] == 0 and k.shape[2] > 0 and q.shape[-1] in ops.ATTENTION_HEAD_DIMS
    o, lse = ops.attention_forward_reference(q, k, v, is_causal=is_causal, scale=scale, window=window)
    return o.to(q.dtype), lse.float()


def attention_backward_standin(q, k, v, o, lse, grad_o, *, is_causal=False, scale=None, window=None):
    """The coming ops.attention_backward's contract, in float64 math from the saved o and lse (as the kernel
    would: the probabilities are rebuilt as exp(scale q k^T - lse), never renormalised). `window` (causal): query i
    keeps keys i - window < j <= i."""
    B, Hq, Sq, D = q.shape
    Hkv, Sk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    assert lse.shape == (B, Hq, Sq) and lse.dtype == torch.float32 and o.shape == grad_o.shape == q.shape
    scale = D ** -0.5 if scale is None else scale
    q64, o64, do64 = q.double(), o.double(), grad_o.double()
    k64 = k.double().repeat_interleave(group, dim=1)
    v64 = v.double().repeat_interleave(group, dim=1)
    s = (q64 @ k64.transpose(-1, -2)) * scale
    if is_causal:
        dropped = torch.ones(Sq, Sk, dtype=torch.bool).triu(1)
        if window is not None:
            dropped |= torch.ones(Sq, Sk, dtype=torch.bool).tril(-int(window))
        s = s.masked_fill(dropped, float("-inf"))
    p = torch.exp(s - lse.double().unsqueeze(-1))
    dv = p.transpose(-1, -2) @ do64
    dp = do64 @ v64.transpose(-1, -2)
    delta = (do64 * o64).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ k64) * scale
    dk = (ds.transpose(-1, -2) @ q64) * scale

    def per_kv_head(t):  # sum the query heads that share a key/value head
        return t.view(B, Hkv, group, Sk, D).sum(2)

    return dq.to(q.dtype), per_kv_head(dk).to(k.dtype), per_kv_head(dv).to(v.dtype)


def attention_backward_qkv_standin(q, k, v, o, lse, grad_o, cos, sin, *, is_causal=False, scale=None, window=None):
    """ops.attention_backward_qkv's contract: the standin's gradients, rotated back and concatenated (float64)."""
    from thunder_tk import ops

    assert ops.qkv_grad_unsupported(q, k, cos, sin) is None, ops.qkv_grad_unsupported(q, k, cos, sin)
    dq, dk, dv = attention_backward_standin(q, k, v, o, lse, grad_o, is_causal=is_causal, scale=scale, window=window)
    return ops.qkv_grad_reference(dq, dk, dv, cos, sin).to(q.dtype)


# ------------------------------------------------------------------------------------------------
# tk's cross-entropy kernels on CPU


def _check_cross_entropy_standin_args(logits, target):
    """ops.check_cross_entropy_args without its CUDA-only check."""
    assert logits.ndim == 2 and target.ndim == 1 and target.shape[0] == logits.shape[0], (logits.shape, target.shape)
    assert logits.dtype in (torch.bfloat16, torch.float16, torch.float32), logits.dtype
    assert target.dtype == torch.int64 and logits.shape[1] > 0 and target.device == logits.device


def cross_entropy_forward_standin(logits, target, ignore_index=-100):
    """ops.cross_entropy_forward's contract in float64 math on any device: per row (lse - logits[target], lse),
    both float32 (rows,); the loss 0 where target == ignore_index and NaN where a target is outside [0, classes)."""
    from thunder_tk import ops

    _check_cross_entropy_standin_args(logits, target)
    loss, lse = ops.cross_entropy_reference(logits, target, ignore_index)
    return loss.float(), lse.float()


def cross_entropy_backward_standin(logits, target, lse, grad_loss, ignore_index=-100):
    """ops.cross_entropy_backward's contract in float64 math: grad_loss[r] * (softmax - onehot(target[r])) in the
    logits' dtype, the probabilities rebuilt from the saved lse as the kernel does (exp(x - lse)); zero rows where
    target == ignore_index. grad_loss is float32 (rows,) of any stride (an expanded scalar has stride 0)."""
    _check_cross_entropy_standin_args(logits, target)
    rows, classes = logits.shape
    for t in (lse, grad_loss):
        assert t.dtype == torch.float32 and tuple(t.shape) == (rows,) and t.device == logits.device, (t.dtype, t.shape)
    x = logits.double()
    p = torch.exp(x - lse.double().unsqueeze(1))
    valid = (target >= 0) & (target < classes)
    onehot = torch.zeros_like(p)
    onehot[valid, target[valid]] = 1.0
    grad = grad_loss.double().unsqueeze(1) * (p - onehot)
    grad[target == ignore_index] = 0.0
    return grad.to(logits.dtype).contiguous()  # ops allocates a contiguous (rows, classes) gradient


class StandinBuild:
    """A fake compiled module whose kernels run on CPU tensors, for routing tests that also execute.

    Installs (through `monkeypatch`): the module, reporting this version's KERNELS_IN_SOURCE (`add` and
    `remove` change that), claim rules that take CPU tensors for a GPU, and the stand-ins above as
    ops.attention_forward / ops.attention_backward / _backward_qkv, ops.cross_entropy_forward / _backward /
    _forward_grad, ops.gemm (which ops.linear calls), ops.gemm_sum, ops.swiglu_linear, ops.matmul_swiglu_grad,
    ops.linear_rope, ops.embedding_backward, ops.rms_norm and ops.rms_norm_backward. Collectives are not stood in
    for.
    """

    def __init__(self, monkeypatch):
        from thunder_tk import _extension, claim_rules, ops

        self._kernels = set(claim_rules.KERNELS_IN_SOURCE)
        monkeypatch.setattr(_extension, "_load", lambda: (self, ""))
        monkeypatch.setattr(claim_rules, "check_devices", _check_one_device)
        monkeypatch.setattr(ops, "attention_forward", attention_forward_standin)
        monkeypatch.setattr(ops, "attention_backward", attention_backward_standin, raising=False)
        monkeypatch.setattr(ops, "attention_backward_qkv", attention_backward_qkv_standin, raising=False)
        monkeypatch.setattr(ops, "cross_entropy_forward", cross_entropy_forward_standin, raising=False)
        monkeypatch.setattr(ops, "cross_entropy_backward", cross_entropy_backward_standin, raising=False)
        monkeypatch.setattr(ops, "cross_entropy_forward_grad", cross_entropy_forward_grad_standin, raising=False)
        monkeypatch.setattr(ops, "gemm", gemm_standin)
        monkeypatch.setattr(ops, "gemm_sum", gemm_sum_standin)
        monkeypatch.setattr(ops, "swiglu_linear", swiglu_linear_standin)
        monkeypatch.setattr(ops, "matmul_swiglu_grad", matmul_swiglu_grad_standin, raising=False)
        monkeypatch.setattr(ops, "linear_rope", linear_rope_standin, raising=False)
        monkeypatch.setattr(ops, "embedding_backward", embedding_backward_standin, raising=False)
        monkeypatch.setattr(ops, "rms_norm", rms_norm_standin, raising=False)
        monkeypatch.setattr(ops, "rms_norm_backward", rms_norm_backward_standin, raising=False)

    def kernels(self):
        return sorted(self._kernels)

    # the launch-order switch (csrc/kittens/launch.h), kept as the compiled module keeps it
    _dependent = True

    def dependent_launch(self) -> bool:
        return self._dependent

    def set_dependent_launch(self, enabled: bool) -> None:
        self._dependent = bool(enabled)

    def add(self, name: str) -> "StandinBuild":
        self._kernels.add(name)
        return self

    def remove(self, name: str) -> "StandinBuild":
        self._kernels.discard(name)
        return self


def turned_off(how, feature, kernel, build, monkeypatch) -> dict:
    """The compile options that turn `feature` off `how`: the tk_disable option, the environment variable (then no
    options), or a build without its kernel."""
    if how == "option":
        return {"tk_disable": feature}
    if how == "env":
        monkeypatch.setenv("THUNDER_TK_DISABLE", feature)
    else:
        build.remove(kernel)
    return {}


def _check_one_device(tensors):
    from thunder_tk.claim_rules import ACCEPT, decline

    if not tensors:
        return decline("no tensor arguments")
    devices = {str(t.device) for t in tensors}
    return ACCEPT if len(devices) == 1 else decline(f"tensors on several devices: {', '.join(sorted(devices))}")


# ------------------------------------------------------------------------------------------------
# tk's GEMM and the cross-entropy's forward with its gradient, on CPU


def _gemm_out_dtype(a, out_dtype):
    """ops.gemm's result dtype: the operands', or float32 with bfloat16 operands."""
    out_dtype = a.dtype if out_dtype is None else out_dtype
    assert out_dtype == a.dtype or (out_dtype == torch.float32 and a.dtype == torch.bfloat16), (a.dtype, out_dtype)
    return out_dtype


def gemm_standin(a, b, bias=None, *, out_dtype=None, **knobs):
    """ops.gemm's contract in float64 math: a (M, K) @ b (K, N) (+ bias), 16-bit operands, result in their dtype
    (or float32 with bf16 operands)."""
    assert a.ndim == b.ndim == 2 and a.shape[1] == b.shape[0] and a.shape[1] % 8 == 0, (a.shape, b.shape)
    assert a.dtype == b.dtype and a.dtype in (torch.bfloat16, torch.float16), (a.dtype, b.dtype)
    out = a.double() @ b.double()
    if bias is not None:
        out = out + bias.double()
    return out.to(_gemm_out_dtype(a, out_dtype))


def gemm_sum_standin(a, b, a2, b2, bias=None, *, out_dtype=None, **knobs):
    """ops.gemm_sum's contract in float64 math: a @ b + a2 @ b2 (+ bias), rounded once to the operands' dtype (or
    float32 with bf16 operands)."""
    assert a.shape[0] == a2.shape[0] and b.shape[1] == b2.shape[1] and a2.shape[1] == b2.shape[0], (a.shape, a2.shape)
    assert a2.shape[1] % 8 == 0 and a2.dtype == b2.dtype == a.dtype, (a2.shape, a2.dtype)
    out = a.double() @ b.double() + a2.double() @ b2.double()
    if bias is not None:
        out = out + bias.double()
    return out.to(_gemm_out_dtype(a, out_dtype))


def swiglu_linear_standin(x, w1, w2):
    """ops.swiglu_linear's contract in float64 math: (silu(h1) * h2, h1, h2), h1 = x w1^T and h2 = x w2^T rounded to
    x's dtype, silu(h1) rounded before the product."""
    assert x.shape[-1] == w1.shape[1] and w1.shape == w2.shape and w1.shape[0] % 8 == 0 and w1.shape[1] % 8 == 0
    assert x.dtype == w1.dtype == w2.dtype and x.dtype in (torch.bfloat16, torch.float16), (x.dtype, w1.dtype)
    h1, h2 = ((x.double() @ w.double().t()).to(x.dtype) for w in (w1, w2))
    silu = F.silu(h1.double()).to(x.dtype)
    return (silu.double() * h2.double()).to(x.dtype), h1, h2


def embedding_backward_standin(grad, indices, num_weights, padding_idx=-1):
    """ops.embedding_backward's contract: the float64 sums rounded once to grad's dtype."""
    from thunder_tk import ops

    assert ops.embedding_backward_unsupported(grad, indices, num_weights, padding_idx) is None
    return ops.embedding_backward_reference(grad, indices, num_weights, padding_idx).to(grad.dtype)


def linear_rope_standin(x, weight, cos, sin, q_heads, kv_heads, head_dim):
    """ops.linear_rope's contract in float64 math: q, k, v from the projection, q and k roped (rounded once), as
    (B, H, S, D) views of one (B, S, N) tensor."""
    from thunder_tk import ops

    reason = ops.linear_rope_unsupported(x, weight, cos, sin, q_heads, kv_heads, head_dim)
    assert reason is None, reason
    heads = ops.linear_rope_reference(x, weight, cos, sin, q_heads, kv_heads, head_dim)
    B, S = x.shape[:2]
    qkv = torch.cat([t.transpose(1, 2).reshape(B, S, -1) for t in heads], -1).to(x.dtype)
    return ops.qkv_head_views(qkv, q_heads, kv_heads, head_dim)


def matmul_swiglu_grad_standin(a, b, h1, h2):
    """ops.matmul_swiglu_grad's contract in float64 math: dg = a @ b (unrounded, as the kernel keeps it in its
    accumulators), then dh1 = dg * h2 * silu'(h1) and dh2 = dg * silu(h1), each rounded once."""
    assert a.ndim == 2 and b.ndim == 2 and a.shape[1] == b.shape[0] and h1.shape == h2.shape
    assert h1.shape[-1] == b.shape[1] and h1.numel() == a.shape[0] * b.shape[1] and b.shape[1] % 8 == 0
    assert a.dtype == b.dtype == h1.dtype == h2.dtype and a.dtype in (torch.bfloat16, torch.float16)
    dg = (a.double() @ b.double()).reshape(h1.shape)
    x, y = h1.double(), h2.double()
    s = torch.sigmoid(x)
    return (dg * y * s * (1 + x * (1 - s))).to(a.dtype), (dg * x * s).to(a.dtype)


def cross_entropy_forward_grad_standin(logits, target, ignore_index=-100, *, overwrite=False):
    """ops.cross_entropy_forward_grad's contract: row losses and lse as the forward, and softmax - onehot (unscaled,
    zero rows where ignored) in the logits' dtype; written over the logits (and returned as them) with overwrite."""
    loss, lse = cross_entropy_forward_standin(logits, target, ignore_index)
    ones = torch.ones(logits.shape[0], dtype=torch.float32)
    grad = cross_entropy_backward_standin(logits, target, lse, ones, ignore_index)
    return loss, lse, logits.copy_(grad) if overwrite else grad


def rms_norm_standin(x, weight, eps, residual=None):
    """ops.rms_norm's contract in float64 math: (y, rstd) or (y, rstd, s), y rounded once, rstd in float32."""
    from thunder_tk import ops

    assert ops.rms_norm_unsupported(x, weight, residual) is None
    y, rstd, s = ops.rms_norm_reference(x, weight, eps, residual)
    out = (y.to(x.dtype), rstd.float())
    return out if residual is None else (*out, s)


def rms_norm_backward_standin(grad, s, rstd, weight, residual_grad=None):
    """ops.rms_norm_backward's contract in float64 math: dx in s's dtype, dw in the weight's, each rounded once."""
    from thunder_tk import ops

    assert ops.rms_norm_unsupported(s, weight, residual_grad) is None and rstd.dtype == torch.float32
    dx, dw = ops.rms_norm_backward_reference(grad, s, rstd, weight, residual_grad)
    return dx.to(s.dtype), dw.to(weight.dtype)
