"""Same-machine A/B of the attention kernels or the GEMM with both builds in one process, timed in fine turns.

ab_compare.py runs each build in its own process, one after the other; a benchmark process lasts tens of seconds,
and the chip's clock and power drift between them by more than a kernel change moves (unchanged kernels read 0.96x
to 1.04x there). Here the reference build (`scripts/ab_ref.sh <commit>`, installed with `pip --target`) is imported
beside the installed thunder_tk under another package name, and each point times both in turns of a few tens of
milliseconds (`common.interleaved_times`, rounds in rotating order); the ratio reported is the median of the rounds'
paired ratios, with their range.

    python3 benchmarks/ab_inprocess.py --ref-site /tmp/ref_site --rounds 9 --head-dims 128 --seq-lens 2048 8192
    python3 benchmarks/ab_inprocess.py --ref-site /tmp/ref_site --bench gemm --llama-1b
    python3 benchmarks/ab_inprocess.py --ref-site /tmp/ref_site --no-backward --rise random 3.5 9   # rising scores

The reference's package is copied with every `thunder_tk` module name rewritten and imported without its __init__
(no second Thunder executor); the two extension modules must not both register a pybind11 type globally (the
current build's P2PChannel is module-local since the change that added this script, so main from then on, or any
reference before it, pairs with it).
"""
from __future__ import annotations

import argparse
import importlib
import re
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention import bwd_flops, fwd_flops, points  # noqa: E402
from gemm import LAYOUTS, layout_operands, problems  # noqa: E402
from common import interleaved_times, write_results  # noqa: E402

REF_PACKAGE = "thunder_tk_ref"
_NAME = re.compile(r"\bthunder_tk\b")


def import_renamed(site: str | Path, workdir: str | Path, name: str = REF_PACKAGE):
    """thunder_tk as installed under `site`, imported as package `name`: its files copied into `workdir` with every
    reference to the module name thunder_tk rewritten (the extension's PyInit__C keeps its name: the last part of
    `name._C` is still _C)."""
    src = Path(site) / "thunder_tk"
    if not (src / "__init__.py").is_file():
        raise SystemExit(f"no thunder_tk package under {site}")
    dst = Path(workdir) / name
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__"))
    for py in dst.rglob("*.py"):
        py.write_text(_NAME.sub(name, py.read_text()))
    # Its __init__ would register a second Thunder executor named tk; the kernel wrappers need none of it.
    (dst / "__init__.py").write_text(f'"""thunder_tk of {site}, renamed for an in-process A/B."""\n')
    sys.path.insert(0, str(workdir))
    return importlib.import_module(f"{name}.ops")


def paired_row(point: dict, fns: dict, flops: float, rounds: int) -> dict:
    """One point's A/B: TFLOP/s of each side (medians) and the median and range of the turns' paired ratios."""
    t = interleaved_times(fns, rounds=rounds, warmup_ms=10, rep_ms=40)
    ratios = [r / c for c, r in zip(t["current"], t["reference"])]  # > 1: current faster
    return {**point, "current_tflops": flops / statistics.median(t["current"]) / 1e9,
            "reference_tflops": flops / statistics.median(t["reference"]) / 1e9,
            "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios),
            "current_ms": t["current"], "reference_ms": t["reference"]}


def compare_gemm(cur, ref, name: str, M: int, N: int, K: int, layouts, rounds: int) -> list[dict]:
    """The problem's products (gemm.py's layouts: fwd X W^T, dX = dY W, dW = dY^T X) on each build."""
    rows = []
    for layout, lhs, rhs in layout_operands(M, N, K, layouts):
        fns = {side: (lambda ops=ops: ops.gemm(lhs, rhs)) for side, ops in (("current", cur), ("reference", ref))}
        point = {"problem": name, "pass": layout, "M": lhs.shape[0], "N": rhs.shape[1], "K": lhs.shape[1]}
        rows.append(paired_row(point, fns, 2.0 * lhs.shape[0] * lhs.shape[1] * rhs.shape[1], rounds))
    return rows


