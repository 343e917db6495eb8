"""LLaMA's gated MLP products, g = silu(x W1^T) * (x W2^T) with h1 and h2 kept (the backward reads them), three ways
in turns: tk's one launch (ops.swiglu_linear), tk's two GEMMs and torch.compile's kernel for the gated product (what
Thunder [tk] ran before pattern_fusion.fuse_swiglu), and cuBLAS's two GEMMs with the same compiled kernel; and tk's
two GEMMs with no gate, the floor of the one launch.

    python3 benchmarks/swiglu.py --shapes 8192:2048:8192 8192:4096:14336 --json out/swiglu.json
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import bar_chart, interleaved_times, print_table, write_results  # noqa: E402


def shape_arg(text: str) -> tuple[int, int, int]:
    m, k, n = (int(v) for v in text.split(":"))
    return m, k, n


def time_shape(M: int, K: int, N: int, gate, rounds: int) -> list[dict]:
    from thunder_tk import ops

    torch.manual_seed(0)
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w1, w2 = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5 for _ in range(2))

    def apart(linear):
        h1, h2 = linear(x, w1), linear(x, w2)
        return gate(h1, h2), h1, h2

    fns = {"tk one launch": lambda: ops.swiglu_linear(x, w1, w2),
           "tk two GEMMs + compiled gate": lambda: apart(ops.linear),
           "cuBLAS two GEMMs + compiled gate": lambda: apart(F.linear),
           # The floor the one launch works against: its products alone, with no gate and no third output.
           "tk two GEMMs, no gate": lambda: (None, ops.linear(x, w1), ops.linear(x, w2))}
    outs = {name: fn() for name, fn in fns.items()}
    ref = outs["cuBLAS two GEMMs + compiled gate"][0].double()
    times = interleaved_times(fns, rounds=rounds, warmup_ms=20, rep_ms=100)
    base = times["tk two GEMMs + compiled gate"]
    rows = []
    for name in fns:
        ms = statistics.median(times[name])
        rows.append({"shape": f"{M}x{K}->{N}", "variant": name, "ms": ms, "tflops": 4.0 * M * K * N / ms / 1e9,
                     "vs_tk_apart": statistics.median(b / t for b, t in zip(base, times[name])),
                     "g_rel_err_vs_cublas": (float((outs[name][0].double() - ref).norm() / ref.norm())
                                             if outs[name][0] is not None else None)})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=shape_arg, default=[(8192, 2048, 8192), (8192, 4096, 14336)],
                   metavar="TOKENS:K:N", help="tokens, model width K and MLP width N")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--json", default="out/swiglu.json")
    p.add_argument("--png", help="bar chart of the variants' TFLOP/s per shape")
    a = p.parse_args(argv)

    gate = torch.compile(lambda h1, h2: F.silu(h1) * h2)
    rows = []
    for M, K, N in a.shapes:
        rows += time_shape(M, K, N, gate, a.rounds)
        torch.cuda.empty_cache()
    print_table(rows, ["shape", "variant", "ms", "tflops", "vs_tk_apart", "g_rel_err_vs_cublas"])
    write_results(a.json, "swiglu", rows)
    if a.png:
        shapes = list(dict.fromkeys(r["shape"] for r in rows))
        series = {v: [next(r["tflops"] for r in rows if r["shape"] == s and r["variant"] == v) for s in shapes]
                  for v in dict.fromkeys(r["variant"] for r in rows)}
        bar_chart(a.png, "SwiGLU's products (bf16), TFLOP/s", shapes, series, "TFLOP/s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
