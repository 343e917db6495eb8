"""Counts over a trace's bound symbols that the FSDP-in-CUDA-graphs workers (CPU and GPU) check: where the
collectives ran, and how many waits a captured backward moved ahead of its last reduce-scatter."""

from thunder_tk.cuda_graphs import is_graph_call


def collectives_in(trace, names) -> tuple[int, int]:
    """Collectives named `names` inside the trace's graphs, and outside them."""
    inside = sum(s.sym.name in names for b in trace.bound_symbols if is_graph_call(b) for s in b.subsymbols)
    outside = sum(b.sym.name in names for b in trace.bound_symbols)
    return inside, outside


def waits_before_last(trace, reduce_scatter: str, wait: str = "torch_wait_prim_impl") -> int:
    """Waits inside the trace's graphs that come before its last `reduce_scatter` there."""
    names = [s.sym.name for b in trace.bound_symbols if is_graph_call(b) for s in b.subsymbols]
    last = max((i for i, n in enumerate(names) if n == reduce_scatter), default=0)
    return sum(n == wait for n in names[:last])
