"""AdamW on tk's multi-tensor kernel (ops.adamw_step, thunder_tk.optim.AdamW) on an sm_90 GPU.

Every update is checked two ways from the same starting values: bit for bit against torch's fused AdamW (the kernel
follows its fp32 arithmetic operation for operation; where bits differ, the failure says in how many elements and by
how many ulps, so that a compiler's different fma contraction is told from a wrong result), and element by element
against the AdamW formula in float64, within one ulp of the dtype (the result is rounded to it once) plus a bound on
the fp32 arithmetic's error. Covered: bf16, fp16 and fp32; every size around the kernel's 16-byte vectors and its
chunks (fp32 chunks of 2048 elements, 16-bit ones of 4096), 65537 and 1000003 elements, and empty tensors, in one
list; more than the 256 tensors of a launch (257, 300 and 600: two and three launches); tensors off 16-byte
boundaries (the element-by-element path: param, grad or a moment alone, all four, fp32 8 bytes off); each tensor a
slice of a larger buffer whose guard regions must keep their bits (the in-place analogue of the NaN-poisoned
allocator); weight decay 0 and 0.1, maximize, several steps with different learning rates, a CUDA graph; repeated
runs give the same bits. The optimizer: a small bf16 MLP trained as by torch.optim.AdamW(fused=True) bit for bit with
every parameter on the kernel; parameters of three dtypes in one group; step counts that differ within a group; a
non-contiguous parameter, a float64 one and AMSGrad on torch's path with the reason, still as torch computes them; the
state_dict from ours into torch's fused AdamW and back, the steps continuing alike."""

import copy
import math

import pytest
import torch

from optim_twins import same_grads, torch_clip_factor as clip_factor, twins
from thunder_tk import ops
from thunder_tk.optim import AdamW as TkAdamW

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not hasattr(ops, "adamw_step"), reason="no ops.adamw_step")]
DEVICE = "cuda"

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
DTYPE_IDS = ["bf16", "fp16", "fp32"]
# A 16-byte vector is 8 16-bit or 4 fp32 elements; a block's chunk 256 threads x 2 vectors: 4096 16-bit or 2048
# fp32 elements. Each size below, at and above those, a few chunks and a tail, many chunks, and none.
NUMELS = [1, 7, 8, 9, 2047, 2048, 2049, 4095, 4096, 4097, 65537, 1_000_003, 0]
HYPER = dict(lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.1, maximize=False)
INTS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32,
        torch.float64: torch.int64}


def generator(seed):
    return torch.Generator(device=DEVICE).manual_seed(seed)


def entries(numels, dtype, seed, *, zero_state=False, grad_scale=1.0):
    """Lists P, G, M, V of flat tensors in `dtype`: parameters N(0, 1), gradients N(0, grad_scale^2), first moments
    N(0, 0.01) and second moments the squares of N(0, 0.01) (or zero moments: a first step)."""
    g = generator(seed)

    def randn(n, scale=1.0):
        return (torch.randn(n, device=DEVICE, generator=g) * scale).to(dtype)

    P = [randn(n) for n in numels]
    G = [randn(n, grad_scale) for n in numels]
    if zero_state:
        M = [torch.zeros(n, device=DEVICE, dtype=dtype) for n in numels]
        V = [torch.zeros(n, device=DEVICE, dtype=dtype) for n in numels]
    else:
        M = [randn(n, 0.1) for n in numels]
        V = [(torch.randn(n, device=DEVICE, generator=g) * 0.1).square().to(dtype) for n in numels]
    return P, G, M, V


# -- bits against torch's fused AdamW ----------------------------------------------------------------------------

def ordered(t: torch.Tensor) -> torch.Tensor:
    """t's bits as int64 in the order of the values they encode (sign and magnitude to two's complement), so that
    neighbouring floats are 1 apart; +0 and -0 are both 0."""
    bits = t.detach().contiguous().view(INTS[t.dtype]).to(torch.int64)
    return torch.where(bits < 0, torch.iinfo(INTS[t.dtype]).min - bits, bits)


