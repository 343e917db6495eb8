"""LLaMA's RMSNorm on tk's kernels: a rewrite of the joint forward-backward trace, since the norm reaches Thunder
spelled out.

LitGPT's RMSNorm.forward is plain torch code (x.float(), the mean of squares, rsqrt, the weight), so Thunder's trace
holds some fifteen elementwise ops and a sum for it, and its autodiff some twenty more. The fuser ran them as one
kernel each way, and Inductor added a separate sum of the weight gradient's partial sums. In the joint trace that tk's
fusion pass sees, `fold_rms_norm` finds each norm by its structure:

    s = convert(add(convert(h, f32), convert(x, f32)), bf16)        (where there is one: the residual stream's add)
    X = convert(s, f32);  rstd = rsqrt(div(broadcast(sum(X * X, -1)), n) + eps)
    y = convert(X * broadcast(rstd) * broadcast(convert(w, f32)), bf16)

Its backward is every op that reads the forward's internal values (X, rstd, the scaled rows, the broadcast weight)
or what those ops make, up to the 16-bit gradient of s (dx) and the weight gradient summed over the rows (dw). Where
dx's one reader adds another path's gradient of s (the residual stream's), that add goes too, as do dtype round trips
of the result. A probe then runs the forward and backward ops on random values against ops.rms_norm_reference and
ops.rms_norm_backward_reference, so that a change in Thunder's decomposition cannot make this match something else.
Confirmed norms become tk_rms_norm (tk_add_rms_norm with the residual add) and tk_rms_norm_backward: the forward reads
h and x once and writes s, y and rstd; the backward reads dy, s and the residual's gradient once, writes dx, and sums
dw from its blocks' partial sums in a fixed order. Off with the feature name RMS_NORM.
"""

from __future__ import annotations

from dataclasses import dataclass

import thunder
import torch
from thunder.core.proxies import TensorProxy, variableify
from thunder.core.trace import from_trace, tracectx

from thunder_tk.pattern_fusion import (_alpha_one, _ProbeOpError, _probe_device, _producers_and_users, _rewritten,
                                       _run_region)

RMS_NORM = "rms_norm"
"""THUNDER_TK_DISABLE name that leaves RMSNorm's forward and backward to the fuser."""

_CONVERTS = frozenset({"convert_element_type", "to"})
# What Thunder's autodiff writes for the norm's backward, as prims and ltorch ops.
_GRAD_OPS = _CONVERTS | frozenset({"broadcast_in_dim", "shallow_copy", "mul", "add", "sub", "neg", "div",
                                   "true_divide", "pow", "sum", "rsqrt"})
# The probe's tolerance (relative, over each result): Thunder rounds the backward's dx to 16 bits before the residual's
# gradient is added (a few 1e-3); a wrong formula or role is of order 1.
_PROBE_TOLERANCE = 3e-2


@dataclass
class _Forward:
    ops: set[int]                 # the forward's bsyms, the residual add's included
    internal: set[str]            # values only the norm's forward and backward read
    s: TensorProxy                # the norm's input (16-bit)
    weight: TensorProxy
    eps: float
    rstd: TensorProxy
    y: TensorProxy
    residual: tuple | None        # (x, r) whose sum, rounded, is s, where that add folds in


@dataclass
class _Backward:
    ops: set[int]
    grad: TensorProxy             # dy, 16-bit like s
    residual_grad: TensorProxy | None
    dx: TensorProxy               # the gradient of s (the residual's added where it is)
    aliases: list[TensorProxy]    # dtype round trips of dx, read as dx
    dw: TensorProxy


def _number(x) -> float | None:
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def _made_by(p, names: frozenset, bsyms, producer) -> int | None:
    """The index of the bsym of `names` that makes tensor p, else None."""
    j = producer.get(p.name) if isinstance(p, TensorProxy) else None
    return j if j is not None and bsyms[j].sym.name in names else None


def _through_copies(p, bsyms, producer, ops: set[int]):
    """p followed back through shallow_copy ops (added to `ops`)."""
    while (j := _made_by(p, frozenset({"shallow_copy"}), bsyms, producer)) is not None:
        ops.add(j)
        p = bsyms[j].args[0]
    return p


def _only_user(p, names: frozenset, bsyms, users) -> int | None:
    """The one bsym of `names` reading p, else None."""
    readers = [u for u in users.get(p.name, []) if bsyms[u].sym.name in names]
    return readers[0] if len(readers) == 1 else None


