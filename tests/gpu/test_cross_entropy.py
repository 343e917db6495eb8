"""The cross-entropy kernels (ops.cross_entropy_forward / ops.cross_entropy_backward) against a float64 reference.

Covers one to 8192 rows and 1 to 128256 classes (vector tails, rows alternately on and off 16 bytes), bf16, fp16 and
fp32 logits, strided views (wide rows, a misaligned start, a transposed view that ops copies), ignored rows (default
and custom ignore_index), targets outside [0, classes), grad_loss of any stride, outputs written in full (the caching
allocator is filled with NaN first), repeatability, extreme logits, the ops.cross_entropy convenience against
torch, and a bf16 Linear + cross-entropy trained through Thunder with the loss on tk.
"""

import copy
import gc

import pytest
import torch
import torch.nn.functional as F
import thunder

import thunder_tk
from accuracy import rel_err
from poisoning import poison_allocator
from thunder_tk import ops, tk

pytestmark = pytest.mark.gpu
DEVICE = "cuda"

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
# Row loss and lse are fp32 whatever the logits' dtype, from the same (exactly representable) logits: only the fp32
# summation differs. The error is measured relative to the row's scale, 1 + |lse| (a loss may be ~0 by cancellation).
ROW_TOL = 1e-5
# ||grad - ref|| / ||ref||: the gradient is rounded once to the logits' dtype on the way out.
GRAD_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3, torch.float32: 1e-5}


