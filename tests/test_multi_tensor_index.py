"""The multi-tensor chunk index (csrc/kittens/multi_tensor.cuh) that the AdamW and sq_norm kernels walk, checked on
the host: the header is plain C++ apart from its qualifiers, so tests/cpp/multi_tensor_check.cpp compiles it with
the host compiler and walks a persistent grid's chunks for edge and random lists of tensor sizes."""

from host_cpp import run_host_check


def test_chunks_cover_every_element_once_and_batches_cut_in_order(tmp_path):
    run_host_check("multi_tensor_check.cpp", tmp_path)
