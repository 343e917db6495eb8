"""FSDP's collectives scheduled to overlap the compute, in tk's fusion pass (after the fuser's).

Thunder sorts the waits of its FSDP collectives before the fusion pass, and the fuser's regrouping undoes that
order: in the traces that run, every parameter's all-gather is issued at the top of the forward in parameter
order (the embedding, needed first, among the last), every wait comes before the first layer's compute, and each
gradient's division and reduce-scatter sit after the whole backward. On 4x H200 (8-layer Llama-2-7B) the compute
stream waited ~10 ms per micro-batch for the gathers and ~6 ms for the reduce-scatters, with no GEMM overlapping
any collective.

`overlap_collectives` re-sorts the fused joint trace (a topological order over its dataflow, so every consumer
still follows its producers and every rank, running the same trace, issues its collectives in the same order):
- a collective is issued as soon as its input exists; all-gathers in the order their parameters are first used;
- what feeds only collectives (a gradient's division before its reduce-scatter) runs as soon as it can;
- everything else keeps its order;
- a wait comes last, just before the first op that reads its result.
Under ZeRO-3 (parameters gathered again in the backward) an all-gather goes out only when nothing else can run,
just before its wait: memory before overlap.
`THUNDER_TK_DISABLE=collective_schedule` (or `tk_disable=`) keeps the fuser's order.

Where tk's collectives keep their tensors until their waits (THUNDER_TK_COLLECTIVE_KEEP=wait, the default, and
always inside a CUDA-graph capture), a reduce-scatter's input (an unsharded gradient) lives until its wait, and the
waits come at the backward's end: before a reduce-scatter that would take the inputs of those issued and not yet
waited for past THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB (default 1024), the oldest ones are waited for. A wait only
orders the compute stream after its collective, long done by then; the newer ones still overlap the compute.
"""

from __future__ import annotations

from thunder.core import prims
from thunder.core.proxies import FutureTensorProxy
from thunder.core.transforms import TOPOSORT_ORDER, bsym_list_to_dag, toposort_bsym_dag

from thunder_tk.trace_edits import with_bound_symbols

COLLECTIVE_SCHEDULE = "collective_schedule"
"""THUNDER_TK_DISABLE name that keeps the fuser's order of collectives and waits."""

_COLLECTIVES = {"torch_all_gather_prim_impl", "torch_reduce_scatter_prim_impl", "torch_all_reduce_prim_impl",
                "torch_broadcast_prim_impl", "tk_all_gather", "tk_reduce_scatter"}
_WAIT = "torch_wait_prim_impl"
# Selection classes, lowest first.
_ISSUE, _FEED, _OTHER, _WAITING, _REGATHER, _LAST = range(6)


REDUCE_SCATTER_BUDGET_ENV = "THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB"
REDUCE_SCATTER_BUDGET_MB = 1024
_TK_REDUCE_SCATTERS = frozenset({"tk_reduce_scatter"})


def reduce_scatter_budget() -> int:
    """Bytes of reduce-scatter inputs that may be issued and not yet waited for (the module's last paragraph)."""
    from thunder_tk.collectives import _env_number

    return int(_env_number(REDUCE_SCATTER_BUDGET_ENV, REDUCE_SCATTER_BUDGET_MB, float) * 2**20)


def reduce_scatter_waits_within(trace, budget: int, reduce_scatters=_TK_REDUCE_SCATTERS):
    """The trace with the waits of the reduce-scatters named moved up, so that the inputs of those issued and not
    yet waited for stay within `budget` bytes: before a reduce-scatter that would pass it, the oldest ones are
    waited for. Applying it twice changes nothing more."""
    bsyms = list(trace.bound_symbols)
    waits = {b.flat_proxy_args[0].name: b for b in bsyms
             if b.sym.name == _WAIT and b.flat_proxy_args and isinstance(b.flat_proxy_args[0], FutureTensorProxy)}
    out, pending, held, moved = [], [], 0, set()  # pending: (future's name, input bytes), oldest first
    for b in bsyms:
        if b.sym.name == _WAIT and b.flat_proxy_args and b.flat_proxy_args[0].name in moved:
            continue  # waited for earlier
        future = b.flat_proxy_outs[0] if b.sym.name in reduce_scatters and b.flat_proxy_outs else None
        if isinstance(future, FutureTensorProxy) and future.name in waits:
            a = b.flat_proxy_args[0]
            size = a.numel * a.dtype.bytes if isinstance(a.numel, int) else 0
            while pending and held + size > budget:
                name, s = pending.pop(0)
                held -= s
                out.append(waits[name])
                moved.add(name)
            pending.append((future.name, size))
            held += size
        elif b.sym.name == _WAIT and b.flat_proxy_args:
            for i, (name, s) in enumerate(pending):
                if name == b.flat_proxy_args[0].name:  # waited for where the trace waits
                    del pending[i]
                    held -= s
                    break
        out.append(b)
    if not moved:
        return trace
    return with_bound_symbols(trace, out, "tk: reduce-scatters waited for within THUNDER_TK_REDUCE_SCATTER_INFLIGHT_MB")


