"""Attention masks whose values the trace fixes: what tk's kernels can compute in their place.

LitGPT hands SDPA a mask for its sliding-window layers (Mistral, Mathstral, Phi-3/Phi-4-mini, Gemma-3), built inside
`forward` from constants: a (T, T) tensor of -inf with a row-by-row loop writing zeros over each query's window. Where
the window is at least the sequence (Phi-4-mini's 262145 keys, Mistral's 4096 at T <= 4096), that mask is the causal
mask; SDPA executors given any mask fall back to slower kernels or to Thunder's decomposition, which stores S^2
scores. Many models written for backends without `is_causal` build causal masks the same way (`torch.ones(T, T,
dtype=torch.bool).tril()`, or `arange` comparisons).

A mask made in the trace from constants alone has values known when tracing. `pattern_of` finds the ops that make it
(by name, in the trace being transformed), runs them on the CPU, and reads the result as one of the patterns the
kernels compute: every key kept, causal, or causal within a window of W keys (query i keeps keys i - W + 1 .. i).
Each proxy's answer is kept on it as a tag, so the checker, the lowering and `explain` read one answer; identical ops
(every layer's mask) are evaluated once.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field, replace

import thunder
import torch
from thunder.core.compile_data import _compile_data
from thunder.core.proxies import NumberProxy, Proxy, TensorProxy, pyval
from thunder.core.pytree import tree_map
from thunder.core.symbol import BoundSymbol

from thunder_tk.trace_edits import with_bound_symbols

# Largest mask evaluated (elements): 8192 x 8192 in a few hundred MB of transient CPU memory at most.
MAX_MASK_ELEMENTS = 1 << 26
# Ops evaluated before giving up (a T-row loop writes T of them; 32768 rows at most are above the size limit anyway).
MAX_MASK_OPS = 1 << 16
# A mask made by more traced ops than this is worth a word in `describe`: LitGPT's per-position loop, one write a
# position, is what made every such mask seen so far, and thunder.jit spends minutes tracing it at 2048 positions.
MANY_MASK_OPS = 64


@dataclass(frozen=True)
class MaskPattern:
    """What a mask keeps, in the kernels' terms."""

    causal: bool
    window: int | None = None  # causal only: keys a query sees, itself included (None: all keys up to itself)
    made_by: int = field(default=0, compare=False)  # how many traced ops made the mask (0: not from a trace)

    def describe(self) -> str:
        if not self.causal:
            read = "attn_mask keeps every key: run unmasked"
        elif self.window is None:
            read = "attn_mask read as causal"
        else:
            read = f"attn_mask read as causal within a window of {self.window} keys"
        if self.made_by > MANY_MASK_OPS:
            read += (f", from {self.made_by} traced ops (for a LitGPT model, thunder_tk.litgpt_models."
                     "vectorize_window_masks(model) makes the same mask in a few, and the jit takes seconds)")
        return read


@dataclass(frozen=True)
class _Answer:
    """A tag on a mask proxy: its pattern for an attention of q_len by kv_len, or why it has none."""

    q_len: int
    kv_len: int
    found: MaskPattern | str


def pattern_of(mask: TensorProxy, q_len: int, kv_len: int) -> MaskPattern | str:
    """The pattern of `mask` as SDPA's attn_mask for q_len queries and kv_len keys, or why it is none of them."""
    answer = next((t for t in mask.tags if isinstance(t, _Answer) and (t.q_len, t.kv_len) == (q_len, kv_len)), None)
    if answer is None:
        answer = _Answer(q_len, kv_len, _recognise(mask, q_len, kv_len))
        mask.tags.add(answer)
    return answer.found


# ------------------------------------------------------------------------------------------------
# Finding the ops that make the mask


_producer_maps: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _producers(trace) -> dict[str, BoundSymbol]:
    known = _producer_maps.get(trace)
    if known is None:
        known = {p.name: b for b in trace.bound_symbols for p in b.flat_proxy_outs}
        _producer_maps[trace] = known
    return known


def _traces_being_compiled() -> list:
    """The current compilation's traces, newest first (Thunder appends each stage's trace to them as it goes; the
    claim checks run on the newest)."""
    cd, cs = _compile_data.get()
    traces = getattr(cs, "last_traces", None) if cs is not None else None
    return list(reversed(traces)) if traces else []


def _is_input(b: BoundSymbol | None) -> bool:
    """Whether a producer is no op at all: the trace's unpacking of an argument, a closure or a module attribute."""
    return b is None or b.sym.name.startswith("unpack")


