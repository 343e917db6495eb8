"""Trace rewrites across Thunder symbols, run by the tk executor on each execution trace before its fuser's pass.

`fold_row_scaling`: with the cross-entropy's gradient computed in its forward (`lowering.FORWARD_GRAD_MIN_CLASSES`),
the backward of an lm_head + cross-entropy reads

    dlogits = tk_scale_rows(D, g)            # (rows, classes): D = softmax - onehot, g the rows' incoming gradient
    dx = matmul(view(dlogits), W)            # (rows, hidden)
    dw = matmul(view(dlogits)^T, x)          # (classes, hidden)

Scaling the rows of D is a pass over the whole logits-sized tensor; scaling the rows of the small operands instead
gives the same products, since diag(g) D W = diag(g) (D W) and (diag(g) D)^T x = D^T (diag(g) x):

    dx = tk_scale_rows(matmul(view(D), W), g)
    dw = matmul(view(D)^T, tk_scale_rows(x, g))

The rewrite applies only where every use of dlogits (through reshapes and a 2-D transpose) is such a product;
otherwise the explicit scaling stays, which is correct and costs one pass over D.

`attend_grouped_kv`: LitGPT (and other grouped-query models written for backends that need Hkv = Hq) repeats each
key/value head over its query heads before attention, `k.repeat_interleave(G, dim=1)`, which Thunder traces as

    k = reshape(broadcast_in_dim(broadcast_in_dim(k0, (B, Hkv, 1, S, D)), (B, Hkv, G, S, D)), (B, Hkv * G, S, D))

and differentiates into a sum over each group of the (B, Hq, S, D) gradient. tk's kernels read grouped K and V
natively and sum dK and dV over the group in-kernel, so the attention takes k0 and v0 instead: the expanded copies
are neither written nor saved for the backward (2 (G - 1) / G of a layer's K and V bytes less at the step's peak),
and the backward's dk and dv are the group sums themselves. Applied where both the forward and, in training, its
backward are tk's and the gradients' only use is that sum; off with the feature name `GROUPED_KV`.

`write_gradient_over_logits`: D is as large as the logits (2 GiB for 8192 tokens of a 128256-word vocabulary) and
the logits are dead once D is written, where the logits are a GEMM's own output that nothing but the cross-entropy
reads (through reshapes). There tk_cross_entropy_forward_grad becomes tk_cross_entropy_forward_grad_over_logits,
which writes D into the logits' memory: the step's peak holds one such tensor, not two.

`fuse_swiglu`: LLaMA's MLP computes silu(x W1^T) * (x W2^T). Where both products are tk_linear of one x (no bias)
and their outputs meet in that gated product, one tk_swiglu_linear launch computes both products, 128 columns of
each per tile, and writes silu(h1) * h2 beside them from shared memory (h1 and h2 stay outputs: the backward reads
them). The fuser's kernel that read both products back to form the gated one goes. Off with the feature name
`gemm_swiglu`.

`fuse_swiglu_grad`: in the backward, the output projection's dX GEMM makes dg (the gradient of silu(h1) * h2), and
Thunder's autodiff then spells out dh1 = dg * h2 * silu'(h1) and dh2 = dg * silu(h1) in some twenty elementwise ops,
which the fuser runs as one kernel reading dg, h1 and h2 back. Where dg is read by nothing else, one
tk_matmul_swiglu_grad launch computes dh1 and dh2 from dg's accumulators in its epilogue instead. The region is found
by its shape (elementwise ops from dg and two more tensors like it to two tensors like it) and confirmed by running its
ops on a small CPU probe against the formula, which also tells h1 from h2 and dh1 from dh2: Thunder's decomposition of
silu's gradient may change between versions without this rewrite matching something else. Taken up to MLP widths of
SWIGLU_GRAD_MAX_N (wider ones measured slower); off with the feature name `gemm_swiglu_grad`.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass

import thunder
import torch
import torch.nn.functional as F
from thunder.core import prims
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import from_trace, tracectx
from thunder.core.transform_common import dce

from thunder_tk import env_settings, trace_edits
from thunder_tk.attention_masks import first_torch_dtype, torch_dtype_of
from thunder_tk.claim_rules import HALF_DTYPES, TensorMetadata

# View ops as the torch executor runs them (their result is the same data in another shape).
_RESHAPES = frozenset({"reshape", "torch_prims_reshape_impl", "view"})
_TRANSPOSES = frozenset({"permute", "transpose", "torch_prims_transpose_impl"})
_VIEWS = _RESHAPES | _TRANSPOSES
_MATMULS = frozenset({"tk_matmul", "matmul"})


def _is_view_of(b: BoundSymbol, views: dict[str, bool]) -> bool:
    args = b.flat_proxy_args
    return (b.sym.name in _VIEWS and bool(args) and args[0].name in views
            and isinstance(b.output, TensorProxy))


def _plan(bsyms: list[BoundSymbol], at: int, returned: set[str]):
    """For the tk_scale_rows at `at`: the view bsyms of its result and its products [(index, 'dx' | 'dw')], or None
    if some use of it is neither."""
    scaled = bsyms[at].output
    rows, classes = scaled.shape
    views: dict[str, bool] = {scaled.name: False}  # name -> transposed
    chain, products = [], []
    for j in range(at + 1, len(bsyms)):
        b = bsyms[j]
        used = [p for p in b.flat_proxy_args if p.name in views]
        if not used:
            continue
        if _is_view_of(b, views) and len(used) == 1:
            out = b.output
            transposed = views[b.flat_proxy_args[0].name] ^ (b.sym.name in _TRANSPOSES)
            if out.ndim == 2 and tuple(out.shape) == ((classes, rows) if transposed else (rows, classes)):
                views[out.name] = transposed
            elif not transposed and out.ndim >= 2 and out.shape[-1] == classes:
                views[out.name] = False  # e.g. back to (batch, sequence, classes)
            else:
                return None
            chain.append(j)
        elif b.sym.name in _MATMULS and len(b.args) == 2 and len(used) == 1 and isinstance(b.args[0], TensorProxy) \
                and b.args[0].name in views and b.args[0].ndim == 2 and isinstance(b.args[1], TensorProxy) \
                and b.args[1].ndim == 2:
            products.append((j, "dw" if views[b.args[0].name] else "dx"))
        else:
            return None
    if not products or any(name in returned for name in views):
        return None
    return chain, products


def _producers_and_users(bsyms: list[BoundSymbol]) -> tuple[dict[str, int], dict[str, list[int]]]:
    """Each proxy's producing bsym index, and the indices of the bsyms that read it (each once)."""
    producer: dict[str, int] = {}
    users: dict[str, list[int]] = defaultdict(list)
    for i, b in enumerate(bsyms):
        for p in b.flat_proxy_outs:
            producer.setdefault(p.name, i)
        for name in dict.fromkeys(p.name for p in b.flat_proxy_args):
            users[name].append(i)
    return producer, users


def _rewritten(out, bsyms: list, provenance: str):
    """`out` (from_trace of the original) with `bsyms`, where an entry may be None (dropped) or a list (spliced in),
    dead code removed."""
    flat = []
    for b in bsyms:
        if isinstance(b, list):
            flat.extend(b)
        elif b is not None:
            flat.append(b)
    out.bound_symbols = flat
    cleaned = dce(out)
    cleaned.set_provenance(trace_edits.provenance(provenance))  # after dce, which sets its own
    return cleaned


CAST_MERGE = "cast_merge"
"""THUNDER_TK_DISABLE name that leaves repeated casts of one tensor as traced (each computed and kept on its own)."""


def merge_repeated_casts(trace):
    """The trace with each repeated cast of an fp32 tensor to one 16-bit dtype read from its first occurrence.
    Under autocast, Thunder casts a linear's input for each linear on its own, so the two up-projections
    of LLaMA's MLP read two bf16 copies of one fp32 activation: two tensors written, both saved for the backward, and
    two inputs where `fuse_swiglu` needs one. Casts are pure, so the first one's value serves every reader; merged
    before the other rewrites, which compare operands by identity. Only these downcasts: the upcasts inside a
    16-bit elementwise op's decomposition stay its own (the RMSNorm fold matches them per op). Off with the feature
    name CAST_MERGE."""
    from thunder_tk import claim_rules

    if CAST_MERGE in claim_rules.disabled_names():
        return trace
    swaps: dict = {}
    first: dict[tuple[str, str], TensorProxy] = {}
    bsyms = []
    for b in trace.bound_symbols:
        if swaps:
            b = b.from_bsym_swap_proxies(swaps, skip_output=True)
        if (b.sym.id == prims.PrimIDs.CONVERT_ELEMENT_TYPE and isinstance(b.args[0], TensorProxy)
                and isinstance(b.output, TensorProxy) and b.args[0].dtype == thunder.float32
                and b.output.dtype in HALF_DTYPES):
            key = (b.args[0].name, str(b.args[1]))
            if key in first:
                swaps[variableify(b.output)] = first[key]
                continue
            first[key] = b.output
        bsyms.append(b)
    if not swaps:
        return trace
    return trace_edits.with_bound_symbols(trace, bsyms, "tk: repeated casts of one tensor read from the first")