def differing_bits(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor:
    """Where the bits of two tensors of one dtype and shape differ (flat)."""
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    ints = INTS[got.dtype]
    return got.detach().contiguous().view(ints).flatten() != want.detach().contiguous().view(ints).flatten()


def ulp_summary(label: str, got: torch.Tensor, want: torch.Tensor) -> str | None:
    """None where got and want have the same bits; otherwise how many elements differ, by how many ulps of their
    dtype at most and at the median, and the first one's values."""
    differ = differing_bits(got, want)
    count = int(differ.sum())
    if count == 0:
        return None
    ulps = (ordered(got).flatten() - ordered(want).flatten()).abs()[differ]
    first = int(differ.nonzero()[0])
    return (f"{label}: {count} of {got.numel()} elements ({count / got.numel():.2e}) differ, by up to "
            f"{int(ulps.max())} ulp (median {int(ulps.median())}); first at {first}: "
            f"{got.flatten()[first].item()!r}, torch {want.flatten()[first].item()!r}")


def assert_same_bits(pairs, what="torch's fused AdamW") -> None:
    """Each (label, got, want) bit for bit. A failure lists every pair that differs with its ulp summary, and the
    totals, so that a handful of 1-ulp differences (fma contraction) reads differently from a wrong update."""
    report = [s for s in (ulp_summary(*pair) for pair in pairs) if s is not None]
    if report:
        total = sum(int(differing_bits(got, want).sum()) for _, got, want in pairs)
        size = sum(got.numel() for _, got, _ in pairs)
        shown = report[:20] + ([f"... and {len(report) - 20} more tensors"] if len(report) > 20 else [])
        raise AssertionError(f"not bit for bit with {what}: {total} of {size} elements differ, in "
                             f"{len(report)} tensors:\n" + "\n".join(shown))


def torch_fused(P, G, M, V, *, step, lr, beta1, beta2, eps, weight_decay, maximize):
    """torch's fused AdamW update in place: the launch torch.optim.AdamW(fused=True).step makes once it has counted
    the step (each tensor's step count is a float32 tensor on the device)."""
    steps = [torch.tensor(float(step), device=DEVICE) for _ in P]
    torch._fused_adamw_(P, G, M, V, [], steps, lr=lr, beta1=beta1, beta2=beta2, weight_decay=weight_decay, eps=eps,
                        amsgrad=False, maximize=maximize)


# -- the float64 reference -----------------------------------------------------------------------------------------

U = 2.0 ** -24  # fp32's unit roundoff: each fp32 operation's relative error, rounding to nearest
POWF_ULPS = 8  # powf's error bound near 1, in ulps there (CUDA's math library documents 4; twice that, to be safe)


def as_fp32(x: float) -> float:
    return float(torch.tensor(x, dtype=torch.float32))


def reference(p, g, m, v, *, step, lr, beta1, beta2, eps, weight_decay, maximize):
    """One AdamW step in float64 (p * (1 - lr wd); m = b1 m + (1 - b1) g; v = b2 v + (1 - b2) g^2;
    p -= lr / bc1 * m / (sqrt(v) / sqrt(bc2) + eps), bc = 1 - b^step) from flat values, with the hyperparameters as
    the kernel is given them (rounded to fp32 once, as torch's fused kernel takes them), and for each result a bound on
    the error of the kernel's fp32 arithmetic: {name: (value, bound)}.

    The bounds, U the unit roundoff, each fp32 operation off by at most U of its result:
    - m: (1 - b1) g is one fma, rounded once (U of it), and the sum another (U of m): 2 U of the two terms' magnitudes
      (not of m, which can cancel to near 0).
    - v: two terms, both >= 0 (no cancellation), g * g rounded (exact for 16-bit g) and two fmas: 3 U of v.
    - bias corrections: powf(b, step) is within POWF_ULPS ulps (U each, just below 1) and 1 - x is exact there
      (Sterbenz), so bc is off by POWF_ULPS U / bc of itself: large when bc is small (b2 = 0.999 at step 1: 0.001).
      It scales the update by 1 / bc1 and sqrt(bc2): relative POWF_ULPS U (1 / bc1 + 1 / (2 bc2)).
    - the update u = (lr / bc1) m / (sqrt(v) / sqrt(bc2) + eps): the divisions, the square roots, the sum with eps
      and the products, some 8 roundings, plus v's error halved by the square root, plus m's error over the
      denominator.
    - the parameter: p - (lr wd) p is three roundings of |p| at most, then p1 - u one of the result."""
    lr, beta1, beta2, eps, weight_decay = (as_fp32(x) for x in (lr, beta1, beta2, eps, weight_decay))
    p, g, m, v = (t.double() for t in (p, g, m, v))
    if maximize:
        g = -g
    p1 = p * (1 - lr * weight_decay)
    m_terms = (beta1 * m).abs() + ((1 - beta1) * g).abs()
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    bc1, bc2 = 1 - beta1 ** step, 1 - beta2 ** step
    denom = v.sqrt() / math.sqrt(bc2) + eps
    u = lr / bc1 * m / denom
    p_new = p1 - u
    m_err = 2 * U * m_terms
    bc_rel = POWF_ULPS * U * (1 / bc1 + 1 / (2 * bc2))
    u_err = u.abs() * (10 * U + bc_rel) + (lr / bc1) * m_err / denom
    p_err = 3 * U * p.abs() + u_err + U * p_new.abs()
    return {"param": (p_new, p_err), "exp_avg": (m, m_err), "exp_avg_sq": (v, 3 * U * v)}


def flat(tensors, dtype):
    """The tensors' values end to end (an empty list: no elements)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors]) if tensors else torch.empty(0, device=DEVICE,
                                                                                          dtype=dtype)


def assert_near_float64(label, before, after, *, step, **hyper) -> None:
    """The kernel's results (`after`: P, M, V) within one ulp of their dtype of the float64 formula's from the values
    `before` (P, G, M, V), plus the bound on the fp32 arithmetic's error (`reference`); subnormals within one ulp of
    the smallest normal. Tensors of one dtype, checked end to end."""
    dtype = before[0][0].dtype
    ref = reference(*(flat(x, dtype) for x in before), step=step, **hyper)
    fi = torch.finfo(dtype)
    problems = []
    for name, got_list in zip(("param", "exp_avg", "exp_avg_sq"), after):
        got = flat(got_list, dtype).double()
        want, bound = ref[name]
        # One ulp of the dtype at the (bounded) fp32 result, at most eps |x| for a normal x, or the subnormals' spacing.
        tol = bound + fi.eps * (want.abs() + bound) + fi.smallest_normal * fi.eps
        off = (got - want).abs()
        bad = ~(off <= tol)  # a NaN is bad
        if bad.any():
            first = int(bad.nonzero()[0])
            problems.append(f"{label} {name} ({dtype}): {int(bad.sum())} of {got.numel()} elements off the float64 "
                            f"formula by more than the bound, up to {float((off / tol).max()):.3g}x it; first at "
                            f"{first} (end to end): {got[first].item()!r}, float64 {want[first].item()!r}")
    assert not problems, "\n".join(problems)


def adamw_and_check(P, G, M, V, *, step, label="", **hyper):
    """ops.adamw_step over the lists, in place, checked: bit for bit against torch's fused AdamW from clones of the
    same values, within the bounds of the float64 formula from those values, and the gradients untouched."""
    hyper = {**HYPER, **hyper}
    before = [[t.clone() for t in X] for X in (P, G, M, V)]
    want_P, want_M, want_V = ([t.clone() for t in X] for X in (P, M, V))
    torch_fused(want_P, [g.clone() for g in G], want_M, want_V, step=step, **hyper)
    ops.adamw_step(P, G, M, V, step=step, **hyper)
    torch.cuda.synchronize()
    assert_same_bits([(f"{label} grad {i}", g, b) for i, (g, b) in enumerate(zip(G, before[1]))],
                     what="the gradients as they were (the kernel must not write them)")
    pairs = []
    for name, got, want in (("param", P, want_P), ("exp_avg", M, want_M), ("exp_avg_sq", V, want_V)):
        pairs += [(f"{label} {name} {i} ({t.numel()} elements)", t, w) for i, (t, w) in enumerate(zip(got, want))]
    assert_same_bits(pairs)
    assert_near_float64(label, before, (P, M, V), step=step, **hyper)


# -- ops.adamw_step ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("maximize", [False, True], ids=["min", "maximize"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1], ids=["wd0", "wd0.1"])
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_every_size_in_one_list(dtype, weight_decay, maximize):
    """Every size of NUMELS, empty tensors among them, in one call: the fifth step from random moments."""
    P, G, M, V = entries(NUMELS, dtype, seed=1 + 2 * int(maximize) + int(weight_decay > 0))
    adamw_and_check(P, G, M, V, step=5, weight_decay=weight_decay, maximize=maximize)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_consecutive_steps_with_different_learning_rates(dtype):
    """Five steps from zero moments (the bias corrections' smallest values), each with its own learning rate and
    new gradients, betas (0.9, 0.95) and a larger eps; each step checked from the values before it, and the five
    steps bit for bit as five of torch's fused steps run on their own copies."""
    numels = [1, 9, 2049, 4097, 65537, 0]
    P, _, M, V = entries(numels, dtype, seed=20, zero_state=True)
    chain = [[t.clone() for t in X] for X in (P, M, V)]
    hyper = dict(beta1=0.9, beta2=0.95, eps=1e-6, weight_decay=0.1)
    g = generator(21)
    for step, lr in enumerate([1e-2, 3e-2, 1e-3, 5e-3, 2e-2], start=1):
        G = [torch.randn(n, device=DEVICE, generator=g).to(dtype) for n in numels]
        adamw_and_check(P, G, M, V, step=step, lr=lr, label=f"step {step}", **hyper)
        torch_fused(chain[0], G, chain[1], chain[2], step=step, lr=lr, maximize=False, **hyper)
    assert_same_bits([(f"{name} {i}", a, b) for name, X, Y in zip(("param", "exp_avg", "exp_avg_sq"), (P, M, V), chain)
                      for i, (a, b) in enumerate(zip(X, Y))], what="five steps of torch's fused AdamW")


@pytest.mark.parametrize("count,dtype", [(257, torch.bfloat16), (300, torch.bfloat16), (300, torch.float16),
                                         (600, torch.float32), (600, torch.bfloat16)],
                         ids=["257-bf16", "300-bf16", "300-fp16", "600-fp32", "600-bf16"])
def test_more_tensors_than_a_launch_takes(count, dtype):
    """257 to 600 tensors in one call (256 a launch: two or three launches), of random sizes up to 5000 elements,
    some empty and some of 70000 (many chunks), so that every launch has tensors of one chunk and of several."""
    sizes = torch.Generator().manual_seed(count)
    numels = torch.randint(1, 5000, (count,), generator=sizes).tolist()
    for i in range(0, count, 97):
        numels[i] = 70000
    for i in range(5, count, 61):
        numels[i] = 0
    numels[255], numels[256] = 4097, 1  # the last of the first launch, the first of the second
    P, G, M, V = entries(numels, dtype, seed=count)
    adamw_and_check(P, G, M, V, step=3, label=f"{count} tensors")


def placed(t: torch.Tensor, offset: int, back: int = 0, guard=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): t's values in a view `offset` elements into a flat buffer with `back` elements behind it; the
    buffer's other elements random bits (or `guard`'s, a generator's) that nothing may write."""
    n = t.numel()
    ints = INTS[t.dtype]
    info = torch.iinfo(ints)
    buffer = torch.randint(info.min, info.max, (offset + n + back,), device=DEVICE, dtype=ints,
                           generator=guard).view(t.dtype)
    view = buffer[offset:offset + n].view(t.shape)
    view.copy_(t)
    return buffer, view


# Which of param, grad, exp_avg, exp_avg_sq sit how many elements past a 16-byte boundary.
OFFSETS = {"param": (1, 0, 0, 0), "grad": (0, 1, 0, 0), "exp_avg": (0, 0, 1, 0), "exp_avg_sq": (0, 0, 0, 1),
           "all": (1, 1, 1, 1), "all, 3 apart": (3, 1, 2, 5), "aligned": (0, 0, 0, 0)}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_tensors_off_16_bytes(dtype):
    """Entries with one or all four tensors off a 16-byte boundary (the element-by-element path) among aligned ones
    in one call: each right (torch's bits, float64), and the same bits as the same values aligned (the two paths
    compute alike). fp32 also 8 bytes off (2 elements: aligned for 8-byte loads, not 16)."""
    numels = [1, 9, 2049, 4097, 65537]
    offsets = dict(OFFSETS)
    if dtype == torch.float32:
        offsets["8 bytes"] = (2, 2, 2, 2)
    P, G, M, V = entries(numels, dtype, seed=30)
    aligned = [[t.clone() for t in X] for X in (P, G, M, V)]
    ops.adamw_step(*aligned, step=4, **HYPER)
    lists, labels, keep = ([], [], [], []), [], []
    for name, offs in offsets.items():
        for i in range(len(numels)):
            for k, (X, off) in enumerate(zip((P, G, M, V), offs)):
                buffer, view = placed(X[i], off)
                keep.append(buffer)
                assert (view.data_ptr() % 16 != 0) == (off != 0), (name, off, view.data_ptr() % 16)
                lists[k].append(view)
            labels.append(name)
    adamw_and_check(*lists, step=4, label="off 16 bytes")
    pairs = []
    for j, label in enumerate(labels):
        i = j % len(numels)
        for k, kind in ((0, "param"), (2, "exp_avg"), (3, "exp_avg_sq")):
            pairs.append((f"{label}: {kind} of {numels[i]} elements", lists[k][j], aligned[k][i]))
    assert_same_bits(pairs, what="the same values 16-byte aligned")


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nothing_written_outside_the_tensors(dtype):
    """Each of the four tensors of every entry a slice in the middle of its own buffer, the rest of which holds
    random bits (NaNs and infinities among them): after the step every guard element keeps its bits, the gradients
    all of theirs, and the slices are right. Slices 16-byte aligned (64 elements in) and not (1 and 3 in), with guards
    behind of 1 to 130 elements; empty slices too."""
    numels = [1, 7, 8, 9, 4095, 4097, 0, 65537]
    guard = generator(40)
    for front, back in [(64, 64), (1, 1), (3, 130), (8, 5)]:
        P, G, M, V = entries(numels, dtype, seed=41 + front)
        buffers, views = [], ([], [], [], [])
        for X, out in zip((P, G, M, V), views):
            for t in X:
                buffer, view = placed(t, front, back, guard)
                buffers.append(buffer)
                out.append(view)
        saved = [b.clone() for b in buffers]
        adamw_and_check(*views, step=2, label=f"{front} in, {back} behind")
        guards = [(f"{front} in, {back} behind: buffer {i}'s guards", torch.cat([b[:front], b[front + n:]]),
                   torch.cat([s[:front], s[front + n:]]))
                  for i, (b, s, n) in enumerate(zip(buffers, saved, numels * 4))]
        assert_same_bits(guards, what="the guard regions as they were (written outside the tensors)")


def test_repeatable_bit_for_bit():
    """The same call three more times from the same values: the same bits (each element's update is its own)."""
    for dtype, numels in ((torch.bfloat16, [7, 4097, 65537, 0, 2049] * 60), (torch.float32, NUMELS)):
        P, G, M, V = entries(numels, dtype, seed=50)
        first = None
        for _ in range(4):
            # the first three parameters off 16 bytes (element by element), the rest aligned, in one call
            run = [[placed(t, 1)[1] if i < 3 else t.clone() for i, t in enumerate(P)], G,
                   [t.clone() for t in M], [t.clone() for t in V]]
            ops.adamw_step(*run, step=7, **HYPER)
            out = [run[0], run[2], run[3]]
            if first is None:
                first = out
                continue
            assert_same_bits([(f"{dtype} list {k} entry {i}", a, b) for k, (X, Y) in enumerate(zip(out, first))
                              for i, (a, b) in enumerate(zip(X, Y))], what="the first run")


def test_captured_in_a_cuda_graph():
    """The launches (two: 300 tensors) captured in a CUDA graph and replayed: each replay one step, as the same call
    made eagerly (the step count and hyperparameters are the launch's arguments, the tensors read where they are)."""
    numels = [9, 4097, 65537] + [100] * 297
    P, G, M, V = entries(numels, torch.bfloat16, seed=60)
    eager = [[t.clone() for t in X] for X in (P, M, V)]
    ops.adamw_step(P, G, M, V, step=2, **HYPER)  # warm-up outside the capture (occupancy, the first launch)
    ops.adamw_step(eager[0], G, eager[1], eager[2], step=2, **HYPER)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # on torch's capture stream, the current one inside
        ops.adamw_step(P, G, M, V, step=3, **HYPER)
    for _ in range(2):
        graph.replay()
        ops.adamw_step(eager[0], G, eager[1], eager[2], step=3, **HYPER)
        torch.cuda.synchronize()
        assert_same_bits([(f"list {k} entry {i}", a, b) for k, (X, Y) in enumerate(zip((P, M, V), eager))
                          for i, (a, b) in enumerate(zip(X, Y))], what="the eager launches")


def test_errors_name_the_problem():
    x = torch.randn(4, 6, device=DEVICE)
    with pytest.raises(ValueError, match=r"entry 0: param is not contiguous \(strides \(1, 6\)\)"):
        ops.adamw_step([x.t()], [x.t().contiguous()], [x.t().contiguous()], [x.t().contiguous()], step=1, **HYPER)
    y = x[:, :3]  # (4, 3) with row stride 6
    with pytest.raises(ValueError, match=r"entry 1: exp_avg is not contiguous \(strides \(6, 1\)\)"):
        ops.adamw_step([x, y.contiguous()], [x, y.contiguous()], [x, y], [x, y.contiguous()], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"entry 1 is torch.bfloat16 on cuda:\d, entry 0 torch.float32 on cuda:\d"):
        h = x.bfloat16()
        ops.adamw_step([x, h], [x, h], [x, h], [x, h], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"entry 0: grad is on cpu, the parameter on cuda:\d"):
        ops.adamw_step([x], [x.cpu()], [x], [x], step=1, **HYPER)
    with pytest.raises(ValueError, match=r"step must be at least 1"):
        ops.adamw_step([x], [x], [x], [x], step=0, **HYPER)
    with pytest.raises(ValueError, match=r"entry 0: dtype torch.float64 not in"):
        d = x.double()
        ops.adamw_step([d], [d], [d], [d], step=1, **HYPER)
    # Nothing to update: no launch, no error.
    e = torch.empty(0, device=DEVICE, dtype=torch.bfloat16)
    ops.adamw_step([e, e.clone()], [e, e], [e, e], [e, e], step=1, **HYPER)
    ops.adamw_step([], [], [], [], step=1, **HYPER)


# -- thunder_tk.optim.AdamW ----------------------------------------------------------------------------------------

def mlp(dtype, seed):
    """A two-layer MLP with a LayerNorm, on the GPU in `dtype`."""
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 48),
                               torch.nn.LayerNorm(48)).to(DEVICE, dtype)


