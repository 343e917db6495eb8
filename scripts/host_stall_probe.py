"""Does inductor's pool of compile-worker processes starve the host's main thread?

The 8-layer Llama-2-7B runs on 4 GPUs stall once per process, 1.5-4 s after the compiling first step, for about
0.65 s in whichever Python the main thread was running (benchmarks/NOTES.md, session 27). Each rank's inductor starts
min(32, cores) worker processes in the background once its first compile job asks for them, so 4 ranks start 128
processes that each import torch. This probe reproduces just that: N processes (one per GPU, as torchrun's ranks)
each torch.compile a small CUDA function, then run a loop of trivial Python (the meta-tensor call the stalled
traces caught) and record every gap over --threshold between iterations. Each mode runs the N processes together:
"pool" (inductor's default) and "in-process" (TORCHINDUCTOR_COMPILE_THREADS=1: no worker processes).

    python3 scripts/host_stall_probe.py --procs 4 --seconds 15 --json out/host_stall_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODES = {"pool": {}, "in-process": {"TORCHINDUCTOR_COMPILE_THREADS": "1"}}


def child(index: int, seconds: float, threshold: float) -> None:
    import torch

    device = torch.device("cuda", index % torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"
    start = time.perf_counter()

    @torch.compile
    def f(x):
        return (x.sin() * 2 + 1).relu().sum()

    f(torch.randn(4096, device=device))
    compiled = time.perf_counter()
    gaps, iterations, last = [], 0, compiled
    while last < compiled + seconds:
        torch.randn(1, device="meta")  # the Python the stalled ranks were caught in
        iterations += 1
        now = time.perf_counter()
        if now - last > threshold:
            gaps.append({"at_s": round(now - compiled, 3), "gap_s": round(now - last, 3)})
        last = now
    from torch._inductor import config

    print(json.dumps({"process": index, "compile_s": round(compiled - start, 2), "compile_threads":
                      config.compile_threads, "iterations": iterations, "gaps": gaps,
                      "max_gap_s": max((g["gap_s"] for g in gaps), default=0.0)}), flush=True)


def run_mode(name: str, procs: int, seconds: float, threshold: float) -> dict:
    env = {**os.environ, **MODES[name]}
    args = [sys.executable, os.path.abspath(__file__), "--seconds", str(seconds), "--threshold", str(threshold)]
    children = [subprocess.Popen(args + ["--child", str(i)], env=env, stdout=subprocess.PIPE, text=True)
                for i in range(procs)]
    workers = []  # (seconds since launch, compile-worker processes on the host, 1-minute load)
    launched = time.perf_counter()
    while any(c.poll() is None for c in children):
        count = subprocess.run(["pgrep", "-fc", "compile_worker"], capture_output=True, text=True).stdout.strip()
        workers.append((round(time.perf_counter() - launched, 1), int(count or 0), os.getloadavg()[0]))
        time.sleep(0.5)
    results = []
    for c in children:
        out = c.stdout.read().strip().splitlines()
        results.append(json.loads(out[-1]) if out and c.returncode == 0 else {"returncode": c.returncode})
    return {"mode": name, "env": MODES[name], "processes": results,
            "max_compile_workers": max((w[1] for w in workers), default=0), "samples": workers}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4, help="processes run together (one per GPU, like ranks)")
    p.add_argument("--seconds", type=float, default=15.0, help="loop time after each process's compile")
    p.add_argument("--threshold", type=float, default=0.05, help="a gap over this many seconds is recorded")
    p.add_argument("--modes", nargs="*", choices=list(MODES), default=list(MODES))
    p.add_argument("--json", default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        child(a.child, a.seconds, a.threshold)
        return 0
    report = {"procs": a.procs, "cpus": os.cpu_count(), "threshold_s": a.threshold, "modes": []}
    for name in a.modes:
        r = run_mode(name, a.procs, a.seconds, a.threshold)
        report["modes"].append(r)
        print(f"{name}: compile-worker processes at most {r['max_compile_workers']}")
        for q in r["processes"]:
            if "gaps" in q:
                print(f"  process {q['process']}: compile {q['compile_s']} s ({q['compile_threads']} threads), "
                      f"{len(q['gaps'])} gaps over {a.threshold} s, longest {q['max_gap_s']} s: {q['gaps'][:6]}")
            else:
                print(f"  a process failed: {q}")
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