def fold_row_scaling(trace):
    """The trace with each tk_scale_rows whose result only feeds GEMMs moved onto those GEMMs' small operands."""
    from thunder_tk.executor import sites_of
    from thunder_tk.lowering import tk_scale_rows

    bsyms = list(trace.bound_symbols)
    returned = {p.name for b in bsyms if b.sym.name == "return" for p in b.flat_proxy_args}
    plans = [(i, _plan(bsyms, i, returned)) for i, b in enumerate(bsyms) if b.sym.id == tk_scale_rows.id]
    plans = [(i, plan) for i, plan in plans if plan is not None]
    if not plans:
        return trace
    out = from_trace(trace)
    with tracectx(out):
        for i, (chain, products) in plans:
            b = bsyms[i]
            d, g = b.args
            scaled = b.output
            bsyms[i] = None  # D's views stand in for the scaled gradient's
            for j in chain:
                c = bsyms[j]
                bsyms[j] = c.from_bsym(args=tuple(
                    d if isinstance(a, TensorProxy) and a.name == scaled.name else a for a in c.args))
            for j, kind in products:
                m = bsyms[j]
                a, w = m.args
                if kind == "dx":
                    y = TensorProxy(like=m.output)
                    y.tags.update(sites_of(m.output))  # explain names the product's launch, not the scaling
                    y.tags.add(Folded("the loss gradient's row scaling applied to its output rows"))
                    bsyms[j] = [m.from_bsym(output=y), tk_scale_rows.bind(y, g, output=m.output)]
                else:
                    w_scaled = TensorProxy(like=w)
                    m.output.tags.add(Folded("the loss gradient's row scaling applied to its other operand's rows"))
                    bsyms[j] = [tk_scale_rows.bind(w, g, output=w_scaled), m.from_bsym(args=(a, w_scaled))]
    return _rewritten(out, bsyms, "tk: the cross-entropy gradient's row scaling moved onto the lm_head's GEMMs")


# Ops whose output is memory of their own, never a view of an input.
_FRESH_OUTPUTS = frozenset({"tk_linear", "tk_matmul", "linear", "matmul"})
OVERWRITE_LOGITS = "cross_entropy_gradient_over_logits"
"""THUNDER_TK_DISABLE name that keeps D in a buffer of its own (the logits untouched)."""


def _logits_read_only_by(bsyms: list[BoundSymbol], at: int, producer: dict[str, int],
                         users: dict[str, list[int]]) -> bool:
    """Whether the cross-entropy at `at` reads the only view of a GEMM's fresh output that anything reads."""
    a = bsyms[at].args[0]
    root = a
    while True:  # back through views to the op that allocated the memory
        j = producer.get(root.name)
        if j is None:
            return False  # a trace input: the caller's tensor
        made_by = bsyms[j]
        if made_by.sym.name in _VIEWS and made_by.flat_proxy_args:
            root = made_by.flat_proxy_args[0]
            continue
        if made_by.sym.name not in _FRESH_OUTPUTS:
            return False
        break
    seen, frontier = {root.name}, [root.name]
    while frontier:  # every use of every view of it: the views themselves, and the cross-entropy's logits argument
        name = frontier.pop()
        for u in users[name]:
            b = bsyms[u]
            tensor_args = [p for p in b.flat_proxy_args if isinstance(p, TensorProxy)]
            if u == at:
                if name != a.name or sum(p.name == name for p in tensor_args) != 1:
                    return False
            elif b.sym.name in _VIEWS and len(tensor_args) == 1 and isinstance(b.output, TensorProxy):
                if b.output.name not in seen:
                    seen.add(b.output.name)
                    frontier.append(b.output.name)
            else:
                return False  # another reader (the return included)
    return True


def write_gradient_over_logits(trace):
    """The trace with each tk_cross_entropy_forward_grad whose logits nothing else reads writing D over them."""
    from thunder_tk import claim_rules
    from thunder_tk.lowering import tk_cross_entropy_forward_grad, tk_cross_entropy_forward_grad_over_logits

    if OVERWRITE_LOGITS in claim_rules.disabled_names():
        return trace
    bsyms = list(trace.bound_symbols)
    at = [i for i, b in enumerate(bsyms) if b.sym.id == tk_cross_entropy_forward_grad.id]
    if not at:
        return trace
    producer, users = _producers_and_users(bsyms)
    chosen = [i for i in at if _logits_read_only_by(bsyms, i, producer, users)]
    if not chosen:
        return trace
    out = from_trace(trace)
    with tracectx(out):
        for i in chosen:
            b = bsyms[i]
            bsyms[i] = tk_cross_entropy_forward_grad_over_logits.bind(*b.args, output=b.output)
    out.bound_symbols = bsyms
    out.set_provenance(trace_edits.provenance("tk: the cross-entropy's gradient written over the logits nothing else reads"))
    return out


GROUPED_KV = "attention_grouped_kv"
"""THUNDER_TK_DISABLE name that keeps LitGPT's repeated K and V (attention then reads Hq heads of each)."""

_BROADCASTS = frozenset({"broadcast_in_dim", "expand"})
_UNSQUEEZES = frozenset({"unsqueeze"})
_SUMS = frozenset({"sum"})


def _made_by(p, names: frozenset, bsyms: list[BoundSymbol], producer: dict[str, int]):
    """The bsym among `names` that produced tensor p, or None."""
    j = producer.get(p.name) if isinstance(p, TensorProxy) else None
    return bsyms[j] if j is not None and bsyms[j].sym.name in names else None


def _repeated_heads(t: TensorProxy, bsyms: list[BoundSymbol], producer: dict[str, int]):
    """(k0, G) where t = k0 with each head repeated G times in a row along dim 1, as repeat_interleave traces it
    (a size-1 dim 2, broadcast to G, merged into dim 1; the prims, or the torch executor's ops on CPU); else None."""
    if t.ndim != 4:
        return None
    B, H, S, D = t.shape
    merge = _made_by(t, _RESHAPES, bsyms, producer)
    x = merge.flat_proxy_args[0] if merge is not None else None
    if x is None or x.ndim != 5 or x.shape[0] != B or tuple(x.shape[3:]) != (S, D) or x.shape[1] * x.shape[2] != H:
        return None
    Hkv, G = x.shape[1], x.shape[2]
    # back through the broadcasts of dim 2 (B, Hkv, 1, S, D) -> (B, Hkv, G, S, D), identity ones included
    while (grown := _made_by(x, _BROADCASTS, bsyms, producer)) is not None and grown.flat_proxy_args[0].ndim == 5:
        if grown.sym.name == "broadcast_in_dim" and tuple(grown.args[2]) != (0, 1, 2, 3, 4):
            return None
        x = grown.flat_proxy_args[0]
    if tuple(x.shape) != (B, Hkv, 1, S, D):
        return None
    inserted = _made_by(x, _BROADCASTS | _UNSQUEEZES | _RESHAPES, bsyms, producer)
    if inserted is None:
        return None
    if inserted.sym.name == "broadcast_in_dim" and tuple(inserted.args[2]) != (0, 1, 3, 4):
        return None
    if inserted.sym.name in _UNSQUEEZES and inserted.args[1] not in (2, -3):
        return None
    if inserted.sym.name == "expand":
        return None
    k0 = inserted.flat_proxy_args[0]
    if not isinstance(k0, TensorProxy) or tuple(k0.shape) != (B, Hkv, S, D) or k0.dtype != t.dtype:
        return None
    return k0, G


