"""The multi-tensor chunk index (csrc/kittens/multi_tensor.cuh) that the AdamW and sq_norm kernels walk, checked on
the host: the header is plain C++ apart from its qualifiers, so tests/cpp/multi_tensor_check.cpp compiles it with
the host compiler and walks a persistent grid's chunks for edge and random lists of tensor sizes."""

import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_chunks_cover_every_element_once_and_batches_cut_in_order(tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        pytest.skip("no host C++ compiler")
    exe = tmp_path / "multi_tensor_check"
    subprocess.run([compiler, "-std=c++17", "-O1", f"-I{ROOT / 'csrc'}", str(ROOT / "tests/cpp/multi_tensor_check.cpp"),
                    "-o", str(exe)], check=True)
    done = subprocess.run([str(exe)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout + done.stderr
    assert " 0 failures" in done.stdout
