"""The attention backward's last wave cut into query ranges, by how many parts, timed in one process (no mask).

Without a causal mask the backward's units (128 keys of a head) are all alike; `units % SMs` of them make a last
wave that leaves most multiprocessors idle (the protocol at D = 128: 2048 units, 68 left on 132 SMs). Each of those
can be walked in `parts` query ranges by as many blocks, whose fp32 dK, dV the last part sums
(`ops.attention_backward(..., _tail_split=(split_from, parts))`). With 68 units, 2 parts are 136 blocks (two rounds
of halves: no shorter), 3 are two rounds of thirds, 5 three rounds of fifths, 7 four of sevenths. This times the
whole walk and each split at the protocol's points in fine turns beside cuDNN (`common.interleaved_times`): per
point, the median and range of the paired ratios whole / split (> 1: the split is faster), and each split's gradients
against the whole walk's.

    python3 benchmarks/attention_tail_parts.py --seq-lens 4096 8192 16384 --parts 3 4 5 7 --rounds 11
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from attention import bwd_flops, points  # noqa: E402
from common import bar_chart, interleaved_times, write_results  # noqa: E402


def max_rel_diff(xs, ys) -> float:
    return max(float((x.float() - y.float()).abs().max() / y.float().abs().max().clamp_min(1e-30))
               for x, y in zip(xs, ys))


def time_point(B: int, H: int, S: int, D: int, parts_list, rounds: int, sms: int) -> dict:
    """One protocol point: the whole walk, each split, ops' own choice and cuDNN, in turns."""
    from thunder_tk import ops
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v, grad_o = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = ops.attention_forward(q, k, v)
    units = B * H * -(-S // ops._BWD_KEYS)  # ops' units and steps, as attention_backward counts them (D <= 128)
    r = units % sms
    fns = {"whole": lambda: ops.attention_backward(q, k, v, o, lse, grad_o, _tail_split=False)}
    for parts in parts_list:
        fns[f"{parts} parts"] = (lambda parts=parts:
                                 ops.attention_backward(q, k, v, o, lse, grad_o, _tail_split=(units - r, parts)))
    fns["policy"] = lambda: ops.attention_backward(q, k, v, o, lse, grad_o)
    outs = {name: fn() for name, fn in fns.items()}
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        ref = torch.nn.functional.scaled_dot_product_attention(*inputs)
    fns["cudnn"] = lambda: torch.autograd.grad(ref, inputs, grad_o, retain_graph=True)
    times = interleaved_times(fns, rounds=rounds, warmup_ms=10, rep_ms=60)
    flops = bwd_flops(B, H, S, D, False)
    row = {"shape": f"{B}x{H}x{S}x{D}", "units": units, "left": r, "sms": sms,
           "policy_plan": list(ops.backward_tail_split(units, -(-S // ops._BWD_QUERIES), False, sms))}
    cells = []
    for name in fns:
        row[f"{name}_tflops"] = flops / statistics.median(times[name]) / 1e9
        ratios = sorted(w / t for w, t in zip(times["whole"], times[name]))
        row[f"{name}_vs_whole"] = statistics.median(ratios)
        row[f"{name}_vs_whole_range"] = [ratios[0], ratios[-1]]
        row[f"{name}_vs_cudnn"] = statistics.median(c / t for c, t in zip(times["cudnn"], times[name]))
        if name in outs and name != "whole":
            row[f"{name}_max_rel_diff"] = max_rel_diff(outs[name], outs["whole"])
        cells.append(f"{name} {row[f'{name}_tflops']:.0f} ({row[f'{name}_vs_whole']:.3f}x "
                     f"[{ratios[0]:.3f}, {ratios[-1]:.3f}], cuDNN {row[f'{name}_vs_cudnn']:.3f}x)")
    print(f"{row['shape']} ({units} units, {r} left, policy {row['policy_plan']}): " + " | ".join(cells), flush=True)
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", type=int, nargs="+", default=[4096, 8192, 16384])
    p.add_argument("--head-dims", type=int, nargs="+", default=[128], choices=(64, 128))
    p.add_argument("--parts", type=int, nargs="+", default=[3, 4, 5, 7])
    p.add_argument("--rounds", type=int, default=11)
    p.add_argument("--json", default="out/attention_tail_parts.json")
    p.add_argument("--png", help="bar chart of each split's and ops' plan's speed against the whole walk")
    a = p.parse_args(argv)

    from thunder_tk._extension import multiprocessor_count

    sms = multiprocessor_count(0)
    rows = []
    for B, H, S, D, _ in points(a.seq_lens, a.head_dims, (False,)):
        rows.append(time_point(B, H, S, D, a.parts, a.rounds, sms))
        torch.cuda.empty_cache()
    write_results(a.json, "attention_tail_parts", rows)
    if a.png and rows:
        names = [k[: -len("_vs_whole")] for k in rows[0] if k.endswith("_vs_whole") and not k.startswith("whole")]
        bar_chart(a.png, "attention backward, last wave split: speed against the whole walk (D = 128, no mask)",
                  [r["shape"] for r in rows], {n: [r[f"{n}_vs_whole"] for r in rows] for n in names}, "x whole walk")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
