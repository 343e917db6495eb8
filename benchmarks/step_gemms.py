"""The GEMMs of one LitGPT training step under Thunder [tk], each timed on tk and on cuBLAS.

`litgpt_step.py --profile` gives the step's GEMM time per library; this says which calls make the difference. It
builds the tk variant, records every `ops.gemm` call of one step (shapes, strides, bias), and times each distinct
call on fresh operands with the same shapes and strides: `ops.gemm` against `torch.matmul` (cuBLAS) in turns.
Prints one row per distinct call with its count per step, and the step's total GEMM time on each.

Each call timed alone runs between L2 flushes (triton's do_bench), with the chip resting between calls; in the step
the GEMMs run back to back. `--replay R` also replays the step's whole GEMM sequence in its order, back to back, on
each library (and tk's schedule and cluster options) in turns, R rounds, with the SM clock and power the sequence ran
at (nvidia-smi): on a power-limited chip, a kernel that draws more per FLOP runs at a lower clock there.

    python benchmarks/step_gemms.py --n-layer 16 --json out/step_gemms.json
    python benchmarks/step_gemms.py --n-layer 16 --no-isolated --replay 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import ClockSampler, interleaved_ms, print_table, write_results  # noqa: E402
from litgpt_step import Built, add_model_arguments, variants  # noqa: E402

from thunder_tk import ops  # noqa: E402


def record_gemm_calls(step) -> list[tuple]:
    """The GEMM calls of one run of `step`, in order: (a shape, a strides, b shape, b strides, dtype, bias)."""
    calls: list[tuple] = []
    original = ops.gemm

    def recording(a, b, bias=None, **knobs):
        calls.append((tuple(a.shape), a.stride(), tuple(b.shape), b.stride(), a.dtype, bias is not None))
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


# What the replay times: cuBLAS, and tk with its default and with options that change what a GEMM draws or how its
# blocks take tiles (clusters of two share B through multicast: a third fewer L2 bytes per product).
REPLAY_LIBRARIES = {
    "cuBLAS": None,
    "tk": {},
    "tk_dynamic": {"_schedule": "dynamic"},
    "tk_cluster2": {"_cluster": 2},
    "tk_store_warps": {"_epilogue": 1},
    "tk_consumers": {"_epilogue": 2},
}


def replay(calls: list[tuple], rounds: int, libraries: list[str]) -> list[dict]:
    """The step's GEMM sequence back to back on each library, in turns: ms per sequence (median over rounds) and the
    mean SM clock, power and temperature while it ran. Operands: two sets per distinct call, used alternately, so a
    call rarely finds its operands left in L2 by the one before (as in the step, where each layer has its own)."""
    operands = {}
    for key in dict.fromkeys(calls):
        a_shape, a_stride, b_shape, b_stride, dtype, has_bias = key
        operands[key] = [(operand(a_shape, a_stride, dtype), operand(b_shape, b_stride, dtype),
                          torch.randn(b_shape[1], dtype=dtype, device="cuda") if has_bias else None)
                         for _ in range(2)]

    def sequence(knobs):
        for i, key in enumerate(calls):
            x, w, bias = operands[key][i & 1]
            if knobs is None:
                torch.addmm(bias, x, w) if bias is not None else torch.matmul(x, w)
            else:
                ops.gemm(x, w, bias, **knobs)

    times = {name: [] for name in libraries}
    clocks = {name: [] for name in libraries}
    with ClockSampler() as sampler:
        marks = []
        for r in range(rounds):
            for name in libraries[r % len(libraries):] + libraries[:r % len(libraries)]:
                knobs = REPLAY_LIBRARIES[name]
                sequence(knobs)  # warm: the chip settles into this library's load
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                t0 = sampler.now()
                start.record()
                for _ in range(3):
                    sequence(knobs)
                end.record()
                end.synchronize()
                marks.append((name, t0, sampler.now()))
                times[name].append(start.elapsed_time(end) / 3)
    for name, t0, t1 in marks:
        if (c := sampler.between(t0, t1)) is not None:
            clocks[name].append(c)
    rows = []
    for name in libraries:
        row = {"library": name, "sequence_ms": statistics.median(times[name]), "rounds_ms": times[name]}
        for field in ClockSampler.FIELDS:
            values = [c[field] for c in clocks[name]]
            row[field] = statistics.fmean(values) if values else float("nan")
        rows.append(row)
    base = next(r["sequence_ms"] for r in rows if r["library"] == "cuBLAS") if "cuBLAS" in libraries else None
    for r in rows:
        r["vs_cublas"] = base / r["sequence_ms"] if base else float("nan")
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    add_model_arguments(p, n_layer=2, warmup=2)
    p.add_argument("--rounds", type=int, default=3, help="timing rounds per call, tk and cuBLAS in rotating order")
    p.add_argument("--stream-k", action="store_true",
                   help="also time tk with its stream-K tail (off by default), in the same rotation")
    p.add_argument("--no-isolated", dest="isolated", action="store_false",
                   help="skip timing each distinct call alone")
    p.add_argument("--replay", type=int, default=0, metavar="R",
                   help="replay the step's GEMM sequence back to back on each library in turns, R rounds")
    p.add_argument("--replay-libraries", nargs="*", default=["cuBLAS", "tk", "tk_dynamic", "tk_cluster2"],
                   choices=list(REPLAY_LIBRARIES))
    p.add_argument("--replay-by-role", action="store_true",
                   help="also replay the forward, dX and dW calls each as a sequence of their own")
    p.add_argument("--json", default="out/step_gemms.json")
    a = p.parse_args()
    device = torch.device("cuda")
    built = Built("thunder [tk]", variants(False, device)["thunder [tk]"], a, device)
    sequence = record_gemm_calls(built.step)
    calls = Counter(sequence)
    del built
    torch.cuda.empty_cache()

    rows = []
    for (a_shape, a_stride, b_shape, b_stride, dtype, has_bias), n in sorted(calls.items(), key=lambda kv: -kv[1]):
        if not a.isolated:
            break
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

    if a.replay:
        replayed = replay(sequence, a.replay, a.replay_libraries)
        print(f"\nThe step's {len(sequence)} GEMM calls replayed back to back in their order, {a.replay} rounds in "
              f"turns (median ms per sequence; mean SM clock, power and temperature while each ran):")
        print_table(replayed, ["library", "sequence_ms", "vs_cublas", "sm_mhz", "watts", "celsius"])
        if a.replay_by_role:
            for kind in ("fwd", "dX", "dW"):
                part = [c for c in sequence if role(c[0], c[2], c[1], c[3]) == kind]
                if not part:
                    continue
                by_role = replay(part, a.replay, a.replay_libraries)
                print(f"\nThe step's {len(part)} {kind} calls alone, back to back:")
                print_table(by_role, ["library", "sequence_ms", "vs_cublas", "sm_mhz", "watts", "celsius"])
                for r in by_role:
                    r["role"] = kind
                replayed += by_role
        write_results(Path(a.json).with_name(Path(a.json).stem + "_replay.json"), "step_gemms_replay", replayed)
    if not rows:
        return
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
