"""thunder_tk: Hopper tile kernels as a Lightning Thunder executor.

    import thunder
    from thunder_tk import tk
    jitted = thunder.jit(model, executors=[tk])
    ...
    print(thunder_tk.explain(jitted))
    optimizer = thunder_tk.optim.AdamW(model.parameters())  # torch's AdamW, its update on tk's kernel
"""

from __future__ import annotations

import warnings

with warnings.catch_warnings():
    # Thunder warns at import about optional executors (transformer_engine) that are not installed.
    warnings.filterwarnings("ignore", message=".*module not found.*")
    import thunder  # noqa: F401  (imported here, under the filter)

from thunder.extend import Executor

from thunder_tk import thunder_fixes  # noqa: F401  (before anything is jitted: see its docstring)
from thunder_tk.version import __version__
from thunder_tk.executor import tk, Decision
from thunder_tk import lowering as _lowering  # noqa: F401  (registers the kernel operators)
from thunder_tk.functional import attention_bwd_delta
from thunder_tk.explain import explain, Report
from thunder_tk.cuda_graphs import CUDAGraphs
from thunder_tk import optim  # noqa: F401  (thunder_tk.optim.AdamW after `import thunder_tk`)
from thunder_tk._extension import build_info, compiled_kernels, unavailable_reason

__all__ = [
    "tk",
    "executors",
    "baseline_executors",
    "explain",
    "Report",
    "Decision",
    "CUDAGraphs",
    "optim",
    "attention_bwd_delta",
    "build_info",
    "compiled_kernels",
    "unavailable_reason",
    "__version__",
]


def executors() -> list[Executor]:
    """The explicit executor list that ``executors=[tk]`` amounts to.

    tk first, then the attention executors that take what tk declines, then the fuser for everything else
    (nvFuser when Thunder can load it, else tk's torch.compile fuser, registered as "tk_torchcompile").
    """
    return [tk, *tk.attention_fallbacks(), tk.default_fuser()]


def baseline_executors() -> list[Executor]:
    """Thunder's default executors, the baseline tk is measured against (`compiler.executors: [default]`).

    Where nvFuser cannot load (our GPU hosts: no wheel for this torch), Thunder's defaults hold no general fuser
    and would leave every elementwise op unfused; the torch.compile fuser takes nvFuser's place, keeping out the
    GEMMs, attention and collectives just as nvFuser does (they stay with cuBLAS, SDPA and NCCL).
    """
    from thunder_tk.executor import is_general_fuser

    found = list(thunder.get_default_executors())
    if not any(is_general_fuser(ex) for ex in found):
        found.append(tk.private_fuser)
    return found
