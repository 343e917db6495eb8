"""Helpers for comparing thunder_tk.optim.AdamW with torch's AdamW (CPU and GPU tests): copies of the
parameters, the same gradient on both of each pair, and torch's clip factor as the reference."""

import torch


def twins(params):
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def same_grads(pairs, make_grad, skip=()):
    """make_grad(param) -> a gradient, set (cloned) on both parameters of each pair; none on the pairs in `skip`."""
    for i, (a, b) in enumerate(pairs):
        if i in skip:
            a.grad = b.grad = None
            continue
        grad = make_grad(a)
        a.grad, b.grad = grad.clone(), grad.clone()


def torch_clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """The tests' reference: torch.nn.utils.clip_grad_norm_'s factor from a norm, its expression as written there
    (written out here, not taken from thunder_tk, so that the code under test is checked against torch's)."""
    return torch.clamp(max_norm / (norm + 1e-6), max=1.0)