def _making_ops(mask: TensorProxy) -> list[BoundSymbol] | str:
    """The bsyms that compute `mask` from constants, in trace order, or why there are none."""
    unknown = "attn_mask is an input of the traced function, so its values are not known when tracing"
    trace = next((t for t in _traces_being_compiled() if mask.name in _producers(t)), None)
    if trace is None or _is_input(_producers(trace)[mask.name]):
        return unknown
    producer = _producers(trace)
    needed: dict[int, BoundSymbol] = {}
    stack = [mask]
    while stack:
        p = stack.pop()
        b = producer.get(p.name)
        if _is_input(b):
            return f"attn_mask is computed from {p.name}, an input of the traced function, so its values are not " \
                   "known when tracing"
        if id(b) in needed:
            continue
        if len(needed) >= MAX_MASK_OPS:
            return f"attn_mask is made by more than {MAX_MASK_OPS} ops"
        needed[id(b)] = b
        stack.extend(x for x in b.flat_proxy_args if isinstance(x, TensorProxy))
    order = {id(b): i for i, b in enumerate(trace.bound_symbols)}
    return sorted(needed.values(), key=lambda b: order[id(b)])


# ------------------------------------------------------------------------------------------------
# Running them on the CPU


def torch_dtype_of(d):
    """A torch dtype for a torch or Thunder dtype; None for anything else (the ops' other arguments)."""
    if isinstance(d, torch.dtype):
        return d
    if isinstance(d, thunder.dtypes.dtype):
        return thunder.dtypes.to_torch_dtype(d)
    return None


def first_torch_dtype(*values):
    """The first of `values` that is a torch or Thunder dtype, as a torch dtype; None if there is none."""
    return next((d for d in map(torch_dtype_of, values) if d is not None), None)


def _shape(args) -> tuple:
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        args = args[0]
    return tuple(int(x) for x in args)


class _CannotEvaluate(Exception):
    pass


def _refuse_above_limit(elements: int) -> None:
    if elements > MAX_MASK_ELEMENTS:
        raise _CannotEvaluate(f"attn_mask has {elements} elements, more than tk inspects ({MAX_MASK_ELEMENTS})")


def _check_size(t: torch.Tensor) -> torch.Tensor:
    _refuse_above_limit(t.numel())
    return t


def _full(shape, value, dtype):
    shape = _shape(shape if isinstance(shape, (tuple, list)) else (shape,))
    _refuse_above_limit(math.prod(shape))  # before allocating
    return torch.full(shape, value, dtype=dtype or torch.float32)


def _like(a, value, kw):
    return _full(tuple(a.shape), value, torch_dtype_of(kw.get("dtype")) or a.dtype)


def _key(key):
    """An index of ints, slices, None and Ellipsis (tensor indices are not evaluated)."""
    parts = key if isinstance(key, tuple) else (key,)
    if any(isinstance(k, torch.Tensor) for k in parts):
        raise _CannotEvaluate("attn_mask is indexed by a tensor")
    return key


def _binary(fn):
    return lambda a, b, **kw: fn(a, b * kw["alpha"] if kw.get("alpha") not in (None, 1) else b)


def _in_place(fn):
    def run(a, *args, **kw):
        result = fn(a, *args, **kw)
        a.copy_(result)
        return a
    return run


def _setitem(a, key, value):
    a = a.clone()
    a[_key(key)] = value
    return a


def _setitem_(a, key, value):
    a[_key(key)] = value  # in place: a row loop's T writes cost T * window, not T^3
    return a


