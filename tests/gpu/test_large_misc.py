"""Cross-entropy, the embedding's weight gradient, RMSNorm, AdamW and the squared gradient norm on tensors past 2^31
elements (and 16-bit tensors past 2^32 bytes), where an index or offset kept in 32 bits would wrap: every output
element checked against a float64 reference (torch's fused AdamW, bit for bit, for the optimizer), with the tolerances
of the families' own tests, into memory poisoned with NaN first.

The inputs are made in pieces, each from its own seeded generator, so that the reference makes each piece again and
checks the outputs piece by piece: no float64 copy of a whole tensor, and the peak stays near the op's own tensors
(about 8 to 22 GiB a test, each skipped where the GPU has less free than it asks; a few seconds each on an
H100/H200)."""

import gc
import sys
import traceback

import pytest
import torch

from accuracy import rel_err
from optim_twins import torch_clip_factor
from poisoning import poison_allocator
from thunder_tk import ops
from thunder_tk.optim import AdamW as TkAdamW

pytestmark = [pytest.mark.gpu]
DEVICE = "cuda"
GiB = 1 << 30
MARGIN_GIB = 2  # free memory asked for beyond a test's estimate (the CUDA context, the allocator's rounding)
PIECE = 1 << 27  # elements of a flat input made (and checked) at once: 1 GiB in float64


@pytest.fixture(autouse=True)
def free_memory_after():
    """Every test's tensors given back to the GPU after it, a failed test's too: pytest keeps the failure's traceback
    (sys.last_value), whose frames would hold gigabytes into the next test."""
    yield
    failure = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if failure is not None and failure.__traceback__ is not None:
        traceback.clear_frames(failure.__traceback__)
    gc.collect()
    torch.cuda.empty_cache()


def need_memory(gib: float) -> None:
    """Skips the test where the GPU has less than `gib` GiB free (plus a margin), counted after the caching allocator
    has given back what earlier tests left."""
    gc.collect()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    if free < (gib + MARGIN_GIB) * GiB:
        pytest.skip(f"needs {gib + MARGIN_GIB:.0f} GiB of free GPU memory; {free / GiB:.1f} GiB free")


def pieces(count: int, size: int = PIECE):
    """(k, start, stop) of the consecutive pieces of `size` covering [0, count)."""
    return [(k, lo, min(lo + size, count)) for k, lo in enumerate(range(0, count, size))]


def piece_randn(seed: int, k: int, shape, dtype, scale: float = 1.0, square: bool = False) -> torch.Tensor:
    """Piece k of an input: N(0, scale^2) (squared where `square`) in `dtype`, from a generator of its own, so that
    the same call makes it again for the reference."""
    g = torch.Generator(device=DEVICE).manual_seed(seed * 100_003 + k)
    x = torch.randn(shape, device=DEVICE, generator=g) * scale
    return (x.square() if square else x).to(dtype)


def flat_randn(numel: int, dtype, seed: int, **kw) -> torch.Tensor:
    """A flat tensor made of piece_randn's pieces of PIECE elements."""
    t = torch.empty(numel, dtype=dtype, device=DEVICE)
    for k, lo, hi in pieces(numel):
        t[lo:hi] = piece_randn(seed, k, hi - lo, dtype, **kw)
    return t


def rows_randn(rows: int, cols: int, piece_rows: int, dtype, seed: int, **kw) -> torch.Tensor:
    """A (rows, cols) tensor made of piece_randn's pieces of `piece_rows` rows."""
    t = torch.empty(rows, cols, dtype=dtype, device=DEVICE)
    for k, lo, hi in pieces(rows, piece_rows):
        t[lo:hi] = piece_randn(seed, k, (hi - lo, cols), dtype, **kw)
    return t


def assert_finite(label: str, t: torch.Tensor) -> None:
    assert torch.isfinite(t).all(), f"{label}: unwritten (NaN) or non-finite elements"


