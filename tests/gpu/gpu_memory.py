"""GPU memory for the tests of sizes past 2^31 elements: give the cache back, and skip a test the GPU has no room for."""

import gc

import pytest
import torch

GIB = 1 << 30


def free_cached() -> None:
    """Collects what nothing holds, drops tk's kept dQ accumulators and returns the allocator's cache to the GPU."""
    from thunder_tk import ops

    gc.collect()
    if hasattr(ops, "clear_dq_accumulators"):
        ops.clear_dq_accumulators()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()


def require_free(nbytes: int, margin: int) -> None:
    """Skips unless the GPU has `nbytes` + `margin` free once this process's cache is given back."""
    free_cached()
    free = torch.cuda.mem_get_info()[0]
    if free < nbytes + margin:
        pytest.skip(f"needs {(nbytes + margin) / GIB:.1f} GiB of free GPU memory, {free / GIB:.1f} GiB are free")
