"""tk's kernels launched programmatically dependent on the kernel before them (csrc/kittens/launch.h): each may be
scheduled while its predecessor still runs, and waits for it (`pdl::wait_prior_grid`) before its first access to
global memory. These tests put every kind of tk launch right behind a producer that keeps one or two SMs busy for
about a millisecond while the rest of the GPU is free, so that the dependent kernel's blocks are resident early:
a block that read its input before the wait would read the producer's NaN-poisoned output, and one that wrote
before it would overwrite what the producer is still reading. Each result is compared bit for bit with the same
launch made after a device synchronisation in plain stream order. Also: chains of small dependent launches (the
dynamic GEMM schedule's shared ticket counter included), the same chain captured in a CUDA graph, and the switch."""

import pytest
import torch

from thunder_tk import ops

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not hasattr(ops, "set_dependent_launch"), reason="no ops.set_dependent_launch")]
DEVICE = "cuda"
BF16 = torch.bfloat16
N = 256  # the producer's output: N x N
LONG_K = 1 << 16  # its reduction length: two 128 x 256 tiles of 2^16 k-steps keep two SMs busy ~1 ms


@pytest.fixture(autouse=True)
def restore_switch():
    previous = ops.dependent_launch()
    yield
    ops.set_dependent_launch(previous)


def generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def randn(*shape, gen, dtype=BF16, scale=1.0):
    return (scale * torch.randn(*shape, device=DEVICE, generator=gen)).to(dtype)


class Producer:
    """A long, narrow GEMM into a NaN-filled output: two blocks work for about a millisecond while the other SMs
    are free for whatever is launched next."""

    def __init__(self, gen):
        self.a = randn(N, LONG_K, gen=gen, scale=LONG_K ** -0.5)
        self.b = randn(LONG_K, N, gen=gen)

    def __call__(self) -> torch.Tensor:
        out = torch.full((N, N), float("nan"), dtype=BF16, device=DEVICE)
        return ops.gemm(self.a, self.b, out=out, _stream_k=-1, _skinny=-1, _tile_n=256)


def consumers(gen):
    """name -> f(x): a tk op reading x, an N x N bf16 tensor (returns a tuple of tensors)."""
    w = randn(N, N, gen=gen, scale=N ** -0.5)
    norm_w = (1 + 0.1 * torch.randn(N, device=DEVICE, generator=gen)).to(BF16)
    s = randn(N, N, gen=gen)
    rstd = s.float().pow(2).mean(-1, keepdim=True).add(1e-5).rsqrt()
    target = torch.randint(0, N, (N,), device=DEVICE, generator=gen)
    ids = torch.randint(0, 64, (N,), device=DEVICE, generator=gen)
    # attention on (1, 2, 256, 128) views of x; the backward with a fixed forward's o and lse
    qkv = [randn(1, 2, N, 128, gen=gen) for _ in range(3)]
    o, lse = ops.attention_forward(*qkv, is_causal=True)
    heads, kv_heads, head_dim = 2, 1, 64  # linear_rope: (2 + 2) x 64 = N output columns
    cos, sin = ops.rope_tables(N, head_dim, BF16, DEVICE)
    w1, w2 = randn(N, N, gen=gen, scale=N ** -0.5), randn(N, N, gen=gen, scale=N ** -0.5)
    as_heads = lambda x: x.view(1, N, 2, 128).transpose(1, 2)  # noqa: E731  (strided (B, H, S, D))
    return {
        "gemm": lambda x: (ops.gemm(x, w),),
        "gemm_dynamic": lambda x: (ops.gemm(x, w, _schedule="dynamic"),),
        "gemm_stream_k": lambda x: (ops.gemm(x, w, _stream_k=1),),
        "gemm_skinny": lambda x: (ops.gemm(x[:16], w, _skinny=1),),
        "gemm_sum": lambda x: (ops.gemm_sum(x, w, x, w1),),
        "linear_rope": lambda x: ops.linear_rope(x.view(1, N, N), w, cos, sin, heads, kv_heads, head_dim),
        "swiglu_linear": lambda x: ops.swiglu_linear(x, w1, w2),
        "rms_norm": lambda x: ops.rms_norm(x, norm_w, 1e-5),
        "rms_norm_residual": lambda x: ops.rms_norm(s, norm_w, 1e-5, x),
        "rms_norm_backward": lambda x: ops.rms_norm_backward(x, s, rstd, norm_w),
        "attention_forward": lambda x: ops.attention_forward(as_heads(x), qkv[1], qkv[2], is_causal=True),
        "attention_backward": lambda x: ops.attention_backward(*qkv, o, lse, as_heads(x), is_causal=True),
        "cross_entropy_forward_grad": lambda x: ops.cross_entropy_forward_grad(x, target),
        "cross_entropy_forward": lambda x: ops.cross_entropy_forward(x, target),
        "embedding_backward": lambda x: (ops.embedding_backward(x, ids, 64),),
    }


CONSUMERS = ["gemm", "gemm_dynamic", "gemm_stream_k", "gemm_skinny", "gemm_sum", "linear_rope", "swiglu_linear",
             "rms_norm", "rms_norm_residual", "rms_norm_backward", "attention_forward", "attention_backward",
             "cross_entropy_forward_grad", "cross_entropy_forward", "embedding_backward"]


def assert_bit_equal(got, want, what):
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape and g.dtype == w.dtype, what
        same = (g == w) | (torch.isnan(g) & torch.isnan(w))
        assert bool(same.all()), f"{what}: output {i} differs from the plain launch's in {int((~same).sum())} places"
        assert not bool(torch.isnan(g).any()) or bool(torch.isnan(w).any()), f"{what}: output {i} read the poison"