_OPS = {
    "full": lambda shape, value, **kw: _full(shape, value, torch_dtype_of(kw.get("dtype"))),
    "zeros": lambda *shape, **kw: _full(shape, 0, torch_dtype_of(kw.get("dtype"))),
    "ones": lambda *shape, **kw: _full(shape, 1, torch_dtype_of(kw.get("dtype"))),
    "full_like": lambda a, value, **kw: _like(a, value, kw),
    "zeros_like": lambda a, **kw: _like(a, 0, kw),
    "ones_like": lambda a, **kw: _like(a, 1, kw),
    "arange": lambda start, end=None, step=1, **kw: torch.arange(
        *((start,) if end is None else (start, end, step)), dtype=torch_dtype_of(kw.get("dtype"))),
    "triu": lambda a, diagonal=0, **kw: torch.triu(a, diagonal),
    "tril": lambda a, diagonal=0, **kw: torch.tril(a, diagonal),
    "bool": lambda a: a.bool(),
    "float": lambda a: a.float(),
    "to": lambda a, *args, **kw: a.to(first_torch_dtype(*args, kw.get("dtype")) or a.dtype),
    "convert_element_type": lambda a, dtype: a.to(torch_dtype_of(dtype)),
    "type_as": lambda a, b: a.to(b.dtype),
    "masked_fill": lambda a, m, value: a.masked_fill(m, value),
    "where": lambda pred, a, b: torch.where(pred, a, b),
    "setitem": _setitem,
    "getitem": lambda a, key: a[_key(key)],
    "view": lambda a, *shape: a.reshape(_shape(shape)),
    "reshape": lambda a, *shape: a.reshape(_shape(shape)),
    "unsqueeze": lambda a, dim: a.unsqueeze(dim),
    "squeeze": lambda a, dim=None: a.squeeze() if dim is None else a.squeeze(dim),
    "expand": lambda a, *shape: a.expand(_shape(shape)),
    "contiguous": lambda a, **kw: a.contiguous(),
    "clone": lambda a, **kw: a.clone(),
    "add": _binary(torch.add),
    "sub": _binary(torch.sub),
    "mul": lambda a, b: a * b,
    "neg": torch.neg,
    "logical_not": torch.logical_not,
    "bitwise_not": torch.bitwise_not,
    "logical_and": torch.logical_and,
    "logical_or": torch.logical_or,
    "bitwise_and": torch.bitwise_and,
    "bitwise_or": torch.bitwise_or,
    "eq": torch.eq, "ne": torch.ne, "lt": torch.lt, "le": torch.le, "gt": torch.gt, "ge": torch.ge,
}
_IN_PLACE = {"setitem_": _setitem_, "masked_fill_": _in_place(_OPS["masked_fill"]), "add_": _in_place(_OPS["add"]),
             "sub_": _in_place(_OPS["sub"]), "mul_": _in_place(_OPS["mul"]), "triu_": _in_place(_OPS["triu"]),
             "tril_": _in_place(_OPS["tril"])}


def _evaluate(bsyms: list[BoundSymbol], mask: TensorProxy) -> torch.Tensor:
    env: dict[str, object] = {}

    def value(x):
        if isinstance(x, TensorProxy):
            return env[x.name]
        if isinstance(x, NumberProxy):
            return pyval(x)
        if isinstance(x, Proxy):
            raise _CannotEvaluate(f"attn_mask's ops read {type(x).__name__} {x.name}")
        return x

    for b in bsyms:
        name = b.sym.name
        args = tree_map(value, tuple(b.args))
        kwargs = {k: tree_map(value, v) for k, v in b.kwargs.items()}
        if name == "update_aliases":  # Thunder's marker for in-place updates: the same tensors under new names
            results = tuple(args[0])
        else:
            fn = _OPS.get(name) or _IN_PLACE.get(name)
            if fn is None:
                raise _CannotEvaluate(f"attn_mask is made by {name}, which tk does not evaluate")
            try:
                results = (_check_size(fn(*args, **kwargs)),)
            except _CannotEvaluate:
                raise
            except Exception as e:  # an op form the table does not cover
                raise _CannotEvaluate(f"attn_mask's {name} could not be evaluated ({type(e).__name__}: {e})") from e
        outs = b.flat_proxy_outs
        if len(outs) != len(results):
            raise _CannotEvaluate(f"attn_mask's {name} gave {len(results)} results for {len(outs)} outputs")
        for p, r in zip(outs, results):
            env[p.name] = r
    return env[mask.name]


_evaluated: dict[tuple, object] = {}  # the ops up to a renaming of proxies -> the mask's values (or the failure)
_EVALUATED_CAPACITY = 16


def _program_key(bsyms: list[BoundSymbol], mask: TensorProxy) -> tuple:
    """The ops and their arguments with proxies named by order of appearance: the same for every layer's mask."""
    names: dict[str, int] = {}

    def canonical(x):
        return f"%{names.setdefault(x.name, len(names))}" if isinstance(x, Proxy) else x

    ops = tuple(repr((b.sym.name, tree_map(canonical, b.args), tree_map(canonical, b.kwargs),
                      tree_map(canonical, b.output))) for b in bsyms)
    return ops, names.get(mask.name)


def _values(bsyms: list[BoundSymbol], mask: TensorProxy) -> torch.Tensor | str:
    key = _program_key(bsyms, mask)
    if key not in _evaluated:
        try:
            result: object = _evaluate(bsyms, mask)
        except _CannotEvaluate as e:
            result = str(e)
        if len(_evaluated) >= _EVALUATED_CAPACITY:
            _evaluated.pop(next(iter(_evaluated)))
        _evaluated[key] = result
    return _evaluated[key]


# ------------------------------------------------------------------------------------------------
# Reading the values as a pattern