def _other(b, p):
    """The argument of binary bsym b that is not tensor p (None if both are p or b is not binary)."""
    a, c = b.args[0], b.args[1]
    if isinstance(a, TensorProxy) and a.name == p.name:
        return c
    if isinstance(c, TensorProxy) and c.name == p.name:
        return a
    return None


def _match_forward(bsyms, k: int, producer, users) -> _Forward | None:
    """The norm whose rsqrt is bsym k, or None."""
    ops = {k}
    rstd = bsyms[k].output
    j = _made_by(bsyms[k].args[0], frozenset({"add"}), bsyms, producer)
    if j is None or not _alpha_one(bsyms[j]):
        return None
    ops.add(j)
    a, c = bsyms[j].args[:2]
    mean, eps = (a, _number(c)) if isinstance(a, TensorProxy) else (c, _number(a))
    if eps is None or not isinstance(mean, TensorProxy):
        return None
    j = _made_by(_through_copies(mean, bsyms, producer, ops), frozenset({"div", "true_divide"}), bsyms, producer)
    if j is None or _number(bsyms[j].args[1]) is None:
        return None
    ops.add(j)
    count = _number(bsyms[j].args[1])
    j = _made_by(bsyms[j].args[0], frozenset({"broadcast_in_dim"}), bsyms, producer)
    if j is None:
        return None
    ops.add(j)
    j = _made_by(bsyms[j].args[0], frozenset({"sum"}), bsyms, producer)
    if j is None:
        return None
    ops.add(j)
    summed, dims = bsyms[j].args[0], bsyms[j].args[1]
    j = _made_by(_through_copies(summed, bsyms, producer, ops), frozenset({"mul"}), bsyms, producer)
    if j is None or not all(isinstance(t, TensorProxy) for t in bsyms[j].args[:2]):
        return None
    ops.add(j)
    X, X2 = bsyms[j].args[:2]
    if X.name != X2.name or X.dtype != thunder.float32:
        return None
    j = _made_by(X, _CONVERTS, bsyms, producer)
    if j is not None and isinstance(bsyms[j].args[0], TensorProxy):
        ops.add(j)
        s = bsyms[j].args[0]
    else:  # an fp32 input (x.float() traces to nothing): matched so that explain can say why it stays
        s = X
    n = s.shape[-1] if s.ndim else 0
    if count != n or tuple(dims if not isinstance(dims, int) else (dims,)) not in ((s.ndim - 1,), (-1,)):
        return None
    shape = tuple(s.shape)
    # rstd -> broadcast -> X * rstd -> * broadcast weight -> 16 bits
    rb = next((u for u in users.get(rstd.name, []) if bsyms[u].sym.name == "broadcast_in_dim"
               and tuple(bsyms[u].output.shape) == shape), None)
    if rb is None:
        return None
    rows = bsyms[rb].output
    scaled = next((u for u in users.get(rows.name, []) if bsyms[u].sym.name == "mul"
                   and isinstance(other := _other(bsyms[u], rows), TensorProxy) and other.name == X.name), None)
    if scaled is None:
        return None
    ops |= {rb, scaled}
    xh = bsyms[scaled].output
    times_w = next((u for u in users.get(xh.name, []) if bsyms[u].sym.name == "mul"
                    and (wb := _other(bsyms[u], xh)) is not None and isinstance(wb, TensorProxy)
                    and _made_by(wb, frozenset({"broadcast_in_dim"}), bsyms, producer) is not None
                    and bsyms[producer[wb.name]].args[0].ndim == 1), None)
    if times_w is None:
        return None
    wb = _other(bsyms[times_w], xh)
    jb = producer[wb.name]
    ops |= {times_w, jb}
    w = bsyms[jb].args[0]
    if (jw := _made_by(w, _CONVERTS, bsyms, producer)) is not None and w.dtype == thunder.float32:
        ops.add(jw)
        w = bsyms[jw].args[0]
    if not isinstance(w, TensorProxy) or tuple(w.shape) != (n,):
        return None
    if s.dtype == thunder.float32:
        y = bsyms[times_w].output
    else:
        jy = _only_user(bsyms[times_w].output, _CONVERTS, bsyms, users)
        if jy is None or bsyms[jy].output.dtype != s.dtype or len(users.get(bsyms[times_w].output.name, [])) != 1:
            return None
        ops.add(jy)
        y = bsyms[jy].output
    internal = {p.name for i in ops for p in bsyms[i].flat_proxy_outs} - {y.name, s.name}
    residual = None
    if (js := _made_by(s, _CONVERTS, bsyms, producer)) is not None:
        total = bsyms[js].args[0]
        ja = _made_by(total, frozenset({"add"}), bsyms, producer)
        if ja is not None and _alpha_one(bsyms[ja]) and users.get(total.name) == [js]:
            halves = [(_made_by(t, _CONVERTS, bsyms, producer), t) for t in bsyms[ja].args[:2]]
            if all(i is not None and users.get(t.name) == [ja] and bsyms[i].args[0].dtype == s.dtype
                   and tuple(bsyms[i].args[0].shape) == shape for i, t in halves):
                ops |= {js, ja, *(i for i, _ in halves)}
                internal |= {total.name, *(t.name for _, t in halves)}
                residual = tuple(bsyms[i].args[0] for i, _ in halves)
    return _Forward(ops, internal, s, w, eps, rstd, y, residual)


