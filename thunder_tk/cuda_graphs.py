"""CUDA graphs of a jitted step: Thunder's CUDAGraphTransform, fitted to the traces tk runs.

A deep model issues many short calls a step, and Thunder runs its trace in Python, one call at a time: with tk,
Gemma 3's 26 layers make about 1350 host calls a step, and the GPU waits for the host. Captured once and then
replayed, each stretch of the trace between collectives costs the host one call.

    jitted = thunder.jit(model, executors=[tk], transforms=[thunder_tk.CUDAGraphs()])

What this adds to Thunder's transform:
- one memory pool for all of the function's graphs on a device (forward, backward, and an inference trace),
  made at the first capture, so the transform can be built where no GPU is (plans, CPU runs);
- under FSDP, tk's collectives and their waits are captured with the compute around them (the channel's stream
  joins the capture, so the overlap is kept), and a gathered weight is a temporary of the graph as it was of the
  op-by-op step; other collectives (NCCL's) stay outside, their results copied into the graph's input buffers.
  A collective is captured only with its wait in the same graph. In a captured backward, reduce-scatters are waited
  for (oldest first) before their unwaited inputs pass THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB (default 1024): a capture
  holds a collective's input until its wait (fsdp_schedule.py);
- the backward's inputs saved by the forward's graph are found by name, not by their position in the trace;
- the backward's graph reuses the memory of the tensors the forward's graph saved for it once it has read them, as
  the op-by-op step does (the graphs' pool would otherwise hold every saved tensor and every temporary of the
  backward at once): where one backward graph alone reads them, a run of its region finds the last call touching each
  saved tensor's storage (views included) and the capture frees that storage there. Saved tensors the caller also
  gets back, storages a collective touches and a region's outputs are kept. A pool with memory freed this way takes
  no later capture (a new shape's graphs get a new pool). `CUDAGraphs(reuse_saved=False)` keeps them all;
- calls on tensors off the GPU stay outside the graphs (a capture would fix what they computed on the host).

Semantics (Thunder's): a graph's outputs are the same tensors at every replay, so a result kept from one step to the
next (the loss, say) is overwritten by the next step; copy it (`loss.detach().clone()`, or `.item()`) to keep it.
Parameters are read in place; other inputs are copied into the graph's own buffers. A parameter's `.grad` is the
backward graph's own buffer, with no copy: the graphs of a function share one memory pool, so before any of them
replays again (the next forward included), a `.grad` still kept (gradient accumulation, `zero_grad(set_to_none=False)`)
is moved to memory of its own. Gradients of other inputs are cloned by autograd as before; so are parameters' with
`CUDAGraphs(copy_gradients=True)`, which costs a gradient's memory and a copy per parameter a step. Gradients returned by
`torch.autograd.grad`, or references to a `.grad` kept elsewhere, are the graph's buffers until the next replay. A new
input shape, dtype or stride captures a new graph. Forward and backward must alternate (no two forwards before their
backwards).
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_leaves
from thunder.core import prims, vjp_utils
from thunder.core.pytree import tree_flatten
from thunder.core.symbol import Symbol
from thunder.core.proxies import FutureTensorProxy, ProxyTag, TensorProxy
from thunder.core.trace import TraceCtx, TraceTag
from thunder.executors import torchex
from thunder.transforms.cudagraph import CUDAGraphRunner, CUDAGraphTransform

from thunder_tk.executor import COLLECTIVE_IDS
from thunder_tk.fsdp_schedule import reduce_scatter_budget, reduce_scatter_waits_within
from thunder_tk.lowering import tk_all_gather, tk_reduce_scatter
from thunder_tk.trace_edits import with_bound_symbols

# tk's collectives: captured into a graph with their waits (their launches are capturable; see the module docstring).
# Every other distributed op runs outside the graphs (NCCL's queues and watchdog; FSDP's bucket bookkeeping): the
# distributed prims, and the torch executor's ops for them.
_TK_COLLECTIVES = frozenset({tk_all_gather.name, tk_reduce_scatter.name})
_TK_REDUCE_SCATTERS = frozenset({tk_reduce_scatter.name})
_WAIT = "torch_wait_prim_impl"
_TORCH_DISTRIBUTED = frozenset(info.symbol.name for pid, info in torchex.ex.implmap.items()
                               if pid in COLLECTIVE_IDS and getattr(info, "symbol", None) is not None)

GRAPH_PREFIX = "CUDAGraph"  # the name Thunder gives each graph's call in a trace: CUDAGraph1, CUDAGraph2, ...


def is_graph_call(bsym) -> bool:
    """Whether a trace's bound symbol replays a CUDA graph (of this transform or Thunder's)."""
    return bsym.sym.is_fusion and bsym.sym.name.startswith(GRAPH_PREFIX)


class _SharedPoolRunner(CUDAGraphRunner):
    """Thunder's runner with one graph memory pool and capture stream per device, made at the first capture;
    gradients handed to autograd without a copy; a failed capture reported with the region's calls."""

    def __init__(self):
        super().__init__(share_mem_pool=False)
        # Names of the backward's values that are a parameter's gradient (CUDAGraphs finds them in the traces).
        self.parameter_gradients: set[str] = set()
        # Every graph's parameter inputs, held weakly, and the jitted modules (weakly: their parameters are read when
        # needed). Strong references would keep parameters that a later transform replaces alive: FSDP swaps the
        # jitted module's for shards, and the unsharded originals were kept (2.79 GiB a GPU at Llama-3.2-1B's size).
        self.parameters: weakref.WeakValueDictionary[int, torch.nn.Parameter] = weakref.WeakValueDictionary()
        self.modules: list[weakref.ref] = []
        self._aliased: dict[str, tuple[int, ...]] = {}  # per graph: positions of its outputs handed out as aliases
        self._buffers: set[int] = set()  # storages of those outputs
        self._handed_out = False  # aliases handed out since the last replay
        self.with_collectives: set[str] = set()  # graphs that launch tk collectives
        # The backward's graph reuses the memory of tensors the forward's graph saved for it (_freeing_region).
        self.reuse_saved = True
        self.saved_only: dict[str, tuple[int, ...]] = {}  # forward graphs: outputs only saved for the backward
        self.sole_readers: set[str] = set()  # backward graphs that alone read the backward's saved tensors
        self._freeable: dict[int, torch.UntypedStorage] = {}  # by data pointer: captured saved-only outputs' storages
        self._closed: set[int] = set()  # devices whose pool had saved tensors freed in it: next capture, a new pool
        self._pools: list = []  # every pool made, for memory()
        self._building: str | None = None  # the graph being captured
        self.freed_saved_bytes = 0  # memory of saved tensors the backward's graphs reuse
        self._freed: set[int] = set()  # their data pointers

    def make_cuda_graph_callable_from_symbols(self, bsyms, inputs, outputs, static_inputs_mask=None):
        fn, fn_name = super().make_cuda_graph_callable_from_symbols(bsyms, inputs, outputs, static_inputs_mask)
        if any(b.sym.name in _TK_COLLECTIVES for b in bsyms):
            self.with_collectives.add(fn_name)
        return fn, fn_name

    def forget(self, names) -> None:
        """Drop graphs planned but not used (a plan redone); none of them was captured."""
        for name in names:
            self.python_callables.pop(name, None)
            self.trace_symbols.pop(name, None)
            self.with_collectives.discard(name)

    def call_cuda_graph(self, fn_name, *args):
        # Graphs captured into one pool reuse each other's free memory: a graph captured before the backward's
        # (the forward) may write its temporaries where the backward's outputs are. So a .grad still in a backward
        # buffer moves out before any replay, not only the backward's.
        if self._handed_out:
            self._move_kept_gradients()
        if fn_name in self.with_collectives:
            return self._call_with_collectives(fn_name, args)
        return self._call(fn_name, args)

    def _call_with_collectives(self, fn_name, args):
        # The channels order their launches across streams by events, which cannot reach into a graph: the replay
        # waits for their last launch outside it, and their next launch waits for the replay.
        from thunder_tk import collectives

        device = next((a.device for a in args if isinstance(a, torch.Tensor) and a.is_cuda), None)
        collectives.graph_replay(device)
        outputs = self._call(fn_name, args)
        collectives.graph_replay(device)
        return outputs

    def _call(self, fn_name, args):
        captured = len(self.cuda_graph_cache)
        self._building = fn_name
        try:
            outputs = super().call_cuda_graph(fn_name, *args)
        except RuntimeError as e:
            if "captur" not in str(e).lower():
                raise
            bsyms = self.trace_symbols.get(fn_name, ((),))[0]
            calls = sorted({str(b.sym.name) for b in bsyms} - {"python_del", "python_return"})
            raise RuntimeError(
                f"thunder_tk.CUDAGraphs: capturing {fn_name} failed ({str(e).splitlines()[0]}). A call in it waits "
                f"for the GPU or reads a result on the host, which a CUDA graph cannot hold; jit without "
                f"CUDAGraphs, or keep that call out of the step. Its calls: {', '.join(calls)}") from e
        if len(self.cuda_graph_cache) != captured:  # a new capture: note its parameters and gradient buffers
            static_inputs = list(self.cuda_graph_cache.values())[-1][1]  # the entry just captured (dicts keep order)
            self._note_saved_only(fn_name, (*args, *static_inputs), outputs)
            self.parameters.update((id(a), a) for a in args if isinstance(a, torch.nn.Parameter))
            names = [getattr(o, "name", None) for o in self.trace_symbols[fn_name][2]]
            self._aliased[fn_name] = tuple(i for i, (n, o) in enumerate(zip(names, outputs))
                                           if n in self.parameter_gradients and isinstance(o, torch.Tensor))
            self._buffers.update(_storage(outputs[i]) for i in self._aliased[fn_name])
        aliased = self._aliased.get(fn_name)
        if not aliased:
            return outputs
        # Autograd keeps a gradient that nothing else holds as the parameter's .grad, and clones one that something
        # does (the graph keeps its outputs): an alias hands it the graph's buffer without a copy or a second
        # gradient's memory.
        self._handed_out = True
        handed = list(outputs)
        for i in aliased:
            handed[i] = outputs[i].detach()
        return tuple(handed) if isinstance(outputs, tuple) else handed

    def current_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters whose .grad may be a graph's buffer: the jitted modules' present ones (after FSDP, the
        shards) and every graph's parameter inputs."""
        found = dict(self.parameters.items())
        for ref in self.modules:
            module = ref()
            if module is not None:
                found.update((id(p), p) for p in module.parameters())
        return list(found.values())

    def _move_kept_gradients(self) -> None:
        for p in self.current_parameters():
            g = p.grad
            if g is not None and _storage(g) in self._buffers:
                p.grad = g.clone()
        self._handed_out = False

    def memory(self) -> dict[str, int]:
        """Bytes the captured graphs hold (all devices): see CUDAGraphs.memory."""
        outputs, copies = {}, {}
        for key, (_graph, static_inputs, static_outputs) in self.cuda_graph_cache.items():
            for t in tree_leaves(static_outputs):
                if isinstance(t, torch.Tensor) and _storage(t) not in self._freed:
                    outputs[_storage(t)] = t.untyped_storage().nbytes()
            for t, static in zip(static_inputs, key[1]):
                if isinstance(t, torch.Tensor) and not static:
                    copies[_storage(t)] = t.untyped_storage().nbytes()
        pool = pool_allocated = 0
        if self._pools and torch.cuda.is_available():
            handles = {tuple(h) for h in self._pools}
            for segment in torch.cuda.memory_snapshot():
                if tuple(segment.get("segment_pool_id", ())) in handles:
                    pool += segment["total_size"]
                    pool_allocated += segment["allocated_size"]
        return {"pool": pool, "pool_allocated": pool_allocated, "outputs": sum(outputs.values()),
                "input_copies": sum(copies.values()), "saved_reused": self.freed_saved_bytes}

    def _note_saved_only(self, fn_name, inputs, outputs) -> None:
        """After a forward graph's capture: the storages of its outputs that are only saved for the backward (not
        shared with another output, an input or a buffer an input is copied into), which the backward's graph may
        reuse after their last read."""
        positions = self.saved_only.get(fn_name)
        if not positions or not self.reuse_saved:
            return
        flat = list(outputs) if isinstance(outputs, (tuple, list)) else [outputs]
        kept = {_storage(t) for i, t in enumerate(flat) if i not in positions and isinstance(t, torch.Tensor)}
        kept |= {_storage(a) for a in inputs if isinstance(a, torch.Tensor)}
        for i in positions:
            t = flat[i] if i < len(flat) else None
            if isinstance(t, torch.Tensor) and _storage(t) not in kept:
                self._freeable[_storage(t)] = t.untyped_storage()

    def _freeing_region(self, fn_name, fn, args):
        """The region to capture for a backward graph that alone reads the forward's saved tensors: it frees each
        saved-only storage the forward's graph allocated right after the last call that touches a tensor on it, so
        the capture's later allocations reuse that memory, as op by op. Which calls touch which storage (views
        included) is found by running the region once with a note after each call. A storage a collective touches,
        or that a region's output lives on, is kept. `fn` itself where there is nothing to free."""
        if not self.reuse_saved or fn_name not in self.sole_readers:
            return fn
        targets = {_storage(a): a.untyped_storage() for a in args
                   if isinstance(a, torch.Tensor) and _storage(a) in self._freeable}
        if not targets:
            return fn
        bsyms, inputs, outputs = self.trace_symbols[fn_name]
        calls = [b for b in bsyms if b.sym.id != prims.PrimIDs.RETURN]
        touched: list[set[int]] = [set() for _ in calls]

        def note(k, *tensors):
            touched[k].update(_storage(t) for t in tensors if isinstance(t, torch.Tensor))

        noted = []
        for k, b in enumerate(calls):
            noted.append(b)
            if b.sym.id != prims.PrimIDs.DEL:  # a deletion reads nothing (and its names are gone after it)
                noted.append(_NOTE.bind(k, *_tensors(b), output=None, _call_ctx={_NOTE.name: note}))
        results = self.make_python_callable_from_symbols(f"{fn_name}_noted", noted, inputs, outputs)(*args)
        keep = {_storage(t) for t in tree_leaves(results) if isinstance(t, torch.Tensor)}
        keep |= {p for k, b in enumerate(calls) if b.sym.name in _TK_COLLECTIVES for p in touched[k]}
        last: dict[int, int] = {}
        for k, ptrs in enumerate(touched):
            for p in ptrs:
                last[p] = k
        plan: dict[int, list] = {}  # call index (-1: before the first) -> storages to free after it
        for p, storage in targets.items():
            if p not in keep:
                plan.setdefault(last.get(p, -1), []).append(storage)
        if not plan:
            return fn

        def free(*storages):  # runs once, in the capture (a replay runs no Python)
            for storage in storages:
                first = self._freeable.pop(storage.data_ptr(), None) is not None
                if _free_storage(storage) and first:
                    self.freed_saved_bytes += storage.nbytes()
                    self._freed.add(storage.data_ptr())

        freeing = [_FREE.bind(*plan[-1], output=None, _call_ctx={_FREE.name: free})] if -1 in plan else []
        for k, b in enumerate(calls):
            freeing.append(b)
            if k in plan:
                freeing.append(_FREE.bind(*plan[k], output=None, _call_ctx={_FREE.name: free}))
        return self.make_python_callable_from_symbols(f"{fn_name}_freeing", freeing, inputs, outputs)

    def build_cuda_graph(self, fn, args, static_args_mask):
        capture_fn = self._freeing_region(self._building, fn, args)
        return self._capture(fn, capture_fn, args, static_args_mask)

    def _capture(self, fn, capture_fn, args, static_args_mask):
        """Warm `fn` up on the device's capture stream, then capture `capture_fn` (the same work) into the pool."""
        device = next(a.device.index for a in args if isinstance(a, torch.Tensor) and a.is_cuda)
        if self.mem_pool is None:
            count = torch.cuda.device_count()
            self.mem_pool = [torch.cuda.graph_pool_handle() for _ in range(count)]
            self._pools.extend(self.mem_pool)
            self.stream = [torch.cuda.Stream(device=i) for i in range(count)]
        if device in self._closed:
            # Its saved tensors' memory is free to the allocator but written by each forward's replay: a capture
            # into this pool could place its own tensors there.
            self.mem_pool[device] = torch.cuda.graph_pool_handle()
            self._pools.append(self.mem_pool[device])
            self._closed.discard(device)
        static_inputs = tuple(a if static or not isinstance(a, torch.Tensor) else torch.empty_like(a).copy_(a)
                              for a, static in zip(args, static_args_mask))
        stream = self.stream[device]
        torch.cuda.synchronize()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):  # the first runs allocate their workspaces (cuBLAS, inductor) outside
            for _ in range(3):
                fn(*static_inputs)
        stream.synchronize()
        torch.cuda.current_stream().wait_stream(stream)
        # The warm-up's temporaries are cached on the capture stream, whose blocks no later step allocates from (a
        # replay allocates nothing; the step's other ops run on the caller's stream): returned to the device, or they
        # would stay reserved beside the pool for good, and be reserved with it while the capture fills it.
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        freed = self.freed_saved_bytes
        with torch.cuda.graph(graph, stream=stream, pool=self.mem_pool[device]):
            static_outputs = capture_fn(*static_inputs)
        if self.freed_saved_bytes != freed:
            self._closed.add(device)
        return graph, static_inputs, static_outputs


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _free_storage(storage: torch.UntypedStorage) -> bool:
    """Return a storage's memory to the allocator while its tensors live on (they no longer own it): inside a
    capture, to the graphs' pool for the capture's later allocations. False (kept) where torch cannot: memory not
    from its caching allocator, or a torch without these (private) entry points."""
    cdata = storage._cdata
    if not (_CAN_FREE and torch._C._has_Standard_Deleter(cdata)):
        return False
    torch._C._free_And_Remove_DeleterFn(cdata)
    return True


