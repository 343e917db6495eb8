"""NaN-poisoning of the CUDA caching allocator, shared by the GPU tests that check every output element is written."""

from __future__ import annotations

import torch


def poison_allocator(*specs):
    """Leaves NaN-filled blocks of each (shape, dtype) in the CUDA caching allocator, so the op's own output
    allocations most likely land on NaN: an element the kernel never writes stays NaN. Asserts that an allocation of
    the first spec does come back poisoned, so a test cannot silently lose its poisoning."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # no stale free blocks of a fitting size that hold finite garbage
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for shape, dtype in specs for _ in range(2)]
    del blocks
    probe = torch.empty(specs[0][0], device="cuda", dtype=specs[0][1])
    assert torch.isnan(probe).all(), "the caching allocator did not hand back a poisoned block"
    del probe