def _match_backward(bsyms, fwd: _Forward, producer, users) -> _Backward | None:
    """The backward of the norm `fwd` (see the module's docstring), or None."""
    s, n = fwd.s, fwd.s.shape[-1]
    readers = [u for name in fwd.internal for u in users.get(name, []) if u not in fwd.ops]
    ops, made, dx, dw = set(), set(), None, None
    for j in range(min(readers), len(bsyms)):
        b = bsyms[j]
        if j in fwd.ops or not any(p.name in fwd.internal or p.name in made for p in b.flat_proxy_args):
            continue
        if b.sym.name not in _GRAD_OPS or not isinstance(b.output, TensorProxy):
            return None  # an internal value read by something else
        ops.add(j)
        out = b.output
        if b.sym.name in _CONVERTS and out.dtype == s.dtype and tuple(out.shape) == tuple(s.shape):
            if dx is not None:
                return None
            dx = out  # the gradient of s, in 16 bits: the end of the region on this side
        elif tuple(out.shape) == (n,) and out.dtype == fwd.weight.dtype:
            if dw is not None:
                return None
            dw = out
        else:
            made.add(out.name)
    if dx is None or dw is None:
        return None
    if any(u not in ops for name in made for u in users.get(name, [])):
        return None  # a backward value read outside the region
    residual_grad = None
    adds = [u for u in users.get(dx.name, []) if bsyms[u].sym.name == "add" and _alpha_one(bsyms[u])]
    if len(users.get(dx.name, [])) == 1 and adds:
        other = _other(bsyms[adds[0]], dx)
        total = bsyms[adds[0]].output
        if (isinstance(other, TensorProxy) and other.dtype == s.dtype and tuple(other.shape) == tuple(s.shape)
                and total.dtype == s.dtype and tuple(total.shape) == tuple(s.shape)):
            ops.add(adds[0])
            residual_grad, dx = other, total
    aliases = []
    for u in users.get(dx.name, []):  # convert(dx, f32) read only by conversions back: the same values
        wide = bsyms[u].output
        if not isinstance(wide, TensorProxy):
            continue
        back = users.get(wide.name, [])
        if (bsyms[u].sym.name in _CONVERTS and back and all(bsyms[v].sym.name in _CONVERTS and bsyms[v].output.dtype
                                                             == s.dtype for v in back)):
            ops |= {u, *back}
            aliases += [bsyms[v].output for v in back]
    externals = {p.name: p for j in ops for p in bsyms[j].flat_proxy_args
                 if p.name not in fwd.internal and p.name not in made and producer.get(p.name) not in ops
                 and (residual_grad is None or p.name != residual_grad.name)}
    for name, p in list(externals.items()):  # the incoming gradient's conversion to fp32, read only here
        j = _made_by(p, _CONVERTS, bsyms, producer)
        if j is not None and all(u in ops for u in users[name]) and isinstance(bsyms[j].args[0], TensorProxy):
            ops.add(j)
            del externals[name]
            externals[bsyms[j].args[0].name] = bsyms[j].args[0]
    if len(externals) != 1:
        return None
    (grad,) = externals.values()
    if grad.dtype != s.dtype or tuple(grad.shape) != tuple(s.shape):
        return None
    return _Backward(ops, grad, residual_grad, dx, aliases, dw)


def _relative(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want).norm() / want.norm().clamp_min(1e-30))


