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

Clipping by the global gradient norm (LitGPT's `train.max_norm`) is `clip_grad_norm_` on the optimizer: torch's
torch.nn.utils.clip_grad_norm_ reads every gradient for the norm, then reads and writes every gradient again to
scale it, before the update reads it a third time; here the norm is one read-only pass (tk's sq_norm kernel) and the
scaling happens inside the update's own read.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch
from torch.optim.adamw import adamw as _torch_adamw

from thunder_tk import ops

__all__ = ["AdamW", "clip_factor", "sq_norm_by_torch"]


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_'s factor for a norm, its operations in its order: min(1, max_norm / (norm +
    1e-6)), on the norm's device (tk's AdamW kernel computes the same from the squared norm)."""
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def sq_norm_by_torch(tensors: list) -> torch.Tensor:
    """The sum of squares of every element of `tensors` (one device, any dtypes), a 0-d float32 tensor there: torch's
    foreach norms in fp32 for 16- and 32-bit floats, each tensor's own norm in its dtype for the others (float64)."""
    narrow = [t for t in tensors if t.dtype in ops.ADAMW_DTYPES]
    wide = [t for t in tensors if t.dtype not in ops.ADAMW_DTYPES]
    parts = []
    if narrow:
        parts.append(torch.stack(torch._foreach_norm(narrow, 2.0, dtype=torch.float32)).square().sum())
    if wide:
        parts.append(torch.stack([torch.linalg.vector_norm(t).square() for t in wide]).sum().float())
    return parts[0] if len(parts) == 1 else parts[0] + parts[1]


_grad_of = operator.attrgetter("grad")
_exp_avg_of, _exp_avg_sq_of, _step_of = (operator.itemgetter(k) for k in ("exp_avg", "exp_avg_sq", "step"))
_data_ptr, _numel, _is_contiguous = torch.Tensor.data_ptr, torch.Tensor.numel, torch.Tensor.is_contiguous
_dtype_of, _is_sparse = operator.attrgetter("dtype"), operator.attrgetter("is_sparse")


def _all_same(a: list, b: list) -> bool:
    """Whether two lists hold the same objects in the same order."""
    return len(a) == len(b) and all(map(operator.is_, a, b))


