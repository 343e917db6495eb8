"""The torch.compile fuser behind `executors=[tk]` where nvFuser cannot load: Thunder's torch.compile executor,
except that structurally identical fusion regions share one compiled function.

A transformer's layers produce the same fusion regions over and over (the same ops on tensors of the same
shapes, with different proxy names). Thunder compiles every region on its own, so a 32-layer model pays dynamo
tracing and inductor for each of ~32 copies of each region: minutes before the first step of a 7B model. Here a
region is keyed by its program with the proxy names replaced by their order of appearance, plus its inputs'
metadata; regions with the same key call the same compiled function, which dynamo compiles once (its guards
then hold for every copy, since the inputs have the same shapes, dtypes and devices).

Inside each region, repeated expressions are merged before it is compiled, as nvFuser does inside its own regions
(Thunder runs that elimination only in nvFuser's fusion pass): an RMSNorm backward otherwise returns the same bf16
tensor twice, written to memory twice.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import replace
from itertools import filterfalse

from thunder.core import dtypes, prims
from thunder.core.compile_data import get_compile_data
from thunder.core.proxies import NumberProxy, Proxy, TensorProxy, Variable, unvariableify, variableify
from thunder.core.pytree import tree_map
from thunder.core.symbol import BoundSymbol, Symbol
from thunder.core.trace import TraceCtx
from thunder.core.transform_common import cse_single_bsym, dce, replace_redundant_inputs
from thunder.core.utils import consumers
from thunder.executors.passes import update_fusion_call_ctx
from thunder.executors.torch_compile import TorchCompileExecutor, make_compiled
from thunder.executors.utils import Region

from thunder_tk.direct_regions import DIRECT_REGIONS, DirectRegion, can_call_directly, region_function
from thunder_tk.trace_edits import provenance, with_bound_symbols

_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _proxies(bsyms: Sequence[BoundSymbol]):
    for b in bsyms:
        yield from b.flat_proxy_args
        yield from b.flat_proxy_outs
        yield from _proxies(b.subsymbols)


def _metadata(p: Proxy) -> tuple:
    if isinstance(p, TensorProxy):
        return ("tensor", tuple(p.shape), str(p.dtype), str(p.device), bool(p.requires_grad))
    if isinstance(p, NumberProxy):
        return ("number", p.python_type.__name__)
    return (type(p).__name__,)


def region_key(bsyms: Sequence[BoundSymbol], inputs: Sequence[Proxy], outputs: Sequence[Proxy]) -> Hashable:
    """The region's program up to a renaming of its proxies, and what its inputs look like."""
    names = {p.name for p in _proxies(bsyms)} | {p.name for p in inputs} | {p.name for p in outputs}
    canonical: dict[str, str] = {}

    def rename(m: re.Match) -> str:
        word = m.group(0)
        if word not in names:
            return word
        return canonical.setdefault(word, f"_{len(canonical)}")

    signature = " ".join(canonical.setdefault(p.name, f"_{len(canonical)}") for p in inputs)
    program = tuple(_IDENTIFIER.sub(rename, str(b)) for b in bsyms)
    returns = " ".join(canonical.get(p.name, "?") for p in outputs)
    return signature, program, returns, tuple(_metadata(p) for p in inputs)


def _unique(values) -> tuple:
    """The proxies in order, each once (an output merged into another would otherwise be returned twice)."""
    return tuple({variableify(x) if isinstance(x, Proxy) else id(x): x for x in values}.values())


