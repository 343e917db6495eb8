"""Helpers the GPU tests share for measuring a result against a reference and making GEMM operands."""

import torch


def rel_err(got: torch.Tensor, ref: torch.Tensor, floor: float = 1e-30) -> float:
    """||got - ref|| / max(||ref||, floor), Frobenius norms taken in float64."""
    ref = ref.double()
    return ((got.double() - ref).norm() / ref.norm().clamp_min(floor)).item()


def operand(rows, cols, unit_cols: bool, dtype=torch.bfloat16):
    """(rows, cols) of torch.randn on cuda in `dtype`, with a unit stride along cols (row-major) or along rows (a
    transposed view)."""
    if unit_cols:
        return torch.randn(rows, cols, device="cuda", dtype=dtype)
    return torch.randn(cols, rows, device="cuda", dtype=dtype).t()
