"""Attention backward pre-pass, delta = rowsum(dO * O) in fp32: tk kernel vs PyTorch eager and torch.compile.

Memory-bound: bytes = 2 * B*H*S*D * elem + 4 * B*H*S. Shapes follow the FlashAttention-3 protocol
(16k tokens, hidden 2048). Prints GB/s and ratios, writes JSON, optionally a PNG chart.

    python benchmarks/attention_bwd_delta.py --json out/delta.json --png out/delta.png
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import bar_chart, median_ms, print_table, write_results  # noqa: E402

from thunder_tk import ops  # noqa: E402


def eager(o, g):
    return (g.float() * o.float()).sum(-1)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--json", default="out/attention_bwd_delta.json")
    p.add_argument("--png")
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--sweep", action="store_true", help="also time every launch configuration of the kernel")
    p.add_argument("--layout", choices=("bhsd", "bshd", "mixed"), default="bhsd",
                   help="o and grad_o in memory: (B, H, S, D), or (B, S, H, D) as the attention forward writes o, or "
                        "mixed: o (B, S, H, D) and grad_o (B, H, S, D), as attention.py's backward hands them over")
    p.add_argument("--head-dims", type=int, nargs="+", default=[64, 128])
    p.add_argument("--seq-lens", type=int, nargs="+", default=[512, 2048, 8192, 16384])
    a = p.parse_args()

    compiled = torch.compile(eager)
    rows = []
    for D in a.head_dims:
        H = 2048 // D
        for S in a.seq_lens:
            B = max(1, a.tokens // S)
            if a.layout in ("bshd", "mixed"):
                o = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
            else:
                o = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
            # grad_o with o's strides, or contiguous (mixed)
            g = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) if a.layout == "mixed"
                 else torch.randn_like(o))
            ref = eager(o, g)
            out = ops.attention_bwd_delta(o, g)
            err = ((out - ref).norm() / ref.norm()).item()
            assert err < 1e-5, f"wrong result at {(B, H, S, D)}: rel err {err}"
            nbytes = 2 * o.numel() * o.element_size() + 4 * B * H * S
            t_tk = median_ms(lambda: ops.attention_bwd_delta(o, g))
            t_eager = median_ms(lambda: eager(o, g))
            t_compile = median_ms(lambda: compiled(o, g))
            dst = torch.empty_like(o)
            t_copy = median_ms(lambda: dst.copy_(o))  # the bandwidth ceiling: read + write of one tensor
            sweep = {}
            if a.sweep:
                for rows_per_group in (1, 2, 4):
                    for resident in (True, False):
                        t = median_ms(lambda: ops.attention_bwd_delta(o, g, _tuning=(rows_per_group, resident)))
                        sweep[f"rows{rows_per_group}_{'resident' if resident else 'block'}_us"] = t * 1e3
                        print(f"  sweep {B}x{H}x{S}x{D} rows={rows_per_group} resident={resident}: "
                              f"{t * 1e3:.1f} us, {nbytes / t / 1e6:.0f} GB/s", flush=True)
            rows.append({
                "shape": f"{B}x{H}x{S}x{D}", "layout": a.layout, "D": D, "S": S,
                "tk_us": t_tk * 1e3, "eager_us": t_eager * 1e3, "compile_us": t_compile * 1e3,
                "tk_GBps": nbytes / t_tk / 1e6, "compile_GBps": nbytes / t_compile / 1e6,
                "copy_GBps": 2 * o.numel() * o.element_size() / t_copy / 1e6,
                "vs_eager": t_eager / t_tk, "vs_compile": t_compile / t_tk, **sweep,
            })
    print_table(rows, ["shape", "tk_us", "eager_us", "compile_us", "tk_GBps", "compile_GBps", "copy_GBps", "vs_eager",
                       "vs_compile"])
    path = write_results(a.json, "attention_bwd_delta", rows)
    print(f"wrote {path}")
    if a.png:
        bar_chart(a.png, "attention bwd pre-pass, bf16 (GB/s)", [r["shape"] for r in rows],
                  {"tk": [r["tk_GBps"] for r in rows], "torch.compile": [r["compile_GBps"] for r in rows]}, "GB/s")


if __name__ == "__main__":
    main()
