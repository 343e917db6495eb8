"""Trace inspection: for every symbol tk could claim, who ran it and, where tk declined, why.

    report = thunder_tk.explain(jitted)   # after one call of `jitted`
    print(report)                        # a table
    report.rows                          # the same as data
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

import thunder
from thunder.core.symbol import BoundSymbol

from thunder_tk.cuda_graphs import is_graph_call
from thunder_tk.executor import Site, decisions_of, describe_inputs, latest_decisions_of, sites_of
from thunder_tk.lowering import MaskRead
from thunder_tk.pattern_fusion import QKV_GRAD, QKV_ROPE, SWIGLU, Declined, Folded
from thunder_tk.rms_norm_fusion import RMS_NORM


@dataclass(frozen=True)
class Row:
    trace: str  # "forward" or "backward": where the claimed symbol's result is computed
    symbol: str  # e.g. "ltorch.scaled_dot_product_attention"
    inputs: str
    claimed_by_tk: bool
    ran_by: str  # e.g. "tk: tk_attention_bwd_delta", "sdpa: sdpaex_grad_forward_...", "tk_torchcompile_0 (tk_torchcompile)"
    backward_ran_by: str  # for a symbol claimed with its gradient: the ops that ran its backward
    reason: str  # why tk declined; empty when tk claimed it
    detail: str = ""  # how tk's op differs from the traced symbol, e.g. attention reading unrepeated K/V heads


@dataclass
class Report:
    rows: list[Row]
    planned: bool = False  # True for a plan made without a GPU (thunder-tk explain)
    note: str = ""
    # The calls each run of the traces makes on the host, by trace and by who runs them (`calls_of`): every one is a
    # Python call, so a long model of small kernels can be paced by the host rather than by the GPU.
    calls: dict[str, dict[str, int]] = field(default_factory=dict)

    @property
    def claimed(self) -> list[Row]:
        return [r for r in self.rows if r.claimed_by_tk]

    @property
    def declined(self) -> list[Row]:
        return [r for r in self.rows if not r.claimed_by_tk]

    def to_dict(self) -> dict:
        return {"planned": self.planned, "note": self.note, "rows": [asdict(r) for r in self.rows],
                "calls": self.calls}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        header = ("trace", "symbol", "inputs", "tk", "ran by", "why tk declined")
        body = [
            (
                r.trace,
                r.symbol,
                r.inputs,
                "claimed" if r.claimed_by_tk else "declined",
                r.ran_by + (f"; backward: {r.backward_ran_by}" if r.backward_ran_by else "")
                + (f" ({r.detail})" if r.detail else ""),
                r.reason,
            )
            for r in self.rows
        ]
        widths = [max(len(str(x)) for x in col) for col in zip(header, *body)] if body else [len(h) for h in header]
        line = lambda cells: "  ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()
        out = [line(header), line(["-" * w for w in widths]), *(line(b) for b in body)]
        n = len(self.rows)
        out.append(f"{len(self.claimed)} of {n} claimable symbol{'s' if n != 1 else ''} run on tk kernels.")
        if not self.rows:
            out.append("No symbol that tk can claim appears in these traces.")
        for label, by in self.calls.items():
            parts = ", ".join(f"{who} {n}" for who, n in by.items())
            total = sum(by.values())
            out.append(f"{label}: {total} call{'s' if total != 1 else ''} a step on the host ({parts})")
        if self.note:
            out.append(self.note)
        return "\n".join(out)


# Trace bookkeeping that is not a call into an executor: deletions, unpacking, the return.
_BOOKKEEPING = frozenset({"python_del", "python_return", "unpack_trivial", "unpack_sequence", "unpack_key",
                          "unpack_attr", "clear_mutable_collection", "comment"})


def calls_of(trace) -> dict[str, int]:
    """A trace's top-level calls by who makes them: tk's ops, fusion regions (each one call of the fuser's compiled
    function), and every other executor by name, most first; bookkeeping left out."""
    by: dict[str, int] = {}
    for bsym in trace.bound_symbols:
        if bsym.sym.name in _BOOKKEEPING:
            continue
        ex = bsym.sym.executor
        who = ("CUDA graphs" if is_graph_call(bsym) else "fusion regions" if bsym.sym.is_fusion
               else (ex.name if ex is not None else "python"))
        by[who] = by.get(who, 0) + 1
    return dict(sorted(by.items(), key=lambda kv: -kv[1]))


def _calls(trace):
    """The trace's top-level calls, those a CUDA graph replays in its place (cuda_graphs) included."""
    for b in trace.bound_symbols:
        if is_graph_call(b):
            yield from (s for s in b.subsymbols if s.sym.name not in _BOOKKEEPING)
        else:
            yield b


