"""A pass's new trace made from the old one: the same signature and context, other bound symbols, and a
provenance. Thunder prints a trace's provenance as its program's first line, so it must be a `TraceProvenance`
(printed as a comment): a bare string there makes the printed trace, and `python_callable()`, invalid Python."""

from thunder.core.trace import TraceCtx, TraceProvenance, from_trace


def provenance(what: str) -> TraceProvenance:
    """What made the trace, printed as `# Constructed by <what>`."""
    return TraceProvenance(what)


def with_bound_symbols(trace: TraceCtx, bound_symbols, what: str) -> TraceCtx:
    """A copy of `trace` running `bound_symbols`, made by `what`."""
    new = from_trace(trace)
    new.bound_symbols = list(bound_symbols)
    new.set_provenance(provenance(what))
    return new
