#!/usr/bin/env python3
"""Check ptxas's report of every kernel source for what a GPU run would only show as lost speed.

    python3 scripts/check_kernels.py            # all of csrc/kernels, compiled here, 2 compiles at a time
    python3 scripts/check_kernels.py attention  # sources whose path contains "attention"
    python3 scripts/check_kernels.py --report DIR  # no compile: the build's report, from a build (pip install,
                                                   # cmake) configured with THUNDER_TK_KERNEL_REPORT=DIR

Fails (exit 1) when ptxas
- serialises wgmma ("Potential Performance Loss: wgmma.mma_async instructions are serialized", C7512, C7514,
  C7520, ...) or injects a wait for wgmma results (C7517), printed with or without -v: every product of that
  kernel then waits for the one before it (or one place waits for all of them), which no test notices;
- spills more than a source's budget (SPILL_BUDGET, bytes of spill loads per kernel; 0 unless listed);
- has a kernel that never waits for the grid before it (`griddepcontrol.wait`, `pdl::wait_prior_grid`), outside
  the sources launched in plain stream order (PLAIN_ORDER): tk launches its kernels programmatically dependent
  (csrc/kittens/launch.h), and such a kernel would read its inputs before the kernel that writes them is done.
Compiling, it needs nvcc only (no GPU, no libcuda) and uses the same flags as csrc/CMakeLists.txt. With --report
it reads, per source, DIR/<path under csrc>/compile.log (the compile's stdout, then its stderr, with -Xptxas=-v),
status (its exit status) and *.ptx, which csrc/CMakeLists.txt's launcher leaves; a source without them is a
problem. CI builds with the report and runs this on it, so that every kernel is compiled once.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
FLAGS = ["-std=c++17", "-O3", f"-I{CSRC}", "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr",
         "-Xptxas", "-v"]
# Bytes of spill loads a kernel of the source may have, and why.
SPILL_BUDGET = {
    # Only the tuning variant with 4 rows per lane group at 8-element vectors (the default is 1: no spills).
    "kernels/attention/bwd_delta.cu": 28,
}

# Sources whose kernels are launched in plain stream order (no programmatic dependence), with the reason.
PLAIN_ORDER = {
    "kernels/collectives/": "the collectives' kernels wait on peers' flags and copy engines, in stream order",
    "kernels/selftest/": "the tile library's unit kernels, launched one at a time by the tests",
}

# Sources whose wgmma serialisation is known, with the reason; the check reports it without failing.
KNOWN_SERIALISED: dict[str, str] = {}

ENTRY = re.compile(r"Compiling entry function '(\S+)'")
SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
REGS = re.compile(r"Used (\d+) registers")
PTX_ENTRY = re.compile(r"^\s*(?:\.(?:visible|weak)\s+)?\.entry\s+([^\s(]+)\s*\(", re.M)


def entries_without_wait(ptx: str) -> list[str]:
    """The .entry functions of a PTX file whose bodies have no griddepcontrol.wait."""
    starts = [(m.start(), m.group(1)) for m in PTX_ENTRY.finditer(ptx)]
    bodies = [(name, ptx[at:(starts[i + 1][0] if i + 1 < len(starts) else len(ptx))])
              for i, (at, name) in enumerate(starts)]
    return [name for name, body in bodies if "griddepcontrol.wait" not in body]


def find_nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "/usr/local/cuda"
    candidate = Path(home) / "bin" / "nvcc"
    return str(candidate) if candidate.exists() else None


def short(name: str) -> str:
    """A mangled kernel name cut to its readable core (e.g. backward_kernelI13__nv_bfloat16Li128E)."""
    m = re.search(r"([A-Za-z_]+_kernel[A-Za-z0-9_]*?E)E", name) or re.search(r"([A-Za-z_]+_kernel\w{0,40})", name)
    return m.group(1) if m else name[:60]


def kept_ptx(folder: Path) -> str:
    """The PTX files that nvcc's -keep left in a folder, one after the other."""
    return "".join(f.read_text() for f in sorted(folder.glob("*.ptx")))


