"""Fusion regions compiled by inductor and called without dynamo (feature `direct_regions`).

Thunder's torch.compile executor hands each region to torch.compile, so every call of a region goes through
dynamo's frame evaluation and guards before inductor's code runs: tens of microseconds of host time a call, to check
what the trace already fixes (Thunder's prologue holds the inputs' shapes, dtypes and devices, and a region's inputs
follow from them). Here a region is traced to ATen ops (`make_fx` on fake tensors) at its first call and compiled by
inductor (`torch._inductor.compile`: AOTAutograd, then inductor's code), and each later call goes straight to that.

What dynamo's guards did that is left: strides. Thunder's cache does not tell apart inputs that differ only in
strides, and inductor's code is compiled for the strides it saw. Inductor checks its inputs' sizes and strides
itself (`size_asserts`) before running anything; a call that fails that check compiles a version for its strides,
and from then on each call picks its version by its inputs' strides. Where the first version was compiled with
`size_asserts` off, every call does.

Regions with an input or output that is not a tensor (a number the trace passes at run time) keep torch.compile,
whose guards see the number's value; so do regions of a fuser with a torch.compile `mode`. A region that this path
cannot trace or compile falls back to torch.compile, with a warning naming the error (`fallback_reason`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence

import torch
from thunder.core import prims
from thunder.core.codeutils import SigInfo
from thunder.core.proxies import Proxy, TensorProxy
from thunder.core.symbol import BoundSymbol
from thunder.core.trace import TraceCtx, tracectx
from thunder.executors.passes import transform_for_execution

DIRECT_REGIONS = "direct_regions"  # the feature's name for tk_disable / THUNDER_TK_DISABLE

_AUTOCAST_DEVICES = ("cpu", "cuda")


def can_call_directly(inputs: Sequence[Proxy], outputs: Sequence[Proxy]) -> bool:
    """Whether a region's values are all tensors (a number would be fixed into the compiled code)."""
    return all(isinstance(p, TensorProxy) for p in (*inputs, *outputs))


def region_function(bsyms: Sequence[BoundSymbol], inputs: Sequence[Proxy], outputs: Sequence[Proxy]) -> Callable:
    """The region as a Python function of torch calls (Thunder's torch executor), returning its outputs as a list:
    the function Thunder's make_compiled gives torch.compile."""
    from thunder.executors.torchex import ex as torch_executor

    trace = TraceCtx(None)
    trace.args, trace.kwargs = list(inputs), {}
    trace.names = {p.name for p in inputs}
    with tracectx(trace):
        for p in inputs:
            prims.unpack_trivial(p, name=p.name)
    trace.bound_symbols += list(bsyms)
    trace.bound_symbols.append(prims.python_return.bind(list(outputs), output=None))
    for b in trace.bound_symbols:
        if b.sym == prims.unpack_trivial:
            continue
        for o in (*b.flat_outs, *(o for s in b.subsymbols for o in s.flat_outs)):
            if o is not None and o.name not in trace.names:
                trace.add_name(o.name)
    trace._siginfo = SigInfo("region")
    trace._siginfo.args = [(p.name, None) for p in inputs]
    return transform_for_execution(trace, executors_list=(torch_executor,)).python_callable(include_decorators=False)


def _strides(args) -> tuple:
    return tuple(a.stride() if isinstance(a, torch.Tensor) else None for a in args)


class DirectRegion:
    """A region's function compiled by inductor at its first call, one version per input strides, called with grad
    and autocast off (as Thunder's regions are) and no dynamo in between."""

    def __init__(self, fn: Callable):
        self._fn = fn
        self._versions: dict[tuple, Callable] = {}
        self._first: Callable | None = None
        # Whether the first version's code checks its inputs' sizes and strides (size_asserts when it was compiled).
        self._first_checks_inputs = False
        self.compiled = 0  # versions compiled (for tests and reports)
        self.fallback_reason: str | None = None  # why the region runs through torch.compile instead, if it does

    def __call__(self, *args):
        grad = torch.is_grad_enabled()
        autocast = [torch.is_autocast_enabled(d) for d in _AUTOCAST_DEVICES]
        torch.set_grad_enabled(False)
        for d in _AUTOCAST_DEVICES:
            torch.set_autocast_enabled(d, False)
        try:
            return self._call(args)
        finally:
            torch.set_grad_enabled(grad)
            for d, on in zip(_AUTOCAST_DEVICES, autocast):
                torch.set_autocast_enabled(d, on)

    def _call(self, args):
        if self.fallback_reason is not None:
            return self._first(*args)
        if len(self._versions) == 1 and self._first_checks_inputs:
            try:
                return self._first(*args)
            except AssertionError:
                # Inductor's check of its inputs' sizes and strides, which runs before any of its kernels: these
                # strides need a version of their own. Anything else failing an assertion is raised as it was.
                if _strides(args) in self._versions:
                    raise
        return self._version(args)(*args)

    def _version(self, args) -> Callable:
        key = _strides(args)
        compiled = self._versions.get(key)
        if compiled is None:
            from torch._inductor import compile as inductor_compile, config
            from torch.fx.experimental.proxy_tensor import make_fx

            try:
                graph = make_fx(self._fn, tracing_mode="fake")(*args)
                compiled = inductor_compile(graph, list(args))
            except Exception as e:  # noqa: BLE001 - whatever this path cannot do, torch.compile may
                self.fallback_reason = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
                warnings.warn(f"thunder_tk: a fusion region runs through torch.compile, not called directly "
                              f"({self.fallback_reason})", stacklevel=2)
                self._first = torch.compile(self._fn, fullgraph=True)  # its guards cover every stride
                return self._first
            self._versions[key] = compiled
            self.compiled += 1
            if self._first is None:
                self._first, self._first_checks_inputs = compiled, bool(config.size_asserts)
        return compiled
