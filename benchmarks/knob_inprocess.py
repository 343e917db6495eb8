"""tk's kernels under each value of an environment knob their launch reads, timed in one process, beside the peer.

Experimental branches read knobs from the environment at every launch (e.g. THUNDER_TK_GEMM_L2); setting the
variable between calls picks the variant, so all values are timed in fine turns on the same tensors
(`common.interleaved_times`), as benchmarks/ab_inprocess.py does for two builds. The first value is the reference:
per point, the median and range of the turns' paired ratios reference time / value time (> 1: the value is
faster), and each value's result against the reference's (max relative difference). The peer (cuDNN's attention,
cuBLAS's GEMM) runs in the same turns, so each value's ratio to it is read from one run too.

    python3 benchmarks/knob_inprocess.py --knob THUNDER_TK_GEMM_L2=0,21,12 --bench gemm --llama-1b
    python3 benchmarks/knob_inprocess.py --knob THUNDER_TK_BWD_L2=0,200,220 --bench attention --seq-lens 4096 16384
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention import bwd_flops, fwd_flops, points  # noqa: E402
from common import interleaved_times, write_results  # noqa: E402
from gemm import LAYOUTS, layout_operands, problems  # noqa: E402


def parse_knob(text: str) -> tuple[str, list[str]]:
    name, _, values = text.partition("=")
    vals = [v for v in values.split(",") if v]
    if not name or len(vals) < 2:
        raise SystemExit(f"--knob NAME=V0,V1[,...] (V0 the reference), not {text!r}")
    return name, vals


def parse_knobs(texts: list[str]) -> tuple[str, list[str], dict[str, dict[str, str]]]:
    """Several --knob options are zipped: variant i sets every knob to its i-th value (so two knobs with four values
    each time four combinations). Returns (the knobs' names, the variants' labels V1+V2..., each label's settings)."""
    knobs = [parse_knob(t) for t in texts]
    counts = {len(vals) for _, vals in knobs}
    if len(counts) != 1:
        raise SystemExit(f"every --knob needs the same number of values (they are zipped), not {sorted(counts)}")
    labels, settings = [], {}
    for i in range(counts.pop()):
        label = "+".join(vals[i] for _, vals in knobs)
        if label in settings:
            raise SystemExit(f"variant {label!r} given twice")
        labels.append(label)
        settings[label] = {name: vals[i] for name, vals in knobs}
    return "+".join(name for name, _ in knobs), labels, settings


SETTINGS: dict[str, dict[str, str]] = {}  # label -> {variable: value}, filled by main


def set_knob(label: str) -> None:
    os.environ.update(SETTINGS[label])


def with_knob(label: str, fn):
    def run():
        set_knob(label)
        return fn()
    return run


def as_list(out):
    return [t.float() for t in (out if isinstance(out, tuple) else (out,))]


def time_point(point: dict, name: str, values: list[str], call, peer, flops: float, rounds: int) -> dict:
    """One point: every knob value (and the peer, if any) in turns; ratios paired per turn."""
    fns = {v: with_knob(v, call) for v in values}
    outs = {v: as_list(fns[v]()) for v in values}
    if peer is not None:
        fns["peer"] = peer
    times = interleaved_times(fns, rounds=rounds, warmup_ms=10, rep_ms=40)
    row = {**point, "knob": name}
    ref = times[values[0]]
    parts = []
    for v in values:
        row[f"{v}_tflops"] = flops / statistics.median(times[v]) / 1e9
        if v == values[0]:
            parts.append(f"{v}: {row[f'{v}_tflops']:.0f}")
            continue
        ratios = sorted(r / t for r, t in zip(ref, times[v]))
        row[f"{v}_ratio"] = statistics.median(ratios)
        row[f"{v}_ratio_range"] = [ratios[0], ratios[-1]]
        row[f"{v}_max_rel_diff"] = max(float((x - y).abs().max() / y.abs().max().clamp_min(1e-30))
                                       for x, y in zip(outs[v], outs[values[0]]))
        parts.append(f"{v}: {row[f'{v}_tflops']:.0f} {row[f'{v}_ratio']:.3f}x [{ratios[0]:.3f}, {ratios[-1]:.3f}] "
                     f"diff {row[f'{v}_max_rel_diff']:.1e}")
    if "peer" in times:
        row["peer_tflops"] = flops / statistics.median(times["peer"]) / 1e9
        for v in values:
            row[f"{v}_vs_peer"] = statistics.median(p / t for p, t in zip(times["peer"], times[v]))
        parts.append(f"peer {row['peer_tflops']:.0f} ({values[0]}: {row[f'{values[0]}_vs_peer']:.3f}x)")
    label = " ".join(str(point[k]) for k in point)
    print(f"  {label:>32}: " + " | ".join(parts) + " TFLOP/s", flush=True)
    return row


def attention_point(a, name, values, B, H, S, D, causal) -> dict:
    """One attention point's row; its tensors (and the closures over them) are freed when it returns."""
    from thunder_tk import ops
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    set_knob(values[0])
    o, lse = ops.attention_forward(q, k, v, is_causal=causal)
    grad_o = torch.randn_like(q)
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            ref_out = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=causal)
            if a.forward:
                def peer():
                    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
            else:
                torch.autograd.grad(ref_out, inputs, grad_o, retain_graph=True)

                def peer():
                    return torch.autograd.grad(ref_out, inputs, grad_o, retain_graph=True)
    except RuntimeError as e:
        print(f"  cuDNN skipped: {str(e).splitlines()[0]}", flush=True)
        peer = None
    if a.forward:
        def call():
            return ops.attention_forward(q, k, v, is_causal=causal)
        flops = fwd_flops(B, H, S, D, causal)
    else:
        def call():
            return ops.attention_backward(q, k, v, o, lse, grad_o, is_causal=causal)
        flops = bwd_flops(B, H, S, D, causal)
    point = {"shape": f"{B}x{H}x{S}x{D}", "causal": causal, "pass": "fwd" if a.forward else "bwd"}
    return time_point(point, name, values, call, peer, flops, a.rounds)


