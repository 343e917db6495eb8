"""`thunder_tk.optim.AdamW`: torch.optim.AdamW whose update runs as tk's multi-tensor kernel.

The optimizer step is not in Thunder's trace, so no claim rule reaches it, yet in a LitGPT training step it is a
pass over every parameter, its gradient and two moment buffers: for Llama-3.2-1B (1.5 B parameters in bf16) 21 GB
of memory traffic, which torch's fused AdamW moves at about half the GPU's bandwidth. This class is a drop-in
torch.optim.AdamW (same arguments, defaults, state and state_dict, so checkpoints move between the two either way)
whose `step` hands every parameter the kernel can take to one pass of `ops.adamw_step`, 256 tensors a launch,
computing what torch's fused AdamW computes (torch 2.11's, operation for operation: the same bits). Parameters it
cannot take (off an sm_90 GPU, other dtypes, non-contiguous tensors, tensor subclasses such as FSDP2's DTensor,
AMSGrad, a tensor learning rate) take torch's own implementation in the same step; `routes` says which went where
and why.
"""

from __future__ import annotations

import torch
from torch.optim.adamw import adamw as _torch_adamw

from thunder_tk import ops

__all__ = ["AdamW"]


class AdamW(torch.optim.AdamW):
    """torch.optim.AdamW (decoupled weight decay) with its update on tk's kernel where the parameters allow.

    Arguments as torch.optim.AdamW's. `fused` is accepted and changes nothing (the kernel is the fused path, so a
    config written for torch's fused AdamW needs only its class changed); `capturable` and `differentiable` must
    stay False: step counts stay on the CPU, as in torch's default path, so reading them costs no
    synchronisation. `foreach` picks torch's implementation for the parameters the kernel does not take.
    `kernels=False` sends every parameter to torch's implementation (for comparisons). With GradScaler, unscale
    first, as for any optimizer without built-in AMP scaling (GradScaler.step does so). A state_dict saved here
    loads into torch's AdamW, but torch then takes this class's group settings with it (`fused` None), so set
    `fused` in its groups to keep torch's fused path."""

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *, maximize: bool = False,
                 foreach: bool | None = None, fused: bool | None = None, capturable: bool = False,
                 differentiable: bool = False, kernels: bool = True):
        if capturable or differentiable:
            raise ValueError("thunder_tk.optim.AdamW: capturable and differentiable are not supported (its step "
                             "counts stay on the CPU); use torch.optim.AdamW for them")
        del fused  # the kernel is the fused path
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, amsgrad=amsgrad,
                         maximize=maximize, foreach=foreach)
        self.kernels = bool(kernels)
        self._reset_routes()

    def _reset_routes(self) -> None:
        # The last step's routes: tensors updated by tk's kernel and by torch, and why each of the latter was.
        self.routes: dict = {"tk": 0, "torch": 0, "declined": []}
        self._device_reasons: dict = {}

    def __getstate__(self):
        state = super().__getstate__()
        state["kernels"] = self.kernels
        return state

    def __setstate__(self, state) -> None:
        kernels = state.pop("kernels", True)
        super().__setstate__(state)
        self.kernels = kernels
        self._reset_routes()

    def load_state_dict(self, state_dict) -> None:
        """torch's load, then this class's settings back: a state saved by a fused or capturable torch AdamW
        brings those flags and step counts on the GPU, which this class keeps on the CPU."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["fused"], group["capturable"], group["differentiable"] = None, False, False
        for state in self.state.values():
            step = state.get("step")
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                state["step"] = step.detach().to("cpu", torch.float32)

    def _device_reason(self, device: torch.device) -> str | None:
        """Why the kernel cannot run on `device` (no build, not sm_90), or None; once per device."""
        if device not in self._device_reasons:
            try:
                ops._require_kernels(device)
                self._device_reasons[device] = None
            except ops.KernelUnavailableError as e:
                self._device_reasons[device] = str(e)
        return self._device_reasons[device]

    def _group_reason(self, group: dict) -> str | None:
        if not self.kernels:
            return "kernels=False"
        if group["amsgrad"]:
            return "amsgrad is not supported by the kernel"
        if group.get("differentiable"):
            return "differentiable is not supported by the kernel"
        if any(isinstance(group[k], torch.Tensor) for k in ("lr", "weight_decay", "eps")) or any(
                isinstance(b, torch.Tensor) for b in group["betas"]):
            return "tensor hyperparameters are not supported by the kernel"
        return None

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        routes = {"tk": 0, "torch": 0, "declined": []}
        for index, group in enumerate(self.param_groups):
            self._update_group(index, group, routes)
        self.routes = routes
        return loss

    def _update_group(self, index: int, group: dict, routes: dict) -> None:
        group_reason = self._group_reason(group)
        fast: dict = {}  # (device, dtype) -> ([param], [grad], [exp_avg], [exp_avg_sq], [step])
        slow = ([], [], [], [], [], [])  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        has_complex = False
        for position, p in enumerate(group["params"]):
            g = p.grad
            if g is None:
                continue
            if g.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            state = self.state[p]
            if not state:  # torch's initial state for its default path
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            m, v = state["exp_avg"], state["exp_avg_sq"]
            reason = group_reason
            if reason is None:
                reason = ops.adamw_unsupported(p, g, m, v)
                if reason is None:
                    reason = self._device_reason(p.device)
                if reason is None and state["step"].device.type != "cpu":
                    reason = f"its step count is on {state['step'].device}"
            if reason is None:
                entry = fast.setdefault((p.device, p.dtype), ([], [], [], [], []))
                for lst, t in zip(entry, (p, g, m, v, state["step"])):
                    lst.append(t)
                continue
            routes["declined"].append((index, position, tuple(p.shape), reason))
            has_complex |= torch.is_complex(p)
            for lst, t in zip(slow, (p, g, m, v, state.get("max_exp_avg_sq"), state["step"])):
                if t is not None:
                    lst.append(t)
        beta1, beta2 = group["betas"]
        for (device, _), (ps, gs, ms, vs, steps) in fast.items():
            counts = (torch.stack(steps) + 1).tolist()  # this step's counts; CPU tensors: no synchronisation
            by_count: dict = {}
            for i, c in enumerate(counts):
                by_count.setdefault(c, []).append(i)
            ext = ops._require_kernels(device)
            for count, idx in by_count.items():
                pick = (lambda lst: lst) if len(idx) == len(ps) else (lambda lst: [lst[i] for i in idx])
                ops._adamw_launch(ext, pick(ps), pick(gs), pick(ms), pick(vs), step=count, lr=group["lr"],
                                  beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                                  maximize=group["maximize"])
            torch._foreach_add_(steps, 1)  # counted once the updates are enqueued (a refused launch counts none)
            routes["tk"] += len(ps)
        if slow[0]:
            _torch_adamw(*slow, foreach=group["foreach"], capturable=False,
                         differentiable=bool(group.get("differentiable")), fused=None, grad_scale=None, found_inf=None,
                         has_complex=has_complex, amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                         weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
            routes["torch"] += len(slow[0])