def assert_same_bits(label: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """Bit for bit (NaN equal to the same NaN), naming how many elements differ and the first."""
    ints = {2: torch.int16, 4: torch.int32}[got.element_size()]
    differ = got.contiguous().view(ints) != want.contiguous().view(ints)
    if differ.any():
        first = int(differ.nonzero()[0])
        raise AssertionError(f"{label}: {int(differ.sum())} of {got.numel()} elements differ; first at {first}: "
                             f"{got[first].item()!r}, want {want[first].item()!r}")


# -- cross-entropy -------------------------------------------------------------------------------------------------

# Llama 3's vocabulary over 16800 rows of bf16 logits: 2.15e9 elements, 4.3 GB; element 2^31 (byte 2^32) lies in row
# 16743. The forward and backward kernels take a block a row; the forward+grad kernel splits each row over 4 blocks
# of a cluster.
CE_ROWS, CE_CLASSES, CE_SEED = 16800, 128256, 5
CE_PIECE_ROWS = 1024
CE_IGNORED = [16744, CE_ROWS - 1]  # rows past element 2^31 whose target is the ignore_index
CE_BYTES = CE_ROWS * CE_CLASSES * 2
ROW_TOL = 1e-5  # test_cross_entropy's: row loss and lse against float64, relative to 1 + |lse|
CE_GRAD_TOL = 1e-2  # test_cross_entropy's for bf16: ||grad - ref|| / ||ref||
assert CE_ROWS * CE_CLASSES > 2**31 and CE_BYTES > 2**32


def ce_inputs():
    """bf16 logits N(0, 16) (a peaked softmax, as test_cross_entropy's), targets, two rows ignored."""
    logits = rows_randn(CE_ROWS, CE_CLASSES, CE_PIECE_ROWS, torch.bfloat16, CE_SEED, scale=4.0)
    g = torch.Generator(device=DEVICE).manual_seed(CE_SEED)
    target = torch.randint(0, CE_CLASSES, (CE_ROWS,), device=DEVICE, generator=g)
    target[CE_IGNORED] = -100
    return logits, target


def check_cross_entropy(loss, lse, grads, target, grad_loss) -> None:
    """Row losses and lse against float64 over all rows; each gradient in `grads` against grad_loss[r] (softmax -
    onehot) in float64, piece by piece (the logits made again), every element written, ignored rows zero."""
    ref_loss, ref_lse = (torch.empty(CE_ROWS, dtype=torch.float64, device=DEVICE) for _ in range(2))
    for k, lo, hi in pieces(CE_ROWS, CE_PIECE_ROWS):
        x = piece_randn(CE_SEED, k, (hi - lo, CE_CLASSES), torch.bfloat16, scale=4.0)
        t = target[lo:hi]
        ref_loss[lo:hi], ref_lse[lo:hi] = ops.cross_entropy_reference(x, t)
        want = x.double().sub_(ref_lse[lo:hi].unsqueeze(1)).exp_()  # softmax
        kept = (t != -100).nonzero().squeeze(1)
        want[kept, t[kept]] -= 1.0
        want.mul_(grad_loss[lo:hi].double().unsqueeze(1))
        want[t == -100] = 0.0
        ignored = (t == -100).nonzero().squeeze(1)
        for label, grad in grads.items():
            got = grad[lo:hi]
            assert_finite(f"{label} rows {lo}:{hi}", got)
            assert not got[ignored].any(), f"{label}: an ignored row's gradient is not zero"
            err = rel_err(got, want)
            assert err < CE_GRAD_TOL, f"{label} rows {lo}:{hi}: rel err {err:.3g}"
        del x, want
    assert_finite("lse", lse)
    assert_finite("loss", loss)
    assert (loss[CE_IGNORED] == 0).all(), "an ignored row's loss must be 0"
    scale = 1 + ref_lse.abs()
    for label, got, want in (("lse", lse, ref_lse), ("loss", loss, ref_loss)):
        err = ((got.double() - want).abs() / scale).max().item()
        assert err < ROW_TOL, f"{label}: err {err:.3g}"


def test_cross_entropy_forward_and_backward_past_2_31_elements():
    """ops.cross_entropy_forward and _backward (a block a row, row offsets row x 128256 past 2^31 elements) on 16800
    x 128256 bf16 logits, grad_loss random per row. Peak about 13 GiB (logits, grad and the poisoned spare), a few
    seconds."""
    need_memory(3 * CE_BYTES / GiB + 4)
    logits, target = ce_inputs()
    grad_loss = torch.randn(CE_ROWS, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(1))
    poison_allocator(((CE_ROWS,), torch.float32))
    loss, lse = ops.cross_entropy_forward(logits, target)
    poison_allocator(((CE_ROWS, CE_CLASSES), torch.bfloat16))
    grad = ops.cross_entropy_backward(logits, target, lse, grad_loss)
    assert grad.shape == logits.shape and grad.dtype == torch.bfloat16
    del logits
    check_cross_entropy(loss, lse, {"grad": grad}, target, grad_loss)
    del grad


def test_cross_entropy_forward_grad_past_2_31_elements():
    """ops.cross_entropy_forward_grad on the one-kernel path (each row over 4 blocks of a cluster, bulk copies at
    row x 128256 + part offsets) on 16800 x 128256 bf16 logits: into a new gradient, then over the logits themselves
    (overwrite=True) with the same bits. Peak about 13 GiB, a few seconds."""
    need_memory(3 * CE_BYTES / GiB + 4)
    logits, target = ce_inputs()
    assert ops.cross_entropy_forward_grad_unsupported(logits) is None, "the test wants the one-kernel path"
    poison_allocator(((CE_ROWS, CE_CLASSES), torch.bfloat16), ((CE_ROWS,), torch.float32))
    loss, lse, grad = ops.cross_entropy_forward_grad(logits, target)
    loss_again, lse_again, in_place = ops.cross_entropy_forward_grad(logits, target, overwrite=True)
    assert in_place.data_ptr() == logits.data_ptr()
    del logits
    assert_same_bits("loss over the logits", loss_again, loss)
    assert_same_bits("lse over the logits", lse_again, lse)
    for _, lo, hi in pieces(CE_ROWS, CE_PIECE_ROWS):
        assert_same_bits(f"grad over the logits, rows {lo}:{hi}", in_place[lo:hi].reshape(-1), grad[lo:hi].reshape(-1))
    del in_place
    ones = torch.ones(CE_ROWS, device=DEVICE)  # the gradient comes unscaled
    check_cross_entropy(loss, lse, {"forward_grad": grad}, target, ones)
    del grad


# -- the embedding's weight gradient -------------------------------------------------------------------------------

# 131072 tokens into Llama 3's 128256-row table, rows of 16800 (whole 16-byte vectors) or 16745 elements (element by
# element): both the incoming gradient (tokens x dim) and the table (rows x dim) pass 2^31 elements.
EMB_TOKENS, EMB_ROWS, EMB_SEED = 131072, 128256, 7
EMB_PIECE = 8192  # tokens a piece of the incoming gradient; table rows a piece of the check
EMB_TOL = 1e-2  # test_embedding_backward's for bf16


@pytest.mark.parametrize("dim", [16800, 16745], ids=["vectors", "elements"])
def test_embedding_backward_past_2_31_elements(dim):
    """ops.embedding_backward with tokens x dim and rows x dim past 2^31: every row of the table against float64
    index_add, piece by piece; ids include the last row, the row holding element 2^31, a row summed 56 times near the
    end and a padding row there (kept zero). Peak about 18 GiB, a few seconds."""
    assert EMB_TOKENS * dim > 2**31 and EMB_ROWS * dim > 2**31
    table_bytes, grad_bytes = EMB_ROWS * dim * 2, EMB_TOKENS * dim * 2
    need_memory((3 * table_bytes + grad_bytes) / GiB + 2)
    grad = rows_randn(EMB_TOKENS, dim, EMB_PIECE, torch.bfloat16, EMB_SEED)
    g = torch.Generator(device=DEVICE).manual_seed(EMB_SEED)
    ids = torch.randint(0, EMB_ROWS, (EMB_TOKENS,), device=DEVICE, generator=g)
    padding_idx = EMB_ROWS - 2
    ids[:4] = EMB_ROWS - 1
    ids[4:8] = 2**31 // dim  # the row holding element 2^31 of the table
    ids[8:64] = EMB_ROWS - 3
    ids[64:70] = padding_idx
    poison_allocator(((EMB_ROWS, dim), torch.bfloat16))
    out = ops.embedding_backward(grad, ids, EMB_ROWS, padding_idx)
    assert out.shape == (EMB_ROWS, dim) and out.dtype == torch.bfloat16
    assert not out[padding_idx].any(), "the padding row must stay zero"
    for _, lo, hi in pieces(EMB_ROWS, EMB_PIECE):
        got = out[lo:hi]
        assert_finite(f"rows {lo}:{hi}", got)
        tokens = ((ids >= lo) & (ids < hi) & (ids != padding_idx)).nonzero().squeeze(1)
        want = torch.zeros(hi - lo, dim, dtype=torch.float64, device=DEVICE)
        want.index_add_(0, ids[tokens] - lo, grad[tokens].double())
        err = rel_err(got, want)
        assert err < EMB_TOL, f"rows {lo}:{hi}: rel err {err:.3g}"
        del want
    del grad, out


# -- RMSNorm -------------------------------------------------------------------------------------------------------

# 262208 tokens of a hidden size of 8192 (Llama 3 70B's): 2^31 + 2^19 bf16 elements, 4.3 GB a tensor; four rows a
# thread's registers hold, the next row's loads issued under this one's reduction.
NORM_ROWS, NORM_N, NORM_SEED = 262208, 8192, 9
NORM_PIECE_ROWS = 8192
NORM_EPS = 1e-5
NORM_TOL = {torch.bfloat16: 1e-2, torch.float32: 1e-4}  # test_rms_norm's, by the output's dtype
NORM_RSTD_TOL = 1e-5
NORM_BYTES = NORM_ROWS * NORM_N * 2
assert NORM_ROWS * NORM_N > 2**31 and NORM_BYTES > 2**32


def test_rms_norm_forward_and_backward_past_2_31_elements():
    """ops.rms_norm with a residual add (y, rstd and the sum s written at row offsets past 2^31 elements) and
    ops.rms_norm_backward with the residual stream's gradient, fp32 weight: y, rstd, s and dx against the float64
    references piece by piece, dw (summed over every row) against their sum. Peak about 22 GiB, a few seconds."""
    need_memory(5 * NORM_BYTES / GiB + 4)
    x = rows_randn(NORM_ROWS, NORM_N, NORM_PIECE_ROWS, torch.bfloat16, NORM_SEED)
    residual = rows_randn(NORM_ROWS, NORM_N, NORM_PIECE_ROWS, torch.bfloat16, NORM_SEED + 1)
    weight = (1 + 0.5 * torch.randn(NORM_N, device=DEVICE, generator=torch.Generator(device=DEVICE).manual_seed(3)))
    poison_allocator(((NORM_ROWS, NORM_N), torch.bfloat16), ((NORM_ROWS, 1), torch.float32))
    y, rstd, s = ops.rms_norm(x, weight, NORM_EPS, residual)
    for _, lo, hi in pieces(NORM_ROWS, NORM_PIECE_ROWS):
        want_y, want_rstd, want_s = ops.rms_norm_reference(x[lo:hi], weight, NORM_EPS, residual[lo:hi])
        for label, got in (("y", y[lo:hi]), ("rstd", rstd[lo:hi]), ("s", s[lo:hi])):
            assert_finite(f"{label} rows {lo}:{hi}", got)
        assert_same_bits(f"s rows {lo}:{hi}", s[lo:hi].reshape(-1), want_s.reshape(-1))
        err = rel_err(rstd[lo:hi], want_rstd)
        assert err < NORM_RSTD_TOL, f"rstd rows {lo}:{hi}: {err:.3g}"
        err = rel_err(y[lo:hi], want_y)
        assert err < NORM_TOL[torch.bfloat16], f"y rows {lo}:{hi}: {err:.3g}"
        del want_y
    del x, y
    grad = rows_randn(NORM_ROWS, NORM_N, NORM_PIECE_ROWS, torch.bfloat16, NORM_SEED + 2)
    poison_allocator(((NORM_ROWS, NORM_N), torch.bfloat16), ((NORM_N,), torch.float32))
    dx, dw = ops.rms_norm_backward(grad, s, rstd, weight, residual_grad=residual)
    want_dw = torch.zeros(NORM_N, dtype=torch.float64, device=DEVICE)
    for _, lo, hi in pieces(NORM_ROWS, NORM_PIECE_ROWS):
        want_dx, dw_part = ops.rms_norm_backward_reference(grad[lo:hi], s[lo:hi], rstd[lo:hi], weight,
                                                           residual[lo:hi])
        want_dw += dw_part
        assert_finite(f"dx rows {lo}:{hi}", dx[lo:hi])
        err = rel_err(dx[lo:hi], want_dx)
        assert err < NORM_TOL[torch.bfloat16], f"dx rows {lo}:{hi}: {err:.3g}"
        del want_dx
    assert_finite("dw", dw)
    err = rel_err(dw, want_dw)
    assert err < NORM_TOL[torch.float32], f"dw: {err:.3g}"
    del grad, s, residual, dx


# -- AdamW and the squared gradient norm ---------------------------------------------------------------------------

# A parameter past 2^31 elements (8.6 GB of bf16 past 2^32 bytes; a 131136 x 16384 embedding and change) between two
# small ones, so that its chunks are numbered after another tensor's; its last chunk is 7 elements (the tail path).
ADAMW_NUMELS = [4097, 2**31 + 2**20 + 7, 9]
ADAMW_HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, maximize=False)
ADAMW_BYTES = sum(ADAMW_NUMELS) * 2
SQ_NORM_TOL = 1e-5  # test_optim's: the fp32 sum against float64's, relatively


