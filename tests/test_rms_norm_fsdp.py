"""fold_rms_norm under Thunder FSDP on two CPU processes (gloo, tk's kernels stood in for in float64 math): with
ZeRO-2 and ZeRO-3 every norm of a 3-layer LitGPT model runs on tk, forward and backward, reading the all-gathered
weights and handing its weight gradients to the reduce-scatters, with the loss and gradients of the fuser's norm."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("litgpt")

WORKER = Path(__file__).with_name("rms_norm_fsdp_worker.py")


def _run(tmp_path: Path, variant: str) -> dict:
    out = tmp_path / f"{variant}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", str(WORKER),
           variant, str(out)]
    tests = str(Path(__file__).parent)
    env = {**os.environ, "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_norms_fold_under_fsdp_with_the_fusers_results(tmp_path, strategy):
    folded, fuser = _run(tmp_path, strategy), _run(tmp_path, f"{strategy}-off")
    assert folded["forward_norms"] == folded["backward_norms"] == 7  # 2 per layer and the final one
    assert fuser["forward_norms"] == fuser["backward_norms"] == 0
    assert folded["loss"] == pytest.approx(fuser["loss"], rel=1e-2)
    for name, norm in fuser["grads"].items():
        assert folded["grads"][name] == pytest.approx(norm, rel=2e-2), name
