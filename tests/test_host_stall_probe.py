"""scripts/host_stall_probe.py on the CPU: one process per mode, its report's shape (the GPU hosts run the real one)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_probe_reports_each_mode_and_process(tmp_path):
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_stall_probe.py"), "--procs", "1", "--seconds",
                        "0.3", "--threshold", "0.5", "--quiesce-seconds", "1", "--modes", "in-process", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    (mode,) = report["modes"]
    assert mode["mode"] == "in-process" and mode["env"] == {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    (proc,) = mode["processes"]
    assert proc["compile_threads"] == 1 and proc["iterations"] > 0 and proc["compile_s"] > 0
    # one clock for the gaps and the pool's samples: seconds since the launch
    assert proc["compiled_at_s"] >= proc["compile_s"] and proc["pool_job_at_s"] is None  # no pool in-process
    assert report["quiesce_s"] == 1.0
    assert mode["worker_changes"] and all(len(c) == 2 and c[0] >= 0 for c in mode["worker_changes"])
    assert all(g["gap_s"] > 0.5 for g in proc["gaps"]) and proc["max_gap_s"] >= 0
    assert "in-process: compile-worker processes at most" in r.stdout