def decay_groups(model, weight_decay=0.1):
    """LitGPT's grouping: the matrices with weight decay, the vectors (biases, norm) without."""
    params = list(model.parameters())
    return [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]


def backward(model, seed):
    """A batch's gradients on `model`'s parameters (set, not accumulated)."""
    g = generator(seed)
    x = torch.randn(32, 64, device=DEVICE, generator=g).to(next(model.parameters()).dtype)
    target = torch.randn(32, 48, device=DEVICE, generator=g)
    model.zero_grad(set_to_none=True)
    torch.nn.functional.mse_loss(model(x).float(), target).backward()


def copy_grads(src, dst):
    """dst's parameters get src's gradients (the same bits whatever the GEMMs' order of sums would give)."""
    for p, q in zip(src.parameters(), dst.parameters()):
        q.grad = None if p.grad is None else p.grad.clone()


def assert_same_training(ours, theirs, ours_params, their_params, label, what="torch.optim.AdamW(fused=True)"):
    """Parameters and both moments bit for bit, the step counts equal (ours on the CPU, fused torch's on the GPU)."""
    pairs = []
    for i, (p, q) in enumerate(zip(ours_params, their_params)):
        pairs.append((f"{label} param {i} {tuple(p.shape)}", p, q))
        sp, sq = ours.state.get(p, {}), theirs.state.get(q, {})
        assert sorted(sp) == sorted(sq), (label, i, sorted(sp), sorted(sq))
        for key in sp:
            if key == "step":
                assert float(sp[key]) == float(sq[key]), (label, i, float(sp[key]), float(sq[key]))
                assert sp[key].device.type == "cpu" and sp[key].dtype == torch.float32, (label, i, sp[key])
            else:
                pairs.append((f"{label} param {i} {key}", sp[key], sq[key]))
    assert_same_bits(pairs, what=what)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_mlp_trains_as_torch_fused(dtype):
    """Five steps of a two-layer MLP, matrices with weight decay and vectors without, the learning rate changed
    after step 3: bit for bit as torch.optim.AdamW(fused=True) given the same gradients, every parameter on the
    kernel."""
    model = mlp(dtype, 0)
    twin = copy.deepcopy(model)
    ours = TkAdamW(decay_groups(model), lr=3e-3, betas=(0.9, 0.95))
    theirs = torch.optim.AdamW(decay_groups(twin), lr=3e-3, betas=(0.9, 0.95), fused=True)
    n = len(list(model.parameters()))
    for step in range(1, 6):
        if step == 4:
            for opt in (ours, theirs):
                for group in opt.param_groups:
                    group["lr"] = 1e-3
        backward(model, step)
        copy_grads(model, twin)
        ours.step()
        theirs.step()
        assert ours.routes == {"tk": n, "torch": 0, "declined": []}, ours.routes
        assert_same_training(ours, theirs, list(model.parameters()), list(twin.parameters()), f"step {step}")


