"""RMSNorm forward and backward by tk (ops.rms_norm with the residual add, ops.rms_norm_backward with the residual
stream's gradient added: what a pre-norm block's norm runs in a training step) against the same arithmetic in PyTorch,
eager and as torch.compile'd functions (Inductor's Triton kernels: what Thunder's torch.compile fuser makes of the
decomposed norm). Timed in turns (common.interleaved_ms), µs; ratios peer / tk (above 1: tk faster); tk's rate as
the bytes its launches must move per second; JSON and an optional PNG. Every way is checked against the float64
references (ops.rms_norm_reference, ops.rms_norm_backward_reference) before it is timed.

What each way computes, bf16 activations and a bf16 weight, eps 1e-5 (Llama 3's), x, residual, grad and
residual_grad (rows, n):
  fwd      tk: ops.rms_norm(x, weight, eps, residual) -> (y, rstd, s). Peers: add_rms_norm, the same three outputs
           by LitGPT's arithmetic: s = x + residual (16-bit add), rstd = rsqrt(mean(s.float()^2) + eps) (fp32,
           (rows, 1)), y = (s.float() * rstd * weight.float()).to(bf16); eager, and torch.compile'd.
  bwd      tk: ops.rms_norm_backward(grad, s, rstd, weight, residual_grad) -> (dx, dw), from the forward's saved s
           and rstd. Peers: rms_norm_backward_math, the same outputs from the same inputs: the closed-form gradient
           autograd's chain gives for add_rms_norm (g = grad * weight, dx = rstd * g - rstd^3 * s * mean(g * s) +
           residual_grad, dw = sum over rows of grad * s * rstd), in fp32, each output rounded once; eager, and
           torch.compile'd (Inductor fuses it into a row reduction and a column reduction).
  fwd+bwd  tk: the two calls above in turn. Peers: add_rms_norm with x and the weight requiring grad, then
           torch.autograd.grad((y, s), (x, weight), (grad, residual_grad)) -> (dx, dw): eager autograd, and the
           torch.compile'd add_rms_norm, whose backward AOTAutograd derives and Inductor compiles (what compiling
           the model's forward gives a training step). Autograd's own host work is part of these times.
The fwd and bwd ways are timed as CUDA-graph replays (common.graphed): a 40 us launch is otherwise timed at the pace
of its host work (ops' argument checks, the compiled function's wrapper), which a training step hides behind the
GPU's queue; a way that cannot be captured is timed by direct calls, and the row says so. The fwd+bwd ways (autograd)
are timed by direct calls, host work included. Times are medians (do_bench where Triton is installed).

Shapes (8192 tokens, batch x sequence): Llama-3.2-1B (n 2048), Llama-3-8B (4096), and a 16384-wide one (the widest
row the kernels take).

    python benchmarks/rms_norm.py --json out/rms_norm.json --png out/rms_norm.png
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import graphed, interleaved_ms, report, shape_arguments  # noqa: E402

from thunder_tk import ops  # noqa: E402

# name: (rows, n)
SHAPES = {
    "llama-3.2-1b": (8192, 2048),
    "llama-3-8b": (8192, 4096),
    "wide-16384": (8192, 16384),
}
EPS = 1e-5
PARTS = ["fwd", "bwd", "fwd+bwd"]
WAYS = ["tk", "compile", "eager"]


def add_rms_norm(x, residual, weight, eps: float):
    """The forward peers: a pre-norm block's residual add (in x's dtype) and LitGPT's RMSNorm (fp32 inside, rounded
    once): (y, rstd, s), as ops.rms_norm returns them with a residual."""
    s = x + residual
    sf = s.float()
    rstd = torch.rsqrt(torch.mean(sf * sf, dim=-1, keepdim=True) + eps)
    return (sf * rstd * weight.float()).to(s.dtype), rstd, s


def rms_norm_backward_math(grad, s, rstd, weight, residual_grad):
    """The backward peers: (dx, dw) of add_rms_norm from its saved s and rstd, in fp32, each rounded once (dx to s's
    dtype, dw to the weight's), the residual stream's gradient added to dx, as ops.rms_norm_backward computes them."""
    n = s.shape[-1]
    sf, gf = s.float(), grad.float()
    g = gf * weight.float()
    dx = rstd * g - rstd.pow(3) * sf * (g * sf).mean(-1, keepdim=True) + residual_grad.float()
    dw = (gf * sf * rstd).reshape(-1, n).sum(0)
    return dx.to(s.dtype), dw.to(weight.dtype)


def training_step(forward, x, residual, weight, grad, residual_grad, eps: float):
    """The fwd+bwd peers: `forward` (add_rms_norm, eager or compiled) with x and weight requiring grad, then autograd's
    (dx, dw) for the incoming gradients of y and s."""
    y, _, s = forward(x, residual, weight, eps)
    return torch.autograd.grad((y, s), (x, weight), (grad, residual_grad))


def rel_err(got, want) -> float:
    return ((got.double() - want).norm() / want.norm()).item()


def measure(name: str, compiled_forward, compiled_backward, rounds: int) -> dict:
    """One shape's row: every way checked against the float64 references, then all timed in turns."""
    rows, n = SHAPES[name]
    dtype, dev = torch.bfloat16, "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    x, r, dy, dres = (torch.randn(rows, n, device=dev, generator=g).to(dtype) for _ in range(4))
    w = (1 + 0.5 * torch.randn(n, device=dev, generator=g)).to(dtype)
    y, rstd, s = ops.rms_norm(x, w, EPS, residual=r)
    xg, wg = x.detach().requires_grad_(), w.detach().requires_grad_()

    def tk_step():
        y, rstd, s = ops.rms_norm(x, w, EPS, residual=r)
        return ops.rms_norm_backward(dy, s, rstd, w, residual_grad=dres)

    fns = {
        "fwd tk": lambda: ops.rms_norm(x, w, EPS, residual=r),
        "fwd compile": lambda: compiled_forward(x, r, w, EPS),
        "fwd eager": lambda: add_rms_norm(x, r, w, EPS),
        "bwd tk": lambda: ops.rms_norm_backward(dy, s, rstd, w, residual_grad=dres),
        "bwd compile": lambda: compiled_backward(dy, s, rstd, w, dres),
        "bwd eager": lambda: rms_norm_backward_math(dy, s, rstd, w, dres),
        "fwd+bwd tk": tk_step,
        "fwd+bwd compile": lambda: training_step(compiled_forward, xg, r, wg, dy, dres, EPS),
        "fwd+bwd eager": lambda: training_step(add_rms_norm, xg, r, wg, dy, dres, EPS),
    }

    want_y, _, want_s = ops.rms_norm_reference(x, w, EPS, r)
    for way in WAYS:
        got_y, got_rstd, got_s = fns[f"fwd {way}"]()
        assert torch.equal(got_s, want_s), f"{name}: fwd {way}: s is not x + residual rounded"
        assert got_rstd.shape == (rows, 1) and got_rstd.dtype == torch.float32, f"{name}: fwd {way}: rstd"
        err = rel_err(got_y, want_y)
        assert err < 1e-2, f"{name}: fwd {way} differs from the float64 reference by {err:.3g}"
    del want_y, want_s
    want_dx, want_dw = ops.rms_norm_backward_reference(dy, s, rstd, w, dres)
    for part in ("bwd", "fwd+bwd"):
        for way in WAYS:
            got_dx, got_dw = fns[f"{part} {way}"]()
            for what, got, want in (("dx", got_dx, want_dx), ("dw", got_dw, want_dw)):
                err = rel_err(got, want)
                assert err < 1e-2, f"{name}: {part} {way}: {what} differs from the float64 reference by {err:.3g}"
    del want_dx, want_dw

    timed, direct = {}, []
    for key, fn in fns.items():
        if key.startswith("fwd+bwd"):
            timed[key] = fn
            continue
        try:
            timed[key] = graphed(fn)
        except Exception:  # noqa: BLE001  (not capturable: timed by direct calls)
            timed[key] = fn
            direct.append(key)
    t = interleaved_ms(timed, rounds=rounds)
    tensor_gb = rows * n * x.element_size() / 1e9
    moved = {"fwd": 4 * tensor_gb, "bwd": 4 * tensor_gb, "fwd+bwd": 8 * tensor_gb}  # x, r -> y, s; dy, s, dres -> dx
    row = {"shape": name, "rows": rows, "n": n, "timed by direct calls": ", ".join(direct) or "-"}
    for part in PARTS:
        for way in WAYS:
            row[f"{part} {way} us"] = t[f"{part} {way}"] * 1e3
        for way in WAYS[1:]:
            row[f"{part} {way} / tk"] = t[f"{part} {way}"] / t[f"{part} tk"]
        row[f"{part} tk GB/s"] = moved[part] / (t[f"{part} tk"] * 1e-3)
    return row


def main() -> None:
    a = shape_arguments("rms_norm", SHAPES)
    if not torch.cuda.is_available():
        sys.exit("benchmarks/rms_norm.py needs a CUDA GPU")
    # Static shapes, one specialisation per shape, as Thunder compiles each fusion region of a fixed-shape trace.
    compiled_forward = torch.compile(add_rms_norm, dynamic=False)
    compiled_backward = torch.compile(rms_norm_backward_math, dynamic=False)
    rows = [measure(name, compiled_forward, compiled_backward, a.rounds) for name in a.shapes]
    columns = ["shape", "timed by direct calls", *[f"{p} {w} us" for p in PARTS for w in WAYS], *[f"{p} {w} / tk" for p in PARTS
                                                                          for w in WAYS[1:]],
               *[f"{p} tk GB/s" for p in PARTS]]
    report(a, "rms_norm", rows, columns, "RMSNorm with the residual, bf16 (us)",
           {f"{p} {w}": f"{p} {w} us" for p in PARTS for w in WAYS})


if __name__ == "__main__":
    main()
