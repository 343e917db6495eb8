"""The fused qkv projection with LitGPT's rope of q and k in the GEMM's epilogue (ops.linear_rope, what
`tk_linear_rope` runs in a training step: q, k and v as views of one output), against q, k and v made the way the
step made them before: tk's plain GEMM (ops.linear), then the split into heads, the rope of q and k in the 16-bit
dtype and the copy of v as one torch.compile'd function (the fuser's Triton kernels); and cuBLAS
(torch.nn.functional.linear) followed by the same compiled function (Thunder's default executors). Timed in turns
(common.interleaved_ms), µs; ratios against the fold; JSON and an optional PNG.

Shapes: the training steps' projections (batch x sequence 8192 tokens): Llama-3.2-1B (32 heads over 8 of 64, rope
64), TinyLlama (32 over 4), Llama-3-8B (32 over 8 of 128), Pythia-1.4B-like partial rope (16 heads of 128, rope 32).

    python benchmarks/linear_rope.py --json out/linear_rope.json --png out/linear_rope.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_ms, report, shape_arguments  # noqa: E402

from thunder_tk import ops  # noqa: E402

# name: (B, S, K, Hq, Hkv, D, rope columns)
SHAPES = {
    "llama-3.2-1b": (4, 2048, 2048, 32, 8, 64, 64),
    "tinyllama-1.1b": (4, 2048, 2048, 32, 4, 64, 64),
    "llama-3-8b": (1, 8192, 4096, 32, 8, 128, 128),
    "pythia-1.4b-like": (4, 2048, 2048, 16, 16, 128, 32),
}


def split_and_rope(qkv, cos, sin, q_heads: int, kv_heads: int, head_dim: int):
    """The peer's elementwise part: the projection's (B, S, N) output split into (B, H, S, D) heads, q and k roped
    over the tables' n columns as LitGPT's apply_rope does it (x cos + rotate_half(x) sin in the 16-bit dtype, each
    op rounded, as the traced model's ops compute it), v copied out of the projection's output (the fuser's
    clone)."""
    q, k, v = ops.qkv_head_views(qkv, q_heads, kv_heads, head_dim)
    S, n = qkv.shape[1], cos.shape[1]
    c, s = cos[:S], sin[:S]

    def rope(x):
        x1, x2 = x[..., : n // 2], x[..., n // 2: n]
        roped = x[..., :n] * c + torch.cat((-x2, x1), -1) * s
        return torch.cat((roped, x[..., n:]), -1)

    return rope(q), rope(k), v.contiguous()


def measure(name: str, compiled, rounds: int) -> dict:
    """One shape's row: the three ways timed in turns, after checking that they agree."""
    B, S, K, Hq, Hkv, D, n = SHAPES[name]
    dtype, dev = torch.bfloat16, "cuda"
    N = (Hq + 2 * Hkv) * D
    x = torch.randn(B, S, K, device=dev, dtype=dtype)
    w = (torch.randn(N, K, device=dev) * K ** -0.5).to(dtype)  # unit-variance outputs
    cos, sin = ops.rope_tables(S, n, dtype, dev)

    def fold():
        return ops.linear_rope(x, w, cos, sin, Hq, Hkv, D)

    def tk_then_compiled():
        return compiled(ops.linear(x, w), cos, sin, Hq, Hkv, D)

    def cublas_then_compiled():
        return compiled(F.linear(x, w), cos, sin, Hq, Hkv, D)

    want = [t.double() for t in fold()]
    for label, got in (("tk+compile", tk_then_compiled()), ("cublas+compile", cublas_then_compiled())):
        for part, g, wt in zip("qkv", got, want):
            err = ((g.double() - wt).norm() / wt.norm()).item()
            assert err < 2e-2, f"{name}: {label}'s {part} differs from the fold's by {err:.3g}"
    t = interleaved_ms({"fold": fold, "tk+compile": tk_then_compiled, "cublas+compile": cublas_then_compiled},
                       rounds=rounds)
    return {"shape": name, "B": B, "S": S, "K": K, "Hq": Hq, "Hkv": Hkv, "D": D, "rope": n,
            "fold_us": t["fold"] * 1e3, "tk_compile_us": t["tk+compile"] * 1e3,
            "cublas_compile_us": t["cublas+compile"] * 1e3,
            "vs_tk_compile": t["tk+compile"] / t["fold"], "vs_cublas_compile": t["cublas+compile"] / t["fold"],
            "fold_tflops": 2 * B * S * N * K / (t["fold"] * 1e-3) / 1e12}


def main() -> None:
    a = shape_arguments("linear_rope", SHAPES)
    # Static shapes, one specialisation per shape, as Thunder compiles each fusion region of a fixed-shape trace
    # (without it Dynamo turns the second shape's sizes symbolic).
    compiled = torch.compile(split_and_rope, dynamic=False)
    rows = [measure(name, compiled, a.rounds) for name in a.shapes]
    report(a, "linear_rope", rows, ["shape", "fold_us", "tk_compile_us", "cublas_compile_us", "vs_tk_compile",
                                    "vs_cublas_compile"],
           "qkv projection with rope of q and k, bf16 (us)", {"tk fold": "fold_us", "tk + torch.compile": "tk_compile_us",
                                                              "cuBLAS + torch.compile": "cublas_compile_us"})


if __name__ == "__main__":
    main()
