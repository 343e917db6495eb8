"""The GEMM's stream-K tail schedule (csrc/kittens/schedule.cuh), checked exhaustively on the host: the header is
plain C++ outside CUDA, so tests/cpp/split_tail_check.cpp compiles it with the host compiler and walks every block's
pieces for thousands of (tiles, k-blocks, grid) cases."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_split_tail_covers_every_k_block_once_and_never_waits_in_a_cycle(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path / "split_tail_check"
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(ROOT / "tests/cpp/split_tail_check.cpp"),
                    "-o", str(exe)], check=True)
    done = subprocess.run([str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "0 failures" in done.stdout
