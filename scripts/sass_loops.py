#!/usr/bin/env python3
"""Count a kernel's SASS instructions per loop: how many one step of a consumer's main loop issues.

    python3 scripts/sass_loops.py csrc/kernels/attention/backward.cu            # compile, list each kernel's loops
    python3 scripts/sass_loops.py x.cubin --kernel 1 --loop 0x11d0:0x3dc0      # opcode histogram of one range

A loop is a backward branch: its body runs from the branch target to the branch. Only loops that issue wgmma
(HGMMA) are listed, largest first, as (instructions, HGMMAs, start, end). A branch inside a loop (a masked and an
unmasked copy, say) counts both sides; take the side not run off by hand (--loop on each part).
Needs nvcc (for a .cu) and nvdisasm: $NVDISASM, on PATH, or PyPI's nvidia-cuda-nvdisasm
(`pip download --no-deps nvidia-cuda-nvdisasm`, unzip; the binary is nvidia/cu13/bin/nvdisasm).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

from check_kernels import FLAGS, find_nvcc, short  # csrc's compile flags, nvcc, readable kernel names

INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);")
LABEL = re.compile(r"\.(L_x_\d+):\s*\n\s*/\*([0-9a-f]+)\*/")


def nvdisasm() -> str:
    found = os.environ.get("NVDISASM") or shutil.which("nvdisasm")
    if not found:
        sys.exit("sass_loops: no nvdisasm (set NVDISASM; see the docstring for PyPI's nvidia-cuda-nvdisasm)")
    return found


def kernels(cubin: Path) -> list[tuple[str, list[tuple[int, str]], dict[str, int]]]:
    """(name, [(address, instruction)], {label: address}) per kernel."""
    text = subprocess.run([nvdisasm(), "-c", str(cubin)], check=True, capture_output=True, text=True).stdout
    parts = re.split(r"\n\s*\.text\.(\S+):", text)
    return [(parts[i], [(int(a, 16), t.strip()) for a, t in INSTRUCTION.findall(parts[i + 1])],
             {name: int(a, 16) for name, a in LABEL.findall(parts[i + 1])}) for i in range(1, len(parts), 2)]


def loops(instructions, labels) -> list[tuple[int, int, int, int]]:
    found = set()
    for address, text in instructions:
        m = re.search(r"BRA.*`\(\.(L_x_\d+)\)", text)
        if m and labels.get(m.group(1), address) < address:
            body = [t for a, t in instructions if labels[m.group(1)] <= a <= address]
            hgmma = sum("HGMMA" in t for t in body)
            if hgmma:
                found.add((len(body), hgmma, labels[m.group(1)], address))
    return sorted(found, reverse=True)


def opcode(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a .cu file (compiled with csrc's flags) or a .cubin")
    p.add_argument("--kernel", type=int, help="index of the kernel (as listed) for --loop")
    p.add_argument("--loop", help="START:END addresses (hex) of a range to histogram")
    p.add_argument("--top", type=int, default=4, help="loops listed per kernel")
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(args.source)
        if cubin.suffix == ".cu":
            cubin = Path(tmp) / "k.cubin"
            nvcc = find_nvcc()
            if nvcc is None:
                sys.exit("sass_loops: no nvcc (on PATH or under $CUDA_HOME)")
            # check_kernels' flags ask ptxas for its report (-v): kept out of the listing.
            subprocess.run([nvcc, *FLAGS, "-cubin", "-o", str(cubin), args.source], check=True, capture_output=True)
        found = kernels(cubin)
    if args.loop is not None:
        name, instructions, _ = found[args.kernel or 0]
        lo, hi = (int(x, 16) for x in args.loop.split(":"))
        counts = Counter(opcode(t) for a, t in instructions if lo <= a <= hi)
        print(f"{short(name)}\n{sum(counts.values())} instructions: " +
              ", ".join(f"{op} {n}" for op, n in counts.most_common()))
        return
    for index, (name, instructions, labels) in enumerate(found):
        shown = ", ".join(f"({n}, {h}, {lo:#x}:{hi:#x})" for n, h, lo, hi in loops(instructions, labels)[:args.top])
        print(f"[{index}] {short(name)}: {len(instructions)} instructions; loops {shown}")


if __name__ == "__main__":
    main()