def _group_sum(grad: TensorProxy, G: int, bsyms: list[BoundSymbol], users: dict[str, list[int]]):
    """(reshape index, sum index, sum output) where grad's only use is a reshape to (B, Hkv, G, S, D) and that one's
    only use a sum over dim 2 (and dims of size 1): repeat_interleave's gradient; else None."""
    B, H, S, D = grad.shape
    split = (B, H // G, G, S, D)
    if len(users[grad.name]) != 1:
        return None
    r = users[grad.name][0]
    rb = bsyms[r]
    if rb.sym.name not in _RESHAPES or rb.flat_proxy_args[0] is not grad or tuple(rb.output.shape) != split:
        return None
    if len(users[rb.output.name]) != 1:
        return None
    s = users[rb.output.name][0]
    sb = bsyms[s]
    if sb.sym.name not in _SUMS or len(sb.args) < 2 or sb.args[0] is not rb.output:
        return None
    dims = sb.args[1]
    keepdim = sb.args[2] if len(sb.args) > 2 else sb.kwargs.get("keepdim", False)
    if keepdim or sb.kwargs.get("dtype") is not None or dims is None:
        return None
    dims = {d % 5 for d in ((dims,) if isinstance(dims, int) else dims)}
    if 2 not in dims or any(split[d] != 1 for d in dims - {2}) or sb.output.dtype != grad.dtype:
        return None
    return r, s, sb.output


# Ops whose result is (or, for reshape, may be) a view of their first argument: a chain of them from a larger tensor
# keeps that tensor's memory alive for as long as the result is.
_VIEW_CHAIN = _VIEWS | frozenset({"slice_prim", "slice", "split", "unsqueeze", "squeeze", "narrow", "getitem"})


def _views_a_larger_tensor(t: TensorProxy, bsyms: list[BoundSymbol], producer: dict[str, int]) -> bool:
    """Whether t is reached from a larger tensor of the trace through views only (LitGPT's v: a slice of the fused
    qkv projection, transposed): saved for the backward, it would keep all of that tensor alive."""
    while (j := producer.get(t.name)) is not None and bsyms[j].sym.name in _VIEW_CHAIN:
        src = bsyms[j].flat_proxy_args[0] if bsyms[j].flat_proxy_args else None
        if not isinstance(src, TensorProxy):
            return False
        if src.numel > t.numel:
            return True
        t = src
    return False


def attend_grouped_kv(trace):
    """The trace with tk's attention reading grouped K and V where they are repeat_interleave's copies (module doc)."""
    from thunder.core.prims import reshape as prims_reshape
    from thunder_tk import claim_rules
    from thunder_tk.lowering import tk_attention, tk_attention_backward, tk_attention_forward

    if GROUPED_KV in claim_rules.disabled_names():
        return trace
    bsyms = list(trace.bound_symbols)
    forwards = [i for i, b in enumerate(bsyms) if b.sym.id in (tk_attention.id, tk_attention_forward.id)]
    if not forwards:
        return trace
    producer, users = _producers_and_users(bsyms)
    edits = []  # (forward index, backward index or None, k0, v0, [(reshape, sum, summed) for dk and dv])
    for i in forwards:
        f = bsyms[i]
        q, k, v = f.args[:3]
        kg, vg = _repeated_heads(k, bsyms, producer), _repeated_heads(v, bsyms, producer)
        if kg is None or vg is None or kg[1] != vg[1]:
            continue
        (k0, G), (v0, _) = kg, vg
        backward, sums = None, []
        if f.sym.id == tk_attention_forward.id:
            lse = f.output[1]
            readers = [j for j in users[lse.name] if bsyms[j].sym.id == tk_attention_backward.id]
            if len(readers) > 1:
                continue
            if readers:
                backward = readers[0]
                bb = bsyms[backward]
                if bb.args[1] is not k or bb.args[2] is not v or bb.args[4] is not lse:
                    continue
                sums = [_group_sum(g, G, bsyms, users) for g in bb.output[1:]]
                if any(s is None for s in sums):
                    continue
        edits.append((i, backward, k0, v0, sums))
    if not edits:
        return trace
    out = from_trace(trace)
    with tracectx(out):
        for i, backward, k0, v0, sums in edits:
            f = bsyms[i]
            # K or V that only views a larger tensor (the qkv projection's output) is made compact for the attention:
            # what the backward saves is then its own Hkv heads, not the whole projection.
            compact = []
            if backward is not None:
                for t in (k0, v0):
                    if _views_a_larger_tensor(t, bsyms, producer):
                        copy = TensorProxy(like=t)
                        compact.append(prims.clone.bind(t, output=copy))
                        k0, v0 = (copy if x is t else x for x in (k0, v0))
            bsyms[i] = [*compact, f.from_bsym(args=(f.args[0], k0, v0, *f.args[3:]))]
            if backward is None:
                continue
            bb = bsyms[backward]
            grads, after = [], []
            for (r, s, summed), g0 in zip(sums, (k0, v0)):
                bsyms[r] = None
                bsyms[s] = None
                if tuple(summed.shape) == tuple(g0.shape):
                    grads.append(summed)  # the kernel's dk or dv is the group sum itself
                else:  # e.g. B = 1, summed over dims 0 and 2: the same elements in the sum's shape
                    native = TensorProxy(like=g0)
                    grads.append(native)
                    after.append(prims_reshape.bind(native, tuple(summed.shape), output=summed))
            bsyms[backward] = [bb.from_bsym(args=(bb.args[0], k0, v0, *bb.args[3:]),
                                            output=(bb.output[0], *grads)), *after]
    return _rewritten(out, bsyms, "tk: attention reads grouped K and V instead of their repeat_interleave copies")


SWIGLU = "gemm_swiglu"
"""THUNDER_TK_DISABLE name that keeps SwiGLU's two products and silu(h1) * h2 apart (the fuser then computes the
product from both GEMMs' outputs)."""

_TO = frozenset({"to", "convert_element_type"})
_MUL = frozenset({"mul"})
_SILU = frozenset({"silu"})


def _linear_of(p, bsyms: list[BoundSymbol], producer: dict[str, int]):
    """(index, x, w, bias) where tensor p is a tk_linear's output, else None."""
    from thunder_tk.lowering import tk_linear

    j = producer.get(p.name) if isinstance(p, TensorProxy) else None
    if j is None or bsyms[j].sym.id != tk_linear.id:
        return None
    return (j, *bsyms[j].args)


def _upcast_of(p, bsyms: list[BoundSymbol], producer: dict[str, int]):
    """The tensor that p converts to float32 (to / convert_element_type), else None."""
    b = _made_by(p, _TO, bsyms, producer)
    if b is None or b.output.dtype != thunder.float32 or not isinstance(b.args[0], TensorProxy):
        return None
    return b.args[0]


def _swiglu_unsupported(x, x2, w1, w2, bias1, bias2, g, h1, bsyms, producer) -> str | None:
    """Why one tk_swiglu_linear launch cannot stand for these two products and their gated product (for `explain`)."""
    if x is not x2:
        casts = [_made_by(t, _TO, bsyms, producer) for t in (x, x2)]
        if all(c is not None for c in casts) and casts[0].args[0] is casts[1].args[0]:
            return "fc_1 and fc_2 read two casts of one tensor (cast_merge turned off)"
        return "fc_1 and fc_2 read different inputs"
    if bias1 is not None or bias2 is not None:
        return "a product has a bias (the launch adds none)"
    if tuple(w1.shape) != tuple(w2.shape):
        return f"the weights differ in shape: {tuple(w1.shape)} and {tuple(w2.shape)}"
    if w1.shape[0] % 8 or w1.shape[1] % 8:
        return f"the MLP width ({w1.shape[0]}) and K ({w1.shape[1]}) must be multiples of 8"
    if not (x.dtype == w1.dtype == w2.dtype == g.dtype) or x.dtype not in HALF_DTYPES:
        return (f"x, both weights and the gated product must share one 16-bit dtype; got {x.dtype}, {w1.dtype}, "
                f"{w2.dtype} and {g.dtype}")
    if tuple(g.shape) != tuple(h1.shape):
        return f"the gated product {tuple(g.shape)} is not the products' shape {tuple(h1.shape)}"
    return None


def _swiglu_plan(bsyms: list[BoundSymbol], k: int, producer: dict[str, int]):
    """For bsym k whose output g is silu(h1) * h2 as traced, h1 and h2 tk_linear products: `mul(silu(h1), h2)` in
    16 bits (inference), or `to(mul(to(silu(h1), f32), to(h2, f32)), dtype)` (training, as Thunder's autodiff writes
    it). Returns (fc_1 index, fc_2 index, x, w1, w2, g) where one launch can take both products (one x, no bias),
    (fc_1 index, fc_2 index, why not) where it cannot, and None where bsym k is no such product."""
    b = bsyms[k]
    if b.sym.name in _TO and isinstance(b.args[0], TensorProxy):
        mul = _made_by(b.args[0], _MUL, bsyms, producer)
        if mul is None or len(mul.flat_proxy_args) != 2:
            return None
        factors = [_upcast_of(f, bsyms, producer) for f in mul.args[:2]]
    elif b.sym.name in _MUL and len(b.flat_proxy_args) == 2:
        factors = list(b.args[:2])
    else:
        return None
    g = b.output
    if any(f is None for f in factors) or not isinstance(g, TensorProxy):
        return None
    for silu_side in (0, 1):
        silu = _made_by(factors[silu_side], _SILU, bsyms, producer)
        if silu is None or (len(silu.args) > 1 and silu.args[1]):  # not in place
            continue
        fc_1 = _linear_of(silu.args[0], bsyms, producer)
        fc_2 = _linear_of(factors[1 - silu_side], bsyms, producer)
        if fc_1 is None or fc_2 is None or fc_1[0] == fc_2[0]:
            continue
        (i1, x, w1, bias1), (i2, x2, w2, bias2) = fc_1, fc_2
        why = _swiglu_unsupported(x, x2, w1, w2, bias1, bias2, g, bsyms[i1].output, bsyms, producer)
        return (i1, i2, why) if why is not None else (i1, i2, x, w1, w2, g)
    return None


def _swiglu_hoisted(bsyms: list[BoundSymbol], plan, producer: dict[str, int]):
    """The indices of the bsyms to move up to the earlier product's place, so that the launch replacing both
    products can go there: those making x or a weight after it (under autocast, the second weight's cast comes
    between the two linears), each reading only what exists before that place. None where one reads more."""
    i1, i2, x, w1, w2, _ = plan
    first = min(i1, i2)
    hoisted = []
    for t in (x, w1, w2):
        j = producer.get(t.name, -1)
        if j < first or j in hoisted:
            continue
        if any(producer.get(a.name, -1) >= first for a in bsyms[j].flat_proxy_args):
            return None
        hoisted.append(j)
    return sorted(hoisted)


def fuse_swiglu(trace):
    """The trace with SwiGLU's two tk_linear products and silu(h1) * h2 as one tk_swiglu_linear launch, which also
    returns h1 and h2 for whatever else reads them (the backward): the fuser no longer reads both products back to
    form the gated one. Off with the feature name SWIGLU, and where the build has no gemm_swiglu kernel. Products
    left as they are say why in a Declined tag, which `explain` shows on the linears' rows."""
    from thunder_tk.lowering import tk_swiglu_linear

    bsyms = list(trace.bound_symbols)
    if not any(b.sym.name in _SILU for b in bsyms):
        return trace
    off = _switched_off(SWIGLU, SWIGLU)
    producer, _ = _producers_and_users(bsyms)
    plans, taken = [], set()
    for k, b in enumerate(bsyms):
        plan = _swiglu_plan(bsyms, k, producer)
        if plan is None or plan[0] in taken or plan[1] in taken:
            continue
        why = off or (plan[2] if len(plan) == 3 else None)
        hoisted = _swiglu_hoisted(bsyms, plan, producer) if why is None else None
        if why is None and hoisted is None:
            why = "x or a weight is made after the first product from values made after it"
        if why is not None:
            # on both products' results, which `explain` finds the linears' rows by
            for i in plan[:2]:
                _tag_declined(bsyms[i].output, SWIGLU, why)
            continue
        taken.update(plan[:2])
        plans.append((k, hoisted, plan))
    if not plans:
        return trace
    out = from_trace(trace)
    with tracectx(out):
        for k, hoisted, (i1, i2, x, w1, w2, g) in plans:
            h1, h2 = bsyms[i1].output, bsyms[i2].output
            first = min(i1, i2)
            launch = [bsyms[j] for j in hoisted] + [tk_swiglu_linear.bind(x, w1, w2, output=(g, h1, h2))]
            for j in (*hoisted, i1, i2, k):
                bsyms[j] = None
            bsyms[first] = launch
    return _rewritten(out, bsyms, "tk: SwiGLU's two products and silu(h1) * h2 in one GEMM launch")


SWIGLU_GRAD = "gemm_swiglu_grad"
"""THUNDER_TK_DISABLE name that keeps SwiGLU's backward apart from the output projection's dX GEMM (the fuser then
reads dg, h1 and h2 back to form dh1 and dh2)."""

# The widest MLP (N, the product's output columns) the rewrite takes. Its launch runs 128-wide tiles, and against tk's
# 256-wide dX GEMM plus the fuser's kernel it measured 1.07x at Llama-3.2-1B's 2048 -> 8192 and 0.976x at Llama-3-8B's
# 4096 -> 14336, where 128-wide tiles alone cost 13% (H100, 6781471); with the consumers' epilogue, on an H200 (whose
# bandwidth makes the fuser's kernel cheaper), 0.993x and 0.994x (f45304c); with the consumers taking whole tiles in
# turns, 1.10x and 1.02x (H200, efcfa62; benchmarks/swiglu.py, benchmarks/NOTES.md). So up to Llama-3-8B's width.
SWIGLU_GRAD_MAX_N = 14336

# The elementwise ops that Thunder's autodiff writes for silu(h1) * h2's backward, including silu(h1) recomputed from
# the saved h1, by name: as prims and ltorch ops (the joint trace tk sees with a fuser) or as the torch executor's.
_GATE_GRAD_OPS = _TO | _MUL | _SILU | frozenset({"clone", "neg", "exp", "add", "sub", "div", "true_divide",
                                                 "reciprocal", "sigmoid"})
# The probe's values: h1 spread over silu's bend, dg and h2 of unit scale. Its tolerance (relative, over the probe)
# leaves room for the bf16 roundings between Thunder's ops (0.2-0.6% over the probe), far below what a wrong formula
# or a swapped role gives (order 1).
_PROBE_ELEMENTS, _PROBE_H1_SCALE, _PROBE_TOLERANCE = 512, 3.0, 4e-2


def _gate_grad_region(bsyms: list[BoundSymbol], k: int, producer: dict[str, int], users: dict[str, list[int]]):
    """For the tk_matmul at k: (index of dg's reshape or None, dg, the region's indices, its two other inputs, its two
    outputs) where the product's output dg (or its one reshape) is read only by elementwise ops (_GATE_GRAD_OPS)
    which, with the elementwise ops that feed them alone, read two more tensors and make two tensors read elsewhere,
    all of dg's shape and dtype. Else None. What the region computes is checked by _gate_grad_roles."""
    b = bsyms[k]
    a, w = b.args[:2]
    out = b.output
    if not (isinstance(a, TensorProxy) and isinstance(w, TensorProxy) and isinstance(out, TensorProxy)
            and a.ndim == 2 and w.ndim == 2 and out.ndim == 2):
        return None
    dg, view, readers = out, None, users.get(out.name, [])
    if len(readers) == 1 and bsyms[readers[0]].sym.name in _RESHAPES:
        view = readers[0]
        dg = bsyms[view].output
        readers = users.get(dg.name, [])
    if (not isinstance(dg, TensorProxy) or not readers or dg.dtype not in HALF_DTYPES
            or dg.shape[-1] != out.shape[1] or any(bsyms[j].sym.name not in _GATE_GRAD_OPS for j in readers)):
        return None
    region, made = set(), {dg.name}
    for j in range(min(readers), len(bsyms)):  # what reads dg, and what reads that, elementwise
        if bsyms[j].sym.name in _GATE_GRAD_OPS and any(p.name in made for p in bsyms[j].flat_proxy_args):
            region.add(j)
            made.update(p.name for p in bsyms[j].flat_proxy_outs)
    grown = True
    while grown:  # the elementwise ops whose results only the region reads (e.g. silu(h1) recomputed)
        grown = False
        for j in sorted(region):
            for p in bsyms[j].flat_proxy_args:
                i = producer.get(p.name)
                if (p.name in made or i is None or bsyms[i].sym.name not in _GATE_GRAD_OPS
                        or not all(u in region for q in bsyms[i].flat_proxy_outs for u in users[q.name])):
                    continue
                region.add(i)
                made.update(q.name for q in bsyms[i].flat_proxy_outs)
                grown = True
    if not all(isinstance(bsyms[j].output, TensorProxy) for j in region):
        return None
    inputs = list({p.name: p for j in sorted(region) for p in bsyms[j].flat_proxy_args if p.name not in made}.values())
    outputs = [p for j in sorted(region) for p in bsyms[j].flat_proxy_outs
               if any(u not in region for u in users[p.name])]
    like_dg = all(isinstance(p, TensorProxy) and tuple(p.shape) == tuple(dg.shape) and p.dtype == dg.dtype
                  for p in inputs + outputs)
    if len(inputs) != 2 or len(outputs) != 2 or not like_dg or dg.shape[-1] % 8 or dg.shape[-1] > SWIGLU_GRAD_MAX_N:
        return None
    if any(producer.get(p.name, -1) > k for p in inputs):  # the launch replaces the product at k
        return None
    return view, dg, region, inputs, outputs


def _probe_op(name: str, args: list, kwargs: dict):
    """One of _GATE_GRAD_OPS on probe values, by its name: the same op whether the trace holds it as a prim, an ltorch
    symbol or the torch executor's (whose symbols cannot run outside a trace)."""
    if name in ("to", "convert_element_type"):
        dtype = first_torch_dtype(*args[1:], kwargs.get("dtype"))
        return args[0].to(dtype) if dtype is not None else args[0].clone()
    unary = {"clone": torch.clone, "neg": torch.neg, "exp": torch.exp, "reciprocal": torch.reciprocal,
             "sigmoid": torch.sigmoid, "silu": F.silu, "rsqrt": torch.rsqrt}
    if name in unary:
        return unary[name](args[0])
    a, b = args[0], args[1]
    if name == "pow":
        return a ** b
    if name in ("add", "sub"):
        alpha = kwargs.get("alpha", args[2] if len(args) > 2 else None)
        if alpha is not None and alpha != 1:
            b = b * alpha
        return a + b if name == "add" else a - b
    if name == "mul":
        return a * b
    if kwargs.get("rounding_mode", args[2] if len(args) > 2 else None) is not None:
        raise ValueError("a rounding division")
    return a / b  # div, true_divide


def _evaluate_region(bsyms: list[BoundSymbol], region: set[int], values: dict[str, torch.Tensor], outputs) -> list:
    """The region's outputs for the given input values, each op run on them by _probe_op."""
    env = dict(values)

    def value(x):
        return env[x.name] if isinstance(x, TensorProxy) else x

    for j in sorted(region):
        b = bsyms[j]
        result = _probe_op(b.sym.name, [value(x) for x in b.args], {k: value(v) for k, v in b.kwargs.items()})
        env[b.output.name] = result
    return [env[p.name] for p in outputs]


def _gate_grad_roles(bsyms: list[BoundSymbol], region: set[int], dg: TensorProxy, inputs, outputs):
    """(h1, h2, dh1, dh2) among the region's inputs and outputs such that, run on a probe (CPU, dg's dtype), the
    outputs are dg * h2 * silu'(h1) and dg * silu(h1); None if no assignment matches."""
    dtype = thunder.dtypes.to_torch_dtype(dg.dtype)
    gen = torch.Generator().manual_seed(0)
    shape = (1,) * (dg.ndim - 1) + (_PROBE_ELEMENTS,)
    grad, first, second = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
    first = (first.double() * _PROBE_H1_SCALE).to(dtype)
    g64, x, y = grad.double(), first.double(), second.double()
    s = torch.sigmoid(x)
    want = (g64 * y * s * (1 + x * (1 - s)), g64 * x * s)

    def close(got, ref):
        return bool(torch.isfinite(got).all()) and float((got.double() - ref).norm() / ref.norm()) < _PROBE_TOLERANCE

    for h1, h2 in (inputs, inputs[::-1]):
        try:
            got = _evaluate_region(bsyms, region, {dg.name: grad, h1.name: first, h2.name: second}, outputs)
        except Exception:  # an op the probe cannot run: leave the region to the fuser
            return None
        if any(not isinstance(t, torch.Tensor) or t.shape != shape for t in got):
            return None
        for d1, d2 in ((0, 1), (1, 0)):
            if close(got[d1], want[0]) and close(got[d2], want[1]):
                return h1, h2, outputs[d1], outputs[d2]
    return None


def fuse_swiglu_grad(trace):
    """The trace with SwiGLU's backward folded into the output projection's dX GEMM: where a tk_matmul's output dg
    is read only by the elementwise ops that make dh1 = dg * h2 * silu'(h1) and dh2 = dg * silu(h1) (found by their
    shape, confirmed by running them on a probe), one tk_matmul_swiglu_grad launch computes dh1 and dh2 from dg's
    accumulators: dg is neither written nor read back. Off with the feature name SWIGLU_GRAD, and where the build
    has no gemm_swiglu_grad kernel."""
    from thunder_tk import _extension, claim_rules
    from thunder_tk.lowering import tk_matmul, tk_matmul_swiglu_grad

    if SWIGLU_GRAD in claim_rules.disabled_names() or not _extension.kernel_in_build("gemm_swiglu_grad"):
        return trace
    bsyms = list(trace.bound_symbols)
    if not any(b.sym.name in _SILU for b in bsyms) or not any(b.sym.id == tk_matmul.id for b in bsyms):
        return trace
    producer, users = _producers_and_users(bsyms)
    plans, taken = [], set()
    for k, b in enumerate(bsyms):
        if b.sym.id != tk_matmul.id:
            continue
        found = _gate_grad_region(bsyms, k, producer, users)
        if found is None or found[2] & taken:
            continue
        view, dg, region, inputs, outputs = found
        roles = _gate_grad_roles(bsyms, region, dg, inputs, outputs)
        if roles is None:
            continue
        taken |= region
        plans.append((k, view, region, roles))
    if not plans:
        return trace
    from thunder_tk.executor import sites_of

    out = from_trace(trace)
    with tracectx(out):
        for k, view, region, (h1, h2, dh1, dh2) in plans:
            a, w = bsyms[k].args[:2]
            # The product's decision (its site) goes with its results, so that `explain` names the launch for it.
            dh1.tags.update(sites_of(bsyms[k].output))
            bsyms[k] = tk_matmul_swiglu_grad.bind(a, w, h1, h2, output=(dh1, dh2))
            if view is not None:
                bsyms[view] = None
            for j in region:
                bsyms[j] = None
    return _rewritten(out, bsyms, "tk: SwiGLU's backward in the output projection's dX GEMM")


GEMM_SUM = "gemm_sum"
"""THUNDER_TK_DISABLE name that keeps two tk_matmul whose results meet only in an add as two launches and the add
(the fuser's)."""


def _alpha_one(b: BoundSymbol) -> bool:
    """Whether add (or sub) bsym b has no alpha other than 1."""
    return b.kwargs.get("alpha", b.args[2] if len(b.args) > 2 else None) in (None, 1)


def _product_behind(p, j: int, bsyms: list[BoundSymbol], producer: dict[str, int], users: dict[str, list[int]],
                    kinds: frozenset | None = None):
    """(product index, reshape index or None) where tensor p, read by bsym j, is the result of a tk_matmul (or of
    the operators whose ids are `kinds`) or its one reshape, and nothing but j reads either; else None."""
    from thunder_tk.lowering import tk_matmul

    kinds = kinds or frozenset({tk_matmul.id})
    if not isinstance(p, TensorProxy) or users.get(p.name) != [j] or p.name not in producer:
        return None
    at = producer[p.name]
    if bsyms[at].sym.id in kinds:
        return at, None
    b = bsyms[at]
    if b.sym.name not in _RESHAPES or not isinstance(b.args[0], TensorProxy):
        return None
    inner = b.args[0]
    k = producer.get(inner.name)
    if k is None or bsyms[k].sym.id not in kinds or users.get(inner.name) != [at]:
        return None
    return k, at


def _sum_plan(bsyms: list[BoundSymbol], j: int, producer: dict[str, int], users: dict[str, list[int]], product,
              dtypes: tuple):
    """For bsym j: ((product, reshape or None) of each operand) where j is add(x, y) (alpha 1, no promotion or
    broadcast) of two results of the operator `product` of one shape and one of `dtypes`, each read only there
    (through one reshape each, or none)."""
    b = bsyms[j]
    if b.sym.name != "add" or len(b.args) < 2 or not isinstance(b.output, TensorProxy):
        return None
    x, y = b.args[:2]
    if not _alpha_one(b) or not isinstance(x, TensorProxy) or not isinstance(y, TensorProxy) or x.name == y.name:
        return None
    out = b.output
    if not (tuple(x.shape) == tuple(y.shape) == tuple(out.shape) and x.dtype == y.dtype == out.dtype):
        return None
    sides = [_product_behind(p, j, bsyms, producer, users, frozenset({product.id})) for p in (x, y)]
    if None in sides or (sides[0][1] is None) != (sides[1][1] is None):
        return None
    m1, m2 = (bsyms[k].output for k, _ in sides)
    if tuple(m1.shape) != tuple(m2.shape) or m1.dtype != m2.dtype or m1.dtype not in dtypes:
        return None
    return sides


def sum_products(trace):
    """The trace with each add of two tk_matmul results (of one shape, read nowhere else, each through one reshape
    or none) as one tk_matmul_sum launch: both products accumulate in the same fp32 tile and are rounded once, so
    neither is written or read back on its own (LLaMA's MLP input gradient, dh1 W1 + dh2 W2, whose sum the fuser
    read back from two GEMM outputs). Off with the feature name GEMM_SUM, and where the build has no gemm_sum
    kernel."""
    from thunder_tk.lowering import tk_matmul, tk_matmul_sum

    return _summed_pairs(trace, tk_matmul, tk_matmul_sum, HALF_DTYPES)


def _summed_pairs(trace, product, summed, dtypes: tuple):
    """sum_products for the operator `product` (results of `dtypes`), whose pairs become one `summed` launch."""
    from thunder_tk import _extension, claim_rules

    if GEMM_SUM in claim_rules.disabled_names() or not _extension.kernel_in_build("gemm_sum"):
        return trace
    bsyms = list(trace.bound_symbols)
    if sum(b.sym.id == product.id for b in bsyms) < 2:
        return trace
    producer, users = _producers_and_users(bsyms)
    plans = [(j, plan) for j in range(len(bsyms))
             if (plan := _sum_plan(bsyms, j, producer, users, product, dtypes)) is not None]
    if not plans:
        return trace
    from thunder_tk.executor import sites_of

    out = from_trace(trace)
    with tracectx(out):
        for j, ((k1, r1), (k2, r2)) in plans:
            early, late = sorted(((k1, r1), (k2, r2)))
            (a, b), (a2, b2) = bsyms[early[0]].args[:2], bsyms[late[0]].args[:2]
            total = bsyms[j].output if r1 is None else bsyms[late[0]].output
            # Both products' decisions (sites) go with the sum, so that `explain` names the launch for each.
            total.tags.update(sites_of(bsyms[early[0]].output) + sites_of(bsyms[late[0]].output))
            bsyms[late[0]] = summed.bind(a, b, a2, b2, output=total)
            bsyms[early[0]] = None
            if r1 is None:
                bsyms[j] = None
            else:  # the sum's reshape makes the add's result
                bsyms[j] = bsyms[late[1]].from_bsym_swap_proxies({variableify(bsyms[late[1]].output): bsyms[j].output})
                bsyms[early[1]] = bsyms[late[1]] = None
    return _rewritten(out, bsyms, "tk: two products met in an add summed in one GEMM launch")


GEMM_FP32_OUT = "gemm_fp32_out"
"""THUNDER_TK_DISABLE name that keeps bf16 products cast to fp32 as products rounded to bf16 and the fuser's casts."""
GEMM_FP32_OUT_ENV = env_settings.GEMM_FP32_OUT.name
"""1: widen_products runs (then GEMM_FP32_OUT turns it off per jitted function); 0 or unset: it does not. Off by
default: in the 16-layer Llama-3.2-1B step at bf16-mixed (H200, 04915fa, benchmarks/NOTES.md) it was no faster (66.0k
tokens/s against 65.7k without it, inside the rounds' spread: the fp32 epilogue costs the GEMMs about what the fuser's
casts it saves took) and held 0.49 GiB more at peak (the lm_head's weight gradient in fp32)."""


def _widening_wanted() -> bool:
    return env_settings.GEMM_FP32_OUT.read() == "1"


def _widen_cast_plan(bsyms: list[BoundSymbol], j: int, producer: dict[str, int], users: dict[str, list[int]]):
    """For bsym j: (product, reshape or None) where j casts a bf16 tk_matmul or tk_matmul_sum result (or its one
    reshape), read nowhere else, to fp32."""
    from thunder_tk.lowering import tk_matmul, tk_matmul_sum

    b = bsyms[j]
    if b.sym.name != "convert_element_type" or not isinstance(b.output, TensorProxy):
        return None
    x = b.args[0]
    if b.output.dtype != thunder.float32 or not isinstance(x, TensorProxy) or x.dtype != thunder.bfloat16:
        return None
    return _product_behind(x, j, bsyms, producer, users, frozenset({tk_matmul.id, tk_matmul_sum.id}))


def widen_products(trace):
    """The trace with bf16 products that are cast to fp32 written in fp32 by their launch (tk_matmul_fp32,
    tk_matmul_sum_fp32), rounded once from the accumulators instead of to bf16 and widened again by a pass of the
    fuser (bf16-mixed training: every weight gradient is a bf16 product cast to the fp32 parameter's dtype, and so is
    the input gradient of a linear that reads an fp32 activation; those casts took 1.8 ms of a 16-layer
    Llama-3.2-1B step). Where two widened products then meet in an fp32 add (autocast's backward of LLaMA's MLP:
    fc_1's and fc_2's input gradients), sum_products' rewrite makes them one tk_matmul_sum_fp32 launch.
    Runs after fold_rms_norm, which reads a 16-bit incoming gradient. Only where GEMM_FP32_OUT_ENV is 1 (off by
    default, see there); then off with the feature name GEMM_FP32_OUT, and where the build has no gemm_fp32 kernel."""
    from thunder_tk import _extension, claim_rules
    from thunder_tk.lowering import tk_matmul, tk_matmul_fp32, tk_matmul_sum, tk_matmul_sum_fp32

    if (not _widening_wanted() or GEMM_FP32_OUT in claim_rules.disabled_names()
            or not _extension.kernel_in_build("gemm_fp32")):
        return trace
    bsyms = list(trace.bound_symbols)
    if not any(b.sym.id in (tk_matmul.id, tk_matmul_sum.id) and b.output.dtype == thunder.bfloat16 for b in bsyms):
        return trace
    producer, users = _producers_and_users(bsyms)
    casts = [(j, plan) for j in range(len(bsyms)) if (plan := _widen_cast_plan(bsyms, j, producer, users)) is not None]
    if not casts:
        return trace
    from thunder_tk.executor import sites_of

    out = from_trace(trace)
    with tracectx(out):
        for j, (k, r) in casts:
            summed = bsyms[k].sym.id == tk_matmul_sum.id
            made, result = bsyms[k].output, bsyms[j].output
            # the cast's result itself, or a new fp32 product that the product's reshape then makes it from
            wide = result if r is None else TensorProxy(like=made, dtype=thunder.float32)
            wide.tags.update(sites_of(made))  # the product's decisions go with the launch, for `explain`
            launch = tk_matmul_sum_fp32 if summed else tk_matmul_fp32
            bsyms[k] = launch.bind(*bsyms[k].args[:4 if summed else 2], output=wide)
            if r is not None:
                bsyms[r] = bsyms[r].from_bsym_swap_proxies({variableify(made): wide,
                                                            variableify(bsyms[r].output): result})
            bsyms[j] = None
    widened = _rewritten(out, bsyms, "tk: bf16 products cast to fp32 written in fp32 by their launch")
    return _summed_pairs(widened, tk_matmul_fp32, tk_matmul_sum_fp32, (thunder.float32,))


QKV_GRAD = "attention_qkv_grad"
"""THUNDER_TK_DISABLE name that keeps the rotary embedding's backward and the concatenation of dq, dk and dv into the
qkv projection's gradient with the fuser, after tk's attention backward."""
QKV_GRAD_KERNEL = "attention_rope_grad"


@dataclass(frozen=True)
class Folded:
    """A tag on a tk op's result that a rewrite here gave more work: what the launch's row in `explain` adds."""

    description: str


@dataclass(frozen=True)
class Declined:
    """A tag on the first result of a tk op that a rewrite here left as it was: the rewrite's feature name and why,
    for `explain` (Thunder carries proxy tags over to renamed proxies, as it does tk's decision sites)."""

    feature: str
    why: str
    inputs: str = ""  # what the left-alone computation reads, as `explain` lists inputs (where its op does not say)


def _tag_declined(p: TensorProxy, feature: str, why: str, inputs: str = "") -> None:
    # A pass run again over the same proxies replaces its earlier reason.
    p.tags.difference_update([t for t in p.tags if isinstance(t, Declined) and t.feature == feature])
    p.tags.add(Declined(feature, why, inputs))


def _listed(names: list[str]) -> str:
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} and {names[-1]}"


