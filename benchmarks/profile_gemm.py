"""One GEMM shape, a few times over: the workload for a profiler (ncu, nsys).

tk's kernel (with its tuning knobs) or cuBLAS's (`torch.matmul`), alone in the process, so a kernel-name filter
picks them out. Problems are M x K x N, by default with the forward's layout (X (M, K) times a (N, K) weight's
transpose); `--layout dx` takes B as a (K, N) row-major weight, as the backward's dX products read it, and
`--impl tk_swiglu_grad` runs SwiGLU's backward launch (dg = A B turned into dh1, dh2 with h1, h2 (M, N)) there:

    ncu -k regex:gemm -s 2 -c 1 --metrics lts__t_bytes.sum python benchmarks/profile_gemm.py --impl tk --cluster 2
    ncu -k regex:nvjet -s 2 -c 1 --section SpeedOfLight python benchmarks/profile_gemm.py --impl cublas
"""

from __future__ import annotations

import argparse

import torch


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("tk", "cublas", "tk_swiglu_grad"), default="tk")
    ap.add_argument("--layout", choices=("fwd", "dx"), default="fwd",
                    help="B as a (N, K) weight's transpose (fwd) or a (K, N) row-major matrix (dx)")
    ap.add_argument("--problem", default="8192x8192x8192", help="M x K x N")
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--cluster", type=int, default=0, help="tk: 2 for clusters of two sharing B by multicast")
    ap.add_argument("--tile-n", type=int, default=0, help="tk: output tile width 128 or 256 (0: automatic)")
    ap.add_argument("--epilogue", type=int, default=0, help="tk: 1 store warps, 2 the consumers (0: automatic)")
    ap.add_argument("--group-rows", type=int, default=0, help="tk: tile rows per L2 group (0: the default)")
    args = ap.parse_args(argv)

    m, k, n = (int(v) for v in args.problem.lower().split("x"))
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float16
    torch.manual_seed(0)
    x = torch.randn(m, k, device="cuda", dtype=dtype)
    b = torch.randn(n, k, device="cuda", dtype=dtype).t() if args.layout == "fwd" else \
        torch.randn(k, n, device="cuda", dtype=dtype)
    if args.impl == "tk":
        from thunder_tk import ops

        def run():
            ops.gemm(x, b, _cluster=args.cluster, _tile_n=args.tile_n, _epilogue=args.epilogue,
                     _group_rows=args.group_rows)
    elif args.impl == "tk_swiglu_grad":
        from thunder_tk import ops
        h1, h2 = (torch.randn(m, n, device="cuda", dtype=dtype) for _ in range(2))

        def run():
            ops.matmul_swiglu_grad(x, b, h1, h2)
    else:
        def run():
            torch.matmul(x, b)

    for _ in range(args.iters):
        run()
    torch.cuda.synchronize()
    print(f"{args.impl}: {args.iters} GEMMs of {m} x {k} x {n} ({args.dtype}, {args.layout} layout)"
          + (f", cluster {args.cluster}" if args.impl == "tk" and args.cluster else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
