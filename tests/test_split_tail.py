"""The GEMM's stream-K tail schedule (csrc/kittens/schedule.cuh), checked exhaustively on the host: the header is
plain C++ outside CUDA, so tests/cpp/split_tail_check.cpp compiles it with the host compiler and walks every block's
pieces for thousands of (tiles, k-blocks, grid) cases."""

from host_cpp import run_host_check


def test_split_tail_covers_every_k_block_once_and_never_waits_in_a_cycle(tmp_path):
    run_host_check("split_tail_check.cpp", tmp_path)