# What the region from the attention backward's (dq, dk, dv) to the qkv projection's gradient may hold: layout ops,
# dtype conversions, the rotation's elementwise ops, the zero padding of its slices and the (trivial) group sum.
_QKV_REGION_OPS = frozenset({"convert_element_type", "to", "broadcast_in_dim", "slice_prim", "reshape", "transpose",
                             "shallow_copy", "clone", "squeeze", "unsqueeze", "full", "neg", "mul", "add", "sub",
                             "pad", "cat", "sum"})
# The probe's tolerance (relative, over the whole gradient): Thunder rounds each product and sum of the rotation to
# 16 bits (a few 1e-3 in all); a wrong angle, sign, column order or position is of order 1.
_QKV_PROBE_TOLERANCE = 3e-2


def _probe_region_op(b: BoundSymbol, args: list, device):
    """An op of _QKV_REGION_OPS on probe values, as the prim or the ltorch symbol of that name computes it (the
    elementwise ones by _probe_op). Raises on what it does not know."""
    name, prim = b.sym.name, b.sym.is_prim
    kw = b.kwargs
    if name == "broadcast_in_dim":
        a, shape, dims = args[0], tuple(args[1]), tuple(args[2])
        view = [1] * len(shape)
        for i, d in enumerate(dims):
            view[d] = a.shape[i]
        return a.reshape(view).expand(shape)
    if name == "slice_prim":
        a, start, end = args[0], args[1], args[2]
        steps = args[3] if len(args) > 3 and args[3] is not None else [1] * len(start)
        return a[tuple(slice(s, e, st) for s, e, st in zip(start, end, steps))]
    if name == "reshape":
        shape = args[1] if len(args) == 2 and not isinstance(args[1], int) else args[1:]
        return args[0].reshape(tuple(shape))
    if name == "transpose":
        return args[0].permute(tuple(args[1])) if prim else args[0].transpose(args[1], args[2])
    if name == "shallow_copy":
        return args[0]
    if name == "squeeze":
        return args[0].squeeze(tuple(args[1]))
    if name == "unsqueeze":
        return args[0].unsqueeze(args[1])
    if name == "full":
        dtype = torch_dtype_of(kw.get("dtype", args[3] if len(args) > 3 else None))
        return torch.full(tuple(args[0]), args[1], dtype=dtype, device=device)
    if name == "pad":
        a, value, config = args[0], args[1], args[2]
        if any(interior != 0 for _, _, interior in config):
            raise ValueError("interior padding")
        flat = [x for lo, hi, _ in reversed(config) for x in (lo, hi)]
        return F.pad(a, flat, value=value)
    if name == "cat":
        tensors = args[0]
        dim = args[1] if len(args) > 1 else kw.get("dim", 0)
        return torch.cat(tensors, dim)
    if name == "sum":
        dims = args[1] if len(args) > 1 else kw.get("dim")
        keepdim = bool(args[2] if len(args) > 2 else kw.get("keepdim", False))
        if not prim and kw.get("dtype") is not None:
            raise ValueError("a sum to another dtype")
        return args[0].sum(tuple(dims) if not isinstance(dims, int) else dims, keepdim=keepdim)
    return _probe_op(name, args, kw)