def _confirmed(bsyms, fwd: _Forward, bwd: _Backward | None) -> bool:
    """Runs the matched ops on random values (on s's device) against the float64 references."""
    from thunder_tk import ops

    device = _probe_device(fwd.s)
    gen = torch.Generator(device=device).manual_seed(0)

    def rand(p, scale=1.0, shift=0.0):
        return (torch.randn(tuple(p.shape), generator=gen, device=device) * scale + shift).to(
            thunder.dtypes.to_torch_dtype(p.dtype))

    env = {fwd.weight.name: rand(fwd.weight, 0.2, 1.0)}
    if fwd.residual is not None:
        env.update({fwd.residual[0].name: rand(fwd.residual[0]), fwd.residual[1].name: rand(fwd.residual[1])})
    else:
        env[fwd.s.name] = rand(fwd.s)
    keep = {fwd.s.name, fwd.y.name, fwd.rstd.name, fwd.weight.name}
    if bwd is not None:
        env[bwd.grad.name] = rand(bwd.grad)
        if bwd.residual_grad is not None:
            env[bwd.residual_grad.name] = rand(bwd.residual_grad)
        keep |= {bwd.dx.name, bwd.dw.name, *(a.name for a in bwd.aliases), bwd.grad.name,
                 *((bwd.residual_grad.name,) if bwd.residual_grad is not None else ())}
    try:
        _run_region(bsyms, fwd.ops | (bwd.ops if bwd is not None else set()), env, keep, device)
    except _ProbeOpError:
        return False
    s, w = env[fwd.s.name], env[fwd.weight.name]
    y, rstd, _ = ops.rms_norm_reference(s, w, fwd.eps)
    checks = [(fwd.y, y), (fwd.rstd, rstd)]
    if bwd is not None:
        dx, dw = ops.rms_norm_backward_reference(env[bwd.grad.name], s, rstd, w,
                                                 env[bwd.residual_grad.name] if bwd.residual_grad is not None else None)
        checks += [(bwd.dx, dx), (bwd.dw, dw), *((a, dx) for a in bwd.aliases)]
    return all(tuple(env[p.name].shape) == tuple(want.shape) and bool(torch.isfinite(env[p.name]).all())
               and _relative(env[p.name], want) < _PROBE_TOLERANCE for p, want in checks)


def _unusable(fwd: _Forward) -> str | None:
    """Why tk's kernels cannot run this norm here (the switch, the build, its tensors' device, shapes and dtypes)."""
    from thunder_tk import _extension, claim_rules, ops
    from thunder_tk.pattern_fusion import _switched_off

    if (why := _switched_off(RMS_NORM, "rms_norm")) is not None:
        return why
    if why := _extension.kernels_usable_reason():
        return why
    if not (verdict := claim_rules.check_devices([fwd.s, fwd.weight])):
        return verdict.reason
    return ops.rms_norm_unsupported(claim_rules.TensorMetadata(fwd.s), claim_rules.TensorMetadata(fwd.weight))


def _backward_at(bwd: _Backward, producer) -> int:
    """Where the backward launch goes: at its first op, or after its incoming gradients are made if later (the
    residual's comes from the next layer's backward, which may run after the norm's backward began)."""
    made = [producer.get(p.name, -1) for p in (bwd.grad, bwd.residual_grad) if p is not None]
    return max(min(bwd.ops), *made)


def _has_backward(fwd: _Forward, users) -> bool:
    return any(u not in fwd.ops for name in fwd.internal for u in users.get(name, []))


def _probe_key(bsyms, fwd: _Forward, bwd: _Backward | None):
    """The matched ops up to a renaming of their values, with their roots' metadata (fusion.region_key): a model's
    norms of one kind share it, so that one probe confirms them all (a probe of a large model's norm on a CPU, as
    `thunder-tk explain` plans it, takes seconds)."""
    from thunder_tk.fusion import region_key

    ops = sorted(fwd.ops | (bwd.ops if bwd is not None else set()))
    roots = [*(fwd.residual or (fwd.s,)), fwd.weight]
    results = [fwd.y, fwd.rstd, fwd.s]
    if bwd is not None:
        roots += [bwd.grad, *((bwd.residual_grad,) if bwd.residual_grad is not None else ())]
        results += [bwd.dx, bwd.dw, *bwd.aliases]
    return region_key([bsyms[j] for j in ops], roots, results), fwd.eps