def classify(values: torch.Tensor, q_len: int, kv_len: int) -> MaskPattern | str:
    """The pattern of an SDPA attn_mask with these values (bool: True keeps; float: added to the scores, 0 keeps
    and -inf, or the dtype's lowest value, drops), broadcast over batch and heads, or why it is none."""
    if not 1 <= values.ndim <= 4:
        return f"attn_mask is {values.ndim}-D"
    try:
        full = values.expand(*values.shape[:-2], q_len, kv_len)
    except RuntimeError:
        return f"attn_mask's shape {tuple(values.shape)} does not broadcast to {q_len} x {kv_len} scores"
    if values.dtype == torch.bool:
        kept = full
    elif values.dtype.is_floating_point:
        kept = full == 0
        dropped = (full == -math.inf) | (full <= torch.finfo(values.dtype).min)
        if not bool((kept | dropped).all()):
            return "attn_mask adds values other than 0 and -inf to the scores (a bias, not a mask)"
    else:
        return f"attn_mask has dtype {values.dtype}"
    rows = kept.reshape(-1, q_len, kv_len)
    first = rows[0]
    if rows.shape[0] > 1 and not bool((rows == first).all()):
        return "attn_mask differs between batch entries or heads"
    if bool(first.all()):
        return MaskPattern(causal=False)
    if q_len != kv_len:
        return f"attn_mask is not all-keep, and causal patterns need q_len == kv_len (got {q_len}, {kv_len})"
    window = int(first[-1].sum())
    i = torch.arange(q_len).unsqueeze(1)
    j = torch.arange(kv_len).unsqueeze(0)
    if window < 1 or not bool((first == ((j <= i) & (j > i - window))).all()):
        return "attn_mask keeps neither every key nor a causal window of keys"
    return MaskPattern(causal=True, window=None if window >= kv_len else window)


def _recognise(mask: TensorProxy, q_len: int, kv_len: int) -> MaskPattern | str:
    ops = _making_ops(mask)
    if isinstance(ops, str):
        return ops
    values = _values(ops, mask)
    if isinstance(values, str):
        return values
    found = classify(values, q_len, kv_len)
    return found if isinstance(found, str) else replace(found, made_by=len(ops))


# ------------------------------------------------------------------------------------------------
# The mask's ops, once nothing reads the mask


# Ops without tensor inputs whose result their arguments fix (no random numbers, no uninitialised memory).
_FACTORIES = frozenset({"full", "zeros", "ones", "arange", "iota"})
# Ops that are never part of a constant computation, whatever they read.
_NOT_CONSTANT = ("python_", "unpack", "get_grad", "put_grad")


def drop_unread_constants(trace):
    """The execution trace without the tensors it makes from constants alone and then never reads.

    Once tk runs an attention without its mask (`pattern_of`), the mask's ops are dead. Thunder's DCE keeps them:
    in-place writes (`masked_fill_`, LitGPT's row-by-row `setitem_`, `mask += bias`) become `copy_`, which it never
    removes, and the trace's split puts them in the backward, which would then build S x S masks every step for no
    reader. Here the ops that compute only from constants (factories, then anything reading only their results) are
    grouped by the tensors they share, an in-place write with what it writes into; a group none of whose tensors any
    other op reads or the trace returns is removed whole, so no write into a tensor something else reads is lost."""
    bsyms = trace.bound_symbols
    constant: list[int] = []
    made: set[str] = set()
    for i, b in enumerate(bsyms):
        tensors = [p.name for p in b.flat_proxy_args if isinstance(p, TensorProxy)]
        outs = [p.name for p in b.flat_proxy_outs]
        if not outs or b.sym.name.startswith(_NOT_CONSTANT):
            continue
        if all(t in made for t in tensors) if tensors else b.sym.name in _FACTORIES:
            constant.append(i)
            made.update(outs)
    if not constant:
        return trace

    group = {name: name for name in made}

    def root(name: str) -> str:
        while group[name] != name:
            group[name] = group[group[name]]
            name = group[name]
        return name

    for i in constant:
        b = bsyms[i]
        names = [p.name for p in b.flat_proxy_args if isinstance(p, TensorProxy)] + [p.name for p in b.flat_proxy_outs]
        for name in names[1:]:
            group[root(name)] = root(names[0])
    constants = set(constant)
    read = {p.name for i, b in enumerate(bsyms) if i not in constants for p in b.flat_proxy_args}
    live = {root(name) for name in read if name in group}
    dropped = {i for i in constant if root(bsyms[i].flat_proxy_outs[0].name) not in live}
    if not dropped:
        return trace
    return with_bound_symbols(trace, [b for i, b in enumerate(bsyms) if i not in dropped],
                              f"tk: unread constant tensors dropped ({len(dropped)} ops)")