def test_kept_plan_follows_replaced_storage_and_state():
    """After a step that took every parameter to the kernel, the group's plan is reused while nothing it keeps has
    changed, and dropped where something has: a parameter's storage replaced (`.data =`, the old storage freed), a
    moment buffer replaced in the state, a fresh gradient of another layout. Each step bit for bit as torch's fused
    AdamW, and the old storage untouched."""
    specs = [((300, 70), torch.bfloat16), ((4097,), torch.bfloat16), ((9,), torch.bfloat16)]
    ours_params = params_like(specs, 90)
    their_params = twins(ours_params)
    ours = TkAdamW(ours_params, lr=2e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(their_params, lr=2e-2, weight_decay=0.1, fused=True)
    g = generator(91)
    pairs = list(zip(ours_params, their_params))

    def step(label, planned_after=True):
        ours.step()
        theirs.step()
        assert ours.routes["tk"] + ours.routes["torch"] == len(specs)
        assert_same_training(ours, theirs, ours_params, their_params, label)
        assert (0 in ours._plans) == planned_after, (label, ours._plans.keys())

    for i in range(3):
        give_grads(pairs, g)
        step(f"step {i + 1}")
    old = ours_params[0].data
    kept = old.clone()
    ours_params[0].data = old.clone()
    give_grads(pairs, g)
    step("after .data replaced")
    assert torch.equal(old, kept)  # the old storage (still held here) was not written
    del old
    give_grads(pairs, g)
    step("after .data replaced, planned again")
    state = ours.state[ours_params[1]]
    state["exp_avg_sq"] = state["exp_avg_sq"].clone()
    give_grads(pairs, g)
    step("after a moment buffer replaced")
    give_grads(pairs, g)
    step("planned again")
    give_grads(pairs, g)  # last: torch's default path (not fused) takes the strided one
    ours_params[2].grad = torch.empty(18, device=DEVICE, dtype=torch.bfloat16)[::2].copy_(their_params[2].grad)
    ours.step()
    theirs.step()
    assert ours.routes["tk"] == 2 and "not contiguous" in ours.routes["declined"][0][3], ours.routes
    assert 0 not in ours._plans
    assert_same_training(ours, theirs, ours_params[:2], their_params[:2], "with a strided gradient declined")


def params_like(specs, seed):
    """nn.Parameters on the GPU: (shape, dtype) each, N(0, 1)."""
    g = generator(seed)
    return [torch.nn.Parameter(torch.randn(shape, device=DEVICE, generator=g).to(dtype)) for shape, dtype in specs]


def give_grads(pairs, g, skip=()):
    """The same random gradient, in each parameter's layout, on both parameters of each pair but those in `skip`."""
    same_grads(pairs, lambda a: torch.empty_like(a).copy_(torch.randn(a.shape, device=DEVICE, generator=g)), skip)


def test_three_dtypes_in_one_group():
    """bf16, fp16 and fp32 parameters in one group: one launch per dtype, as torch's fused AdamW, bit for bit."""
    specs = [((300, 70), torch.bfloat16), ((4097,), torch.float16), ((65, 33), torch.float32), ((9,), torch.bfloat16),
             ((2049,), torch.float32)]
    ours_params = params_like(specs, 70)
    their_params = twins(ours_params)
    ours = TkAdamW(ours_params, lr=1e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(their_params, lr=1e-2, weight_decay=0.1, fused=True)
    g = generator(71)
    for step in range(1, 4):
        give_grads(list(zip(ours_params, their_params)), g)
        ours.step()
        theirs.step()
        assert ours.routes["tk"] == len(specs) and not ours.routes["declined"]
        assert_same_training(ours, theirs, ours_params, their_params, f"step {step}")


def test_step_counts_that_differ_within_a_group():
    """A parameter without a gradient at step 1 (its count lags from then on) and another without one at step 3:
    the group's parameters launched by step count, each with its own bias corrections, as torch's fused AdamW
    (which reads each tensor's count)."""
    specs = [((4097,), torch.bfloat16), ((128, 9), torch.bfloat16), ((33,), torch.bfloat16), ((2048,), torch.bfloat16)]
    ours_params = params_like(specs, 80)
    their_params = twins(ours_params)
    ours = TkAdamW(ours_params, lr=2e-2, weight_decay=0.1)
    theirs = torch.optim.AdamW(their_params, lr=2e-2, weight_decay=0.1, fused=True)
    g = generator(81)
    for step, skip in ((1, {1}), (2, set()), (3, {2}), (4, set()), (5, set())):
        give_grads(list(zip(ours_params, their_params)), g, skip)
        ours.step()
        theirs.step()
        assert ours.routes["tk"] == len(specs) - len(skip) and not ours.routes["declined"]
        assert_same_training(ours, theirs, ours_params, their_params, f"step {step}")
    assert [float(ours.state[p]["step"]) for p in ours_params] == [5.0, 4.0, 4.0, 5.0]


class with_declined:
    """Parameters of which two go to torch's path: a bf16 matrix and a vector of `vector_dtype` on the kernel, a
    transposed (non-contiguous) bf16 parameter and a float64 one between them; ours on tk's AdamW, their twins on
    torch's fused AdamW (the kernel's) and default AdamW (the others), lr 1e-2, weight decay 0.1."""

    def __init__(self, seed: int, vector_dtype: torch.dtype):
        self.g = g = generator(seed)
        self.transposed = torch.nn.Parameter(torch.randn(48, 32, device=DEVICE, generator=g).to(torch.bfloat16).t())
        assert not self.transposed.is_contiguous()
        self.fast = params_like([((32, 48), torch.bfloat16), ((100,), vector_dtype)], seed + 1)
        self.wide = torch.nn.Parameter(torch.randn(7, device=DEVICE, generator=g, dtype=torch.float64))
        self.ours_params = [self.fast[0], self.transposed, self.wide, self.fast[1]]
        self.their_fast = twins(self.fast)
        self.their_slow = [torch.nn.Parameter(self.transposed.detach().clone()), twins([self.wide])[0]]
        assert self.their_slow[0].stride() == self.transposed.stride()
        self.ours = TkAdamW(self.ours_params, lr=1e-2, weight_decay=0.1)
        self.fused = torch.optim.AdamW(self.their_fast, lr=1e-2, weight_decay=0.1, fused=True)
        self.plain = torch.optim.AdamW(self.their_slow, lr=1e-2, weight_decay=0.1)

    def give_grads(self) -> None:
        """The same new gradients on ours and their twins."""
        give_grads([(self.fast[0], self.their_fast[0]), (self.transposed, self.their_slow[0]),
                    (self.wide, self.their_slow[1]), (self.fast[1], self.their_fast[1])], self.g)


def test_declined_parameters_take_torch_s_path():
    """A transposed parameter (non-contiguous, its gradient and moments alike) and a float64 one go to torch's own
    AdamW with their reasons, updated as torch.optim.AdamW (its default, foreach path) updates them; the others stay
    on the kernel, as torch's fused AdamW."""
    case = with_declined(90, torch.bfloat16)
    fast, transposed, wide, their_fast, their_slow, ours, fused, plain = (
        case.fast, case.transposed, case.wide, case.their_fast, case.their_slow, case.ours, case.fused, case.plain)
    for step in range(1, 4):
        case.give_grads()
        ours.step()
        fused.step()
        plain.step()
        assert ours.routes["tk"] == 2 and ours.routes["torch"] == 2
        declined = ours.routes["declined"]
        assert [d[:3] for d in declined] == [(0, 1, (32, 48)), (0, 2, (7,))], declined
        assert "not contiguous" in declined[0][3] and "float64" in declined[1][3], declined
        assert_same_training(ours, fused, fast, their_fast, f"step {step}, kernel")
        assert_same_training(ours, plain, [transposed, wide], their_slow, f"step {step}, declined",
                             what="torch.optim.AdamW (default)")
    assert ours.state[transposed]["exp_avg"].stride() == transposed.stride()


def test_amsgrad_goes_to_torch():
    specs = [((64, 33), torch.bfloat16), ((4097,), torch.float32)]
    ours_params = params_like(specs, 100)
    their_params = twins(ours_params)
    ours = TkAdamW(ours_params, lr=1e-2, amsgrad=True)
    theirs = torch.optim.AdamW(their_params, lr=1e-2, amsgrad=True)
    g = generator(101)
    for step in range(1, 4):
        give_grads(list(zip(ours_params, their_params)), g)
        ours.step()
        theirs.step()
        assert ours.routes["tk"] == 0 and ours.routes["torch"] == 2
        assert [(d[:3], d[3]) for d in ours.routes["declined"]] == [
            ((0, 0, (64, 33)), "amsgrad is not supported by the kernel"),
            ((0, 1, (4097,)), "amsgrad is not supported by the kernel")]
        assert_same_training(ours, theirs, ours_params, their_params, f"step {step}",
                             what="torch.optim.AdamW(amsgrad=True)")


def test_state_dict_between_ours_and_torch_fused():
    """Ours -> torch's fused AdamW and torch's fused -> ours after three steps, then three more steps each, bit for
    bit with the optimizer the state came from. torch's load_state_dict takes every group setting from the
    checkpoint, `fused` too: a checkpoint of ours (fused None) would turn a fused torch AdamW into its foreach path,
    so the groups are marked fused first, as a torch user moving to fused would. Ours, loading torch's fused state,
    takes its step counts off the GPU to the CPU and drops the fused flag."""
    specs = [((256, 64), torch.bfloat16), ((256,), torch.bfloat16), ((4097,), torch.float32)]
    for direction in ("ours -> torch fused", "torch fused -> ours"):
        start = params_like(specs, 110)
        src_params, dst_params = twins(start), twins(start)
        make_src = TkAdamW if direction.startswith("ours") else \
            (lambda *a, **k: torch.optim.AdamW(*a, fused=True, **k))
        src = make_src([{"params": src_params[:2], "weight_decay": 0.1}, {"params": src_params[2:]}], lr=1e-2)
        g = generator(111)
        for _ in range(3):
            give_grads(list(zip(src_params, dst_params)), g)
            src.step()
        for p, q in zip(dst_params, src_params):
            p.data.copy_(q.data)
        state = copy.deepcopy(src.state_dict())
        if direction.startswith("ours"):
            for group in state["param_groups"]:
                group["fused"] = True
            dst = torch.optim.AdamW([{"params": dst_params[:2]}, {"params": dst_params[2:]}], fused=True)
            dst.load_state_dict(state)
            assert all(dst.state[p]["step"].device.type == "cuda" for p in dst_params)
            assert all(group["fused"] for group in dst.param_groups)
        else:
            assert all(s["step"].device.type == "cuda" for s in state["state"].values())
            dst = TkAdamW([{"params": dst_params[:2]}, {"params": dst_params[2:]}])
            dst.load_state_dict(state)
            assert all(group["fused"] is None and group["capturable"] is False for group in dst.param_groups)
            assert all(dst.state[p]["step"].device.type == "cpu" and dst.state[p]["step"].dtype == torch.float32
                       for p in dst_params)
        assert dst.param_groups[0]["weight_decay"] == 0.1 and dst.param_groups[1]["lr"] == 1e-2
        for step in range(4, 7):
            give_grads(list(zip(src_params, dst_params)), g)
            src.step()
            dst.step()
            ours, theirs = (src, dst) if direction.startswith("ours") else (dst, src)
            ours_params, their_params = (src_params, dst_params) if ours is src else (dst_params, src_params)
            assert ours.routes["tk"] == len(specs) and not ours.routes["declined"], ours.routes
            assert_same_training(ours, theirs, ours_params, their_params, f"{direction}, step {step}")


# -- clipping by the global norm: ops.sq_norm, adamw_step's clip, AdamW.clip_grad_norm_ ----------------------------
# sq_norm's chunk: 256 threads x 4 16-byte vectors, 8192 16-bit or 4096 fp32 elements.
SQ_NUMELS = NUMELS + [4096, 4097, 8191, 8192, 8193, 3 * 8192 + 5]


def sq_norm_float64(tensors) -> float:
    """The sum of squares in float64: exact for 16-bit inputs up to the sum's own rounding."""
    return sum(float(t.detach().double().square().sum()) for t in tensors)


def assert_sq_norm_near(got: torch.Tensor, tensors, label="") -> None:
    """Within 1e-5 of the float64 sum, relatively: each thread adds at most a few hundred squares here, each
    fp32 addition off by at most 2^-24 of the running sum, and the partials add up in a few levels."""
    want = sq_norm_float64(tensors)
    assert got.dtype == torch.float32 and got.shape == () and got.device.type == "cuda", (got.dtype, got.shape)
    assert abs(got.item() - want) <= 1e-5 * want, f"{label}: {got.item()!r}, float64 {want!r}"


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_sq_norm_every_size(dtype):
    """Every size of SQ_NUMELS (around a 16-byte vector, an AdamW chunk and a sq_norm chunk, many chunks, empty) in
    one call, six more off 16 bytes (element by element): the float64 sum, into an `out` poisoned with NaN; then
    added to what `out` holds (accumulate); the same bits on three more calls."""
    _, G, _, _ = entries(SQ_NUMELS, dtype, seed=200, grad_scale=3.0)
    tensors = G + [placed(g, off)[1] for g, off in zip(G[:6], (1, 3, 1, 5, 2, 7))]
    assert any(t.data_ptr() % 16 for t in tensors)
    out = torch.full((), math.nan, device=DEVICE)
    assert ops.sq_norm(tensors, out=out) is out
    assert_sq_norm_near(out, tensors, f"{dtype}")
    first = out.clone()
    for _ in range(3):
        assert_same_bits([("sum", ops.sq_norm(tensors), first)], what="the first call")
    ops.sq_norm(tensors[:5], out=out, accumulate=True)
    assert_sq_norm_near(out, tensors + tensors[:5], f"{dtype}, accumulated")


def test_sq_norm_many_tensors_three_dtypes():
    """600 tensors (three launches for each dtype) of bf16, fp16 and fp32 in turn, of random sizes with some empty
    and some of many chunks: one sum, as float64's; repeatable bit for bit."""
    sizes = torch.Generator().manual_seed(7)
    numels = torch.randint(0, 9000, (600,), generator=sizes).tolist()
    for i in range(0, 600, 89):
        numels[i] = 100_000
    g = generator(210)
    tensors = [torch.randn(n, device=DEVICE, generator=g).to(DTYPES[i % 3]) for i, n in enumerate(numels)]
    got = ops.sq_norm(tensors)
    assert_sq_norm_near(got, tensors, "600 tensors")
    assert_same_bits([("sum", ops.sq_norm(tensors), got)], what="the first call")


def test_sq_norm_edges_and_errors():
    """No elements: 0 (into a poisoned `out` too); an infinity or a NaN carries through; one element; errors name
    the entry and its problem."""
    e = torch.empty(0, device=DEVICE, dtype=torch.bfloat16)
    out = torch.full((), math.nan, device=DEVICE)
    assert ops.sq_norm([e, e], out=out).item() == 0.0
    out.fill_(math.nan)
    assert ops.sq_norm([], out=out).item() == 0.0
    assert ops.sq_norm([torch.tensor([3.0], device=DEVICE)]).item() == 9.0
    x = torch.randn(10000, device=DEVICE, dtype=torch.bfloat16)
    x[4321] = math.inf
    assert ops.sq_norm([torch.ones(5, device=DEVICE), x]).item() == math.inf
    x[17] = math.nan
    assert math.isnan(ops.sq_norm([x]).item())
    y = torch.randn(4, 6, device=DEVICE)
    with pytest.raises(ValueError, match=r"sq_norm: entry 1 is not contiguous \(strides \(1, 6\)\)"):
        ops.sq_norm([y, y.t()])
    with pytest.raises(ValueError, match=r"sq_norm: entry 0 is dtype torch.float64 not in"):
        ops.sq_norm([y.double()])
    with pytest.raises(ValueError, match=r"sq_norm: entry 1 is on cpu, not a CUDA device"):
        ops.sq_norm([y, y.cpu()])
    with pytest.raises(ValueError, match=r"out must be a one-element float32 tensor"):
        ops.sq_norm([y], out=torch.zeros((), device=DEVICE, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_adamw_step_clipped_every_size(dtype):
    """adamw_step with grad_sq_norm and max_norm over every size of NUMELS and tensors off 16 bytes: bit for bit as
    torch's fused AdamW on gradients multiplied in place by torch's clip factor for that norm (clipping on: max_norm
    a third of the norm; and off: max_norm above it, the factor 1); the gradients keep their bits."""
    P, G, M, V = entries(NUMELS, dtype, seed=220)
    for i, off in enumerate((1, 2, 3)):  # the first three gradients off 16 bytes (element by element)
        G[i] = placed(G[i], off)[1]
    sq = ops.sq_norm(G)
    for max_norm, label in ((sq.sqrt().item() / 3, "clipped"), (sq.sqrt().item() * 2, "under max_norm")):
        run = [[t.clone() for t in X] for X in (P, M, V)]
        grads_before = [g.clone() for g in G]
        scaled = [g.clone().mul_(clip_factor(sq.sqrt(), max_norm)) for g in G]
        want = [[t.clone() for t in X] for X in (P, M, V)]
        torch_fused(want[0], scaled, want[1], want[2], step=3, **HYPER)
        ops.adamw_step(run[0], G, run[1], run[2], step=3, grad_sq_norm=sq, max_norm=max_norm, **HYPER)
        torch.cuda.synchronize()
        assert_same_bits([(f"{label} grad {i}", g, b) for i, (g, b) in enumerate(zip(G, grads_before))],
                         what="the gradients as they were")
        assert_same_bits([(f"{label} {name} {i}", a, b) for name, X, Y in zip(("param", "exp_avg", "exp_avg_sq"),
                                                                              run, want)
                          for i, (a, b) in enumerate(zip(X, Y))], what="torch's fused AdamW on clipped gradients")
        if label == "under max_norm":  # the factor is 1: the unclipped update's bits
            plain = [[t.clone() for t in X] for X in (P, M, V)]
            ops.adamw_step(plain[0], G, plain[1], plain[2], step=3, **HYPER)
            assert_same_bits([(f"{name} {i}", a, b) for name, X, Y in zip(("param", "m", "v"), run, plain)
                              for i, (a, b) in enumerate(zip(X, Y))], what="the update without clipping")


def test_adamw_step_clip_argument_errors():
    x = torch.randn(8, device=DEVICE)
    sq = torch.ones((), device=DEVICE)
    with pytest.raises(ValueError, match="grad_sq_norm and max_norm go together"):
        ops.adamw_step([x], [x], [x], [x], step=1, grad_sq_norm=sq, **HYPER)
    with pytest.raises(ValueError, match="max_norm must be a positive number; got -1.0"):
        ops.adamw_step([x], [x], [x], [x], step=1, grad_sq_norm=sq, max_norm=-1.0, **HYPER)
    with pytest.raises(ValueError, match="grad_sq_norm must be a one-element float32 tensor"):
        ops.adamw_step([x], [x], [x], [x], step=1, grad_sq_norm=sq.double(), max_norm=1.0, **HYPER)
    with pytest.raises(ValueError, match=r"grad_sq_norm is on cpu, the parameters on cuda:\d"):
        ops.adamw_step([x], [x], [x], [x], step=1, grad_sq_norm=sq.cpu(), max_norm=1.0, **HYPER)


def test_norm_and_clipped_update_captured_in_a_cuda_graph():
    """sq_norm (its workspace allocated inside the capture) and the clipped update captured together and replayed
    on new gradients written into the captured ones: each replay as the same two calls made eagerly."""
    numels = [9, 4097, 65537] + [100] * 297
    P, G, M, V = entries(numels, torch.bfloat16, seed=230)
    eager = [[t.clone() for t in X] for X in (P, M, V)]
    sq = torch.zeros((), device=DEVICE)
    ops.sq_norm(G, out=sq)  # warm-up outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.sq_norm(G, out=sq)
        ops.adamw_step(P, G, M, V, step=3, grad_sq_norm=sq, max_norm=20.0, **HYPER)
    g = generator(231)
    for _ in range(2):
        for t in G:
            t.copy_(torch.randn(t.shape, device=DEVICE, generator=g) * 2)
        graph.replay()
        eager_sq = ops.sq_norm(G)
        ops.adamw_step(eager[0], G, eager[1], eager[2], step=3, grad_sq_norm=eager_sq, max_norm=20.0, **HYPER)
        torch.cuda.synchronize()
        assert_same_bits([("sq_norm", sq, eager_sq)] +
                         [(f"list {k} entry {i}", a, b) for k, (X, Y) in enumerate(zip((P, M, V), eager))
                          for i, (a, b) in enumerate(zip(X, Y))], what="the eager launches")


@pytest.mark.parametrize("max_norm", [1e-3, 1e4], ids=["clipped", "under-max-norm"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_optimizer_clip_grad_norm_as_torch(dtype, max_norm):
    """Four steps of the MLP with clip_grad_norm_ before each: the norm as float64's of the gradients; the step bit
    for bit as torch.optim.AdamW(fused=True) after the gradients were multiplied by torch's clip factor for that
    norm (clip_grad_norm_'s own last step); our gradients untouched; the clip used once (a second step without a
    new clip_grad_norm_ is unclipped) and dropped by zero_grad."""
    model = mlp(dtype, 1)
    twin = copy.deepcopy(model)
    ours = TkAdamW(decay_groups(model), lr=3e-3)
    theirs = torch.optim.AdamW(decay_groups(twin), lr=3e-3, fused=True)
    for step in range(1, 5):
        backward(model, 10 + step)
        copy_grads(model, twin)
        grads = [p.grad.clone() for p in model.parameters()]
        norm = ours.clip_grad_norm_(max_norm)
        assert_sq_norm_near(norm.square(), grads, f"step {step}")
        factor = clip_factor(norm, max_norm)
        assert (factor.item() < 1) == (max_norm < 1)
        torch._foreach_mul_([q.grad for q in twin.parameters()], factor)
        ours.step()
        theirs.step()
        assert_same_training(ours, theirs, list(model.parameters()), list(twin.parameters()), f"step {step}")
        assert_same_bits([(f"grad {i}", p.grad, g) for i, (p, g) in enumerate(zip(model.parameters(), grads))],
                         what="the gradients before the step")
    # The clip was the last step's: this step is unclipped, as torch's on the unscaled gradients.
    copy_grads(model, twin)
    ours.step()
    theirs.step()
    assert_same_training(ours, theirs, list(model.parameters()), list(twin.parameters()), "a step without a clip")
    # zero_grad drops a clip not yet applied.
    ours.clip_grad_norm_(1e-6)
    ours.zero_grad()
    theirs.zero_grad()
    backward(model, 20)
    copy_grads(model, twin)
    ours.step()
    theirs.step()
    assert_same_training(ours, theirs, list(model.parameters()), list(twin.parameters()), "after zero_grad")


def test_optimizer_clip_with_declined_parameters():
    """Clipping with a transposed (non-contiguous) and a float64 parameter beside kernel ones: their squares summed
    by torch's foreach norms into the same norm, their update on torch's path reading clipped copies, every
    gradient left as it was; all bit for bit as torch's AdamW (fused for the kernel's, default for the others)
    after the gradients were multiplied by the clip factor."""
    case = with_declined(240, torch.float32)
    fast, transposed, wide, their_fast, their_slow, ours, fused, plain = (
        case.fast, case.transposed, case.wide, case.their_fast, case.their_slow, case.ours, case.fused, case.plain)
    ours_params = case.ours_params
    for step in range(1, 4):
        case.give_grads()
        grads = [p.grad.clone() for p in ours_params]
        norm = ours.clip_grad_norm_(1.0)
        assert_sq_norm_near(norm.square(), grads, f"step {step}")
        factor = clip_factor(norm, 1.0)
        assert factor.item() < 1
        for q in their_fast + their_slow:
            q.grad.mul_(factor)
        ours.step()
        fused.step()
        plain.step()
        assert ours.routes["tk"] == 2 and ours.routes["torch"] == 2
        assert_same_training(ours, fused, fast, their_fast, f"step {step}, kernel")
        assert_same_training(ours, plain, [transposed, wide], their_slow, f"step {step}, declined",
                             what="torch.optim.AdamW (default)")
        assert_same_bits([(f"grad {i}", p.grad, q) for i, (p, q) in enumerate(zip(ours_params, grads))],
                         what="the gradients before the step")
