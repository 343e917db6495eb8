"""LLaMA's gated MLP products, g = silu(x W1^T) * (x W2^T) with h1 and h2 kept (the backward reads them), three ways
in turns: tk's one launch (ops.swiglu_linear), tk's two GEMMs and torch.compile's kernel for the gated product (what
Thunder [tk] ran before pattern_fusion.fuse_swiglu), and cuBLAS's two GEMMs with the same compiled kernel; and tk's
two GEMMs with no gate, the floor of the one launch. And the backward through the output projection: tk's one
launch (ops.matmul_swiglu_grad: dg's accumulators turned into dh1 and dh2 in its epilogue), against tk's or
cuBLAS's dX GEMM and a compiled kernel for the gradient, and tk's GEMM alone.

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
    return timed_rows(f"{M}x{K}->{N}", fns, 4.0 * M * K * N, "tk two GEMMs + compiled gate",
                      "cuBLAS two GEMMs + compiled gate", rounds)


def timed_rows(shape: str, fns: dict, flop: float, apart: str, reference: str, rounds: int) -> list[dict]:
    """The variants timed in turns: ms, TFLOP/s, speed against `apart` (tk's kernels without the fusion), and the
    first output's error against `reference`'s (None for a variant that does not make it)."""
    outs = {name: fn() for name, fn in fns.items()}
    ref = outs[reference][0].double()
    times = interleaved_times(fns, rounds=rounds, warmup_ms=20, rep_ms=100)
    rows = []
    for name in fns:
        ms = statistics.median(times[name])
        first = outs[name][0]
        rows.append({"shape": shape, "variant": name, "ms": ms, "tflops": flop / ms / 1e9,
                     "vs_tk_apart": statistics.median(b / t for b, t in zip(times[apart], times[name])),
                     "g_rel_err_vs_cublas": (float((first.double() - ref).norm() / ref.norm())
                                             if first is not None else None)})
    return rows


def time_backward(M: int, K: int, N: int, grad, rounds: int) -> list[dict]:
    """SwiGLU's backward through the output projection (K = model width, N = MLP width): dg = dy @ W3 (W3 (K, N) as
    the backward trace reads proj's weight) and dh1, dh2 from dg, h1 and h2."""
    from thunder_tk import ops

    torch.manual_seed(0)
    dy = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w3 = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / K ** 0.5
    h1 = torch.randn(M, N, device="cuda", dtype=torch.bfloat16) * 2
    h2 = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    fns = {"tk one launch": lambda: ops.matmul_swiglu_grad(dy, w3, h1, h2),
           # the consumers sharing each tile (both wait for the epilogue) instead of taking whole tiles in turns
           "tk one launch, shared tiles": lambda: ops.matmul_swiglu_grad(dy, w3, h1, h2, _pingpong=-1),
           "tk GEMM + compiled gradient": lambda: grad(ops.gemm(dy, w3), h1, h2),
           "cuBLAS GEMM + compiled gradient": lambda: grad(dy @ w3, h1, h2),
           "tk GEMM, no gradient": lambda: (None, ops.gemm(dy, w3)),
           # the one launch's tile shape without its epilogue: what 128-wide tiles cost at this shape
           "tk GEMM 128-wide tiles, no gradient": lambda: (None, ops.gemm(dy, w3, _tile_n=128))}
    return timed_rows(f"bwd {M}x{K}->{N}", fns, 2.0 * M * K * N, "tk GEMM + compiled gradient",
                      "cuBLAS GEMM + compiled gradient", rounds)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", nargs="+", type=shape_arg, default=[(8192, 2048, 8192), (8192, 4096, 14336)],
                   metavar="TOKENS:K:N", help="tokens, model width K and MLP width N")
    p.add_argument("--rounds", type=int, default=7)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--forward-only", action="store_true", help="the products and the gate only")
    which.add_argument("--backward-only", action="store_true", help="the projection's dX and the gradient only")
    p.add_argument("--json", default="out/swiglu.json")
    p.add_argument("--png", help="bar chart of the variants' TFLOP/s per shape")
    a = p.parse_args(argv)

    gate = torch.compile(lambda h1, h2: F.silu(h1) * h2)

    def gate_grad(dg, h1, h2):  # as Thunder's unfused backward computes it: fp32 from the 16-bit tensors
        x, y, g = h1.float(), h2.float(), dg.float()
        s = torch.sigmoid(x)
        return (g * y * s * (1 + x * (1 - s))).to(dg.dtype), (g * x * s).to(dg.dtype)

    grad = torch.compile(gate_grad)
    rows = []
    for M, K, N in a.shapes:
        if not a.backward_only:
            rows += time_shape(M, K, N, gate, a.rounds)
        if not a.forward_only:
            rows += time_backward(M, K, N, grad, a.rounds)
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
