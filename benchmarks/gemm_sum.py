"""Two products that meet in a sum, C = A B + A2 B2, in one tk launch (ops.gemm_sum, what `tk_matmul_sum` runs in a
training step for LLaMA's MLP input gradient, dh1 W1 + dh2 W2) against the same sum from two launches: tk's or
cuBLAS's GEMMs alone (the step's case, where the fuser's norm kernel then reads both products back), the same plus
an eager add, and cuBLAS accumulating the second product into the first (mm, then addmm with beta 1). Timed in turns
(common.interleaved_ms), µs; ratios against tk's one launch; tk's TFLOP/s; JSON and an optional PNG.

Shapes (8192 tokens; A and A2 the MLP's (tokens, hidden) gradients row-major, B and B2 its (hidden, D) weights):
Llama-3.2-1B (D 2048, hidden 8192), TinyLlama (2048, 5632), Llama-3-8B (4096, 14336).

    python benchmarks/gemm_sum.py --json out/gemm_sum.json --png out/gemm_sum.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_ms, report, shape_arguments  # noqa: E402

from thunder_tk import ops  # noqa: E402

# name: (tokens, D, hidden)
SHAPES = {
    "llama-3.2-1b": (8192, 2048, 8192),
    "tinyllama-1.1b": (8192, 2048, 5632),
    "llama-3-8b": (8192, 4096, 14336),
}
WAYS = ["tk sum", "tk 2 GEMMs", "cuBLAS 2 GEMMs", "cuBLAS mm+addmm", "tk 2 GEMMs + add", "cuBLAS 2 GEMMs + add"]


def measure(name: str, rounds: int) -> dict:
    """One shape's row: every way checked against float64, then all timed in turns."""
    M, N, H = SHAPES[name]
    dtype, dev = torch.bfloat16, "cuda"
    a, a2 = (torch.randn(M, H, device=dev, dtype=dtype) for _ in range(2))
    b, b2 = (torch.randn(H, N, device=dev, dtype=dtype) / H**0.5 for _ in range(2))
    fns = {"tk sum": lambda: ops.gemm_sum(a, b, a2, b2),
           "tk 2 GEMMs": lambda: (ops.gemm(a, b), ops.gemm(a2, b2)),
           "cuBLAS 2 GEMMs": lambda: (torch.mm(a, b), torch.mm(a2, b2)),
           "cuBLAS mm+addmm": lambda: torch.addmm(torch.mm(a, b), a2, b2),
           "tk 2 GEMMs + add": lambda: ops.gemm(a, b) + ops.gemm(a2, b2),
           "cuBLAS 2 GEMMs + add": lambda: torch.mm(a, b) + torch.mm(a2, b2)}
    want = a[:512].double() @ b.double() + a2[:512].double() @ b2.double()
    for label, fn in fns.items():
        got = fn()
        got = got[0] + got[1] if isinstance(got, tuple) else got
        err = ((got[:512].double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{name}: {label} differs from the float64 reference by {err:.3g}"
    t = interleaved_ms(fns, rounds=rounds)
    row = {"shape": name, "M": M, "N": N, "K": H, "K2": H}
    for way in WAYS:
        row[way] = t[way] * 1e3
    for way in WAYS[1:]:
        row[f"{way} / tk sum"] = t[way] / t["tk sum"]
    row["tk sum TFLOP/s"] = 4 * M * N * H / (t["tk sum"] * 1e-3) / 1e12
    return row


def main() -> None:
    a = shape_arguments("gemm_sum", SHAPES)
    rows = [measure(name, a.rounds) for name in a.shapes]
    report(a, "gemm_sum", rows, ["shape", *WAYS, *[f"{w} / tk sum" for w in WAYS[1:]], "tk sum TFLOP/s"],
           "A B + A2 B2, bf16 (us)", {way: way for way in WAYS})


if __name__ == "__main__":
    main()
