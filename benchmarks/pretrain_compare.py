"""`thunder-tk pretrain` with tk's executors against Thunder's default executors, same config, same machine, one
run: tokens/s per GPU, MFU and peak memory after the first (compiling) step.

    python3 benchmarks/pretrain_compare.py --config litgpt_configs/llama-2-7b.yaml --nproc 4 \\
        -- --train.global_batch_size 16 --train.max_steps 12

Each variant is its own `torchrun` job (a fresh process group and allocator), writing no checkpoints. Everything
after `--` is passed to `thunder-tk pretrain` as config overrides.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import bar_chart, print_table, write_results  # noqa: E402

# name -> (executors as `compiler.executors` spells them, environment). The "tk -" variants switch one kernel
# family off (THUNDER_TK_DISABLE) to show what each contributes; run them with --only.
VARIANTS = {
    "tk": ("[tk]", {}),
    "thunder default": ("[default]", {}),
    "tk - collectives": ("[tk]", {"THUNDER_TK_DISABLE": "collective"}),
    "tk - gemm": ("[tk]", {"THUNDER_TK_DISABLE": "gemm"}),
    # On several GPUs `thunder-tk pretrain` sets FSDP_KERNEL_SETTINGS (32 collective blocks, the dynamic GEMM
    # schedule) unless the environment does; these variants set both, so they mean what their names say.
    "tk, 32 collective blocks": ("[tk]", {"THUNDER_TK_COLLECTIVE_BLOCKS": "32", "THUNDER_TK_GEMM_SCHEDULE": "static"}),
    "tk, dynamic GEMM schedule": ("[tk]", {"THUNDER_TK_GEMM_SCHEDULE": "dynamic",
                                           "THUNDER_TK_COLLECTIVE_BLOCKS": "128"}),
    "tk, dynamic GEMM, 32 collective blocks": ("[tk]", {"THUNDER_TK_GEMM_SCHEDULE": "dynamic",
                                                         "THUNDER_TK_COLLECTIVE_BLOCKS": "32"}),
    # The large collectives on the copy engines (no SMs taken from the GEMMs that overlap them); messages under
    # 16 MiB gathered stay on 32 blocks of tk's kernels.
    "tk, dynamic GEMM, copy-engine collectives": ("[tk]", {"THUNDER_TK_GEMM_SCHEDULE": "dynamic",
                                                            "THUNDER_TK_COLLECTIVE_BLOCKS": "32",
                                                            "THUNDER_TK_COLLECTIVE_ENGINE": "auto"}),
    # tk without its FSDP schedule (thunder_tk/fsdp_schedule.py): the fuser's order, all gathers before the
    # forward's compute and every reduce-scatter after the backward's.
    "tk - fsdp schedule": ("[tk]", {"THUNDER_TK_DISABLE": "collective_schedule"}),
    # tk as it ran before the schedule: the fuser's order, 128 collective blocks, the static GEMM schedule.
    "tk, fused order": ("[tk]", {"THUNDER_TK_DISABLE": "collective_schedule", "THUNDER_TK_COLLECTIVE_BLOCKS": "128",
                                 "THUNDER_TK_GEMM_SCHEDULE": "static"}),
    # Inductor compiling in each rank's own process, no pool of compile-worker processes: whether that pool (its
    # workers started or stopped in the background) is what starves the host once per process in the first steps.
    "tk, inductor in-process": ("[tk]", {"TORCHINDUCTOR_COMPILE_THREADS": "1"}),
    "thunder default, inductor in-process": ("[default]", {"TORCHINDUCTOR_COMPILE_THREADS": "1"}),
    # Each rank (and the compile workers it starts) on its own share of the CPUs near its GPU: whether one rank's
    # host work taking another's cores is what stalls them.
    "tk, exclusive cores": ("[tk]", {"THUNDER_TK_CPU_AFFINITY": "exclusive"}),
    "thunder default, exclusive cores": ("[default]", {"THUNDER_TK_CPU_AFFINITY": "exclusive"}),
}
# Variants whose config differs beyond the executors: name -> overrides placed after the run's own (the optimizer
# class: torch.optim.AdamW and thunder_tk.optim.AdamW read and write the same state, with the same bits).
CONFIG_VARIANTS = {
    "tk, torch AdamW": ("[tk]", {}, ["--optimizer.class_path", "torch.optim.AdamW"]),
    "tk, tk AdamW": ("[tk]", {}, ["--optimizer.class_path", "thunder_tk.optim.AdamW"]),
    "thunder default, torch AdamW": ("[default]", {}, ["--optimizer.class_path", "torch.optim.AdamW"]),
}
VARIANTS.update({name: (executors, env) for name, (executors, env, _) in CONFIG_VARIANTS.items()})
DEFAULT_VARIANTS = ("tk", "thunder default")
# Thunder (inductor_cat_cudnn executors), Llama-2-7B FSDP on 8x H100, bs 1, seq 4096: tokens/s per GPU
# (lightning-thunder issue #940; shared/docs/performance-anchors.md)
PUBLISHED_7B_TOKENS_PER_GPU = 10.6e3
ENV_PROFILE = "THUNDER_TK_PROFILE_STEPS"
UNEVEN = 1.5  # a step this many times the median one: the mean is not the variant's pace


def slow_steps(steps: list[dict], median: float | None) -> list[dict]:
    """The logged steps after the first that took over UNEVEN x the median step, with what may have stalled them:
    the host's share of each (and by phase), the garbage collector's and the CUDA allocator's counters (the keys a
    step's record has)."""
    if not median:
        return []
    keys = ("step", "step_seconds", "host_seconds", "host_phases", "gc_seconds", "alloc_retries", "device_allocs",
            "system")
    # (Profiled steps, THUNDER_TK_PROFILE_STEPS, are slow by the profiler's own synchronisations and writing.)
    return [{k: r[k] for k in keys if k in r}
            for r in [r for r in steps if "step_seconds" in r][1:]
            if r["step_seconds"] > UNEVEN * median and not r.get("profiled")]


