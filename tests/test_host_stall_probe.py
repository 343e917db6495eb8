"""scripts/host_stall_probe.py on the CPU: one process per mode, its report's shape (the GPU hosts run the real one)."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_probe_reports_each_mode_and_process(tmp_path):
    out = tmp_path / "probe.json"
    r = subprocess.run([sys.executable, str(ROOT / "scripts" / "host_stall_probe.py"), "--procs", "1", "--seconds",
                        "0.3", "--threshold", "0.5", "--modes", "in-process", "--json", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    report = json.loads(out.read_text())
    (mode,) = report["modes"]
    assert mode["mode"] == "in-process" and mode["env"] == {"TORCHINDUCTOR_COMPILE_THREADS": "1"}
    (proc,) = mode["processes"]
    assert proc["compile_threads"] == 1 and proc["iterations"] > 0 and proc["compile_s"] > 0
    assert all(g["gap_s"] > 0.5 for g in proc["gaps"]) and proc["max_gap_s"] >= 0
    assert "in-process: compile-worker processes at most" in r.stdout
