"""Loading the compiled kernels and describing the GPU they would run on.

Everything here is cheap metadata: the executor's claim rules call it while Thunder builds traces, so it
must never launch work on the GPU or synchronise.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import os
from functools import lru_cache
from pathlib import Path

import torch

SUPPORTED_CAPABILITY = (9, 0)
"""Our kernels use sm_90a instructions (wgmma, TMA, setmaxnreg): Hopper only."""


@lru_cache(maxsize=1)
def build_info() -> dict:
    """What the install recorded: whether the kernels were compiled and, if not, why."""
    path = Path(__file__).with_name("_build_info.json")
    if not path.exists():
        return {"kernels_built": False, "reason": _no_build_reason(Path(__file__).parent)}
    return json.loads(path.read_text())


def _no_build_reason(package_dir: Path) -> str:
    # Python imports a package from the current directory before the installed one: in a source checkout that
    # shadows the installed build, which is what users (and our GPU script once) ran into.
    if (package_dir.parent / "pyproject.toml").exists() and (package_dir.parent / "csrc").is_dir():
        return (f"thunder_tk was imported from its source tree ({package_dir}), which holds no compiled kernels; "
                "run from another directory to use the installed package, or install it with `pip install .`")
    return "thunder_tk was not installed with its build step (no _build_info.json)"


@lru_cache(maxsize=1)
def _load() -> tuple[object | None, str]:
    info = build_info()
    if not info.get("kernels_built"):
        return None, f"kernels not built: {info.get('reason') or 'unknown reason'}"
    try:
        from thunder_tk import _C  # type: ignore[attr-defined]
    except ImportError as e:  # built, but the module will not load here
        return None, f"kernels not built: the compiled module failed to load ({e})"
    _C.set_dependent_launch(dependent_launch_from_environment())
    return _C, ""


DEPENDENT_LAUNCH_ENV = "THUNDER_TK_DEPENDENT_LAUNCH"
"""0 (or off, false, no): tk's kernels launch in plain stream order instead of programmatically dependent on the
kernel before them. Read when the kernels load; `thunder_tk.ops.set_dependent_launch` changes it later."""


def dependent_launch_from_environment() -> bool:
    value = os.environ.get(DEPENDENT_LAUNCH_ENV, "").strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"{DEPENDENT_LAUNCH_ENV}={value!r}: expected 1/on/true/yes or 0/off/false/no")


def extension():
    """The compiled module, or None. `unavailable_reason()` says why it is None."""
    return _load()[0]


def unavailable_reason() -> str:
    return _load()[1]


def compiled_kernels() -> frozenset[str]:
    ext = extension()
    return frozenset(ext.kernels()) if ext is not None else frozenset()


# While planning on a machine without a GPU (``thunder-tk explain``), CUDA proxies stand for a GPU that is
# not there; this holds the compute capability the plan assumes for them.
_planned_capability: contextvars.ContextVar[tuple[int, int] | None] = contextvars.ContextVar(
    "thunder_tk_planned_capability", default=None
)


@contextlib.contextmanager
def planning_for(capability: tuple[int, int] = SUPPORTED_CAPABILITY):
    """Within this block, claim rules judge CUDA devices as if they had `capability` and the kernels were built."""
    token = _planned_capability.set(tuple(capability))
    try:
        yield
    finally:
        _planned_capability.reset(token)


def planning() -> bool:
    return _planned_capability.get() is not None


@lru_cache(maxsize=None)
def _real_capability(index: int) -> tuple[int, int] | None:
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return tuple(torch.cuda.get_device_capability(index))


def device_capability(index: int | None) -> tuple[int, int] | None:
    """Compute capability of cuda:`index` (None: no such GPU). Cached; reads device properties once."""
    planned = _planned_capability.get()
    if planned is not None:
        return planned
    return _real_capability(0 if index is None else index)


PLANNED_MULTIPROCESSORS = 132
"""SMs of the GPU a plan without one assumes: the H100 SXM and the H200 have 132."""


@lru_cache(maxsize=None)
def _real_multiprocessors(index: int) -> int | None:
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        return None
    return torch.cuda.get_device_properties(index).multi_processor_count


def multiprocessor_count(index: int | None) -> int:
    """SMs of cuda:`index` (while planning, or with no such GPU: PLANNED_MULTIPROCESSORS). Cached."""
    if planning():
        return PLANNED_MULTIPROCESSORS
    return _real_multiprocessors(0 if index is None else index) or PLANNED_MULTIPROCESSORS


def kernels_usable_reason() -> str:
    """Empty when kernels can run (or are assumed to, while planning); otherwise why not."""
    if planning():
        return ""
    return unavailable_reason()


def kernel_in_build(name: str) -> bool:
    return planning_kernels_override(name) if planning() else name in compiled_kernels()


def planning_kernels_override(name: str) -> bool:
    # A plan describes this version of thunder_tk as built for the GPU: the kernels its source provides.
    from thunder_tk.claim_rules import KERNELS_IN_SOURCE

    return name in KERNELS_IN_SOURCE