def check(nvcc: str, source: Path) -> tuple[list[str], list[str]]:
    """(report lines, problems) for one source, compiled here."""
    rel = source.relative_to(CSRC).as_posix()
    with tempfile.TemporaryDirectory() as tmp:
        # -keep leaves the PTX of this one compile beside the object, for the dependent-launch check
        r = subprocess.run([nvcc, *FLAGS, "-keep", "-keep-dir", tmp, "-c", str(source), "-o", str(Path(tmp) / "k.o")],
                           capture_output=True, text=True)
        ptx = kept_ptx(Path(tmp))
    return parse(rel, r.returncode, r.stdout + r.stderr, ptx)


def from_report(report: Path, rel: str) -> tuple[list[str], list[str]]:
    """(report lines, problems) for one source (path under csrc), from what the build's launcher left in report."""
    at = report / rel
    try:
        returncode = int((at / "status").read_text())
        out = (at / "compile.log").read_text()
    except (OSError, ValueError):
        return [f"{rel}: no report"], [f"{rel}: no report in {report} (status, compile.log): was the build "
                                       f"configured with THUNDER_TK_KERNEL_REPORT={report}?"]
    return parse(rel, returncode, out, kept_ptx(at))


def parse(rel: str, returncode: int, out: str, ptx: str) -> tuple[list[str], list[str]]:
    """(report lines, problems) for one source (path under csrc) from its compile's exit status, output (stdout, then
    stderr, with ptxas's -v report) and kept PTX."""
    if returncode != 0:
        return [f"{rel}: compile failed"], [f"{rel} does not compile:\n{out[-3000:]}"]
    lines, problems = [], []
    if not any(rel.startswith(prefix) for prefix in PLAIN_ORDER):
        if not ptx:
            problems.append(f"{rel}: no PTX kept, so no check that its kernels wait for the grid before them")
        for name in entries_without_wait(ptx):
            problems.append(f"{rel}: {short(name)} never waits for the grid before it (pdl::wait_prior_grid), "
                            "but tk launches it programmatically dependent")
    entry = None
    budget = SPILL_BUDGET.get(rel, 0)
    for line in out.splitlines():
        if m := ENTRY.search(line):
            entry = short(m.group(1))
        elif re.search(r"\(C75\d\d\)", line):  # ptxas's wgmma notes: serialised products, injected waits
            named = re.search(r"function '(\S+)'", line)  # printed before the function's report
            code = re.search(r"\((C\d+)\)", line)
            why = re.split(r" in (?:the )?function| for the function", line.split("due to", 1)[-1].split(") ", 1)[-1])[0]
            why = why.strip()
            note = (f"{rel}: {short(named.group(1)) if named else '?'}: ptxas serialises its wgmma "
                    f"({code.group(1) if code else '?'}: {why})")
            if rel in KNOWN_SERIALISED:
                lines.append(f"{note}: known, {KNOWN_SERIALISED[rel]}")
            else:
                problems.append(note)
        elif (m := SPILL.search(line)) and entry:
            loads = int(m.group(2))
            if loads > budget:
                problems.append(f"{rel}: {entry}: {loads} bytes of spill loads (budget {budget})")
            lines.append(f"{rel}: {entry}: spill loads {loads} B")
        elif (m := REGS.search(line)) and entry:
            lines[-1:] = [f"{lines[-1]}, {m.group(1)} registers"] if lines else []
    return lines, problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("filter", nargs="?", default="", help="only sources whose path contains this")
    p.add_argument("-j", "--jobs", type=int, default=2)
    p.add_argument("--report", type=Path, metavar="DIR",
                   help="read the build's report (THUNDER_TK_KERNEL_REPORT=DIR at configure time), compile nothing")
    a = p.parse_args(argv)
    sources = sorted(s for s in (CSRC / "kernels").rglob("*.cu") if a.filter in s.as_posix())
    if a.report is not None:
        results = [from_report(a.report, s.relative_to(CSRC).as_posix()) for s in sources]
    else:
        nvcc = find_nvcc()
        if nvcc is None:
            print("check_kernels: no nvcc found (PATH, CUDA_HOME, /usr/local/cuda)", file=sys.stderr)
            return 2
        with ThreadPoolExecutor(max(1, a.jobs)) as pool:
            results = list(pool.map(lambda s: check(nvcc, s), sources))
    problems = [x for _, ps in results for x in ps]
    for lines, _ in results:
        for line in lines:
            print(line)
    for x in problems:
        print("PROBLEM:", x, file=sys.stderr)
    print(f"check_kernels: {len(sources)} sources, {len(problems)} problems")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
