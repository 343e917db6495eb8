"""The tk GEMM against an fp32 reference: shapes with tails, every operand major, strided views, bias, and
a Llama-style MLP trained through Thunder with every GEMM on tk."""

import pytest
import torch
import thunder

import thunder_tk
from accuracy import operand, rel_err
from models import LlamaMLP
from thunder_tk import ops

pytestmark = pytest.mark.gpu

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}


def reference(a, b, bias=None):
    r = a.float() @ b.float()
    return r + bias.float() if bias is not None else r


def check(a, b, bias=None):
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), device="cuda", dtype=a.dtype)
    ops.gemm(a, b, bias, out=out)
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    err = rel_err(out, reference(a, b, bias))
    assert err < TOL[a.dtype], err
    return out


SHAPES = [(1, 1, 8), (1, 7, 64), (17, 33, 24), (128, 256, 64), (129, 257, 72), (300, 500, 1000), (1000, 5, 4096),
          (8192, 16, 128), (16, 8192, 2048), (777, 1500, 520), (2048, 4096, 2048)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_k_major", [True, False])
@pytest.mark.parametrize("b_n_major", [True, False])
@pytest.mark.parametrize("M,N,K", SHAPES)
def test_matches_fp32_reference(M, N, K, a_k_major, b_n_major, dtype):
    if (not a_k_major and M % 8) or (b_n_major and N % 8):
        pytest.skip("that layout's leading stride is M or N; the copy path is tested separately")
    a = operand(M, K, a_k_major, dtype)
    b = operand(K, N, b_n_major, dtype)
    check(a, b)


@pytest.mark.parametrize("M,N,K", [(129, 257, 72), (300, 100, 1000), (1000, 513, 64)])
@pytest.mark.parametrize("a_k_major", [True, False])
@pytest.mark.parametrize("b_n_major", [True, False])
def test_cluster_variant(M, N, K, a_k_major, b_n_major):
    a = operand(M, K, a_k_major, torch.bfloat16)
    b = operand(K, N, b_n_major, torch.bfloat16) if not (b_n_major and N % 8) else operand(K, N, False, torch.bfloat16)
    out = ops.gemm(a, b, _cluster=2)
    assert rel_err(out, reference(a, b)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_bias_and_linear(dtype):
    x = torch.randn(3, 111, 512, device="cuda", dtype=dtype)
    w = torch.randn(1001, 512, device="cuda", dtype=dtype) / 16
    bias = torch.randn(1001, device="cuda", dtype=dtype)
    check(x.reshape(-1, 512), w.t(), bias)
    y = ops.linear(x, w, bias)
    assert y.shape == (3, 111, 1001)
    assert rel_err(y, torch.nn.functional.linear(x.float(), w.float(), bias.float())) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("K", [64, 520])
@pytest.mark.parametrize("bias_offset", [0, 1])
@pytest.mark.parametrize("schedule", ["static", "dynamic"])
def test_bias_through_the_tma_epilogue_over_many_tiles(dtype, K, bias_offset, schedule):
    """N % 8 == 0 takes the TMA-store epilogue (here the consumers' own: 289 tiles on at most 132 blocks; the store
    warps' is forced in test_epilogues), K of one k-block and of several; the bias 4-byte aligned or a view 2 bytes
    off."""
    M, N = 2100, 4104
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = operand(K, N, False, dtype) / 8
    bias = torch.randn(N + 1, device="cuda", dtype=dtype)[bias_offset:bias_offset + N]
    out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
    ops.gemm(a, b, bias, out=out, _schedule=schedule)
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    assert rel_err(out, reference(a, b, bias)) < TOL[dtype]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_k_major", [True, False])
@pytest.mark.parametrize("b_n_major", [True, False])
@pytest.mark.parametrize("M,N,K", [(1, 7, 64), (129, 257, 72), (300, 500, 1000), (3072, 2048, 1024), (777, 1500, 520)])
def test_narrow_tiles(M, N, K, a_k_major, b_n_major, dtype):
    """The 128-wide tile variant (chosen where 256-wide tiles leave the grid's last wave mostly idle), forced on
    every operand major, with tails, bias and both schedules."""
    if (not a_k_major and M % 8) or (b_n_major and N % 8):
        pytest.skip("that layout's leading stride is M or N; the copy path is tested separately")
    a = operand(M, K, a_k_major, dtype)
    b = operand(K, N, b_n_major, dtype)
    bias = torch.randn(N, device="cuda", dtype=dtype)
    for schedule in ("static", "dynamic"):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=dtype)
        ops.gemm(a, b, bias, out=out, _tile_n=128, _schedule=schedule)
        assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
        assert rel_err(out, reference(a, b, bias)) < TOL[dtype]


def biased_problem(M, N, K, a_k_major, b_n_major, dtype):
    """Operands in the given majors (skipping layouts whose leading stride would be M or N off a multiple of 8), a
    bias, and the fp32 reference."""
    if (not a_k_major and M % 8) or (b_n_major and N % 8):
        pytest.skip("that layout's leading stride is M or N; the copy path is tested separately")
    a = operand(M, K, a_k_major, dtype)
    b = operand(K, N, b_n_major, dtype) / 8
    bias = torch.randn(N, device="cuda", dtype=dtype)
    return a, b, bias, reference(a, b, bias)


def checked_gemm(a, b, bias, ref, **knobs):
    """ops.gemm into a NaN-poisoned output, every element written and within tolerance of `ref`."""
    out = torch.full((a.shape[0], b.shape[1]), float("nan"), device="cuda", dtype=a.dtype)
    ops.gemm(a, b, bias, out=out, **knobs)
    assert torch.isfinite(out).all(), "unwritten or non-finite outputs"
    assert rel_err(out, ref) < TOL[a.dtype]
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_k_major", [True, False])
@pytest.mark.parametrize("b_n_major", [True, False])
@pytest.mark.parametrize("M,N,K", [(1, 7, 64), (129, 257, 72), (300, 500, 1000), (3072, 2048, 1024), (777, 1500, 520),
                                   (4096, 4104, 136)])
def test_pingpong(M, N, K, a_k_major, b_n_major, dtype):
    """The ping-pong kernel (the consumer warpgroups take 128 x 128 tiles in turns), forced on every operand major,
    with tails, bias and both schedules: blocks with no tile, one tile (one warpgroup idle), and many (up to 8 per
    warpgroup at 4096 x 4104); K from one k-block (72: two) to more than the ring's stages."""
    a, b, bias, ref = biased_problem(M, N, K, a_k_major, b_n_major, dtype)
    for schedule in ("static", "dynamic"):
        for _ in range(2):  # the dynamic schedule's counter must be left zeroed for the next launch
            checked_gemm(a, b, bias, ref, _pingpong=1, _schedule=schedule)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_k_major", [True, False])
@pytest.mark.parametrize("b_n_major", [True, False])
@pytest.mark.parametrize("M,N,K", [(1, 8, 64), (129, 264, 72), (300, 504, 1000), (777, 1504, 520), (4096, 4104, 136),
                                   (2100, 4104, 64)])
@pytest.mark.parametrize("epilogue", [1, 2, 3])
def test_epilogues(M, N, K, a_k_major, b_n_major, dtype, epilogue):
    """Each epilogue forced (1: store warps hand each staged tile to TMA stores while the consumers go on; 2: the
    consumers store their own rows through their staging; 3: the consumers store them from registers), N % 8 == 0
    so the TMA-store path could run: tails, bias, every major, both schedules, blocks with no tile, one, and many
    (2100 x 4104: 289 tiles, the staging handed back and forth at K of one k-block), run twice so the hand-over's
    barriers start each launch in phase. The register stores write the staged path's bits."""
    a, b, bias, ref = biased_problem(M, N, K, a_k_major, b_n_major, dtype)
    for schedule in ("static", "dynamic"):
        for _ in range(2):
            out = checked_gemm(a, b, bias, ref, _epilogue=epilogue, _schedule=schedule)
        if epilogue == 3:
            assert torch.equal(out, ops.gemm(a, b, bias, _epilogue=2, _schedule=schedule))


STREAM_K_SHAPES = [
    (1, 8, 2048, 0, 0),  # one tile, cut into 3 pieces
    (1, 7, 520, 0, 0),  # register epilogue, K tail
    (129, 264, 72, 0, 0),  # ranges shorter than the minimum: one block per tile
    (300, 504, 1000, 0, 0),
    (3072, 2048, 1024, 0, 0),  # 192 tiles, 1.45 waves: every tile in the tail
    (8192, 2048, 520, 0, 2),  # 512 tiles: whole tiles first, then the tail; the consumers store
    (8192, 2048, 520, 0, 1),  # the same through store warps
    (777, 1500, 520, 128, 0),  # narrow tiles
    (2100, 4104, 136, 0, 0),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("a_k_major", [True, False])
@pytest.mark.parametrize("b_n_major", [True, False])
@pytest.mark.parametrize("M,N,K,tile_n,epilogue", STREAM_K_SHAPES)
def test_stream_k(M, N, K, tile_n, epilogue, a_k_major, b_n_major, dtype):
    """The stream-K tail forced: tiles cut into k-block ranges whose partial sums one block adds up, against the
    fp32 reference, run twice (bitwise equal: the partial sums are added in a fixed order) and close to whole tiles;
    the flags are left zeroed for the next launch."""
    a, b, bias, ref = biased_problem(M, N, K, a_k_major, b_n_major, dtype)
    outs = [checked_gemm(a, b, bias, ref, _stream_k=1, _tile_n=tile_n, _epilogue=epilogue) for _ in range(2)]
    assert torch.equal(outs[0], outs[1]), "stream-K results differ between runs"
    whole = ops.gemm(a, b, bias, _stream_k=-1, _tile_n=tile_n, _epilogue=epilogue)
    assert rel_err(outs[0], whole.float()) < TOL[dtype]
    torch.cuda.synchronize()
    flags = ops._stream_k_workspaces[(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)][1]
    assert int(flags.abs().sum()) == 0, "a launch left a stream-K flag raised"


def captured(fn):
    """(graph, output): `fn` run once on a side stream, then captured into a CUDA graph whose replay rewrites output."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        fn()
        with torch.cuda.graph(graph, stream=side):
            out = fn()
    return graph, out


def check_replays(graph, out, source, ref_of, times=2):
    """Refills `source` with fresh values and replays `graph` `times` times; `out` must match ref_of() each time."""
    for _ in range(times):
        source.copy_(torch.randn_like(source))
        graph.replay()
        torch.cuda.synchronize()
        assert rel_err(out, ref_of()) < TOL[out.dtype]


def test_stream_k_off_by_default_graph_capture_and_errors():
    """512 tiles on 132 SMs leave 3% of the last wave idle, but the default stays whole tiles (bitwise what forcing
    them off gives; no automatic rule measured faster). Captured in a CUDA graph, a stream-K launch gets its own
    workspace and replays right. Bad combinations are named errors."""
    a = torch.randn(8192, 1024, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(1024, 2048, device="cuda", dtype=torch.bfloat16)
    ref = reference(a, b)
    default = ops.gemm(a, b)
    assert rel_err(default, ref) < TOL[torch.bfloat16]
    assert torch.equal(default, ops.gemm(a, b, _stream_k=-1))
    assert rel_err(ops.gemm(a, b, _stream_k=1), ref) < TOL[torch.bfloat16]
    graph, out = captured(lambda: ops.gemm(a, b, _stream_k=1))
    check_replays(graph, out, a, lambda: reference(a, b))
    with pytest.raises(ValueError, match="stream-K"):
        ops.gemm(a, b, _stream_k=1, _schedule="dynamic")
    with pytest.raises(ValueError, match="stream-K"):
        ops.gemm(a, b, _stream_k=1, _cluster=2)
    with pytest.raises(ValueError, match="stream_k"):
        ops.gemm(a, b, _stream_k=2)


def test_epilogue_errors():
    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    for bad in ({"_tile_n": 128}, {"_cluster": 2}, {"_pingpong": 1}):
        with pytest.raises(ValueError, match="store warps"):
            ops.gemm(a, b, _epilogue=1, **bad)
    with pytest.raises(ValueError, match="epilogue must be 0"):
        ops.gemm(a, b, _epilogue=4)


def test_pingpong_errors():
    a = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="ping-pong"):
        ops.gemm(a, b, _pingpong=1, _tile_n=256)
    with pytest.raises(ValueError, match="ping-pong"):
        ops.gemm(a, b, _pingpong=1, _cluster=2)
    with pytest.raises(ValueError, match="pingpong"):
        ops.gemm(a, b, _pingpong=2)


def test_tile_width_choice_and_errors():
    """3072 x 2048 outputs: 192 wide tiles are 1.45 waves on 132 SMs, so the automatic choice takes narrow ones, or
    wide ones where a stream-K tail is asked for; every way the result is the same product. Bad widths are named
    errors."""
    a = torch.randn(3072, 512, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(512, 2048, device="cuda", dtype=torch.bfloat16)
    ref = reference(a, b)
    for tile_n in (0, 128, 256):
        for stream_k in (0, 1):
            assert rel_err(ops.gemm(a, b, _tile_n=tile_n, _stream_k=stream_k), ref) < TOL[torch.bfloat16]
    with pytest.raises(ValueError, match="tile_n"):
        ops.gemm(a, b, _tile_n=64)
    with pytest.raises(ValueError, match="256-wide"):
        ops.gemm(a, b, _tile_n=128, _cluster=2)


def test_strided_views_and_copy_path():
    base = torch.randn(300, 1024, device="cuda", dtype=torch.bfloat16)
    check(base[:, 128:640], torch.randn(512, 96, device="cuda", dtype=torch.bfloat16))  # leading stride 1024
    check(base[:77, 8:520], base[:, 64:576].t()[:, :64])  # both from one buffer, B M-major with lead 1024
    flat = torch.randn(1 + 64 * 40, device="cuda", dtype=torch.bfloat16)
    check(flat[1:].view(40, 64), torch.randn(64, 30, device="cuda", dtype=torch.bfloat16))  # misaligned base
    check(torch.randn(50, 64, device="cuda", dtype=torch.bfloat16),
          torch.randn(30, 64, device="cuda", dtype=torch.bfloat16).t()[:, ::2][:, :13])  # no unit stride
    check(operand(77, 64, False, torch.bfloat16), operand(64, 50, True, torch.bfloat16))  # M-major, lead 77


def test_degenerate_and_errors():
    a = torch.randn(0, 64, device="cuda", dtype=torch.bfloat16)
    assert ops.gemm(a, torch.randn(64, 8, device="cuda", dtype=torch.bfloat16)).shape == (0, 8)
    with pytest.raises(ValueError, match="K a multiple of 8"):
        ops.gemm(torch.randn(4, 12, device="cuda", dtype=torch.bfloat16),
                 torch.randn(12, 4, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="bfloat16 or float16"):
        ops.gemm(torch.randn(4, 16, device="cuda"), torch.randn(16, 4, device="cuda"))
    with pytest.raises(ValueError, match="shapes do not match"):
        ops.gemm(torch.randn(4, 16, device="cuda", dtype=torch.half), torch.randn(8, 4, device="cuda", dtype=torch.half))


@pytest.mark.parametrize("M,N,K", [(1, 7, 64), (129, 257, 72), (1000, 513, 64), (4096, 4096, 512), (8192, 2048, 256)])
@pytest.mark.parametrize("a_k_major", [True, False])
def test_dynamic_schedule(M, N, K, a_k_major):
    """Tiles taken from a counter: right on every shape, run after run (each launch re-zeroes its counter), with
    launches on two streams at once, and where a busy GPU starts blocks late."""
    if not a_k_major and M % 8:
        pytest.skip("that layout's leading stride is M")
    a = operand(M, K, a_k_major, torch.bfloat16)
    b = operand(K, N, True, torch.bfloat16)
    ref = reference(a, b)
    outs = []
    for _ in range(3):
        out = torch.full((M, N), float("nan"), device="cuda", dtype=torch.bfloat16)
        outs.append(ops.gemm(a, b, out=out, _schedule="dynamic"))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        outs.append(ops.gemm(a, b, _schedule="dynamic"))
    outs.append(ops.gemm(a, b, _schedule="dynamic"))
    torch.cuda.current_stream().wait_stream(side)
    busy_stream = torch.cuda.Stream()
    with torch.cuda.stream(busy_stream):  # other work holding SMs, so the GEMM's blocks start as SMs come free
        busy = torch.randn(4096, 4096, device="cuda")
        for _ in range(4):
            busy = busy @ busy.t() * 1e-3
    outs.append(ops.gemm(a, b, _schedule="dynamic"))
    torch.cuda.current_stream().wait_stream(busy_stream)
    for out in outs:
        assert torch.isfinite(out).all()
        assert rel_err(out, ref) < TOL[torch.bfloat16]
    ring = ops._zeroed_rings[("tickets", torch.cuda.current_device())]
    torch.cuda.synchronize()
    assert int(ring.abs().sum()) == 0, "a launch left its counter non-zero"
    with pytest.raises(ValueError, match="THUNDER_TK_GEMM_SCHEDULE='fastest': expected static or dynamic"):
        ops.gemm(a, b, _schedule="fastest")


def test_repeatable_and_graph_capturable():
    a = torch.randn(1000, 2048, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2048, 3000, device="cuda", dtype=torch.bfloat16)
    first = ops.gemm(a, b)
    for _ in range(3):
        assert torch.equal(ops.gemm(a, b), first)
    graph, out = captured(lambda: ops.gemm(a, b))
    a.copy_(torch.randn_like(a))
    graph.replay()
    torch.cuda.synchronize()
    assert rel_err(out, reference(a, b)) < 1e-2


def test_mlp_training_step_runs_every_gemm_on_tk():
    torch.manual_seed(0)
    model = LlamaMLP(512, 1376, proj_bias=True).cuda().bfloat16()
    x = torch.randn(4, 250, 512, device="cuda", dtype=torch.bfloat16)
    jm = thunder.jit(model, executors=[thunder_tk.tk])
    out = jm(x)
    seed = torch.randn_like(out)
    out.backward(seed)

    ref_model = LlamaMLP(512, 1376, proj_bias=True).cuda()
    ref_model.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    ref = ref_model(x.float())
    ref.backward(seed.float())
    assert rel_err(out, ref) < 2e-2
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert rel_err(p.grad, q.grad) < 3e-2

    report = thunder_tk.explain(jm)
    gemms = [r for r in report.rows if r.symbol in ("prims.linear", "ltorch.matmul")]
    assert len(gemms) >= 7  # 3 forward; dX of proj and dW of all three (x needs no gradient)
    assert all(r.claimed_by_tk for r in gemms), str(report)
    # fc_1 and fc_2 in one launch with silu(h1) * h2 (pattern_fusion.fuse_swiglu), proj and the backward's alone
    assert sorted(r.ran_by for r in gemms if r.trace == "forward") == ["tk: tk_linear"] + ["tk: tk_swiglu_linear"] * 2
    # proj's dX with SwiGLU's backward in one launch (pattern_fusion.fuse_swiglu_grad)
    assert {r.ran_by for r in gemms} == {"tk: tk_linear", "tk: tk_matmul", "tk: tk_swiglu_linear",
                                         "tk: tk_matmul_swiglu_grad"}


def test_persistent_grid_and_every_device():
    """The grid is one block per SM (clusters: what fits at once), and a process can use every GPU: the
    shared-memory opt-in and the grid are per device."""
    import thunder_tk._C as kernels

    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert kernels.gemm_resident_blocks(1) == sms
    pair = kernels.gemm_resident_blocks(2)
    assert pair % 2 == 0 and 0 < pair <= sms, pair
    with pytest.raises(ValueError, match="cluster must be 1 or 2"):
        kernels.gemm_resident_blocks(3)
    for index in range(torch.cuda.device_count()):
        with torch.cuda.device(index):
            a = torch.randn(300, 256, device=f"cuda:{index}", dtype=torch.bfloat16)
            b = torch.randn(256, 500, device=f"cuda:{index}", dtype=torch.bfloat16)
            for schedule in ("static", "dynamic"):
                assert rel_err(ops.gemm(a, b, _schedule=schedule), reference(a, b)) < TOL[torch.bfloat16]


@pytest.mark.parametrize("M,N", [(1, 70), (200, 70), (130, 301)])
def test_out_view_with_padding_is_written_only_inside(M, N):
    """TMA stores write whole 16-byte chunks: a C whose rows end off a chunk must not use them, else the columns
    after N (another tensor's data in a view) are overwritten."""
    K = 256
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    stride = (N + 8 + 7) // 8 * 8  # 16-byte rows with at least one spare chunk after column N
    base = torch.full((M, stride), 7.0, device="cuda", dtype=torch.bfloat16)
    out = base[:, :N]
    out.fill_(float("nan"))
    ops.gemm(a, b, out=out)
    assert torch.isfinite(out).all()
    assert rel_err(out, reference(a, b)) < TOL[torch.bfloat16]
    assert (base[:, N:] == 7.0).all()


# -- few rows: the skinny kernel (C^T = B^T A^T, K split over the SMs) -------------------------------------------

SKINNY_SHAPES = [(1, 1, 8), (1, 7, 64), (1, 4104, 4096), (5, 33, 8), (16, 8192, 2048), (17, 1000, 520), (32, 70, 72),
                 (33, 130, 4104), (64, 4160, 72), (64, 300, 16384), (2, 128256, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("b_n_major", [True, False])
@pytest.mark.parametrize("M,N,K", SKINNY_SHAPES)
def test_skinny(M, N, K, b_n_major, dtype):
    a, b, bias, ref = biased_problem(M, N, K, True, b_n_major, dtype)
    out = checked_gemm(a, b, bias, ref, _skinny=1)
    assert torch.equal(ops.gemm(a, b, bias), out)  # the default for <= 64 rows with A K-major
    for _ in range(2):  # the split counters are left zeroed, and the split order is fixed
        assert torch.equal(ops.gemm(a, b, bias, _skinny=1), out)
    checked_gemm(a, b, None, reference(a, b), _skinny=1)
    torch.cuda.synchronize()
    counters = ops._stream_k_workspaces[(torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream)][1]
    assert int(counters.abs().sum()) == 0, "a launch left a split counter raised"
    checked_gemm(a, b, bias, ref, _skinny=-1)  # the persistent kernel at the same size


def test_skinny_strided_rows_graph_capture_and_errors():
    # A with a row stride past K (a view into wider rows), C a view with padded rows
    wide = torch.randn(24, 4096 + 64, device="cuda", dtype=torch.bfloat16)
    a = wide[:, :4096]
    b = torch.randn(4096, 3000, device="cuda", dtype=torch.bfloat16)
    out_rows = torch.full((24, 3008), float("nan"), device="cuda", dtype=torch.bfloat16)
    ops.gemm(a, b, out=out_rows[:, :3000], _skinny=1)
    assert rel_err(out_rows[:, :3000], reference(a, b)) < TOL[torch.bfloat16]
    assert out_rows[:, 3000:].isnan().all(), "written outside the view"
    graph, out = captured(lambda: ops.gemm(a, b))
    check_replays(graph, out, wide, lambda: reference(a, b))
    with pytest.raises(ValueError, match="at most 64 rows"):
        ops.gemm(torch.randn(65, 64, device="cuda", dtype=torch.bfloat16), b[:64], _skinny=1)
    with pytest.raises(ValueError, match="K-major"):
        ops.gemm(torch.randn(64, 16, device="cuda", dtype=torch.bfloat16).t(), b[:64], _skinny=1)
    with pytest.raises(ValueError, match="knobs"):
        ops.gemm(a, b, _skinny=1, _tile_n=128)
    with pytest.raises(ValueError, match="skinny"):
        ops.gemm(a, b, _skinny=2)
