"""tk's FSDP schedule (thunder_tk/fsdp_schedule.py) on two CPU processes (gloo): the collectives of the traces
that run are issued in the order of need, waits sit just before their readers, the reduce-scatters go out during
the backward, and losses and gradients are those of the fuser's order. Thunder's default executors keep their own
order (the baseline is not changed)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("litgpt")

WORKER = Path(__file__).with_name("fsdp_schedule_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, variant: str) -> dict:
    out = tmp_path / f"{variant}.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
           str(_free_port()), str(WORKER), variant, str(out)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=400, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fsdp_schedule")
    return {v: _run(tmp, v) for v in ("tk", "tk-fused-order", "default")}


def test_gathers_in_the_order_of_need_and_waits_before_their_readers(runs):
    tk, fused = runs["tk"], runs["tk-fused-order"]
    # The fuser's order: parameters in module order, the embedding (read first) among the last; every wait before
    # the first GEMM, so the forward waits for every gather.
    assert fused["gathers"][0] == "t_model_lm_head_weight"
    assert max(fused["forward_waits"]) < fused["forward_first_gemm"]
    # tk's: the embedding gathered before any layer's GEMM weights, the lm_head's last; waits spread through the
    # forward, each before its reader.
    gathers = tk["gathers"]
    assert gathers[-1] == "t_model_lm_head_weight"
    assert gathers.index("t_model_transformer_wte_weight") < gathers.index("t_model_transformer_h_0_attn_qkv_weight")
    layer = [gathers.index(f"t_model_transformer_h_{i}_attn_qkv_weight") for i in range(3)]
    assert layer == sorted(layer)
    assert max(tk["forward_waits"]) > tk["forward_first_gemm"]
    assert sorted(gathers) == sorted(fused["gathers"])


def test_reduce_scatters_go_out_during_the_backward(runs):
    tk, fused = runs["tk"], runs["tk-fused-order"]
    assert len(tk["backward_reduce_scatters"]) == len(fused["backward_reduce_scatters"]) > 0
    assert min(tk["backward_reduce_scatters"]) < tk["backward_last_gemm"]  # the first ones before the last GEMM
    assert min(tk["backward_waits"]) > tk["backward_last_gemm"]  # their waits after the compute (read by the return)


def test_same_losses_and_gradients_in_either_order(runs):
    tk, fused = runs["tk"], runs["tk-fused-order"]
    assert tk["loss"] == pytest.approx(fused["loss"], rel=1e-6)
    assert tk["grads"].keys() == fused["grads"].keys()
    for name, norm in tk["grads"].items():
        assert norm == pytest.approx(fused["grads"][name], rel=1e-5), name


def test_the_baseline_keeps_its_order(runs):
    default = runs["default"]
    assert default["gathers"][0] == "t_model_lm_head_weight"
    assert max(default["forward_waits"]) < default["forward_first_gemm"]
    assert default["loss"] == pytest.approx(runs["tk"]["loss"], rel=1e-5)