_CAN_FREE = hasattr(torch._C, "_free_And_Remove_DeleterFn") and hasattr(torch._C, "_has_Standard_Deleter")


_NOTE = Symbol(name="tk_graph_note", meta=None)
_FREE = Symbol(name="tk_graph_free", meta=None)


def _tensors(bsym):
    return [p for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs) if isinstance(p, TensorProxy)]


def _on_cuda(t: TensorProxy) -> bool:
    return t.device.devicetype.name == "CUDA"


def _saved_for_backward_unpacked(trace: TraceCtx):
    """The backward trace's proxies of the tensors the forward saved, in the forward's order."""
    collections = next((b for b in trace.bound_symbols if b.sym.name == "unpack_sequence"
                        and getattr(b.args[0], "name", None) == "saved_for_backward"), None)
    if collections is None:
        return None
    tensors = collections.output[0]
    return next((b.output for b in trace.bound_symbols if b.sym.name == "unpack_sequence" and b.args[0] is tensors),
                None)


_UNPACKS = frozenset({prims.PrimIDs.UNPACK_TRIVIAL, prims.PrimIDs.UNPACK_SEQUENCE, prims.PrimIDs.UNPACK_KEY,
                      prims.PrimIDs.UNPACK_EMPTY_DICT})


def _unpacks_first(trace: TraceCtx) -> TraceCtx:
    """The trace with its unpacking of arguments moved to the top, in order. Graphs are cut at what they cannot hold,
    unpacking included: FSDP's schedule issues each parameter's all-gather just after its unpacking, which would cut
    every gather from its wait."""
    ready = {a.name for a in trace.args if hasattr(a, "name")}
    first, rest = [], []
    for b in trace.bound_symbols:
        if b.sym.id in _UNPACKS and all(p.name in ready for p in b.flat_proxy_args):
            first.append(b)
            ready.update(p.name for p in b.flat_proxy_outs)
        else:
            rest.append(b)
    if all(a is b for a, b in zip(trace.bound_symbols, first)):  # already at the top
        return trace
    return with_bound_symbols(trace, first + rest, "tk: arguments unpacked first, so that CUDA graphs are not cut there")


