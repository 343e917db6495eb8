"""fold_rms_norm under Thunder FSDP on two CPU processes (gloo, tk's kernels stood in for in float64 math): with
ZeRO-2 and ZeRO-3 every norm of a 3-layer LitGPT model runs on tk, forward and backward, reading the all-gathered
weights and handing its weight gradients to the reduce-scatters, with the loss and gradients of the fuser's norm."""

from pathlib import Path

import pytest

from workers import run_two_ranks

pytest.importorskip("litgpt")

WORKER = Path(__file__).with_name("rms_norm_fsdp_worker.py")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    # One reference run with the fuser's norms: ZeRO-2 and ZeRO-3 shard alike, and the fuser's run under either gave
    # the same loss and gradient norms to the bit, so a second one (some 20 s of Thunder's tracing) adds nothing.
    return run_two_ranks(WORKER, ["zero2", "zero3", "zero2-off"], tmp_path_factory.mktemp("rms_norm_fsdp"))


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_norms_fold_under_fsdp_with_the_fusers_results(runs, strategy):
    folded, fuser = runs[strategy], runs["zero2-off"]
    assert folded["forward_norms"] == folded["backward_norms"] == 7  # 2 per layer and the final one
    assert fuser["forward_norms"] == fuser["backward_norms"] == 0
    assert folded["loss"] == pytest.approx(fuser["loss"], rel=1e-2)
    for name, norm in fuser["grads"].items():
        assert folded["grads"][name] == pytest.approx(norm, rel=2e-2), name