class _ProbeOpError(Exception):
    """An op of a probed region failed on the probe's values (the cause chained)."""

    def __init__(self, op: str):
        super().__init__(op)
        self.op = op


def _run_region(bsyms: list[BoundSymbol], evaluate: set[int], env: dict, keep: set[str], device) -> None:
    """Runs the ops `evaluate` (indices into bsyms, in trace order) on the probe values in env, adding their results
    (each output of a multi-output op such as split) to it. Intermediates not in `keep` go once read for the last
    time: a full-size probe holds a few region-sized tensors, not all of them."""
    order = sorted(evaluate)
    last_use = {p.name: pos for pos, j in enumerate(order) for p in bsyms[j].flat_proxy_args}
    for pos, j in enumerate(order):
        b = bsyms[j]
        args = [[env[y.name] if isinstance(y, TensorProxy) else y for y in a] if isinstance(a, (list, tuple))
                and any(isinstance(y, TensorProxy) for y in a) else env[a.name] if isinstance(a, TensorProxy)
                else a for a in b.args]
        try:
            if b.sym.name == "split":
                a, sizes = args[0], args[1]
                dim = args[2] if len(args) > 2 else b.kwargs.get("dim", 0)
                for p, part in zip(b.flat_proxy_outs, torch.split(a, sizes, dim), strict=True):
                    env[p.name] = part
            else:
                env[b.output.name] = _probe_region_op(b, args, device)
        except Exception as e:
            raise _ProbeOpError(b.sym.name) from e
        for p in b.flat_proxy_args:
            if last_use[p.name] == pos and p.name not in keep:
                env.pop(p.name, None)


