"""Host C++ checks of the kernels' plain-C++ headers (csrc/kittens/): compile a checker from tests/cpp/ with the
host compiler and run it."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_host_check(source: str, tmp_path) -> str:
    """Builds tests/cpp/<source> against csrc/ and runs it: its output, once it exits 0 and reports 0 failures
    (skipped without a host C++ compiler)."""
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path / pathlib.Path(source).stem
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(ROOT / "tests/cpp" / source), "-o",
                    str(exe)], check=True)
    done = subprocess.run([str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 failures" in done.stdout, done.stdout
    return done.stdout
