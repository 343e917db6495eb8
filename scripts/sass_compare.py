#!/usr/bin/env python3
"""Compare a kernel source's SASS in the working tree with its SASS at another commit: whether a refactor
changed the machine code (before the GPU run that any kernel change still gets).

    python3 scripts/sass_compare.py csrc/kernels/attention/backward.cu            # against HEAD
    python3 scripts/sass_compare.py csrc/kernels/gemm/gemm.cu --against be1b924

Both sides are compiled with csrc's flags (check_kernels.FLAGS; the commit's csrc/ from `git archive`) and
disassembled with nvdisasm (see sass_loops.py). Per kernel: `identical`, `same instructions` (only predicate
polarity differs, e.g. `@P1` where the other has `@!P1` with the compare that sets P1 negated), or how many
instructions differ. Exit status 0 when no kernel differs beyond predicate polarity.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from check_kernels import CSRC, FLAGS, find_nvcc, short
from sass_loops import kernels

ROOT = CSRC.parent
# A guard predicate and the compare-and-set instructions' conditions, written without their polarity.
_POLARITY = [(re.compile(r"@!?(U?P\d)"), r"@\1"), (re.compile(r"!(U?P\d|PT)"), r"\1"),
             (re.compile(r"\.(GT|LE)\b"), ".GTLE"), (re.compile(r"\.(LT|GE)\b"), ".LTGE"),
             (re.compile(r"\.(EQ|NE)\b"), ".EQNE"), (re.compile(r"\.(AND|OR)\b"), ".ANDOR")]


def without_polarity(instruction: str) -> str:
    for pattern, replacement in _POLARITY:
        instruction = pattern.sub(replacement, instruction)
    return instruction


# An anonymous namespace's mangled name carries a hash of the file's path: the same kernel built from another
# checkout gets another name.
_ANONYMOUS = re.compile(r"\d+_GLOBAL__N__\w+?_[0-9a-f]{8,}(?=\d)")


def sass(source: Path, csrc: Path, out: Path) -> dict[str, list[str]]:
    flags = [f"-I{csrc}" if f.startswith("-I") else f for f in FLAGS if f not in ("-Xptxas", "-v")]
    subprocess.run([find_nvcc(), *flags, "-cubin", "-o", str(out), str(source)], check=True, capture_output=True)
    return {_ANONYMOUS.sub("", name): [_ANONYMOUS.sub("", text) for _, text in instructions]
            for name, instructions, _ in kernels(out)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("source", help="a .cu file under csrc/")
    p.add_argument("--against", default="HEAD", help="commit to compare with (default HEAD)")
    a = p.parse_args()
    if find_nvcc() is None:
        sys.exit("sass_compare: no nvcc (on PATH or under $CUDA_HOME)")
    source = Path(a.source).resolve()
    if not source.is_relative_to(CSRC) or not source.is_file():
        sys.exit(f"sass_compare: {a.source} is not a source file under {CSRC}")
    relative = source.relative_to(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", a.against, "csrc"], check=True,
                                 capture_output=True).stdout
        (tmp / "csrc.tar").write_bytes(archive)
        with tarfile.open(tmp / "csrc.tar") as t:
            t.extractall(tmp / "old", filter="data")
        old = sass(tmp / "old" / relative, tmp / "old" / "csrc", tmp / "old.cubin")
        new = sass(source, CSRC, tmp / "new.cubin")
    changed = 0
    for name in sorted(set(old) | set(new)):
        if name not in old or name not in new:
            print(f"{short(name)}: only {'in the working tree' if name in new else f'at {a.against}'}")
            changed += 1
            continue
        x, y = old[name], new[name]
        if x == y:
            verdict = "identical"
        elif len(x) == len(y) and all(without_polarity(i) == without_polarity(j) for i, j in zip(x, y)):
            verdict = f"same instructions ({sum(i != j for i, j in zip(x, y))} differ in predicate polarity only)"
        else:
            differing = sum(i != j for i, j in zip(x, y)) + abs(len(x) - len(y))
            verdict = f"DIFFERENT: {len(x)} -> {len(y)} instructions, {differing} differ"
            changed += 1
        print(f"{short(name)}: {verdict}")
    return 1 if changed else 0


if __name__ == "__main__":
    sys.exit(main())