def describe_slow_step(slow: dict) -> str:
    """One line for a slow step: its time, the host's, the host's largest phases, the collector's and the allocator's."""
    def sec(key):
        return f"{slow[key]:.3f} s" if slow.get(key) is not None else "?"
    line = f"  step {slow['step']}: {sec('step_seconds')}, host {sec('host_seconds')}"
    phases = slow.get("host_phases") or {}
    if phases:
        top = sorted(phases.items(), key=lambda kv: -kv[1])[:2]
        line += " (" + ", ".join(f"{name} {seconds:.3f} s" for name, seconds in top) + ")"
    line += f", garbage collector {sec('gc_seconds')}"
    if slow.get("alloc_retries") is not None:
        line += f", allocator retries {slow['alloc_retries']}, cudaMalloc calls {slow.get('device_allocs')}"
    system = slow.get("system") or {}
    if system.get("main_thread_cpu_s") is not None:  # since the log point before: the whole interval's
        line += (f"; interval: main thread CPU {system['main_thread_cpu_s']:.3f} s, "
                 f"{system['involuntary_switches']} involuntary switches, {system['minor_faults']} minor and "
                 f"{system['major_faults']} major faults, compactions {system['compactions']}, "
                 f"reclaims {system['reclaims']}, NUMA migrations {system['numa_migrations']}")
    return line


def profile_rows(rows: list[dict]) -> list[dict]:
    """One row per profiled variant, ms per step (rank 0): the step's wall time and GPU window, the main (compute)
    stream's busy and idle time (idle split into another stream busy and every stream idle), the main stream's
    time by kernel kind, and the other streams' busy time."""
    table = []
    for r in rows:
        p = r.get("profile")
        if not p or "main_stream" not in p:
            continue
        main = next(s for s in p["streams"] if s["main"])
        row = {"variant": r["variant"], "wall": p["wall_ms"], "window": p["window_ms"], "main busy": p["main_busy_ms"],
               "idle, other busy": p["main_idle_other_stream_busy_ms"], "idle, all idle": p["main_idle_all_idle_ms"],
               "other streams busy": sum(s["busy_ms"] for s in p["streams"] if not s["main"])}
        row.update({f"main: {kind}": ms for kind, ms in main["kinds_ms"].items()})
        table.append(row)
    return table


