"""Fixes for bugs in the installed Lightning Thunder that tk's users would otherwise hit, each applied at import
only where the installed Thunder shows the bug (checked by behaviour, not by version).

`no_autocast` (thunder.executors.torchex, 0.2.6): the decorator Thunder puts on every execution trace and every
torch.compile region turns autocast off for the call, then restores the autocast state it read when it *decorated*
the function, not the state at the call. Under `torch.autocast` (bf16-mixed training) Thunder compiles inside the
user's context, so each such wrapper re-enables autocast when it returns, wherever it runs. In the backward, which
the autograd engine runs on its own thread with that thread's autocast settings (dtype float16 by default), a
region returning turns autocast on for the rest of the backward: the next op that is not in a fused region (a
cuBLAS GEMM that tk declines, Thunder's SDPA backward) then runs in float16 on bf16 tensors. Thunder's default
executors with a torch.compile fuser failed at bf16-mixed that way ("query and dout must have the same dtype", its
SDPA backward given a float16 gradient), as did tk where it declines an attention. The replacement restores the state
it found at each call.
"""

from __future__ import annotations

import functools

import torch

_DEVICES = ("cpu", "cuda")


def no_autocast(fn):
    """`fn` run with CPU and CUDA autocast off, each restored afterwards to what it was at this call."""

    @functools.wraps(fn)
    def no_autocast_fn(*args, **kwargs):
        was = [torch.is_autocast_enabled(d) for d in _DEVICES]
        for d in _DEVICES:
            torch.set_autocast_enabled(d, False)
        try:
            return fn(*args, **kwargs)
        finally:
            for d, on in zip(_DEVICES, was):
                torch.set_autocast_enabled(d, on)

    return no_autocast_fn


def restores_autocast_at_call(decorator) -> bool:
    """Whether `decorator` (a no_autocast) leaves autocast as the call found it, where the function was decorated
    with autocast on and is called with it off. Checked on the CPU's autocast flag (no GPU needed)."""
    before = torch.is_autocast_enabled("cpu")
    try:
        torch.set_autocast_enabled("cpu", True)
        wrapped = decorator(lambda: torch.is_autocast_enabled("cpu"))
        torch.set_autocast_enabled("cpu", False)
        off_inside = not wrapped()
        return off_inside and not torch.is_autocast_enabled("cpu")
    finally:
        torch.set_autocast_enabled("cpu", before)


REPLACED: dict = {}
"""What each applied fix replaced: name -> Thunder's own object (for tests)."""


def apply() -> list[str]:
    """Applies each fix the installed Thunder needs; returns the names of those applied."""
    from thunder.executors import torchex

    applied = []
    if torchex.no_autocast is not no_autocast and not restores_autocast_at_call(torchex.no_autocast):
        REPLACED["no_autocast"] = torchex.no_autocast
        # Thunder imports it at call time (make_compiled, and the import line of every generated trace), so the
        # module attribute is what every trace compiled from now on uses.
        torchex.no_autocast = no_autocast
        applied.append("no_autocast")
    return applied


APPLIED = apply()
