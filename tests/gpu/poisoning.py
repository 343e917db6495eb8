"""NaN-poisoning of the CUDA caching allocator, shared by the GPU tests that check every output element is written."""

from __future__ import annotations

import torch

SMALL_REQUEST = 1 << 20  # the caching allocator serves requests up to 1 MiB from its small pool's 2 MiB segments
ROUNDS = 8


def _free_blocks() -> list[tuple[int, str]]:
    """(size, segment type) of each free block of the cached segments that serve this device's current stream."""
    device, stream = torch.cuda.current_device(), torch.cuda.current_stream().cuda_stream
    return [(b["size"], seg["segment_type"]) for seg in torch.cuda.memory_snapshot()
            if seg.get("device", device) == device and seg.get("stream", stream) == stream
            for b in seg["blocks"] if b["state"] == "inactive"]


def poison_allocator(*specs):
    """Leaves the CUDA caching allocator's free memory all NaN, with free blocks of each (shape, dtype) among it, so
    the op's own output allocations land on NaN: an element the kernel never writes stays NaN. Asserts that an
    allocation of the first spec does come back poisoned, so a test cannot silently lose its poisoning.

    `empty_cache` releases only wholly free segments; the free blocks of segments that still hold live tensors (the
    test's inputs) keep whatever they held, and one of them can be an output's best fit; so does the unused tail of
    a fresh segment, which coalesces with the poisoned block before it once freed and can lie under a larger
    output (seen for outputs just under 1 MiB). So every free block is taken (a small-pool block in pieces of at
    most 1 MiB, the most a small request asks), filled with 0xFF bytes (NaN in every floating dtype) and given
    back."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    # Blocks of the specs' sizes first: those that need a fresh segment leave its tail free, which the sweep below
    # takes too.
    held = [torch.empty(shape, device="cuda", dtype=dtype).reshape(-1).view(torch.uint8).fill_(0xFF)
            for shape, dtype in specs for _ in range(2)]
    left = None
    for _ in range(ROUNDS):
        # A large-pool block under 1 MiB serves no request of the large pool: it is never handed out.
        wanted = sorted(min(size, SMALL_REQUEST) if kind == "small" else size
                        for size, kind in _free_blocks() if kind == "small" or size > SMALL_REQUEST)
        if not wanted or (left is not None and len(wanted) >= left):  # done, or no longer shrinking
            break
        left = len(wanted)
        for nbytes in wanted:  # smallest first: each request's best fit is a block of just that size
            held.append(torch.empty(nbytes, device="cuda", dtype=torch.uint8).fill_(0xFF))
    del held
    # Where the first spec's best fit is a block the sweep could not take (a fresh segment, when the freed blocks
    # do not coalesce into one that fits: seen once in a long run of fuzz cases), the probe poisons that block
    # itself, which the next allocation of that size gets back.
    for _ in range(3):
        probe = torch.empty(specs[0][0], device="cuda", dtype=specs[0][1])
        poisoned = bool(torch.isnan(probe).all())
        if not poisoned:
            probe.reshape(-1).view(torch.uint8).fill_(0xFF)
        del probe
        if poisoned:
            return
    raise AssertionError("the caching allocator did not hand back a poisoned block")
