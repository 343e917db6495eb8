"""tk's collectives across GPUs: each test runs tests/gpu/collectives_worker.py under torchrun, one process per
GPU (up to 8). Skipped with fewer than two GPUs."""

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs at least 2 GPUs"),
]

WORKER = Path(__file__).with_name("collectives_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _environment(**extra: str) -> dict:
    """This process's environment with NVLink multicast kept off (NCCL, torch symmetric memory, NVSHMEM)."""
    return {**os.environ, "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
            "NVSHMEM_DISABLE_NVLS": "1", **extra}


def torchrun(*cases: str, timeout: int = 400) -> str:
    nproc = min(torch.cuda.device_count(), 8)
    env = _environment()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), str(WORKER), *cases]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    print(r.stdout[-6000:])
    assert r.returncode == 0, (r.stdout[-3000:] + "\n" + r.stderr[-6000:])
    return r.stdout


def test_all_gather_and_reduce_scatter_match_nccl():
    out = torchrun("kernels")
    assert "ok: 1 GiB all_gather and reduce_scatter" in out


def test_copy_engine_collectives_match_nccl():
    out = torchrun("copy_engine")
    assert "ok: copy-engine channel captured in a CUDA graph" in out
    assert "ok: copy engine async with compute, and 1 GiB" in out


def test_a_missing_peer_times_out_with_a_clear_error():
    out = torchrun("timeout", timeout=200)
    assert "ok: timeout after" in out and "ok: other channels still work" in out


def test_thunder_fsdp_runs_collectives_on_tk_with_overlap():
    out = torchrun("thunder", timeout=500)
    assert "ok: FSDP 30 steps" in out


def test_thunder_fsdp_in_cuda_graphs_trains_as_op_by_op():
    out = torchrun("thunder_graphs", timeout=500)
    for strategy in ("ZERO2", "ZERO3"):
        for mode in ("graphs", "graphs, 64 KiB of reduce-scatters", "graphs, NCCL"):
            assert f"ok: FSDP {strategy} in CUDA graphs ({mode})" in out, (strategy, mode)


def _pretrain(tmp_path: Path, name: str, disable: str, *extra: str) -> tuple[list[float], dict]:
    import json

    nproc = min(torch.cuda.device_count(), 8)
    env = _environment(THUNDER_TK_DISABLE=disable)
    out_dir = tmp_path / name
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(_free_port()), "-m", "thunder_tk.cli", "pretrain", "--config",
           str(Path(__file__).parents[2] / "litgpt_configs" / "tiny.yaml"), "--devices", str(nproc),
           "--train.global_batch_size", str(4 * nproc), "--train.max_steps", "30", "--train.log_interval", "1",
           "--train.save_interval", "1000", "--out_dir", str(out_dir), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=500, env=env)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [row["loss"] for row in rows if "loss" in row]
    return losses, json.loads((out_dir / "explain.json").read_text())


def test_pretrain_fsdp_losses_match_torch_collectives(tmp_path):
    pytest.importorskip("litgpt")
    with_nccl, report_nccl = _pretrain(tmp_path, "nccl", "collective")
    with_tk, report_tk = _pretrain(tmp_path, "tk", "")
    assert len(with_tk) == len(with_nccl) == 30
    for a, b in zip(with_nccl, with_tk):
        assert abs(a - b) <= 2e-2 * abs(a), (with_nccl, with_tk)  # bf16 model; reduce-scatter rounding differs
    tk_colls = [r for r in report_tk["rows"] if r["symbol"] in ("all_gather", "reduce_scatter")]
    assert tk_colls and all(r["claimed_by_tk"] for r in tk_colls), tk_colls
    nccl_colls = [r for r in report_nccl["rows"] if r["symbol"] in ("all_gather", "reduce_scatter")]
    assert nccl_colls and not any(r["claimed_by_tk"] for r in nccl_colls)


def test_pretrain_fsdp_in_cuda_graphs_matches_op_by_op(tmp_path):
    """`thunder-tk pretrain` on every GPU with compiler.cuda_graphs: the op-by-op run's losses, step by step, with
    tk's collectives inside the graphs."""
    import json

    pytest.importorskip("litgpt")
    plain, _ = _pretrain(tmp_path, "plain", "")
    replayed, _ = _pretrain(tmp_path, "graphs", "", "--compiler.cuda_graphs", "true")
    assert len(plain) == len(replayed) == 30
    for a, b in zip(replayed, plain):
        assert abs(a - b) <= 2e-3 * abs(b), (replayed, plain)
    summary = json.loads((tmp_path / "graphs" / "summary.json").read_text())
    assert summary["cuda_graphs_captured"] >= 2, summary