def make(rows, classes, dtype, seed=0, scale=4.0):
    """Logits N(0, 1) x `scale` (a peaked softmax) in `dtype`, and class indices."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    logits = (torch.randn(rows, classes, device=DEVICE, generator=g) * scale).to(dtype)
    target = torch.randint(0, classes, (rows,), device=DEVICE, generator=g)
    return logits, target


def per_row(rows, seed=1):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    return torch.randn(rows, device=DEVICE, generator=g)


reference = ops.cross_entropy_reference  # row losses and lse in float64


def reference_grad(logits, target, grad_loss, ignore_index=-100):
    """grad_loss[r] * (softmax - onehot(target[r])) in float64; zero rows where target == ignore_index."""
    x = logits.double()
    p = torch.softmax(x, dim=1)
    valid = (target >= 0) & (target < x.shape[1])
    rows = torch.arange(x.shape[0], device=x.device)
    p[rows[valid], target[valid]] -= 1.0
    grad = grad_loss.double().unsqueeze(1) * p
    grad[target == ignore_index] = 0.0
    return grad


def row_err(out, ref, ref_lse):
    return ((out.double() - ref).abs() / (1 + ref_lse.abs())).max().item() if ref.numel() else 0.0


def forward(logits, target, ignore_index=-100):
    """The forward on poisoned memory, with its output contract checked."""
    rows = logits.shape[0]
    poison_allocator(((rows,), torch.float32))
    loss, lse = ops.cross_entropy_forward(logits, target, ignore_index)
    for t in (loss, lse):
        assert t.shape == (rows,) and t.dtype == torch.float32 and t.device == logits.device and t.is_contiguous()
    return loss, lse


def backward(logits, target, lse, grad_loss, ignore_index=-100):
    poison_allocator((tuple(logits.shape), logits.dtype))
    grad = ops.cross_entropy_backward(logits, target, lse, grad_loss, ignore_index)
    assert grad.shape == logits.shape and grad.dtype == logits.dtype and grad.device == logits.device
    assert grad.is_contiguous()
    return grad


def check(logits, target, grad_loss=None, ignore_index=-100):
    """Forward and backward against the float64 reference; every output written (finite) where it must be."""
    rows = logits.shape[0]
    loss, lse = forward(logits, target, ignore_index)
    ref_loss, ref_lse = reference(logits, target, ignore_index)
    ignored = target == ignore_index
    bad = ~ignored & ((target < 0) | (target >= logits.shape[1]))  # outside [0, classes): NaN loss
    assert torch.isfinite(lse).all(), "lse has unwritten (NaN) or non-finite elements"
    assert torch.isnan(loss[bad]).all(), "a target outside [0, classes) must give a NaN loss"
    assert torch.isfinite(loss[~bad]).all(), "loss has unwritten (NaN) or non-finite elements"
    assert (loss[ignored] == 0).all(), "an ignored row's loss must be 0"
    assert row_err(lse, ref_lse, ref_lse) < ROW_TOL, f"lse err {row_err(lse, ref_lse, ref_lse)}"
    err = row_err(loss[~bad], ref_loss[~bad], ref_lse[~bad])
    assert err < ROW_TOL, f"loss err {err}"

    grad_loss = per_row(rows) if grad_loss is None else grad_loss
    grad = backward(logits, target, lse, grad_loss, ignore_index)
    assert torch.isfinite(grad).all(), "grad has unwritten (NaN) or non-finite elements"
    assert (grad[ignored] == 0).all(), "an ignored row's gradient must be zero"
    keep = ~bad  # the gradient of a row whose target is outside [0, classes) is not specified
    if logits.shape[1] == 1:  # softmax is 1 and the one-hot 1: the reference is exactly 0, so no relative error
        bound = 1e-6 * grad_loss.double().abs().unsqueeze(1)
        assert (grad[keep].double().abs() <= bound[keep]).all(), grad
        return loss, lse, grad
    ref_grad = reference_grad(logits, target, grad_loss, ignore_index)
    err = rel_err(grad[keep], ref_grad[keep])
    assert err < GRAD_TOL[logits.dtype], f"grad rel err {err}"
    return loss, lse, grad


# (rows, classes). rows x classes stays <= ~34M so the float64 reference fits easily; 128256 classes with few rows.
SHAPES = (
    [(1, c) for c in (1, 7, 8, 9, 1000, 4097, 32000, 128256)]
    + [(3, c) for c in (1, 7, 8, 9, 1000, 4097, 32000, 128256)]
    + [(257, c) for c in (1, 7, 8, 9, 1000, 4097, 32000)]
    + [(64, 128256)]
    + [(8192, c) for c in (1, 8, 9, 1000, 4097)]
)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,classes", SHAPES, ids=[f"{r}x{c}" for r, c in SHAPES])
def test_matches_fp64_reference(rows, classes, dtype):
    check(*make(rows, classes, dtype, seed=rows + classes))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_wide_rows(dtype):
    """A row stride larger than the classes: a [:, :C] slice of a wider tensor."""
    for rows, classes, extra in [(257, 1000, 40), (33, 4097, 3), (5, 32000, 8)]:
        wide, target = make(rows, classes + extra, dtype, seed=classes)
        target = target.clamp_max(classes - 1)
        view = wide[:, :classes]
        assert view.stride() == (classes + extra, 1)
        check(view, target)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_misaligned_row_start(dtype):
    """A view starting one element into its buffer: no row starts on 16 bytes (classes x size is a multiple of 16),
    so every row takes the element-wise path."""
    rows, classes = 129, 1000
    flat = torch.randn(1 + rows * classes, device=DEVICE).mul(4).to(dtype)
    logits = flat[1:].view(rows, classes)
    assert logits.data_ptr() % 16 != 0
    target = make(rows, classes, dtype)[1]
    loss, lse, grad = check(logits, target)
    # The same values, aligned (the vector path): the same results up to the summation order.
    aligned = logits.contiguous()
    loss2, lse2, grad2 = check(aligned, target)
    assert (lse - lse2).abs().max().item() < 1e-4
    assert rel_err(grad, grad2.double()) < GRAD_TOL[dtype]


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_transposed_view_is_copied(dtype):
    """A non-unit class stride: ops copies the logits first."""
    rows, classes = 300, 1001
    base, _ = make(classes, rows, dtype, seed=11)
    logits = base.t()
    assert logits.stride() == (1, rows)
    target = make(rows, classes, dtype)[1]
    _, lse, grad = check(logits, target)
    _, lse2, grad2 = check(logits.contiguous(), target)
    assert torch.equal(lse, lse2) and torch.equal(grad, grad2)


def test_expanded_rows_view():
    """Every row the same (an expanded (1, C) tensor, row stride 0): only read, so nothing overlaps in the output."""
    one, _ = make(1, 1000, torch.bfloat16, seed=31)
    logits = one.expand(8, 1000)
    assert logits.stride() == (0, 1)
    target = make(8, 1000, torch.bfloat16, seed=31)[1]
    check(logits, target)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("ignore_index", [-100, -1, 3], ids=["default", "minus_1", "class_3"])
@pytest.mark.parametrize("rows,classes", [(5, 9), (257, 4097), (64, 32000)])
def test_ignored_rows_have_zero_loss_and_gradient(rows, classes, ignore_index, dtype):
    logits, target = make(rows, classes, dtype, seed=5)
    target[::3] = ignore_index  # with ignore_index 3, any row that drew class 3 is ignored too
    loss, _, grad = check(logits, target, ignore_index=ignore_index)
    ignored = target == ignore_index
    assert ignored.any() and (~ignored).any()
    assert torch.equal(loss[ignored], torch.zeros_like(loss[ignored]))
    assert torch.equal(grad[ignored], torch.zeros_like(grad[ignored]))
    assert (loss[~ignored] > 0).all()


def test_every_row_ignored():
    logits, _ = make(17, 1000, torch.bfloat16)
    target = torch.full((17,), -100, device=DEVICE)
    loss, lse, grad = check(logits, target)
    assert torch.equal(loss, torch.zeros_like(loss)) and torch.equal(grad, torch.zeros_like(grad))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_target_outside_the_classes_gives_nan(dtype):
    rows, classes = 6, 1000
    logits, target = make(rows, classes, dtype, seed=9)
    target[1], target[3], target[4] = classes, -5, 10**12
    loss, lse, _ = check(logits, target)  # NaN exactly there; every other row (and every lse) right
    assert torch.isnan(loss[[1, 3, 4]]).all() and torch.isfinite(loss[[0, 2, 5]]).all()


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,classes", [(1, 9), (257, 1000), (33, 32000)])
def test_grad_loss_of_any_stride(rows, classes, dtype):
    logits, target = make(rows, classes, dtype, seed=13)
    target[0] = -100
    scalar = torch.tensor(0.37, device=DEVICE).expand(rows)  # a mean's gradient: one value, stride 0
    assert scalar.stride() == (0,)
    check(logits, target, grad_loss=scalar)
    check(logits, target, grad_loss=per_row(rows))  # reduction="none": one value per row
    spaced = per_row(2 * rows, seed=3)[::2]  # stride 2
    assert spaced.stride() == (2,)
    _, lse, grad = check(logits, target, grad_loss=spaced)
    assert torch.equal(grad, backward(logits, target, lse, spaced.contiguous()))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,classes", [(257, 4097), (64, 128256), (8192, 1000)])
def test_repeatable_bitwise(rows, classes, dtype):
    logits, target = make(rows, classes, dtype, seed=17)
    grad_loss = per_row(rows)
    loss, lse = ops.cross_entropy_forward(logits, target)
    grad = ops.cross_entropy_backward(logits, target, lse, grad_loss)
    for _ in range(3):
        loss2, lse2 = ops.cross_entropy_forward(logits, target)
        assert torch.equal(loss, loss2) and torch.equal(lse, lse2)
        assert torch.equal(grad, ops.cross_entropy_backward(logits, target, lse2, grad_loss))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("classes", [9, 1000, 32000])
def test_extreme_logits(classes, dtype):
    """One huge logit (1e4), targeted or not; -inf entries around a finite target; a row of all -inf but the
    target: all finite and right (exp never overflows, -inf contributes exactly 0)."""
    logits, target = make(6, classes, dtype, seed=19)
    logits[0, 2] = 1e4
    target[0] = 2  # loss ~ 0, softmax ~ one-hot
    logits[1, 5] = 1e4
    target[1] = 0  # loss ~ 1e4
    logits[2, ::2] = float("-inf")
    target[2] = 1
    logits[3] = float("-inf")
    logits[3, 4] = 0.5
    target[3] = 4  # loss exactly 0, lse 0.5
    logits[4, 3:] = -1e4
    target[4] = 1
    loss, lse, grad = check(logits, target)
    assert loss[0].abs().item() < 1e-3 and abs(loss[1].item() - (lse[1].item() - logits[1, 0].float().item())) < 2e-3
    assert abs(loss[3].item()) < 1e-6 and abs(lse[3].item() - 0.5) < 1e-6
    assert torch.equal(grad[2, ::2], torch.zeros_like(grad[2, ::2]))  # exp(-inf) is exactly 0
    others = torch.arange(classes, device=DEVICE) != 4
    assert torch.equal(grad[3, others], torch.zeros_like(grad[3, others]))
    assert grad[3, 4].abs().item() < 1e-5  # softmax 1 at the target: 1 - 1


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("ignore_index", [-100, 7])
def test_convenience_matches_torch(reduction, ignore_index, dtype):
    rows, classes = 513, 4097
    logits, target = make(rows, classes, dtype, seed=23)
    target[::5] = ignore_index
    out = ops.cross_entropy(logits, target, ignore_index=ignore_index, reduction=reduction)
    ref = F.cross_entropy(logits.float(), target, ignore_index=ignore_index, reduction=reduction)
    assert out.dtype == dtype and out.shape == ref.shape
    tol = {torch.bfloat16: 1e-2, torch.float16: 1e-3, torch.float32: 1e-5}[dtype]
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    with pytest.raises(ValueError, match="reduction"):
        ops.cross_entropy(logits, target, reduction="batchmean")


def test_no_rows():
    logits = torch.empty(0, 1000, device=DEVICE, dtype=torch.bfloat16)
    target = torch.empty(0, dtype=torch.int64, device=DEVICE)
    loss, lse = ops.cross_entropy_forward(logits, target)
    assert loss.shape == lse.shape == (0,)
    grad = ops.cross_entropy_backward(logits, target, lse, torch.empty(0, device=DEVICE))
    assert grad.shape == (0, 1000)


def test_runs_on_the_current_stream():
    logits, target = make(2048, 32000, torch.bfloat16, seed=29)
    grad_loss = per_row(2048)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        loss, lse = ops.cross_entropy_forward(logits, target)
        grad = ops.cross_entropy_backward(logits, target, lse, grad_loss)
    torch.cuda.current_stream().wait_stream(side)
    ref_loss, ref_lse = reference(logits, target)
    assert row_err(loss, ref_loss, ref_lse) < ROW_TOL
    assert rel_err(grad, reference_grad(logits, target, grad_loss)) < GRAD_TOL[torch.bfloat16]


def _bad(name):
    logits, target = make(8, 100, torch.bfloat16)
    lse = torch.zeros(8, device=DEVICE)
    return {
        "three_dims": (logits.view(8, 10, 10), target, lse),
        "target_2d": (logits, target.view(2, 4), lse),
        "target_rows": (logits, target[:7], lse),
        "int32_target": (logits, target.int(), lse),
        "float64": (logits.double(), target, lse),
        "no_classes": (logits[:, :0], target, lse),
        "cpu": (logits.cpu(), target.cpu(), lse.cpu()),
        "lse_dtype": (logits, target, lse.half()),
        "lse_shape": (logits, target, lse[:4]),
    }[name]


BAD_ARGUMENTS = {  # name -> (pattern the error must contain, whether the forward checks it too)
    "three_dims": (r"rows, classes|3-D", True),
    "target_2d": (r"target", True),
    "target_rows": (r"target", True),
    "int32_target": (r"int64", True),
    "float64": (r"float64|bfloat16", True),
    "no_classes": (r"class", True),
    "cpu": (r"CUDA", True),
    "lse_dtype": (r"lse", False),
    "lse_shape": (r"lse", False),
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_raise_named_errors(name):
    logits, target, lse = _bad(name)
    pattern, in_forward = BAD_ARGUMENTS[name]
    if in_forward:
        with pytest.raises((ValueError, TypeError), match=pattern):
            ops.cross_entropy_forward(logits, target)
    with pytest.raises((ValueError, TypeError), match=pattern):
        ops.cross_entropy_backward(logits, target, lse, torch.ones_like(lse, dtype=torch.float32))


# -- through Thunder ---------------------------------------------------------------------------------------


class LMHead(torch.nn.Module):
    """The last layer of a GPT-2-sized language model and its loss, the logits left in bf16."""

    def __init__(self, hidden=256, vocab=50257):
        super().__init__()
        self.proj = torch.nn.Linear(hidden, vocab)

    def forward(self, x, target):
        return F.cross_entropy(self.proj(x), target)


def test_thunder_lm_head_trains_with_the_loss_on_tk():
    torch.manual_seed(0)
    model = LMHead().to(DEVICE, torch.bfloat16)
    ref_model = copy.deepcopy(model).float()
    rows = 512
    x = torch.randn(rows, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 50257, (rows,), device=DEVICE)
    target[::9] = -100

    jm = thunder.jit(model, executors=[tk])
    loss = jm(x, target)
    assert loss.dtype == torch.bfloat16
    loss.backward()

    x_ref = x.detach().float().requires_grad_()
    ref_loss = ref_model(x_ref, target)
    ref_loss.backward()
    assert abs(loss.float().item() - ref_loss.item()) / ref_loss.item() < 1e-2
    assert rel_err(x.grad, x_ref.grad.double()) < 2e-2
    for p, ref_p in zip(model.parameters(), ref_model.parameters()):
        assert p.grad.dtype == torch.bfloat16
        assert rel_err(p.grad, ref_p.grad.double()) < 2e-2, rel_err(p.grad, ref_p.grad.double())

    report = thunder_tk.explain(jm)
    (row,) = [r for r in report.rows if r.symbol == "ltorch.cross_entropy"]
    assert row.claimed_by_tk, str(report)
    assert row.ran_by == "tk: tk_cross_entropy_forward" and row.backward_ran_by == "tk: tk_cross_entropy_backward"
    assert ("tk_cross_entropy_forward" in str(thunder.last_traces(jm)[-1]))
    assert ("tk_cross_entropy_backward" in str(thunder.last_backward_traces(jm)[-1]))


# ------------------------------------------------------------------------------------------------
# Forward and unscaled gradient from one read (ops.cross_entropy_forward_grad)

# 5 x 100000: rows of 200000 bytes in 16 bits, one part of nearly the largest size at 200 KB parts.
FWD_GRAD_SHAPES = [(1, 8), (3, 1000), (257, 4104), (64, 32000), (33, 128256), (5, 100000), (5, 150000), (2, 1001)]


# Each row split over a cluster in parts of at most this many bytes (None: the kernel's default, 64 KB; 4096: up to 8
# parts even at a few thousand classes, parts past 4 KB where 8 are not enough; 200 KB, the largest part a block
# holds: the fewest parts, a whole row in one block up to 102400 bf16 classes).
PART_BYTES = [None, 4096, 200 * 1024]


@pytest.mark.parametrize("part_bytes", PART_BYTES, ids=lambda b: f"part{b}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,classes", FWD_GRAD_SHAPES, ids=[f"{r}x{c}" for r, c in FWD_GRAD_SHAPES])
def test_forward_grad_matches_fp64_reference(rows, classes, dtype, part_bytes):
    logits, target = make(rows, classes, dtype)
    target[0] = classes - 1
    if rows > 2:
        target[1], target[2] = 0, -100
    poison_allocator(((rows, classes), dtype))
    loss, lse, grad = ops.cross_entropy_forward_grad(logits, target, _part_bytes=part_bytes)
    ref_loss, ref_lse = reference(logits, target)
    assert torch.isfinite(lse).all() and torch.isfinite(grad).all(), "unwritten output"
    assert row_err(lse, ref_lse, ref_lse) < ROW_TOL and row_err(loss, ref_loss, ref_lse) < ROW_TOL
    ignored = target == -100
    assert (grad[ignored] == 0).all() and (loss[ignored] == 0).all()
    ref_grad = reference_grad(logits, target, torch.ones(rows, device=DEVICE))
    assert rel_err(grad, ref_grad) < GRAD_TOL[dtype], rel_err(grad, ref_grad)


def test_forward_grad_split_rows_edge_values():
    """Rows split over a cluster of 8: a target in every part and at both ends of parts, a row of -inf, a NaN, +-inf
    logits, a target outside [0, classes) and a custom ignore_index give what one block a row gives (the default
    parts at 9000 classes: one)."""
    rows, classes = 12, 9000  # 4096-byte parts: 8 parts of 141 vectors (1128 classes), the last 138
    logits, target = make(rows, classes, torch.bfloat16, seed=7)
    per_part = 1128
    target[:6] = torch.tensor([0, per_part - 1, per_part, 2 * per_part - 1, 2 * per_part, classes - 1])
    logits[6] = -float("inf")
    logits[7, 4321] = float("nan")
    logits[8, 17] = float("inf")
    logits[9, :100] = -float("inf")
    target[10] = classes + 5
    target[11] = 3  # the custom ignore_index below
    loss0, lse0, grad0 = ops.cross_entropy_forward_grad(logits, target, ignore_index=3)
    loss, lse, grad = ops.cross_entropy_forward_grad(logits, target, ignore_index=3, _part_bytes=4096)
    assert lse0[6] == -float("inf") and lse0[7].isnan() and loss0[10].isnan() and lse0[10].isfinite()
    for a, b in ((loss, loss0), (lse, lse0)):
        assert torch.equal(torch.isnan(a), torch.isnan(b)) and torch.equal(torch.isinf(a), torch.isinf(b)), (a, b)
        finite = torch.isfinite(b)
        assert torch.allclose(a[finite], b[finite], rtol=1e-5, atol=1e-5), (a, b)
    assert torch.equal(torch.isnan(grad), torch.isnan(grad0))
    finite = torch.isfinite(grad0)
    assert (grad[finite].float() - grad0[finite].float()).abs().max() <= 2 ** -8
    assert (grad[11] == 0).all() and loss[11] == 0
    ok = torch.tensor([r not in (6, 7, 8, 10, 11) for r in range(rows)], device=DEVICE)
    ref_loss, ref_lse = reference(logits[ok], target[ok])
    assert row_err(loss[ok], ref_loss, ref_lse) < ROW_TOL


@pytest.mark.parametrize("part_bytes", [None, 4096], ids=lambda b: f"part{b}")
@pytest.mark.parametrize("rows,classes", [(2000, 4104), (700, 128256)], ids=str)
def test_forward_grad_many_rows(rows, classes, part_bytes):
    """Many more clusters than fit at once (several blocks an SM, each pushing its pair into its peers), ignored rows
    among them; the same result twice, bit for bit (a moving result is a race)."""
    logits, target = make(rows, classes, torch.bfloat16, seed=11)
    target[::7] = -100
    poison_allocator(((rows, classes), torch.bfloat16))
    loss, lse, grad = ops.cross_entropy_forward_grad(logits, target, _part_bytes=part_bytes)
    ref_loss, ref_lse = reference(logits, target)
    assert row_err(lse, ref_lse, ref_lse) < ROW_TOL and row_err(loss, ref_loss, ref_lse) < ROW_TOL
    assert rel_err(grad, reference_grad(logits, target, torch.ones(rows, device=DEVICE))) < GRAD_TOL[torch.bfloat16]
    again = ops.cross_entropy_forward_grad(logits, target, _part_bytes=part_bytes)
    assert all(torch.equal(x, y) for x, y in zip((loss, lse, grad), again))


def test_forward_grad_rows_past_one_block():
    """Rows wider than one block holds (200 KB: 102400 bf16 classes) stay on chip split over a cluster, at the
    default parts and at parts asked past 200 KB (capped: 4 parts of 128 KB); rows past 8 parts of 200 KB do not.
    A part size of 0 bytes is an error at ops and at the binding."""
    classes = 262144
    logits, target = make(3, classes, torch.bfloat16, seed=9)
    assert ops.cross_entropy_forward_grad_unsupported(logits) is None
    widest = torch.empty(1, 819200 + 8, device=DEVICE, dtype=torch.bfloat16)
    assert ops.cross_entropy_forward_grad_unsupported(widest[:, :819200]) is None
    assert ops.cross_entropy_forward_grad_unsupported(widest) == "a row too long to keep on chip"
    ref_loss, ref_lse = reference(logits, target)
    ref_grad = reference_grad(logits, target, torch.ones(3, device=DEVICE))
    for part_bytes in (None, 1 << 20):
        loss, lse, grad = ops.cross_entropy_forward_grad(logits, target, _part_bytes=part_bytes)
        assert row_err(lse, ref_lse, ref_lse) < ROW_TOL and row_err(loss, ref_loss, ref_lse) < ROW_TOL
        assert rel_err(grad, ref_grad) < GRAD_TOL[torch.bfloat16], part_bytes
    with pytest.raises(ValueError, match="_part_bytes must be > 0"):
        ops.cross_entropy_forward_grad(logits, target, _part_bytes=0)
    with pytest.raises(ValueError, match=r"part_bytes \(.*\) must be > 0"):
        thunder_tk._extension.extension().cross_entropy_forward_grad(
            logits.data_ptr(), target.data_ptr(), loss.data_ptr(), lse.data_ptr(), grad.data_ptr(), classes,
            ops._DTYPE_CODES[torch.bfloat16], 3, classes, classes, -100, 0, 0)


def test_forward_grad_row_stride_and_fallbacks():
    wide, target = make(40, 4096 + 64, torch.bfloat16, seed=2)
    logits = wide[:, :4096]  # row stride 4160 elements: on-chip path
    assert ops.cross_entropy_forward_grad_unsupported(logits) is None
    loss, lse, grad = ops.cross_entropy_forward_grad(logits, target.clamp_max(4095))
    ref_grad = reference_grad(logits, target.clamp_max(4095), torch.ones(40, device=DEVICE))
    assert rel_err(grad, ref_grad) < GRAD_TOL[torch.bfloat16]
    odd = torch.randn(1 + 6 * 1000, device=DEVICE, dtype=torch.bfloat16)[1:].view(6, 1000)  # not 16-byte aligned
    assert ops.cross_entropy_forward_grad_unsupported(odd) is not None
    t = torch.randint(0, 1000, (6,), device=DEVICE)
    loss, lse, grad = ops.cross_entropy_forward_grad(odd, t)
    assert rel_err(grad, reference_grad(odd, t, torch.ones(6, device=DEVICE))) < GRAD_TOL[torch.bfloat16]


# 4096-byte parts: rows of several parts written in place (33 x 128256 and 257 x 4104)
@pytest.mark.parametrize("part_bytes", [None, 4096], ids=lambda b: f"part{b}")
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("rows,classes", [(1, 8), (33, 128256), (257, 4104), (2, 1001)], ids=str)
def test_forward_grad_written_over_the_logits(rows, classes, dtype, part_bytes):
    """overwrite=True: grad is the logits tensor itself, holding softmax - onehot; the padding between strided rows
    and everything past the last row stay as they were."""
    pad = 24
    store, target = make(rows + 1, classes + pad, dtype, seed=5)
    target = target[:rows].clamp_max(classes - 1)
    target[-1] = -100
    logits = store[:rows, :classes]  # row stride classes + 24 (16-byte multiple for every dtype)
    original, store_before = logits.clone(), store.clone()
    ref_loss, ref_lse = reference(original, target)
    ref_grad = reference_grad(original, target, torch.ones(rows, device=DEVICE))
    loss, lse, grad = ops.cross_entropy_forward_grad(logits, target, overwrite=True, _part_bytes=part_bytes)
    assert grad.data_ptr() == logits.data_ptr() and grad.stride() == logits.stride()
    assert row_err(loss, ref_loss, ref_lse) < ROW_TOL and row_err(lse, ref_lse, ref_lse) < ROW_TOL
    assert rel_err(grad, ref_grad) < GRAD_TOL[dtype], rel_err(grad, ref_grad)
    assert (grad[-1] == 0).all()
    assert torch.equal(store[:rows, classes:], store_before[:rows, classes:]), "padding between rows written"
    assert torch.equal(store[rows:], store_before[rows:]), "written past the last row"


def test_forward_grad_over_the_logits_fallback_and_overlap():
    odd = torch.randn(1 + 6 * 1000, device=DEVICE, dtype=torch.bfloat16)[1:].view(6, 1000)  # not 16-byte aligned
    t = torch.randint(0, 1000, (6,), device=DEVICE)
    ref_grad = reference_grad(odd.clone(), t, torch.ones(6, device=DEVICE))
    _, _, grad = ops.cross_entropy_forward_grad(odd, t, overwrite=True)
    assert grad.data_ptr() == odd.data_ptr() and rel_err(odd, ref_grad) < GRAD_TOL[torch.bfloat16]
    t_view = torch.randn(1000, 6, device=DEVICE, dtype=torch.bfloat16).t()  # classes not contiguous: copied over
    ref_grad = reference_grad(t_view.clone(), t, torch.ones(6, device=DEVICE))
    _, _, grad = ops.cross_entropy_forward_grad(t_view, t, overwrite=True)
    assert grad.data_ptr() == t_view.data_ptr() and rel_err(t_view, ref_grad) < GRAD_TOL[torch.bfloat16]
    overlapping = torch.randn(8 * 1024, device=DEVICE, dtype=torch.bfloat16).as_strided((8, 1024), (512, 1))
    with pytest.raises(ValueError, match="overlap"):
        ops.cross_entropy_forward_grad(overlapping, torch.zeros(8, dtype=torch.long, device=DEVICE), overwrite=True)


class WideLMHeadLoss(torch.nn.Module):
    """Norm, lm_head and LitGPT's loss (per-token, fp32 mean) over a vocabulary wide enough for the gradient to come
    from the forward (lowering.FORWARD_GRAD_MIN_CLASSES)."""

    def __init__(self, hidden=512, vocab=65600):
        super().__init__()
        self.norm = torch.nn.LayerNorm(hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, x, target):
        logits = self.lm_head(self.norm(x))
        per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1), reduction="none")
        return per_token.float().mean()


def test_thunder_wide_lm_head_takes_the_gradient_from_the_forward():
    from thunder_tk import lowering

    torch.manual_seed(0)
    model = WideLMHeadLoss().to(DEVICE, torch.bfloat16)
    ref_model = copy.deepcopy(model).double()
    x = torch.randn(4, 256, 512, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 65600, (4, 256), device=DEVICE)
    target[:, ::9] = -100
    jm = thunder.jit(model, executors=[tk])
    loss = jm(x, target)
    loss.backward()
    x_ref = x.detach().double().requires_grad_()
    ref_loss = ref_model(x_ref, target)
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-3
    assert rel_err(x.grad, x_ref.grad) < 2e-2
    for p, ref_p in zip(model.parameters(), ref_model.parameters()):
        assert rel_err(p.grad, ref_p.grad) < 2e-2, rel_err(p.grad, ref_p.grad)
    assert 65600 >= lowering.FORWARD_GRAD_MIN_CLASSES
    (row,) = [r for r in thunder_tk.explain(jm).rows if r.symbol == "ltorch.cross_entropy"]
    assert row.ran_by == "tk: tk_cross_entropy_forward_grad_over_logits", str(thunder_tk.explain(jm))
    bwd = thunder.last_backward_traces(jm)[-1]
    scaled = [b for b in bwd.bound_symbols if b.sym.name == "tk_scale_rows"]
    assert scaled and all(b.output.shape[-1] == 512 for b in scaled), "the row scaling must act on (rows, hidden)"



def _step_peak(model, x, target):
    """Peak bytes above the start of one step (compiling included). Cyclic garbage of earlier tests is collected
    first and the collector held off: tensors freed mid-step would lower the peak relative to the start."""
    jm = thunder.jit(model, executors=[tk])
    gc.collect()
    gc.disable()
    try:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        jm(x, target).backward()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start, jm
    finally:
        gc.enable()


def test_gradient_over_the_logits_takes_a_logits_buffer_off_the_peak(monkeypatch):
    from thunder_tk import pattern_fusion

    torch.manual_seed(1)
    model = WideLMHeadLoss(hidden=256, vocab=131072).to(DEVICE, torch.bfloat16)
    x = torch.randn(2, 1024, 256, device=DEVICE, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 131072, (2, 1024), device=DEVICE)
    logits_bytes = 2 * 1024 * 131072 * 2  # 512 MiB, next to a 64 MiB weight
    peak_over, jm = _step_peak(model, x, target)
    assert "tk_cross_entropy_forward_grad_over_logits" in str(thunder.last_traces(jm)[-1])
    grads_over = [p.grad.clone() for p in model.parameters()] + [x.grad.clone()]
    model.zero_grad(set_to_none=True)
    x.grad = None
    monkeypatch.setenv("THUNDER_TK_DISABLE", pattern_fusion.OVERWRITE_LOGITS)
    peak_apart, jm = _step_peak(model, x, target)
    assert "tk_cross_entropy_forward_grad_over_logits" not in str(thunder.last_traces(jm)[-1])
    grads_apart = [p.grad for p in model.parameters()] + [x.grad]
    for a, b in zip(grads_over, grads_apart):
        assert torch.equal(a, b)  # the same kernels on the same values
    # Written over, the step never holds two logits-sized tensors (H100: 606 MB, D and the weight's gradient); apart,
    # the forward holds the logits and D together (1075 MB).
    assert peak_over < 1.25 * logits_bytes, (peak_over, logits_bytes)
    assert peak_over <= peak_apart - 0.75 * logits_bytes, (peak_over, peak_apart)
