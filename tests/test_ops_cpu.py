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


class RecordingGemm:
    """A compiled module whose gemm records what ops hands the kernel, for CPU tensors (nothing is launched)."""

    def __init__(self):
        self.calls = []

    def gemm(self, a, b, c, bias, dtype, M, N, K, a_sm, a_sk, b_sk, b_sn, c_sm, stream, *knobs, **summed):
        self.calls.append(dict(M=M, N=N, K=K, a=(a_sm, a_sk), b=(b_sn, b_sk), a_ptr=a, b_ptr=b, skinny=knobs[-1],
                               **summed))


@pytest.fixture
def recorded(monkeypatch):
    """ops.gemm and ops.gemm_sum on CPU tensors, their launches recorded: the device parts stood in for."""
    from contextlib import nullcontext

    ext = RecordingGemm()
    monkeypatch.setattr(ops, "check_gemm_args", lambda a, b, bias: None)  # its device check wants CUDA
    monkeypatch.setattr(ops, "_require_kernels", lambda device: ext)
    monkeypatch.setattr(ops, "_on", lambda device: nullcontext())
    monkeypatch.setattr(ops, "_stream_handle", lambda device: 0)
    monkeypatch.setattr(ops, "_gemm_tickets", lambda device, schedule: 0)
    return ext


def test_gemm_and_gemm_sum_hand_the_kernel_their_operands_as_read(recorded):
    """In place where TMA can read an operand; a second product's operands with the first's majors (both read
    K-major, copied as needed, where they differ); the skinny kernel never for a sum; an empty product left out."""
    bf16 = torch.bfloat16
    M, N, K, K2 = 128, 64, 96, 40
    a, a2 = torch.randn(M, K).to(bf16), torch.randn(M, K2).to(bf16)  # K-major
    b_n, b2_n = torch.randn(K, N).to(bf16), torch.randn(K2, N).to(bf16)  # N-major (MN-major)
    b_k, b2_k = torch.randn(N, K).to(bf16).t(), torch.randn(N, K2).to(bf16).t()  # K-major

    ops.gemm(a, b_n)
    call = recorded.calls.pop()
    assert (call["a"], call["b"], call["a_ptr"], call["b_ptr"]) == ((K, 1), (1, N), a.data_ptr(), b_n.data_ptr())
    assert "sum_a" not in call
    off = torch.randn(1 + M * K).to(bf16)[1:].view(M, K)  # 2 bytes off 16: copied, row-major
    ops.gemm(off, b_n)
    call = recorded.calls.pop()
    assert call["a"] == (K, 1) and call["a_ptr"] % 16 == 0

    ops.gemm_sum(a, b_n, a2, b2_n)  # one layout for both: nothing copied
    call = recorded.calls.pop()
    assert (call["a"], call["b"], call["sum_K"]) == ((K, 1), (1, N), K2)
    assert (call["sum_a"], call["sum_b"]) == (a2.data_ptr(), b2_n.data_ptr())
    assert (call["sum_a_stride_m"], call["sum_a_stride_k"], call["sum_b_stride_k"], call["sum_b_stride_n"]) == \
        (K2, 1, N, 1)
    assert call["skinny"] == -1

    ops.gemm_sum(a, b_n, a2, b2_k)  # B majors differ: both B read K-major, b_n copied, b2_k in place
    call = recorded.calls.pop()
    assert call["b"] == (K, 1) and call["b_ptr"] != b_n.data_ptr()
    assert (call["sum_b"], call["sum_b_stride_k"], call["sum_b_stride_n"]) == (b2_k.data_ptr(), 1, K2)
    assert call["a_ptr"] == a.data_ptr() and call["sum_a"] == a2.data_ptr()

    ops.gemm_sum(a, b_k, a2[:, :0], b2_k[:0])  # nothing to add: a plain launch
    call = recorded.calls.pop()
    assert "sum_a" not in call and call["b"] == (K, 1)
    ops.gemm_sum(a[:, :0], b_k[:0], a2, b2_k)  # the first product empty: the second alone
    call = recorded.calls.pop()
    assert "sum_a" not in call and (call["K"], call["a_ptr"], call["b_ptr"]) == (K2, a2.data_ptr(), b2_k.data_ptr())


