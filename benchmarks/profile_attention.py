"""One attention shape, forward and backward, a few times over: the workload for a profiler (ncu, nsys).

tk's kernels or a torch SDPA backend's, alone in the process, so a kernel-name filter picks them out:

    ncu -k regex:backward_kernel -s 2 -c 1 --set full python benchmarks/profile_attention.py --impl tk
    ncu -k regex:bprop -s 2 -c 1 --section SpeedOfLight python benchmarks/profile_attention.py --impl cudnn
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import profiled_kernels  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=("tk", "cudnn", "flash"), default="tk")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--kernels", action="store_true",
                    help="print each kernel's name and mean GPU time (torch.profiler) over the last --iters")
    args = ap.parse_args(argv)

    torch.manual_seed(0)
    shape = (args.batch, args.heads, args.seq, args.head_dim)
    q, k, v, grad_o = (torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    if args.impl == "tk":
        from thunder_tk import ops

        def step():
            o, lse = ops.attention_forward(q, k, v, is_causal=args.causal)
            ops.attention_backward(q, k, v, o, lse, grad_o, is_causal=args.causal)
    else:
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.CUDNN_ATTENTION if args.impl == "cudnn" else SDPBackend.FLASH_ATTENTION
        q, k, v = (t.requires_grad_() for t in (q, k, v))

        def step():
            with sdpa_kernel(backend):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=args.causal)
                torch.autograd.grad(o, (q, k, v), grad_o)

    if args.kernels:
        step()  # warm-up, outside the profile
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.iters):
                step()
            torch.cuda.synchronize()
        for name, (ms, launches) in sorted(profiled_kernels(prof).items(), key=lambda kv: -kv[1][0]):
            print(f"{ms / args.iters:9.3f} ms/iter  x{launches // args.iters}  {name[:150]}")
    else:
        for _ in range(args.iters):
            step()
    torch.cuda.synchronize()
    print(f"{args.impl}: {args.iters} forward + backward at B={args.batch} H={args.heads} S={args.seq} "
          f"D={args.head_dim} causal={args.causal}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