def adamw_piece(i: int, k: int, n: int, *, zero_state: bool = False):
    """Piece k of entry i's parameter, gradient and moments, as test_optim's entries makes them: N(0, 1), N(0, 1),
    N(0, 0.01) and the square of N(0, 0.01) (or zero moments)."""
    bf16 = torch.bfloat16
    p, g = piece_randn(100 + i, k, n, bf16), piece_randn(200 + i, k, n, bf16)
    if zero_state:
        return p, g, torch.zeros(n, dtype=bf16, device=DEVICE), torch.zeros(n, dtype=bf16, device=DEVICE)
    return p, g, piece_randn(300 + i, k, n, bf16, scale=0.1), piece_randn(400 + i, k, n, bf16, scale=0.1, square=True)


def adamw_entries(*, zero_state: bool = False, lists: int = 4):
    """The first `lists` of P, G, M, V for the entries of ADAMW_NUMELS, made of adamw_piece's pieces."""
    made = [[torch.empty(n, dtype=torch.bfloat16, device=DEVICE) for n in ADAMW_NUMELS] for _ in range(lists)]
    for i, n in enumerate(ADAMW_NUMELS):
        for k, lo, hi in pieces(n):
            for X, values in zip(made, adamw_piece(i, k, hi - lo, zero_state=zero_state)):
                X[i][lo:hi] = values
    return made


