"""Launching a test's worker script on two CPU processes (torchrun, gloo)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path


def run_two_ranks(worker: Path, variant: str, tmp_path: Path, timeout: int = 400) -> dict:
    """`worker variant out.json` under torchrun with two processes (a rendezvous on a free local port); the JSON
    rank 0 wrote. The tests directory is on the workers' path (for `standins`)."""
    out = tmp_path / f"{variant}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(worker),
           variant, str(out)]
    tests = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())
