"""The Python side of the kernels, on a machine without a GPU: errors name the problem."""

import pytest
import torch

import thunder_tk
from thunder_tk import ops


def test_argument_errors():
    o = torch.randn(2, 3, 4, 8)
    with pytest.raises(ValueError, match=r"expects \(B, H, S, D\) tensors; o has 3 dims"):
        ops.check_attention_bwd_delta_args(o[0], o[0])
    with pytest.raises(ValueError, match="same shape"):
        ops.check_attention_bwd_delta_args(o, o[..., :4])
    with pytest.raises(ValueError, match="same dtype"):
        ops.check_attention_bwd_delta_args(o, o.double())
    with pytest.raises(ValueError, match="supports bfloat16, float16 and float32, not torch.int64"):
        ops.check_attention_bwd_delta_args(o.long(), o.long())
    with pytest.raises(ValueError, match="runs on CUDA tensors; got a tensor on cpu"):
        ops.attention_bwd_delta(o, o)
    with pytest.raises(TypeError, match="two tensors"):
        ops.check_attention_bwd_delta_args(o, None)


def test_kernel_unavailable_is_a_clear_error(kernels_not_built):
    with pytest.raises(ops.KernelUnavailableError, match="kernels not built: no CUDA compiler"):
        ops._require_kernels(torch.device("cuda:0"))


def test_eager_function_falls_back_to_the_differentiable_reference():
    o = torch.randn(2, 3, 5, 8, requires_grad=True)
    g = torch.randn(2, 3, 5, 8)
    out = thunder_tk.attention_bwd_delta(o, g)
    torch.testing.assert_close(out, (o * g).sum(-1))
    out.sum().backward()
    torch.testing.assert_close(o.grad, g)
    assert thunder_tk.attention_bwd_delta(o.bfloat16(), g.bfloat16()).dtype == torch.float32
