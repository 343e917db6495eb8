"""thunder_tk.thunder_fixes: Thunder 0.2.6's `no_autocast` restored the autocast state it saw when it decorated a
trace, so a model jitted under autocast left autocast on after every call of its backward (on the autograd thread:
the GPU's bf16-mixed backward then ran declined GEMMs and Thunder's SDPA backward in float16). Importing thunder_tk
replaces it where the installed Thunder has the bug; every trace jitted afterwards restores the caller's state."""

import pytest
import thunder
import torch
from thunder.executors import torchex

import thunder_tk  # noqa: F401  (importing it applies the fixes)
from thunder_tk import thunder_fixes


def test_the_installed_thunder_needed_the_fix_and_has_it():
    assert "no_autocast" in thunder_fixes.APPLIED, "Thunder's no_autocast restores the call's state: drop the fix"
    assert not thunder_fixes.restores_autocast_at_call(thunder_fixes.REPLACED["no_autocast"])
    assert torchex.no_autocast is thunder_fixes.no_autocast
    assert thunder_fixes.restores_autocast_at_call(torchex.no_autocast)
    assert thunder_fixes.apply() == []  # applying again changes nothing


def test_fixed_decorator_turns_both_devices_off_inside_and_restores_each():
    seen = []

    def probe():
        seen.append((torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")))

    wrapped = thunder_fixes.no_autocast(probe)
    for cpu, cuda in [(True, False), (False, True), (True, True)]:
        torch.set_autocast_enabled("cpu", cpu)
        torch.set_autocast_enabled("cuda", cuda)
        try:
            wrapped()
            assert (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")) == (cpu, cuda)
        finally:
            torch.set_autocast_enabled("cpu", False)
            torch.set_autocast_enabled("cuda", False)
    assert seen == [(False, False)] * 3

    def fails():
        raise ValueError("inside")

    torch.set_autocast_enabled("cpu", True)
    try:
        with pytest.raises(ValueError, match="inside"):
            thunder_fixes.no_autocast(fails)()
        assert torch.is_autocast_enabled("cpu")
    finally:
        torch.set_autocast_enabled("cpu", False)


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(32, 64)
        self.b = torch.nn.Linear(64, 32)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)) * 2)


@pytest.mark.parametrize("fixed", [True, False], ids=["fixed", "thunder-0.2.6"])
def test_a_backward_jitted_under_autocast_runs_its_ops_without_autocast(standin_nvfuser, monkeypatch, fixed):
    """Jitted (its fusion regions compiled) under CPU autocast, the backward called outside it: with Thunder's own
    decorator each region turns autocast back on as it returns, so the GEMMs after it (outside the fuser's regions,
    as with nvFuser) run under autocast; with the fix every op of the backward runs without."""
    if not fixed:
        monkeypatch.setattr(torchex, "no_autocast", thunder_fixes.REPLACED["no_autocast"])
    model = MLP()
    jm = thunder.jit(model, executors=[standin_nvfuser])
    x = torch.randn(4, 32)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = jm(x)
    assert out.dtype == torch.bfloat16 and not torch.is_autocast_enabled("cpu")
    under_autocast = []
    matmul = torch.matmul

    def spy(*args, **kwargs):  # the backward's GEMMs, as the trace calls them
        under_autocast.append(torch.is_autocast_enabled("cpu"))
        return matmul(*args, **kwargs)

    monkeypatch.setattr(torch, "matmul", spy)
    try:
        out.float().sum().backward()
    finally:
        torch.set_autocast_enabled("cpu", False)
    assert under_autocast, "the backward ran no torch.matmul"
    assert any(under_autocast) is not fixed, under_autocast
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())
