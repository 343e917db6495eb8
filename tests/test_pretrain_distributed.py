"""Thunder FSDP through `thunder-tk pretrain` with two CPU processes (gloo): same losses as one process, and a
resumed run continues bit-identically. The same code path runs NCCL on GPUs."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytest.importorskip("litgpt")

MICRO = {
    "model_config": {"name": "micro", "block_size": 32, "vocab_size": 128, "padded_vocab_size": 128, "n_layer": 1,
                     "n_head": 2, "n_query_groups": 2, "n_embd": 64, "head_size": 32, "bias": False,
                     "norm_class_name": "RMSNorm", "mlp_class_name": "LLaMAMLP", "intermediate_size": 128},
    "train": {"global_batch_size": 8, "micro_batch_size": 2, "max_seq_length": 32, "max_steps": 4,
              "lr_warmup_steps": 1, "log_interval": 1, "save_interval": 2,
              "tie_embeddings": True},  # one weight in two modules, sharded once and exported under both names
    # tk's AdamW (torch's path on the CPU) and its clip_grad_norm_, the squared norms summed over the ranks' shards
    "optimizer": {"class_path": "thunder_tk.optim.AdamW", "init_args": {"lr": 1e-3}},
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, name: str, nproc: int, *extra: str, env: dict | None = None) -> dict[int, float]:
    cfg = tmp_path / f"{name}.yaml"
    cfg.write_text(yaml.safe_dump({**MICRO, "devices": nproc, "out_dir": str(tmp_path / name)}))
    if nproc == 1:
        cmd = [sys.executable, "-m", "thunder_tk.cli", "pretrain", "--config", str(cfg), *extra]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
               str(_free_port()),
               "-m", "thunder_tk.cli", "pretrain", "--config", str(cfg), *extra]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, **(env or {})})
    assert r.returncode == 0, r.stderr[-3000:]
    return _losses(tmp_path / name)


def _losses(out_dir: Path) -> dict[int, float]:
    """A run's training losses by step, from its metrics.jsonl."""
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["loss"] for row in rows if "loss" in row}


def _grad_norms(out_dir: Path) -> dict[int, float]:
    """A run's gradient norms (before clipping) by step, from its metrics.jsonl."""
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["grad_norm"] for row in rows if "loss" in row}


@pytest.fixture(scope="module")
def single_run(tmp_path_factory) -> tuple[Path, dict[int, float]]:
    """The one-process run both tests compare with: its out_dir's parent and its losses by step."""
    root = tmp_path_factory.mktemp("one_process")
    return root, _run(root, "single", 1)


