"""Launching a test's worker script on two CPU processes (torchrun, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_two_ranks(worker: Path, variants: list[str], tmp_path: Path, timeout: int = 400) -> dict[str, dict]:
    """`worker v1,v2,... out.json` under torchrun with two processes (a rendezvous on a free local port): the worker
    runs each variant in turn in one process group (the processes' start-up, torch's and Thunder's imports, once);
    returns what rank 0 wrote, by variant. The tests directory is on the workers' path (for `standins`)."""
    out = tmp_path / f"{'+'.join(variants)}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
           ",".join(variants), str(out)]
    tests = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    results = json.loads(out.read_text())
    assert sorted(results) == sorted(variants), sorted(results)
    return results


def run_variants(run_one, variants: str, out: str) -> None:
    """A worker's main: `run_one(variant)` for each of the comma-separated `variants` in one process group, rank
    0's results written to `out` as JSON by variant."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    results = {v: run_one(v) for v in variants.split(",")}
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()
