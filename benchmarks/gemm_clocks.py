"""GEMMs under sustained load: time per call beside the SM clock and board power it ran at, tk against cuBLAS.

In a training step the H100 sits at its 700 W cap, and a GEMM that draws more power per FLOP runs at a lower clock
there (`benchmarks/litgpt_step.py`'s clocks per round). Short timings (`benchmarks/gemm.py`: 50 ms bursts, the L2
flushed before each call) hardly reach the cap. This runs each implementation back to back for --seconds, in turns
over --rounds, with nvidia-smi sampling the clock and power, and prints per problem and implementation: ms per call,
TFLOP/s, SM MHz, watts, mega-cycles per call (time x clock: the cost at equal clock) and TFLOP per kJ.

tk runs once per value of --group-rows (tile rows per L2 group of its persistent tile order; 0 = the default): at
the lm_head forward (8192 x 2048 x 128256) groups of 8 tile rows stream the 525 MB weight from memory once per
group, eight times in all, where 64 rows (all of M) read it once; memory traffic costs power, not time, while the
product is compute-bound, so only a run at the cap can tell.

    python benchmarks/gemm_clocks.py --problems 8192:2048:128256:fwd 8192:2048:128256:dW --group-rows 0 64
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from attention_clocks import sustained, sustained_stats  # noqa: E402
from common import ClockSampler, in_turns, print_table, write_results  # noqa: E402
from gemm import LAYOUTS  # noqa: E402
# Llama-3.2-1B's lm_head (8192 tokens, hidden 2048, vocabulary 128256): the step's largest GEMMs
DEFAULT_PROBLEMS = ("8192:2048:128256:fwd", "8192:2048:128256:dX", "8192:2048:128256:dW")


def problem_arg(text: str) -> tuple[int, int, int, str]:
    """M:K:N:layout (the forward product's M tokens against a K x N weight) -> (M, K, N, layout)."""
    parts = text.split(":")
    if len(parts) != 4 or not all(x.isdigit() and int(x) > 0 for x in parts[:3]) or parts[3] not in LAYOUTS:
        raise argparse.ArgumentTypeError(f"{text!r}: a problem is M:K:N:fwd|dX|dW, e.g. 8192:2048:128256:fwd")
    return int(parts[0]), int(parts[1]), int(parts[2]), parts[3]


def operands(M: int, K: int, N: int, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """lhs, rhs of one product of a linear layer (as benchmarks/gemm.py lays them out)."""
    if layout == "fwd":
        return (torch.randn(M, K, device="cuda", dtype=torch.bfloat16),
                torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t())
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    if layout == "dX":
        return dy, torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    return dy.t(), torch.randn(M, K, device="cuda", dtype=torch.bfloat16)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--problems", nargs="+", type=problem_arg, default=[problem_arg(x) for x in DEFAULT_PROBLEMS],
                   help=f"M:K:N:layout (default: {' '.join(DEFAULT_PROBLEMS)})")
    p.add_argument("--group-rows", nargs="+", type=int, default=[0, 64],
                   help="tk's tile rows per L2 group, one tk variant each (0: the default)")
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", default="out/gemm_clocks.json")
    a = p.parse_args()
    if any(g < 0 for g in a.group_rows):
        p.error("--group-rows must be 0 (the default) or positive")
    from thunder_tk import ops

    measured = []
    with ClockSampler() as sampler:
        for M, K, N, layout in a.problems:
            lhs, rhs = operands(M, K, N, layout)
            flops = 2.0 * lhs.shape[0] * lhs.shape[1] * rhs.shape[1]
            ref = torch.matmul(lhs, rhs).float()
            fns = {"cuBLAS": lambda: torch.matmul(lhs, rhs)}
            for g in a.group_rows:
                fns[f"tk group_rows={g or 'default'}"] = lambda g=g: ops.gemm(lhs, rhs, _group_rows=g)
            for name, fn in fns.items():  # each variant checked once before it is timed
                err = ((fn().float() - ref).norm() / ref.norm()).item()
                assert err < 1e-2, f"{name} at {M}:{K}:{N}:{layout}: rel err {err}"
            del ref
            names, runs = list(fns), {name: [] for name in fns}
            for name in in_turns(names, a.rounds):
                runs[name].append(sustained(fns[name], a.seconds))
            measured += [(f"{M}:{K}:{N}:{layout}", name, flops, runs[name]) for name in names]
            del fns, lhs, rhs
            torch.cuda.empty_cache()
    print(f"{len(sampler.samples)} clock samples from nvidia-smi")
    rows = []
    for problem, name, flops, runs in measured:
        rows.append({"problem": problem, "impl": name, **sustained_stats(runs, sampler, flops)})
    for r in rows:
        base = next(x for x in rows if x["problem"] == r["problem"] and x["impl"] == "cuBLAS")
        r["speed_vs_cublas"] = base["ms"] / r["ms"]
        r["equal_clock_vs_cublas"] = base["mcycles"] / r["mcycles"] if r["mcycles"] and base["mcycles"] else None
    print_table(rows, ["problem", "impl", "ms", "tflops", "sm_mhz", "watts", "mcycles", "tflop_per_kj",
                       "speed_vs_cublas", "equal_clock_vs_cublas"])
    write_results(a.json, "gemm_clocks", rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