def test_two_process_fsdp_matches_one_process_and_resumes(tmp_path, single_run):
    single_root, single = single_run
    # Each rank on its own share of the CPUs (THUNDER_TK_CPU_AFFINITY): the same losses, the binding recorded.
    fsdp = _run(tmp_path, "fsdp", 2, env={"THUNDER_TK_CPU_AFFINITY": "exclusive"})
    for step in (1, 2, 3, 4):
        assert fsdp[step] == pytest.approx(single[step], rel=1e-4)
    # The global gradient norm that clipping used: the two ranks' shards together give the one process's.
    norms, single_norms = _grad_norms(tmp_path / "fsdp"), _grad_norms(single_root / "single")
    assert all(single_norms[s] > 0 for s in (1, 2, 3, 4)), single_norms
    for step in (1, 2, 3, 4):
        assert norms[step] == pytest.approx(single_norms[step], rel=1e-4)
    # Several processes: tk's kernel settings for FSDP, where the environment leaves them unset.
    from thunder_tk.pretrain import FSDP_KERNEL_SETTINGS

    expected = {k: v for k, v in FSDP_KERNEL_SETTINGS.items() if k not in os.environ}
    assert json.loads((tmp_path / "fsdp" / "summary.json").read_text())["kernel_settings"] == expected
    assert json.loads((single_root / "single" / "summary.json").read_text())["kernel_settings"] == {}
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    if allowed:
        bound = json.loads((tmp_path / "fsdp" / "summary.json").read_text())["cpus_bound"]
        assert bound == max(1, allowed // 2)
    shards = sorted(p.name for p in (tmp_path / "fsdp" / "checkpoints" / "step-00000004").iterdir())
    assert shards == ["rank0.pt", "rank1.pt"]
    # The LitGPT checkpoint (out_dir/final): the ranks' shards put together, bit for bit, under LitGPT's keys, and
    # the one-process run's weights to rounding.
    import torch

    exported = torch.load(tmp_path / "fsdp" / "final" / "lit_model.pth", weights_only=True)
    single_weights = torch.load(single_root / "single" / "final" / "lit_model.pth", weights_only=True)
    assert list(exported) == list(single_weights)
    parts = [torch.load(tmp_path / "fsdp" / "checkpoints" / "step-00000004" / f"rank{r}.pt",
                        weights_only=False)["model"] for r in (0, 1)]
    for k, full in exported.items():
        # the tied embedding's one parameter is sharded (and saved) once, under the output layer's name
        shard = f"model.{k}" if k != "transformer.wte.weight" else "model.lm_head.weight"
        assert full.shape == single_weights[k].shape, k
        assert torch.equal(full, torch.cat([parts[0][shard], parts[1][shard]])[: full.shape[0]]), k
        torch.testing.assert_close(full, single_weights[k], rtol=1e-3, atol=1e-5)
    assert torch.equal(exported["transformer.wte.weight"], exported["lm_head.weight"])
    # ... and `thunder-tk export` puts the same together offline from the ranks' files
    from thunder_tk.litgpt_checkpoint import export_run_checkpoint

    offline = torch.load(export_run_checkpoint(tmp_path / "fsdp", 4, tmp_path / "offline") / "lit_model.pth",
                         weights_only=True)
    assert list(offline) == list(exported) and all(torch.equal(offline[k], exported[k]) for k in exported)

    # train.max_time on two ranks: both stop after the same step (the main rank's verdict, all-reduced and read one
    # step later), save and export, and neither waits on the other
    timed = _run(tmp_path, "timed", 2, "--train.max_time", "1e-9", "--train.max_steps", "50")
    assert sorted(timed) == [1, 2]
    summary = json.loads((tmp_path / "timed" / "summary.json").read_text())
    assert (summary["steps"], summary["stopped_by"]) == (2, "train.max_time")
    assert (tmp_path / "timed" / "final" / "lit_model.pth").is_file()
    assert (tmp_path / "timed" / "checkpoints" / "latest").read_text().strip() == "step-00000002"

    # That run, resumed from the checkpoint saved where it stopped (step 2) and run to the config's max_steps (4),
    # continues the run that was never stopped bit for bit (steps 1 and 2, warm-up and the cosine's start, have the
    # same learning rate whatever max_steps is).
    resumed = _run(tmp_path, "timed", 2, "--resume")
    assert [resumed[s] for s in (1, 2, 3, 4)] == [fsdp[s] for s in (1, 2, 3, 4)]
    assert json.loads((tmp_path / "timed" / "summary.json").read_text())["steps"] == 4


def test_two_nodes_through_torchrun_rendezvous(tmp_path, single_run):
    """num_nodes: 2 with one process a node, started as on two machines (two torchrun launches, --nnodes 2 and each
    its --node_rank, meeting at one rendezvous address; here both on this host, sharing out_dir as a shared file
    system would): the same losses as one process, and a resumable checkpoint with both ranks' shards."""
    _, single = single_run
    cfg = tmp_path / "nodes.yaml"
    cfg.write_text(yaml.safe_dump({**MICRO, "devices": 1, "num_nodes": 2, "out_dir": str(tmp_path / "nodes")}))
    port = _free_port()
    launches = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "1", "--node_rank",
         str(node), "--master_addr", "127.0.0.1", "--master_port", str(port),
         "-m", "thunder_tk.cli", "pretrain", "--config", str(cfg)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for node in (0, 1)]
    results = [p.communicate(timeout=300) for p in launches]
    for p, (_, err) in zip(launches, results):
        assert p.returncode == 0, err[-3000:]
    losses = _losses(tmp_path / "nodes")
    for step in (1, 2, 3, 4):
        assert losses[step] == pytest.approx(single[step], rel=1e-4)
    summary = json.loads((tmp_path / "nodes" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 4
    shards = sorted(p.name for p in (tmp_path / "nodes" / "checkpoints" / "step-00000004").iterdir())
    assert shards == ["rank0.pt", "rank1.pt"]
