"""Attention under sustained load: time per call beside the SM clock and board power it ran at, tk against cuDNN.

The H100 runs at its 700 W cap under these kernels, so a kernel that draws more power per FLOP loses clock. This
runs each implementation back to back for --seconds (no cache flush between calls), in turns over --rounds, with
nvidia-smi sampling the clock and power, once back to back and once with do_bench's L2 flush (a 256 MB write)
before each call, and prints per implementation and mode: ms per call, TFLOP/s, mean SM MHz and
watts, mega-cycles per call (time x clock: the cost at equal clock) and TFLOP per kJ. Also triton's do_bench time
(the one `benchmarks/attention.py` reports) in the same turns.

    python benchmarks/attention_clocks.py --points 8192:128:full 2048:128:full --json out/attention_clocks.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention import HIDDEN, TOKENS, bwd_flops, fwd_flops, sdpa_forward  # noqa: E402
from common import ClockSampler, in_turns, median_ms, print_table, write_results  # noqa: E402

MODES = ("back_to_back", "flushed")


def callables(S: int, D: int, causal: bool, which: str) -> tuple[dict, float]:
    """{impl: fn} for the forward or the backward at the protocol's shape, and that pass's FLOPs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from thunder_tk import ops

    B, H = TOKENS // S, HIDDEN // D
    q, k, v = (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if which == "fwd":
        return {"tk": lambda: ops.attention_forward(q, k, v, is_causal=causal),
                "cudnn": sdpa_forward(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)}, fwd_flops(B, H, S, D, causal)
    o, lse = ops.attention_forward(q, k, v, is_causal=causal)
    grad = torch.randn_like(o)
    inputs = tuple(t.detach().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        out = torch.nn.functional.scaled_dot_product_attention(*inputs, is_causal=causal)
    return {"tk": lambda: ops.attention_backward(q, k, v, o, lse, grad, is_causal=causal),
            "cudnn": lambda: torch.autograd.grad(out, inputs, grad, retain_graph=True)}, bwd_flops(B, H, S, D, causal)


def point_arg(text: str) -> tuple[int, int, bool]:
    """S:D:full|causal -> (S, D, causal), or an error naming the format."""
    parts = text.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or parts[1] not in ("64", "128") or parts[2] not in ("full", "causal"):
        raise argparse.ArgumentTypeError(f"{text!r}: a point is S:D:full|causal with D 64 or 128, e.g. 8192:128:full")
    return int(parts[0]), int(parts[1]), parts[2] == "causal"


def sustained(fn, seconds: float, flush: torch.Tensor | None = None) -> dict:
    """Calls back to back for `seconds`; with `flush`, each call after a write of that buffer (what triton's
    do_bench does to empty the L2), timed per call without it."""
    fn()
    torch.cuda.synchronize()
    events = []
    t0 = time.time()
    while time.time() - t0 < seconds:
        for _ in range(4):
            if flush is not None:
                flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()  # keeps the host's lead short, so the window below is the GPU's
    t1 = time.time()
    ms = statistics.median(s.elapsed_time(e) for s, e in events)
    # the first quarter of the window is the clock settling; the rest is read once the sampler has stopped
    return {"ms": ms, "window": (t0 + (t1 - t0) / 4, t1)}


def sustained_stats(runs: list[dict], sampler: ClockSampler, flops: float) -> dict:
    """Over the rounds of one implementation (`sustained`'s results): median ms per call, TFLOP/s, the median SM clock
    and power over the rounds' windows, mega-cycles per call (the cost at equal clock) and TFLOP per kJ."""
    ms = statistics.median(x["ms"] for x in runs)
    clocks = [c for c in (sampler.between(*x["window"]) for x in runs) if c]
    mhz = statistics.median(c["sm_mhz"] for c in clocks) if clocks else None
    watts = statistics.median(c["watts"] for c in clocks) if clocks else None
    return {"ms": ms, "tflops": flops / ms / 1e9, "sm_mhz": mhz, "watts": watts,
            "mcycles": ms * mhz / 1e3 if mhz else None,
            "tflop_per_kj": flops / 1e12 / (watts * ms / 1e3) / 1e-3 if watts else None}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", nargs="+", type=point_arg, default=[(8192, 128, False), (2048, 128, False)],
                   help="S:D:full|causal (default: 8192:128:full 2048:128:full)")
    p.add_argument("--passes", nargs="+", choices=("fwd", "bwd"), default=["bwd"])
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="out/attention_clocks.json")
    a = p.parse_args()

    rows, measured = [], []
    flush = torch.empty(256 * 1024 * 1024 // 4, dtype=torch.int32, device="cuda")  # do_bench's L2 flush
    with ClockSampler() as sampler:
        for S, D, causal in a.points:
            point = f"{S}:{D}:{'causal' if causal else 'full'}"
            for which in a.passes:
                fns, flops = callables(S, D, causal, which)
                names = list(fns)
                runs = {(name, mode): [] for name in names for mode in MODES}
                bench = {name: [] for name in names}
                for name in in_turns(names, a.rounds):
                    for mode in MODES:
                        runs[name, mode].append(sustained(fns[name], a.seconds, flush if mode == "flushed" else None))
                    bench[name].append(median_ms(fns[name], warmup_ms=10, rep_ms=50))
                for name in names:
                    for mode in MODES:
                        measured.append((point, which, name, mode, flops, runs[name, mode], bench[name]))
                del fns
                torch.cuda.empty_cache()
    # nvidia-smi's samples are read when the sampler stops
    print(f"{len(sampler.samples)} clock samples from nvidia-smi")
    for point, which, name, mode, flops, runs, bench in measured:
        stats = sustained_stats(runs, sampler, flops)
        rows.append({"point": point, "pass": which, "impl": name, "mode": mode, "ms": stats.pop("ms"),
                     "tflops": stats.pop("tflops"), "do_bench_ms": statistics.median(bench), **stats})
    print_table(rows, ["point", "pass", "impl", "mode", "ms", "tflops", "do_bench_ms", "sm_mhz", "watts", "mcycles",
                       "tflop_per_kj"])
    for point in dict.fromkeys(r["point"] for r in rows):
        for which in a.passes:
            for mode in MODES:
                by = {r["impl"]: r for r in rows if r["point"] == point and r["pass"] == which and r["mode"] == mode}
                if "tk" not in by or "cudnn" not in by:
                    continue
                line = f"{point} {which} {mode}: tk/cuDNN speed {by['cudnn']['ms'] / by['tk']['ms']:.3f}x"
                if by["tk"]["mcycles"] and by["cudnn"]["mcycles"]:
                    line += (f", at equal clock {by['cudnn']['mcycles'] / by['tk']['mcycles']:.3f}x, clock "
                             f"{by['tk']['sm_mhz']:.0f} vs {by['cudnn']['sm_mhz']:.0f} MHz, power "
                             f"{by['tk']['watts']:.0f} vs {by['cudnn']['watts']:.0f} W")
                print(line)
    write_results(a.json, "attention_clocks", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