def _plan(bsyms, fwd: _Forward, producer, users, taken: set[int], probed: dict):
    """(the norm's backward or None for a forward-only trace, None) where it folds, else (None, why). `probed`:
    the probes' verdicts by _probe_key."""
    if why := _unusable(fwd):
        return None, why
    bwd = None
    if _has_backward(fwd, users):
        bwd = _match_backward(bsyms, fwd, producer, users)
        if bwd is None:
            return None, ("its backward is not the one Thunder's autodiff writes for it (one of its values is read "
                          "by something else)")
        if bwd.ops & (taken | fwd.ops):
            return None, "its backward overlaps another rewrite's"
    # The forward launch goes where its last op was (its inputs are made by then): its results must not be read
    # before that, other than by the ops it replaces.
    results = [fwd.y, fwd.rstd, fwd.s]
    inside = fwd.ops | (bwd.ops if bwd is not None else set())
    if any(u <= max(fwd.ops) for p in results for u in users.get(p.name, []) if u not in inside):
        return None, "a result is read before the norm's last op"
    if bwd is not None:
        at = _backward_at(bwd, producer)
        results = [bwd.dx, bwd.dw, *bwd.aliases]
        if at <= max(fwd.ops) or any(u <= at for p in results for u in users.get(p.name, []) if u not in bwd.ops):
            return None, "a gradient is read before the backward's inputs are all made"
    key = _probe_key(bsyms, fwd, bwd)
    if key not in probed:
        probed[key] = _confirmed(bsyms, fwd, bwd)
    if not probed[key]:
        return None, "the probe's results differ from RMSNorm's (float64 reference)"
    return bwd, None


def fold_rms_norm(trace):
    """The trace with each RMSNorm (forward, and its backward where the trace has one) on tk's kernels; see the
    module's docstring. Off with the feature name RMS_NORM, and where the build has no rms_norm kernel. A norm
    found but left to the fuser carries why on its rstd (pattern_fusion.Declined), for `explain`."""
    from thunder_tk.lowering import tk_add_rms_norm, tk_rms_norm, tk_rms_norm_backward
    from thunder_tk.executor import describe_inputs
    from thunder_tk.pattern_fusion import _tag_declined

    bsyms = list(trace.bound_symbols)
    if not any(b.sym.name == "rsqrt" for b in bsyms):
        return trace
    producer, users = _producers_and_users(bsyms)
    plans, taken, probed = [], set(), {}
    for k, b in enumerate(bsyms):
        if b.sym.name != "rsqrt" or not isinstance(b.output, TensorProxy):
            continue
        fwd = _match_forward(bsyms, k, producer, users)
        if fwd is None or fwd.ops & taken:
            continue
        bwd, why = _plan(bsyms, fwd, producer, users, taken, probed)
        if why is not None:
            # the norm's own inputs (the residual add's where it would fold), not the rsqrt's
            read = (*fwd.residual, fwd.weight) if fwd.residual is not None else (fwd.s, fwd.weight)
            _tag_declined(fwd.rstd, RMS_NORM, why, describe_inputs(read, {}))
            continue
        taken |= fwd.ops | (bwd.ops if bwd is not None else set())
        plans.append((fwd, bwd))
    if not plans:
        return trace
    out = from_trace(trace)
    swap = {}
    with tracectx(out):
        for fwd, bwd in plans:
            if fwd.residual is not None:
                first = tk_add_rms_norm.bind(*fwd.residual, fwd.weight, fwd.eps, output=(fwd.y, fwd.rstd, fwd.s))
            else:
                first = tk_rms_norm.bind(fwd.s, fwd.weight, fwd.eps, output=(fwd.y, fwd.rstd))
            for j in fwd.ops:
                bsyms[j] = None
            bsyms[max(fwd.ops)] = first
            if bwd is None:
                continue
            at = _backward_at(bwd, producer)
            kept = bsyms[at] if at not in bwd.ops else None  # the incoming gradient's producer
            for j in bwd.ops:
                bsyms[j] = None
            launch = tk_rms_norm_backward.bind(bwd.grad, fwd.s, fwd.rstd, fwd.weight, bwd.residual_grad,
                                               output=(bwd.dx, bwd.dw))
            bsyms[at] = [*(kept if isinstance(kept, list) else [kept] if kept is not None else []), launch]
            swap.update({variableify(a): bwd.dx for a in bwd.aliases})
    if swap:
        def swapped(b):
            return b.from_bsym_swap_proxies(swap, skip_inputs=False, skip_output=True)

        bsyms = [[swapped(x) for x in b] if isinstance(b, list) else swapped(b) if b is not None else None
                 for b in bsyms]
    return _rewritten(out, bsyms, "tk: RMSNorm forward and backward on tk's kernels")
