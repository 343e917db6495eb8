"""NaN-poisoning of the CUDA caching allocator, shared by the GPU tests that check every output element is written."""

from __future__ import annotations

import torch

# Free blocks that held finite garbage and would have been the allocator's best fit for a poisoned size: kept
# allocated (NaN-filled) until the next poisoning, so that the op under test cannot be handed one of them.
_held: list[torch.Tensor] = []
TRIES = 64


def poison_allocator(*specs):
    """Leaves NaN-filled blocks of each (shape, dtype) in the CUDA caching allocator, so the op's own output
    allocations most likely land on NaN: an element the kernel never writes stays NaN. Asserts that an allocation of
    each spec does come back poisoned, so a test cannot silently lose its poisoning.

    `empty_cache` releases only wholly free segments: a free block of a segment that still holds live tensors
    (the test's inputs) keeps its finite garbage and can be the best fit for an output (seen in the fuzz tests, for
    a 42 KB output among small-pool inputs). Each such block a probe draws is NaN-filled and held until the next
    call, and the probe is drawn again, until the allocator's choice for that size is a NaN block."""
    torch.cuda.synchronize()
    _held.clear()
    torch.cuda.empty_cache()  # no stale free blocks of a fitting size that hold finite garbage, where it can
    blocks = [torch.full(shape, float("nan"), device="cuda", dtype=dtype) for shape, dtype in specs for _ in range(2)]
    del blocks
    for shape, dtype in specs:
        for _ in range(TRIES):
            probe = torch.empty(shape, device="cuda", dtype=dtype)
            if probe.numel() == 0 or torch.isnan(probe).all():
                del probe  # back to the free list: the next allocation of this size takes it
                break
            _held.append(probe.fill_(float("nan")))
        else:
            raise AssertionError(f"the caching allocator did not hand back a poisoned block for {shape} {dtype} "
                                 f"in {TRIES} tries")
