"""What the seeded fuzz tests share (tests/test_claim_fuzz_cpu.py, tests/gpu/test_fuzz.py)."""

from __future__ import annotations

import random


def pick(rng: random.Random, options: list[tuple[float, object]]):
    """One value of `options`, (weight, value) pairs, drawn by weight."""
    x = rng.random() * sum(w for w, _ in options)
    for w, value in options:
        x -= w
        if x < 0:
            return value
    return options[-1][1]