def torch_fused(p, g, m, v, step: int) -> None:
    """torch's fused AdamW update in place, as torch.optim.AdamW(fused=True) launches it for step count `step`."""
    h = ADAMW_HYPER
    torch._fused_adamw_([p], [g], [m], [v], [], [torch.tensor(float(step), device=DEVICE)], lr=h["lr"],
                        beta1=h["beta1"], beta2=h["beta2"], weight_decay=h["weight_decay"], eps=h["eps"],
                        amsgrad=False, maximize=h["maximize"])


def sq_norm_float64(tensors) -> float:
    return sum(float(t[lo:hi].double().square().sum()) for t in tensors for _, lo, hi in pieces(t.numel()))


def assert_sq_norm_near(label: str, got: torch.Tensor, want: float) -> None:
    """Within SQ_NORM_TOL of float64's sum. Each of the grid's threads adds some 8000 to 16000 squares in fp32 here
    (the test_optim sizes: a few hundred): its rounding errors, of either sign, grow as the square root of that, to
    a few 1e-6 of its sum at most, and the threads' sums add up in fixed order."""
    assert abs(got.item() - want) <= SQ_NORM_TOL * want, f"{label}: {got.item()!r}, float64 {want!r}"


def check_adamw_entries(label: str, P, G, M, V, steps, *, zero_state: bool = False) -> None:
    """Every element of P, M and V bit for bit as torch's fused AdamW after `steps` ((step, factor or None) in
    turn, the gradient times the factor in its dtype where given) from adamw_piece's values, piece by piece; G
    unchanged."""
    for i, n in enumerate(ADAMW_NUMELS):
        for k, lo, hi in pieces(n):
            p, g, m, v = adamw_piece(i, k, hi - lo, zero_state=zero_state)
            assert_same_bits(f"{label}: grad {i} [{lo}:{hi}]", G[i][lo:hi], g)
            for step, factor in steps:
                torch_fused(p, g if factor is None else g.clone().mul_(factor), m, v, step)
            for name, X, want in (("param", P, p), ("exp_avg", M, m), ("exp_avg_sq", V, v)):
                assert_same_bits(f"{label}: {name} {i} [{lo}:{hi}]", X[i][lo:hi], want)