@dataclass
class _KernelPlan:
    """What a group's update on the kernel keeps from one step to the next: the step whose every parameter had a
    gradient and went to the kernel in bulk (one dtype and device). The parameters and moment buffers are held (so
    that an object replaced is seen as such), with their addresses and sizes; each step re-reads those addresses
    and the parameters' dtype and contiguity, and checks the gradients (new tensors every step) as the kernel needs
    them (_planned_update). Anything
    else makes the step take the full path, which names a reason for every tensor it sends elsewhere."""
    params: list
    exp_avgs: list
    exp_avg_sqs: list
    steps: torch.Tensor  # the buffer whose views are the group's step counts, in order
    addresses: tuple[list, list, list]  # params', exp_avgs', exp_avg_sqs'
    numels: list
    dtype: torch.dtype
    device: torch.device
    device_index: int  # as Tensor.get_device gives it


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
        self._reset_transient()

    def _reset_transient(self) -> None:
        """What is neither state nor settings: routes, step-count buffers, a pending clip."""
        # clip_grad_norm_'s squared norm (0-d fp32 on the first gradient's device) and max_norm, for the next step
        self._clip: tuple[torch.Tensor, float] | None = None
        self._clip_on: dict = {}  # device -> the squared norm, or the clip factor, there
        # The last step's routes: tensors updated by tk's kernel and by torch, and why each of the latter was.
        self.routes: dict = {"tk": 0, "torch": 0, "declined": []}
        self._device_reasons: dict = {}
        # Step counts made together are 0-d views of one CPU buffer, so that a step advances them all with one add
        # (a CPU add per tensor costs about 1.5 us): buffer id -> (the views' ids in order, the buffer).
        self._step_buffers: dict = {}
        # Group index -> _KernelPlan: the per-tensor checks of the parameters and their state, which cost more host
        # time than torch's whole fused step on models of many small tensors, done once (see _planned_update).
        self._plans: dict[int, _KernelPlan] = {}

    def _step_views(self, values) -> list:
        """Fresh step-count tensors holding `values`, each a 0-d float32 view of one new CPU buffer."""
        buffer = torch.tensor(list(values), dtype=torch.float32)
        views = list(buffer.unbind(0))
        self._step_buffers[id(buffer)] = (tuple(map(id, views)), buffer)
        return views

    def __getstate__(self):
        state = super().__getstate__()
        state["kernels"] = self.kernels
        return state

    def __setstate__(self, state) -> None:
        kernels = state.pop("kernels", True)
        super().__setstate__(state)
        self.kernels = kernels
        self._reset_transient()
        self._pack_steps()

    def load_state_dict(self, state_dict) -> None:
        """torch's load, then this class's settings back: a state saved by a fused or capturable torch AdamW
        brings those flags and step counts on the GPU, which this class keeps on the CPU."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            group["fused"], group["capturable"], group["differentiable"] = None, False, False
        self._pack_steps()

    def _pack_steps(self) -> None:
        """Each group's step counts on the CPU as views of one buffer (see _step_views), from whatever tensors a
        loaded or copied state holds."""
        self._step_buffers = {}
        for group in self.param_groups:
            states = [self.state[p] for p in group["params"]
                      if p in self.state and isinstance(self.state[p].get("step"), torch.Tensor)]
            for state, view in zip(states, self._step_views([float(s["step"]) for s in states]) if states else ()):
                state["step"] = view

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

    def route_counts(self) -> dict:
        """The last step's routes counted: {"tk": tensors on tk's kernel, "torch": tensors on torch's path,
        "declined": {reason: tensors}}, the reasons in the order first met."""
        declined: dict[str, int] = {}
        for *_, reason in self.routes["declined"]:
            declined[reason] = declined.get(reason, 0) + 1
        return {"tk": self.routes["tk"], "torch": self.routes["torch"], "declined": declined}

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, *, process_group=None) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_(parameters, max_norm) over this optimizer's parameters, for its next
        step(): returns the gradients' global L2 norm (a 0-d float32 tensor on the first gradient's device; nothing
        waits for it), and that step reads each gradient multiplied by min(1, max_norm / (norm + 1e-6)) in its
        dtype, as torch's in-place multiply would leave it. The gradients themselves are not written, so `p.grad`
        keeps its unclipped values. The norm is summed in fp32 by tk's sq_norm kernel (torch's foreach norms for
        gradients the kernel does not read); `process_group`: the parameters are shards over its ranks (FSDP), and
        their squared norms are summed across them first. zero_grad() drops a clip not yet applied; a second call
        replaces it. Only the L2 norm; non-finite norms are not raised (torch's default), they propagate."""
        if (why := ops.max_norm_unsupported(max_norm)) is not None:
            raise ValueError(f"clip_grad_norm_: {why}")
        self._clip, self._clip_on = None, {}
        grads = [g for group in self.param_groups for g in map(_grad_of, group["params"]) if g is not None]
        if not grads:
            return torch.zeros(())
        if any(map(_is_sparse, grads)):
            raise RuntimeError("clip_grad_norm_ does not support sparse gradients")
        if ops._on_one_gpu(grads):
            by_device = {grads[0].device: grads}  # the usual case, found in bulk
        else:
            by_device = {}
            for g in grads:
                by_device.setdefault(g.device, []).append(g)
        total = None
        for device, device_grads in by_device.items():
            part = self._sq_norm_on(device, device_grads)
            total = part if total is None else total + part.to(total.device)
        if process_group is not None:
            torch.distributed.all_reduce(total, group=process_group)
        self._clip = (total, float(max_norm))
        return total.sqrt()

    def _sq_norm_on(self, device: torch.device, grads: list) -> torch.Tensor:
        """The squared norm of one device's gradients, 0-d fp32 there: tk's kernel for those it reads, torch's
        foreach norms for the rest."""
        if not (self.kernels and device.type == "cuda" and self._device_reason(device) is None):
            on_kernel, rest = [], grads
        elif ops.sq_norm_list_alike(grads):
            on_kernel, rest = grads, []
        else:
            on_kernel, rest = [], []
            for g in grads:
                (rest if ops.sq_norm_unsupported(g) else on_kernel).append(g)
        total = None
        if on_kernel:  # checked above: the launch itself
            total = torch.empty((), dtype=torch.float32, device=device)
            ops._sq_norm_launch(ops._require_kernels(device), on_kernel, total, accumulate=False)
        if rest:
            part = sq_norm_by_torch(rest)
            total = part if total is None else total.add_(part)
        return total

    def _clip_factor(self, device: torch.device) -> torch.Tensor:
        """The pending clip's factor on `device` (clip_factor: for the gradients on torch's path)."""
        key = ("factor", device)
        if key not in self._clip_on:
            total, max_norm = self._clip
            self._clip_on[key] = clip_factor(total.sqrt(), max_norm).to(device)
        return self._clip_on[key]

    def _clip_sq_norm(self, device: torch.device) -> torch.Tensor:
        """The pending clip's squared norm on `device` (the kernel's argument)."""
        key = ("sq_norm", device)
        if key not in self._clip_on:
            self._clip_on[key] = self._clip[0].to(device)
        return self._clip_on[key]

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._clip, self._clip_on = None, {}  # the gradients it was measured on are gone
        super().zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            if self._clip is not None:
                raise ValueError("AdamW.step: a closure recomputes the gradients that clip_grad_norm_ measured; "
                                 "clip inside the closure's caller instead, or step without a closure")
            with torch.enable_grad():
                loss = closure()
        routes = {"tk": 0, "torch": 0, "declined": []}
        try:
            for index, group in enumerate(self.param_groups):
                self._update_group(index, group, routes)
        finally:
            self._clip, self._clip_on = None, {}  # one clip, one step
        self.routes = routes
        return loss

    def _update_group(self, index: int, group: dict, routes: dict) -> None:
        if self._planned_update(index, group):
            routes["tk"] += len(group["params"])
            return
        self._plans.pop(index, None)
        params = [p for p in group["params"] if p.grad is not None]
        if not params:
            return
        grads = [p.grad for p in params]
        if any(g.is_sparse for g in grads):
            raise RuntimeError("AdamW does not support sparse gradients")
        states = [self.state[p] for p in params]
        fresh = [state for state in states if not state]
        for state, view in zip(fresh, self._step_views([0.0] * len(fresh)) if fresh else ()):
            state["step"] = view
        for p, state in zip(params, states):
            if "exp_avg" not in state:  # torch's initial state for its default path, the step count made above
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if group["amsgrad"]:
                    state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        exp_avgs = [s["exp_avg"] for s in states]
        exp_avg_sqs = [s["exp_avg_sq"] for s in states]
        steps = [s["step"] for s in states]
        group_reason = self._group_reason(group)
        # The usual case, checked in bulk: every parameter of the group on the kernel, one dtype and device.
        if (group_reason is None and ops.adamw_lists_alike(params, grads, exp_avgs, exp_avg_sqs)
                and self._device_reason(params[0].device) is None and not any(t.is_cuda for t in steps)):
            self._on_kernel(params, grads, exp_avgs, exp_avg_sqs, steps, group)
            routes["tk"] += len(params)
            self._make_plan(index, group, params, states, exp_avgs, exp_avg_sqs, steps)
            return
        fast: dict = {}  # (device, dtype) -> ([param], [grad], [exp_avg], [exp_avg_sq], [step])
        slow = ([], [], [], [], [], [])  # params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps
        has_complex = False
        positions = {id(p): i for i, p in enumerate(group["params"])}
        for p, g, state in zip(params, grads, states):
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
            routes["declined"].append((index, positions[id(p)], tuple(p.shape), reason))
            has_complex |= torch.is_complex(p)
            for lst, t in zip(slow, (p, g, m, v, state.get("max_exp_avg_sq"), state["step"])):
                if t is not None:
                    lst.append(t)
        for lists in fast.values():
            self._on_kernel(*lists, group)
            routes["tk"] += len(lists[0])
        if slow[0]:
            beta1, beta2 = group["betas"]
            if self._clip is not None:  # clipped copies: the gradients stay as they are, as on the kernel's path
                slow[1][:] = [g.mul(self._clip_factor(g.device)) for g in slow[1]]
            _torch_adamw(*slow, foreach=group["foreach"], capturable=False,
                         differentiable=bool(group.get("differentiable")), fused=None, grad_scale=None, found_inf=None,
                         has_complex=has_complex, amsgrad=group["amsgrad"], beta1=beta1, beta2=beta2, lr=group["lr"],
                         weight_decay=group["weight_decay"], eps=group["eps"], maximize=group["maximize"])
            routes["torch"] += len(slow[0])

    def _make_plan(self, index: int, group: dict, params, states, exp_avgs, exp_avg_sqs, steps) -> None:
        """Keeps the group's plan after a step that took every parameter to the kernel in bulk. Step counts made
        elsewhere (a state set by hand, not loaded) become views of one buffer first, as a loaded state's do."""
        if len(params) != len(group["params"]):
            return
        buffer = self._whole_buffer(steps)
        if buffer is None:
            steps = self._step_views([float(s) for s in steps])
            for state, view in zip(states, steps):
                state["step"] = view
            buffer = self._whole_buffer(steps)
        self._plans[index] = _KernelPlan(
            params=list(params), exp_avgs=list(exp_avgs), exp_avg_sqs=list(exp_avg_sqs), steps=buffer,
            addresses=tuple(list(map(_data_ptr, x)) for x in (params, exp_avgs, exp_avg_sqs)),
            numels=list(map(_numel, params)), dtype=params[0].dtype, device=params[0].device,
            device_index=params[0].get_device())

    def _planned_update(self, index: int, group: dict) -> bool:
        """The group's update by its plan, where every check still holds; False (nothing done) where one does not
        or there is no plan. About a third of the full path's host time a tensor: the gradients are checked for
        type, layout, dtype, device, contiguity and element count (their shapes are the parameters', as the `.grad`
        setter requires), the parameters and moments only for having been replaced or moved."""
        plan = self._plans.get(index)
        if plan is None or self._group_reason(group) is not None:
            return False
        params = group["params"]
        if not _all_same(params, plan.params):
            return False
        grads = list(map(_grad_of, params))
        if not all(map(operator.is_not, grads, itertools.repeat(None))):
            return False
        try:
            states = list(map(self.state.__getitem__, params))
            exp_avgs, exp_avg_sqs = list(map(_exp_avg_of, states)), list(map(_exp_avg_sq_of, states))
            steps = list(map(_step_of, states))
        except KeyError:
            return False
        if not (_all_same(exp_avgs, plan.exp_avgs) and _all_same(exp_avg_sqs, plan.exp_avg_sqs)
                and self._whole_buffer(steps) is plan.steps):
            return False
        addresses = tuple(list(map(_data_ptr, x)) for x in (params, exp_avgs, exp_avg_sqs))
        if addresses != plan.addresses or set(map(_dtype_of, params)) != {plan.dtype} or not all(
                map(_is_contiguous, params)):
            return False
        if not (ops._flat_on_one_gpu(grads) and grads[0].get_device() == plan.device_index
                and set(map(_dtype_of, grads)) == {plan.dtype} and list(map(_numel, grads)) == plan.numels):
            return False
        self._on_kernel(params, grads, exp_avgs, exp_avg_sqs, steps, group, plan=plan)
        return True

    def _on_kernel(self, params, grads, exp_avgs, exp_avg_sqs, steps, group: dict, plan=None) -> None:
        """The update of checked tensors of one dtype and device: a launch per distinct step count (a parameter
        that first had a gradient later counts fewer steps), then the counts advanced."""
        buffer = plan.steps if plan is not None else self._whole_buffer(steps)
        device = params[0].device
        ext = ops._require_kernels(device)
        beta1, beta2 = group["betas"]
        hyper = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                     maximize=group["maximize"])
        if self._clip is not None:
            hyper.update(grad_sq_norm=self._clip_sq_norm(device), max_norm=self._clip[1])
        counts = (buffer if buffer is not None else torch.stack(steps)) + 1  # float32 on the CPU: no waiting
        low, high = counts.aminmax()
        if low == high:  # the usual case: every count alike, one pass (grouping tensor by tensor costs host time)
            if plan is not None:
                ops._adamw_launch_ptrs(ext, device, plan.dtype, plan.addresses[0], list(map(_data_ptr, grads)),
                                       plan.addresses[1], plan.addresses[2], plan.numels, step=float(low), **hyper)
            else:
                ops._adamw_launch(ext, params, grads, exp_avgs, exp_avg_sqs, step=float(low), **hyper)
        else:
            by_count: dict = {}
            for i, c in enumerate(counts.tolist()):
                by_count.setdefault(c, []).append(i)
            for count, idx in by_count.items():
                ops._adamw_launch(ext, *([lst[i] for i in idx] for lst in (params, grads, exp_avgs, exp_avg_sqs)),
                                  step=count, **hyper)
        # Counted once the updates are enqueued (a refused launch counts none).
        if buffer is not None:
            buffer.add_(1)
        else:
            torch._foreach_add_(steps, 1)

    def _whole_buffer(self, steps) -> torch.Tensor | None:
        """The buffer whose views `steps` are, all of them in its order, or None."""
        if not steps or steps[0]._base is None:
            return None
        known = self._step_buffers.get(id(steps[0]._base))
        if known is None or known[1] is not steps[0]._base or known[0] != tuple(map(id, steps)):
            return None
        return known[1]