def _probe_device(p: TensorProxy):
    """Where a probe of p's region runs: on p's device (a full-size probe is quick on the GPU, and CPU tensors are
    the tests' small ones), or on the CPU for a trace planned for a GPU this process cannot use (`thunder-tk
    explain` without one)."""
    device = thunder.devices.to_torch_device(p.device)
    if device.type == "cuda" and not (torch.cuda.is_available() and (device.index or 0) < torch.cuda.device_count()):
        device = torch.device("cpu")
    return device


def _walk_back(bsyms: list[BoundSymbol], start, ops: frozenset, producer: dict[str, int], visited: set[int]):
    """Follows the tensors `start` back through the bsyms of `ops` that make them, adding those bsyms' indices to
    `visited` (a bsym already there is not walked through again); returns the tensors reached that no such op
    makes, by name."""
    reached, todo = {}, list(start)
    while todo:
        p = todo.pop()
        j = producer.get(p.name)
        if j is not None and bsyms[j].sym.name in ops:
            if j not in visited:
                visited.add(j)
                todo.extend(bsyms[j].flat_proxy_args)
        elif isinstance(p, TensorProxy):
            reached[p.name] = p
    return reached


def _angle_roots(bsyms: list[BoundSymbol], region: set[int], inner: set[str], ops: frozenset, producer):
    """The region's inputs other than `inner`, followed back through `ops` to the tensors they come from: (those
    tensors by name, the ops on the way, added to the region's). The angles' tables, where a rope reads them (the
    zero tensors that pad the rotation's halves come from nothing)."""
    evaluate = set(region)
    start = [p for j in region for p in bsyms[j].flat_proxy_args if p.name not in inner]
    return _walk_back(bsyms, start, ops, producer, evaluate), evaluate


