"""Checks over traces shared by tests and their workers: where the collectives ran and how many waits a captured
backward moved ahead of its last reduce-scatter (the FSDP-in-CUDA-graphs workers, CPU and GPU), and which traces
do not print as Python."""

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


def traces_not_python(traces) -> list[str]:
    """For each trace whose printed program is not Python: its provenance, the error and the program's start (a
    pass's provenance is the program's first line, so it must be a comment)."""
    bad = []
    for trace in traces:
        source = str(trace)
        try:
            compile(source, "trace", "exec")
        except SyntaxError as e:
            bad.append(f"{trace.get_provenance()!r}: {e}\n{source[:400]}")
    return bad
