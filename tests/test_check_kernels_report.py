"""scripts/check_kernels.py --report on a build's report made up here (csrc/CMakeLists.txt's launcher leaves, per
source, compile.log, status and the PTX): a clean source passes; serialised wgmma, spills over the source's budget,
a kernel that never waits for the grid before it, a failed compile and a source missing from the report are
problems; sources launched in plain stream order need no wait. No nvcc: nothing is compiled."""
import importlib
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def kernel(name: str) -> str:
    return f"_ZN2tk4test{len(name)}{name}ILi64EEEvPf"


def ptxas(name: str, loads: int = 0, registers: int = 168, before: str = "") -> str:
    """ptxas -v's report of one kernel, as nvcc prints it on stderr."""
    return (f"{before}ptxas info    : Compiling entry function '{kernel(name)}' for 'sm_90a'\n"
            f"ptxas info    : Function properties for {kernel(name)}\n"
            f"    0 bytes stack frame, {loads} bytes spill stores, {loads} bytes spill loads\n"
            f"ptxas info    : Used {registers} registers, used 1 barriers\n"
            "ptxas info    : Compile time = 12.3 ms\n")


def ptx(*entries: tuple[str, bool]) -> str:
    """A PTX file with one .entry per (kernel, whether it waits for the grid before it)."""
    head = ".version 8.8\n.target sm_90a\n.address_size 64\n\n"
    return head + "".join(f".visible .entry {kernel(name)}(\n\t.param .u64 p0\n)\n{{\n"
                          + ("\tgriddepcontrol.wait;\n" if waits else "") + "\tret;\n}\n\n"
                          for name, waits in entries)


SERIALISED = ("ptxas info    : (C7512) Potential Performance Loss: wgmma.mma_async instructions are serialized due to "
              f"insufficient register resources for the wgmma pipeline in the function '{kernel('serial_kernel')}'\n")

# source under csrc: (compile.log, status, PTX); None: no report for it
REPORT = {
    "kernels/a/clean.cu": (ptxas("clean_kernel", registers=90), 0, ptx(("clean_kernel", True))),
    "kernels/a/serial.cu": (ptxas("serial_kernel", before=SERIALISED), 0, ptx(("serial_kernel", True))),
    "kernels/a/spill.cu": (ptxas("small_kernel", loads=20) + ptxas("spill_kernel", loads=40), 0,
                           ptx(("small_kernel", True), ("spill_kernel", True))),
    "kernels/a/nowait.cu": (ptxas("waits_kernel") + ptxas("nowait_kernel"), 0,
                            ptx(("waits_kernel", True), ("nowait_kernel", False))),
    "kernels/a/broken.cu": ("broken.cu(3): error: identifier \"x\" is undefined\n", 2, ""),
    "kernels/a/missing.cu": None,
    "kernels/selftest/plain.cu": (ptxas("plain_kernel", registers=8), 0, ptx(("plain_kernel", False))),
}


@pytest.fixture
def check_kernels(tmp_path, monkeypatch):
    """check_kernels with csrc/kernels made of REPORT's sources and a report of them in tmp_path/report."""
    monkeypatch.syspath_prepend(str(SCRIPTS))
    module = importlib.import_module("check_kernels")
    monkeypatch.setattr(module, "CSRC", tmp_path / "csrc")
    monkeypatch.setitem(module.SPILL_BUDGET, "kernels/a/spill.cu", 28)
    for rel, files in REPORT.items():
        (tmp_path / "csrc" / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "csrc" / rel).write_text("// made up by the test\n")
        if files is not None:
            log, status, kept = files
            at = tmp_path / "report" / rel
            at.mkdir(parents=True)
            (at / "compile.log").write_text(log)
            (at / "status").write_text(f"{status}\n")
            if kept:
                (at / f"{Path(rel).stem}.ptx").write_text(kept)
    return module


def test_problems_from_the_report(check_kernels, tmp_path, capsys):
    assert check_kernels.main(["--report", str(tmp_path / "report")]) == 1
    out, err = capsys.readouterr()
    problems = sorted(line.removeprefix("PROBLEM: ") for line in err.splitlines() if line.startswith("PROBLEM: "))
    assert len(problems) == 5, err
    assert problems[0].startswith("kernels/a/broken.cu does not compile")
    assert problems[1].startswith("kernels/a/missing.cu: no report in ")
    assert problems[2] == ("kernels/a/nowait.cu: nowait_kernelILi64E never waits for the grid before it "
                           "(pdl::wait_prior_grid), but tk launches it programmatically dependent")
    assert problems[3] == ("kernels/a/serial.cu: serial_kernelILi64E: ptxas serialises its wgmma "
                           "(C7512: insufficient register resources for the wgmma pipeline)")
    assert problems[4] == "kernels/a/spill.cu: spill_kernelILi64E: 40 bytes of spill loads (budget 28)"
    assert "kernels/a/clean.cu: clean_kernelILi64E: spill loads 0 B, 90 registers" in out.splitlines()
    assert "kernels/a/spill.cu: small_kernelILi64E: spill loads 20 B, 168 registers" in out.splitlines()
    assert "kernels/selftest/plain.cu: plain_kernelILi64E: spill loads 0 B, 8 registers" in out.splitlines()
    assert out.splitlines()[-1] == "check_kernels: 7 sources, 5 problems"


@pytest.mark.parametrize("only, problems", [("clean", 0), ("selftest", 0), ("missing", 1)])
def test_filter_picks_the_sources(check_kernels, tmp_path, capsys, only, problems):
    assert check_kernels.main(["--report", str(tmp_path / "report"), only]) == (1 if problems else 0)
    assert capsys.readouterr().out.splitlines()[-1] == f"check_kernels: 1 sources, {problems} problems"


def test_report_without_ptx_is_a_problem(check_kernels, tmp_path):
    (tmp_path / "report" / "kernels/a/clean.cu" / "clean.ptx").unlink()
    lines, problems = check_kernels.from_report(tmp_path / "report", "kernels/a/clean.cu")
    assert problems == ["kernels/a/clean.cu: no PTX kept, so no check that its kernels wait for the grid before them"]