def _read_outside(bsyms: list[BoundSymbol], region: set[int], users: dict[str, list[int]], results: set[str]):
    """Why the region cannot go (one of its values, other than `results`, read by an op outside it), or None."""
    for j in sorted(region):
        reader = next((u for p in bsyms[j].flat_proxy_outs if p.name not in results for u in users[p.name]
                       if u not in region), None)
        if reader is not None:
            return f"the rope region's {bsyms[j].sym.name} is read outside it, by a {bsyms[reader].sym.name}"
    return None


def _angle_tables_problem(angles: list, besides: str, producer: dict[str, int], before: int, what: str):
    """Why the region's other inputs (`angles`, those read besides `besides`) are not two 2-D angle tables alike,
    made before bsym `before` (`what`), or None."""
    if len(angles) != 2:
        return f"the rope region reads {len(angles)} tensors besides {besides}, not two angle tables"
    if any(a.ndim != 2 or tuple(a.shape) != tuple(angles[0].shape) for a in angles):
        return (f"the rope region's other inputs, {list(angles[0].shape)} and {list(angles[1].shape)}, are not two "
                "2-D angle tables alike")
    if any(producer.get(a.name, -1) > before for a in angles):
        return f"an angle table is computed after {what}"
    return None


def _random_values(p: TensorProxy, gen: torch.Generator, device, *, angle: bool = False) -> torch.Tensor:
    """A probe's value for p, in p's dtype: of unit scale, or an angle table's cosines and sines in [-1, 1)."""
    shape = tuple(p.shape)
    values = (torch.rand(shape, generator=gen, device=device) * 2 - 1 if angle
              else torch.randn(shape, generator=gen, device=device))
    return values.to(thunder.dtypes.to_torch_dtype(p.dtype))


