"""Twin parameters for comparing thunder_tk.optim.AdamW with torch's AdamW (CPU and GPU tests): copies of the
parameters, and the same gradient on both of each pair."""

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