def _runner(bsym: BoundSymbol) -> str:
    ex = bsym.sym.executor
    if bsym.sym.is_fusion:
        return f"{bsym.sym.name} ({ex.name if ex is not None else 'fusion'})"
    return f"{ex.name if ex is not None else 'python'}: {bsym.sym.name}"


def _walk(bsyms):
    for b in bsyms:
        yield b
        yield from _walk(b.subsymbols)


def _producers(trace, label: str, into: dict[Site, list[tuple[str, str]]], ops: dict[Site, BoundSymbol],
               declined: dict[Site, dict[str, str]]) -> None:
    """Map each site whose result this trace computes to [(trace label, what computes it), ...], to the first
    bsym that computes it, and to the rewrites of pattern_fusion left undone on its results ({feature: why})."""
    for bsym in _calls(trace):
        runner = _runner(bsym)
        inner = _walk(bsym.subsymbols) if bsym.sym.is_fusion else ()
        for b in (bsym, *inner):
            for p in b.flat_proxy_outs:
                for site in sites_of(p):
                    ops.setdefault(site, b)
                    if (label, runner) not in into.setdefault(site, []):
                        into[site].append((label, runner))
                    for t in p.tags:
                        if isinstance(t, Declined):
                            declined.setdefault(site, {})[t.feature] = t.why


_ATTENTION_OPS = frozenset({"tk_attention", "tk_attention_forward"})


def _detail(op: BoundSymbol | None, backward_by: str, cd, declined: dict[str, str]) -> str:
    """What the trace's inputs column does not show: attention whose repeated K/V heads tk read unrepeated
    (pattern_fusion.attend_grouped_kv) or whose backward writes the qkv projection's gradient
    (pattern_fusion.attention_backward_into_qkv), and why not where tk's backward does not; a training
    cross-entropy's gradient, from the forward's read of the logits or from the backward kernel, and why the latter;
    a product summed with another in one launch.
    `declined`: the site's rewrites left undone, {feature: why}."""
    if op is None:
        return ""
    if op.sym.name in _ATTENTION_OPS:
        q, k = op.args[0], op.args[1]
        notes = [f"K/V read with their {k.shape[1]} heads for {q.shape[1]} query heads"] if k.shape[1] < q.shape[1] \
            else []
        notes += [t.description for p in op.flat_proxy_outs for t in p.tags if isinstance(t, MaskRead)]
        if "tk_attention_backward_qkv" in backward_by:
            notes.append("gradient written as the qkv projection's, the rotary embedding's backward included")
        elif QKV_GRAD in declined:
            notes.append(f"gradient not written as the qkv projection's: {declined[QKV_GRAD]}")
        return "; ".join(notes)
    if op.sym.name == "tk_linear_rope":
        return "q and k roped in the epilogue; the attention reads q, k and v from its output in place"
    if op.sym.name == "tk_linear" and QKV_ROPE in declined:
        return f"q and k not roped in the epilogue: {declined[QKV_ROPE]}"
    if op.sym.name == "tk_linear" and SWIGLU in declined:
        return f"SwiGLU's products not in one launch: {declined[SWIGLU]}"
    if op.sym.name == "tk_matmul_sum":
        return "summed with the other product of an add in one launch"
    folded = [t.description for p in op.flat_proxy_outs for t in p.tags if isinstance(t, Folded)]
    if folded:
        return "; ".join(folded)
    if op.sym.name.startswith("tk_cross_entropy_forward_grad"):
        over = op.sym.name.endswith("_over_logits")
        return "loss and gradient from one read of the logits" + ("; the gradient written over them" if over else "")
    if op.sym.name == "tk_cross_entropy_forward" and "tk_cross_entropy_backward" in backward_by:
        from thunder_tk import _extension, claim_rules, lowering

        why = lowering.forward_grad_declined(
            op.args[0], option=cd.compile_options.get(lowering.FORWARD_GRAD_OPTION),
            disabled=claim_rules.disabled_names(), built=_extension.kernel_in_build(lowering.FORWARD_GRAD_KERNEL))
        return f"gradient by the backward kernel: {why}" if why else ""
    return ""


