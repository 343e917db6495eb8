"""The GEMMs of one LitGPT training step under Thunder [tk], each timed on tk and on cuBLAS.

`litgpt_step.py --profile` gives the step's GEMM time per library; this says which calls make the difference. It
builds the tk variant, records every `ops.gemm` call of one step (shapes, strides, bias), and times each distinct
call on fresh operands with the same shapes and strides: `ops.gemm` against `torch.matmul` (cuBLAS) in turns.
Prints one row per distinct call with its count per step, and the step's total GEMM time on each.

    python benchmarks/step_gemms.py --n-layer 16 --json out/step_gemms.json
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import interleaved_ms, print_table, write_results  # noqa: E402
from litgpt_step import Built, add_model_arguments, variants  # noqa: E402

from thunder_tk import ops  # noqa: E402


def record_gemm_calls(step) -> Counter:
    """(a shape, a strides, b shape, b strides, dtype, bias) -> calls, over one run of `step`."""
    calls: Counter = Counter()
    original = ops.gemm

    def recording(a, b, bias=None, **knobs):
        calls[(tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype, bias is not None)] += 1
        return original(a, b, bias, **knobs)

    ops.gemm = recording
    try:
        step()
        torch.cuda.synchronize()
    finally:
        ops.gemm = original
    return calls


def operand(shape, stride, dtype) -> torch.Tensor:
    return torch.empty_strided(shape, stride, dtype=dtype, device="cuda").normal_()


def role(a_shape, b_shape, a_stride, b_stride) -> str:
    """What the product is, from the operands' majors: a K-major weight read transposed is a forward, a row-major
    activation gradient times the weight a dX, a transposed activation (gradient) times an activation a dW."""
    a_k_major, b_k_major = a_stride[1] == 1, b_stride[0] == 1
    if a_k_major and b_k_major:
        return "fwd"
    if a_k_major:
        return "dX"
    return "dW"


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_arguments(p, n_layer=2, warmup=2)
    p.add_argument("--rounds", type=int, default=3, help="timing rounds per call, tk and cuBLAS in rotating order")
    p.add_argument("--stream-k", action="store_true",
                   help="also time tk with its stream-K tail (off by default), in the same rotation")
    p.add_argument("--json", default="out/step_gemms.json")
    a = p.parse_args()
    device = torch.device("cuda")
    built = Built("thunder [tk]", variants(False, device)["thunder [tk]"], a, device)
    calls = record_gemm_calls(built.step)
    del built
    torch.cuda.empty_cache()

    rows = []
    for (a_shape, a_stride, b_shape, b_stride, dtype, has_bias), n in sorted(calls.items(), key=lambda kv: -kv[1]):
        x, w = operand(a_shape, a_stride, dtype), operand(b_shape, b_stride, dtype)
        bias = torch.randn(b_shape[1], dtype=dtype, device="cuda") if has_bias else None
        out = ops.gemm(x, w, bias)
        ref = torch.matmul(x.float(), w.float()) + (bias.float() if has_bias else 0)
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 1e-2, (a_shape, b_shape, err)
        del out, ref
        peer = (lambda: torch.addmm(bias, x, w)) if has_bias else (lambda: torch.matmul(x, w))
        timed = {"tk": lambda: ops.gemm(x, w, bias), "cuBLAS": peer}
        if a.stream_k:
            timed["stream_k"] = lambda: ops.gemm(x, w, bias, _stream_k=1)
        ms = interleaved_ms(timed, rounds=a.rounds)
        M, K = a_shape
        N = b_shape[1]
        flops = 2.0 * M * N * K
        rows.append({"M": M, "N": N, "K": K, "role": role(a_shape, b_shape, a_stride, b_stride),
                     "a_stride": str(a_stride), "b_stride": str(b_stride), "calls": n,
                     "tk_ms": ms["tk"], "cublas_ms": ms["cuBLAS"], "tk_tflops": flops / ms["tk"] / 1e9,
                     "cublas_tflops": flops / ms["cuBLAS"] / 1e9, "ratio": ms["cuBLAS"] / ms["tk"],
                     "step_ms_lost": n * (ms["tk"] - ms["cuBLAS"])})
        if a.stream_k:
            rows[-1].update(stream_k_ms=ms["stream_k"], stream_k_ratio=ms["cuBLAS"] / ms["stream_k"])
        print(f"{M:>6} x {N:>6} x {K:>6} {rows[-1]['role']:>3} a{a_stride} b{b_stride} x{n}: tk {ms['tk']:.3f} "
              f"cuBLAS {ms['cuBLAS']:.3f} ms, ratio {rows[-1]['ratio']:.3f}"
              + (f", stream-K {ms['stream_k']:.3f} ms" if a.stream_k else ""), flush=True)
        del x, w

    tk_total = sum(r["calls"] * r["tk_ms"] for r in rows)
    cublas_total = sum(r["calls"] * r["cublas_ms"] for r in rows)
    print(f"\nGEMMs of one step ({a.model}, {a.n_layer} layers, batch {a.batch} x {a.seq}), each timed alone, in turns:")
    print_table(sorted(rows, key=lambda r: -r["step_ms_lost"]),
                ["M", "N", "K", "role", "a_stride", "b_stride", "calls", "tk_tflops", "cublas_tflops", "ratio",
                 "step_ms_lost"] + (["stream_k_ratio"] if a.stream_k else []))
    print(f"step total: tk {tk_total:.2f} ms, cuBLAS {cublas_total:.2f} ms ({cublas_total / tk_total:.3f}x), "
          f"{sum(r['calls'] for r in rows)} calls")
    if a.stream_k:
        split_total = sum(r["calls"] * r["stream_k_ms"] for r in rows)
        print(f"tk with the stream-K tail: {split_total:.2f} ms ({cublas_total / split_total:.3f}x cuBLAS, "
              f"{tk_total / split_total:.3f}x the default)")
    write_results(a.json, "step_gemms", rows)


if __name__ == "__main__":
    main()
