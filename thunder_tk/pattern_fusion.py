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
"""

from __future__ import annotations

from thunder.core.proxies import TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import from_trace, tracectx
from thunder.core.transform_common import dce

# View ops as the torch executor runs them (their result is the same data in another shape).
_RESHAPES = frozenset({"reshape", "torch_prims_reshape_impl", "view"})
_TRANSPOSES = frozenset({"permute", "transpose", "torch_prims_transpose_impl"})
_MATMULS = frozenset({"tk_matmul", "matmul"})


def _is_view_of(b: BoundSymbol, views: dict[str, bool]) -> bool:
    args = b.flat_proxy_args
    return (b.sym.name in _RESHAPES | _TRANSPOSES and bool(args) and args[0].name in views
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


def fold_row_scaling(trace):
    """The trace with each tk_scale_rows whose result only feeds GEMMs moved onto those GEMMs' small operands."""
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
                    bsyms[j] = [m.from_bsym(output=y), tk_scale_rows.bind(y, g, output=m.output)]
                else:
                    w_scaled = TensorProxy(like=w)
                    bsyms[j] = [tk_scale_rows.bind(w, g, output=w_scaled), m.from_bsym(args=(a, w_scaled))]
    flat = []
    for b in bsyms:
        if isinstance(b, list):
            flat.extend(b)
        elif b is not None:
            flat.append(b)
    out.bound_symbols = flat
    out.set_provenance("tk: the cross-entropy gradient's row scaling moved onto the lm_head's GEMMs")
    return dce(out)
