"""Helpers the GPU tests share for measuring a result against a reference and making GEMM operands."""

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """||got - ref|| / max(||ref||, floor), Frobenius norms taken in float64."""
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm().clamp_min(floor)).item()


def assert_as_accurate_as_eager(label, out, eager_out, exact_out, model, eager, exact) -> None:
    """A model's output and every parameter's gradient within twice eager PyTorch's error (plus 1e-3) against a
    float64 copy with the same weights (`out`, `eager_out`, `exact_out`: their outputs, backward already run). Every
    figure goes in the message, so that a short log says how far off what was."""
    errors = {"logits": (rel_err(out, exact_out), rel_err(eager_out, exact_out), out.dtype)}
    for (name, p), q, r in zip(model.named_parameters(), eager.parameters(), exact.parameters()):
        errors[name] = (rel_err(p.grad, r.grad), rel_err(q.grad, r.grad), p.grad.dtype)
    worse = {k: f"jitted {a:.2e} eager {e:.2e} ({dtype})" for k, (a, e, dtype) in errors.items() if not a < 2 * e + 1e-3}
    assert not worse, (label, worse)


def operand(rows, cols, unit_cols: bool, dtype=torch.bfloat16):
    """(rows, cols) of torch.randn on cuda in `dtype`, with a unit stride along cols (row-major) or along rows (a
    transposed view)."""
    if unit_cols:
        return torch.randn(rows, cols, device="cuda", dtype=dtype)
    return torch.randn(cols, rows, device="cuda", dtype=dtype).t()