def run_variant(name: str, executors: str, env: dict, a, overrides: list[str]) -> dict:
    out_dir = Path(a.work) / "".join(c if c.isalnum() else "_" for c in name)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("summary.json", "metrics.jsonl", "explain.json", "profile.json"):
        (out_dir / stale).unlink(missing_ok=True)
    # --standalone: a rendezvous on a free local port
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(a.nproc)]
                if a.nproc > 1 else [sys.executable])
    cmd = [*launcher, "-m", "thunder_tk.cli", "pretrain", "--config", a.config, "--no-checkpoint",
           "--devices", str(a.nproc), "--compiler.executors", executors, "--out_dir", str(out_dir),
           "--train.log_interval", "1", *overrides]
    log = out_dir / "run.log"
    t0 = time.perf_counter()
    with log.open("w") as f:
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **env})
        try:
            rc = proc.wait(timeout=a.timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = "timeout"
    row = {"variant": name, "executors": executors, "env": env, "wall_s": time.perf_counter() - t0, "rc": rc}
    summary_path = out_dir / "summary.json"
    if rc != 0 or not summary_path.exists():
        tail = log.read_text().splitlines()[-15:]
        print(f"{name}: failed ({rc}); last lines of {log}:\n" + "\n".join(tail), flush=True)
        return row
    s = json.loads(summary_path.read_text())
    steps = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    first = next((r for r in steps if r.get("step") == 1), {})
    row.update({
        "tokens_per_s_per_gpu": s["tokens_per_s_per_device_after_first_step"],
        # From the median step: the variants' steady pace, which a few stalled steps do not move (8-layer Llama-2-7B
        # on 4x H200: steps of 0.204 s with two or three of 0.65-0.90 s among 39 put the mean 13-23% lower).
        "tokens_per_s_per_gpu_median_step": s.get("tokens_per_s_per_device_median_step"),
        "step_s_median": s.get("step_seconds_median_after_first_step"),
        "step_s_max": s.get("step_seconds_max_after_first_step"),
        "mfu": s["mfu_after_first_step"],
        "peak_gib": s["peak_memory_gib"],
        "first_step_s": first.get("step_seconds"),
        "final_loss": s["final_loss"],
        "steps": s["steps"], "world_size": s["world_size"], "seq_len": s["seq_len"],
        "global_batch_size": s["global_batch_size"], "device": s["device"],
        # What the run's tk settings were, the variant's own and those it inherited or pretrain chose.
        "tk_environment": s.get("tk_environment"),
    })
    row["slow_steps"] = slow_steps(steps, row["step_s_median"])
    profile = out_dir / "profile.json"  # THUNDER_TK_PROFILE_STEPS: rank 0's GPU time by stream and kernel kind
    if profile.exists():
        row["profile"] = json.loads(profile.read_text())
    explain = out_dir / "explain.json"
    if explain.exists():
        rows = json.loads(explain.read_text())["rows"]
        row["tk_claimed"] = sorted({r["symbol"] for r in rows if r["claimed_by_tk"]})
    return row


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", required=True)
    p.add_argument("--nproc", type=int, default=1, help="GPUs (torchrun processes)")
    p.add_argument("--only", nargs="*", choices=list(VARIANTS), default=list(DEFAULT_VARIANTS),
                   help=f"variants to run, in order (default: {', '.join(DEFAULT_VARIANTS)})")
    p.add_argument("--timeout", type=float, default=600, help="seconds per variant")
    p.add_argument("--work", default="out/pretrain_compare")
    p.add_argument("--json", default="out/pretrain_compare.json")
    p.add_argument("--png")
    a, overrides = p.parse_known_args()
    if overrides[:1] == ["--"]:
        overrides = overrides[1:]
    rows = []
    for name in a.only:
        executors, env = VARIANTS[name]
        extra = CONFIG_VARIANTS[name][2] if name in CONFIG_VARIANTS else []
        rows.append(run_variant(name, executors, env, a, [*overrides, *extra]))
        print(json.dumps(rows[-1]), flush=True)
    ok = {r["variant"]: r for r in rows if "tokens_per_s_per_gpu" in r}
    base = ok.get("thunder default")
    for r in ok.values():
        r["vs_thunder_default"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"] if base else None
        r["vs_thunder_default_median_step"] = (
            r["tokens_per_s_per_gpu_median_step"] / base["tokens_per_s_per_gpu_median_step"]
            if base and r.get("tokens_per_s_per_gpu_median_step") and base.get("tokens_per_s_per_gpu_median_step")
            else None)
    print(f"{a.config} on {a.nproc} GPU(s), overrides {' '.join(overrides) or '-'}")
    if ok:
        table = list(ok.values())
        print_table(table, ["variant", "tokens_per_s_per_gpu", "tokens_per_s_per_gpu_median_step", "mfu", "peak_gib",
                            "first_step_s", "step_s_median", "step_s_max", "final_loss", "vs_thunder_default",
                            "vs_thunder_default_median_step"])
        for r in table:
            if r.get("slow_steps"):  # steps over UNEVEN x the median (slow_steps)
                print(f"{r['variant']}: uneven steps (slowest {r['step_s_max']:.3f} s against a median of "
                      f"{r['step_s_median']:.3f} s): compare the variants by the median step")
                for slow in r["slow_steps"]:
                    print(describe_slow_step(slow))
        profiled = profile_rows(table)
        if profiled:
            columns = list(dict.fromkeys(k for row in profiled for k in row))
            print(f"\nGPU time per step (ms, rank 0, profiled steps; {ENV_PROFILE}):")
            print_table([{c: row.get(c, 0.0) for c in columns} for row in profiled], columns)
        tk = ok.get("tk")
        if tk and base:
            ratio = tk["vs_thunder_default"]
            memory = (f"; peak memory {tk['peak_gib']:.1f} vs {base['peak_gib']:.1f} GiB"
                      if tk["peak_gib"] is not None and base["peak_gib"] is not None else "")
            median = tk.get("vs_thunder_default_median_step")
            print(f"goal tk >= 1.15x Thunder default: {ratio:.2f}x ({'met' if ratio >= 1.15 else 'not met'})"
                  + (f", by the median step {median:.2f}x" if median else "") + memory)
        if tk and "7b" in a.config.lower():
            print(f"published LitGPT + Thunder Llama-2-7B on 8x H100: {PUBLISHED_7B_TOKENS_PER_GPU / 1e3:.1f}k "
                  f"tokens/s/GPU; tk here {tk['tokens_per_s_per_gpu'] / 1e3:.1f}k")
    write_results(a.json, "pretrain_compare", rows)
    if a.png and ok:
        bar_chart(a.png, f"{Path(a.config).stem} on {a.nproc} GPU(s): tokens/s per GPU", list(ok),
                  {"tokens/s/GPU": [r["tokens_per_s_per_gpu"] for r in ok.values()]}, "tokens/s per GPU")
    return 0 if len(ok) == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main())