def rising_inputs(B, H, S, D, rise: float):
    """q, k, v whose scores rise by about `rise` (base 2) from one 128-key block to the next in every row: the
    running maximum of the forward's online softmax is passed block after block (the kernels' slow paths)."""
    q = torch.randn(B, H, S, D, device="cuda") * 0.05
    k = torch.randn(B, H, S, D, device="cuda") * 0.05
    q[..., 0] = 1.0
    k[..., 0] = (torch.arange(S, device="cuda") // 128) * rise / (D ** -0.5 * 1.4426950408889634)
    v = torch.randn(B, H, S, D, device="cuda")
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def compare_point(cur, ref, B, H, S, D, causal, rounds: int, backward: bool, rise: float | None = None) -> list[dict]:
    if rise is None:
        q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    else:
        q, k, v = rising_inputs(B, H, S, D, rise)
    g = torch.randn_like(q)
    rows = []
    point = {"shape": f"{B}x{H}x{S}x{D}", "S": S, "D": D, "causal": causal}
    if rise is not None:
        point["rise"] = rise
    outs = {side: ops.attention_forward(q, k, v, is_causal=causal) for side, ops in (("current", cur),
                                                                                     ("reference", ref))}
    passes = {"fwd": ({side: (lambda ops=ops: ops.attention_forward(q, k, v, is_causal=causal))
                       for side, ops in (("current", cur), ("reference", ref))}, fwd_flops(B, H, S, D, causal))}
    if backward:
        passes["bwd"] = ({side: (lambda ops=ops, o=outs[side][0], lse=outs[side][1]:
                                 ops.attention_backward(q, k, v, o, lse, g, is_causal=causal))
                          for side, ops in (("current", cur), ("reference", ref))}, bwd_flops(B, H, S, D, causal))
    for name, (fns, flops) in passes.items():
        rows.append(paired_row({**point, "pass": name}, fns, flops, rounds))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref-site", required=True, help="directory where the reference thunder_tk is installed")
    p.add_argument("--ref-label", default="reference")
    p.add_argument("--bench", choices=("attention", "gemm"), default="attention")
    p.add_argument("--rounds", type=int, default=9, help="turns per point and pass (odd: a true median)")
    p.add_argument("--head-dims", type=int, nargs="+", default=[128], choices=(64, 128, 256))
    p.add_argument("--seq-lens", type=int, nargs="+", default=[2048, 8192])
    p.add_argument("--mask", choices=("both", "causal", "full"), default="both")
    p.add_argument("--no-backward", action="store_true")
    p.add_argument("--rise", nargs="+", help="attention: inputs whose scores rise by each of these (base 2) per "
                   "128-key block, or `random` (the default inputs): the forward's paths past its running maximum")
    p.add_argument("--quick", action="store_true", help="gemm: gemm.py's quick problems")
    p.add_argument("--llama-1b", action="store_true", help="gemm: the Llama-3.2-1B step's problems")
    p.add_argument("--layouts", nargs="+", choices=LAYOUTS, default=list(LAYOUTS), help="gemm: products to time")
    p.add_argument("--json", default="out/ab_inprocess.json")
    a = p.parse_args(argv)
    if a.rounds < 1:
        p.error("--rounds must be at least 1")
    try:
        rises = [None if r == "random" else float(r) for r in a.rise or ["random"]]
    except ValueError:
        p.error("--rise takes numbers (base-2 rise per key block) or `random`")
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/ab_inprocess.py needs a CUDA GPU")
    from thunder_tk import ops as cur

    with tempfile.TemporaryDirectory() as work:
        ref = import_renamed(a.ref_site, work)
        for side, ops in (("current", cur), ("reference", ref)):
            ops._require_kernels(torch.device("cuda", torch.cuda.current_device()))
        rows = []
        print(f"{a.bench} in one process: current vs {a.ref_label}, {a.rounds} paired turns per pass "
              f"(ratio: median of the turns' reference/current times, > 1 current faster; [min, max])", flush=True)

        def report(row, label):
            rows.append(row)
            print(f"  {label} {row['pass']}: {row['current_tflops']:6.1f} vs {row['reference_tflops']:6.1f} TFLOP/s  "
                  f"{row['ratio']:.3f}x [{row['ratio_min']:.3f}, {row['ratio_max']:.3f}]", flush=True)

        if a.bench == "gemm":
            for name, M, N, K in problems(a.quick, a.llama_1b):
                for row in compare_gemm(cur, ref, name, M, N, K, a.layouts, a.rounds):
                    report(row, f"{name:>16}")
                torch.cuda.empty_cache()
        else:
            masks = {"both": (False, True), "causal": (True,), "full": (False,)}[a.mask]
            for rise in rises:
                for B, H, S, D, causal in points(a.seq_lens, a.head_dims, masks):
                    for row in compare_point(cur, ref, B, H, S, D, causal, a.rounds, not a.no_backward, rise):
                        label = f"{row['shape']:>14} {'causal' if causal else 'full':>6}"
                        report(row, label if rise is None else f"{label} rise {rise:g}")
                    torch.cuda.empty_cache()
    if rows:
        gm = statistics.geometric_mean([r["ratio"] for r in rows])
        print(f"geometric mean current/{a.ref_label}: {gm:.3f} over {len(rows)} values")
    for row in rows:
        row["reference"] = a.ref_label
    write_results(a.json, f"ab_inprocess_{a.bench}", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
