"""The embedding's dense weight gradient (ops.embedding_backward, what `tk_embedding_backward` runs in a training
step: one sort of the ids, then one pass writing the whole (V, D) gradient) against PyTorch's native kernel
(torch.ops.aten.embedding_dense_backward, eager) and the same op as one torch.compile'd function (what Thunder's
torch.compile fuser runs: Inductor decomposes it into a zero fill, an fp32 scatter-add and a cast). Timed in turns
(common.interleaved_ms), µs; ratios against tk; tk's rate as the gradient's bytes written per second; JSON and an
optional PNG.

Shapes: the training steps' token embeddings (batch x sequence 8192 tokens, ids uniform over the vocabulary):
Llama-3.2-1B (128256 x 2048), TinyLlama (32000 x 2048), Llama-3-8B (128256 x 4096), GPT-2-like (50257 x 768).

    python benchmarks/embedding_backward.py --json out/embedding_backward.json --png out/embedding_backward.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_ms, report, shape_arguments  # noqa: E402

from thunder_tk import ops  # noqa: E402

# name: (B, S, V, D)
SHAPES = {
    "llama-3.2-1b": (4, 2048, 128256, 2048),
    "tinyllama-1.1b": (4, 2048, 32000, 2048),
    "llama-3-8b": (1, 8192, 128256, 4096),
    "gpt2-like": (8, 1024, 50257, 768),
}


def dense_backward(grad, indices, num_weights: int):
    """The peers' op: the dense weight gradient as Thunder's trace names it (no padding row, unscaled)."""
    return torch.ops.aten.embedding_dense_backward(grad, indices, num_weights, -1, False)


def measure(name: str, compiled, rounds: int) -> dict:
    """One shape's row: the three ways timed in turns, after checking each against the float64 reference."""
    B, S, V, D = SHAPES[name]
    dtype, dev = torch.bfloat16, "cuda"
    grad = torch.randn(B, S, D, device=dev, dtype=dtype)
    indices = torch.randint(0, V, (B, S), device=dev)

    fns = {"tk": lambda: ops.embedding_backward(grad, indices, V),
           "eager": lambda: dense_backward(grad, indices, V),
           "compile": lambda: compiled(grad, indices, V)}
    want = ops.embedding_backward_reference(grad, indices, V)
    for label, fn in fns.items():
        err = ((fn().double() - want).norm() / want.norm()).item()
        assert err < 1e-2, f"{name}: {label} differs from the float64 reference by {err:.3g}"
    del want
    t = interleaved_ms(fns, rounds=rounds)
    out_gb = V * D * grad.element_size() / 1e9
    return {"shape": name, "B": B, "S": S, "V": V, "D": D,
            "tk_us": t["tk"] * 1e3, "eager_us": t["eager"] * 1e3, "compile_us": t["compile"] * 1e3,
            "vs_eager": t["eager"] / t["tk"], "vs_compile": t["compile"] / t["tk"],
            "out_gb": out_gb, "tk_gb_per_s": out_gb / (t["tk"] * 1e-3)}


def main() -> None:
    a = shape_arguments("embedding_backward", SHAPES)
    # Static shapes, one specialisation per shape, as Thunder compiles each fusion region of a fixed-shape trace
    # (without it Dynamo turns the second shape's sizes, the vocabulary's too, symbolic).
    compiled = torch.compile(dense_backward, dynamic=False)
    rows = [measure(name, compiled, a.rounds) for name in a.shapes]
    report(a, "embedding_backward", rows, ["shape", "tk_us", "eager_us", "compile_us", "vs_eager", "vs_compile",
                                           "out_gb", "tk_gb_per_s"],
           "embedding weight gradient, bf16 (us)", {"tk": "tk_us", "PyTorch eager": "eager_us",
                                                    "torch.compile": "compile_us"})


if __name__ == "__main__":
    main()
