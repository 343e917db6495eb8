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


def test_swiglu_argument_errors():
    """SwiGLU's checks read metadata only and name the problem (the CUDA-only checks come last on CPU tensors)."""
    x, w = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(24, 16, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="w2 must be a 2-D"):
        ops.check_swiglu_args(x, w, w[0])
    with pytest.raises(ValueError, match="weights of one shape"):
        ops.check_swiglu_args(x, w, w[:16])
    with pytest.raises(ValueError, match="bfloat16 or float16 operands of one dtype"):
        ops.check_swiglu_args(x.float(), w.float(), w.float())
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        ops.swiglu_linear(x, w, w)
    a, b, h = torch.randn(4, 16, dtype=torch.bfloat16), torch.randn(16, 24, dtype=torch.bfloat16), \
        torch.randn(2, 2, 24, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="gemm shapes do not match"):
        ops.check_swiglu_grad_args(a, b[:8], h, h)
    with pytest.raises(ValueError, match="runs on CUDA tensors"):
        ops.matmul_swiglu_grad(a, b, h, h)


@pytest.mark.parametrize("part_bytes", [0, -1])
def test_cross_entropy_forward_grad_rejects_parts_of_no_bytes(part_bytes):
    """A part size of 0 bytes or less is an error before anything runs, not a quiet fall back to the two kernels."""
    logits, target = torch.randn(4, 32000, dtype=torch.bfloat16), torch.zeros(4, dtype=torch.long)
    with pytest.raises(ValueError, match="_part_bytes must be > 0"):
        ops.cross_entropy_forward_grad(logits, target, _part_bytes=part_bytes)


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


@pytest.mark.parametrize("B,Hq,Hkv,S,D,causal,split", [
    (4, 32, 32, 2048, 64, True, 1),   # not grouped
    (4, 32, 8, 2048, 64, True, 1),    # LitGPT Llama-3.2-1B, batch 4: 512 blocks of 4 heads even out
    (1, 32, 8, 2048, 64, True, 2),    # batch 1: 128 causal blocks of up to 4 heads' steps, 1.75x the mean load
    (1, 32, 8, 2048, 64, False, 1),   # full: 128 equal blocks are one wave
    (1, 32, 8, 8192, 128, True, 1),   # 512 blocks
    (1, 32, 1, 2048, 64, True, 16),   # multi-query: 16 blocks of 32 heads each, unsplit
])
def test_backward_splits_a_group_only_where_its_blocks_are_too_few(B, Hq, Hkv, S, D, causal, split):
    assert ops.backward_group_split(B, Hq, Hkv, S, S, D, causal, sms=132) == split


@pytest.mark.parametrize("units,steps,causal,plan", [
    (2048, 32, False, (2048, 0)),   # the attention protocol at D = 128 (16k tokens): 68 units left, no halves in a round
    (2048, 64, False, (2048, 0)),   # S = 4096: several rounds of parts, but the units are too short for them
    (2048, 128, False, (1980, 5)),  # S = 8192: fifths in three rounds (340 parts on 132 multiprocessors)
    (2048, 256, False, (1980, 5)),  # S = 16384
    (2090, 256, False, (2090, 0)),  # 110 left: long units, but rounds of parts would not shorten the wave enough
    (4096, 32, False, (4092, 4)),   # D = 64: 4 units left over 132 multiprocessors, in quarters
    (4096, 128, False, (4092, 4)),
    (2040, 32, False, (1980, 2)),   # 60 left: 120 halves fit a round, 180 thirds do not
    (2090, 32, False, (2090, 0)),   # 110 left: not even halves fit a round
    (1990, 32, False, (1980, 4)),   # 10 left, in quarters
    (1990, 12, False, (1980, 3)),   # 12-step units: thirds of 4 steps, no quarters of 3
    (1990, 6, False, (1990, 0)),    # short units: a part's overhead and merge eat the gain
    (2048, 32, True, (2048, 0)),    # causal: never
    (132 * 16, 32, False, (2112, 0)),  # whole waves
    (100, 32, False, (100, 0)),     # under a wave
])
def test_backward_splits_the_last_wave_where_it_shortens_it(units, steps, causal, plan):
    assert ops.backward_tail_split(units, steps, causal, sms=132) == plan
