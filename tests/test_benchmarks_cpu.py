"""The end-to-end benchmarks' code paths on a CPU (tiny models, gloo): they run on GPU hosts only once per
session, so a broken path must show here first."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("litgpt")

ROOT = Path(__file__).resolve().parents[1]


def test_litgpt_step_fsdp_paths(tmp_path):
    out = tmp_path / "step.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(ROOT / "benchmarks" / "litgpt_step.py"), "--fsdp", "--device", "cpu", "--model", "pythia-14m",
           "--n-layer", "1", "--seq", "32", "--batch", "1", "--warmup", "1", "--steps", "1",
           "--only", "eager", "thunder default", "thunder [tk]", "--json", str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [row["variant"] for row in rows] == ["eager", "thunder default", "thunder [tk]"]
    assert all(row["world_size"] == 2 and row["tokens_per_s"] > 0 for row in rows)
    losses = [row["loss"] for row in rows]  # same model, same batches: the same first-step loss
    assert max(losses) - min(losses) < 1e-3, losses


def test_pretrain_compare_runs_both_variants(tmp_path):
    out = tmp_path / "compare.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "pretrain_compare.py"), "--config",
           str(ROOT / "litgpt_configs" / "tiny.yaml"), "--work", str(tmp_path / "work"), "--json", str(out),
           "--", "--train.max_steps", "2", "--train.global_batch_size", "2", "--train.micro_batch_size", "2"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert set(rows) == {"tk", "thunder default"}
    assert rows["tk"]["final_loss"] == pytest.approx(rows["thunder default"]["final_loss"], rel=1e-4)
    assert "goal tk >= 1.15x Thunder default" in r.stdout
    assert not list((tmp_path / "work").rglob("*.pt"))  # --no-checkpoint
