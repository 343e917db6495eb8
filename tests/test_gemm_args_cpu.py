"""The compiled GEMM's own argument checks (gemm_unsupported), on a machine with the kernels built and no GPU (CI):
a summed second product, and an fp32 output, is refused with the reason where its layout or knobs cannot run, and a
valid one passes every check and fails only at the launch, for want of a device. No address is ever read: the
checks look at metadata, and a launch without a device stops before touching memory.
"""

import pytest

BF16 = 0  # ops._DTYPE_CODES[torch.bfloat16]
A, B, C, A2, B2 = 1 << 12, 2 << 12, 3 << 12, 4 << 12, 5 << 12  # 16-byte aligned addresses, never read


@pytest.fixture
def ext(extension_without_gpu):
    return extension_without_gpu


def gemm(ext, **changes):
    """Llama-3.2-1B's MLP input gradient as ext.gemm's arguments (A, A2 K-major; B, B2 N-major), with changes."""
    args = dict(a=A, b=B, c=C, bias=0, dtype=BF16, M=8192, N=2048, K=8192, a_stride_m=8192, a_stride_k=1,
                b_stride_k=2048, b_stride_n=1, c_stride_m=2048, stream=0, sum_a=A2, sum_b=B2, sum_K=8192,
                sum_a_stride_m=8192, sum_a_stride_k=1, sum_b_stride_k=2048, sum_b_stride_n=1)
    args.update(changes)
    return ext.gemm(**args)


def test_a_valid_sum_passes_the_checks(ext):
    with pytest.raises(RuntimeError, match="launching gemm_sum failed"):
        gemm(ext)
    with pytest.raises(RuntimeError, match="launching gemm_sum failed"):  # ragged k-blocks, B2 K-major like B
        gemm(ext, K=72, sum_K=136, b_stride_k=1, b_stride_n=72, sum_b_stride_k=1, sum_b_stride_n=136)


@pytest.mark.parametrize("changes,reason", [
    (dict(sum_b_stride_k=1, sum_b_stride_n=8192), "need A's and B's majors"),
    (dict(sum_a_stride_k=8192, sum_a_stride_m=1), "need A's and B's majors"),
    (dict(sum_K=12), "positive multiple of 8"),
    (dict(sum_K=0), "positive multiple of 8"),
    (dict(sum_a_stride_m=8196), "leading strides must be multiples of 8"),
    (dict(sum_a=A2 + 2), "A2 and B2 must be 16-byte aligned"),
    (dict(sum_b=0), "needs its B2"),
    (dict(sum_a=0), "extra outputs or inputs without their launch"),
    (dict(skinny=1, M=16), "skinny GEMM takes one product"),
])
def test_a_sum_that_cannot_run_is_refused_with_the_reason(ext, changes, reason):
    with pytest.raises(ValueError, match=reason):
        gemm(ext, **changes)


def test_a_valid_fp32_output_passes_the_checks(ext):
    with pytest.raises(RuntimeError, match="launching gemm_sum failed"):
        gemm(ext, c_fp32=True)
    with pytest.raises(RuntimeError, match="launching gemm failed"):  # one product, few rows: not the skinny kernel
        gemm(ext, c_fp32=True, M=16, sum_a=0, sum_b=0, sum_K=0)


@pytest.mark.parametrize("changes,reason", [
    (dict(dtype=1), "fp32 output goes with bf16 operands only"),
    (dict(cluster=2), "fp32 output runs the consumers' epilogue"),
    (dict(pingpong=1, tile_n=128), "fp32 output runs the consumers' epilogue"),
    (dict(epilogue=1), "fp32 output runs the consumers' epilogue"),
    (dict(skinny=1, M=16, sum_a=0, sum_b=0, sum_K=0), "skinny GEMM writes C in the operands' dtype"),
])
def test_an_fp32_output_that_cannot_run_is_refused_with_the_reason(ext, changes, reason):
    with pytest.raises(ValueError, match=reason):
        gemm(ext, c_fp32=True, **changes)


def test_the_register_epilogue_passes_the_checks_for_plain_and_fp32_products(ext):
    for c_fp32 in (False, True):
        with pytest.raises(RuntimeError, match="launching gemm_sum failed"):
            gemm(ext, epilogue=3, c_fp32=c_fp32)


@pytest.mark.parametrize("changes,reason", [
    (dict(epilogue=4), r"epilogue must be 0 \(automatic\), 1 \(store warps\), 2 \(consumers\) or 3"),
    (dict(epilogue=-1), r"epilogue must be 0 \(automatic\), 1 \(store warps\), 2 \(consumers\) or 3"),
])
def test_an_epilogue_that_cannot_run_is_refused_with_the_reason(ext, changes, reason):
    with pytest.raises(ValueError, match=reason):
        gemm(ext, **changes)
