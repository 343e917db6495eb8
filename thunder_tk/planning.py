"""Routing plans without a GPU: trace a model with CUDA-device proxies and report what would run where.

The model lives on the `meta` device (nothing is allocated); each parameter, buffer and input is marked
with Thunder's `_thunder_device`, so the proxies in every trace say `cuda:N`. Thunder then builds the
forward and backward execution traces as it would on the GPU. Nothing is executed.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import thunder
import torch

from thunder_tk import _extension
from thunder_tk.explain import Report, build_report
from thunder_tk.executor import tk

PLAN_NOTE = (
    "Planned without a GPU for an sm_90 device with every kernel of this version built. "
    "Attention that tk declines goes to Thunder's cuDNN/SDPA executors at run time; their own checks need the "
    "GPU, so here it shows as fused math."
)


def _mark(t: torch.Tensor, device: torch.device) -> None:
    if t.device.type != "meta":
        raise ValueError(f"planning needs meta tensors (nothing allocated); got a tensor on {t.device}")
    t._thunder_device = device


@contextlib.contextmanager
def cuda_autocast(dtype: torch.dtype | None):
    """CUDA autocast to `dtype` (None: unchanged), also where no GPU is present: `torch.autocast("cuda")` turns
    itself off there, while Thunder only reads whether autocast is on and to what dtype."""
    if dtype is None:
        yield
        return
    was_enabled, was_dtype = torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda")
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", dtype)
    try:
        yield
    finally:
        torch.set_autocast_enabled("cuda", was_enabled)
        torch.set_autocast_dtype("cuda", was_dtype)


def trace_planned(
    module: torch.nn.Module,
    inputs: Sequence[torch.Tensor],
    *,
    executors: Sequence | None = None,
    device: str | torch.device = "cuda:0",
    capability: tuple[int, int] = _extension.SUPPORTED_CAPABILITY,
    autocast: torch.dtype | None = None,
    transforms: Sequence = (),
):
    """Trace `module(*inputs)` (meta tensors) as if on `device`; returns the jitted module, whose
    `thunder.last_traces` / `last_backward_traces` hold the planned execution traces.

    The backward trace is planned too when any parameter requires grad. `autocast`: a dtype to trace under CUDA
    autocast to (mixed precision: fp32 parameters, Thunder casting the inputs of linears and attention).
    `transforms`: Thunder transforms for `thunder.jit` (e.g. thunder_tk.CUDAGraphs: the graphs the step would be).
    """
    device = torch.device(device)
    if device.type != "cuda":
        raise ValueError(f"plans are for CUDA devices, not {device}")
    for t in (*module.parameters(), *module.buffers(), *inputs):
        _mark(t, device)
    jitted = thunder.jit(module, executors=list(executors) if executors is not None else [tk],
                         transforms=list(transforms))
    cd, cs = thunder.compile_data(jitted), thunder.compile_stats(jitted)
    with _extension.planning_for(capability), cuda_autocast(autocast):
        try:
            cd.get_computation_and_inputs(*inputs)
        except AssertionError:
            # The traces are complete; only the prologue failed, comparing meta tensors with cuda proxies.
            if not cs.last_traces:
                raise
    return jitted


def plan(module: torch.nn.Module, inputs: Sequence[torch.Tensor], **options) -> Report:
    """`trace_planned` (same arguments), reported: what would run where, and why tk declined."""
    jitted = trace_planned(module, inputs, **options)
    return build_report(thunder.compile_data(jitted), thunder.compile_stats(jitted), planned=True, note=PLAN_NOTE)