def cse_within_regions(trace: TraceCtx, executor) -> TraceCtx:
    """Merges repeated expressions inside each of `executor`'s fusion regions of a fused trace. A region's output
    that repeats another value of the region is dropped, and the rest of the trace reads the value it repeats.
    Nothing is merged across regions or outside them: a cheap value recomputed in two regions stays recomputed
    rather than becoming a tensor in memory between them."""
    merged: dict[Variable, Proxy] = {}  # a region output dropped -> the value of that region that replaces it

    bsyms = []
    for bsym in trace.bound_symbols:
        ours = bsym.sym.is_fusion and bsym.sym.executor is executor
        if not ours:
            bsyms.append(bsym.from_bsym_swap_proxies(merged, skip_inputs=False, skip_output=True) if merged else bsym)
            continue
        # Rematerialization recomputes values inside several regions under one name, so a region sees the merges
        # of earlier regions only through its inputs, and hands on only the merges of its own outputs.
        local = {v: merged[v] for v in map(variableify, bsym.flat_proxy_args) if v in merged}
        seen: dict = {}  # expressions are merged only within the region
        inner = [cse_single_bsym(local, seen, sub) for sub in bsym.subsymbols]
        inner = replace_redundant_inputs(local, tuple(filterfalse(lambda b: b is None, inner)))

        def swap(x):
            return local.get(variableify(x), x) if isinstance(x, Proxy) else x

        outputs = {variableify(o) for o in bsym.flat_proxy_outs}
        merged.update({k: v for k, v in local.items() if k in outputs})
        bsyms.append(replace(bsym, args=_unique(tree_map(swap, tuple(bsym.args))), subsymbols=inner,
                             output=_unique(tree_map(swap, tuple(bsym.output)))))
    if not merged and all(len(a.subsymbols) == len(b.subsymbols) for a, b in zip(trace.bound_symbols, bsyms)):
        return trace
    what = "tk: repeated expressions merged inside torch.compile regions"
    new = update_fusion_call_ctx(dce(with_bound_symbols(trace, bsyms, what)))  # each region from its merged program
    new.set_provenance(provenance(what))
    return new


# The feature name (tk_disable / THUNDER_TK_DISABLE) that keeps regions computing nothing as compiled calls.
VIEW_CALLS = "view_calls"
# Ops that compute nothing (each output a view of an input, or its metadata): a region of these alone is a compiled
# call that does no arithmetic, and the same ops run as their own calls cost the host less.
VIEW_OPS = frozenset({"reshape", "transpose", "squeeze", "unsqueeze", "broadcast_in_dim", "slice_prim",
                      "shallow_copy", "split", "view", "expand", "permute"})

# dtype -> the dtypes that hold every one of its values: a cast there and back returns the input, bit for bit.
_EXACTLY_WIDER = {dtypes.bfloat16: (dtypes.float32, dtypes.float64), dtypes.float16: (dtypes.float32, dtypes.float64),
                  dtypes.float32: (dtypes.float64,)}


def _as_plain_calls(region: BoundSymbol, readers) -> list[BoundSymbol] | None:
    """The region's ops as plain calls where it computes nothing: views, and casts to a wider dtype and straight
    back, which return their input (a round trip of RMSNorm's weight gradient, bf16 -> fp32 -> bf16, in Gemma's
    backward), or None. A round trip is dropped only where the region alone reads its input: the result then is
    that tensor itself, with nothing else holding it."""
    subs = list(region.subsymbols)
    produced_by = {variableify(o): i for i, b in enumerate(subs) for o in b.flat_proxy_outs}
    outputs = {variableify(o) for o in region.flat_proxy_outs}
    dropped, plain = set(), {}
    for i, b in enumerate(subs):
        if b.sym.name != "convert_element_type":
            continue
        mid = b.args[0]
        j = produced_by.get(variableify(mid)) if isinstance(mid, TensorProxy) else None
        if j is None or subs[j].sym.name != "convert_element_type" or variableify(mid) in outputs:
            continue
        source = subs[j].args[0]
        if not isinstance(source, TensorProxy) or b.output.dtype != source.dtype \
                or mid.dtype not in _EXACTLY_WIDER.get(source.dtype, ()):
            continue
        if sum(variableify(mid) in {variableify(a) for a in s.flat_proxy_args} for s in subs) != 1:
            continue  # the wide value is read by another op of the region
        if [r for r in readers.get(source, ()) if r is not region] or variableify(source) in outputs:
            continue  # the input lives on beside the result: keep them two tensors
        dropped.add(j)
        plain[i] = prims.shallow_copy.bind(source, output=b.output)
    kept = [plain.get(i, b) for i, b in enumerate(subs) if i not in dropped]
    return kept if all(b.sym.name in VIEW_OPS for b in kept) else None