def test_adamw_step_and_clip_past_2_31_elements():
    """ops.adamw_step over [4097, 2^31 + 2^20 + 7, 9] bf16 entries (chunk offsets past 2^31 elements): a step
    without clipping, then ops.sq_norm of the gradients (against float64) and a step clipped by it to a third of the
    norm; after each, every element bit for bit as torch's fused AdamW (test_optim's standard) on gradients
    multiplied by torch's clip factor, the gradients unwritten. Peak about 19 GiB, a few seconds."""
    need_memory(4 * ADAMW_BYTES / GiB + 2)
    P, G, M, V = adamw_entries()
    ops.adamw_step(P, G, M, V, step=1, **ADAMW_HYPER)
    check_adamw_entries("step 1", P, G, M, V, [(1, None)])
    sq = torch.full((), float("nan"), device=DEVICE)
    ops.sq_norm(G, out=sq)
    assert_sq_norm_near("sq_norm of the gradients", sq, sq_norm_float64(G))
    max_norm = sq.sqrt().item() / 3
    factor = torch_clip_factor(sq.sqrt(), max_norm)
    assert factor.item() < 1
    ops.adamw_step(P, G, M, V, step=2, grad_sq_norm=sq, max_norm=max_norm, **ADAMW_HYPER)
    check_adamw_entries("step 2, clipped", P, G, M, V, [(1, None), (2, factor)])
    del P, G, M, V