def test_sliding_window_references_and_standins():
    """The float64 references with window=W keep keys i - W < j <= i (against a softmax over each row's keys), a
    window of S keys or more is plain causal, and the CPU stand-ins take the window too (their backward, from lse,
    against autograd through the reference)."""
    from standins import attention_backward_standin, attention_forward_standin

    g = torch.Generator().manual_seed(0)
    B, Hq, Hkv, S, D, W = 1, 4, 2, 11, 64, 3
    q, k, v, grad_o = (torch.randn(B, h, S, D, generator=g).bfloat16() for h in (Hq, Hkv, Hkv, Hq))
    o, lse = ops.attention_forward_reference(q, k, v, is_causal=True, window=W)
    k64, v64 = (t.double().repeat_interleave(Hq // Hkv, 1) for t in (k, v))
    for i in range(S):
        keys = list(range(max(0, i - W + 1), i + 1))
        s = (q[:, :, i].double().unsqueeze(-2) @ k64[:, :, keys].transpose(-1, -2)).squeeze(-2) * D ** -0.5
        torch.testing.assert_close(o[:, :, i], (s.softmax(-1).unsqueeze(-2) @ v64[:, :, keys]).squeeze(-2))
        torch.testing.assert_close(lse[:, :, i], s.logsumexp(-1))
    plain = ops.attention_forward_reference(q, k, v, is_causal=True)
    for big in (S, S + 5):
        wide = ops.attention_forward_reference(q, k, v, is_causal=True, window=big)
        assert all(torch.equal(a, b) for a, b in zip(wide, plain))
    o16, lse32 = attention_forward_standin(q, k, v, is_causal=True, window=W)
    torch.testing.assert_close(lse32, lse.float())
    grads = attention_backward_standin(q, k, v, o16, lse32, grad_o, is_causal=True, window=W)
    refs = ops.attention_backward_reference(q, k, v, o16, lse32, grad_o, is_causal=True, window=W)
    for got, ref in zip(grads, refs):
        assert ((got.double() - ref).norm() / ref.norm()).item() < 2e-2


def test_backward_group_split_prices_a_sliding_window():
    """With a window the causal key tiles walk nearly equal query ranges: a batch-1 GQA backward whose causal blocks
    are too uneven to fill the GPU whole (split in 2) is even enough whole with a short window; no window (0) is the
    causal plan."""
    assert ops.backward_group_split(1, 32, 8, 2048, 2048, 64, True, 132, 0) == \
        ops.backward_group_split(1, 32, 8, 2048, 2048, 64, True, 132)
    assert ops.backward_group_split(1, 32, 8, 2048, 2048, 64, True, 132) == 2
    assert ops.backward_group_split(1, 32, 8, 2048, 2048, 64, True, 132, 256) == 1  # 128 blocks of 5-6 steps a head
    assert ops._bwd_makespan(8, 16, 32, 4, True, 132, 2, 256) < ops._bwd_makespan(8, 16, 32, 4, True, 132, 2)


def test_dq_finalize_mode_argument_then_environment_then_auto(monkeypatch):
    monkeypatch.delenv("THUNDER_TK_DQ_FINALIZE", raising=False)
    assert ops.dq_finalize_mode() == "overlap" and ops.dq_finalize_mode(causal=True) == "pass"
    assert ops.dq_finalize_mode("overlap", causal=True) == "overlap"
    monkeypatch.setenv("THUNDER_TK_DQ_FINALIZE", "overlap")
    assert ops.dq_finalize_mode() == "overlap" and ops.dq_finalize_mode("pass") == "pass"
    monkeypatch.setenv("THUNDER_TK_DQ_FINALIZE", "soon")
    with pytest.raises(ValueError, match="THUNDER_TK_DQ_FINALIZE"):
        ops.dq_finalize_mode()


def test_dq_zero_mode_argument_then_environment_then_auto(monkeypatch):
    monkeypatch.delenv("THUNDER_TK_DQ_ZERO", raising=False)
    assert ops.dq_zero_mode() == "ahead" and ops.dq_zero_mode("pass") == "pass"
    monkeypatch.setenv("THUNDER_TK_DQ_ZERO", "pass")
    assert ops.dq_zero_mode() == "pass" and ops.dq_zero_mode("ahead") == "ahead"
    monkeypatch.setenv("THUNDER_TK_DQ_ZERO", "never")
    with pytest.raises(ValueError, match="THUNDER_TK_DQ_ZERO"):
        ops.dq_zero_mode()


def test_dq_accumulators_take_turns_and_know_what_the_kernel_zeroed():
    """The delta pass zeroes only where the kernel before did not: the first turn of each buffer, a shape larger
    than the last launch zeroed; a taken buffer is dirty until a kernel zeroes it again."""
    turns = ops._DqAccumulators(2 * 3 * 8 * 4, torch.device("cpu"))
    first, must_zero = turns.take((2, 3, 8, 4))
    assert must_zero and first.shape == (2, 3, 8, 4) and first.data_ptr() == turns.buffers[0].data_ptr()
    assert turns.next is turns.buffers[1]
    turns.launched(first.numel())  # the kernel zeroes buffer 1 for the next call
    second, must_zero = turns.take((2, 3, 8, 4))
    assert not must_zero and second.data_ptr() == turns.buffers[1].data_ptr() and turns.next is turns.buffers[0]
    turns.launched(96)  # a smaller launch zeroes only 96 floats of buffer 0
    third, must_zero = turns.take((2, 3, 8, 4))
    assert must_zero and third.data_ptr() == turns.buffers[0].data_ptr()
    # Taken but never launched (the kernel raised): buffer 0 stays the turn's, and dirty.
    again, must_zero = turns.take((1, 3, 8, 4))
    assert must_zero and again.data_ptr() == turns.buffers[0].data_ptr()


def test_dq_accumulator_is_made_per_stream_and_grown(monkeypatch):
    """The first backward on a stream makes the stream's turns, a larger shape makes them anew, a smaller one reuses
    them; "pass" and graph capture take a buffer of their own (the CUDA stream query stood in on CPU)."""

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

    stream = Stream(1)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ops, "_dq_accumulators", {})
    cpu = torch.device("cpu")
    accum, must_zero, turns = ops._dq_accumulator((1, 2, 3, 4), cpu, "ahead")
    assert accum.shape == (1, 2, 3, 4) and accum.dtype == torch.float32 and must_zero
    assert turns.buffers[0].numel() == 24 and ops._dq_accumulators == {(None, 1): turns}
    turns.launched(24)
    smaller, must_zero, same = ops._dq_accumulator((1, 1, 3, 4), cpu, "ahead")
    assert same is turns and not must_zero and smaller.data_ptr() == turns.buffers[1].data_ptr()
    larger, must_zero, grown = ops._dq_accumulator((2, 2, 3, 4), cpu, "ahead")
    assert grown is not turns and grown.buffers[0].numel() == 48 and must_zero and larger.shape == (2, 2, 3, 4)
    stream = Stream(2)
    _, _, other = ops._dq_accumulator((1, 2, 3, 4), cpu, "ahead")
    assert other is not grown and set(ops._dq_accumulators) == {(None, 1), (None, 2)}
    own, must_zero, none = ops._dq_accumulator((1, 2, 3, 4), cpu, "pass")
    assert none is None and must_zero and own.shape == (1, 2, 3, 4)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    own, must_zero, none = ops._dq_accumulator((1, 2, 3, 4), cpu, "ahead")
    assert none is None and must_zero and len(ops._dq_accumulators) == 2


# The most float4s of the next dQ accumulator one backward block zeroes: the kernel's backward_max_zero_share,
# INT32_MAX less a zeroing step.
ZERO_SHARE_MAX = 2**31 - 1 - 256


class RecordingAttention:
    """A compiled module whose attention backward launches (delta pass, kernel, dQ pass) record what ops hands them,
    for CPU tensors: nothing is computed."""

    BACKWARD = ("q", "k", "v", "grad_o", "lse", "delta", "dq_accum", "dk", "dv", "dtype", "B", "Hq", "Hkv", "Sq",
                "Sk", "D", "q_stride", "k_stride", "v_stride", "grad_o_stride", "dk_stride", "dv_stride",
                "lse_stride", "delta_stride", "scale", "causal", "stream", "split", "split_from", "parts",
                "scratch", "split_counts", "window", "dq_done")

    def __init__(self):
        self.calls = []
        self.max_zero_share = ZERO_SHARE_MAX  # lowered by some tests

    def attention_backward_max_zero_share(self):
        return self.max_zero_share

    def attention_bwd_delta(self, o, grad_o, delta, *args):
        self.calls.append(("delta", dict(o=o, grad_o=grad_o, delta=delta, rows_per_group=args[-3],
                                         resident_grid=args[-2], zero=args[-1])))

    def attention_backward(self, *args, zero_next=0, zero_next_count=0):
        assert len(args) == len(self.BACKWARD)
        self.calls.append(("backward", dict(zip(self.BACKWARD, args), zero_next=zero_next,
                                            zero_next_count=zero_next_count)))
        return 123  # the steps each dQ counter reaches

    def attention_dq_finalize(self, accum, dq, dtype, numel, factor, stream, *order):
        self.calls.append(("finalize", dict(accum=accum, dq=dq, numel=numel, factor=factor, order=order)))

    def attention_rope_grad(self, **args):
        self.calls.append(("rope_grad", args))


@pytest.fixture
def recorded_attention(monkeypatch):
    """ops.attention_backward on CPU tensors, its launches recorded: the device parts stood in for."""
    from contextlib import nullcontext

    from thunder_tk import _extension

    class Stream:
        cuda_stream = 7

    ext = RecordingAttention()
    check_attention_args = ops.check_attention_args

    def checked_but_for_the_device(q, k, v, *args):
        try:
            check_attention_args(q, k, v, *args)
        except ValueError as e:
            if "must be CUDA tensors" not in str(e):
                raise

    monkeypatch.setattr(ops, "check_attention_args", checked_but_for_the_device)
    monkeypatch.setattr(ops, "check_attention_bwd_delta_args", lambda o, grad_o: None)
    monkeypatch.setattr(ops, "_require_kernels", lambda device: ext)
    monkeypatch.setattr(ops, "_on", lambda device: nullcontext())
    monkeypatch.setattr(ops, "_stream_handle", lambda device: 0)
    monkeypatch.setattr(ops, "_zeroed_slot", lambda device, kind, slot_ints, slots: 4096)
    monkeypatch.setattr(_extension, "multiprocessor_count", lambda index: 132)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(ops, "_dq_accumulators", {})
    for name in ("THUNDER_TK_DQ_FINALIZE", "THUNDER_TK_DQ_ZERO", "THUNDER_TK_ATTN_BWD_TAIL_SPLIT",
                 "THUNDER_TK_ATTN_DELTA_ROWS"):
        monkeypatch.delenv(name, raising=False)
    return ext


def _backward_inputs(B, Hq, Hkv, S, D):
    g = torch.Generator().manual_seed(B * S + Hq)
    q, o, grad_o = (torch.randn(B, Hq, S, D, generator=g).bfloat16() for _ in range(3))
    k, v = (torch.randn(B, Hkv, S, D, generator=g).bfloat16() for _ in range(2))
    return q, k, v, o, torch.randn(B, Hq, S, generator=g), grad_o


def test_attention_backward_host_path_hands_the_kernels_their_buffers(recorded_attention):
    """Through ops.attention_backward's whole host path: the delta pass zeroes the dQ accumulator only where no
    kernel did (the first call on a stream, a larger shape); each kernel zeroes the other accumulator for the next
    call; the dQ pass reads the accumulator the kernel added into, with the counters without a causal mask."""
    calls = recorded_attention.calls

    def run(*shape, causal=False, **knobs):
        calls.clear()
        dq, dk, dv = ops.attention_backward(*_backward_inputs(*shape), is_causal=causal, **knobs)
        assert [kind for kind, _ in calls] == ["delta", "backward", "finalize"]
        delta, backward, finalize = (args for _, args in calls)
        B, Hq, Hkv, S, D = shape
        assert dq.shape == (B, Hq, S, D) and dk.shape == dv.shape == (B, Hkv, S, D)
        assert finalize["accum"] == backward["dq_accum"] and finalize["dq"] == dq.data_ptr()
        assert finalize["numel"] == dq.numel() and backward["delta"] == delta["delta"]
        return delta, backward, finalize

    shape = (2, 4, 2, 96, 64)
    floats = 2 * 4 * 96 * 64
    delta, first, finalize = run(*shape)
    buffers = [t.data_ptr() for t in ops._dq_accumulators[(None, 7)].buffers]
    assert delta["zero"] == first["dq_accum"] == buffers[0]  # the first call zeroes in the delta pass
    assert (first["zero_next"], first["zero_next_count"]) == (buffers[1], floats)
    assert finalize["order"][1:] == (4 // 2 * 96 * 64, 123) and finalize["order"][0] == first["dq_done"] != 0
    delta, second, _ = run(*shape)
    assert delta["zero"] == 0 and second["dq_accum"] == buffers[1] and second["zero_next"] == buffers[0]
    delta, third, finalize = run(*shape, causal=True)  # smaller than what the kernel zeroed: taken as it is
    assert delta["zero"] == 0 and third["dq_accum"] == buffers[0] and third["causal"]
    assert finalize["order"] == () and third["dq_done"] == 0  # causal: the plain pass, no counters

    delta, grown, _ = run(2, 4, 2, 160, 64)  # larger: new accumulators, zeroed in the delta pass
    new = [t.data_ptr() for t in ops._dq_accumulators[(None, 7)].buffers]
    assert delta["zero"] == grown["dq_accum"] == new[0] and grown["zero_next"] == new[1]
    assert grown["zero_next_count"] == 2 * 4 * 160 * 64

    delta, own, _ = run(*shape, _dq_zero="pass")  # the delta pass zeroes a buffer of the call's own
    assert delta["zero"] == own["dq_accum"] not in new and (own["zero_next"], own["zero_next_count"]) == (0, 0)
    _, kept, _ = run(*shape)
    assert kept["dq_accum"] == new[1]  # "pass" left the turns as they were


def test_delta_pass_rows_from_the_environment(recorded_attention, monkeypatch):
    """THUNDER_TK_ATTN_DELTA_ROWS sets the delta pass's rows per lane group (auto: 0, the launcher's choice, grid and
    all); `_tuning` (the sweeps') overrides it; a misspelt value names the variable."""
    calls = recorded_attention.calls
    o = torch.randn(2, 3, 5, 64).bfloat16()

    def tuning_of(**kw):
        calls.clear()
        ops.attention_bwd_delta(o, o, **kw)
        ((kind, args),) = calls
        return args["rows_per_group"], args["resident_grid"]

    assert tuning_of() == (0, False)
    for word, rows in (("1", 1), ("2", 2), ("4", 4), ("Auto", 0)):
        monkeypatch.setenv("THUNDER_TK_ATTN_DELTA_ROWS", word)
        assert tuning_of() == (rows, False)
    assert tuning_of(_tuning=(4, True)) == (4, True)
    monkeypatch.setenv("THUNDER_TK_ATTN_DELTA_ROWS", "3")
    with pytest.raises(ValueError, match="THUNDER_TK_ATTN_DELTA_ROWS='3'"):
        ops.attention_bwd_delta(o, o)


def test_attention_backward_host_path_with_split_groups_and_split_units(recorded_attention):
    """A group walked in parts writes dK, dV parts of its own (summed after the kernel) and takes the plain dQ pass
    (the sums come between the kernel and the pass); a forced split of the last units hands the kernel its scratch
    and counters; the kernel still zeroes the next accumulator either way."""
    calls = recorded_attention.calls
    B, Hq, Hkv, S, D = 1, 8, 2, 64, 128
    dq, dk, dv = ops.attention_backward(*_backward_inputs(B, Hq, Hkv, S, D), _group_split=2)
    (_, delta), (_, backward), (_, finalize) = calls
    assert backward["split"] == 2 and backward["dk"] != dk.data_ptr() and backward["dv"] != dv.data_ptr()
    assert backward["dq_done"] == 0 and finalize["order"] == ()
    assert backward["zero_next_count"] == dq.numel() and backward["zero_next"] != backward["dq_accum"]
    calls.clear()
    dq, dk, dv = ops.attention_backward(*_backward_inputs(B, Hq, Hkv, S, D), _tail_split=(1, 2))
    (_, delta), (_, backward), (_, finalize) = calls
    assert (backward["split_from"], backward["parts"], backward["split_counts"]) == (1, 2, 4096)
    assert backward["scratch"] != 0 and (backward["dk"], backward["dv"]) == (dk.data_ptr(), dv.data_ptr()) and finalize["order"][0] == backward["dq_done"] != 0
    assert delta["zero"] == 0  # the call before zeroed this turn's accumulator


def test_attention_backward_qkv_host_path_writes_into_the_projections_columns(recorded_attention):
    """dk and dv go from the kernel straight into their columns of the fused gradient, and the rope pass reads the
    accumulator the kernel added into and writes q's columns, rotating dk back in place; the turns of the
    accumulators are the plain backward's."""
    calls = recorded_attention.calls
    B, Hq, Hkv, S, D, n = 2, 4, 2, 80, 64, 32
    cos, sin = ops.rope_tables(S, n, torch.bfloat16, "cpu")
    qkv_grad = ops.attention_backward_qkv(*_backward_inputs(B, Hq, Hkv, S, D), cos, sin, is_causal=True)
    assert qkv_grad.shape == (B, S, (Hq + 2 * Hkv) * D)
    assert [kind for kind, _ in calls] == ["delta", "backward", "rope_grad"]
    (_, delta), (_, backward), (_, rope) = calls
    column, base = qkv_grad.element_size(), qkv_grad.data_ptr()
    assert backward["dk"] == base + Hq * D * column and backward["dv"] == base + (Hq + Hkv) * D * column
    assert backward["dk_stride"] == backward["dv_stride"] == [S * (Hq + 2 * Hkv) * D, D, (Hq + 2 * Hkv) * D]
    assert rope["dq_accum"] == backward["dq_accum"] == delta["zero"] and rope["dq"] == base
    assert rope["dk"] == backward["dk"] and (rope["rope_dims"], rope["q_heads"], rope["kv_heads"]) == (n, Hq, Hkv)
    assert backward["zero_next"] not in (0, backward["dq_accum"]) and backward["dq_done"] == 0
    calls.clear()
    ops.attention_backward_qkv(*_backward_inputs(B, Hq, Hkv, S, D), cos[:, :0], sin[:, :0], is_causal=True)
    (_, delta), (_, backward), (_, rope) = calls
    assert delta["zero"] == 0 and rope["dk"] == 0 and rope["dq_accum"] == backward["dq_accum"] != delta["delta"]