def _probe_sample(B: int, S: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Where a probe's result is checked: the first and last sequences and up to 64 of their positions (positions
    are independent), so that the float64 reference stays small whatever the shapes."""
    positions = torch.linspace(0, S - 1, min(S, 64), device=device).round().long().unique()
    return torch.tensor(sorted({0, B - 1}), device=device), positions


def _cosine_first(angles: list, got: tuple, want_of) -> tuple | float:
    """(cos, sin) among the two angle tables such that the region's results on the probe, `got`, match
    want_of(c, s) (the reference with table c as the cosine, s as the sine) within _QKV_PROBE_TOLERANCE, every one;
    else the smallest relative error found (inf: no reference of got's shapes)."""
    error = math.inf
    for c, s in ((0, 1), (1, 0)):
        want = want_of(c, s)
        if any(tuple(g.shape) != tuple(w.shape) for g, w in zip(got, want)):
            continue
        error = min(error, max(float((g.double() - w).norm() / w.norm().clamp_min(1e-30)) for g, w in zip(got, want)))
        if error < _QKV_PROBE_TOLERANCE:
            return angles[c], angles[s]
    return error


def _switched_off(feature: str, kernel: str) -> str | None:
    """Why a rewrite is off here (for `explain`): the switch that names `feature`, or a build without `kernel`."""
    from thunder_tk import _extension, claim_rules

    if (switch := claim_rules.feature_disabled_by(feature)) is not None:
        return f"turned off ({switch}={feature})"
    if not _extension.kernel_in_build(kernel):
        return f"{kernel} not in this build"
    return None


def _probe_error(e: Exception) -> str:
    """Why a probe could not run a rope region: the exception's type, and the op that raised it."""
    where = f" in its {e.op}" if isinstance(e, _ProbeOpError) else ""
    cause = e.__cause__ if isinstance(e, _ProbeOpError) else e
    return f"the probe cannot run the rope region ({type(cause).__name__}{where})"


def _probe_differs(error: float, rope: str) -> str:
    """Why a probe did not confirm a rope region: its smallest relative error against `rope` (inf: no result of
    the reference's shape)."""
    return (f"the rope region's result on the probe differs from {rope}"
            + (f" (relative error {error:.2g})" if error < math.inf else ""))


def _qkv_grad_region(bsyms: list[BoundSymbol], k: int, producer: dict[str, int], users: dict[str, list[int]]):
    """For the tk_attention_backward at k: (the region's indices, its output X, the two tensors the region's angles
    come from, the ops to evaluate it by) where dq, dk and dv are read only by ops of _QKV_REGION_OPS that make a
    (B, S, (Hq + 2 Hkv) D) tensor X, nothing outside reads the region but through X, and the kernel takes the
    angles' shape. Else why not (for `explain`). What the region computes is checked by _qkv_grad_confirmed."""
    from thunder_tk import ops

    b = bsyms[k]
    q, kk = b.args[0], b.args[1]
    grads = b.flat_proxy_outs
    if len(grads) != 3 or q.ndim != 4:
        return "not the gradients of (B, H, S, D) q, k and v"
    if q.shape[2] != kk.shape[2]:
        return f"the query and key lengths differ ({q.shape[2]} and {kk.shape[2]}): not one projection's q, k and v"
    B, Hq, S, D = q.shape
    width = (Hq + 2 * kk.shape[1]) * D
    made, closure = {p.name for p in grads}, set()
    for j in range(k + 1, len(bsyms)):  # what reads the gradients, and what reads that, through region ops
        if bsyms[j].sym.name in _QKV_REGION_OPS and any(p.name in made for p in bsyms[j].flat_proxy_args):
            closure.add(j)
            made.update(p.name for p in bsyms[j].flat_proxy_outs)
    x = next((bsyms[j].output for j in sorted(closure) if bsyms[j].sym.name == "cat"
              and isinstance(bsyms[j].output, TensorProxy) and tuple(bsyms[j].output.shape) == (B, S, width)
              and bsyms[j].output.dtype == q.dtype), None)
    if x is None:
        if not any(bsyms[j].sym.name == "cat" for j in closure):
            return ""  # nothing like a fused projection's gradient (separate q, k and v, say): no reason to give
        return f"no concatenation into a (B, S, (Hq + 2 Hkv) D) = ({B}, {S}, {width}) gradient"
    region, todo = set(), [producer[x.name]]  # what X is computed from, inside the closure
    while todo:
        j = todo.pop()
        if j in region:
            continue
        region.add(j)
        todo.extend(producer[p.name] for p in bsyms[j].flat_proxy_args if producer.get(p.name) in closure)
    read_outside = [n for n, g in zip(("dq", "dk", "dv"), grads) if any(u not in region for u in users[g.name])]
    if read_outside:
        return f"{_listed(read_outside)} {'is' if len(read_outside) == 1 else 'are'} read outside the rope region"
    if (why := _read_outside(bsyms, region, users, {x.name})) is not None:
        return why
    inner = {p.name for j in region for p in bsyms[j].flat_proxy_outs} | {g.name for g in grads}
    roots, evaluate = _angle_roots(bsyms, region, inner, _QKV_REGION_OPS, producer)
    angles = list(roots.values())
    if (why := _angle_tables_problem(angles, "the gradients", producer, k, "the attention backward")) is not None:
        return why
    why = ops.qkv_grad_unsupported(*map(TensorMetadata, (q, kk, *angles)))
    if why is not None:
        return why
    return region, x, angles, evaluate


def _qkv_grad_confirmed(bsyms: list[BoundSymbol], k: int, evaluate: set[int], x: TensorProxy, angles: list):
    """(cos, sin) among the two angle tables such that the region, run on random gradients and tables, gives
    ops.qkv_grad_reference (the rotate-half rope's backward over the tables' width, dq, dk, dv concatenated); else
    why not (for `explain`): neither order does, or the region holds an op the probe cannot run (or cannot
    allocate)."""
    from thunder_tk import ops

    q = bsyms[k].args[0]
    device = _probe_device(q)
    gen = torch.Generator(device).manual_seed(0)
    grads = bsyms[k].flat_proxy_outs
    try:
        env = {g.name: _random_values(g, gen, device) for g in grads}
        tables = [_random_values(a, gen, device, angle=True) for a in angles]
        env.update({a.name: t for a, t in zip(angles, tables)})
        _run_region(bsyms, evaluate, env, {p.name for p in (*grads, *angles, x)}, device)
        seqs, at = _probe_sample(x.shape[0], x.shape[1], device)
        got = env[x.name][seqs][:, at]
        if not bool(torch.isfinite(got).all()):
            return "the rope region's result on the probe is not finite"
        found = _cosine_first(angles, (got,), lambda c, s: (ops.qkv_grad_reference(
            *(env[g.name][seqs][:, :, at] for g in grads), tables[c][at], tables[s][at]),))
    except Exception as e:  # an op the probe cannot run, or no memory for it: leave the region to the fuser
        return _probe_error(e)
    return found if isinstance(found, tuple) else _probe_differs(found, "the rotate-half rope's backward")


def attention_backward_into_qkv(trace):
    """The trace with tk's attention backward writing the fused qkv projection's gradient itself: where dq, dk and
    dv are read only by ops that rotate dq and dk back through a rotate-half rotary embedding and concatenate them
    with dv into a (B, S, (Hq + 2 Hkv) D) tensor (found by shape, confirmed by running them on a probe), one
    tk_attention_backward_qkv computes that tensor (ops.attention_backward_qkv): dk and dv are stored into its
    columns by the backward kernel and the rotation runs in the pass that finalizes dq. Off with the feature name
    QKV_GRAD, and where the build has no attention_rope_grad kernel. A tk_attention_backward left as it is says why
    in a Declined tag on its dq, which `explain` shows."""
    from thunder_tk.lowering import tk_attention_backward, tk_attention_backward_qkv

    bsyms = list(trace.bound_symbols)
    backwards = [k for k, b in enumerate(bsyms) if b.sym.id == tk_attention_backward.id]
    if not backwards:
        return trace
    # The switches first: turned off, neither the search nor the probe runs (the way around a failure of either).
    off = _switched_off(QKV_GRAD, QKV_GRAD_KERNEL)
    producer, users = _producers_and_users(bsyms) if off is None else ({}, {})
    plans = []
    for k in backwards:
        found = off if off is not None else _qkv_grad_region(bsyms, k, producer, users)
        if not isinstance(found, str):
            region, x, angles, evaluate = found
            confirmed = _qkv_grad_confirmed(bsyms, k, evaluate, x, angles)
            if not isinstance(confirmed, str):
                plans.append((k, region, x, confirmed))
                continue
            found = confirmed
        if found:
            _tag_declined(bsyms[k].flat_proxy_outs[0], QKV_GRAD, found)
    if not plans:
        return trace
    from thunder_tk.executor import sites_of

    out = from_trace(trace)
    with tracectx(out):
        for k, region, x, (cos, sin) in plans:
            q, kk, v, o, lse, grad_o, *flags = bsyms[k].args  # is_causal, scale (and the window)
            x.tags.update(sites_of(bsyms[k].flat_proxy_outs[0]))  # explain names this launch for the attention
            bsyms[k] = tk_attention_backward_qkv.bind(q, kk, v, o, lse, grad_o, cos, sin, *flags, output=x)
            for j in region:
                bsyms[j] = None
    return _rewritten(out, bsyms, "tk: the attention backward into the qkv projection's gradient, rope included")


QKV_ROPE = "gemm_rope"
"""THUNDER_TK_DISABLE name that keeps the split of the fused qkv projection into heads and the rotary embedding of q
and k with the fuser (the projection's GEMM then writes its plain output)."""

# What the region from the qkv projection's output to the attention's q, k and v may hold: _QKV_REGION_OPS's layout,
# dtype and rotation ops, and the split into q's, k's and v's columns.
_ROPE_REGION_OPS = _QKV_REGION_OPS | frozenset({"split"})


def _rope_qkv_region(bsyms: list[BoundSymbol], k: int, producer: dict[str, int], users: dict[str, list[int]]):
    """For the tk attention at k whose q, k and v come, through ops of _ROPE_REGION_OPS, from the (B, S, (Hq + 2 Hkv) D)
    output X of one tk_linear: (X, plan), the plan (the projection's index, the region's indices, the ops to evaluate
    it by, the two tables the angles come from) where the projection has no bias and nothing else reads X or the
    region but through q, k and v, else why not (for `explain`). None where there is no such projection. What the
    region computes is checked by _rope_qkv_confirmed."""
    from thunder_tk.lowering import tk_linear

    q, kk, v = bsyms[k].args[:3]
    if any(not isinstance(t, TensorProxy) or t.ndim != 4 for t in (q, kk, v)):
        return None
    B, Hq, S, D = q.shape
    if tuple(kk.shape) != (B, kk.shape[1], S, D) or tuple(v.shape) != tuple(kk.shape):
        return None
    width = (Hq + 2 * kk.shape[1]) * D
    back = set()  # every region op q, k and v come from; the frontier: what they read besides
    frontier = _walk_back(bsyms, [q, kk, v], _ROPE_REGION_OPS, producer, back)
    projections = [p for p in frontier.values() if producer.get(p.name) is not None
                   and bsyms[producer[p.name]].sym.id == tk_linear.id and tuple(p.shape) == (B, S, width)
                   and p.dtype == q.dtype]
    if len(projections) != 1:
        return None
    x = projections[0]
    at = producer[x.name]
    if bsyms[at].args[2] is not None:
        return x, "the projection has a bias (the epilogue adds none)"
    region, made = set(), {x.name}  # the ops of `back` that compute on X's values
    for j in sorted(back):
        if any(p.name in made for p in bsyms[j].flat_proxy_args):
            region.add(j)
            made.update(p.name for p in bsyms[j].flat_proxy_outs)
    outputs = {q.name, kk.name, v.name}
    if not outputs <= made:
        return x, "q, k and v are not all made from the projection"
    reader = next((u for u in users[x.name] if u not in region), None)
    if reader is not None:
        return x, f"the projection's output is read outside the rope region, by a {bsyms[reader].sym.name}"
    if (why := _read_outside(bsyms, region, users, outputs)) is not None:
        return x, why
    roots, evaluate = _angle_roots(bsyms, region, made, _ROPE_REGION_OPS, producer)
    angles = list(roots.values())
    # Made before the projection: the launch that replaces it reads them.
    if (why := _angle_tables_problem(angles, "the projection's output", producer, at, "the projection")) is not None:
        return x, why
    return x, (at, region, evaluate, angles)


def _rope_qkv_confirmed(bsyms: list[BoundSymbol], at: int, k: int, evaluate: set[int], x: TensorProxy,
                        angles: list):
    """(cos, sin) among the two angle tables such that the region, run on a random projection output and tables,
    gives ops.linear_rope's q, k and v (qkv_head_views of X, q and k roped by rope_reference over the tables'
    width); else why not (for `explain`): the launch cannot take the shapes, the probe cannot run the region, or
    neither order gives the rope."""
    from thunder_tk import ops

    q, kk, v = bsyms[k].args[:3]
    Hq, Hkv, D = q.shape[1], kk.shape[1], q.shape[3]
    inputs, weight = bsyms[at].args[:2]
    why = ops.linear_rope_unsupported(*map(TensorMetadata, (inputs, weight, *angles)), Hq, Hkv, D)
    if why is not None:
        return why
    device = _probe_device(x)
    gen = torch.Generator(device).manual_seed(0)
    try:
        env = {x.name: _random_values(x, gen, device)}
        tables = [_random_values(a, gen, device, angle=True) for a in angles]
        env.update({a.name: t for a, t in zip(angles, tables)})
        _run_region(bsyms, evaluate, env, {p.name for p in (x, *angles, q, kk, v)}, device)
        seqs, pos = _probe_sample(x.shape[0], x.shape[1], device)
        got = [env[p.name][seqs][:, :, pos] for p in (q, kk, v)]
        if not all(bool(torch.isfinite(g).all()) for g in got):
            return "the rope region's result on the probe is not finite"
        heads = ops.qkv_head_views(env[x.name][seqs][:, pos].double(), Hq, Hkv, D)
        found = _cosine_first(angles, tuple(got), lambda c, s: (
            *(ops.rope_reference(h, tables[c][pos].double(), tables[s][pos].double()) for h in heads[:2]), heads[2]))
    except Exception as e:  # an op the probe cannot run, or no memory for it: leave the region to the fuser
        return _probe_error(e)
    return found if isinstance(found, tuple) else _probe_differs(found, "the rotate-half rope")


def rope_into_qkv_projection(trace):
    """The trace with the fused qkv projection writing q, k and v for tk's attention itself: where LitGPT splits a
    tk_linear's (B, S, (Hq + 2 Hkv) D) output into heads and ropes q and k (found by shape, confirmed by running
    the region's ops on a probe), one tk_linear_rope launch computes the projection with the rotation in its
    epilogue and returns q, k and v as views of its output (ops.linear_rope), which the attention reads in place:
    the fuser's pass over the projection's output (the split, the rotation, the copy of v) goes. Off with the feature
    name QKV_ROPE, and where the build has no gemm_rope kernel. A projection left as it is says why in a Declined
    tag on its output, which `explain` shows."""
    from thunder_tk.lowering import tk_attention, tk_attention_forward, tk_linear_rope

    bsyms = list(trace.bound_symbols)
    attentions = {tk_attention.id, tk_attention_forward.id}
    if not any(b.sym.id in attentions for b in bsyms):
        return trace
    off = _switched_off(QKV_ROPE, QKV_ROPE)
    producer, users = _producers_and_users(bsyms)
    plans, taken = [], set()
    for k, b in enumerate(bsyms):
        if b.sym.id not in attentions:
            continue
        found = _rope_qkv_region(bsyms, k, producer, users)
        if found is None:
            continue
        x, plan = found
        if off is None and not isinstance(plan, str) and plan[0] not in taken:
            at, region, evaluate, angles = plan
            confirmed = _rope_qkv_confirmed(bsyms, at, k, evaluate, x, angles)
            if not isinstance(confirmed, str):
                taken.add(at)
                plans.append((at, k, region, x, confirmed))
                continue
            plan = confirmed
        if off is not None or isinstance(plan, str):
            _tag_declined(x, QKV_ROPE, off or plan)
    if not plans:
        return trace
    from thunder_tk.executor import sites_of

    out = from_trace(trace)
    with tracectx(out):
        for at, k, region, x, (cos, sin) in plans:
            q, kk, v = bsyms[k].args[:3]
            inputs, weight = bsyms[at].args[:2]
            q.tags.update(sites_of(x))  # explain names this launch for the projection
            bsyms[at] = tk_linear_rope.bind(inputs, weight, cos, sin, q.shape[1], kk.shape[1], q.shape[3],
                                            output=(q, kk, v))
            for j in region:
                bsyms[j] = None
    return _rewritten(out, bsyms, "tk: the rotary embedding in the qkv projection's epilogue")