def attention_rows(a, name, values) -> list[dict]:
    masks = {"both": (False, True), "causal": (True,), "full": (False,)}[a.mask]
    rows = []
    for B, H, S, D, causal in points(a.seq_lens, a.head_dims, masks):
        rows.append(attention_point(a, name, values, B, H, S, D, causal))
        torch.cuda.empty_cache()
    return rows


def gemm_rows(a, name, values) -> list[dict]:
    from thunder_tk import ops

    rows = []
    for prob, M, N, K in problems(a.quick, a.llama_1b):
        for layout, lhs, rhs in layout_operands(M, N, K, a.layouts):
            point = {"problem": prob, "pass": layout}
            flops = 2.0 * lhs.shape[0] * lhs.shape[1] * rhs.shape[1]
            rows.append(time_point(point, name, values, lambda lhs=lhs, rhs=rhs: ops.gemm(lhs, rhs),
                                   lambda lhs=lhs, rhs=rhs: torch.matmul(lhs, rhs), flops, a.rounds))
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--knob", required=True, action="append",
                   help="NAME=V0,V1,...: the environment variable and its values; given several times, zipped")
    p.add_argument("--bench", choices=("attention", "gemm"), default="attention")
    p.add_argument("--head-dims", type=int, nargs="+", default=[128], choices=(64, 128, 256))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--mask", choices=("both", "causal", "full"), default="both")
    p.add_argument("--forward", action="store_true", help="attention: time the forward instead of the backward")
    p.add_argument("--quick", action="store_true", help="gemm: gemm.py's quick problems")
    p.add_argument("--llama-1b", action="store_true", help="gemm: the Llama-3.2-1B step's problems")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="gemm: products to time")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--json", default="out/knob_inprocess.json")
    a = p.parse_args()
    name, values, settings = parse_knobs(a.knob)
    SETTINGS.update(settings)
    what = a.bench if a.bench == "gemm" else ("attention forward" if a.forward else "attention backward")
    print(f"{what} under {name} = {values} in one process, {a.rounds} turns (ratio: median of reference/value "
          f"times; > 1 the value faster)", flush=True)
    rows = gemm_rows(a, name, values) if a.bench == "gemm" else attention_rows(a, name, values)
    for variable in settings[values[0]]:
        os.environ.pop(variable, None)
    write_results(a.json, "knob_inprocess", rows)


if __name__ == "__main__":
    main()
