"""Does inductor's pool of compile-worker processes starve the host's main thread?

The 8-layer Llama-2-7B runs on 4 GPUs stall once per process, 1.5-4 s after the compiling first step, for about
0.65 s in whichever Python the main thread was running (benchmarks/NOTES.md, session 27). Each rank's inductor starts
min(32, cores) worker processes in the background once its first compile job asks for them, so 4 ranks start 128
processes that each import torch. This probe reproduces just that: N processes (one per GPU, as torchrun's ranks)
each torch.compile a small CUDA function, then run a loop of trivial Python (the meta-tensor call the stalled
traces caught) and record every gap over --threshold between iterations. Each mode runs the N processes together:
"pool" (inductor's default), "pool, kept" (the pool never quiesced: TORCHINDUCTOR_QUIESCE_ASYNC_COMPILE_POOL=0) and
"in-process" (TORCHINDUCTOR_COMPILE_THREADS=1: no worker processes).

Inductor quiesces an idle pool (its workers exit) 60-90 s after the last compile job; --quiesce-seconds shortens
that wait so that a short loop sees it. Gaps and the parent's samples of the worker count share one clock (seconds
since the mode's processes were launched), so a gap can be laid beside the pool's start or exit.

    python3 scripts/host_stall_probe.py --procs 4 --seconds 20 --quiesce-seconds 5 --json out/host_stall_probe.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

MODES = {"pool": {}, "pool, kept": {"TORCHINDUCTOR_QUIESCE_ASYNC_COMPILE_POOL": "0"},
         "in-process": {"TORCHINDUCTOR_COMPILE_THREADS": "1"}}


def child(index: int, seconds: float, threshold: float, launched: float, quiesce: float | None) -> None:
    import torch
    from torch._inductor import config as inductor_config
    from torch._inductor.async_compile import AsyncCompile

    if quiesce is not None:
        inductor_config.quiesce_async_compile_time = quiesce

    device = torch.device("cuda", index % torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"
    start = time.monotonic()

    @torch.compile
    def f(x):
        return (x.sin() * 2 + 1).relu().sum()

    @torch.compile
    def g(x):
        return (x.cos() * 3 - 1).relu().amax()

    x = torch.randn(4096, device=device)
    f(x)  # compiled in this process while the pool starts (its readiness is a job of its own)
    compiled = time.monotonic()
    # Once the pool answers, a second function compiles in it: the job that arms the pool's quiesce timer, as the
    # regions that a model's first step compiles after the pool is up do.
    pool_job_at = None
    gaps, iterations, last = [], 0, compiled
    while last < compiled + seconds:
        torch.randn(1, device="meta")  # the Python the stalled ranks were caught in
        iterations += 1
        if pool_job_at is None and AsyncCompile.use_process_pool():
            g(x)
            pool_job_at = last = time.monotonic()
        now = time.monotonic()
        if now - last > threshold:
            # at_s: since the launch, on the parent's clock (CLOCK_MONOTONIC is one clock for every process)
            gaps.append({"at_s": round(now - launched, 3), "gap_s": round(now - last, 3)})
        last = now
    print(json.dumps({"process": index, "compile_s": round(compiled - start, 2),
                      "compiled_at_s": round(compiled - launched, 2),
                      "pool_job_at_s": None if pool_job_at is None else round(pool_job_at - launched, 2),
                      "compile_threads": inductor_config.compile_threads, "iterations": iterations, "gaps": gaps,
                      "max_gap_s": max((g["gap_s"] for g in gaps), default=0.0)}), flush=True)


def run_mode(name: str, procs: int, seconds: float, threshold: float, quiesce: float | None) -> dict:
    env = {**os.environ, **MODES[name]}
    launched = time.monotonic()
    args = [sys.executable, os.path.abspath(__file__), "--seconds", str(seconds), "--threshold", str(threshold),
            "--launched", repr(launched)] + (["--quiesce-seconds", str(quiesce)] if quiesce is not None else [])
    children = [subprocess.Popen(args + ["--child", str(i)], env=env, stdout=subprocess.PIPE, text=True)
                for i in range(procs)]
    workers = []  # (seconds since launch, compile-worker processes on the host, 1-minute load)
    while any(c.poll() is None for c in children):
        count = subprocess.run(["pgrep", "-fc", "compile_worker"], capture_output=True, text=True).stdout.strip()
        workers.append((round(time.monotonic() - launched, 1), int(count or 0), os.getloadavg()[0]))
        time.sleep(0.5)
    results = []
    for c in children:
        out = c.stdout.read().strip().splitlines()
        results.append(json.loads(out[-1]) if out and c.returncode == 0 else {"returncode": c.returncode})
    return {"mode": name, "env": MODES[name], "processes": results,
            "max_compile_workers": max((w[1] for w in workers), default=0), "samples": workers,
            "worker_changes": worker_changes(workers)}


def worker_changes(samples: list[tuple]) -> list[tuple]:
    """The samples at which the host's count of compile-worker processes changed: the pool's start and exit."""
    changes, last = [], None
    for at, count, _load in samples:
        if count != last:
            changes.append((at, count))
            last = count
    return changes


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--procs", type=int, default=4, help="processes run together (one per GPU, like ranks)")
    p.add_argument("--seconds", type=float, default=15.0, help="loop time after each process's compile")
    p.add_argument("--threshold", type=float, default=0.05, help="a gap over this many seconds is recorded")
    p.add_argument("--quiesce-seconds", type=float, default=None,
                   help="inductor's idle time before it quiesces the pool (its default: 60)")
    p.add_argument("--modes", nargs="*", choices=list(MODES), default=list(MODES))
    p.add_argument("--json", default=None)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--launched", type=float, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child is not None:
        child(a.child, a.seconds, a.threshold, time.monotonic() if a.launched is None else a.launched,
              a.quiesce_seconds)
        return 0
    report = {"procs": a.procs, "cpus": os.cpu_count(), "threshold_s": a.threshold,
              "quiesce_s": a.quiesce_seconds, "modes": []}
    for name in a.modes:
        r = run_mode(name, a.procs, a.seconds, a.threshold, a.quiesce_seconds)
        report["modes"].append(r)
        print(f"{name}: compile-worker processes at most {r['max_compile_workers']}; "
              f"(seconds, count) where the count changed: {r['worker_changes'][:12]}")
        for q in r["processes"]:
            if "gaps" in q:
                print(f"  process {q['process']}: compiled at {q['compiled_at_s']} s ({q['compile_s']} s, "
                      f"{q['compile_threads']} threads), a job in the pool at {q['pool_job_at_s']} s, "
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