def overlap_collectives(trace):
    """The trace re-sorted as the module says (and its reduce-scatters waited for within the budget where the
    collectives keep their tensors until their waits), or the trace itself where it has no waits on collectives."""
    from thunder_tk import collectives

    scheduled = _overlapped(trace)
    if collectives.keeps_until_wait() and any(b.sym.name in _TK_REDUCE_SCATTERS for b in scheduled.bound_symbols):
        scheduled = reduce_scatter_waits_within(scheduled, reduce_scatter_budget())
    return scheduled


def _overlapped(trace):
    """The trace re-sorted as the module says, or the trace itself where it has no waits on collectives (or has
    deletions already: the sort needs the plain dataflow)."""
    from thunder_tk import claim_rules

    bsyms = list(trace.bound_symbols)
    if COLLECTIVE_SCHEDULE in claim_rules.disabled_names() or not any(b.sym.name == _WAIT for b in bsyms):
        return trace
    if any(b.sym.id == prims.python_del.id for b in bsyms):
        return trace
    roots, _ = bsym_list_to_dag(bsyms)
    nodes, seen, stack = [], set(), list(roots)
    while stack:  # every node, to classify them (children reach all of them from the roots)
        n = stack.pop()
        if id(n) in seen:
            continue
        seen.add(id(n))
        nodes.append(n)
        stack.extend(n.children)
    index = {id(b): i for i, b in enumerate(bsyms)}
    end = len(bsyms)

    def first_use(n) -> int:
        return min((index[id(c.bsym)] for c in n.children), default=end)

    # A parameter gathered twice (ZeRO-3: again in the backward) has its gathers issued only when nothing else can
    # run, just before their waits: issued as soon as they could be, the backward's gathers would all go out at
    # the backward's start, every layer's parameters unsharded at once, which ZeRO-3 exists to avoid.
    gathered = [n.bsym.flat_proxy_args[0].name for n in nodes
                if "all_gather" in n.bsym.sym.name and n.bsym.flat_proxy_args]
    regathers = len(gathered) != len(set(gathered))
    # (class, key) per node: keys order nodes within a class.
    rank: dict[int, tuple[int, int]] = {}
    for n in nodes:
        name, i = n.bsym.sym.name, index[id(n.bsym)]
        if n.bsym.sym.id == prims.python_return.id:
            rank[id(n)] = (_LAST, i)
        elif name == _WAIT:
            rank[id(n)] = (_WAITING, first_use(n))  # just in time for its first reader
        elif regathers and "all_gather" in name:
            rank[id(n)] = (_REGATHER, i)
        elif name in _COLLECTIVES:
            waits = [c for c in n.children if c.bsym.sym.name == _WAIT]
            rank[id(n)] = (_ISSUE, min((first_use(w) for w in waits), default=i))  # in the order of need
    # Ops whose every reader is a collective or such an op (a gradient's division, a bucket's packing, a
    # parameter's unpacking), found from the collectives up. They run as soon as they can, so the collective can be issued.
    feeds: set[int] = set()
    frontier = [n for n in nodes if n.bsym.sym.name in _COLLECTIVES]
    while frontier:
        n = frontier.pop()
        for p in n.parents:
            if id(p) in feeds or id(p) in rank:
                continue
            # (The return reads the sharded parameters too: that is no compute to wait for.)
            if all(id(c) in feeds or c.bsym.sym.name in _COLLECTIVES or c.bsym.sym.id == prims.python_return.id
                   for c in p.children):
                feeds.add(id(p))
                frontier.append(p)
    for n in nodes:
        if id(n) not in rank and id(n) not in feeds:
            rank[id(n)] = (_OTHER, index[id(n.bsym)])
    # A feeder goes in the order of the earliest collective it feeds (readers come later in the original order, so
    # walking it backwards settles every reader first): a parameter's unpacking in the order its gather is needed.
    for n in sorted((n for n in nodes if id(n) in feeds), key=lambda n: -index[id(n.bsym)]):
        rank[id(n)] = (_FEED, min(rank[id(c)][1] for c in n.children))

    def select(eligible) -> int:
        return min(range(len(eligible)), key=lambda k: rank[id(eligible[k])])

    ordered = toposort_bsym_dag(roots, TOPOSORT_ORDER.TOP_DOWN, selector=select)
    if len(ordered) != len(bsyms):  # a node the dataflow does not reach: leave the trace as it was
        return trace
    return with_bound_symbols(trace, ordered,
                              "tk: FSDP collectives issued in the order of need, waits just before their readers")
