"""Same-machine A/B of one benchmark: the installed thunder_tk against a reference build of another commit
(`scripts/ab_ref.sh <commit>` puts its tree in .ab_ref; gpu_run.sh installs it with `pip --target`). The two run
in turns, each in a child process, so differences between machines (a few percent between our H100 hosts) cancel.

    python3 benchmarks/ab_compare.py --ref-site /tmp/ref_site [--rounds 2] -- attention --no-backward
    python3 benchmarks/ab_compare.py --knob THUNDER_TK_SOME_KNOB=0,1,2 --rounds 3 attention --no-backward

With --knob, one build runs once per value of an environment variable instead (a kernel variant picked at run
time), the first value the reference.

Prints, per point and tk metric (TFLOP/s, GB/s), the median over rounds for each side and current / reference;
writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH_DIR = Path(__file__).parent
METRIC_SUFFIXES = ("_tflops", "_gbps", "_busbw")


def point_of(row: dict) -> str:
    """A row's identity: its descriptive fields (shape, flags), not its measurements."""
    parts = [f"{k}={v}" for k, v in row.items()
             if isinstance(v, (str, bool, int)) and k not in ("notes", "checked_against")]
    return " ".join(parts)


def tk_metrics(row: dict) -> dict[str, float]:
    return {k: v for k, v in row.items()
            if k.startswith("tk") and k.endswith(METRIC_SUFFIXES) and isinstance(v, (int, float))}


def run_side(bench: str, args: list[str], ref_site: str | None, out_json: Path, log,
             extra_env: dict[str, str] | None = None, name: str | None = None) -> list[dict]:
    env = dict(os.environ)
    env.update(extra_env or {})
    if ref_site:
        env["PYTHONPATH"] = ref_site + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    cmd = [sys.executable, str(BENCH_DIR / f"{bench}.py"), *args, "--json", str(out_json)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp")
    prefix = "".join(f"{k}={v} " for k, v in (extra_env or {}).items())
    log.write(f"$ {prefix}{'PYTHONPATH=' + ref_site + ' ' if ref_site else ''}{' '.join(cmd)}\n{r.stdout}{r.stderr}\n")
    if r.returncode != 0:
        who = name or ("reference" if ref_site else "current")
        raise SystemExit(f"{who} run failed (rc {r.returncode}): "
                         f"{(r.stderr or r.stdout).strip().splitlines()[-1:]}")
    return json.loads(out_json.read_text())["rows"]


def compare(runs: list[list[dict]], ref_runs: list[list[dict]]) -> list[dict]:
    """Per point and tk metric of the first run: medians of each side and their ratio."""
    results = []
    for i, row in enumerate(runs[0]):
        point = point_of(row)
        for metric in tk_metrics(row):
            cur = [rows[i][metric] for rows in runs if metric in rows[i]]
            ref = [rows[i].get(metric) for rows in ref_runs if i < len(rows) and point_of(rows[i]) == point]
            ref = [x for x in ref if isinstance(x, (int, float))]
            if not cur or not ref:
                continue
            c, f = statistics.median(cur), statistics.median(ref)
            results.append({"point": point, "metric": metric, "current": c, "reference": f, "ratio": c / f,
                            "current_all": cur, "reference_all": ref})
    return results


def print_results(bench: str, results: list[dict], label: str, rounds: int, current: str = "current"):
    print(f"\n{bench}: {current} vs {label} (medians of {rounds} alternating runs each)")
    for r in results:
        print(f"  {r['point']:<48} {r['metric']:<16} {r['current']:8.1f} {r['reference']:8.1f}  {r['ratio']:.3f}x")
    if results:
        gm = statistics.geometric_mean([r["ratio"] for r in results])
        print(f"geometric mean {current}/{label}: {gm:.3f} over {len(results)} values")


def main(argv: list[str] | None = None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ref-site", help="directory where the reference thunder_tk is installed")
    p.add_argument("--ref-label", default=None, help="name of the reference (default: .ab_ref/AB_COMMIT)")
    p.add_argument("--knob", help="NAME=V0,V1,...: instead of a reference build, run the installed package once per "
                                  "value of environment variable NAME, in turns, each compared with V0")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default="out/ab_compare.json")
    p.add_argument("bench", help="benchmark module in benchmarks/ (attention, gemm, ...)")
    p.add_argument("bench_args", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    if (a.knob is None) == (a.ref_site is None):
        p.error("give either --ref-site or --knob")
    Path(a.json).parent.mkdir(parents=True, exist_ok=True)
    runs_log = Path(a.json).with_name(Path(a.json).stem + "_runs.log")  # every child's output
    if a.knob is not None:
        name, _, values = a.knob.partition("=")
        values = [v for v in values.split(",") if v]
        if not name or len(values) < 2:
            p.error("--knob wants NAME=V0,V1[,...]")
        sides = {v: [] for v in values}
        with tempfile.TemporaryDirectory() as tmp, open(runs_log, "w") as log:
            for r in range(a.rounds):
                order = values[r % len(values):] + values[:r % len(values)]
                for v in order:
                    sides[v].append(run_side(a.bench, a.bench_args, None, Path(tmp) / f"{v}_{r}.json", log,
                                             {name: v}, f"{name}={v}"))
                    print(f"round {r + 1}/{a.rounds}: {name}={v} done", flush=True)
        by_value = {}
        for v in values[1:]:
            results = compare(sides[v], sides[values[0]])
            print_results(a.bench, results, f"{name}={values[0]}", a.rounds, f"{name}={v}")
            by_value[v] = results
        Path(a.json).write_text(json.dumps({"bench": a.bench, "args": a.bench_args, "knob": name,
                                            "reference": values[0], "rounds": a.rounds, "results": by_value},
                                           indent=1))
        return
    label = a.ref_label
    if label is None:
        stamp = Path(".ab_ref/AB_COMMIT")
        label = stamp.read_text().strip() if stamp.exists() else "reference"
    runs: dict[str, list[list[dict]]] = {"current": [], "reference": []}
    with tempfile.TemporaryDirectory() as tmp, open(runs_log, "w") as log:
        for r in range(a.rounds):
            order = ("current", "reference") if r % 2 == 0 else ("reference", "current")
            for side in order:
                rows = run_side(a.bench, a.bench_args, a.ref_site if side == "reference" else None,
                                Path(tmp) / f"{side}{r}.json", log)
                runs[side].append(rows)
                print(f"round {r + 1}/{a.rounds}: {side} done", flush=True)
    results = compare(runs["current"], runs["reference"])
    print_results(a.bench, results, label, a.rounds)
    Path(a.json).write_text(json.dumps({"bench": a.bench, "args": a.bench_args, "reference": label,
                                        "rounds": a.rounds, "results": results}, indent=1))


if __name__ == "__main__":
    main()