def unfuse_regions_computing_nothing(trace: TraceCtx, executor) -> TraceCtx:
    """`executor`'s regions that compute nothing (_as_plain_calls), replaced by their ops, which the always-executors
    (torch) then run one call each."""
    readers = consumers(trace)
    bsyms, changed = [], False
    for bsym in trace.bound_symbols:
        calls = (_as_plain_calls(bsym, readers) if bsym.sym.is_fusion and bsym.sym.executor is executor
                 and bsym.subsymbols else None)
        if calls is not None:
            bsyms.extend(calls)
            changed = True
        else:
            bsyms.append(bsym)
    if not changed:
        return trace
    return with_bound_symbols(trace, bsyms, "tk: regions that compute nothing run as their ops")


def _beside_tk(cd) -> bool:
    """Whether the jit being compiled (its compile data) lists tk: tk's fuser then does more than Thunder's."""
    return cd is not None and any(getattr(ex, "name", None) == "tk" for ex in cd.executors_list)


class SharingTorchCompileExecutor(TorchCompileExecutor):
    """TorchCompileExecutor whose identical regions (`region_key`) share one compiled function."""

    # Compiled functions kept for reuse, least recently used dropped first. Traces that use a function keep it
    # alive themselves; the cap only bounds what an ever-jitting process holds on to.
    CAPACITY = 4096

    def __init__(self, name: Hashable, required_ops: set | None = None, *, mode: str | None = None):
        super().__init__(name, required_ops, mode=mode)
        self._compiled: OrderedDict[Hashable, Callable] = OrderedDict()
        self.regions_fused = 0  # fusion regions built, shared or not
        self.functions_compiled = 0  # distinct compiled functions created
        self._prefix = re.sub(r"\W", "_", str(name)) + "_"

    def fusion_pass(self, trace):
        fused = cse_within_regions(super().fusion_pass(trace), self)
        # Named in an executor list beside tk (`thunder_tk.executors()`), this is the last fusion pass: regions that
        # compute nothing go back to plain calls, then tk's FSDP schedule. As the baseline's fuser (no tk in the list)
        # it leaves the fused trace as Thunder's torch.compile executor makes it.
        cd = get_compile_data()
        if _beside_tk(cd):
            from thunder_tk import claim_rules
            from thunder_tk.fsdp_schedule import overlap_collectives

            if VIEW_CALLS not in claim_rules.disabled_names():
                fused = unfuse_regions_computing_nothing(fused, self)
            fused = overlap_collectives(fused)
        return fused

    def _calls_directly(self, cd, inputs, outputs) -> bool:
        """Beside tk (as view_calls), a region is compiled without dynamo (direct_regions) where it can be; the
        baseline's fuser stays Thunder's torch.compile executor."""
        if self.mode is not None or not _beside_tk(cd) or not can_call_directly(inputs, outputs):
            return False
        from thunder_tk import claim_rules

        return DIRECT_REGIONS not in claim_rules.disabled_names()

    def fuse(self, region: Region, fusion_counter: int) -> BoundSymbol:
        inputs = [unvariableify(x) for x in region.inputs]
        outputs = [unvariableify(x) for x in region.outputs]
        # make_compiled reads this option of the current jit: regions compiled under another setting differ.
        cd = get_compile_data()
        fullgraph = cd.compile_options.get("torch_compile_fullgraph") if cd is not None else None
        direct = self._calls_directly(cd, inputs, outputs)
        key = (region_key(region.bound_symbols, inputs, outputs), fullgraph, direct)
        compiled = self._compiled.get(key)
        if compiled is None:
            # Both are lazy: tracing and inductor run at the first call, once per distinct key.
            compiled = DirectRegion(region_function(region.bound_symbols, inputs, outputs)) if direct \
                else make_compiled(region.bound_symbols, inputs, outputs, mode=self.mode)
            self._compiled[key] = compiled
            self.functions_compiled += 1
            if len(self._compiled) > self.CAPACITY:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(key)
        self.regions_fused += 1
        # Not Thunder's "TorchCompile<n>": every torch.compile fuser counts from 0, and a trace binds each name
        # to one function, so ours next to Thunder's cross-entropy fuser would call the wrong region.
        name = f"{self._prefix}{fusion_counter}"
        symbol = Symbol(name, meta=None, is_fusion=True, executor=self)
        return BoundSymbol(symbol, inputs, {}, outputs, region.bound_symbols, _call_ctx={name: compiled})