def _parameter_gradients(backward: TraceCtx, parameter_args: list[bool] | None) -> set[str]:
    """Names of the backward's returned values that are parameters' gradients alone: the backward returns the
    gradient of each forward argument at its position. A value also returned for an argument that is not a
    parameter (an input's .grad, which nothing moves) is left out; so is everything where the shapes disagree."""
    ret = backward.bound_symbols[-1] if backward.bound_symbols else None
    if parameter_args is None or ret is None or ret.sym.id != prims.PrimIDs.RETURN:
        return set()
    values = ret.args[0] if len(ret.args) == 1 and isinstance(ret.args[0], (tuple, list)) else ret.args
    if len(values) != len(parameter_args):
        return set()
    names = {v.name for v, is_parameter in zip(values, parameter_args) if is_parameter and isinstance(v, TensorProxy)}
    return names - {v.name for v, is_parameter in zip(values, parameter_args)
                    if not is_parameter and isinstance(v, TensorProxy)}


class CUDAGraphs(CUDAGraphTransform):
    """Thunder's CUDAGraphTransform for tk's traces (module docstring): pass it in `thunder.jit`'s `transforms`."""

    name = "cuda graphs"

    def __init__(self, *, copy_gradients: bool = False, reuse_saved: bool = True):
        super().__init__(share_mem_pool=False)
        self.cuda_graph_runner = _SharedPoolRunner()
        self.copy_gradients = copy_gradients
        self.cuda_graph_runner.reuse_saved = reuse_saved
        self.parameter_args: list[bool] | None = None  # per argument of the last forward: a parameter?
        self._tk_futures: set[str] = set()  # the trace being planned: futures of tk's collectives
        self._kept_out: set[str] = set()  # of those, the ones whose collective and wait must stay outside

    def can_fuse(self, bsym) -> bool:
        if bsym.sym.name in _TK_COLLECTIVES or bsym.sym.name == _WAIT:
            if not self._captured_collective(bsym):
                return False
        elif bsym.sym.id in COLLECTIVE_IDS or bsym.sym.name in _TORCH_DISTRIBUTED:
            return False
        if any(isinstance(p, FutureTensorProxy) and p.name in self._kept_out
               for p in (*bsym.flat_proxy_args, *bsym.flat_proxy_outs)):
            return False
        # A graph replays only the GPU's work: what a capture computed on the host would stay as it was then.
        if not all(_on_cuda(t) for t in _tensors(bsym)):
            return False
        return super().can_fuse(bsym)

    def _captured_collective(self, bsym) -> bool:
        """Whether a tk collective or a wait may go into a graph: a synchronous tk collective may; an asynchronous
        one and its wait together (can_fuse keeps out a pair a plan put apart). No other wait may."""
        if bsym.sym.name == _WAIT:
            future = bsym.flat_proxy_args[0] if bsym.flat_proxy_args else None
        else:
            future = bsym.flat_proxy_outs[0] if bsym.flat_proxy_outs else None
            if not isinstance(future, FutureTensorProxy):
                return True
        return isinstance(future, FutureTensorProxy) and future.name in self._tk_futures

    def transform_module(self, model) -> None:
        # The module's parameters, whose .grad may be a backward graph's buffer (also those no graph reads), are
        # read from it when needed: a later transform (FSDP) may replace them.
        self.cuda_graph_runner.modules.append(weakref.ref(model))

    def transform_trace_post_optimization(self, trace, **kwargs):
        if not any(_on_cuda(t) for b in trace.bound_symbols for t in _tensors(b)):
            return trace
        if TraceTag.AUGMENTED_FORWARD in trace.tags:
            # The backward returns one gradient per forward argument, in order; Thunder tags parameters' proxies.
            self.parameter_args = [isinstance(a, TensorProxy) and ProxyTag.STATIC_MEMORY_LOCATION in a.tags
                                   for a in trace.args]
        if trace.siginfo().name == "backward_fn":
            if not self.copy_gradients:
                self.cuda_graph_runner.parameter_gradients.update(_parameter_gradients(trace, self.parameter_args))
            self.parameter_args = None
            saved = _saved_for_backward_unpacked(trace)
            if self.outputs_from_forward is not None and saved is not None \
                    and len(saved) == len(self.outputs_from_forward):
                for is_static, p in zip(self.outputs_from_forward, saved):
                    if is_static and isinstance(p, TensorProxy):
                        p.tags.add(ProxyTag.STATIC_MEMORY_LOCATION)
            self.outputs_from_forward = None
        new_trace = self._fused_with_collectives(trace, **kwargs)
        if TraceTag.AUGMENTED_FORWARD in new_trace.tags:
            # The forward graph's outputs keep their memory from replay to replay: the backward reads them in place.
            from_graph = {o.name for b in new_trace.bound_symbols if is_graph_call(b) for o in b.flat_proxy_outs}
            self.outputs_from_forward = [o.name in from_graph or ProxyTag.STATIC_MEMORY_LOCATION in o.tags
                                         for o in vjp_utils.get_saved_for_backward_tensors(new_trace)]
            self._note_saved_only_outputs(new_trace)
        elif trace.siginfo().name == "backward_fn":
            self._note_sole_reader(new_trace)
        return new_trace

    def _note_saved_only_outputs(self, forward: TraceCtx) -> None:
        """Per forward graph: the positions of its outputs that the forward only saves for the backward (not
        returned to the caller, who may read them after the backward)."""
        runner = self.cuda_graph_runner
        saved = {p.name for p in vjp_utils.get_saved_for_backward_tensors(forward) if isinstance(p, TensorProxy)}
        saved -= {p.name for p in tree_flatten(forward.output[0])[0] if isinstance(p, TensorProxy)}
        for b in forward.bound_symbols:
            if is_graph_call(b) and b.sym.name in runner.trace_symbols:
                outs = runner.trace_symbols[b.sym.name][2]
                runner.saved_only[b.sym.name] = tuple(i for i, o in enumerate(outs)
                                                      if getattr(o, "name", None) in saved)

    def _note_sole_reader(self, backward: TraceCtx) -> None:
        """The backward graph that alone reads the forward's saved tensors, if one does: only there may their memory
        be reused after their last read (a read outside it, or in a second graph, comes after it or apart from it)."""
        saved = _saved_for_backward_unpacked(backward)
        if saved is None:
            return
        names = {p.name for p in saved if isinstance(p, TensorProxy)}
        readers = [b for b in backward.bound_symbols if b.sym.id != prims.PrimIDs.DEL
                   and any(getattr(p, "name", None) in names for p in b.flat_proxy_args)]
        if len(readers) == 1 and is_graph_call(readers[0]):
            self.cuda_graph_runner.sole_readers.add(readers[0].sym.name)

    def _fused_with_collectives(self, trace, **kwargs):
        """The trace's graphs, with each tk collective captured in the graph that also holds its wait. Where a
        plan puts the two in different graphs (or one outside), the pair stays out and the trace is planned again."""
        self._tk_futures = {b.flat_proxy_outs[0].name for b in trace.bound_symbols
                            if b.sym.name in _TK_COLLECTIVES and b.flat_proxy_outs
                            and isinstance(b.flat_proxy_outs[0], FutureTensorProxy)}
        self._kept_out = set()
        if self._tk_futures:
            trace = reduce_scatter_waits_within(_unpacks_first(trace), reduce_scatter_budget(),
                                                _TK_REDUCE_SCATTERS)
        runner = self.cuda_graph_runner
        while True:
            planned = set(runner.python_callables)
            fused = self.generate_fused_trace(trace, **kwargs)
            crossing = {p.name for b in fused.bound_symbols if is_graph_call(b)
                        for p in (*b.flat_proxy_args, *b.flat_proxy_outs) if isinstance(p, FutureTensorProxy)}
            if not crossing:
                return fused
            if crossing <= self._kept_out:  # cannot happen: whatever touches a kept-out future stays out
                raise RuntimeError(f"thunder_tk.CUDAGraphs: futures {sorted(crossing)} still cross a graph's edge")
            runner.forget(set(runner.python_callables) - planned)
            self._kept_out |= crossing

    def memory(self) -> dict[str, int]:
        """Bytes the captured graphs hold on the GPUs, for a memory budget that counts them:
        - `pool`: the graphs' memory pool, reserved for good. During a replay the graphs' temporaries live in its
          free part, which `torch.cuda.memory_allocated` (and so `max_memory_allocated`) does not count;
          `torch.cuda.memory_reserved` does;
        - `pool_allocated`: the part of it held by tensors (the graphs' outputs, among them the saved tensors the
          forward hands to the backward, and the gradients it hands out);
        - `outputs`: the graphs' outputs, kept from one replay to the next (but for `saved_reused`);
        - `saved_reused`: the saved tensors whose memory the backward's graph reuses after reading them;
        - `input_copies`: the buffers that inputs other than parameters and the forward's outputs are copied into."""
        return self.cuda_graph_runner.memory()

    @property
    def graphs_captured(self) -> int:
        """Graphs captured so far (one per region and input signature)."""
        return len(self.cuda_graph_runner.cuda_graph_cache)