def test_optimizer_clip_grad_norm_and_step_past_2_31_elements():
    """thunder_tk.optim.AdamW over parameters of [4097, 2^31 + 2^20 + 7, 9] bf16 elements, all on tk's kernel:
    clip_grad_norm_ (tk's sq_norm; the norm against float64) to a third of the norm, then the first step, every
    element bit for bit as torch's fused AdamW on the clipped gradients from zero moments. Peak about 19 GiB, a few
    seconds."""
    need_memory(4 * ADAMW_BYTES / GiB + 2)
    P, G = adamw_entries(zero_state=True, lists=2)
    params = [torch.nn.Parameter(p) for p in P]
    for p, g in zip(params, G):
        p.grad = g
    del P
    ours = TkAdamW(params, lr=ADAMW_HYPER["lr"], betas=(ADAMW_HYPER["beta1"], ADAMW_HYPER["beta2"]),
                   eps=ADAMW_HYPER["eps"], weight_decay=ADAMW_HYPER["weight_decay"])
    want = sq_norm_float64(G)
    max_norm = want**0.5 / 3
    norm = ours.clip_grad_norm_(max_norm)
    assert_sq_norm_near("clip_grad_norm_'s norm, squared", norm.square(), want)
    factor = torch_clip_factor(norm, max_norm)
    ours.step()
    assert ours.routes["tk"] == len(params) and not ours.routes["declined"], ours.routes
    M = [ours.state[p]["exp_avg"] for p in params]
    V = [ours.state[p]["exp_avg_sq"] for p in params]
    check_adamw_entries("optimizer", [p.detach() for p in params], G, M, V, [(1, factor)], zero_state=True)
    del params, G, M, V, ours


def test_sq_norm_of_a_list_past_2_32_elements():
    """ops.sq_norm over [2^31 + 2^20 + 7, 4097, 2^31 + 5] bf16 tensors (4.3e9 elements together, each big one past
    2^31): against float64's sum, into an `out` poisoned with NaN, the same bits on a second call. Peak about 8 GiB,
    a few seconds."""
    numels = [2**31 + 2**20 + 7, 4097, 2**31 + 5]
    assert sum(numels) > 2**32
    need_memory(sum(numels) * 2 / GiB + 1)
    tensors = [flat_randn(n, torch.bfloat16, 500 + i, scale=3.0) for i, n in enumerate(numels)]
    out = torch.full((), float("nan"), device=DEVICE)
    assert ops.sq_norm(tensors, out=out) is out
    assert_sq_norm_near("sq_norm", out, sq_norm_float64(tensors))
    assert_same_bits("a second sq_norm", ops.sq_norm(tensors).reshape(1), out.reshape(1))
    del tensors