def test_switch():
    ops.set_dependent_launch(True)
    assert ops.dependent_launch() is True
    with ops.dependent_launches(False):
        assert ops.dependent_launch() is False
    assert ops.dependent_launch() is True
    assert ops.set_dependent_launch(False) is True
    with pytest.raises(TypeError, match="expected a bool"):
        ops.set_dependent_launch(1)


@pytest.mark.parametrize("consumer", CONSUMERS)
def test_reads_after_the_producer(consumer):
    """The consumer reads the long producer's output right after it: with the dependent launch, every block that
    became resident during the producer waited for it (no poison read, the plain launch's bits)."""
    gen = generator(CONSUMERS.index(consumer))
    produce, use = Producer(gen), consumers(gen)[consumer]
    ops.set_dependent_launch(False)
    x = produce()
    torch.cuda.synchronize()
    assert not bool(torch.isnan(x).any())
    want = tuple(t.clone() for t in use(x))
    torch.cuda.synchronize()
    ops.set_dependent_launch(True)
    for _ in range(3):
        got = use(produce())
        torch.cuda.synchronize()
        assert_bit_equal(got, want, consumer)


def test_writes_after_the_producer():
    """A GEMM writing into the producer's operand right behind it: it waits until the producer has read it all."""
    gen = generator(7)
    produce = Producer(gen)
    ops.set_dependent_launch(False)
    want = produce()
    torch.cuda.synchronize()
    original = produce.a.clone()
    small_a, small_b = randn(N, 64, gen=gen), randn(64, 256, gen=gen)
    ops.set_dependent_launch(True)
    for _ in range(3):
        produce.a.copy_(original)
        torch.cuda.synchronize()
        got = produce()
        ops.gemm(small_a, small_b, out=produce.a[:, -256:])  # the columns the producer reads last
        torch.cuda.synchronize()
        assert_bit_equal((got,), (want,), "producer under an overwrite of its operand")


def chain(x, ws, norm_w, schedule):
    """Alternating small GEMMs and RMSNorms, each reading the last's output: back-to-back dependent launches."""
    for w in ws:
        x = ops.gemm(x, w, _schedule=schedule)
        x = ops.rms_norm(x, norm_w, 1e-5)[0]
    return x


@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_chain_of_small_launches(schedule):
    gen = generator(11)
    x = randn(384, 512, gen=gen)
    ws = [randn(512, 512, gen=gen, scale=512 ** -0.5) for _ in range(40)]
    norm_w = (1 + 0.1 * torch.randn(512, device=DEVICE, generator=gen)).to(BF16)
    ops.set_dependent_launch(False)
    want = x
    for w in ws:  # each launch after a synchronisation
        want = ops.gemm(want, w, _schedule=schedule)
        torch.cuda.synchronize()
        want = ops.rms_norm(want, norm_w, 1e-5)[0]
        torch.cuda.synchronize()
    ops.set_dependent_launch(True)
    for _ in range(3):
        got = chain(x, ws, norm_w, schedule)
        torch.cuda.synchronize()
        assert_bit_equal((got,), (want,), f"chain ({schedule})")


def test_chain_in_a_cuda_graph():
    """Dependent launches captured into a graph keep their order on replay."""
    gen = generator(13)
    x = randn(384, 512, gen=gen)
    ws = [randn(512, 512, gen=gen, scale=512 ** -0.5) for _ in range(20)]
    norm_w = (1 + 0.1 * torch.randn(512, device=DEVICE, generator=gen)).to(BF16)
    ops.set_dependent_launch(False)
    want = chain(x, ws, norm_w, "static")
    torch.cuda.synchronize()
    ops.set_dependent_launch(True)
    chain(x, ws, norm_w, "static")  # warm-up outside the capture (per-device set-up)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        got = chain(x, ws, norm_w, "static")
    torch.cuda.current_stream().wait_stream(stream)
    for _ in range(3):
        got.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_bit_equal((got,), (want,), "graph replay")


@pytest.mark.parametrize("dependent", [True, False])
def test_a_failed_launch_raises_once_and_leaves_no_error_behind(dependent):
    """A tk launch that fails raises its error and leaves the module's runtime without it: the launches that read
    cudaGetLastError() after `<<<>>>` (collectives, the tile library's selftests) would otherwise report it as
    theirs. The selftest's launch asks for 2048 threads a block."""
    from thunder_tk import _extension

    selftest = _extension.extension().selftest
    ops.set_dependent_launch(dependent)
    stream = torch.cuda.current_stream().cuda_stream
    with pytest.raises(RuntimeError, match="selftest.failed_launch failed: cudaError"):
        selftest.failed_launch(stream)
    x = torch.randn(64, 64, device=DEVICE)
    out = torch.full((64, 64), float("nan"), dtype=BF16, device=DEVICE)
    selftest.store_matrices(x.data_ptr(), out.data_ptr(), 64, 0, stream)  # checks cudaGetLastError() after <<<>>>
    gen = generator(17)
    a, b = randn(100, 72, gen=gen), randn(72, 40, gen=gen)
    got = ops.gemm(a, b)
    torch.cuda.synchronize()
    assert torch.equal(out, x.to(BF16)), "the selftest after the failed launch"
    want = a.double() @ b.double()
    assert ((got.double() - want).norm() / want.norm()).item() < 1e-2, "a GEMM after the failed launch"