_NORM = "RMSNorm (recognised in the trace)"
_NORM_FORWARD_OPS = frozenset({"tk_rms_norm", "tk_add_rms_norm"})


def _norm_rows(forward, backward) -> list[Row]:
    """RMSNorm has no symbol of its own (LitGPT spells it out): a row for each norm rms_norm_fusion put on tk's
    kernels, and for each it found but left to the fuser, with why (a Declined tag on the norm's rstd)."""
    backward_ops = {}
    if backward is not None:
        backward_ops = {b.args[2].name: b for b in _calls(backward) if b.sym.name == "tk_rms_norm_backward"}
    rows = []
    for label, trace in (("forward", forward), ("backward", backward)):
        if trace is None:
            continue
        for bsym in _calls(trace):
            if bsym.sym.name in _NORM_FORWARD_OPS:
                rstd = bsym.output[1]
                inputs = describe_inputs(bsym.args[:-1], {})
                grad = backward_ops.get(rstd.name)
                detail = "the residual stream's add in the same pass" if bsym.sym.name == "tk_add_rms_norm" else ""
                if grad is not None and grad.args[4] is not None:
                    detail += ("; " if detail else "") + "the residual's gradient added in the backward's pass"
                rows.append(Row(label, _NORM, inputs, True, _runner(bsym),
                                _runner(grad) if grad is not None else "", "", detail))
                continue
            for b in (bsym, *(_walk(bsym.subsymbols) if bsym.sym.is_fusion else ())):
                tag = next((t for p in b.flat_proxy_outs for t in p.tags
                            if isinstance(t, Declined) and t.feature == RMS_NORM), None)
                if tag is not None and b.sym.name == "rsqrt":
                    rows.append(Row(label, _NORM, tag.inputs or describe_inputs(b.args, {}), False, _runner(bsym), "",
                                    tag.why))
    return rows


def build_report(cd, cs, *, planned: bool = False, note: str = "") -> Report:
    if not cs.last_traces:
        raise ValueError("explain needs traces: call the jitted function once first")
    forward = cs.last_traces[-1]
    backward = cs.last_backward_traces[-1] if cs.last_backward_traces else None
    producers: dict[Site, list[tuple[str, str]]] = {}
    ops: dict[Site, BoundSymbol] = {}
    declined: dict[Site, dict[str, str]] = {}
    _producers(forward, "forward", producers, ops, declined)
    if backward is not None:
        _producers(backward, "backward", producers, ops, declined)

    rows = []
    latest = {id(d) for d in latest_decisions_of(cd)}
    for d in decisions_of(cd):
        found = producers.get(d.site, [])
        where = found[0] if found else None
        if where is None:
            if id(d) not in latest:
                continue  # judged in an earlier compilation
            # Thunder replaced the symbol by its decomposition; those ops appear under their own rows.
            where = ("-", "decomposed into primitives")
        trace_label, ran_by = where
        backward_by = ""
        if d.claimed_by is not None and trace_label == "forward":
            backward_by = ", ".join(r for label, r in found if label == "backward" and r.startswith(f"{d.claimed_by}:"))
        rows.append(Row(trace_label, d.symbol, d.inputs, d.claimed_by == "tk", ran_by, backward_by, d.reason,
                        _detail(ops.get(d.site), backward_by, cd, declined.get(d.site, {}))
                        if d.claimed_by == "tk" else ""))
    rows += _norm_rows(forward, backward)
    order = {"forward": 0, "backward": 1}
    rows.sort(key=lambda r: order.get(r.trace, 2))
    calls = {"forward": calls_of(forward)}
    if backward is not None:
        calls["backward"] = calls_of(backward)
    return Report(rows, planned=planned, note=note, calls=calls)


def explain(jitted) -> Report:
    """Report of the last forward and backward traces of a function or module made by ``thunder.jit``."""
    try:
        cd = thunder.compile_data(jitted)
        cs = thunder.compile_stats(jitted)
    except Exception as e:  # not a jitted callable
        raise TypeError(f"explain expects the result of thunder.jit, got {type(jitted).__name__}") from e
    if cd is None or cs is None:
        raise TypeError(f"explain expects the result of thunder.jit, got {type(jitted).__name__}")
    return build_report(cd, cs)
