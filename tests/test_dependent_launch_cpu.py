"""Programmatic dependent launch, the parts that run without a GPU: the switch in thunder_tk.ops (on the stand-in
build, and its error where no kernels are built), THUNDER_TK_DEPENDENT_LAUNCH's values, and check_kernels' test
that every kernel of a dependently launched source waits for the grid before it."""

import importlib.util
from pathlib import Path

import pytest

from standins import StandinBuild
from thunder_tk import _extension, ops

ROOT = Path(__file__).resolve().parents[1]


def test_switch_on_the_standin_build(monkeypatch):
    StandinBuild(monkeypatch)
    assert ops.dependent_launch() is True  # the default
    with ops.dependent_launches(False):
        assert ops.dependent_launch() is False
        with ops.dependent_launches(True):
            assert ops.dependent_launch() is True
        assert ops.dependent_launch() is False
    assert ops.dependent_launch() is True
    assert ops.set_dependent_launch(False) is True
    assert ops.set_dependent_launch(True) is False
    with pytest.raises(TypeError, match="expected a bool, got int"):
        ops.set_dependent_launch(0)


def test_switch_without_kernels(kernels_not_built):
    assert ops.dependent_launch() is False
    with pytest.raises(ops.KernelUnavailableError, match="nvcc"):
        ops.set_dependent_launch(False)


@pytest.mark.parametrize("value, on", [(None, True), ("", True), ("1", True), ("on", True), ("TRUE", True),
                                       ("0", False), ("off", False), ("No", False), (" false ", False)])
def test_environment_values(monkeypatch, value, on):
    if value is None:
        monkeypatch.delenv(_extension.DEPENDENT_LAUNCH_ENV, raising=False)
    else:
        monkeypatch.setenv(_extension.DEPENDENT_LAUNCH_ENV, value)
    assert _extension.dependent_launch_from_environment() is on


def test_environment_typo_is_named(monkeypatch):
    monkeypatch.setenv(_extension.DEPENDENT_LAUNCH_ENV, "maybe")
    with pytest.raises(ValueError, match="THUNDER_TK_DEPENDENT_LAUNCH='maybe'"):
        _extension.dependent_launch_from_environment()


def test_check_kernels_finds_a_kernel_that_does_not_wait():
    spec = importlib.util.spec_from_file_location("check_kernels", ROOT / "scripts" / "check_kernels.py")
    check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(check)
    ptx = """
.visible .entry _Z7waitingv(
    .param .u64 a
)
{
    griddepcontrol.wait;
    ld.global.u32 %r1, [%rd1];
    ret;
}
.visible .entry _Z10forgettingv(
    .param .u64 a
)
{
    ld.global.u32 %r1, [%rd1];
    griddepcontrol.launch_dependents;
    ret;
}
.entry _Z5localv()
{
    ret;
}
"""
    assert check.entries_without_wait(ptx) == ["_Z10forgettingv", "_Z5localv"]
    assert check.entries_without_wait("") == []
    assert set(check.PLAIN_ORDER) == {"kernels/collectives/", "kernels/selftest/"}
