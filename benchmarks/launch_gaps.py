"""What a launch costs the GPU between kernels: chains of tiny launches, each reading the previous one's output,
captured in a CUDA graph (no host in the way) and replayed; per launch = replay time / chain length.

A kernel whose work is a few µs shows, in such a chain, its launch and ramp-up cost: grid launch, shared-memory
carve-out, barrier set-up, descriptor fetch and the first loads' latency. tk's kernels against cuBLAS's and an
elementwise ATen kernel at the same sizes, alone and alternating with the elementwise kernel (a step interleaves
GEMMs and fused elementwise kernels). tk's chains run twice: launched programmatically dependent on the kernel
before (tk's default: set-up under the previous kernel's tail) and in plain stream order (--launch-order).

    python benchmarks/launch_gaps.py [--chain 200] [--rounds 5] [--launch-order both] [--json out/launch_gaps.json]
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import capture, median_ms, print_table, write_results  # noqa: E402


def chains(device: torch.device) -> dict:
    """name -> a function that enqueues one launch (or one pair) reading and writing the same buffers."""
    from thunder_tk import ops

    bf16 = torch.bfloat16
    n = 256
    a = torch.randn(n, n, device=device, dtype=bf16) / 16
    w = torch.randn(n, n, device=device, dtype=bf16) / 16
    out = torch.empty(n, n, device=device, dtype=bf16)
    small = torch.randn(n * n, device=device, dtype=bf16)
    q = torch.randn(1, 4, 128, 64, device=device, dtype=bf16)
    k = torch.randn(1, 4, 128, 64, device=device, dtype=bf16)
    v = torch.randn(1, 4, 128, 64, device=device, dtype=bf16)

    def add():
        torch.add(small, 1.0, out=small)

    def tk_gemm(**knobs):
        def pair():
            ops.gemm(out, w, out=a, **knobs)
            ops.gemm(a, w, out=out, **knobs)

        return pair

    def cublas():
        torch.mm(out, w, out=a)
        torch.mm(a, w, out=out)

    def tk_then_add():
        ops.gemm(out, w, out=a)
        add()
        ops.gemm(a, w, out=out)
        add()

    def cublas_then_add():
        torch.mm(out, w, out=a)
        add()
        torch.mm(a, w, out=out)
        add()

    def attention():
        ops.attention_forward(q, k, v, is_causal=True)

    norm_w = torch.ones(n, device=device, dtype=bf16)

    def tk_then_norm():
        ops.gemm(out, w, out=a)
        ops.rms_norm(a, norm_w, 1e-5)

    # (launches per call, function)
    found = {"ATen add (elementwise)": (1, add), "cuBLAS mm": (2, cublas), "tk gemm": (2, tk_gemm()),
             "tk gemm 256-wide": (2, tk_gemm(_tile_n=256)), "tk gemm store warps": (2, tk_gemm(_epilogue=1)),
             "tk gemm dynamic": (2, tk_gemm(_schedule="dynamic")),
             "tk gemm + add": (4, tk_then_add), "cuBLAS mm + add": (4, cublas_then_add)}
    if hasattr(ops, "rms_norm"):
        found["tk gemm + tk rms_norm"] = (2, tk_then_norm)
    if hasattr(ops, "attention_forward"):
        found["tk attention forward"] = (1, attention)
    return found


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--chain", type=int, default=200, help="launches captured per graph")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--launch-order", choices=["both", "dependent", "plain"], default="both",
                   help="tk's launches programmatically dependent, in plain stream order, or each chain both ways")
    p.add_argument("--json", default="out/launch_gaps.json")
    args = p.parse_args(argv)
    if args.chain < 1 or args.rounds < 1:
        p.error("--chain and --rounds must be >= 1")
    if not torch.cuda.is_available():
        print("launch_gaps: needs a CUDA GPU", file=sys.stderr)
        return 2
    from thunder_tk import ops

    device = torch.device("cuda")
    orders = {"both": ("dependent", "plain"), "dependent": ("dependent",), "plain": ("plain",)}[args.launch_order]
    rows = []
    for name, (launches, fn) in chains(device).items():
        for order in orders if name.startswith("tk") else ("-",):
            try:
                calls = max(1, args.chain // launches)
                # the launch attribute is recorded into the graph's kernel nodes at capture
                with ops.dependent_launches(order != "plain") if order != "-" else contextlib.nullcontext():
                    graph, _ = capture(lambda: [fn() for _ in range(calls)])
                times = [median_ms(graph.replay, warmup_ms=5, rep_ms=30) for _ in range(args.rounds)]
                us = sorted(times)[len(times) // 2] * 1e3 / (calls * launches)
                rows.append({"chain": name, "launch": order, "launches": calls * launches, "us_per_launch": us})
            except Exception as e:  # noqa: BLE001  (one chain failing must not cost the others)
                rows.append({"chain": name, "launch": order, "launches": 0, "us_per_launch": float("nan"),
                             "error": f"{type(e).__name__}: {e}"[:200]})
    add_us = next((r["us_per_launch"] for r in rows if r["chain"].startswith("ATen add")), float("nan"))
    plain = {r["chain"]: r["us_per_launch"] for r in rows if r["launch"] == "plain"}
    for r in rows:
        r["vs_add"] = r["us_per_launch"] / add_us
        dependent = r["launch"] == "dependent" and r["chain"] in plain
        r["vs_plain"] = r["us_per_launch"] / plain[r["chain"]] if dependent else float("nan")
    print_table(rows, ["chain", "launch", "launches", "us_per_launch", "vs_add", "vs_plain"])
    for r in rows:
        if "error" in r:
            print(f"  {r['chain']}: {r['error']}")
    write_results(args.json, "launch_gaps", rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
